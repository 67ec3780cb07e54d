"""Protocol details real clients read (issue 26 §4), through the official ``anthropic`` and ``openai`` clients: a
streamed Messages call's ``message_start`` carries the prompt's real ``input_tokens`` (token mode: rendered before
the first token; passthrough: from the engine's first chunk); ``max_tokens: 0`` is refused for what it is; a
context overflow quotes the real numbers and no completion budget the request did not ask for. See
tests/surfaces/conftest.py for what is real (a scripted engine over the real Qwen3 template in token mode, a
scripted vLLM-style upstream in passthrough; everything else is the real proxy on loopback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from lightning_sdk.proxy.token_mode import TokenModeBackend
from tests.support.proxy import run_proxy
from tests.surfaces.conftest import ScriptedReply, passthrough_proxy, token_proxy
from tests.tokens.conversations import assistant, renderer_for
from tests.tokens.test_token_mode import ScriptedEngine

_MSGS: Any = [{"role": "user", "content": "Say hello."}]


def _streamed(client: anthropic.Anthropic) -> tuple[int, int]:
    """(``message_start``'s ``input_tokens``, the final message's ``input_tokens``) of one streamed call."""
    start = -1
    with client.messages.stream(model="policy", max_tokens=50, messages=_MSGS) as s:
        for event in s:
            if event.type == "message_start":
                start = event.message.usage.input_tokens
        final = s.get_final_message()
    return start, final.usage.input_tokens


def test_message_start_reports_the_prompt_tokens_in_token_mode(tmp_path: Path) -> None:
    with token_proxy(tmp_path, [assistant("Hello.")]) as (px, engine):
        s = px.session()
        client = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        start, final = _streamed(client)
    assert start == final == len(engine.received[0]) > 0


def test_message_start_reports_the_prompt_tokens_in_passthrough(tmp_path: Path) -> None:
    with passthrough_proxy(tmp_path, [ScriptedReply("Hello.")]) as (px, upstream):
        s = px.session()
        client = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        start, final = _streamed(client)
    prompt_ids = upstream.sampled[0][0]
    assert start == final == len(prompt_ids) > 0


def test_max_tokens_zero_is_refused_for_what_it_is(tmp_path: Path) -> None:
    with passthrough_proxy(tmp_path, [ScriptedReply("Hello.")]) as (px, upstream):
        s = px.session()
        client = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as zero:
            client.messages.create(model="policy", max_tokens=0, messages=_MSGS)
        # the SDK insists on max_tokens: a body without it is sent by hand
        r = px.http.post("/v1/messages", json={"model": "policy", "messages": _MSGS}, headers={"x-api-key": s["token"]})
    message = zero.value.body["error"]["message"]  # type: ignore[index]
    assert message == "max_tokens: must be at least 1, got 0" and "Field required" not in message
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens: Field required"
    assert upstream.requests == []  # refused before anything was sent


def test_context_overflow_quotes_the_real_numbers(tmp_path: Path) -> None:
    renderer = renderer_for("qwen3")
    engine = ScriptedEngine(renderer, [assistant("unused")])
    engine.max_model_len = 64
    long: Any = [{"role": "user", "content": "word " * 200}]
    n_prompt = len(renderer.render(long))
    with run_proxy(policy_backend=TokenModeBackend(engine, renderer), store_path=tmp_path / "s.db") as px:  # type: ignore[arg-type]
        s = px.session()
        client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
        with pytest.raises(openai.BadRequestError) as unasked:
            client.chat.completions.create(model="policy", messages=long)
        with pytest.raises(openai.BadRequestError) as asked:
            client.chat.completions.create(model="policy", messages=long, max_tokens=20)
        claude = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as messages:
            claude.messages.create(model="policy", max_tokens=30, messages=long)
    assert unasked.value.code == "context_length_exceeded"
    assert unasked.value.body["message"] == (  # type: ignore[index]
        f"This model's maximum context length is 64 tokens. However, your messages resulted in {n_prompt} tokens, "
        "which leaves no room for a completion. Please reduce the length of the messages."
    )
    assert f"resulted in {n_prompt} tokens, and 20 in the completion" in asked.value.message
    text = messages.value.body["error"]["message"]  # type: ignore[index]
    assert text.startswith("prompt is too long: This model's maximum context length is 64 tokens")
    assert f"resulted in {len(renderer.render(long))} tokens, and 30 in the completion" in text
    assert engine.received == []  # the engine never saw a prompt that does not fit
