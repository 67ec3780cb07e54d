"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat form.

Request → chat: ``system`` (a string or text blocks, ``cache_control`` ignored) and system-role messages become
system messages; ``text`` blocks the message text; ``tool_use`` blocks tool calls (``input`` as JSON arguments);
``tool_result`` blocks (string or text blocks; ``is_error`` marked in the text) tool messages, before the user's
text as the API orders them; ``thinking`` blocks the turn's reasoning. An assistant turn that repeats what the
proxy answered earlier in the attempt (found by its ``tool_use`` ids, its thinking signature or its text) is
replaced by the recorded reply, so the bridge reuses the sampled ids. ``tools`` with ``input_schema`` become
functions; server tools (a ``type`` such as ``web_search_20250305``) are not shown to the policy and are listed
on the recorded call. ``tool_choice`` maps to ``auto``/``required``/a named function/``none``; ``max_tokens``,
``stop_sequences``, ``temperature``, ``top_p`` pass on; ``thinking``, ``metadata``, ``context_management``,
``output_config``, ``cache_control`` and the beta headers are accepted and recorded (the policy's template decides
about reasoning).

Chat → response: reasoning → a ``thinking`` block (its ``signature`` an opaque reference to the recorded call),
text → a ``text`` block, tool calls → ``tool_use`` blocks; ``stop_reason`` ``end_turn`` / ``tool_use`` /
``max_tokens`` / ``stop_sequence`` (with the sequence). Streamed: ``message_start``, ``ping``, per block
``content_block_start`` / ``content_block_delta`` (``thinking_delta`` + ``signature_delta``, ``text_delta``,
``input_json_delta``) / ``content_block_stop``, ``message_delta`` (stop reason, usage), ``message_stop``.
Errors use Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``; a prompt past the policy's
context answers 400 ``prompt is too long: ...``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from lightning_sdk.proxy._backend import CallContext
from lightning_sdk.proxy._errors import ProxyHTTPError, _bad
from lightning_sdk.proxy.surfaces._base import (
    SurfaceAdapter,
    Translation,
    chat_form,
    check_common,
    original_request,
    sse,
)
from lightning_sdk.proxy.surfaces._chat import PriorReplies, Reply, opaque_ref

__all__ = ["MessagesSurface", "anthropic_error"]

Message = dict[str, Any]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error(err: ProxyHTTPError) -> dict[str, Any]:
    """The Anthropic error body of a proxy error (context overflow reads ``prompt is too long``)."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    message = err.message
    if err.code == "context_length_exceeded" and "prompt is too long" not in message:
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text_of(content: Any, where: str) -> str:
    """The text of a string or a list of blocks (text blocks kept; other blocks named in brackets)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of content blocks")
    parts: list[str] = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text") or ""))
        elif isinstance(block, dict):
            parts.append(f"[{block.get('type')}]")  # an image or document: the text policy sees a placeholder
    return "\n".join(parts)


class MessagesSurface(SurfaceAdapter):
    """``POST /v1/messages`` (see the module docstring)."""

    api = "messages"

    # -- request ---------------------------------------------------------------------------------------------------
    def parse(self, raw: Any) -> dict[str, Any]:
        body = check_common(raw)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _bad("messages", "Field required (a list of messages)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
                raise _bad(f"messages.{i}.role", "must be 'user' or 'assistant'")
            if not isinstance(m.get("content"), str | list):
                raise _bad(f"messages.{i}.content", "must be a string or a list of content blocks")
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            raise _bad("max_tokens", "Field required")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise _bad("max_tokens", f"must be an integer, got {json.dumps(max_tokens)[:40]}")
        if max_tokens < 1:
            raise _bad("max_tokens", f"must be at least 1, got {max_tokens}")
        stops = body.get("stop_sequences")
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
            raise _bad("stop_sequences", "must be a list of strings")
        return body

    def translate(self, body: dict[str, Any], prior: PriorReplies, call_id: str) -> Translation:
        messages: list[Message] = []
        system = body.get("system")
        if system:
            messages.append({"role": "system", "content": _text_of(system, "system")})
        for i, msg in enumerate(body["messages"]):
            messages.extend(self._message(msg, i, prior))
        if not any(m["role"] != "system" for m in messages):
            raise _bad("messages", "at least one user message is required")
        tools, hidden = self._tools(body.get("tools") or [])
        stop = list(body.get("stop_sequences") or [])
        chat = chat_form(body, messages, tools)
        chat["max_tokens"] = body.get("max_tokens")
        choice = body.get("tool_choice")
        if choice is not None and not isinstance(choice, dict):
            raise _bad("tool_choice", "must be an object with a type (auto, any, tool, none)")
        if isinstance(choice, dict):
            kind = choice.get("type")
            if kind == "any":
                chat["tool_choice"] = "required"
            elif kind == "tool":
                chat["tool_choice"] = {"type": "function", "function": {"name": str(choice.get("name"))}}
            elif kind in ("auto", "none"):
                chat["tool_choice"] = kind
            else:
                raise _bad("tool_choice.type", "must be one of auto, any, tool, none")
            if choice.get("disable_parallel_tool_use"):
                chat["parallel_tool_calls"] = False
        if stop:
            chat["stop"] = stop
        record: dict[str, Any] = {"api": self.api, "request": original_request(body), "hidden_tools": hidden}
        state = {"id": "msg_" + call_id.removeprefix("call-"), "call_id": call_id, "model": body["model"]}
        return Translation(chat=chat, record=record, stop=stop, state=state)

    def _message(self, msg: dict[str, Any], index: int, prior: PriorReplies) -> list[Message]:
        role, content = msg["role"], msg["content"]
        where = f"messages.{index}.content"
        if role == "system":
            return [{"role": "system", "content": _text_of(content, where)}]
        if isinstance(content, str):
            return [{"role": role, "content": content}]
        if role == "user":
            out: list[Message] = []
            texts: list[str] = []
            for j, block in enumerate(content):
                if not isinstance(block, dict):
                    raise _bad(f"{where}.{j}", "must be a content block object")
                if block.get("type") == "tool_result":
                    text = _text_of(block.get("content"), f"{where}.{j}.content")
                    if block.get("is_error"):
                        text = f"Error: {text}"
                    out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": text})
                elif block.get("type") == "text":
                    texts.append(str(block.get("text") or ""))
                else:
                    texts.append(f"[{block.get('type')}]")
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
            return out
        # assistant: thinking, text and tool_use blocks form one chat turn
        said: list[str] = []
        thinking: list[str] = []
        calls: list[Message] = []
        refs: list[Any] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                said.append(str(block.get("text") or ""))
            elif kind == "thinking":
                thinking.append(str(block.get("thinking") or ""))
                refs.append(block.get("signature"))
            elif kind == "redacted_thinking":
                refs.append(block.get("data"))
            elif kind in ("tool_use", "server_tool_use"):
                refs.append(block.get("id"))
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append(
                    {
                        "id": str(block.get("id") or ""),
                        "type": "function",
                        "function": {"name": str(block.get("name") or ""), "arguments": arguments},
                    }
                )
            else:
                raise _bad(f"{where}.{j}.type", "assistant blocks must be text, thinking or tool_use")
        literal: Message = {"role": "assistant", "content": "".join(said)}
        if thinking:
            literal["reasoning_content"] = "".join(thinking)
        if calls:
            literal["tool_calls"] = calls
        return [prior.resolve(literal, refs)]

    @staticmethod
    def _tools(tools: list[Any]) -> tuple[list[Message], list[str]]:
        functions: list[Message] = []
        hidden: list[str] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise _bad(f"tools.{i}.name", "Field required")
            if tool.get("type") not in (None, "custom"):
                hidden.append(f"{tool['type']}:{tool['name']}")  # a server tool the policy cannot run
                continue
            fn: Message = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
            if tool.get("description"):
                fn["description"] = tool["description"]
            functions.append({"type": "function", "function": fn})
        return functions, hidden

    # -- response --------------------------------------------------------------------------------------------------
    @staticmethod
    def _stop_reason(reply: Reply) -> str:
        if reply.finish == "length":
            return "max_tokens"  # cut by the token limit, even after a complete tool call
        if reply.tool_calls:
            return "tool_use"
        return "stop_sequence" if reply.stop_sequence is not None else "end_turn"

    @staticmethod
    def _usage(reply: Reply) -> dict[str, int]:
        return {
            "input_tokens": reply.prompt_tokens,
            "output_tokens": reply.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }

    def reply_body(self, t: Translation, reply: Reply) -> dict[str, Any]:
        blocks: list[Message] = []
        if reply.reasoning:
            signature = opaque_ref(t.state["call_id"], "thinking")
            blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": signature})
        if reply.text:
            blocks.append({"type": "text", "text": reply.text})
        blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.input_value()} for c in reply.tool_calls]
        return {
            "id": t.state["id"],
            "type": "message",
            "role": "assistant",
            "model": t.state["model"],
            "content": blocks,
            "stop_reason": self._stop_reason(reply),
            "stop_sequence": reply.stop_sequence,
            "usage": self._usage(reply),
        }

    def refs(self, t: Translation, reply: Reply) -> list[str]:
        return [opaque_ref(t.state["call_id"], "thinking")] if reply.reasoning else []

    def stream(self, t: Translation, ctx: CallContext) -> _MessagesStream:
        return _MessagesStream(self, t, ctx.prompt_tokens or 0)

    def error_body(self, err: ProxyHTTPError) -> bytes:
        return orjson.dumps(anthropic_error(err))


class _MessagesStream:
    """Chat chunks → Messages stream events (see the module docstring)."""

    def __init__(self, surface: MessagesSurface, t: Translation, input_tokens: int = 0) -> None:
        from lightning_sdk.proxy.surfaces._chat import ChatDeltaReader

        self.surface = surface
        self.t = t
        self.input_tokens = input_tokens  # the prompt's length when the backend knew it before its first chunk
        self.reader = ChatDeltaReader(t.stop)
        self.index = -1
        self.open: str | None = None  # the type of the open block
        self.tool: int | None = None  # the chat index of the open tool_use block

    def start(self) -> list[bytes]:
        message = {
            "id": self.t.state["id"],
            "type": "message",
            "role": "assistant",
            "model": self.t.state["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [sse("message_start", {"type": "message_start", "message": message}), sse("ping", {"type": "ping"})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": opaque_ref(self.t.state["call_id"], "thinking")}
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open, self.tool = None, None
        return out

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        out.append(
            sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _events(self, deltas: list[tuple[Any, ...]]) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            if d[0] == "reasoning":
                if self.open != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": d[1]}))
            elif d[0] == "text":
                if self.open != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d[1]}))
            elif d[0] == "tool":
                out += self._open({"type": "tool_use", "id": d[2], "name": d[3], "input": {}})
                self.tool = d[1]
            elif d[0] == "args" and self.open == "tool_use" and self.tool == d[1]:
                out.append(self._delta({"type": "input_json_delta", "partial_json": d[2]}))
        return out

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        return self._events(self.reader.feed(chunk))

    def finish(self, reply: Reply) -> list[bytes]:
        out = self._events(self.reader.rest(reply.text))
        out += self._close()
        usage = self.surface._usage(reply)
        delta = {"stop_reason": self.surface._stop_reason(reply), "stop_sequence": reply.stop_sequence}
        out.append(sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out

    def error(self, err: ProxyHTTPError) -> bytes:
        return sse("error", anthropic_error(err))
