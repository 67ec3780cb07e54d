"""Render OpenAI chat messages to token ids with the policy's own tokenizer and chat template.

``ChatRenderer`` wraps a Hugging Face tokenizer (a directory loadable with ``AutoTokenizer``): it shapes messages
for the template's family, renders text with ``apply_chat_template`` and encodes it without adding special tokens
(the template writes BOS and every control token itself). Template errors become ``TokenizationError``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_sdk.errors import TokenizationError
from lightning_sdk.tokens._families import Family, detect_family, get_family
from lightning_sdk.tokens._messages import to_template_messages

__all__ = ["ChatRenderer"]

logger = logging.getLogger(__name__)

Message = dict[str, Any]


class ChatRenderer:
    """A policy tokenizer + chat template.

    ``family`` defaults to the one detected from the template. ``template_kwargs`` are passed to every rendering
    (e.g. ``{"date_string": "26 Jul 2024"}`` for Llama 3.2, ``{"reasoning_effort": "low"}`` for gpt-oss);
    pin anything date-dependent so renderings stay stable across a day boundary.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        family: str | Family | None = None,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template: str = chat_template or getattr(tokenizer, "chat_template", None) or ""
        if not self.chat_template:
            raise TokenizationError("the tokenizer has no chat template; pass chat_template=")
        if isinstance(family, Family):
            self.family = family
        elif family is not None:
            self.family = get_family(family)
        else:
            self.family = detect_family(self.chat_template)
        self.template_kwargs = dict(template_kwargs or {})
        self.stop_token_ids = self._stop_token_ids()
        logger.info("chat renderer: family %s, stop ids %s", self.family.name, sorted(self.stop_token_ids))

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> ChatRenderer:
        """Load the tokenizer in ``path`` (an HF tokenizer directory) with ``AutoTokenizer``."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise TokenizationError(f"cannot load a tokenizer from {path}: {exc}") from exc
        return cls(tokenizer, **kwargs)

    # -- ids <-> text ----------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; control tokens written in the text become their ids, no BOS/EOS added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` with control tokens written out (nothing skipped, no clean-up)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def token_id(self, token: str) -> int | None:
        """The id of a single (special) token, or None when the vocabulary lacks it."""
        tid = self.tokenizer.convert_tokens_to_ids(token)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if not isinstance(tid, int) or (tid == unk and token != getattr(self.tokenizer, "unk_token", None)):
            return None
        return tid

    # -- rendering -------------------------------------------------------------------------------------------------
    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text for ``messages`` (OpenAI shape) and ``tools``."""
        shaped = to_template_messages(messages, self.family)
        try:
            text = self.tokenizer.apply_chat_template(
                shaped,
                tools=list(tools) if tools else None,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.template_kwargs,
            )
        except Exception as exc:  # jinja2 TemplateError, raise_exception() in the template, bad message shapes
            raise TokenizationError(f"{self.family.name} chat template failed: {exc}") from exc
        if not isinstance(text, str):
            raise TokenizationError(f"{self.family.name} chat template returned {type(text).__name__}, not text")
        return text

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``render_text(messages, tools)`` — the official rendering of the whole conversation."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt=add_generation_prompt))

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _stop_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for marker in self.family.stops:
            tid = self.token_id(marker)
            if tid is not None:
                ids.add(tid)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        return frozenset(ids)
