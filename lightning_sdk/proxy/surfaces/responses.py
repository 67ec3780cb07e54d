"""The OpenAI Responses API (``POST /v1/responses``) over the chat form.

Request → chat: ``instructions`` becomes the first system message; ``input`` (a string, or items) becomes
messages: ``message`` items (roles ``user``, ``system``, ``developer`` → system, ``assistant``; text parts),
``function_call_output`` items tool messages, and each run of assistant-side items (``reasoning``, assistant
``message``, ``function_call``) one assistant turn — replaced by the recorded reply when it repeats what the proxy
answered earlier in the attempt (found by the item ids, ``call_id``\\ s, an ``encrypted_content`` reference or its
text), so the bridge reuses the sampled ids. ``previous_response_id`` continues the conversation of an earlier call
of the same attempt (its messages without its instructions, then its reply); an unknown id answers 400.
``tools``: ``function`` tools pass on; ``namespace`` tools are flattened to ``<namespace>__<name>`` for the policy
and mapped back on the way out (``function_call`` items carry ``name`` and ``namespace``); hosted tools
(``web_search``, ``file_search``, ``custom``, ...) are not shown to the policy and are listed on the recorded call.
``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens`` (→ ``max_tokens``), ``temperature``, ``top_p`` and
``text.format`` (→ ``response_format``) pass on; ``store``, ``include``, ``reasoning``, ``prompt_cache_key``,
``metadata`` and ``client_metadata`` are accepted and recorded.

Chat → response: reasoning → a ``reasoning`` item (the text as a ``summary_text``; with ``include:
["reasoning.encrypted_content"]`` an opaque ``encrypted_content`` that names the recorded call), text → a
``message`` item with one ``output_text`` part, tool calls → ``function_call`` items. A reply cut by the token
limit is ``incomplete`` (``max_output_tokens``). Streamed: ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` … ``response.output_item.done`` with the part, text, summary and argument events in
between, then ``response.completed`` (or ``response.incomplete``) carrying the whole response; every event has a
``sequence_number``. Errors use the OpenAI shape.
"""

from __future__ import annotations

import time
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
from lightning_sdk.proxy.surfaces._chat import ChatDeltaReader, PriorReplies, Reply, ToolUse, opaque_ref, surface_of

__all__ = ["ResponsesSurface"]

Message = dict[str, Any]
NAMESPACE_SEP = "__"

_ASSISTANT_ITEMS = ("reasoning", "function_call")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")


def _parts_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of content parts")
    parts: list[str] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
            parts.append(str(part.get("text") or part.get("refusal") or ""))
        elif isinstance(part, dict):
            parts.append(f"[{part.get('type')}]")  # an image or file: the text policy sees a placeholder
        elif isinstance(part, str):
            parts.append(part)
    return "".join(parts)


class ResponsesSurface(SurfaceAdapter):
    """``POST /v1/responses`` (see the module docstring)."""

    api = "responses"

    # -- request ---------------------------------------------------------------------------------------------------
    def parse(self, raw: Any) -> dict[str, Any]:
        body = check_common(raw)
        if not isinstance(body.get("input"), str | list):
            raise _bad("input", "required, a string or a list of input items")
        if body.get("instructions") is not None and not isinstance(body["instructions"], str):
            raise _bad("instructions", "must be a string")
        value = body.get("max_output_tokens")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise _bad("max_output_tokens", "must be a positive integer")
        prev = body.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise _bad("previous_response_id", "must be a string")
        return body

    def first_request_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat-completions form of a first request (``body``, a Responses API body that names no earlier reply):
        the messages and tools the proxy renders for it in token mode. For building training data under a harness's
        own captured prompt (examples/codex_agent)."""
        return self.translate(self.parse(body), PriorReplies([]), "call-to-chat").chat

    def translate(self, body: dict[str, Any], prior: PriorReplies, call_id: str) -> Translation:
        tools, hidden, names = self._tools(body.get("tools") or [])
        messages: list[Message] = []
        if body.get("instructions"):
            messages.append({"role": "system", "content": body["instructions"]})
        prev_id = body.get("previous_response_id")
        if prev_id:
            prev = prior.response_call(prev_id)
            if prev is None:
                raise ProxyHTTPError(
                    400,
                    f"previous_response_id: no response {prev_id!r} in this attempt (responses are kept per attempt)",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            earlier = list(prev.request.get("messages") or [])
            if surface_of(prev).get("instructions"):
                earlier = earlier[1:]
            messages += earlier
            messages.append({k: v for k, v in prior.reply(prev).items() if v is not None or k == "content"})
        flat: dict[tuple[str | None, str], str] = {(ns, name): seen for seen, (ns, name) in names.items() if ns}
        items = body["input"]
        if isinstance(items, str):
            messages.append({"role": "user", "content": items})
        else:
            messages += self._items(items, prior, flat)
        if not messages:
            raise _bad("input", "nothing to answer: no input items")
        chat = chat_form(body, messages, tools)
        choice = body.get("tool_choice")
        if isinstance(choice, str):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") == "function":
            chat["tool_choice"] = {"type": "function", "function": {"name": str(choice.get("name"))}}
        if isinstance(body.get("parallel_tool_calls"), bool) and tools:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        suffix = call_id.removeprefix("call-")
        record: dict[str, Any] = {
            "api": self.api,
            "request": original_request(body),
            "hidden_tools": hidden,
            "response_id": "resp_" + suffix,
            "instructions": bool(body.get("instructions")),
        }
        state = {
            "suffix": suffix,
            "call_id": call_id,
            "names": names,
            "body": body,
            "created": int(time.time()),
            "encrypted": "reasoning.encrypted_content" in (body.get("include") or ()),
        }
        return Translation(chat=chat, record=record, state=state)

    def _items(self, items: list[Any], prior: PriorReplies, flat: dict[tuple[str | None, str], str]) -> list[Message]:
        out: list[Message] = []
        turn: list[tuple[int, dict[str, Any]]] = []  # the assistant-side items of one turn

        def flush() -> None:
            if turn:
                out.append(self._assistant_turn(turn, prior, flat))
                turn.clear()

        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise _bad(f"input[{i}]", "must be an object")
            kind = item.get("type") or ("message" if "role" in item else None)
            if kind in _ASSISTANT_ITEMS or (kind == "message" and item.get("role") == "assistant"):
                turn.append((i, item))
                continue
            flush()
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer"):
                    raise _bad(f"input[{i}].role", "must be one of user, assistant, system, developer")
                text = _parts_text(item.get("content"), f"input[{i}].content")
                out.append({"role": "system" if role == "developer" else role, "content": text})
            elif kind == "function_call_output":
                output = _parts_text(item.get("output"), f"input[{i}].output")
                out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": output})
            else:
                raise _bad(f"input[{i}].type", f"item type {kind!r} is not supported by this proxy")
        flush()
        return out

    def _assistant_turn(
        self, turn: list[tuple[int, dict[str, Any]]], prior: PriorReplies, flat: dict[tuple[str | None, str], str]
    ) -> Message:
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[Message] = []
        refs: list[Any] = []
        for i, item in turn:
            refs.append(item.get("id"))
            kind = item.get("type") or "message"
            if kind == "reasoning":
                refs.append(item.get("encrypted_content"))
                for part in [*(item.get("summary") or []), *(item.get("content") or [])]:
                    if isinstance(part, dict):
                        reasoning.append(str(part.get("text") or ""))
            elif kind == "message":
                text.append(_parts_text(item.get("content"), f"input[{i}].content"))
            else:
                refs.append(item.get("call_id"))
                name = str(item.get("name") or "")
                ns = item.get("namespace")
                calls.append(
                    {
                        "id": str(item.get("call_id") or ""),
                        "type": "function",
                        "function": {"name": flat.get((ns, name), name), "arguments": str(item.get("arguments") or "")},
                    }
                )
        literal: Message = {"role": "assistant", "content": "".join(text)}
        if reasoning:
            literal["reasoning_content"] = "\n".join(reasoning)
        if calls:
            literal["tool_calls"] = calls
        return prior.resolve(literal, refs)

    @staticmethod
    def _tools(tools: list[Any]) -> tuple[list[Message], list[str], dict[str, tuple[str | None, str]]]:
        functions: list[Message] = []
        hidden: list[str] = []
        names: dict[str, tuple[str | None, str]] = {}  # the name the policy sees -> (namespace, name)

        def add(tool: dict[str, Any], where: str, ns: str | None) -> None:
            if not isinstance(tool.get("name"), str):
                raise _bad(f"{where}.name", "required, a string")
            seen = f"{ns}{NAMESPACE_SEP}{tool['name']}" if ns else tool["name"]
            fn: Message = {"name": seen, "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
            if tool.get("description"):
                fn["description"] = tool["description"]
            functions.append({"type": "function", "function": fn})
            names[seen] = (ns, tool["name"])

        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise _bad(f"tools[{i}]", "must be an object")
            kind = tool.get("type")
            if kind == "function":
                add(tool, f"tools[{i}]", None)
            elif kind == "namespace" and isinstance(tool.get("tools"), list):
                for j, inner in enumerate(tool["tools"]):
                    if isinstance(inner, dict) and inner.get("type", "function") == "function":
                        add(inner, f"tools[{i}].tools[{j}]", str(tool.get("name")))
                    else:
                        hidden.append(f"{tool.get('name')}.{inner.get('type') if isinstance(inner, dict) else inner}")
            else:
                hidden.append(str(tool.get("name") or kind))  # a hosted tool the engine cannot run
        return functions, hidden, names

    # -- response --------------------------------------------------------------------------------------------------
    def _call_item(self, t: Translation, index: int, call: ToolUse, status: str) -> dict[str, Any]:
        ns, name = t.state["names"].get(call.name, (None, call.name))
        item: dict[str, Any] = {
            "type": "function_call",
            "id": f"fc_{t.state['suffix']}_{index}",
            "call_id": call.id,
            "name": name,
            "arguments": call.arguments,
            "status": status,
        }
        if ns:
            item["namespace"] = ns
        return item

    def _reasoning_item(self, t: Translation, text: str) -> dict[str, Any]:
        item: dict[str, Any] = {
            "type": "reasoning",
            "id": f"rs_{t.state['suffix']}",
            "summary": [{"type": "summary_text", "text": text}] if text else [],
        }
        if t.state["encrypted"]:
            item["encrypted_content"] = opaque_ref(t.state["call_id"], "reasoning")
        return item

    def _message_item(self, t: Translation, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status else []
        return {
            "type": "message",
            "id": f"msg_{t.state['suffix']}",
            "status": status or "in_progress",
            "role": "assistant",
            "content": content,
        }

    def output(self, t: Translation, reply: Reply) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if reply.reasoning:
            items.append(self._reasoning_item(t, reply.reasoning))
        if reply.text or not reply.tool_calls:
            items.append(self._message_item(t, reply.text, "completed"))
        items += [self._call_item(t, i, c, "completed") for i, c in enumerate(reply.tool_calls)]
        return items

    def _response(self, t: Translation, reply: Reply | None) -> dict[str, Any]:
        body = t.state["body"]
        status = "in_progress"
        incomplete = None
        if reply is not None:
            status = "incomplete" if reply.finish == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
        text = body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
        usage = None
        if reply is not None:
            usage = {
                "input_tokens": reply.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": reply.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            }
        return {
            "id": "resp_" + t.state["suffix"],
            "object": "response",
            "created_at": t.state["created"],
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": body["model"],
            "output": self.output(t, reply) if reply is not None else [],
            "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": bool(body.get("store", True)),
            "temperature": body.get("temperature"),
            "text": text,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "truncation": body.get("truncation") or "disabled",
            "usage": usage,
            "metadata": body.get("metadata") or {},
            "user": body.get("user"),
        }

    def reply_body(self, t: Translation, reply: Reply) -> dict[str, Any]:
        return self._response(t, reply)

    def refs(self, t: Translation, reply: Reply) -> list[str]:
        return [str(item["id"]) for item in self.output(t, reply)]

    def stream(self, t: Translation, ctx: CallContext) -> _ResponsesStream:
        return _ResponsesStream(self, t)

    def error_body(self, err: ProxyHTTPError) -> bytes:
        return orjson.dumps({"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}})


class _ResponsesStream:
    """Chat chunks → Responses stream events (see the module docstring)."""

    def __init__(self, surface: ResponsesSurface, t: Translation) -> None:
        self.surface = surface
        self.t = t
        self.reader = ChatDeltaReader(t.stop)
        self.seq = 0
        self.index = -1  # output_index of the open item
        self.open: dict[str, Any] | None = None  # the open item, as it will be when done
        self.text = ""  # text or reasoning or arguments accumulated for the open item
        self.had_message = False

    def _ev(self, kind: str, data: dict[str, Any]) -> bytes:
        event = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return sse(kind, event)

    def start(self) -> list[bytes]:
        response = self.surface._response(self.t, None)
        return [
            self._ev("response.created", {"response": response}),
            self._ev("response.in_progress", {"response": response}),
        ]

    def _close(self) -> list[bytes]:
        item = self.open
        out: list[bytes] = []
        if item is None:
            return out
        at = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "summary_text", "text": self.text}
            item = self.surface._reasoning_item(self.t, self.text)
            out.append(self._ev("response.reasoning_summary_text.done", {**at, "summary_index": 0, "text": self.text}))
            out.append(self._ev("response.reasoning_summary_part.done", {**at, "summary_index": 0, "part": part}))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item = self.surface._message_item(self.t, self.text, "completed")
            out.append(
                self._ev("response.output_text.done", {**at, "content_index": 0, "text": self.text, "logprobs": []})
            )
            out.append(self._ev("response.content_part.done", {**at, "content_index": 0, "part": part}))
        else:
            item = {**item, "arguments": self.text, "status": "completed"}
            done = {**at, "arguments": self.text, "name": item["name"]}
            out.append(self._ev("response.function_call_arguments.done", done))
        out.append(self._ev("response.output_item.done", {"output_index": self.index, "item": item}))
        self.open, self.text = None, ""
        return out

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = item
        self.had_message = self.had_message or item["type"] == "message"
        out.append(self._ev("response.output_item.added", {"output_index": self.index, "item": item}))
        at = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "summary_text", "text": ""}
            out.append(self._ev("response.reasoning_summary_part.added", {**at, "summary_index": 0, "part": part}))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._ev("response.content_part.added", {**at, "content_index": 0, "part": part}))
        return out

    def _events(self, deltas: list[tuple[Any, ...]]) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            if d[0] == "reasoning":
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._open({"type": "reasoning", "id": f"rs_{self.t.state['suffix']}", "summary": []})
                self.text += d[1]
                at = {"item_id": self.open["id"], "output_index": self.index, "summary_index": 0}  # type: ignore[index]
                out.append(self._ev("response.reasoning_summary_text.delta", {**at, "delta": d[1]}))
            elif d[0] == "text":
                if self.open is None or self.open["type"] != "message":
                    out += self._open(self.surface._message_item(self.t, "", ""))
                self.text += d[1]
                at = {"item_id": self.open["id"], "output_index": self.index, "content_index": 0}  # type: ignore[index]
                out.append(self._ev("response.output_text.delta", {**at, "delta": d[1], "logprobs": []}))
            elif d[0] == "tool":
                out += self._open(self.surface._call_item(self.t, d[1], ToolUse(d[2], d[3], ""), "in_progress"))
            elif d[0] == "args" and self.open is not None and self.open["type"] == "function_call":
                self.text += d[2]
                at = {"item_id": self.open["id"], "output_index": self.index}
                out.append(self._ev("response.function_call_arguments.delta", {**at, "delta": d[2]}))
        return out

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        return self._events(self.reader.feed(chunk))

    def finish(self, reply: Reply) -> list[bytes]:
        out = self._events(self.reader.rest(reply.text))
        if not reply.text and not reply.tool_calls and not self.had_message:
            out += self._open(self.surface._message_item(self.t, "", ""))  # an empty answer still has its message
        out += self._close()
        response = self.surface._response(self.t, reply)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        out.append(self._ev(kind, {"response": response}))
        return out

    def error(self, err: ProxyHTTPError) -> bytes:
        failed = {**self.surface._response(self.t, None), "status": "failed"}
        failed["error"] = {"code": err.code or err.kind, "message": err.message}
        return self._ev("error", {"code": err.code or err.kind, "message": err.message, "param": err.param}) + self._ev(
            "response.failed", {"response": failed}
        )
