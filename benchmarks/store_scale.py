"""Store scaling: what a training step, the records export and the proxy cost as the recorded work grows.

Launch (one command, prints a table of small vs large with ratios)::

    python benchmarks/store_scale.py --cache-dir /work/cache/store_scale   # 10k vs 1M recorded calls
    python benchmarks/store_scale.py --quick                                # 1k vs 10k calls, 10 vs 1,000 attempts

What runs:

1. **Fill.** Two real ``SQLiteStore`` files hold a finished history of ``--small`` and ``--large`` calls: groups of
   8 rollouts, one succeeded attempt each, 4 calls per attempt, one reward per attempt, every group consumed by a
   past step (what a long training run leaves behind). Rows are written with the store's own schema and row codec
   (``_sqlite_rows.call_to_row``) in bulk transactions (the store's API would take ~40x longer for 1M calls).
   Calls are realistic in size: the prompt grows over the 4 turns (320, 480, 640, 800 token ids: each turn adds the
   96-token completion and a 64-token tool result), 96 completion ids with 96 float64 logprobs, and the request/
   response JSON carries about 3 bytes of text per token (~5.6 KB per call in all). Every attempt has the same token
   ids (a store does not look at them). A filled file is kept in ``--cache-dir`` and reused (its fill time is
   printed when it is made; the fixed code migrates an older file on open).
2. **Training step** (what ``app/loop.py`` does each step, through the store's API): on each file, 5 steps of
   32 finished groups (8 rollouts x 4 calls, recorded through the API) with 16 more groups queued or running; per step
   ``finished_groups(limit=192)``, ``build_records`` of the 32 groups, ``consume_groups``, ``counts()`` and
   ``expire_leases()`` (these two read-only ones 9 times per step); the median per operation.
3. **Export.** ``lightning-sdk records --store FILE --out /dev/null --quiet`` as a subprocess (every succeeded
   attempt becomes a JSONL row; the rows are written to /dev/null so the disk is not measured): wall time and peak
   RSS (``wait4``'s ``ru_maxrss``). It runs under an address-space cap (``--export-cap-gb``, default 8) so that an
   export that loads the whole store fails with ``MemoryError`` instead of pushing the machine out of memory.
4. **Proxy.** The real proxy (``create_app`` + ``serve``, a ``PassthroughBackend``) in its own process over a store
   with ``--few`` vs ``--many`` running attempts, a scripted loopback upstream (``tests/support/mock_openai.py``),
   non-stream chat completions at concurrency 16 spread round-robin over every attempt's token (a warm-up pass first
   sends one request per attempt). Reported: the proxy process's CPU (user + system, /proc) per request.

Targets (issue 14): every ratio large/small about 1 for the step and the proxy (O(batch), not O(store)), and an
export whose peak RSS does not grow with the store.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from proxy_overhead import cpu_seconds, free_port, wait_ready  # noqa: E402

from lightning_sdk.records import build_records  # noqa: E402
from lightning_sdk.store import SQLiteStore  # noqa: E402
from lightning_sdk.store import _sqlite_rows as rows  # noqa: E402
from lightning_sdk.types import Call  # noqa: E402

FILL_VERSION = 1  # bump when the filled content changes (cache file names carry it)
N_PER_GROUP = 8
CALLS_PER_ATTEMPT = 4
TASKS_PER_STEP = 32
IN_FLIGHT_GROUPS = 16
STEPS = 5
ADMIN_KEY = "bench-admin-key"
SYSTEM_TOKENS, COMPLETION_TOKENS, TOOL_TOKENS = 320, 96, 64


# ---- realistic calls ------------------------------------------------------------------------------------------------
def turn_ids() -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, completion ids, logprobs) of the 4 turns of an attempt; each prompt extends the previous turn."""
    out = []
    prompt = [1000 + (i * 7919) % 30000 for i in range(SYSTEM_TOKENS)]
    for k in range(CALLS_PER_ATTEMPT):
        completion = [2000 + (k * 131 + i * 17) % 20000 for i in range(COMPLETION_TOKENS)]
        logprobs = [-0.01 - ((k * 31 + i) % 97) / 50.0 for i in range(COMPLETION_TOKENS)]
        out.append((list(prompt), completion, logprobs))
        prompt = prompt + completion + [3000 + (k * 13 + i) % 5000 for i in range(TOOL_TOKENS)]
    return out


def _text(n_tokens: int, seed: int) -> str:
    words = ("the", "value", "of", "x", "is", "tool", "result", "compute", "step", "answer")
    return " ".join(words[(seed + i) % len(words)] for i in range(n_tokens * 3 // 4))[: n_tokens * 3]


def make_call(call_id: str, attempt_id: str, rollout_id: str, k: int, turns: list[tuple[list[int], ...]]) -> Call:
    prompt, completion, logprobs = turns[k]
    messages = [{"role": "system", "content": _text(SYSTEM_TOKENS, 0)}]
    for j in range(k):
        messages.append({"role": "assistant", "content": _text(COMPLETION_TOKENS, j)})
        messages.append({"role": "tool", "content": _text(TOOL_TOKENS, j + 1), "tool_call_id": f"t{j}"})
    reply = _text(COMPLETION_TOKENS, k)
    return Call(
        call_id=call_id,
        attempt_id=attempt_id,
        rollout_id=rollout_id,
        seq=k,
        model="policy",
        request={"model": "policy", "messages": messages, "max_tokens": 256, "temperature": 1.0},
        response={
            "id": f"chatcmpl-{call_id}",
            "object": "chat.completion",
            "model": "policy",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)},
        },
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        logprobs=list(logprobs),
        policy_version=1,
        finish_reason="stop",
        usage={"prompt_tokens": len(prompt), "completion_tokens": len(completion)},
        started_at=1.0e9 + k,
        ended_at=1.0e9 + k + 0.5,
    )


# ---- fill -----------------------------------------------------------------------------------------------------------
def insert_groups(conn: sqlite3.Connection, prefix: str, n_groups: int, consumed: bool) -> None:
    """``n_groups`` finished groups (8 succeeded rollouts x 4 calls, a reward each) in bulk transactions, with the
    store's schema and row codec; ``consumed``: as a past training step left them (else ready for the next one)."""
    turns = turn_ids()
    # Template rows: the codec's own bytes; the ids in each body are replaced per call.
    templates = [rows.call_to_row(make_call("C" * 12, "A" * 12, "R" * 12, k, turns)) for k in range(CALLS_PER_ATTEMPT)]
    task = orjson.dumps({"question": "What is 17 * 23 + 4?", "answer": "395"}).decode()
    ts = 1.0e9
    batch = 250  # groups per transaction
    for g0 in range(0, n_groups, batch):
        groups, rolls, atts, calls, rews = [], [], [], [], []
        for g in range(g0, min(n_groups, g0 + batch)):
            gid = f"{prefix}-{g:07d}"
            groups.append((gid, task, N_PER_GROUP, "train", ts, 1 + g // TASKS_PER_STEP if consumed else None))
            for i in range(N_PER_GROUP):
                rid, aid = f"{gid}-r{i}", f"{gid}-a{i}"
                rolls.append((rid, gid, None, "train", "succeeded", 1, 1, ts, ts))
                atts.append((aid, rid, 0, f"tok-{aid}", "succeeded", "w0", None, None, ts, ts))
                for k, tpl in enumerate(templates):
                    cid = f"{aid}-c{k}"
                    body = tpl[8].replace("C" * 12, cid).replace("A" * 12, aid).replace("R" * 12, rid)
                    calls.append((cid, aid, rid, k, tpl[4], tpl[5], tpl[6], tpl[7], body))
                rews.append((aid, "reward", "", rid, float((g + i) % 2), ts))
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO groups (group_id, task, n, split, created_at, consumed_step) VALUES (?, ?, ?, ?, ?, ?)", groups
        )
        conn.executemany(
            "INSERT INTO rollouts (rollout_id, group_id, task, split, status, max_attempts, attempts_used, "
            "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rolls,
        )
        conn.executemany(f"INSERT INTO attempts ({rows.ATTEMPT_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", atts)
        conn.executemany(
            "INSERT INTO calls (call_id, attempt_id, rollout_id, seq, started_at, prompt_ids, completion_ids, "
            "logprobs, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            calls,
        )
        conn.executemany(
            "INSERT INTO rewards (attempt_id, name, call_id, rollout_id, value, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            rews,
        )
        conn.execute("COMMIT")


def fill(path: Path, n_calls: int) -> float:
    """A finished, consumed history of ``n_calls`` calls in a new store file; returns the seconds it took."""
    t0 = time.perf_counter()
    tmp = path.with_suffix(".filling")
    for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
        p.unlink(missing_ok=True)

    async def create() -> None:
        await SQLiteStore(tmp).close()  # the schema, as the store makes it

    asyncio.run(create())
    conn = rows.connect(str(tmp), synchronous="OFF", busy_timeout_s=10, readonly=False)
    insert_groups(conn, "hist", max(1, n_calls // (CALLS_PER_ATTEMPT * N_PER_GROUP)), consumed=True)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    tmp.rename(path)
    return time.perf_counter() - t0


def store_file(cache: Path, n_calls: int) -> tuple[Path, float | None]:
    """The cached history file of ``n_calls`` calls (filled now if missing) and its fill time if filled now."""
    path = cache / f"history-{n_calls}calls-v{FILL_VERSION}.db"
    if path.exists():
        return path, None
    cache.mkdir(parents=True, exist_ok=True)
    return path, fill(path, n_calls)


# ---- training step --------------------------------------------------------------------------------------------------
async def measure_step(path: Path) -> dict[str, float]:
    """Median seconds per operation over ``STEPS`` training steps on the store at ``path``."""
    tag = f"{os.getpid()}-{int(time.time())}"
    n_ready = (STEPS + 6) * TASKS_PER_STEP  # every step's finished_groups finds a full 192 groups ready
    conn = rows.connect(str(path), synchronous="NORMAL", busy_timeout_s=10, readonly=False)
    insert_groups(conn, f"live-{tag}", n_ready, consumed=False)  # as finished rollouts leave them
    conn.close()
    store = SQLiteStore(path)
    task = {"question": "What is 17 * 23 + 4?", "answer": "395"}
    flying = [f"fly-{tag}-{g}" for g in range(IN_FLIGHT_GROUPS)]
    times: dict[str, list[float]] = {"finished_groups": [], "build_records": [], "consume_groups": []}
    times.update({"counts": [], "expire_leases": []})
    base_step = int(time.time())  # past the history's steps
    try:
        await store.enqueue([task] * len(flying), n=N_PER_GROUP, group_ids=flying)
        for _ in range(IN_FLIGHT_GROUPS * N_PER_GROUP // 2):  # half of them running, half queued
            assert await store.claim(f"bench-{tag}", lease_s=3600, split="train") is not None
        for s in range(STEPS):
            t0 = time.perf_counter()
            finished = await store.finished_groups(limit=4 * TASKS_PER_STEP + 64, split="train")
            t1 = time.perf_counter()
            fresh = finished[:TASKS_PER_STEP]
            built = build_records(fresh)
            t2 = time.perf_counter()
            await store.consume_groups(base_step + s, [g.group.group_id for g in fresh])
            t3 = time.perf_counter()
            counts_s = await _median_of(store.counts)  # read-only and ~1 ms: the median of 9 per step
            expire_s = await _median_of(store.expire_leases)
            assert len(fresh) == TASKS_PER_STEP and len(built.records) == TASKS_PER_STEP * N_PER_GROUP
            assert len(finished) == 4 * TASKS_PER_STEP + 64
            assert all(g.group.group_id.startswith(f"live-{tag}") for g in fresh)
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, counts_s, expire_s), strict=True):
                times[name].append(dt)
    finally:
        await store.close()
        _delete_live(path, tag)
    return {name: statistics.median(v) for name, v in times.items()}


async def _median_of(op: Callable[[], Awaitable[object]], n: int = 9) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _delete_live(path: Path, tag: str) -> None:
    """Leave the cached history as it was: remove this run's groups and everything in them (raw SQL; the schema's
    triggers keep the counts right)."""
    conn = rows.connect(str(path), synchronous="NORMAL", busy_timeout_s=10, readonly=False)
    live = "SELECT rollout_id FROM rollouts WHERE group_id LIKE ? OR group_id LIKE ?"
    args = (f"live-{tag}-%", f"fly-{tag}-%")
    conn.execute("BEGIN")
    for table in ("calls", "rewards", "attempts"):
        conn.execute(f"DELETE FROM {table} WHERE rollout_id IN ({live})", args)
    conn.execute("DELETE FROM rollouts WHERE group_id LIKE ? OR group_id LIKE ?", args)
    conn.execute("DELETE FROM groups WHERE group_id LIKE ? OR group_id LIKE ?", args)
    conn.execute("COMMIT")
    conn.close()


# ---- export ---------------------------------------------------------------------------------------------------------
def measure_export(path: Path, cap_gb: float) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB, outcome) of ``lightning-sdk records`` over ``path``."""
    cap = int(cap_gb * 2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "lightning_sdk", "records", "--store", str(path), "--out", "/dev/null", "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=limit)
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(ln.decode(errors="replace") for ln in proc.stdout))
    reader.start()
    while True:  # an export past the cap raises MemoryError and may then hang: stop it there
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if any("MemoryError" in ln for ln in lines):
            proc.kill()
        time.sleep(0.2)
    reader.join()
    output = "".join(lines)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    rss_mb = usage.ru_maxrss / 1024
    if proc.returncode == 0:
        last = [ln for ln in output.splitlines() if ln.startswith("wrote ")]
        return wall, rss_mb, last[-1] if last else "ok"
    tail = "MemoryError" if "MemoryError" in output else output.strip().splitlines()[-1:] or ["?"]
    return wall, rss_mb, f"FAILED (rc {proc.returncode}): {tail if isinstance(tail, str) else tail[0]}"


# ---- proxy ----------------------------------------------------------------------------------------------------------
_MOCK = """
import sys
sys.path.insert(0, {root!r})
from lightning_sdk.proxy.serve import serve
from tests.support.mock_openai import MockOpenAI
serve(MockOpenAI(record_requests=False).app, port={port})
"""

_PROXY = """
import sys
sys.path.insert(0, {root!r})
from lightning_sdk.proxy import PassthroughBackend, create_app, serve
from lightning_sdk.store import SQLiteStore
store = SQLiteStore({db!r})
app = create_app(store, policy_backend=PassthroughBackend("http://127.0.0.1:{up}/v1"), admin_key={key!r})
serve(app, port={port})
"""


async def _running_tokens(db: str, n: int) -> list[str]:
    store = SQLiteStore(db)
    try:
        await store.enqueue([{"i": i} for i in range(n)], n=1, split="train")
        tokens = []
        for _ in range(n):
            claim = await store.claim("bench", lease_s=3600)
            assert claim is not None
            tokens.append(claim.attempt.token)
        return tokens
    finally:
        await store.close()


async def _load(session: aiohttp.ClientSession, url: str, tokens: list[str], n: int, conc: int) -> None:
    body = {"model": "policy", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 32}
    nxt = 0

    async def worker() -> None:
        nonlocal nxt
        while nxt < n:
            token = tokens[nxt % len(tokens)]
            nxt += 1
            async with session.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"proxy answered {r.status}: {data[:200]!r}")

    await asyncio.gather(*(worker() for _ in range(conc)))


async def measure_proxy(n_attempts: int, n_requests: int, up_port: int) -> float:
    """Proxy CPU milliseconds per request with ``n_attempts`` running attempts, requests spread over all of them."""
    tmp = tempfile.mkdtemp(prefix="ls-scale-")
    db = f"{tmp}/store.db"
    tokens = await _running_tokens(db, n_attempts)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    src = _PROXY.format(root=str(ROOT), db=db, up=up_port, key=ADMIN_KEY, port=port)
    proxy = subprocess.Popen([sys.executable, "-c", src], env=env)
    try:
        await wait_ready(f"http://127.0.0.1:{port}/lightning/v1/health", timeout=120)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await _load(session, url, tokens, max(n_attempts, 200), 16)  # warm-up: every attempt once
            await asyncio.sleep(0.5)
            cpu0 = cpu_seconds(proxy.pid)
            await _load(session, url, tokens, n_requests, 16)
            await asyncio.sleep(0.5)  # the recorder's last writes count too
            cpu = cpu_seconds(proxy.pid) - cpu0
    finally:
        proxy.terminate()
        proxy.wait(10)
    return cpu / n_requests * 1e3


# ---- main -----------------------------------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> str:
    return f"{b / a:.2f}x" if a > 0 else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 1k vs 10k calls, 10 vs 1,000 attempts")
    parser.add_argument("--small", type=int, default=10_000, help="calls in the small store")
    parser.add_argument("--large", type=int, default=1_000_000, help="calls in the large store")
    parser.add_argument("--few", type=int, default=10, help="running attempts, small proxy case")
    parser.add_argument("--many", type=int, default=10_000, help="running attempts, large proxy case")
    parser.add_argument("--requests", type=int, default=3000, help="measured proxy requests per case")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "lightning_sdk" / "store_scale")
    parser.add_argument("--export-cap-gb", type=float, default=8.0, help="address-space cap of the export process")
    parser.add_argument("--skip", action="append", default=[], choices=["step", "export", "proxy"])
    args = parser.parse_args()
    if args.quick:
        args.small, args.large, args.few, args.many, args.requests = 1_000, 10_000, 10, 1_000, 600
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min) on {os.cpu_count()} cores", flush=True)
    files = {}
    for n in (args.small, args.large):
        path, fill_s = store_file(args.cache_dir, n)
        files[n] = path
        made = f"filled in {fill_s:.0f} s" if fill_s is not None else "reused"
        print(f"store of {n:,} calls: {path} ({path.stat().st_size / 2**20:,.0f} MiB, {made})", flush=True)

    out: list[tuple[str, float, float, str]] = []
    if "step" not in args.skip:
        step = {n: asyncio.run(measure_step(files[n])) for n in (args.small, args.large)}
        for op in step[args.small]:
            out.append((f"step: {op} (ms)", step[args.small][op] * 1e3, step[args.large][op] * 1e3, ""))
        total = {n: sum(step[n].values()) * 1e3 for n in step}
        out.append(("step: all of the above (ms)", total[args.small], total[args.large], ""))
    if "export" not in args.skip:
        ex = {n: measure_export(files[n], args.export_cap_gb) for n in (args.small, args.large)}
        out.append(("export: wall (s)", ex[args.small][0], ex[args.large][0], ""))
        out.append(("export: peak RSS (MB)", ex[args.small][1], ex[args.large][1], ""))
        for n in ex:
            print(f"export of {n:,} calls: {ex[n][2]}", flush=True)
    if "proxy" not in args.skip:
        up_port = free_port()
        mock_src = _MOCK.format(root=str(ROOT), port=up_port)
        mock = subprocess.Popen([sys.executable, "-c", mock_src], env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            asyncio.run(wait_ready(f"http://127.0.0.1:{up_port}/v1/models"))
            px = {k: asyncio.run(measure_proxy(k, args.requests, up_port)) for k in (args.few, args.many)}
        finally:
            mock.terminate()
            mock.wait(10)
        out.append((f"proxy: CPU ms/request ({args.few:,} vs {args.many:,} attempts)", px[args.few], px[args.many], ""))

    print(f"\nstore scaling: {args.small:,} vs {args.large:,} recorded calls (load now {os.getloadavg()[0]:.2f})\n")
    head = f"{'measure':<52}{'small':>12}{'large':>12}{'large/small':>13}"
    print(head)
    print("-" * len(head))
    for name, small, large, _ in out:
        print(f"{name:<52}{small:>12.3f}{large:>12.3f}{_ratio(small, large):>13}")
    print("\ntargets: step and proxy ratios about 1 (O(batch), not O(store)); export peak RSS flat (streamed)")


if __name__ == "__main__":
    main()
