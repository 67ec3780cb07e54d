"""The output parsers of the families in TOKENIZERS.md.

- ``hermes`` (Qwen3) / ``hermes-nothink`` (Qwen2.5): ``<think>…</think>`` then content and
  ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>`` blocks (several = parallel calls).
- ``llama3-json``: the whole reply is ``{"name": …, "parameters": {…}}`` (optionally after ``<|python_tag|>``;
  several objects separated by ``;`` or newlines, or a JSON list, are parallel calls), otherwise it is content.
- ``mistral``: content, then ``[TOOL_CALLS][{"name": …, "arguments": {…}, "id": "…"}, …]``.
- ``harmony`` (gpt-oss): messages ``<|channel|>analysis|final|commentary…<|message|>…<|end|>``; analysis is reasoning,
  final (and commentary without a recipient) is content, ``to=functions.NAME`` with ``<|call|>`` is a tool call.
- ``deepseek-v3``: reasoning up to ``</think>`` when the prompt opened it, content, then
  ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>…``.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from lightning_sdk.tokens._parse import OutputParser, ParsedReply, ToolCall, register_parser, trailing_partial

__all__ = ["DeepSeekV3Parser", "HarmonyParser", "HermesParser", "Llama3JsonParser", "MistralParser"]

_DECODER = json.JSONDecoder()


def _arguments_text(value: Any) -> str | None:
    """Tool-call arguments as JSON text (an object, or a string holding a JSON object); None when invalid."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            return value if isinstance(json.loads(value), dict) else None
        except ValueError:
            return None
    return None


def _call_from_object(obj: Any, *, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    value: Any = {}
    for key in args_keys:
        if key in obj:
            value = obj[key]
            break
    arguments = _arguments_text(value)
    if arguments is None:
        return None
    call_id = obj.get("id")
    return ToolCall(obj["name"], arguments, call_id if isinstance(call_id, str) and call_id else None)


def _split_reasoning(text: str, in_reasoning: bool) -> tuple[str, str]:
    """(reasoning, rest): a leading ``<think>…</think>`` block, or text up to ``</think>`` when already open."""
    if not in_reasoning:
        if not text.startswith("<think>"):
            return "", text
        text = text[len("<think>") :]
    end = text.find("</think>")
    if end == -1:  # still thinking (cut off, or a partial stream)
        return text.strip("\n"), ""
    return text[:end].strip("\n"), text[end + len("</think>") :].lstrip("\n")


# ---------------------------------------------------------------------------------------------------------------------


@register_parser
class HermesParser(OutputParser):
    """Qwen3 (and other Hermes-style templates with reasoning)."""

    name = "hermes"
    thinks = True
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>", "</tool_call>", "<think>", "</think>")
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse_text(self, text: str, *, in_reasoning: bool = False) -> ParsedReply:
        reasoning, rest = _split_reasoning(text, in_reasoning) if self.thinks else ("", text)
        pieces: list[str] = []  # content outside valid tool calls
        calls: list[ToolCall] = []
        start = pos = 0
        while True:
            i = rest.find(self.open_tag, pos)
            if i == -1:
                break
            j = rest.find(self.close_tag, i)
            if j == -1:
                break  # unclosed: stays content
            call = self._call(rest[i + len(self.open_tag) : j])
            pos = j + len(self.close_tag)
            if call is not None:
                pieces.append(rest[start:i])
                calls.append(call)
                start = pos
        tail = rest[start:]
        if not calls:
            return ParsedReply(content=rest, reasoning=reasoning)
        head = pieces[0][:-1] if pieces[0].endswith("\n") else pieces[0]  # the template writes "\n" before a call
        others = [p for p in (*pieces[1:], tail) if p.strip()]
        return ParsedReply(content=head + "".join(others), reasoning=reasoning, tool_calls=calls)

    def _call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return None
        return _call_from_object(obj, args_keys=("arguments", "parameters"))

    def settled(self, text: str, *, in_reasoning: bool = False) -> int:
        cut = len(text)
        opened = text.rfind(self.open_tag)
        if opened != -1 and text.find(self.close_tag, opened) == -1:
            cut = opened
        return self.hold_whitespace(text, cut)


@register_parser
class HermesNoThinkParser(HermesParser):
    """Qwen2.5: the same tool calls, no reasoning (``<think>`` is plain text)."""

    name = "hermes-nothink"
    thinks = False
    markers = ("<tool_call>", "</tool_call>")


# ---------------------------------------------------------------------------------------------------------------------


@register_parser
class Llama3JsonParser(OutputParser):
    """Llama 3.1/3.2/3.3 JSON tool calls."""

    name = "llama3-json"
    markers = ("<|python_tag|>",)
    python_tag = "<|python_tag|>"

    def parse_text(self, text: str, *, in_reasoning: bool = False) -> ParsedReply:
        body = text[len(self.python_tag) :] if text.startswith(self.python_tag) else text
        calls = self._calls(body.strip())
        if calls:
            return ParsedReply(tool_calls=calls)
        return ParsedReply(content=text)

    def _calls(self, body: str) -> list[ToolCall] | None:
        if not body or body[0] not in "[{":
            return None
        objects: list[Any] = []
        pos = 0
        try:
            while pos < len(body):
                obj, pos = _DECODER.raw_decode(body, pos)
                objects.extend(obj if isinstance(obj, list) else [obj])
                while pos < len(body) and body[pos] in " \t\r\n;,":
                    pos += 1
        except ValueError:
            return None
        calls = [_call_from_object(o, args_keys=("parameters", "arguments")) for o in objects]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]

    def settled(self, text: str, *, in_reasoning: bool = False) -> int:
        stripped = text.lstrip()
        if not stripped or stripped[0] in "[{" or stripped.startswith(self.python_tag[: len(stripped)]):
            return 0  # may be a tool call: decided when it ends
        return self.hold_whitespace(text, len(text))


# ---------------------------------------------------------------------------------------------------------------------


@register_parser
class MistralParser(OutputParser):
    """Mistral (v3 / tekken) ``[TOOL_CALLS]`` JSON lists."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    tag = "[TOOL_CALLS]"

    def parse_text(self, text: str, *, in_reasoning: bool = False) -> ParsedReply:
        i = text.find(self.tag)
        if i == -1:
            return ParsedReply(content=text)
        calls = self._calls(text[i + len(self.tag) :].strip())
        if calls is None:
            return ParsedReply(content=text)
        return ParsedReply(content=text[:i], tool_calls=calls)

    def _calls(self, body: str) -> list[ToolCall] | None:
        try:
            obj, end = _DECODER.raw_decode(body)
        except ValueError:
            return None
        if body[end:].strip():
            return None
        objects = obj if isinstance(obj, list) else [obj]
        calls = [_call_from_object(o) for o in objects]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]

    def settled(self, text: str, *, in_reasoning: bool = False) -> int:
        i = text.find(self.tag)
        return self.hold_whitespace(text, len(text) if i == -1 else i)


# ---------------------------------------------------------------------------------------------------------------------


@register_parser
class HarmonyParser(OutputParser):
    """gpt-oss harmony channels."""

    name = "harmony"
    start, message = "<|start|>", "<|message|>"
    ends = ("<|end|>", "<|return|>", "<|call|>")
    markers = ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
    _channel = re.compile(r"<\|channel\|>\s*(\w+)")
    _recipient = re.compile(r"to=([^\s<]+)")

    def parse_text(self, text: str, *, in_reasoning: bool = False) -> ParsedReply:
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        for k, piece in enumerate(text.split(self.start)):
            if k > 0 and piece.startswith("assistant"):
                piece = piece[len("assistant") :]
            raw = piece if k == 0 else self.start + piece
            m = piece.find(self.message)
            if m == -1:
                if piece.strip():
                    content.append(raw)  # a header that never got to its message
                continue
            header, body = piece[:m], piece[m + len(self.message) :]
            ends = [(body.find(e), e) for e in self.ends if e in body]
            if ends:
                end, terminator = min(ends)
                if body[end + len(terminator) :].strip():  # text after the terminator: not harmony
                    content.append(raw)
                    continue
                body = body[:end]
            channel = self._channel.search(header)
            recipient = self._recipient.search(header)
            if recipient is not None:
                target = recipient.group(1)
                name = target[len("functions.") :] if target.startswith("functions.") else target
                arguments = _arguments_text(body.strip())
                if arguments is None or not name:
                    content.append(raw)
                else:
                    calls.append(ToolCall(name, body.strip()))
            elif channel is not None and channel.group(1) == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
        return ParsedReply(content="".join(content), reasoning="\n".join(reasoning), tool_calls=calls)

    def settled(self, text: str, *, in_reasoning: bool = False) -> int:
        last = text.rfind(self.start)
        begin = 0 if last == -1 else last
        current = text[begin:]
        m = current.find(self.message)
        if m == -1:
            return begin  # the header is not complete yet
        header, body = current[:m], current[m + len(self.message) :]
        if any(e in body for e in self.ends):
            return trailing_partial(text, self.markers)
        if self._recipient.search(header):
            return begin  # a tool call: held until <|call|>
        return trailing_partial(text, self.markers)


# ---------------------------------------------------------------------------------------------------------------------


@register_parser
class DeepSeekV3Parser(OutputParser):
    """DeepSeek-V3 tool-call tokens (and R1-style reasoning)."""

    name = "deepseek-v3"
    thinks = True
    calls_begin, calls_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    markers = ("<think>", "</think>", calls_begin)
    _call = re.compile(r"(?s)\A[^<]*" + re.escape(sep) + r"(?P<name>[^\n]+)\n```json\n(?P<args>.*)\n```\Z")

    def parse_text(self, text: str, *, in_reasoning: bool = False) -> ParsedReply:
        reasoning, rest = _split_reasoning(text, in_reasoning)
        i = rest.find(self.calls_begin)
        if i == -1:
            return ParsedReply(content=rest, reasoning=reasoning)
        calls = self._calls(rest[i + len(self.calls_begin) :])
        if calls is None:
            return ParsedReply(content=rest, reasoning=reasoning)
        return ParsedReply(content=rest[:i], reasoning=reasoning, tool_calls=calls)

    def _calls(self, region: str) -> list[ToolCall] | None:
        end = region.find(self.calls_end)
        if end != -1:
            if region[end + len(self.calls_end) :].strip():
                return None
            region = region[:end]
        calls: list[ToolCall] = []
        for piece in region.split(self.call_begin)[1:]:
            piece = piece.strip("\n")
            if not piece.endswith(self.call_end):
                return None
            m = self._call.match(piece[: -len(self.call_end)])
            if m is None or _arguments_text(m.group("args")) is None:
                return None
            calls.append(ToolCall(m.group("name").strip(), m.group("args")))
        return calls or None

    def settled(self, text: str, *, in_reasoning: bool = False) -> int:
        i = text.find(self.calls_begin)
        return self.hold_whitespace(text, len(text) if i == -1 else i)
