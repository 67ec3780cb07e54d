"""Every route: the body limit before reading (413), a read timeout for incomplete requests (408), one bearer parser,
400 for out-of-range integers on store routes, a bounded enqueue, a client hanging up mid-body not logged as an
error, and hand-opened sessions traced (not trained) unless the request names a split and a group.

Real proxy app under uvicorn on loopback, real SQLite store, httpx and raw sockets as clients.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lightning_sdk.proxy import ProxyConfig
from tests.support.proxy import ADMIN_KEY, ProxyHandle, run_proxy
from tests.support.servers import RunningServer
from tests.support.waiting import until

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def strict_px(upstream: RunningServer, tmp_path: Path) -> Iterator[ProxyHandle]:
    config = ProxyConfig(max_body_bytes=64 * 1024, max_control_body_bytes=4096, read_timeout_s=0.5)
    with run_proxy(upstream.url + "/v1", store_path=tmp_path / "s.db", config=config) as handle:
        yield handle


def _raw(px: ProxyHandle, head: bytes, body: bytes = b"", *, wait_s: float = 3.0, close: bool = False) -> bytes:
    """Send raw bytes to the proxy and return what it answers within ``wait_s`` (b"" when it answers nothing)."""
    with socket.create_connection((px.server.host, px.server.port)) as sock:
        sock.sendall(head + body)
        if close:
            return b""
        sock.settimeout(wait_s)
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
                more = sock.recv(65536)
                if not more:
                    break
                data += more
        except TimeoutError:
            pass
        return data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


@pytest.mark.parametrize(
    "path",
    ["/lightning/v1/finish", "/lightning/v1/reward", "/lightning/v1/sessions", "/t/tok/lightning/v1/finish"],
)
def test_control_routes_refuse_big_bodies_before_reading_or_authenticating(strict_px: ProxyHandle, path: str) -> None:
    """413 from the Content-Length alone (nothing read, no key needed to be refused), and for a chunked body as
    soon as the limit is passed."""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {256 * 2**20}\r\n\r\n"
    answer = _raw(strict_px, head.encode(), b"{")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
    assert b"request_too_large" in answer

    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b"x" * 1000

    r = strict_px.http.post(path, content=chunks(), headers={"Authorization": "Bearer nope"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_store_routes_have_the_body_limit_too(strict_px: ProxyHandle) -> None:
    big = {"calls": [], "pad": "x" * (80 * 1024)}
    r = strict_px.http.post("/lightning/v1/store/calls", json=big, headers=strict_px.admin)
    assert r.status_code == 413


@pytest.mark.parametrize("path", ["/lightning/v1/finish", "/v1/chat/completions", "/lightning/v1/store/calls"])
def test_incomplete_request_bodies_are_closed_after_the_read_timeout(strict_px: ProxyHandle, path: str) -> None:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    t0 = time.monotonic()
    answer = _raw(strict_px, head.encode(), b'{"status": ', wait_s=5.0)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert 0.4 <= time.monotonic() - t0 < 4.0
    assert b"incomplete request" in answer


def test_client_hanging_up_mid_body_is_not_an_error(strict_px: ProxyHandle, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        for path in ("/lightning/v1/finish", "/v1/chat/completions", "/lightning/v1/store/calls"):
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
            _raw(strict_px, head.encode(), b'{"a": ', close=True)
        # connections are accepted in order: once this later one is answered (and closed), the three were accepted,
        # and the server is settled once their handlers returned
        assert strict_px.http.get("/lightning/v1/health", headers={"Connection": "close"}).status_code == 200
        until(strict_px.server.settled, timeout=10, what="the three handlers to end")
        assert strict_px.http.get("/lightning/v1/health").status_code == 200
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_one_bearer_parser_for_every_route(px: ProxyHandle, scheme: str) -> None:
    admin = {"Authorization": f"{scheme}  {ADMIN_KEY}"}
    assert px.http.get("/lightning/v1/store/counts", headers=admin).status_code == 200
    assert px.http.get("/lightning/v1/rollouts", headers=admin).status_code == 200
    s = px.http.post("/lightning/v1/sessions", json={}, headers=admin).json()
    token = {"Authorization": f"{scheme} {s['token']}"}
    assert px.http.post("/v1/chat/completions", json=CHAT, headers=token).status_code == 200
    assert px.http.post("/lightning/v1/reward", json={"value": 1}, headers=token).status_code == 200
    assert px.http.post("/lightning/v1/finish", json={"status": "succeeded"}, headers=token).status_code == 200


def test_401_and_409_say_do_not_retry(px: ProxyHandle) -> None:
    for r in (
        px.http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer nope"}),
        px.http.get("/lightning/v1/store/counts"),
        px.http.get("/lightning/v1/rollouts"),
    ):
        assert r.status_code == 401 and r.headers["x-should-retry"] == "false"


HUGE = 2**64 - 1


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/rollouts?limit=18446744073709551615", None),
        ("GET", "/groups/finished?limit=18446744073709551615", None),
        ("POST", "/enqueue", {"tasks": [{"q": 1}], "max_attempts": HUGE}),
        ("POST", "/enqueue", {"tasks": [{"q": 1}], "n": 100_000}),
        ("POST", "/versions", {"version": HUGE}),
        ("POST", "/groups/consume", {"step": HUGE, "group_ids": ["g"]}),
    ],
)
def test_store_routes_answer_400_for_out_of_range_integers(
    px: ProxyHandle, method: str, path: str, body: dict[str, object] | None
) -> None:
    r = px.http.request(method, "/lightning/v1/store" + path, json=body, headers=px.admin)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_call_with_an_out_of_range_seq_is_refused_by_the_store_route(px: ProxyHandle) -> None:
    s = px.session()
    call = {"call_id": "c1", "attempt_id": s["attempt_id"], "rollout_id": s["rollout_id"], "seq": HUGE, "model": "m"}
    r = px.http.post("/lightning/v1/store/calls", json={"calls": [call]}, headers=px.admin)
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    assert px.http.get("/lightning/v1/health").status_code == 200


def test_hand_opened_sessions_are_traced_not_trained_unless_split_and_group_are_given(px: ProxyHandle) -> None:
    traced = px.session({"q": 1})
    assert traced["split"] == "traced"
    r = px.http.post("/lightning/v1/sessions", json={"split": "train"}, headers=px.admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "split"
    trained = px.http.post(
        "/lightning/v1/sessions", json={"task": {"q": 2}, "split": "train", "group": "g-hand"}, headers=px.admin
    ).json()
    assert trained["split"] == "train" and trained["group"] == "g-hand"
    for s in (traced, trained):
        px.http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {s['token']}"})
        assert px.finish(s["token"]).status_code == 200
    train_groups = px.call(px.store.finished_groups(split="train"))
    assert [g.group.group_id for g in train_groups] == ["g-hand"]  # what a trainer daemon would train
    (traced_group,) = px.call(px.store.finished_groups(split="traced"))
    assert traced_group.rollouts[0].rollout.rollout_id == traced["rollout_id"]
    assert px.rollout(traced["rollout_id"])["split"] == "traced"


def test_models_retrieve(px: ProxyHandle) -> None:
    import openai

    s = px.session()
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    model = client.models.retrieve("policy")
    assert model.id == "policy" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-served")
    assert httpx.get(px.url + "/v1/models/policy").status_code == 200


def test_incomplete_requests_are_closed_by_the_serving_protocol(upstream: RunningServer, tmp_path: Path) -> None:
    """The proxy's uvicorn protocol (``serve.header_timeout_protocol``) answers 408 and closes a connection whose
    request (headers or body) stays incomplete and silent (a silent new connection too); complete requests and idle
    keep-alive connections are unaffected."""
    from lightning_sdk.proxy.serve import header_timeout_protocol
    from lightning_sdk.store import SQLiteStore
    from tests.support.proxy import proxy_app
    from tests.support.servers import run_server

    app = proxy_app(SQLiteStore(tmp_path / "h.db"), upstream.url + "/v1")
    with run_server(app, http=header_timeout_protocol(0.5)) as srv:
        partial_body = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"
        for sent in (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le", b"", partial_body):
            with socket.create_connection((srv.host, srv.port)) as sock:
                t0 = time.monotonic()
                sock.sendall(sent)
                sock.settimeout(5.0)
                data = b""
                while chunk := sock.recv(4096):
                    data += chunk
                assert 0.4 <= time.monotonic() - t0 < 4.0
            assert data.startswith(b"HTTP/1.1 408") and b"incomplete request" in data
        with httpx.Client(base_url=srv.url) as client:  # keep-alive requests, slower than the timeout apart
            assert client.get("/lightning/v1/health").status_code == 200
            time.sleep(0.7)
            assert client.get("/lightning/v1/health").status_code == 200


def test_serving_protocol_sends_each_response_in_one_write_and_never_holds_headers_back() -> None:
    """The proxy's uvicorn protocol writes a response's status line and headers together with its body (one write
    reaches the socket per response: counted on the server's real transport), and headers of a response whose body
    comes later still go out at once (a stream's first chunk may take long)."""
    import asyncio
    from typing import Any

    from lightning_sdk.proxy.serve import header_timeout_protocol
    from tests.support.servers import run_server

    writes: list[bytes] = []

    class Counting:
        """The server's transport, counting what reaches it (everything else goes to the real one)."""

        def __init__(self, transport: Any) -> None:
            self._t = transport

        def write(self, data: bytes) -> None:
            writes.append(bytes(data))
            self._t.write(data)

        def writelines(self, parts: Any) -> None:
            writes.append(b"".join(parts))
            self._t.writelines(parts)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._t, name)

    base = header_timeout_protocol(5.0)

    class Protocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(Counting(transport))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        if scope["path"] == "/slow":  # headers now, the body 0.5 s later
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
            await asyncio.sleep(0.5)
            await send({"type": "http.response.body", "body": b"late"})
            return
        body = b'{"n": "%s"}' % scope["path"].encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]}
        )
        await send({"type": "http.response.body", "body": body})

    with run_server(app, http=Protocol) as srv:
        with httpx.Client(base_url=srv.url) as client:  # one keep-alive connection
            for i in range(5):
                r = client.get(f"/r{i}")
                assert r.status_code == 200 and r.json() == {"n": f"/r{i}"}
        assert len(writes) == 5
        assert all(w.startswith(b"HTTP/1.1 200 OK\r\n") and w.endswith(b'"}') for w in writes)
        with socket.create_connection((srv.host, srv.port)) as sock:
            sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(5.0)
            t0 = time.monotonic()
            head = sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 200 OK") and time.monotonic() - t0 < 0.4
            rest = head
            while not rest.endswith(b"late"):
                rest += sock.recv(4096)
            assert time.monotonic() - t0 >= 0.4


def _exchange(host: str, port: int, chunks: list[bytes]) -> tuple[bytes, bool]:
    """Send ``chunks`` on a new connection (stopping if the server closes it) and read until the server closes:
    (everything answered, whether every chunk went out)."""
    with socket.create_connection((host, port)) as sock:
        sent_all = True
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except OSError:  # the server answered and closed while the client was still sending
            sent_all = False
        sock.settimeout(5.0)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    return data, sent_all


def test_request_heads_over_the_limit_get_431_and_the_connection_closed(px: ProxyHandle) -> None:
    """uvicorn with httptools takes request headers without limit (20 MB were accepted); the proxy's protocol
    answers 431 (OpenAI error shape) once a request's line and headers pass ``MAX_HEAD_BYTES`` and closes, whether
    the head comes in one piece or dribbles in; a large head under the limit is served."""
    from lightning_sdk.proxy.serve import MAX_HEAD_BYTES

    line = b"X-Filler: " + b"a" * 4000 + b"\r\n"
    start = b"GET /lightning/v1/health HTTP/1.1\r\nHost: x\r\n"
    n_over = MAX_HEAD_BYTES // len(line) + 2
    for chunks in ([start + line * n_over], [start, *[line] * 200]):  # one piece; a dribble far past the limit
        data, _ = _exchange("127.0.0.1", px.server.port, chunks)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 "), data[:80]
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and str(MAX_HEAD_BYTES) in error["message"]
    under = MAX_HEAD_BYTES // len(line) - 2
    data, sent_all = _exchange("127.0.0.1", px.server.port, [start + line * under + b"Connection: close\r\n\r\n"])
    assert sent_all and data.startswith(b"HTTP/1.1 200 "), data[:80]


def test_unparsable_requests_get_400_in_the_openai_error_shape(px: ProxyHandle) -> None:
    """A request the HTTP parser refuses (a bad request line, a bad header) is answered 400 with the proxy's JSON
    error body (uvicorn's own is plain text) and the connection is closed."""
    for raw in (b"GARBAGE\x01 / HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
        data, _ = _exchange("127.0.0.1", px.server.port, [raw])
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), data[:80]
        assert b"application/json" in head and b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert error["message"].startswith("invalid HTTP request")  # a bad request line: it says which part
        assert {**error, "message": "invalid HTTP request"} == {
            "message": "invalid HTTP request",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
