"""What the tracing proxy costs: the same load sent to a mock upstream directly, through a minimal Python proxy and
through the lightning proxy.

Launch (one command, prints a table)::

    python benchmarks/proxy_overhead.py                 # sequential, concurrency 32 and 256
    python benchmarks/proxy_overhead.py --quick         # fewer requests
    python benchmarks/proxy_overhead.py --only c=32     # one load only
    python benchmarks/proxy_overhead.py --stream        # streamed chat completions instead
    python benchmarks/proxy_overhead.py --minimal aiohttp   # the minimal proxy on aiohttp instead of raw ASGI
    python benchmarks/proxy_overhead.py --mock scripted     # the upstream builds every reply (the old mock)
    python benchmarks/proxy_overhead.py --only c=32 --profile FILE   # then py-spy the proxy at concurrency 32

Four processes on loopback: the mock upstream (``tests/support/mock_openai.py``, uvicorn + uvloop + httptools), the
proxy (``lightning_sdk.proxy`` with a ``PassthroughBackend`` to the mock and a ``SQLiteStore`` in a temp dir,
recording every call), the minimal proxy (``minimal_forwarder``: the body forwarded to the mock and the reply sent
back, both unchanged; no parsing, no recording: the floor of any Python proxy on this machine) and this load
generator (aiohttp, one pooled session). For each load — sequential and at concurrency 32 and 256 — the same
requests go first directly to the mock, then through the minimal proxy, then through the proxy, with one session
token; that round is repeated (``--rounds``, 5 by default: a phase is well under a second, and a slow spell of a
shared machine hit a single round's ratio by +-0.05) and the round with the median proxy/direct ratio is shown, with
every round's ratio. Reported: requests/s, the throughput ratios (minimal/direct, proxy/direct, proxy/minimal), the
p50/p99 latency each proxy adds, and each proxy process's CPU milliseconds per request (user + system time from
/proc/<pid>/stat over the phase, so the proxy's recording and SQLite writes are included; the proxy's split into its
event-loop thread and the rest, i.e. the store's writer thread); the load average; and the CPU per request of all
three processes together (this load generator's own included) with the throughput it allows: every process's busiest
thread on one core and all of them on the machine's cores. Direct and minimal phases run at the load generator's
one-core bound; the proxied phase is bound by the three processes' CPU on two cores, so on this machine px/dir is
about 2 x client / (client + mock + proxy) times how close the phase gets to its bound. Both proxies run under
``serve()`` (with its garbage-collector set-up), the mock with ``tune_gc=False``.

The mock upstream answers from pre-encoded bytes (``canned_mock``: each distinct request body is answered once by
``MockOpenAI`` and its reply bytes are kept; after that a request costs the mock a JSON parse of the body and one
send, whether it asks for token ids and log-probs or not). A real engine's cost of adding ids and log-probs to a
reply is a small part of generating it; the scripted mock (``--mock scripted``: starlette + stdlib ``json``,
building every reply, including ~100 log-prob objects, in Python) spent about 2x the CPU on requests asking for
them, which made the proxied phase (the proxy always asks) pay for the mock's own JSON building on the same two
cores. Direct still means the same client talking to the same upstream, without the proxy; the direct+ids column
shows direct requests asking for ids and log-probs (the fair comparison for the proxy's own cost).

Targets on a 2-core box (issue 14): proxy CPU <= 0.15 ms/request and proxied throughput >= 0.5x direct at
concurrency 32 (issue 2: p50 added <= 1 ms sequential). The Agent Lightning gateway is not part of this run (it
needs a Python 3.12 side environment); its numbers measured on this kind of machine are quoted in docs/proxy.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
ADMIN_KEY = "bench-admin-key"
WITH_IDS = {"return_token_ids": True, "logprobs": True}  # what the proxy adds to each request it forwards


@dataclass
class Phase:
    """One load sent to one target: requests/s, latency quantiles (s), CPU ms per request of the mock and of the
    proxy in between (0 for direct)."""

    rate: float
    p50: float
    p99: float
    mock_ms: float
    cpu_ms: float
    main_ms: float = 0.0  # of which the main thread (the event loop); the rest: the store's writer thread
    client_ms: float = 0.0  # this load generator's CPU per request


_MOCK = """
import sys
sys.path.insert(0, {root!r})
from lightning_sdk.proxy.serve import serve
from tests.support.mock_openai import MockOpenAI
app = MockOpenAI(record_requests=False).app
if {kind!r} == "canned":
    sys.path.insert(0, {bench!r})
    from proxy_overhead import canned_mock
    app = canned_mock(app)
serve(app, port={port}, tune_gc=False)  # the upstream as before; the proxies get serve's default
"""

_MINIMAL = """
import sys
sys.path.insert(0, {root!r})
from lightning_sdk.proxy.serve import serve
sys.path.insert(0, {bench!r})
from proxy_overhead import minimal_forwarder
minimal_forwarder({kind!r}, "http://127.0.0.1:{up}/v1", {port})
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


def minimal_forwarder(kind: str, upstream: str, port: int) -> None:
    """Serve the minimal Python proxy on ``port``: the request body forwarded to ``upstream`` unchanged and the
    reply sent back unchanged (no parsing, no recording) — what a Python proxy costs before it does anything.

    ``asgi``: a raw ASGI app on the proxy's own server set-up (uvicorn, uvloop, httptools) and its pooled client
    (``lightning_sdk/http1.py``); ``aiohttp``: an aiohttp web server with one pooled ``aiohttp.ClientSession``.
    """
    if kind == "aiohttp":
        from aiohttp import web

        async def on_startup(app: web.Application) -> None:
            app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def on_cleanup(app: web.Application) -> None:
            await app["session"].close()

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            session: aiohttp.ClientSession = request.app["session"]
            url = upstream + request.path.removeprefix("/v1")
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                data = await r.read()
                return web.Response(body=data, status=r.status, content_type=r.content_type)

        app = web.Application()
        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        app.router.add_post("/v1/{tail:.*}", forward)
        app.router.add_get("/lightning/v1/health", lambda request: web.Response(text="ok"))  # type: ignore[arg-type,return-value]
        import uvloop

        uvloop.install()
        web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
        return

    from lightning_sdk.http1 import Http1Pool
    from lightning_sdk.proxy.serve import serve

    pool = Http1Pool(upstream)
    headers = {"Content-Type": "application/json"}

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await pool.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path: str = scope["path"]
        resp = await pool.send(scope["method"], path.removeprefix("/v1"), await _read_body(receive), headers)
        data = await resp.read()
        ctype = next((v for k, v in resp.headers if k == b"content-type"), b"application/json")
        out = [(b"content-type", ctype), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": resp.status, "headers": out})
        await send({"type": "http.response.body", "body": data})

    serve(asgi, port=port)


async def _read_body(receive: Any) -> bytes:
    """An ASGI request's whole body."""
    parts, more = [], True
    while more:
        message = await receive()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


def canned_mock(scripted: Any) -> Any:
    """A raw ASGI upstream that answers each distinct request body with the bytes ``scripted`` (the
    ``MockOpenAI`` app) answered it the first time: the request is parsed (as any server does), the reply is not
    built again. Same answers, minus per-reply ``id``/``created`` values; non-streamed POSTs only."""
    import orjson

    cache: dict[bytes, tuple[int, list[tuple[bytes, bytes]], bytes]] = {}

    async def ask(scope: dict[str, Any], body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        sent: list[dict[str, Any]] = []
        done = False

        async def receive() -> dict[str, Any]:
            nonlocal done
            if done:
                return {"type": "http.disconnect"}
            done = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await scripted(scope, receive, send)
        head = sent[0]
        data = b"".join(m.get("body", b"") for m in sent[1:])
        return head["status"], [(k, v) for k, v in head["headers"] if k != b"content-length"], data

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await scripted(scope, receive, send)
            return
        body = await _read_body(receive)
        if orjson.loads(body).get("stream"):
            raise ValueError("canned_mock answers non-streamed requests only (use --mock scripted)")
        reply = cache.get(body)
        if reply is None:
            reply = cache[body] = await ask(scope, body)
        status, headers, data = reply
        out = [*headers, (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": data})

    return app


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int, main_thread: bool = False) -> float:
    """User + system CPU time of a process, or of its main thread only (Linux /proc)."""
    stat = f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


async def wait_ready(url: str, timeout: float = 90.0, upstream: bool = False) -> None:
    """Wait until ``url`` answers below 500 (``upstream``: and its health says the upstream is ready, so that the
    proxy, started before the mock, does not answer the warm-up 503 while it looks for its upstream)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url) as r:
                    if r.status < 500 and (not upstream or (await r.json())["upstream"]["state"] == "ready"):
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up")
            await asyncio.sleep(0.1)


async def run_load(
    session: aiohttp.ClientSession,
    url: str,
    token: str,
    n: int,
    concurrency: int,
    stream: bool,
    extra: dict[str, Any] | None = None,
) -> tuple[float, list[float]]:
    """Send ``n`` requests with ``concurrency`` workers; returns (wall seconds, latencies in seconds)."""
    body: dict[str, Any] = {
        "model": "policy",
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "max_tokens": 64,
        **(extra or {}),
    }
    if stream:
        body["stream"] = True
    headers = {"Authorization": f"Bearer {token}"}
    latencies: list[float] = []
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            async with session.post(url, json=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url} answered {r.status}: {(await r.read())[:200]!r}")
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, latencies


async def profile(
    session: aiohttp.ClientSession, url: str, token: str, pid: int, out: str, stream: bool, seconds: float = 8.0
) -> None:
    """Concurrency-32 load through the proxy while ``py-spy`` samples the proxy process (raw folded stacks to
    ``out``, every thread, idle samples left out)."""
    cmd = ["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "250", "--nonblocking", "--threads"]
    spy = subprocess.Popen(
        [*cmd, "-f", "raw", "-o", out],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    await asyncio.sleep(1.0)  # py-spy attaches
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end and spy.poll() is None:
        await run_load(session, url, token, 2000, 32, stream)
    spy.wait(30)
    print(f"py-spy profile of the proxy (c=32, {seconds:.0f} s): {out}")


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def main_async(args: argparse.Namespace) -> None:
    up_port, px_port, min_port = free_port(), free_port(), free_port()
    tmp = tempfile.mkdtemp(prefix="ls-bench-")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    root, bench = str(ROOT), str(ROOT / "benchmarks")
    mock_kind = "scripted" if args.stream else args.mock
    mock = subprocess.Popen(
        [sys.executable, "-c", _MOCK.format(root=root, bench=bench, kind=mock_kind, port=up_port)], env=env
    )
    proxy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _PROXY.format(root=root, db=f"{tmp}/store.db", up=up_port, key=ADMIN_KEY, port=px_port),
        ],
        env=env,
    )
    minimal = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _MINIMAL.format(root=root, bench=bench, kind=args.minimal, up=up_port, port=min_port),
        ],
        env=env,
    )
    load0 = os.getloadavg()
    try:
        await wait_ready(f"http://127.0.0.1:{up_port}/v1/models")
        await wait_ready(f"http://127.0.0.1:{px_port}/lightning/v1/health", upstream=True)
        await wait_ready(f"http://127.0.0.1:{min_port}/lightning/v1/health")
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.post(
                f"http://127.0.0.1:{px_port}/lightning/v1/sessions",
                json={"task": {"bench": True}},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            ) as r:
                token = (await r.json())["token"]
            direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
            least = f"http://127.0.0.1:{min_port}/v1/chat/completions"
            proxied = f"http://127.0.0.1:{px_port}/v1/chat/completions"
            # warm-up: connections, imports, SQLite file
            for url in (direct, least, proxied):
                await run_load(session, url, token, 200, 8, args.stream)
            scale = 0.25 if args.quick else 1.0
            loads = [
                ("sequential", 1, int(1000 * scale)),
                ("c=32", 32, int(4000 * scale)),
                ("c=256", 256, int(4000 * scale)),
            ]
            if args.only:
                loads = [load for load in loads if load[0] == args.only]
            targets = [  # (label, url, the process whose CPU is counted besides the mock's, extra body fields)
                ("direct", direct, None, None),
                ("direct+ids", direct, None, WITH_IDS),
                ("minimal", least, minimal, None),
                ("proxy", proxied, proxy, None),
            ]
            rows: list[tuple[str, dict[str, Phase]]] = []
            spreads: dict[str, list[float]] = {}
            for name, conc, n in loads:
                rounds: list[dict[str, Phase]] = []
                for _ in range(args.rounds):  # the targets in turn, several times: a slow spell hits all of them
                    phases: dict[str, Phase] = {}
                    for label, url, middle, extra in targets:
                        mock0 = cpu_seconds(mock.pid)
                        mid0 = cpu_seconds(middle.pid) if middle is not None else 0.0
                        main0 = cpu_seconds(middle.pid, main_thread=True) if middle is not None else 0.0
                        client0 = time.process_time()
                        wall, lat = await run_load(session, url, token, n, conc, args.stream, extra)
                        client_ms = (time.process_time() - client0) / n * 1e3
                        if middle is proxy:
                            await asyncio.sleep(0.3)  # let the recorder finish this phase's writes (its CPU)
                        phases[label] = Phase(
                            rate=n / wall,
                            p50=pct(lat, 50),
                            p99=pct(lat, 99),
                            mock_ms=(cpu_seconds(mock.pid) - mock0) / n * 1e3,
                            cpu_ms=(cpu_seconds(middle.pid) - mid0) / n * 1e3 if middle is not None else 0.0,
                            main_ms=(cpu_seconds(middle.pid, True) - main0) / n * 1e3 if middle is not None else 0.0,
                            client_ms=client_ms,
                        )
                    rounds.append(phases)
                ratios = [r["proxy"].rate / r["direct"].rate for r in rounds]
                spreads[name] = sorted(ratios)
                rows.append((name, rounds[ratios.index(sorted(ratios)[len(ratios) // 2])]))  # the median round
            if args.profile:
                await profile(session, proxied, token, proxy.pid, args.profile, args.stream)
    finally:
        for proc in (proxy, minimal, mock):
            proc.terminate()
        for proc in (proxy, minimal, mock):
            proc.wait(10)
    load1 = os.getloadavg()
    mode = "stream" if args.stream else "non-stream"
    print(
        f"\nproxy overhead ({mode} chat completions; mock engine ({mock_kind}), minimal proxy ({args.minimal}), "
        f"lightning proxy and this client on {os.cpu_count()} cores; load average {load0[0]:.2f} at start, "
        f"{load1[0]:.2f} at end)\n"
    )
    head = (
        f"{'load':<11}{'direct':>8}{'dir+ids':>8}{'minimal':>8}{'proxy':>8}{'min/dir':>8}{'px/dir':>7}{'px/d+ids':>9}"
        f"{'px/min':>7}{'+p50 ms':>8}{'+p99 ms':>8}{'min +p50':>9}{'min CPU':>8}{'px CPU':>8}"
    )
    print("requests/s, throughput ratios, latency added over direct (ms), CPU ms per request of the minimal proxy and")
    print("of the lightning proxy (recording and SQLite writes included)")
    print(head)
    print("-" * len(head))
    for name, ph in rows:
        d, di, m, p = ph["direct"], ph["direct+ids"], ph["minimal"], ph["proxy"]
        print(
            f"{name:<11}{d.rate:>8.0f}{di.rate:>8.0f}{m.rate:>8.0f}{p.rate:>8.0f}{m.rate / d.rate:>8.2f}"
            f"{p.rate / d.rate:>7.2f}{p.rate / di.rate:>9.2f}{p.rate / m.rate:>7.2f}{(p.p50 - d.p50) * 1e3:>8.2f}"
            f"{(p.p99 - d.p99) * 1e3:>8.2f}{(m.p50 - d.p50) * 1e3:>9.2f}{m.cpu_ms:>8.3f}{p.cpu_ms:>8.3f}"
        )
    if args.rounds > 1:
        print(f"\neach load: {args.rounds} rounds of the four targets in turn; shown: the round with the median px/dir")
        for name, ratios in spreads.items():
            print(f"{name:<11}px/dir of every round: {' '.join(f'{r:.2f}' for r in ratios)}")
    print("\nthe lightning proxy's CPU ms per request: event-loop thread + other threads (the store's writer)")
    for name, ph in rows:
        p = ph["proxy"]
        print(f"{name:<11}{p.main_ms:.3f} + {max(p.cpu_ms - p.main_ms, 0.0):.3f} = {p.cpu_ms:.3f}")
    print(f"\nthe mock engine's ({mock_kind}) CPU ms per request in each phase (the proxy asks for ids and log-probs):")
    for name, ph in rows:
        print(f"{name:<11}" + "".join(f"{label} {ph[label].mock_ms:.3f}   " for label in ph))
    cores = os.cpu_count() or 1
    print(
        f"\nCPU ms per request of every process in each phase (client + mock + proxy) and the throughput those allow "
        f"(requests/s: {cores} cores shared, each process's busiest thread on one core; measured / that bound)"
    )
    for name, ph in rows:
        parts = []
        for label in ph:
            x = ph[label]
            total = x.client_ms + x.mock_ms + x.cpu_ms
            busiest = max(x.client_ms, x.mock_ms, x.main_ms or x.cpu_ms)  # each process's serial part is one thread
            bound = min(cores / total, 1 / busiest) * 1e3 if total > 0 else float("inf")
            parts.append(f"{label} {total:.3f} ({bound:,.0f}; {x.rate / bound:.2f})")
        print(f"{name:<11}" + "   ".join(parts))
    print(
        "\ndir+ids: direct requests asking for what the proxy asks upstream (return_token_ids, logprobs)."
        "\ntargets: proxy CPU <= 0.150 ms/req and px/dir >= 0.50 at c=32; +p50 <= 1.00 ms sequential"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds of the four targets in turn per load (the median is shown)"
    )
    parser.add_argument("--stream", action="store_true", help="streamed chat completions")
    parser.add_argument(
        "--minimal", choices=("asgi", "aiohttp"), default="asgi", help="the minimal proxy measured alongside"
    )
    parser.add_argument("--profile", metavar="FILE", help="then profile the proxy with py-spy at c=32 (raw stacks)")
    parser.add_argument("--only", choices=("sequential", "c=32", "c=256"), help="run one load only")
    parser.add_argument(
        "--mock",
        choices=("canned", "scripted"),
        default="canned",
        help="the upstream: replies from pre-encoded bytes (default) or built per request (--stream: scripted)",
    )
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
