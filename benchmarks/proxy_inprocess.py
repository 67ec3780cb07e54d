"""The proxy's own CPU per call without sockets: the ASGI app driven directly, the engine's answer canned.

Launch (one command, prints a table)::

    python benchmarks/proxy_inprocess.py                  # 3 rounds x 30,000 calls at concurrency 32
    python benchmarks/proxy_inprocess.py --calls 10000 --rounds 2

``benchmarks/proxy_overhead.py`` measures the proxy on loopback, where uvicorn, uvloop's socket work, the load
generator and the mock engine share the two cores with it and a round's figures move with the machine. This one
measures only what the proxy's own code costs a call: the real ``create_app`` with a real ``PassthroughBackend``
whose pooled HTTP client is replaced by one that returns the mock engine's reply bytes at once (``MockOpenAI``'s
answer with token ids and log-probs, as vLLM sends them), and a real ``SQLiteStore`` on a temp dir recording every
call. The load: ``--concurrency`` tasks sending chat completions through the app's ASGI entry point on one session
token. Reported per call: CPU of the event-loop thread (request parsing and validation, the passthrough's reading
of ids and log-probs, the record, the recorder hand-off), of the whole process (plus the store's writer thread:
rows and SQLite), the garbage collector's share (``gc.callbacks``) and wall time; then the same with recording
off (``record_calls`` a no-op) in the same run, and the ratios. The process runs with ``serve()``'s GC set-up.

``--compare-metrics`` instead alternates rounds with the Prometheus metrics on (the default: ``GET /metrics``, the
call observer, the recorder's counters) and off (``ProxyConfig(metrics=False)``), recording on in both, and prints
the ratio of the medians::

    python benchmarks/proxy_inprocess.py --compare-metrics --rounds 4

``--compare-telemetry`` alternates rounds with OTLP span export on (the ``SpanObserver`` on the call pipeline and
the SDK's OTLP/HTTP exporter sending to a loopback sink in this process) and off (no observer, the default)::

    python benchmarks/proxy_inprocess.py --compare-telemetry --rounds 4 --calls 10000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Round:
    main_us: float
    process_us: float
    gc_us: float
    wall_us: float


def engine_reply() -> bytes:
    """The mock engine's answer to the benchmark's request, with token ids and log-probs (vLLM's wire format)."""
    from starlette.testclient import TestClient

    from tests.support.mock_openai import MockOpenAI

    body = {"model": "policy", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 64}
    with TestClient(MockOpenAI(record_requests=False).app) as client:
        r = client.post("/v1/chat/completions", json={**body, "return_token_ids": True, "logprobs": True})
    r.raise_for_status()
    return r.content


class _Canned:
    """A complete 200 reply from the pool (what ``Http1Pool.send`` returns once the engine answered)."""

    _conn = None

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.status = 200
        self.headers = [(b"content-type", b"application/json")]

    async def read(self) -> bytes:
        return self._data

    def close(self) -> None:
        pass


async def _asgi(app: Any, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> list[Any]:
    sent: list[Any] = []
    done = False
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal done
        if done:  # after the body: the connection stays open (what a server's receive does)
            await never.wait()
        done = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "server": ("127.0.0.1", 4700),
        "client": ("127.0.0.1", 50000),
    }
    await app(scope, receive, send)
    return sent


async def measure(
    calls: int,
    rounds: int,
    concurrency: int,
    record: bool,
    reply: bytes,
    metrics: bool = True,
    telemetry_url: str | None = None,
) -> list[Round]:
    from lightning_sdk.proxy import PassthroughBackend, ProxyConfig, create_app
    from lightning_sdk.store import SQLiteStore

    tmp = tempfile.mkdtemp(prefix="ls-inproc-")
    store = SQLiteStore(f"{tmp}/store.db")
    if not record:

        async def nothing(batch: Any) -> None:
            return None

        store.record_calls = nothing  # type: ignore[method-assign]
    backend = PassthroughBackend("http://127.0.0.1:9/v1")

    async def send(method: str, path: str, body: bytes, headers: dict[str, str]) -> _Canned:
        return _Canned(reply)

    backend._pool.send = send  # type: ignore[method-assign,assignment]
    observers: list[Any] = []
    tel: Any = None
    if telemetry_url is not None:
        from lightning_sdk.telemetry import Telemetry, TelemetryConfig
        from lightning_sdk.telemetry.observer import SpanObserver

        tel = Telemetry(TelemetryConfig(otlp=telemetry_url, protocol="http/protobuf"))
        observers.append(SpanObserver(tel))
    app = create_app(
        store, policy_backend=backend, admin_key="bench", config=ProxyConfig(metrics=metrics), observers=observers
    )
    proxy = app.state.proxy
    life_in: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    life_out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await life_in.put({"type": "lifespan.startup"})
    life = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, life_in.get, life_out.put))
    started = await life_out.get()
    assert started["type"] == "lifespan.startup.complete", started
    admin = [(b"authorization", b"Bearer bench"), (b"content-type", b"application/json")]
    sent = await _asgi(app, "POST", "/lightning/v1/sessions", orjson.dumps({"task": {"bench": True}}), admin)
    token = orjson.loads(sent[1]["body"])["token"]
    body = orjson.dumps(
        {"model": "policy", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 64}
    )
    headers = [
        (b"authorization", f"Bearer {token}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]

    async def load(n: int) -> None:
        left = n

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                answer = await _asgi(app, "POST", "/v1/chat/completions", body, headers)
                if answer[0]["status"] != 200:
                    raise RuntimeError(f"the proxy answered {answer[0]['status']}: {answer[1]['body'][:200]!r}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    gc_s = 0.0
    gc_t0 = 0.0

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        nonlocal gc_s, gc_t0
        if phase == "start":
            gc_t0 = time.perf_counter()
        else:
            gc_s += time.perf_counter() - gc_t0

    await load(min(2000, calls))  # warm-up: imports, caches, the SQLite file
    await proxy.recorder.drain()
    gc.callbacks.append(on_gc)
    out = []
    try:
        for _ in range(rounds):
            gc_s = 0.0
            p0, m0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            await load(calls)
            m1, w1 = time.thread_time(), time.perf_counter()
            await proxy.recorder.drain()  # the writer's CPU for this round's calls is counted too
            p1 = time.process_time()
            out.append(
                Round((m1 - m0) / calls * 1e6, (p1 - p0) / calls * 1e6, gc_s / calls * 1e6, (w1 - w0) / calls * 1e6)
            )
    finally:
        gc.callbacks.remove(on_gc)
        await life_in.put({"type": "lifespan.shutdown"})
        await life
    if record:
        assert proxy.recorder.written_calls >= calls * rounds, proxy.recorder.written_calls
    if tel is not None:
        tel.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--compare-metrics", action="store_true", help="metrics on vs off, rounds alternated")
    parser.add_argument(
        "--compare-telemetry", action="store_true", help="OTLP span export on vs off, rounds alternated"
    )
    args = parser.parse_args()
    import sys

    sys.path.insert(0, str(ROOT))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    from lightning_sdk.proxy.serve import tune_gc_for_serving

    reply = engine_reply()
    tune_gc_for_serving()
    import os

    if args.compare_metrics:
        compare_metrics(args, reply)
        return
    if args.compare_telemetry:
        compare_telemetry(args, reply)
        return
    results = {}
    for record in (True, False):
        results[record] = asyncio.run(measure(args.calls, args.rounds, args.concurrency, record, reply))
    print(
        f"\nthe proxy's own CPU per call, in-process ({args.rounds} x {args.calls:,} calls at concurrency "
        f"{args.concurrency}; an engine reply of {len(reply):,} bytes; load average {os.getloadavg()[0]:.2f})\n"
    )
    on, off = _median_table(results, ("recording (default)", "recording off"))
    print(
        f"\nrecording's share (medians): event loop {on.main_us / off.main_us:.2f}x, process "
        f"{on.process_us / off.process_us:.2f}x, wall {on.wall_us / off.wall_us:.2f}x of the app with recording off"
    )


def _median_table(rounds: dict[bool, list[Round]], labels: tuple[str, str]) -> tuple[Round, Round]:
    """Print the median of each field for the on (True) and off (False) rounds; return the two medians."""
    head = f"{'':<22}{'event loop us':>14}{'process us':>12}{'of which GC':>12}{'wall us':>9}"
    print(head)
    print("-" * len(head))
    med = {}
    for on, label in zip((True, False), labels, strict=True):
        med[on] = Round(*(statistics.median(getattr(r, f) for r in rounds[on]) for f in Round.__dataclass_fields__))
        m = med[on]
        print(f"{label:<22}{m.main_us:>14.1f}{m.process_us:>12.1f}{m.gc_us:>12.1f}{m.wall_us:>9.1f}")
    return med[True], med[False]


def compare_metrics(args: argparse.Namespace, reply: bytes) -> None:
    """Alternate one round with the metrics on and one with them off, ``--rounds`` times; print the medians."""
    import os

    rounds: dict[bool, list[Round]] = {True: [], False: []}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for on in (True, False):
            rounds[on] += asyncio.run(measure(args.calls, 1, args.concurrency, True, reply, metrics=on))
        load.append(os.getloadavg()[0])
    print(
        f"\nthe proxy's own CPU per call with and without the Prometheus metrics ({args.rounds} alternated rounds of "
        f"{args.calls:,} calls each at concurrency {args.concurrency}; load average {min(load):.2f}-{max(load):.2f})\n"
    )
    on_, off = _median_table(rounds, ("metrics on (default)", "metrics off"))
    print(
        f"\nmetrics on / off (medians): event loop {on_.main_us / off.main_us:.3f}x, process "
        f"{on_.process_us / off.process_us:.3f}x, wall {on_.wall_us / off.wall_us:.3f}x"
    )


def _otlp_sink() -> tuple[str, Any]:
    """A loopback OTLP/HTTP endpoint that reads each export and answers 200 (on a thread of this process: its CPU
    counts in "process us", not in the event loop's)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def compare_telemetry(args: argparse.Namespace, reply: bytes) -> None:
    """Alternate one round with span export on (``SpanObserver`` + the OTLP/HTTP exporter to a loopback sink) and
    one with it off (no observer: the default), ``--rounds`` times; print the medians."""
    import os

    url, sink = _otlp_sink()
    rounds: dict[bool, list[Round]] = {True: [], False: []}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for on in (True, False):
            got = asyncio.run(measure(args.calls, 1, args.concurrency, True, reply, telemetry_url=url if on else None))
            rounds[on] += got
        load.append(os.getloadavg()[0])
    sink.shutdown()
    print(
        f"\nthe proxy's own CPU per call with and without OTLP span export ({args.rounds} alternated rounds of "
        f"{args.calls:,} calls each at concurrency {args.concurrency}; load average {min(load):.2f}-{max(load):.2f})\n"
    )
    on_, off = _median_table(rounds, ("telemetry on", "telemetry off"))
    print(
        f"\ntelemetry on / off (medians): event loop {on_.main_us / off.main_us:.3f}x, process "
        f"{on_.process_us / off.process_us:.3f}x, wall {on_.wall_us / off.wall_us:.3f}x"
    )


if __name__ == "__main__":
    main()
