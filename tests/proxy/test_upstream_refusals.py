"""An upstream's refusal reaches every surface through the one mapping (``proxy.call.upstream_refusal``): its status,
its message and a ``context_length_exceeded`` code for a prompt that does not fit, streamed or not, and the call is
recorded with the same error. A 429 with ``Retry-After`` reaches the agent as a 429 with that header once the
proxy's own retries are spent (not a 502). Real proxy on loopback in front of a loopback upstream that answers the
scripted error the way vLLM does, a real SQLite store, the real ``openai`` and ``anthropic`` clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lightning_sdk.types import Call
from tests.support.proxy import ProxyHandle, run_proxy
from tests.support.servers import run_server

OVERFLOW = (
    "This model's maximum context length is 1024 tokens. However, you requested 1100 tokens (1090 in the messages, "
    "10 in the completion). Please reduce the length of the messages or completion."
)
_MSGS: Any = [{"role": "user", "content": "a long prompt"}]


class Refusing:
    """An upstream that answers every chat completion with ``status`` and vLLM's error body."""

    def __init__(self) -> None:
        self.status = 400
        self.message = OVERFLOW
        self.headers: dict[str, str] = {}
        self.requests = 0
        self.app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])])

    async def _chat(self, request: Request) -> Response:
        await request.body()
        self.requests += 1
        body = {"error": {"message": self.message, "type": "BadRequestError", "param": None, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@pytest.fixture
def refusing(tmp_path: Path) -> Iterator[tuple[ProxyHandle, Refusing]]:
    upstream = Refusing()
    with run_server(upstream.app) as srv, run_proxy(srv.url + "/v1", store_path=tmp_path / "s.db") as px:
        yield px, upstream


def _calls(px: ProxyHandle, rollout_id: str) -> list[Call]:
    px.drain()
    return sorted(px.call(px.store.get_rollout(rollout_id)).attempts[0].calls, key=lambda c: c.seq)


def test_context_overflow_is_the_same_refusal_on_every_surface(refusing: tuple[ProxyHandle, Refusing]) -> None:
    px, _ = refusing
    s = px.session({"q": 1})
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as plain:
        client.chat.completions.create(model="policy", messages=_MSGS, max_tokens=10)
    assert plain.value.status_code == 400 and OVERFLOW in str(plain.value)
    with pytest.raises(openai.BadRequestError) as streamed:
        list(client.chat.completions.create(model="policy", messages=_MSGS, max_tokens=10, stream=True))
    assert streamed.value.status_code == 400 and OVERFLOW in str(streamed.value)
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model="policy", input="a long prompt", max_output_tokens=10)
    assert responses.value.code == "context_length_exceeded" and OVERFLOW in str(responses.value)
    claude = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as messages:
        claude.messages.create(model="policy", max_tokens=10, messages=_MSGS)
    assert messages.value.status_code == 400
    assert messages.value.body["error"]["message"] == f"prompt is too long: {OVERFLOW}"  # type: ignore[index]
    calls = _calls(px, s["rollout_id"])
    assert len(calls) == 4
    for call in calls:  # recorded alike: the upstream's message, its status, the code
        assert call.error == OVERFLOW
        assert call.checks["http_status"] == 400 and call.checks["error_code"] == "context_length_exceeded"


def test_an_upstream_429_is_relayed_with_its_retry_after(refusing: tuple[ProxyHandle, Refusing]) -> None:
    px, upstream = refusing
    upstream.status, upstream.message, upstream.headers = 429, "rate limited: slow down", {"Retry-After": "7"}
    s = px.session({"q": 1})
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="policy", messages=_MSGS, max_tokens=10)
    assert limited.value.status_code == 429 and limited.value.response.headers["retry-after"] == "7"
    assert "rate limited: slow down" in str(limited.value)
    assert upstream.requests > 1  # the proxy retried first (its own back-off), then relayed the upstream's answer
    claude = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as claude_limited:
        claude.messages.create(model="policy", max_tokens=10, messages=_MSGS, stream=False)
    assert claude_limited.value.response.headers["retry-after"] == "7"
    assert claude_limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    (first, _) = _calls(px, s["rollout_id"])
    assert first.checks["http_status"] == 429
