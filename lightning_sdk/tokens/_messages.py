"""OpenAI chat messages: shaping them for a chat template, and comparing them for the bridge.

Agents send OpenAI messages (content as a string, a list of parts or ``null``; tool-call arguments as a JSON
string; reasoning in ``reasoning_content``). Chat templates want plain strings, arguments as the template expects
them, and reasoning under the template's own key. ``to_template_messages`` does that shaping for a family; for
templates that render one tool call per assistant message (Llama 3, harmony), parallel calls become consecutive
assistant messages of one call each rather than an error (Llama) or a silently dropped call (harmony).

``message_key`` reduces a message to what decides whether a later call repeats it: role, text, tool calls (name and
arguments compared as JSON values) and the tool-call id a tool result answers. Reasoning is left out on purpose:
OpenAI clients drop ``reasoning_content`` when they send a reply back, and that must not break the bridge.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_sdk.tokens._families import Family

__all__ = ["message_key", "message_text", "short_tool_call_id", "to_template_messages", "tools_key"]

Message = dict[str, Any]

_ALNUM = string.ascii_letters + string.digits


_TEXT_PART_TYPES = ("text", "input_text", "output_text")  # a part of these types without a string holds no text


def message_text(content: Any) -> str:
    """The text of an OpenAI ``content`` field: a string, a list of ``{"type": "text", "text": ...}`` parts, or None.

    A part a text policy cannot see (an image, an audio clip, a file) becomes a ``[type]`` placeholder, as the
    Responses and Messages surfaces do, so the prompt shows that something was there instead of losing it without a
    trace; a ``refusal`` part gives its text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, Mapping) and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])
            elif isinstance(part, Mapping) and part.get("type") not in _TEXT_PART_TYPES:
                parts.append(f"[{part.get('type')}]")
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def short_tool_call_id(call_id: str, length: int) -> str:
    """A tool-call id of exactly ``length`` letters and digits (Mistral demands 9): kept when it already is one,
    otherwise derived from ``call_id`` deterministically so an assistant tool call and its result still match."""
    if len(call_id) == length and all(c in _ALNUM for c in call_id):
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:length])


def _arguments_value(arguments: Any, family: Family) -> Any:
    if family.arguments == "string":
        return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments  # not JSON: the template shows the text as sampled
    return arguments


def _tool_call_id(raw: Any, family: Family) -> str:
    call_id = str(raw or "")
    if family.tool_call_id_length is not None:
        return short_tool_call_id(call_id, family.tool_call_id_length)
    return call_id


def to_template_messages(messages: Sequence[Mapping[str, Any]], family: Family) -> list[Message]:
    """Shape OpenAI messages for ``family``'s chat template (see the module docstring)."""
    out: list[Message] = []
    for msg in messages:
        role = msg.get("role")
        shaped: Message = {"role": role, "content": message_text(msg.get("content"))}
        if role == "assistant":
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if family.reasoning_key and isinstance(reasoning, str) and reasoning:
                shaped[family.reasoning_key] = reasoning
            calls = msg.get("tool_calls") or []
            if calls:
                shaped["tool_calls"] = [
                    {
                        "id": _tool_call_id(call.get("id"), family),
                        "type": "function",
                        "function": {
                            "name": call.get("function", {}).get("name", ""),
                            "arguments": _arguments_value(call.get("function", {}).get("arguments", "{}"), family),
                        },
                    }
                    for call in calls
                ]
                if family.single_tool_call and len(calls) > 1:  # one turn per call: the template shows only one
                    first = {**shaped, "tool_calls": shaped["tool_calls"][:1]}
                    out.append(first)
                    out.extend(
                        {"role": "assistant", "content": "", "tool_calls": [call]} for call in shaped["tool_calls"][1:]
                    )
                    continue
        elif role == "tool":
            shaped["tool_call_id"] = _tool_call_id(msg.get("tool_call_id"), family)
            if msg.get("name"):
                shaped["name"] = msg["name"]
        elif msg.get("name"):
            shaped["name"] = msg["name"]
        out.append(shaped)
    return out


def _json_value(text: Any) -> Any:
    if isinstance(text, str):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def message_key(msg: Mapping[str, Any]) -> str:
    """A canonical string for comparing messages across calls (reasoning and tool-call ids ignored)."""
    calls = [
        (c.get("function", {}).get("name"), _json_value(c.get("function", {}).get("arguments")))
        for c in (msg.get("tool_calls") or [])
    ]
    key = {
        "role": msg.get("role"),
        "content": message_text(msg.get("content")),
        "tool_calls": calls,
        "tool_call_id": msg.get("tool_call_id") if msg.get("role") == "tool" else None,
        "name": msg.get("name"),
    }
    return json.dumps(key, sort_keys=True, ensure_ascii=False, default=str)


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A canonical string for a request's tool list (``None`` and ``[]`` are the same)."""
    return json.dumps(list(tools or []), sort_keys=True, ensure_ascii=False, default=str)
