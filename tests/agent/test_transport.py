"""``Http1Transport``: httpx's API over the proxy's pooled HTTP/1.1 client, against real servers on loopback.

What an httpx (or OpenAI SDK) user relies on must hold: the request as sent (method, path, query, headers, body),
the answer as sent (status, headers, content-encoding decoded), bodies that stream as they arrive, keep-alive,
httpx's own errors (so retry logic keeps working), and httpx's behaviour where this transport steps aside (``HEAD``,
an environment proxy).
"""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

import httpx
import openai
import pytest

from lightning_sdk.agent import LLM
from lightning_sdk.agent._transport import Http1Transport
from tests.support.mock_openai import MockOpenAI
from tests.support.servers import free_port, serve_async

RELEASE = asyncio.Event()


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Echoes the request as JSON; ``/gzip`` answers gzip-encoded, ``/sse`` streams three events (the third only
    once the test sets ``RELEASE``), ``/slow`` answers after 2 s."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == "/sse":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(3):
            if i == 2:
                await asyncio.wait_for(RELEASE.wait(), 10)
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/slow":
        await asyncio.sleep(2.0)
    echo = {
        "method": scope["method"],
        "path": path,
        "query": scope["query_string"].decode(),
        "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
        "body": body.decode(),
        "client_port": scope["client"][1],
    }
    data = json.dumps(echo).encode()
    headers = [(b"content-type", b"application/json"), (b"x-echo", b"yes")]
    if path == "/gzip":
        data = gzip.compress(data)
        headers.append((b"content-encoding", b"gzip"))
    await send(
        {"type": "http.response.start", "status": 201, "headers": [*headers, (b"content-length", b"%d" % len(data))]}
    )
    await send({"type": "http.response.body", "body": data})


async def test_requests_and_answers_go_through_unchanged_on_one_kept_alive_connection() -> None:
    async with serve_async(echo_app) as srv, httpx.AsyncClient(transport=Http1Transport()) as client:
        r = await client.post(srv.url + "/a/b?x=1&y=%20", json={"k": [1, 2]}, headers={"Authorization": "Bearer t"})
        assert r.status_code == 201 and r.headers["x-echo"] == "yes"
        echo = r.json()
        assert echo["method"] == "POST" and echo["path"] == "/a/b" and echo["query"] == "x=1&y=%20"
        assert json.loads(echo["body"]) == {"k": [1, 2]}
        assert echo["headers"]["authorization"] == "Bearer t"
        assert echo["headers"]["host"] == f"127.0.0.1:{srv.port}"
        assert echo["headers"]["content-length"] == str(len(echo["body"]))
        ports = {(await client.get(srv.url + "/p")).json()["client_port"] for _ in range(20)}
        assert ports == {echo["client_port"]}  # keep-alive: one connection for 21 requests
        g = await client.get(srv.url + "/gzip")
        assert g.headers["content-encoding"] == "gzip" and g.json()["path"] == "/gzip"  # decoded by httpx


async def test_bodies_stream_as_they_arrive() -> None:
    """The third event is only sent once the test has read the first two: a transport that read the whole body
    before answering would wait for ever (here: time out)."""
    RELEASE.clear()
    async with serve_async(echo_app) as srv, httpx.AsyncClient(transport=Http1Transport()) as client:
        seen = b""
        async with client.stream("GET", srv.url + "/sse") as r:
            assert r.headers["content-type"] == "text/event-stream"
            async for chunk in r.aiter_bytes():
                seen += chunk
                if seen.count(b"\n\n") == 2:
                    RELEASE.set()
        assert seen == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        assert (await client.get(srv.url + "/after")).json()["path"] == "/after"  # the connection was reused fine


async def test_failures_are_httpx_errors() -> None:
    async with serve_async(echo_app) as srv, httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{free_port()}/x")
        with pytest.raises(httpx.ReadTimeout):
            await client.get(srv.url + "/slow", timeout=httpx.Timeout(5.0, read=0.3))
        assert (await client.get(srv.url + "/ok")).json()["path"] == "/ok"  # the pool recovers


async def test_head_and_environment_proxies_go_to_httpx_own_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serve_async(echo_app) as srv:
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
            head = await client.head(srv.url + "/h")
            assert head.status_code == 201 and head.content == b""
        dead_proxy = f"http://127.0.0.1:{free_port()}"
        monkeypatch.setenv("HTTP_PROXY", dead_proxy)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
            with pytest.raises(httpx.ConnectError):  # sent to the (dead) proxy, as httpx would; the server is up
                await client.get(srv.url + "/p")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        async with httpx.AsyncClient(transport=Http1Transport()) as client:
            assert (await client.get(srv.url + "/p")).json()["path"] == "/p"


async def test_the_openai_client_of_an_llm_runs_on_it() -> None:
    """``LLM.async_openai_client()`` sends through ``Http1Transport`` (built for the httpx the SDK uses): the same
    completions, streamed or not, as the SDK's own transport gets from the same server."""
    mock = MockOpenAI()
    async with serve_async(mock.app) as srv:
        llm = LLM(base_url=srv.url + "/v1", api_key="k", model="policy")
        fast = llm.async_openai_client(max_retries=0)
        plain = openai.AsyncOpenAI(base_url=llm.base_url, api_key="k", max_retries=0)
        assert type(fast._client._transport).__name__ == "Transport"
        messages: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]
        a = await fast.chat.completions.create(model="policy", messages=messages)
        b = await plain.chat.completions.create(model="policy", messages=messages)
        assert a.choices[0].message.content == b.choices[0].message.content and a.usage == b.usage
        stream = await fast.chat.completions.create(model="policy", messages=messages, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == a.choices[0].message.content
        await fast.close()
        await plain.close()
