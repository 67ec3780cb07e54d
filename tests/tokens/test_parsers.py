"""Output parsers on real tokenizers: round trips through each family's template, malformed tool calls, streaming.

The ids a model of each family emits for a message are the template's rendering of it (``reply_ids``); parsing
them must give the message back. Streaming must add up to exactly the one-shot message, however the ids arrive.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sdk.tokens import OutputParser, get_parser
from tests.tokens.conversations import (
    FAMILY_NAMES,
    Message,
    assistant,
    conversation,
    renderer_for,
    reply_ids,
    reply_text,
    same_message,
    tool_call,
    tools_for,
)

USER = [{"role": "user", "content": "Hi"}]


def _replies(name: str) -> list[tuple[list[Message], Message]]:
    """(history, reply) pairs: every reply of the single and parallel conversations, plus content + tool call."""
    renderer = renderer_for(name)
    reasoning = renderer.family.reasoning_key is not None
    out = []
    for parallel in (False, True):
        if parallel and name == "gpt-oss":
            continue
        msgs = conversation(reasoning=reasoning, parallel=parallel)
        out += [(msgs[:i], m) for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if name.startswith("qwen"):  # Hermes templates write content before the calls
        call = tool_call("add", {"a": 1, "b": 2}, "call00009")
        out.append((USER, assistant("Let me add.", reasoning="Easy." if reasoning else None, calls=[call])))
    return out


def _stream(parser: OutputParser, ids: list[int], chunks: list[int], prompt_ids: list[int]) -> tuple[Message, Message]:
    """Feed ``ids`` in pieces of the given sizes (cycled); return (deltas added up, the parser's final message)."""
    ids_seen = itertools.count()
    sp = parser.stream(prompt_ids=prompt_ids, id_factory=lambda: f"call_{next(ids_seen)}")
    deltas: list[Message] = []
    pos = 0
    for size in itertools.cycle(chunks):
        if pos >= len(ids):
            break
        deltas += sp.feed(ids[pos : pos + size])
        pos += size
    deltas += sp.finish()
    assert sp.message is not None
    return _accumulate(deltas), sp.message


def _accumulate(deltas: list[Message]) -> Message:
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, Message] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            assert c["index"] not in calls  # each call arrives whole, once
            calls[c["index"]] = {"id": c["id"], "type": "function", "function": c["function"]}
    msg: Message = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def _without_ids(msg: Message) -> Message:
    calls = [{**c, "id": None} for c in msg.get("tool_calls") or []]
    return {**msg, "tool_calls": calls} if calls else msg


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_round_trip_through_the_template(name: str) -> None:
    renderer = renderer_for(name)
    parser = get_parser(renderer)
    for history, reply in _replies(name):
        prompt = renderer.render(history, tools_for(renderer))
        ids = reply_ids(renderer, history, reply, tools_for(renderer))
        parsed = parser.parse(ids, prompt_ids=prompt).to_message()
        assert same_message(parsed, reply), (parsed, reply)
        if name == "mistral-nemo":  # the model writes the ids itself: they are kept
            assert [c["id"] for c in parsed.get("tool_calls", [])] == [c["id"] for c in reply.get("tool_calls") or []]
        # and the parsed message renders to the very same text again
        pairs = zip(parsed.get("tool_calls") or [], reply.get("tool_calls") or [], strict=True)
        echo = {**parsed, "tool_calls": [dict(c, id=o["id"]) for c, o in pairs]}
        if not echo["tool_calls"]:
            del echo["tool_calls"]
        tools = tools_for(renderer)
        assert reply_text(renderer, history, echo, tools) == reply_text(renderer, history, reply, tools)


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("chunks", [[1], [3], [2, 7, 1]])
def test_streaming_adds_up_to_the_one_shot_message(name: str, chunks: list[int]) -> None:
    renderer = renderer_for(name)
    parser = get_parser(renderer)
    for history, reply in _replies(name):
        prompt = renderer.render(history, tools_for(renderer))
        ids = reply_ids(renderer, history, reply, tools_for(renderer))
        one_shot = parser.parse(ids, prompt_ids=prompt).to_message()
        streamed, final = _stream(parser, ids, chunks, prompt)
        assert streamed == final
        assert _without_ids(final) == _without_ids(one_shot)
        assert same_message(final, reply)


MALFORMED: dict[str, list[str]] = {
    "qwen3": [
        '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call><|im_end|>',
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call><|im_end|>',  # no name
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}',  # cut off before </tool_call>
    ],
    "qwen2.5": ['<tool_call>\n["add", 1, 2]\n</tool_call><|im_end|>'],
    "llama3.1": ['{"name": "add", "parameters": {"a": 1', '{"name": "add", "parameters": "a=1"}<|eot_id|>'],
    "llama3.2": ['<|python_tag|>{"nam": "add"}<|eot_id|>'],
    "gpt-oss": [
        "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{not json<|call|>",
        "<|channel|>commentary to=functions.add <|constrain|>json",  # cut off in the header
    ],
    "mistral-nemo": ['[TOOL_CALLS][{"name": "add", "arguments": {]</s>', '[TOOL_CALLS][{"name": "add"}] trailing</s>'],
    "deepseek-v3": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{oops}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n{}<｜tool▁call▁end｜><｜end▁of▁sentence｜>",
    ],
}


@pytest.mark.parametrize(("name", "text"), [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_malformed_tool_call_becomes_content(name: str, text: str) -> None:
    renderer = renderer_for(name)
    parser = get_parser(renderer)
    ids = renderer.encode(text)
    msg = parser.parse(ids).to_message()
    assert "tool_calls" not in msg
    assert msg["content"]  # the text the model wrote is kept, not dropped
    visible = parser.strip_stop(renderer.decode(ids))
    assert msg["content"] in visible and len(msg["content"]) >= len(visible) // 2
    streamed, final = _stream(parser, ids, [2], [])
    assert streamed == final and _without_ids(final) == _without_ids(msg)


def test_hermes_keeps_valid_calls_next_to_a_malformed_one() -> None:
    renderer = renderer_for("qwen3")
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": }\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
    )
    msg = get_parser(renderer).parse(renderer.encode(text)).to_message()
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["add", "get_weather"]
    assert msg["content"] == '\n<tool_call>\n{"name": "add", "arguments": }\n</tool_call>\n'


def test_harmony_recipient_in_either_header_position_and_several_calls() -> None:
    renderer = renderer_for("gpt-oss")
    text = (
        "<|channel|>analysis<|message|>Two lookups.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
        "<|call|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>"
        '{"a": 1, "b": 2}<|call|>'
    )
    msg = get_parser(renderer).parse(renderer.encode(text)).to_message()
    assert msg["reasoning_content"] == "Two lookups."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"}),
        ("add", {"a": 1, "b": 2}),
    ]
    final = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>"
    msg = get_parser(renderer).parse(renderer.encode(final)).to_message()
    assert msg == {"role": "assistant", "content": "Hi!", "reasoning_content": "Think."}


def test_deepseek_reasoning_opened_by_the_prompt() -> None:
    renderer = renderer_for("deepseek-v3")
    parser = get_parser(renderer)
    prompt = renderer.render(USER)
    assert renderer.decode(prompt).endswith("<think>\n")
    ids = renderer.encode("Let me think.\n</think>\n\nHello!<｜end▁of▁sentence｜>")
    assert parser.parse(ids, prompt_ids=prompt).to_message() == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "Let me think.",
    }
    streamed, final = _stream(parser, ids, [1], prompt)
    assert streamed == final == parser.parse(ids, prompt_ids=prompt).to_message()
    cut = renderer.encode("Still thinking")  # cut off by max_tokens inside the reasoning
    assert parser.parse(cut, prompt_ids=prompt).to_message() == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Still thinking",
    }


def test_llama_parallel_json_calls() -> None:
    renderer = renderer_for("llama3.2")
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    msg = get_parser(renderer).parse(renderer.encode(text + "<|eot_id|>")).to_message()
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["add", "get_weather"]
    assert msg["content"] is None
    plain = get_parser(renderer).parse(renderer.encode("{curly} but prose<|eot_id|>")).to_message()
    assert plain == {"role": "assistant", "content": "{curly} but prose"}


# -- property tests -------------------------------------------------------------------------------------------------

_PIECES = [*'ab xyz\n\t{}[]":,<>/|é中', "think", "tool", "\n\n", "<think>", "</tool"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=20).map("".join)


def _clean(text: str) -> str:
    return text.strip() or "x"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    content=_TEXT,
    reasoning=_TEXT,
    args=st.dictionaries(st.sampled_from(["a", "city", "q"]), st.one_of(st.integers(), _TEXT), max_size=3),
    n_calls=st.integers(0, 2),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=4),
)
def test_qwen3_parse_and_stream_properties(
    content: str, reasoning: str, args: dict[str, Any], n_calls: int, chunks: list[int]
) -> None:
    """Any content/reasoning/arguments text the template renders parses back, streamed or not."""
    renderer = renderer_for("qwen3")
    parser = get_parser(renderer)
    calls = [tool_call("add", args, f"call{i:05d}") for i in range(n_calls)]
    reply = assistant(
        _clean(content) if content.strip() or not calls else None, reasoning=_clean(reasoning), calls=calls
    )
    ids = reply_ids(renderer, USER, reply, tools_for(renderer))
    prompt = renderer.render(USER, tools_for(renderer))
    one_shot = parser.parse(ids, prompt_ids=prompt).to_message()
    assert same_message(one_shot, reply)
    streamed, final = _stream(parser, ids, chunks, prompt)
    assert streamed == final and _without_ids(final) == _without_ids(one_shot)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(FAMILY_NAMES),
    token_ids=st.lists(st.integers(0, 127999), max_size=30),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=3),
)
def test_any_ids_parse_without_error_and_stream_equals_one_shot(
    name: str, token_ids: list[int], chunks: list[int]
) -> None:
    """Arbitrary sampled ids (garbage included) never raise, and the stream adds up to the one-shot message."""
    renderer = renderer_for(name)
    parser = get_parser(renderer)
    one_shot = parser.parse(token_ids).to_message()
    assert one_shot["role"] == "assistant"
    streamed, final = _stream(parser, token_ids, chunks, [])
    assert streamed == final and _without_ids(final) == _without_ids(one_shot)
