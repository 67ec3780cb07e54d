"""Passthrough in front of a faulty upstream: every malformed answer is an OpenAI-shaped 502 (a stream ends with an
error event, then ``[DONE]``) and the call is recorded with its error; credentials in the upstream URL are used as
basic auth and never echoed; the proxy command starts before its upstream (503 + ``Retry-After`` meanwhile).

The faulty upstreams are small starlette apps on loopback that answer one scripted body (what a broken or
non-vLLM server sends); the proxy, the store (SQLite file) and the clients (httpx, openai) are the real ones.
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lightning_sdk.store import SQLiteStore
from tests.support.mock_openai import MockOpenAI
from tests.support.proxy import ProxyHandle, run_proxy
from tests.support.servers import free_port, run_server
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def _good_choice(**over: Any) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "ok"},
        "finish_reason": "stop",
        "token_ids": [10, 11],
        "logprobs": {"content": [{"token": "o", "logprob": -0.1}, {"token": "k", "logprob": -0.2}]},
    }
    choice.update(over)
    return choice


def _answer(**over: Any) -> dict[str, Any]:
    body = {"id": "x", "object": "chat.completion", "model": "policy", "prompt_token_ids": [1, 2, 3]}
    body["choices"] = [_good_choice()]
    body.update(over)
    return body


MALFORMED: dict[str, bytes] = {
    "a JSON list": b"[1, 2, 3]",
    "choices is a string": orjson.dumps(_answer(choices="x")),
    "a choice is a number": orjson.dumps(_answer(choices=[7])),
    "logprob null": orjson.dumps(
        _answer(choices=[_good_choice(logprobs={"content": [{"token": "o", "logprob": None}]})])
    ),
    "logprob not a number": orjson.dumps(
        _answer(choices=[_good_choice(logprobs={"content": [{"token": "o", "logprob": "low"}]})])
    ),
    "token id not an integer": orjson.dumps(_answer(choices=[_good_choice(token_ids=[10, 1.5])])),
    "token id out of range": orjson.dumps(_answer(choices=[_good_choice(token_ids=[10, 2**31])])),
    "prompt id negative": orjson.dumps(_answer(prompt_token_ids=[1, -4])),
    "token id true": orjson.dumps(_answer(choices=[_good_choice(token_ids=[10, True])])),
    "token id a string": orjson.dumps(_answer(choices=[_good_choice(token_ids=[10, "11"])])),
    "prompt ids nested": orjson.dumps(_answer(prompt_token_ids=[[1, 2], 3])),
    "prompt id beyond 64 bits": b'{"choices": [], "prompt_token_ids": [1, 18446744073709551616]}',
    "logprob missing": orjson.dumps(_answer(choices=[_good_choice(logprobs={"content": [{"token": "o"}, {}]})])),
    "logprob true": orjson.dumps(_answer(choices=[_good_choice(logprobs={"content": [{"logprob": True}] * 2})])),
    "usage a list": orjson.dumps(_answer(usage=[1, 2])),
}


def _scripted(body: bytes, *, content_type: str = "application/json", stream_body: bytes | None = None) -> Starlette:
    async def chat(request: Request) -> Response:
        data = await request.json()
        if data.get("stream"):
            return Response(stream_body if stream_body is not None else body, media_type=content_type)
        return Response(body, media_type="application/json")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "policy", "object": "model"}]})

    return Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models, methods=["GET"])]
    )


@pytest.fixture
def faulty(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ProxyHandle]:
    app = _scripted(**request.param)
    with run_server(app) as upstream, run_proxy(upstream.url + "/v1", store_path=tmp_path / "s.db") as px:
        yield px


def _assert_recorded_failed(px: ProxyHandle, rollout_id: str, fragment: str) -> None:
    [call] = px.calls(rollout_id)
    assert call["error"] is not None and fragment in call["error"], call["error"]
    assert call["completion_ids"] == [] and call["checks"]["http_status"] == 502


@pytest.mark.parametrize(
    ("faulty", "fragment"),
    [({"body": body}, "malformed") for body in MALFORMED.values()],
    ids=list(MALFORMED),
    indirect=["faulty"],
)
def test_malformed_answer_is_502_and_recorded(faulty: ProxyHandle, fragment: str) -> None:
    px = faulty
    s = px.session()
    r = px.http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {s['token']}"})
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["type"] == "upstream_error" and "malformed" in err["message"]
    fin = px.finish(s["token"]).json()
    assert fin["calls"] == 1 and fin["calls_failed"] == 1
    _assert_recorded_failed(px, s["rollout_id"], fragment)


def _stream_events(r: httpx.Response) -> list[bytes]:
    return [line[6:] for line in r.content.split(b"\n") if line.startswith(b"data: ")]


GOOD_CHUNK = orjson.dumps(
    {
        "id": "x",
        "object": "chat.completion.chunk",
        "model": "policy",
        "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "o"}, "token_ids": [10]}],
    }
)


@pytest.mark.parametrize(
    ("faulty", "fragment", "started"),
    [
        ({"body": b"{}", "stream_body": b'{"not": "sse"}'}, "not a server-sent-event stream", False),
        ({"body": b"{}", "stream_body": b"hello\n\nworld\n", "content_type": "text/event-stream"}, "single", False),
        (
            {
                "body": b"{}",
                "stream_body": b"data: " + GOOD_CHUNK + b"\n\ndata: [1, 2]\n\n",
                "content_type": "text/event-stream",
            },
            "malformed",
            True,
        ),
        (
            {
                "body": b"{}",
                "stream_body": b"data: " + GOOD_CHUNK.replace(b"[10]", b"[4294967296]") + b"\n\ndata: [DONE]\n\n",
                "content_type": "text/event-stream",
            },
            "malformed",
            True,
        ),
        (
            {"body": b"{}", "stream_body": b'data: {"choices": "x"}\n\n', "content_type": "text/event-stream"},
            "malformed",
            False,
        ),
    ],
    ids=["json-not-sse", "no-events", "chunk-a-list", "stream-id-out-of-range", "chunk-choices-a-string"],
    indirect=["faulty"],
)
def test_malformed_stream_is_502_or_an_error_event_and_recorded(
    faulty: ProxyHandle, fragment: str, started: bool
) -> None:
    """Before the first chunk reaches the agent: a 502 status. After: the stream ends with an OpenAI error event
    and ``data: [DONE]``. Either way the call is recorded with the error."""
    px = faulty
    s = px.session()
    r = px.http.post(
        "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"Authorization": f"Bearer {s['token']}"}
    )
    if not started:
        assert r.status_code == 502, r.text
        assert fragment in r.json()["error"]["message"]
    else:
        assert r.status_code == 200
        events = _stream_events(r)
        assert events[-1] == b"[DONE]"
        err = orjson.loads(events[-2])["error"]
        assert err["type"] == "upstream_error" and fragment in err["message"]
    assert px.finish(s["token"]).json()["calls_failed"] == 1
    _assert_recorded_failed(px, s["rollout_id"], fragment)


def test_the_openai_client_sees_a_malformed_stream_as_an_error(tmp_path: Path) -> None:
    body = b"data: " + GOOD_CHUNK + b'\n\ndata: {"choices": [{"index": 0, "delta": "x"}]}\n\ndata: [DONE]\n\n'
    app = _scripted(b"{}", stream_body=body, content_type="text/event-stream")
    with run_server(app) as upstream, run_proxy(upstream.url + "/v1", store_path=tmp_path / "s.db") as px:
        s = px.session()
        client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
        stream = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        with pytest.raises(openai.APIError, match="malformed"):
            for _ in stream:
                pass
        _assert_recorded_failed(px, s["rollout_id"], "malformed")


# -- credentials ---------------------------------------------------------------------------------------------------
def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


class _BasicAuthGate:
    """An ASGI wrapper that answers 401 unless the request carries the expected basic auth; counts what it saw."""

    def __init__(self, app: Any, expected: str) -> None:
        self.app = app
        self.expected = expected.encode()
        self.seen: list[bytes | None] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization")
            self.seen.append(auth)
            if auth != self.expected:
                await JSONResponse({"error": {"message": "bad credentials"}}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refused(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port`` any more."""
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return True
    return False


def test_upstream_credentials_are_basic_auth_and_never_echoed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = "s3cr3t-pw"
    gate = _BasicAuthGate(MockOpenAI().app, _basic("agent", secret))
    with run_server(gate) as upstream:
        url = upstream.url.replace("http://", f"http://agent:{secret}@") + "/v1"
        with caplog.at_level(logging.DEBUG), run_proxy(url, store_path=tmp_path / "s.db", max_retries=1) as px:
            s = px.session()
            client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
            r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content
            assert gate.seen[-1] == _basic("agent", secret).encode()
            # now the upstream goes away: the 502 the agent sees and the recorded error name it without the password
            upstream.server.should_exit = True
            until(lambda: _refused(upstream.host, upstream.port), timeout=20, what="the upstream to stop listening")
            bad = px.http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {s['token']}"})
            assert bad.status_code == 502 and upstream.url.split("//")[1] in bad.text
            health = px.http.get("/lightning/v1/health").text
            calls = px.calls(s["rollout_id"])
    assert calls[1]["error"] and "agent:" not in calls[1]["error"]
    for text in (bad.text, health, orjson.dumps(calls).decode(), caplog.text):
        assert secret not in text


# -- starting before the upstream ----------------------------------------------------------------------------------
def test_proxy_command_starts_before_its_upstream(tmp_path: Path) -> None:
    """``lightning-sdk proxy`` starts while its upstream is down: health says ``waiting``, calls get 503 with
    ``Retry-After``; once the upstream is up (on the same port), health says ``ready`` and calls are served."""
    up_port, port = free_port(), free_port()
    secret = "pw-before"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("OPENAI_API_KEY", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lightning_sdk",
            "proxy",
            "--upstream",
            f"http://u:{secret}@127.0.0.1:{up_port}/v1",
            "--store",
            str(tmp_path / "s.db"),
            "--port",
            str(port),
            "--admin-key",
            "k",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        health: dict[str, Any] = {}

        def answers() -> bool:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                health.update(httpx.get(url + "/lightning/v1/health", timeout=1).json())
            except httpx.HTTPError:
                return False
            return True

        until(answers, timeout=60, what="the proxy's health", every=0.1)
        assert health["upstream"]["state"] == "waiting" and secret not in str(health)
        s = httpx.post(url + "/lightning/v1/sessions", json={}, headers={"Authorization": "Bearer k"}).json()
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {s['token']}"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "service_unavailable_error" and secret not in r.text
        gate = _BasicAuthGate(MockOpenAI().app, _basic("u", secret))
        with run_server(gate, port=up_port):
            until(
                lambda: httpx.get(url + "/lightning/v1/health", timeout=1).json()["upstream"]["state"] == "ready",
                timeout=60,
                what="the upstream ready",
                every=0.1,
            )
            client = openai.OpenAI(base_url=url + "/v1", api_key=s["token"], max_retries=0)
            reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content == "Hello from the mock upstream."
            fin = httpx.post(
                url + "/lightning/v1/finish",
                json={"status": "succeeded"},
                headers={"Authorization": f"Bearer {s['token']}"},
            )
            assert fin.json()["calls"] == 2 and fin.json()["calls_failed"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert secret not in out and "Traceback" not in out
    store = SQLiteStore(tmp_path / "s.db")
    import asyncio

    detail = asyncio.run(store.get_rollout(s["rollout_id"]))
    asyncio.run(store.close())
    calls = sorted(detail.attempts[0].calls, key=lambda c: c.seq)
    assert calls[0].error is not None and calls[0].checks["http_status"] == 503 and calls[1].error is None
