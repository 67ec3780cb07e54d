"""Read sampled completion ids back into an OpenAI assistant message, at once or as a stream of deltas.

``OutputParser.parse(ids)`` decodes the ids with control tokens written out and splits them into reasoning, content
and tool calls; each family's subclass (below) knows its markup. Parsing is total: a tool call that does
not parse (bad JSON, a missing name, an unclosed tag) stays in the content as the text the model wrote, and no
sampled text is ever thrown away.

``StreamingParser`` feeds on ids as the engine samples them and yields OpenAI chunk deltas
(``{"reasoning_content": ...}``, ``{"content": ...}``, ``{"tool_calls": [{"index", "id", "type", "function"}]}``).
Each step parses only the *settled* part of the text — what later tokens cannot change (a tool call is held back
until it closes, trailing whitespace until something follows it) — and emits what is new. ``finish()`` parses the
whole completion with the one-shot parser and emits the remainder, so the deltas always add up to exactly the
one-shot message.

The families' parsers (TOKENIZERS.md), registered by name, follow the framework in this module:

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
import logging
import re
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lightning_sdk.errors import TokenizationError
from lightning_sdk.tokens._families import Family
from lightning_sdk.tokens._render import ChatRenderer

__all__ = [
    "PARSERS",
    "DeepSeekV3Parser",
    "HarmonyParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "OutputParser",
    "ParsedReply",
    "StreamingParser",
    "ToolCall",
    "get_parser",
    "new_tool_call_id",
    "register_parser",
]

logger = logging.getLogger(__name__)

Message = dict[str, Any]
_ALNUM = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    """One parsed tool call: ``arguments`` is JSON text; ``id`` is the model's own when it wrote one."""

    name: str
    arguments: str
    id: str | None = None


@dataclass
class ParsedReply:
    """A parsed completion: content, reasoning and tool calls."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_message(self) -> Message:
        """The OpenAI assistant message (``content`` is None when there are tool calls and no text)."""
        msg: Message = {"role": "assistant", "content": self.content if self.content or not self.tool_calls else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        return msg


def new_tool_call_id(family: Family) -> str:
    """A fresh tool-call id in the shape ``family``'s template accepts (``call_<hex>``, or Mistral's 9 characters)."""
    if family.tool_call_id_length is not None:
        return "".join(secrets.choice(_ALNUM) for _ in range(family.tool_call_id_length))
    return "call_" + secrets.token_hex(12)


def trailing_partial(text: str, markers: Sequence[str]) -> int:
    """Where a proper prefix of one of ``markers`` starts at the end of ``text`` (``len(text)`` when none does)."""
    cut = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


class OutputParser(ABC):
    """Turns completion ids into an assistant message. Subclasses implement ``parse_text`` and ``settled``."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # the markup strings (held back while only partly decoded)
    thinks: ClassVar[bool] = False  # replies may open with reasoning

    def __init__(self, renderer: ChatRenderer) -> None:
        self.renderer = renderer
        self.family = renderer.family

    # -- what subclasses implement --------------------------------------------------------------------------------
    @abstractmethod
    def parse_text(self, text: str, *, in_reasoning: bool = False) -> ParsedReply:
        """Parse decoded completion text (stop markers already removed). Never raises."""

    @abstractmethod
    def settled(self, text: str, *, in_reasoning: bool = False) -> int:
        """How much of a partial completion's text later tokens cannot re-interpret."""

    # -- shared ----------------------------------------------------------------------------------------------------
    def strip_stop(self, text: str) -> str:
        """``text`` without the stop token that ended the generation (any of the renderer's stop ids: the family's
        end of turn, the tokenizer's and the generation config's EOS)."""
        for marker in self.family.stops:
            if text.endswith(marker):
                return text[: -len(marker)]
        for stop in getattr(self.renderer, "stop_texts", ()):
            if stop and text.endswith(stop):
                return text[: -len(stop)]
        eos = getattr(self.renderer.tokenizer, "eos_token", None)
        if isinstance(eos, str) and eos and text.endswith(eos):
            return text[: -len(eos)]
        return text

    def starts_in_reasoning(self, prompt_ids: Sequence[int] | None) -> bool:
        """Whether the prompt left a ``<think>`` block open (DeepSeek's generation prompt does)."""
        if not self.thinks or not prompt_ids:
            return False
        tail = self.renderer.decode(list(prompt_ids[-8:]))
        return tail.rfind("<think>") > tail.rfind("</think>")

    def parse(self, completion_ids: Sequence[int], *, prompt_ids: Sequence[int] | None = None) -> ParsedReply:
        """Parse completion ids (``prompt_ids`` tells whether the prompt opened a reasoning block)."""
        text = self.strip_stop(self.renderer.decode(list(completion_ids)))
        try:
            return self.parse_text(text, in_reasoning=self.starts_in_reasoning(prompt_ids))
        except Exception:  # a parser bug must not cost the agent its reply: return the raw text
            logger.exception("%s parser failed; returning the raw text as content", self.name)
            return ParsedReply(content=text)

    def stream(
        self, *, prompt_ids: Sequence[int] | None = None, id_factory: Callable[[], str] | None = None
    ) -> StreamingParser:
        """A streaming parser for one completion."""
        return StreamingParser(self, prompt_ids=prompt_ids, id_factory=id_factory)

    def hold_whitespace(self, text: str, cut: int) -> int:
        """``cut`` moved before trailing whitespace and before a partly decoded marker."""
        cut = trailing_partial(text[:cut], self.markers)
        return len(text[:cut].rstrip())


class StreamingParser:
    """Incremental parsing of one completion (see the module docstring)."""

    def __init__(
        self,
        parser: OutputParser,
        *,
        prompt_ids: Sequence[int] | None = None,
        id_factory: Callable[[], str] | None = None,
    ) -> None:
        self.parser = parser
        self.in_reasoning = parser.starts_in_reasoning(prompt_ids)
        self.id_factory = id_factory or (lambda: new_tool_call_id(parser.family))
        self.ids: list[int] = []
        self._done_text = ""  # decoded text of ids[: self._read]
        self._prefix = 0  # ids[self._prefix : self._read] give the next decode its left context
        self._read = 0
        self._content = ""
        self._reasoning = ""
        self._calls: list[ToolCall] = []
        self.message: Message | None = None  # set by finish()

    def _text(self) -> str:
        """The decoded text so far, decoding only the new ids (with a little left context, as tokenizers that
        drop a leading space when decoding a piece on its own need) and holding back a partial character."""
        decode = self.parser.renderer.decode
        before = decode(self.ids[self._prefix : self._read])
        now = decode(self.ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            self._done_text += now[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            return self._done_text
        return self._done_text + now[len(before) :].rstrip("\ufffd") if now.startswith(before) else self._done_text

    def feed(self, ids: Sequence[int]) -> list[Message]:
        """Add sampled ids; return the OpenAI deltas they settle."""
        if self.message is not None:
            raise TokenizationError("feed() after finish()")
        self.ids.extend(ids)
        text = self.parser.strip_stop(self._text())
        cut = trailing_partial(text, self.parser.family.stops)
        cut = min(cut, self.parser.settled(text[:cut], in_reasoning=self.in_reasoning))
        return self._emit(self.parser.parse_text(text[:cut], in_reasoning=self.in_reasoning))

    def finish(self) -> list[Message]:
        """Parse the whole completion like ``OutputParser.parse`` and return the remaining deltas."""
        text = self.parser.strip_stop(self.parser.renderer.decode(self.ids))
        try:
            final = self.parser.parse_text(text, in_reasoning=self.in_reasoning)
        except Exception:
            logger.exception("%s parser failed; returning the raw text as content", self.parser.name)
            final = ParsedReply(content=text)
        deltas = self._emit(final, final=True)
        for i, call in enumerate(final.tool_calls):
            call.id = self._calls[i].id if i < len(self._calls) else call.id
        self.message = final.to_message()
        return deltas

    def _emit(self, parsed: ParsedReply, *, final: bool = False) -> list[Message]:
        deltas: list[Message] = []
        if parsed.reasoning != self._reasoning:
            if parsed.reasoning.startswith(self._reasoning):
                deltas.append({"reasoning_content": parsed.reasoning[len(self._reasoning) :]})
                self._reasoning = parsed.reasoning
            elif final:
                logger.warning("%s stream: streamed reasoning is not a prefix of the final one", self.parser.name)
        if parsed.content != self._content:
            if parsed.content.startswith(self._content):
                deltas.append({"content": parsed.content[len(self._content) :]})
                self._content = parsed.content
            elif final:
                logger.warning("%s stream: streamed content is not a prefix of the final one", self.parser.name)
        for index in range(len(self._calls), len(parsed.tool_calls)):
            call = parsed.tool_calls[index]
            call_id = call.id or self.id_factory()
            self._calls.append(ToolCall(call.name, call.arguments, call_id))
            fn = {"name": call.name, "arguments": call.arguments}
            deltas.append({"tool_calls": [{"index": index, "id": call_id, "type": "function", "function": fn}]})
        return deltas


PARSERS: dict[str, type[OutputParser]] = {}
"""Output parsers by name (a family's ``parser`` field names one)."""


def register_parser(cls: type[OutputParser]) -> type[OutputParser]:
    """Class decorator: register an ``OutputParser`` under its ``name``."""
    PARSERS[cls.name] = cls
    return cls


def get_parser(renderer: ChatRenderer, name: str | None = None) -> OutputParser:
    """The parser ``name`` (default: the renderer's family's) bound to ``renderer``."""
    key = name or renderer.family.parser
    try:
        cls = PARSERS[key]
    except KeyError:
        raise TokenizationError(f"unknown output parser {key!r}; known: {', '.join(sorted(PARSERS))}") from None
    return cls(renderer)


# -- the families' parsers ---------------------------------------------------------------------------------------------
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
