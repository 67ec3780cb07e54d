"""Multi-turn tool conversations and a template-faithful "sampler" for the token tests.

``reply_ids`` plays the model: it returns the ids a model of the family would sample for an assistant message —
the template's own rendering of that message (the text after the generation prompt, up to and including the
turn-end marker), which is exactly what the model was trained to emit. DeepSeek-V3's generation prompt opens a
``<think>`` block that its template never renders back, so the sampled text there starts with the reasoning and
``</think>``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from lightning_sdk.tokens import ChatRenderer, HistoryPolicy, PriorCall, RenderedPrompt, render_prompt
from tests.support.tokenizers import load_tokenizer

Message = dict[str, Any]

FAMILY_NAMES = ("qwen3", "qwen2.5", "llama3.1", "llama3.2", "gpt-oss", "mistral-nemo", "deepseek-v3")
"""The families of TOKENIZERS.md, by the fixture's names (tests.support.tokenizers)."""


@functools.cache
def renderer_for(name: str) -> ChatRenderer:
    """The renderer of a fixture family, loaded once per session; Llama's date is pinned (stable renderings)."""
    kwargs = {"date_string": "26 Jul 2024"} if name.startswith("llama") else None
    return ChatRenderer(load_tokenizer(name), template_kwargs=kwargs)


TOOLS: list[Message] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


def tool_call(name: str, arguments: dict[str, Any], call_id: str) -> Message:
    """An OpenAI tool call; ids of 9 letters/digits suit every template (Mistral demands exactly that)."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def assistant(
    content: str | None = None, *, reasoning: str | None = None, calls: list[Message] | None = None
) -> Message:
    msg: Message = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def tool_result(call: Message, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def conversation(*, reasoning: bool, parallel: bool) -> list[Message]:
    """A conversation of user turns, tool calls (two parallel ones first when asked), tool results and final
    answers. Returned as a flat list; the assistant messages are the replies to sample."""
    think = (lambda text: text) if reasoning else (lambda text: None)
    c1 = tool_call("get_weather", {"city": "Paris", "unit": "c"}, "call00001")
    c2 = tool_call("get_weather", {"city": "Zürich"}, "call00002")
    c3 = tool_call("add", {"a": 2, "b": 40}, "call00003")
    first_calls = [c1, c2] if parallel else [c1]
    msgs: list[Message] = [{"role": "system", "content": "You are a careful assistant."}]
    msgs.append({"role": "user", "content": "What's the weather in Paris and Zürich?"})
    msgs.append(assistant(None, reasoning=think("I should look both up."), calls=first_calls))
    msgs.extend(tool_result(c, f"{18 + i} degrees, sunny") for i, c in enumerate(first_calls))
    msgs.append(assistant("Paris is 18°C and sunny.", reasoning=think("Both answered; summarise.")))
    msgs.append({"role": "user", "content": "Now add 2 and 40, please."})
    msgs.append(assistant(None, reasoning=think("Use the add tool."), calls=[c3]))
    msgs.append(tool_result(c3, "42"))
    msgs.append(assistant("2 + 40 = 42.", reasoning=think("The tool said 42.")))
    return msgs


def reply_text(renderer: ChatRenderer, history: list[Message], reply: Message, tools: list[Message] | None) -> str:
    """The text a model of this family emits for ``reply`` after ``history`` (see the module docstring).

    The reply is rendered by the template after a one-line user turn (what follows the generation prompt, up to the
    last turn-end marker), so template quirks about the history (Mistral drops the system prompt unless the last
    message is a user turn) do not leak into it. The history only decides whether the prompt opened ``<think>``.
    """
    calls = reply.get("tool_calls") or []
    if renderer.family.name == "llama3" and len(calls) > 1:  # JSON objects joined by "; " (vLLM's llama3_json)
        bodies = [reply_text(renderer, history, {**reply, "tool_calls": [c]}, tools) for c in calls]
        marker = "<|eot_id|>"
        return "; ".join(b.removesuffix(marker) for b in bodies) + marker
    context: list[Message] = [{"role": "user", "content": "x"}]
    prompt = renderer.render_text(context, add_generation_prompt=True)
    whole = renderer.render_text([*context, reply], add_generation_prompt=False)
    opened = prompt.endswith("<think>\n") and renderer.family.name == "deepseek-v3"
    prompt = prompt.removesuffix("<think>\n") if opened else prompt
    assert whole.startswith(prompt), (prompt, whole)
    text = whole[len(prompt) :]
    ends = [text.rfind(m) + len(m) for m in renderer.family.end_markers if m in text]
    text = text[: max(ends)] if ends else text
    if opened and renderer.render_text(history, tools, add_generation_prompt=True).endswith("<think>\n"):
        text = (reply.get("reasoning_content") or "") + "</think>" + text
    return text


def reply_ids(renderer: ChatRenderer, history: list[Message], reply: Message, tools: list[Message] | None) -> list[int]:
    return renderer.encode(reply_text(renderer, history, reply, tools))


@dataclass
class Played:
    """One call of a played conversation: the messages sent, the rendered prompt, the sampled ids, the reply."""

    history: list[Message]
    prompt: RenderedPrompt
    completion_ids: list[int]
    reply: Message


def tools_for(renderer: ChatRenderer) -> list[Message] | None:
    """``TOOLS``, or None for a template that drops tool definitions (DeepSeek-V3's official template renders tool
    calls and results but never the tools: the renderer refuses them, ``renderer.capabilities.tools`` is False)."""
    return None if renderer.capabilities.tools is False else TOOLS


def play(
    renderer: ChatRenderer,
    msgs: list[Message],
    *,
    policy: HistoryPolicy = "exact",
    tools: list[Message] | str | None = "default",
    echo_reasoning: bool = True,
) -> list[Played]:
    """Play the agent side of ``msgs``: one call per assistant message, sampled with ``reply_ids``; the agent sends
    earlier replies back with their reasoning (``echo_reasoning``) or without it (what OpenAI clients do).
    ``tools``: default ``tools_for(renderer)``."""
    if isinstance(tools, str):
        tools = tools_for(renderer)
    played: list[Played] = []
    prior: list[PriorCall] = []
    sent = [
        m if echo_reasoning or m["role"] != "assistant" else {k: v for k, v in m.items() if k != "reasoning_content"}
        for m in msgs
    ]
    for i, reply in enumerate(msgs):
        if reply["role"] != "assistant":
            continue
        history = sent[:i]
        prompt = render_prompt(renderer, history, tools, prior, policy=policy)
        ids = reply_ids(renderer, history, reply, tools)
        played.append(Played(history, prompt, ids, reply))
        prior.append(PriorCall(history, tools, reply, prompt.prompt_ids, ids))
    return played


def same_message(a: Message, b: Message) -> bool:
    """Content, reasoning and tool calls (name, arguments as JSON values) equal; ids and empty fields ignored."""

    def key(m: Message) -> tuple[Any, ...]:
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or []]
        return (m.get("content") or None, m.get("reasoning_content") or None, calls)

    return key(a) == key(b)
