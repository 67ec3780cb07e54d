"""Read sampled completion ids back into an OpenAI assistant message, at once or as a stream of deltas.

``OutputParser.parse(ids)`` decodes the ids with control tokens written out and splits them into reasoning, content
and tool calls; each family's subclass (``_parsers.py``) knows its markup. Parsing is total: a tool call that does
not parse (bad JSON, a missing name, an unclosed tag) stays in the content as the text the model wrote, and no
sampled text is ever thrown away.

``StreamingParser`` feeds on ids as the engine samples them and yields OpenAI chunk deltas
(``{"reasoning_content": ...}``, ``{"content": ...}``, ``{"tool_calls": [{"index", "id", "type", "function"}]}``).
Each step parses only the *settled* part of the text — what later tokens cannot change (a tool call is held back
until it closes, trailing whitespace until something follows it) — and emits what is new. ``finish()`` parses the
whole completion with the one-shot parser and emits the remainder, so the deltas always add up to exactly the
one-shot message.
"""

from __future__ import annotations

import logging
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
        """``text`` without the stop marker that ended the generation."""
        for marker in self.family.stops:
            if text.endswith(marker):
                return text[: -len(marker)]
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
