"""The PostgreSQL store beside SQLite: what a training step's reads cost as the recorded history grows, how many calls
a second one and two proxies record, and the proxy's CPU per call with each store, all in one run.

Launch (one command, a few minutes; it starts its own PostgreSQL server and removes it after)::

    python benchmarks/store_postgres.py                       # 10k vs 100k recorded calls, c=32, 2,000 calls a case
    python benchmarks/store_postgres.py --large 1000000       # the 1M-call history (~6 GB per store, removed after)
    python benchmarks/store_postgres.py --quick               # 1k vs 10k calls, 600 calls a case

What runs:

1. **Histories.** A finished, consumed history of ``--small`` and ``--large`` calls, in a SQLite file (the cached
   files of ``store_scale.py``) and in a PostgreSQL database (filled with the same rows, the same row codec, then
   ``ANALYZE``d). Groups of 8 rollouts x 4 calls of ~5.6 KB (``store_scale.make_call``).
2. **Training step**, per store and history (``store_scale``'s step): 5 steps of ``finished_groups(limit=192)``
   with 32 + 160 groups ready and 16 in flight, ``build_records``, ``consume_groups``, ``counts``,
   ``expire_leases``; the median per operation, and the ratio large/small (flat: about 1).
3. **Proxies.** The real proxy (``create_app`` + ``serve``, ``PassthroughBackend``) as one or two processes over one
   store, a scripted loopback upstream (``tests/support/mock_openai.py``), non-stream chat completions at
   concurrency 32 over 64 running attempts (two proxies: requests alternate between them). Reported: recorded
   calls a second (from the first request until the store holds every call) and the proxies' CPU (user + system,
   /proc, all proxy processes together) per call. Cases: SQLite/1 proxy, PostgreSQL/1 proxy, PostgreSQL/2 proxies,
   alternated for ``--rounds`` rounds (median). Two proxies on one SQLite file is not a layout the SQLite store
   supports (one writer per file), so it is not measured.

The PostgreSQL server runs with ``fsync=on, synchronous_commit=off``: the durability of ``SQLiteStore``'s default
(a killed process loses nothing committed; an OS crash may lose the last commits). Figures: docs/scale-out.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import store_scale as ss  # noqa: E402
from proxy_overhead import cpu_seconds, free_port, wait_ready  # noqa: E402

from lightning_sdk.records import build_records  # noqa: E402
from lightning_sdk.store import SQLiteStore, Store, open_store  # noqa: E402
from lightning_sdk.store import _sqlite_rows as rows  # noqa: E402
from lightning_sdk.store.postgres import PostgresStore  # noqa: E402
from tests.support.postgres import PostgresServer  # noqa: E402

CONCURRENCY = 32
ATTEMPTS = 64


_INSERT = re.compile(r"INSERT INTO (\w+) \(([\w, ]+)\) VALUES")


def check_disk(where: Path, n_calls: int) -> None:
    """Refuse a history the disk cannot hold twice over (SQLite file + PostgreSQL table, ~6 KB a call each, and the
    indexes and WAL on top), before filling anything."""
    need = n_calls * 6_000 * 2 * 1.5
    free = shutil.disk_usage(where).free
    if free < need:
        raise SystemExit(f"a {n_calls:,}-call history needs ~{need / 1e9:.0f} GB free at {where}; {free / 1e9:.0f} GB")


class PgBulk:
    """The slice of ``sqlite3.Connection`` that ``store_scale.insert_groups`` uses, over a psycopg connection (its
    ``?`` placeholders become ``%s``), so both stores are filled with the very same rows."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url)
        self.cur = self.conn.cursor()

    def execute(self, sql: str) -> None:
        if sql == "COMMIT":
            self.conn.commit()
        elif sql != "BEGIN":
            self.cur.execute(sql)  # type: ignore[arg-type]

    def executemany(self, sql: str, params: list[tuple[Any, ...]]) -> None:
        """An ``INSERT INTO t (cols) VALUES (...)`` of many rows as one ``COPY t (cols) FROM STDIN`` (the 1M-call
        history loads in minutes instead of an hour of row-by-row inserts); anything else as ``executemany``."""
        m = _INSERT.match(sql)
        if m is None:
            self.cur.executemany(sql.replace("?", "%s"), params)  # type: ignore[arg-type]
            return
        with self.cur.copy(f"COPY {m[1]} ({m[2]}) FROM STDIN") as copy:  # type: ignore[arg-type]
            for row in params:
                copy.write_row(row)

    def close(self) -> None:
        self.conn.close()


def fill_postgres(server: PostgresServer, n_calls: int) -> tuple[str, float]:
    """A database holding a consumed history of ``n_calls`` calls; (its URL, the seconds the fill took)."""
    t0 = time.perf_counter()
    url = server.create_db(f"history_{n_calls}")
    asyncio.run(PostgresStore(url, listen=False).close())  # the schema, as the store makes it
    bulk = PgBulk(url)
    n_groups = max(1, n_calls // (ss.CALLS_PER_ATTEMPT * ss.N_PER_GROUP))
    ss.insert_groups(bulk, "hist", n_groups, consumed=True)  # type: ignore[arg-type]
    bulk.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return url, time.perf_counter() - t0


# ---- training step --------------------------------------------------------------------------------------------------
async def measure_step(store: Store, bulk: Any, tag: str) -> dict[str, float]:
    """``store_scale.measure_step`` over any store: median seconds per operation over ``STEPS`` steps (the groups
    it adds are named after ``tag``)."""
    n_ready = (ss.STEPS + 6) * ss.TASKS_PER_STEP
    ss.insert_groups(bulk, f"live-{tag}", n_ready, consumed=False)
    task = {"question": "What is 17 * 23 + 4?", "answer": "395"}
    flying = [f"fly-{tag}-{g}" for g in range(ss.IN_FLIGHT_GROUPS)]
    times: dict[str, list[float]] = {n: [] for n in ("finished_groups", "build_records", "consume_groups")}
    times.update({"counts": [], "expire_leases": []})
    base_step = int(time.time())
    await store.enqueue([task] * len(flying), n=ss.N_PER_GROUP, group_ids=flying)
    for _ in range(ss.IN_FLIGHT_GROUPS * ss.N_PER_GROUP // 2):
        assert await store.claim(f"bench-{tag}", lease_s=3600, split="train") is not None
    for s in range(ss.STEPS):
        t0 = time.perf_counter()
        finished = await store.finished_groups(limit=4 * ss.TASKS_PER_STEP + 64, split="train")
        t1 = time.perf_counter()
        fresh = finished[: ss.TASKS_PER_STEP]
        built = build_records(fresh)
        t2 = time.perf_counter()
        await store.consume_groups(base_step + s, [g.group.group_id for g in fresh])
        t3 = time.perf_counter()
        counts_s = await ss._median_of(store.counts)
        expire_s = await ss._median_of(store.expire_leases)
        assert len(fresh) == ss.TASKS_PER_STEP and len(built.records) == ss.TASKS_PER_STEP * ss.N_PER_GROUP
        assert all(g.group.group_id.startswith(f"live-{tag}") for g in fresh)
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, counts_s, expire_s), strict=True):
            times[name].append(dt)
    return {name: statistics.median(v) for name, v in times.items()}


def step_sqlite(path: Path) -> dict[str, float]:
    """The step on the cached SQLite history, which is left as it was (this run's groups are removed)."""
    tag = f"{os.getpid()}-{int(time.time())}"

    async def go() -> dict[str, float]:
        conn = rows.connect(str(path), synchronous="NORMAL", busy_timeout_s=10, readonly=False)
        store = SQLiteStore(path)
        try:
            return await measure_step(store, conn, tag)
        finally:
            await store.close()
            conn.close()

    try:
        return asyncio.run(go())
    finally:
        ss._delete_live(path, tag)


def step_postgres(url: str) -> dict[str, float]:
    async def go() -> dict[str, float]:
        bulk = PgBulk(url)
        store = PostgresStore(url, listen=False)
        try:
            return await measure_step(store, bulk, f"{os.getpid()}-{int(time.time())}")
        finally:
            await store.close()
            bulk.close()

    return asyncio.run(go())


# ---- proxies --------------------------------------------------------------------------------------------------------
_PROXY = """
import sys
sys.path.insert(0, {root!r})
from lightning_sdk.proxy import PassthroughBackend, create_app, serve
from lightning_sdk.store import open_store
store = open_store({spec!r})
app = create_app(store, policy_backend=PassthroughBackend("http://127.0.0.1:{up}/v1"), admin_key={key!r},
                 close_store=True)
serve(app, port={port})
"""


async def _tokens(spec: str, n: int) -> list[str]:
    store = open_store(spec)
    try:
        return [(await store.open_session({"i": i})).attempt.token for i in range(n)]
    finally:
        await store.close()


def _recorded(spec: str) -> int:
    if spec.startswith("postgresql://"):
        with psycopg.connect(spec) as conn:
            row = conn.execute("SELECT COUNT(*) FROM calls").fetchone()
            return int(row[0]) if row else 0
    conn = sqlite3.connect(spec)
    try:
        return int(conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0])
    finally:
        conn.close()


async def _load(urls: list[str], tokens: list[str], n: int) -> None:
    body = {"model": "policy", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 32}
    nxt = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal nxt
        while nxt < n:
            i = nxt
            nxt += 1
            headers = {"Authorization": f"Bearer {tokens[i % len(tokens)]}"}
            async with session.post(urls[i % len(urls)], json=body, headers=headers) as r:
                data = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"proxy answered {r.status}: {data[:200]!r}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))


def measure_proxies(spec: str, n_proxies: int, n_calls: int, up_port: int) -> tuple[float, float]:
    """(recorded calls a second, proxy CPU ms per call) of ``n_proxies`` proxy processes on the store ``spec``."""
    tokens = asyncio.run(_tokens(spec, ATTEMPTS))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ports = [free_port() for _ in range(n_proxies)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROXY.format(root=str(ROOT), spec=spec, up=up_port, key=ss.ADMIN_KEY, port=p)],
            env=env,
        )
        for p in ports
    ]
    try:
        for p in ports:
            asyncio.run(wait_ready(f"http://127.0.0.1:{p}/lightning/v1/health", timeout=120, upstream=True))
        urls = [f"http://127.0.0.1:{p}/v1/chat/completions" for p in ports]
        asyncio.run(_load(urls, tokens, 200))  # warm-up
        deadline = time.monotonic() + 60
        while _recorded(spec) < 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = _recorded(spec)
        cpu0 = sum(cpu_seconds(pr.pid) for pr in procs)
        t0 = time.perf_counter()
        asyncio.run(_load(urls, tokens, n_calls))
        deadline = time.monotonic() + 120
        while _recorded(spec) < before + n_calls:  # every call committed (the recorders write behind the answer)
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {_recorded(spec) - before} of {n_calls} calls were recorded")
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        cpu = sum(cpu_seconds(pr.pid) for pr in procs) - cpu0
        assert _recorded(spec) == before + n_calls, "a call was recorded twice"
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            pr.wait(20)
    return n_calls / wall, cpu / n_calls * 1e3


# ---- main -----------------------------------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> str:
    return f"{b / a:.2f}x" if a > 0 else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1k vs 10k calls, 600 proxied calls a case")
    parser.add_argument("--small", type=int, default=10_000, help="calls in the small history")
    parser.add_argument("--large", type=int, default=100_000, help="calls in the large history")
    parser.add_argument("--calls", type=int, default=2000, help="proxied calls per case and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the alternated proxy cases")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "lightning_sdk" / "store_scale")
    parser.add_argument("--skip", action="append", default=[], choices=["step", "proxy"])
    parser.add_argument("--keep-max", type=int, default=100_000, help="cached SQLite histories above this are removed")
    args = parser.parse_args()
    if args.quick:
        args.small, args.large, args.calls = 1_000, 10_000, 600
    bin_dir = PostgresServer.find()
    if bin_dir is None:
        raise SystemExit("no PostgreSQL server binaries found (set $LSDK_PG_BIN)")
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min) on {os.cpu_count()} cores", flush=True)
    server = PostgresServer(bin_dir, fsync=True).start()
    tmp = Path(tempfile.mkdtemp(prefix="ls-pgbench-"))
    out: list[tuple[str, float, float]] = []
    try:
        if "step" not in args.skip:
            step: dict[tuple[str, int], dict[str, float]] = {}
            for n in (args.small, args.large):
                check_disk(args.cache_dir if args.cache_dir.exists() else Path.home(), n)
                path, fill_s = ss.store_file(args.cache_dir, n)
                made = f"filled in {fill_s:.0f} s" if fill_s is not None else "reused"
                print(f"SQLite history of {n:,} calls: {path} ({made}, load {os.getloadavg()[0]:.1f})", flush=True)
                url, pg_s = fill_postgres(server, n)
                print(f"PostgreSQL history of {n:,} calls: filled in {pg_s:.0f} s (COPY)", flush=True)
                try:
                    step[("sqlite", n)] = step_sqlite(path)
                    step[("postgres", n)] = step_postgres(url)
                finally:
                    server.drop_db(f"history_{n}")  # the disk: a 1M-call history is ~6 GB a store
                    if n > args.keep_max:
                        for f in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                            f.unlink(missing_ok=True)
            for kind in ("sqlite", "postgres"):
                for op in step[(kind, args.small)]:
                    small, large = step[(kind, args.small)][op] * 1e3, step[(kind, args.large)][op] * 1e3
                    out.append((f"{kind}: step {op} (ms)", small, large))
        proxy: dict[str, list[tuple[float, float]]] = {}
        if "proxy" not in args.skip:
            up_port = free_port()
            mock_src = ss._MOCK.format(root=str(ROOT), port=up_port)
            mock = subprocess.Popen([sys.executable, "-c", mock_src], env=dict(os.environ, PYTHONPATH=str(ROOT)))
            try:
                asyncio.run(wait_ready(f"http://127.0.0.1:{up_port}/v1/models"))
                for r in range(args.rounds):
                    cases = {
                        "SQLite, 1 proxy": (str(tmp / f"proxy-{r}.db"), 1),
                        "PostgreSQL, 1 proxy": (server.create_db(f"proxy1_{r}"), 1),
                        "PostgreSQL, 2 proxies": (server.create_db(f"proxy2_{r}"), 2),
                    }
                    for name, (spec, n_proxies) in cases.items():
                        if spec.endswith(".db"):
                            asyncio.run(SQLiteStore(spec).close())
                        proxy.setdefault(name, []).append(measure_proxies(spec, n_proxies, args.calls, up_port))
                        rate, cpu = proxy[name][-1]
                        load = os.getloadavg()[0]
                        print(f"round {r + 1} {name}: {rate:.0f} calls/s, {cpu:.2f} CPU ms/call (load {load:.2f})")
            finally:
                mock.terminate()
                mock.wait(10)
    finally:
        server.stop()
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()

    load = os.getloadavg()[0]
    if out:
        print(f"\nstep reads: {args.small:,} vs {args.large:,} recorded calls (load now {load:.2f})\n")
        head = f"{'measure':<44}{'small':>10}{'large':>10}{'large/small':>13}"
        print(head)
        print("-" * len(head))
        for name, small, large in out:
            print(f"{name:<44}{small:>10.3f}{large:>10.3f}{_ratio(small, large):>13}")
    if proxy:
        base = statistics.median(v[0] for v in proxy["SQLite, 1 proxy"])
        base_cpu = statistics.median(v[1] for v in proxy["SQLite, 1 proxy"])
        print(f"\nproxies: c={CONCURRENCY}, {ATTEMPTS} attempts, {args.calls} calls a case, median of {args.rounds} "
              f"alternated rounds (load now {load:.2f})\n")  # fmt: skip
        head = f"{'case':<26}{'calls/s':>10}{'vs SQLite':>11}{'CPU ms/call':>13}{'vs SQLite':>11}"
        print(head)
        print("-" * len(head))
        for name, vals in proxy.items():
            rate, cpu = statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals)
            print(f"{name:<26}{rate:>10.0f}{_ratio(base, rate):>11}{cpu:>13.2f}{_ratio(base_cpu, cpu):>11}")


if __name__ == "__main__":
    main()
