"""What both surfaces share: the internal chat-completions form they translate to and from.

A surface request (Responses ``input`` items, Messages ``messages`` blocks) becomes a chat-completions body that
the policy backend serves unchanged — token mode renders it through the bridge, passthrough forwards it to the
engine's ``/chat/completions`` with ``return_token_ids``. The backend's answer comes back as a chat message, which
``Reply`` reads into the parts a surface shows: reasoning, text, tool calls, why it stopped.

Recognising the proxy's own output: an agent sends its earlier replies back in the surface's own form (Responses
``function_call`` items with the ids the proxy gave them, Messages ``tool_use`` blocks, thinking signatures).
``PriorReplies`` indexes the attempt's earlier calls by every id the proxy handed out and by the text it showed;
when an assistant turn of a new request shows exactly what an earlier call showed, the turn is replaced by that
call's recorded chat reply (its reasoning, the arguments exactly as sampled), so the bridge finds the earlier call
and reuses the sampled ids verbatim. A turn that was edited is translated as sent (and the bridge splits, honestly).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_sdk.tokens import message_key, trailing_partial
from lightning_sdk.types import Call

__all__ = [
    "ChatDeltaReader",
    "PriorReplies",
    "Reply",
    "ToolUse",
    "opaque_ref",
    "read_opaque_ref",
    "surface_of",
]

Message = dict[str, Any]
_REF_PREFIX = "lsdk1."


def opaque_ref(call_id: str, kind: str) -> str:
    """An opaque token naming a recorded call (thinking signatures, ``encrypted_content``); resolved by the proxy."""
    raw = json.dumps({"call": call_id, "kind": kind}, separators=(",", ":")).encode()
    return _REF_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def read_opaque_ref(token: Any) -> str | None:
    """The call id inside an ``opaque_ref`` token (None for anything else: a real provider's signature)."""
    if not isinstance(token, str) or not token.startswith(_REF_PREFIX):
        return None
    body = token[len(_REF_PREFIX) :]
    try:
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (ValueError, TypeError):
        return None
    call = data.get("call") if isinstance(data, dict) else None
    return call if isinstance(call, str) else None


def surface_of(call: Call) -> dict[str, Any]:
    """The ``request["surface"]`` record of a call served through a surface (empty for chat completions)."""
    surface = call.request.get("surface")
    return surface if isinstance(surface, dict) else {}


# -- the reply, read from the chat form ------------------------------------------------------------------------------
@dataclass
class ToolUse:
    """One tool call of a reply: ``arguments`` is the JSON text as sampled."""

    id: str
    name: str
    arguments: str

    def input_value(self) -> dict[str, Any]:
        """The arguments as a JSON object (Anthropic ``input``); text that is not an object is kept under a key."""
        try:
            value = json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError:
            return {"arguments": self.arguments}
        return value if isinstance(value, dict) else {"arguments": value}


@dataclass
class Reply:
    """An assistant reply as a surface shows it (``text`` cut at a matched stop sequence)."""

    reasoning: str = ""
    text: str = ""
    tool_calls: list[ToolUse] = field(default_factory=list)
    finish: str = "stop"  # stop | length | tool_calls
    stop_sequence: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def from_chat(cls, response: dict[str, Any], stop: Sequence[str] = ()) -> Reply:
        """Read choice 0 of a ``chat.completion`` (as the backend answered it)."""
        choices = response.get("choices") or [{}]
        choice = choices[0] or {}
        msg = choice.get("message") or {}
        calls = [
            ToolUse(
                str(tc.get("id") or ""),
                str((tc.get("function") or {}).get("name") or ""),
                str((tc.get("function") or {}).get("arguments") or ""),
            )
            for tc in msg.get("tool_calls") or ()
        ]
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        text, matched = cut_at_stop(str(msg.get("content") or ""), stop, choice.get("stop_reason"))
        usage = response.get("usage") or {}
        finish = str(choice.get("finish_reason") or "stop")
        return cls(
            reasoning=str(reasoning),
            text=text,
            tool_calls=calls,
            finish="tool_calls" if calls and finish == "stop" else finish,
            stop_sequence=matched,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )

    def shown(self) -> Message:
        """The assistant chat message of what the agent was shown (compared with what it sends back)."""
        msg: Message = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return msg


def cut_at_stop(text: str, stop: Sequence[str], engine_match: Any = None) -> tuple[str, str | None]:
    """``text`` up to the first stop sequence in it, and the sequence (an engine that already removed it says which
    one in vLLM's ``stop_reason``)."""
    best: tuple[int, str] | None = None
    for s in stop:
        pos = text.find(s) if s else -1
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    if best is not None:
        return text[: best[0]], best[1]
    if isinstance(engine_match, str) and engine_match in stop:
        return text, engine_match
    return text, None


# -- streamed chat chunks -> normalised deltas ------------------------------------------------------------------------
class ChatDeltaReader:
    """Reads ``chat.completion.chunk`` objects and yields surface-neutral deltas, holding back text that may be
    the start of a stop sequence (the surface must never show the stop sequence itself).

    Deltas: ``("reasoning", text)``, ``("text", text)``, ``("tool", index, id, name)`` when a tool call starts,
    ``("args", index, fragment)`` for its arguments.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self._text = ""  # all content received
        self._shown = 0  # how much of it was emitted
        self._stopped = False
        self._tools: dict[int, str] = {}

    def feed(self, chunk: dict[str, Any]) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                out.append(("reasoning", str(reasoning)))
            if delta.get("content"):
                out.extend(self._content(str(delta["content"])))
            for tc in delta.get("tool_calls") or ():
                index = int(tc.get("index", 0))
                fn = tc.get("function") or {}
                if index not in self._tools:
                    self._tools[index] = str(tc.get("id") or "")
                    out.append(("tool", index, self._tools[index], str(fn.get("name") or "")))
                if fn.get("arguments"):
                    out.append(("args", index, str(fn["arguments"])))
        return out

    def _content(self, piece: str) -> list[tuple[Any, ...]]:
        if self._stopped:
            return []
        self._text += piece
        text, matched = cut_at_stop(self._text, self.stop)
        if matched is not None:
            self._stopped = True
            safe = len(text)
        else:
            safe = trailing_partial(self._text, self.stop) if self.stop else len(self._text)
        if safe <= self._shown:
            return []
        new = self._text[self._shown : safe]
        self._shown = safe
        return [("text", new)]

    def rest(self, final_text: str) -> list[tuple[Any, ...]]:
        """The text still held back, given the reply's final (cut) text."""
        shown = self._text[: self._shown]
        if final_text.startswith(shown) and len(final_text) > len(shown):
            self._shown = len(final_text)
            return [("text", final_text[len(shown) :])]
        return []


# -- recognising earlier output -------------------------------------------------------------------------------------
class PriorReplies:
    """The attempt's earlier calls, indexed by the ids and text the proxy showed (see the module docstring)."""

    def __init__(self, calls: Iterable[Call]) -> None:
        self.calls: dict[str, Call] = {}
        self._by_ref: dict[str, str] = {}
        self._by_text: dict[str, str] = {}
        for call in calls:
            if call.error is not None or not call.response.get("choices"):
                continue
            self.calls[call.call_id] = call
            surface = surface_of(call)
            for ref in surface.get("refs") or ():
                self._by_ref[str(ref)] = call.call_id
            reply = self.reply(call)
            for tc in reply.get("tool_calls") or ():
                if tc.get("id"):
                    self._by_ref[str(tc["id"])] = call.call_id
            shown = surface.get("shown")
            if isinstance(shown, dict):
                self._by_text[message_key(shown)] = call.call_id

    @staticmethod
    def reply(call: Call) -> Message:
        choices = call.response.get("choices") or [{}]
        msg = choices[0].get("message") or {}
        return dict(msg) if isinstance(msg, dict) else {}

    def by_ref(self, ref: Any) -> Call | None:
        if not isinstance(ref, str) or not ref:
            return None
        call_id = self._by_ref.get(ref) or read_opaque_ref(ref)
        return self.calls.get(call_id) if call_id else None

    def resolve(self, literal: Message, refs: Sequence[Any]) -> Message:
        """The recorded reply this assistant turn repeats, or the turn as sent when it repeats none."""
        key = message_key(literal)
        candidates = [c for c in (self.by_ref(r) for r in refs) if c is not None]
        by_text = self._by_text.get(key)
        if by_text is not None and by_text in self.calls:
            candidates.append(self.calls[by_text])
        for call in candidates:
            shown = surface_of(call).get("shown")
            if isinstance(shown, dict) and message_key(shown) == key:
                reply = self.reply(call)
                return {k: v for k, v in reply.items() if v is not None or k == "content"}
            if not shown and message_key(self.reply(call)) == key:  # a chat-completions call
                return self.reply(call)
        return literal

    def response_call(self, response_id: str) -> Call | None:
        """The call that answered as ``response_id`` (Responses ``previous_response_id``)."""
        for call in self.calls.values():
            if surface_of(call).get("response_id") == response_id:
                return call
        return None
