"""The proxy end to end in token-in/token-out mode, and the retokenization fallback.

The agent side is the real ``openai`` client over loopback HTTP (uvicorn on a free port) against the real proxy app
with a real SQLite store file and the real Qwen3 tokenizer and chat template. The engine is a fake: no GPU engine
(SGLang, vLLM, the embedded one) runs in this test, so ``ScriptedEngine`` stands in for one — it records the ids it
is given and "samples" ids from the real tokenizer's vocabulary (a scripted reply's template tokens, or random
vocabulary ids) with log-probs from a seeded RNG, exactly what the records must then contain.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from lightning_sdk.engines.base import Engine, Generation, GenerationDelta, Sampling
from lightning_sdk.proxy import PassthroughBackend
from lightning_sdk.proxy._backend import CallContext, ChatResult
from lightning_sdk.proxy._errors import ProxyHTTPError
from lightning_sdk.proxy._shapes import ChatStreamAssembler
from lightning_sdk.proxy.token_mode import RetokenizingBackend, TokenModeBackend, TokenModeConfig
from lightning_sdk.store.sqlite import SQLiteStore
from lightning_sdk.tokens import ChatRenderer, get_parser
from lightning_sdk.types import Attempt, Call
from tests.support.mock_openai import MockOpenAI
from tests.support.proxy import ADMIN_KEY, proxy_app
from tests.support.servers import run_server, serve_async
from tests.tokens.conversations import TOOLS, Message, assistant, renderer_for, reply_ids, tool_call

ADMIN = ADMIN_KEY  # the one test proxy harness's key (tests/support/proxy.py)
Plan = Message | int | list[int]  # a scripted reply message, a number of random vocabulary tokens, or exact ids


class ScriptedEngine(Engine):
    """A fake ``Engine`` over a real tokenizer (see the module docstring). Its capabilities are plain attributes a
    test sets (``max_model_len``: what the proxy reads as the policy's context, None: unknown)."""

    max_model_len: int | None = None
    supports_response_format = False
    supports_top_logprobs = False

    def __init__(self, renderer: ChatRenderer, plans: list[Plan], *, version: int = 7, seed: int = 0) -> None:
        self.renderer = renderer
        self.plans = list(plans)
        self.version = version
        self.rng = random.Random(seed)
        self.received: list[list[int]] = []
        self.sampled: list[list[int]] = []
        self.logprobs: list[list[float]] = []
        self.sampling: list[Sampling] = []
        n_plain = renderer.tokenizer.vocab_size  # ids below are ordinary vocabulary (no control tokens)
        self.vocab = [i for i in range(0, n_plain, 7)]

    @property
    def policy_version(self) -> int:
        return self.version

    def _sample(self, input_ids: list[int], sampling: Sampling) -> tuple[list[int], list[float], str]:
        plan = self.plans.pop(0)
        if isinstance(plan, int):
            stop = self.renderer.token_id(self.renderer.family.stops[0])
            ids = [self.rng.choice(self.vocab) for _ in range(plan)] + [stop]
        elif isinstance(plan, list):
            ids = list(plan)
        else:
            ids = reply_ids(self.renderer, [{"role": "user", "content": "x"}], plan, None)
        finish = "stop"
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        lps = [round(-self.rng.random() * 3, 6) for _ in ids]
        self.received.append(list(input_ids))
        self.sampled.append(ids)
        self.logprobs.append(lps)
        self.sampling.append(sampling)
        return ids, lps, finish

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        ids, lps, finish = self._sample(input_ids, sampling)
        return Generation(completion_ids=ids, logprobs=lps, finish_reason=finish, policy_version=self.version)  # type: ignore[arg-type]

    async def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        ids, lps, finish = self._sample(input_ids, sampling)
        for i in range(0, len(ids), 3):
            last = i + 3 >= len(ids)
            yield GenerationDelta(
                ids=ids[i : i + 3],
                logprobs=lps[i : i + 3],
                finish_reason=finish if last else None,  # type: ignore[arg-type]
                policy_version=self.version,
            )

    async def update_weights(self, source: Any, version: int) -> None:
        self.version = version

    async def close(self) -> None:
        return None


async def _session(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{url}/lightning/v1/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
        r.raise_for_status()
        return dict(r.json())


async def _finish(url: str, token: str) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.post(
            f"{url}/lightning/v1/finish", json={"status": "succeeded"}, headers={"Authorization": f"Bearer {token}"}
        )
        r.raise_for_status()


def _as_sent(message: Any) -> Message:
    """What an agent sends back: the SDK message as a dict (reasoning_content included, as the SDK keeps extras)."""
    return dict(message.model_dump(exclude_none=True))


@pytest.mark.parametrize("history", ["exact", "template"])
async def test_token_mode_end_to_end_records_exactly_what_the_engine_saw_and_sampled(
    tmp_path: Any, history: str
) -> None:
    renderer = renderer_for("qwen3")
    calls = [tool_call("get_weather", {"city": "Paris"}, "call00001"), tool_call("add", {"a": 1, "b": 2}, "call00002")]
    plans: list[Plan] = [
        assistant(None, reasoning="Two tools at once.", calls=calls),  # parallel tool calls
        24,  # streamed: random vocabulary tokens
        assistant("It is 18 degrees in Paris; 1 + 2 = 3.", reasoning="Summarise."),
        assistant("Rome: also sunny.", reasoning="Short answer."),
    ]
    engine = ScriptedEngine(renderer, plans)
    backend = TokenModeBackend(engine, renderer, config=TokenModeConfig(history=history))  # type: ignore[arg-type]
    assert isinstance(engine, Engine)
    store = SQLiteStore(tmp_path / "store.db")
    app = proxy_app(store, policy_backend=backend)
    try:
        async with serve_async(app) as srv:
            session = await _session(srv.url)
            client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=session["token"], max_retries=0)
            msgs: list[Message] = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris, and 1+2?"},
            ]
            # 1: parallel tool calls
            r1 = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, logprobs=True)  # type: ignore[arg-type]
            m1 = r1.choices[0].message
            assert r1.choices[0].finish_reason == "tool_calls"
            assert [(c.function.name, json.loads(c.function.arguments)) for c in m1.tool_calls or []] == [
                ("get_weather", {"city": "Paris"}),
                ("add", {"a": 1, "b": 2}),
            ]
            assert _as_sent(m1)["reasoning_content"] == "Two tools at once."
            assert [e.logprob for e in r1.choices[0].logprobs.content] == engine.logprobs[0]  # type: ignore[union-attr]
            msgs.append(_as_sent(m1))
            msgs += [
                {"role": "tool", "tool_call_id": c.id, "content": out}
                for c, out in zip(m1.tool_calls or [], ["18C", "3"], strict=True)
            ]
            # 2: streamed reply of random vocabulary tokens, cut by max_tokens
            stream = await client.chat.completions.create(
                model="policy",
                messages=msgs,
                tools=TOOLS,
                stream=True,  # type: ignore[arg-type]
                max_tokens=20,
                stream_options={"include_usage": True},
            )
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    finish = choice.finish_reason or finish
            assert finish == "length" and usage is not None and usage.completion_tokens == 20
            assert text == get_parser(renderer).parse(engine.sampled[1]).content
            msgs.append({"role": "assistant", "content": text})
            msgs.append({"role": "user", "content": "Summarise."})
            # 3 and 4: plain replies, the second after one more user turn
            r3 = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
            assert r3.choices[0].message.content == "It is 18 degrees in Paris; 1 + 2 = 3."
            msgs += [_as_sent(r3.choices[0].message), {"role": "user", "content": "And Rome?"}]
            r4 = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
            assert r4.choices[0].message.content == "Rome: also sunny."
            await _finish(srv.url, session["token"])
            detail = await store.get_rollout(session["rollout_id"])
    finally:
        await store.close()
    recorded: list[Call] = sorted(detail.attempts[0].calls, key=lambda c: c.seq)
    assert len(recorded) == 4
    for i, call in enumerate(recorded):
        assert call.prompt_ids == engine.received[i]  # exactly the context the engine consumed
        assert call.completion_ids == engine.sampled[i]  # exactly what it sampled
        assert call.logprobs == engine.logprobs[i]
        assert call.token_source == "engine" and call.policy_version == 7
        assert engine.sampling[i].stop_token_ids == sorted(renderer.stop_token_ids)
    assert recorded[1].finish_reason == "length" and engine.sampling[1].max_tokens == 20
    for i in (1, 2, 3):
        base = recorded[i - 1].prompt_ids + recorded[i - 1].completion_ids
        extends = recorded[i].prompt_ids[: len(base)] == base
        assert recorded[i].checks["render"]["extended"] is extends
    reasons = [c.checks["render"]["split_reason"] for c in recorded]
    if history == "exact":  # never splits an append-only conversation
        assert reasons == [None, None, None, None]
    else:
        # call 3: the random ids the engine sampled are not the canonical encoding of their text, so the official
        # rendering re-encodes that reply differently; call 4: the new user turn drops the earlier <think> block
        assert reasons == [None, None, "template_rewrite", "template_rewrite"]
        assert all(c.prompt_ids == renderer.render(c.request["messages"], TOOLS) for c in recorded)


def test_retokenization_fallback_is_marked_and_checked(tmp_path: Any) -> None:
    """A policy engine that returns text only (a plain OpenAI server): ids are reconstructed, never silently."""
    renderer = renderer_for("qwen2.5")
    mock = MockOpenAI(supports_token_ids=False, reply="Paris is sunny today.")
    store = SQLiteStore(tmp_path / "store.db")
    with run_server(mock.app) as upstream:
        backend = RetokenizingBackend(PassthroughBackend(f"{upstream.url}/v1"), renderer)
        app = proxy_app(store, policy_backend=backend)
        with run_server(app) as srv:
            session = srv.call(_session(srv.url))
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=session["token"], max_retries=0)
            msgs = [{"role": "user", "content": "Weather in Paris?"}]
            reply = client.chat.completions.create(model="policy", messages=msgs)  # type: ignore[arg-type]
            assert reply.choices[0].message.content == "Paris is sunny today."
            follow = [
                *msgs,
                {"role": "assistant", "content": "Paris is sunny today."},
                {"role": "user", "content": "Sure?"},
            ]
            stream = client.chat.completions.create(model="policy", messages=follow, stream=True)  # type: ignore[arg-type]
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Paris is sunny today."
            srv.call(_finish(srv.url, session["token"]))
            detail = srv.call(store.get_rollout(session["rollout_id"]))
            srv.call(store.close())
    call, streamed = sorted(detail.attempts[0].calls, key=lambda c: c.seq)
    assert streamed.token_source == "retokenized" and streamed.checks["reply_roundtrip"] is True
    base = call.prompt_ids + call.completion_ids
    assert streamed.prompt_ids[: len(base)] == base and streamed.checks["render"]["extended"] is True
    assert streamed.prompt_ids == renderer.render(follow)  # Qwen2.5 keeps the prefix: the bridge is the official one
    assert call.token_source == "retokenized"
    assert call.prompt_ids == renderer.render(msgs)
    assert call.completion_ids == renderer.encode("Paris is sunny today.<|im_end|>")
    assert call.checks["decode_encode_roundtrip"] is True and call.checks["reply_roundtrip"] is True
    n_engine = call.checks["logprob_count"][0]  # the mock's own byte "tokens", not the policy's
    assert call.checks["logprob_count"] == [n_engine, len(call.completion_ids)]
    assert call.checks["logprobs_kept"] is (n_engine == len(call.completion_ids))
    assert call.logprobs == ([] if not call.checks["logprobs_kept"] else call.logprobs)
    assert call.checks["render"]["split_reason"] is None


def _ctx(earlier: list[Call] | None = None) -> CallContext:
    attempt = Attempt(attempt_id="at-1", rollout_id="ro-1", index=0, token="tok")

    async def calls() -> list[Call]:
        return list(earlier or [])

    return CallContext(attempt=attempt, call_id="call-1", seq=0, model="policy", policy_version=1, _earlier=calls)


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5", "llama3.1", "gpt-oss", "mistral-nemo"])
async def test_streamed_and_unstreamed_calls_give_the_same_result(name: str) -> None:
    """For every family whose template renders tools, a tool-call reply streamed adds up (as OpenAI chunks) to the
    unstreamed response (DeepSeek-V3's template drops tool definitions: tests/tokens/test_templates.py)."""
    renderer = renderer_for(name)
    reasoning = "Look it up." if renderer.family.reasoning_key else None
    plan = assistant(None, reasoning=reasoning, calls=[tool_call("get_weather", {"city": "Oslo"}, "abcdefghi")])
    body = {"model": "policy", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS}
    backend = TokenModeBackend(ScriptedEngine(renderer, [plan, plan]), renderer)  # type: ignore[arg-type]
    plain = await backend.chat(dict(body), _ctx())
    items = [item async for item in backend.chat_stream(dict(body, stream=True), _ctx())]
    streamed = items[-1]
    assert isinstance(streamed, ChatResult)
    assembler = ChatStreamAssembler()
    for item in items[:-1]:
        assert isinstance(item, dict)
        assembler.feed(item)
    assembled = assembler.response()["choices"][0]["message"]
    expected = plain.response["choices"][0]["message"]
    assert expected["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    for msg in (assembled, streamed.response["choices"][0]["message"]):
        calls = [{**c, "id": None} for c in msg["tool_calls"]]
        assert {**msg, "tool_calls": calls} == {
            **expected,
            "tool_calls": [{**c, "id": None} for c in expected["tool_calls"]],
        }
    assert streamed.response["choices"][0]["finish_reason"] == plain.finish_reason == "tool_calls"
    assert (streamed.prompt_ids, streamed.completion_ids, streamed.logprobs) != ([], [], [])
    assert streamed.prompt_ids == plain.prompt_ids
    assert streamed.completion_ids == plain.completion_ids


async def test_completions_and_request_errors() -> None:
    renderer = renderer_for("qwen2.5")
    engine = ScriptedEngine(renderer, [5, 5, 6])
    backend = TokenModeBackend(engine, renderer)  # type: ignore[arg-type]
    r = await backend.completions({"model": "policy", "prompt": "Once upon", "max_tokens": 8, "logprobs": 1}, _ctx())
    assert r.prompt_ids == renderer.encode("Once upon") == engine.received[0]
    assert r.completion_ids == engine.sampled[0] and r.logprobs == engine.logprobs[0]
    assert r.response["choices"][0]["text"] == renderer.decode(engine.sampled[0][:-1])  # stop token not shown
    assert r.response["choices"][0]["logprobs"]["token_logprobs"] == engine.logprobs[0]
    ids_prompt = renderer.encode("Hello there")
    items = [i async for i in backend.completions_stream({"model": "policy", "prompt": ids_prompt}, _ctx())]
    result = items[-1]
    assert isinstance(result, ChatResult) and result.prompt_ids == ids_prompt == engine.received[1]
    text = "".join(i["choices"][0]["text"] for i in items[:-1] if isinstance(i, dict))
    assert text == result.response["choices"][0]["text"] == renderer.decode(engine.sampled[1][:-1])
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ProxyHTTPError) as err:
        await backend.chat({**chat, "n": 2}, _ctx())
    assert err.value.status == 400 and err.value.param == "n"
    with pytest.raises(ProxyHTTPError) as err:
        await backend.chat({**chat, "temperature": "hot"}, _ctx())
    assert err.value.status == 400 and err.value.param == "temperature"
    with pytest.raises(ProxyHTTPError) as err:
        await backend.completions({"model": "policy", "prompt": [["a"], ["b"]]}, _ctx())
    assert err.value.param == "prompt"
    mistral = renderer_for("mistral-nemo")
    refusing = TokenModeBackend(ScriptedEngine(mistral, [3]), mistral)  # type: ignore[arg-type]
    two_users = {"model": "policy", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(ProxyHTTPError) as err:
        await refusing.chat(two_users, _ctx())
    assert err.value.status == 400 and "alternate" in err.value.message
    assert await backend.models() == ["policy"]


# -- the rules of token mode (issue 9 §1), through the real proxy with the real Qwen3 template ----------------------
QWEN3_TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def _serve(engine: ScriptedEngine, tmp_path: Any) -> tuple[Any, SQLiteStore]:
    backend = TokenModeBackend(engine, engine.renderer)  # type: ignore[arg-type]
    store = SQLiteStore(tmp_path / "rules.db")
    return proxy_app(store, policy_backend=backend), store


async def test_context_length_is_refused_and_max_tokens_clipped(tmp_path: Any) -> None:
    """A prompt that does not fit the policy's context answers 400 ``context_length_exceeded`` (as vLLM does) and
    is recorded with that error (never trained); ``max_tokens`` beyond what remains is clipped (finish length)."""
    renderer = renderer_for("qwen3")
    engine = ScriptedEngine(renderer, [50, 50])
    short = [{"role": "user", "content": "Hi"}]
    n_short = len(renderer.render(short))
    engine.max_model_len = n_short + 8
    app, store = await _serve(engine, tmp_path)
    async with serve_async(app) as srv:
        session = await _session(srv.url)
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=session["token"], max_retries=0)
        long = [{"role": "user", "content": "word " * 200}]
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="policy", messages=long)  # type: ignore[arg-type]
        assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
        assert f"maximum context length is {n_short + 8} tokens" in err.value.message
        r = await client.chat.completions.create(model="policy", messages=short, max_tokens=500)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 8
        assert engine.sampling[0].max_tokens == 8  # clipped to the room left, not 500
        with pytest.raises(openai.BadRequestError):  # refused before the stream starts: a status, not an event
            await client.chat.completions.create(model="policy", messages=long, stream=True)  # type: ignore[arg-type]
        await _finish(srv.url, session["token"])
        detail = await store.get_rollout(session["rollout_id"])
    await store.close()
    calls = sorted(detail.attempts[0].calls, key=lambda c: c.seq)
    assert [c.error is None for c in calls] == [False, True, False]
    refused = calls[0]
    assert refused.checks["error_code"] == "context_length_exceeded" and refused.checks["http_status"] == 400
    assert refused.completion_ids == [] and refused.response == {}
    assert len(engine.received) == 1  # the engine never saw the prompts that do not fit
    assert len(calls[1].prompt_ids) + len(calls[1].completion_ids) == n_short + 8
    from lightning_sdk.records.segments import merge_attempt

    merged = merge_attempt(calls)
    assert merged.stats.failed_calls == 2 and merged.stats.trained_calls == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_are_parsed_only_when_tools_are_offered(tmp_path: Any, stream: bool) -> None:
    """A reply that writes ``<tool_call>`` text stays ``content`` when the request offers no tools or says
    ``tool_choice: "none"``; with tools offered (auto) the same ids become ``message.tool_calls``."""
    renderer = renderer_for("qwen3")
    reply = renderer.encode("Let me see.\n" + QWEN3_TOOL_CALL + "<|im_end|>")
    engine = ScriptedEngine(renderer, [list(reply), list(reply), list(reply)])
    app, store = await _serve(engine, tmp_path)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    results = []
    async with serve_async(app) as srv:
        session = await _session(srv.url)
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=session["token"], max_retries=0)
        for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS}):
            if stream:
                chunks = await client.chat.completions.create(
                    model="policy",
                    messages=msgs,  # type: ignore[arg-type]
                    stream=True,
                    **extra,  # type: ignore[arg-type]
                )
                asm = ChatStreamAssembler()
                async for c in chunks:
                    asm.feed(c.model_dump(exclude_none=True))
                choice = asm.response()["choices"][0]
                results.append((choice["message"], choice["finish_reason"]))
            else:
                r = await client.chat.completions.create(model="policy", messages=msgs, **extra)  # type: ignore[arg-type]
                results.append((r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason))
        await _finish(srv.url, session["token"])
    await store.close()
    for message, finish in results[:2]:
        assert finish == "stop" and not message.get("tool_calls")
        assert message["content"] == "Let me see.\n" + QWEN3_TOOL_CALL
    message, finish = results[2]
    assert finish == "tool_calls" and message["content"] == "Let me see."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize(
    ("tool_choice", "forced", "sampled"),
    [
        ("required", "<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '<tool_call>\n{"name": "get_weather", "arguments": ',
            '{"city": "Paris"}}\n</tool_call>',
        ),
    ],
)
async def test_tool_choice_required_and_named_are_forced_and_never_trained(
    tmp_path: Any, tool_choice: Any, forced: str, sampled: str
) -> None:
    """``tool_choice: "required"`` / a named function force the Qwen3 template's tool-call opening (and name) as a
    prompt suffix: the engine continues from it, the reply is a tool call, and the forced tokens are recorded in
    the prompt (loss mask 0), not among the sampled ids."""
    renderer = renderer_for("qwen3")
    sampled_ids = renderer.encode(sampled + "<|im_end|>")
    engine = ScriptedEngine(renderer, [list(sampled_ids)])
    app, store = await _serve(engine, tmp_path)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    async with serve_async(app) as srv:
        session = await _session(srv.url)
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=session["token"], max_retries=0)
        r = await client.chat.completions.create(
            model="policy",
            messages=msgs,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=tool_choice,
        )
        await _finish(srv.url, session["token"])
        detail = await store.get_rollout(session["rollout_id"])
    await store.close()
    assert r.choices[0].finish_reason == "tool_calls"
    (tc,) = r.choices[0].message.tool_calls or []
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    forced_ids = renderer.encode(forced)
    assert engine.received[0] == renderer.render(msgs, TOOLS) + forced_ids  # the engine continued the opening
    (call,) = detail.attempts[0].calls
    assert call.prompt_ids == engine.received[0] and call.completion_ids == sampled_ids
    from lightning_sdk.records.segments import merge_attempt

    (segment,) = merge_attempt([call]).segments
    n_prompt = len(call.prompt_ids)
    assert list(segment.loss_mask[:n_prompt]) == [0] * n_prompt  # forced tokens: mask 0
    assert list(segment.loss_mask[n_prompt:]) == [1] * len(sampled_ids)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": 1}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": ["f"]}]}, "messages[0].tool_calls[0].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"top_logprobs": 30}, "top_logprobs"),
    ],
)
def test_invalid_parameters_are_400_naming_the_parameter(tmp_path: Any, extra: dict[str, Any], param: str) -> None:
    """Out-of-range or mistyped parameters are refused with 400 naming them (never a 500), before any engine work;
    they are not recorded (the call never got a place in the attempt)."""
    renderer = renderer_for("qwen3")
    engine = ScriptedEngine(renderer, [])
    store = SQLiteStore(tmp_path / "v.db")
    app = proxy_app(store, policy_backend=TokenModeBackend(engine, renderer))  # type: ignore[arg-type]
    with run_server(app) as srv:
        session = srv.call(_session(srv.url))
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], **extra}
        r = httpx.post(
            f"{srv.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {session['token']}"}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
        srv.call(_finish(srv.url, session["token"]))
        detail = srv.call(store.get_rollout(session["rollout_id"]))
        srv.call(store.close())
    assert engine.received == [] and detail.attempts[0].calls == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
    ],
)
def test_parameters_the_engine_cannot_honour_are_refused_and_recorded_as_failed(
    tmp_path: Any, extra: dict[str, Any], param: str
) -> None:
    """Valid parameters the embedded engine cannot honour (no guided decoding, one choice, no top alternatives,
    no penalties) are a clear 400 naming them; the call is recorded with that error, never as an empty success."""
    renderer = renderer_for("qwen3")
    engine = ScriptedEngine(renderer, [3])
    store = SQLiteStore(tmp_path / "h.db")
    app = proxy_app(store, policy_backend=TokenModeBackend(engine, renderer))  # type: ignore[arg-type]
    with run_server(app) as srv:
        session = srv.call(_session(srv.url))
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=session["token"], max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="policy", messages=msgs, **extra)  # type: ignore[arg-type]
        assert err.value.param == param
        ok = client.chat.completions.create(model="policy", messages=msgs, presence_penalty=0, logit_bias={})  # type: ignore[arg-type]
        assert ok.choices[0].finish_reason == "stop"  # default values are served
        srv.call(_finish(srv.url, session["token"]))
        detail = srv.call(store.get_rollout(session["rollout_id"]))
        srv.call(store.close())
    refused, served = sorted(detail.attempts[0].calls, key=lambda c: c.seq)
    assert refused.error is not None and param in refused.error and refused.checks["param"] == param
    assert (refused.prompt_ids, refused.completion_ids, refused.response) == ([], [], {})
    assert served.error is None and served.completion_ids == engine.sampled[0]


async def test_response_format_reaches_engines_with_guided_decoding() -> None:
    """``response_format`` is refused (400) by the embedded engine but handed to engines that declare guided
    decoding; the vLLM client sends it as ``response_format`` on ``/v1/completions`` and the SGLang client as
    ``sampling_params.json_schema`` (vLLM ``CompletionRequest.response_format``; SGLang
    ``SamplingParams.json_schema``)."""
    from lightning_sdk.engines.base import Sampling
    from lightning_sdk.engines.sglang import SGLangEngine
    from lightning_sdk.engines.vllm import VLLMEngine

    renderer = renderer_for("qwen3")
    engine = ScriptedEngine(renderer, [renderer.encode('{"a": 1}<|im_end|>')])
    engine.supports_response_format = True
    backend = TokenModeBackend(engine, renderer)  # type: ignore[arg-type]
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    body = {"model": "policy", "messages": [{"role": "user", "content": "json"}], "response_format": schema}
    r = await backend.chat(body, _ctx())
    assert r.response["choices"][0]["message"]["content"] == '{"a": 1}'
    assert engine.sampling[0].response_format == schema
    sampling = Sampling(max_tokens=4, response_format=schema)
    vllm_body = VLLMEngine("http://127.0.0.1:1")._body([1, 2], sampling, stream=False, model="policy-v3")
    assert vllm_body["response_format"] == schema
    assert vllm_body["model"] == "policy-v3"  # the served name (an adapter's per-version name with LoRA)
    sglang_body = SGLangEngine._body(
        [1, 2], Sampling(max_tokens=4, response_format={"type": "json_object"}), stream=False
    )
    assert json.loads(sglang_body["sampling_params"]["json_schema"]) == {"type": "object"}
    assert "response_format" not in VLLMEngine("http://127.0.0.1:1")._body([1], Sampling(), stream=False, model="p")


async def test_the_engine_wrappers_pass_their_engines_capabilities_on() -> None:
    """The trainer serves a vLLM/SGLang client through ``ServedEngine`` (and several through ``EnginePool``): token
    mode reads the capabilities from the wrapper, so the wrapper must pass them on (before, the proxy probed the
    wrapper with ``getattr`` and refused ``response_format`` for a served vLLM). A pool takes the shortest known
    context and a capability only when every engine has it; an engine that tells nothing gets the defaults."""
    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.engines.pool import EnginePool
    from lightning_sdk.engines.serving import ServedEngine
    from lightning_sdk.engines.vllm import VLLMEngine

    renderer = renderer_for("qwen3")
    vllm = VLLMEngine("http://127.0.0.1:1")
    served = ServedEngine(vllm, renderer.tokenizer)
    backend = TokenModeBackend(served, renderer)
    assert (backend.response_format, backend.top_logprobs, backend.max_model_len) == (True, False, None)

    short, long = ScriptedEngine(renderer, []), ScriptedEngine(renderer, [])
    short.max_model_len, long.max_model_len = 64, 128
    long.supports_response_format = True
    pool = EnginePool([short, long, ScriptedEngine(renderer, [])])
    assert (pool.max_model_len, pool.supports_response_format, pool.supports_top_logprobs) == (64, False, False)
    assert TokenModeBackend(pool, renderer).max_model_len == 64
    assert EnginePool([long]).supports_response_format is True
    assert EmbeddedEngine.max_model_len is not Engine.max_model_len  # the embedded engine tells its own
    await vllm.close()
