"""Render OpenAI chat messages to token ids with the policy's own tokenizer and chat template.

``ChatRenderer`` wraps a Hugging Face tokenizer (a directory loadable with ``AutoTokenizer``): it shapes messages
for the template's family, renders text with ``apply_chat_template`` and encodes it without adding special tokens
(the template writes BOS and every control token itself). Template errors become ``TokenizationError``.

At construction the template is probed (``tokens/_templates.py``): ``capabilities`` records what it renders, and a
request using a feature it drops (tools, tool calls, tool results, reasoning, a system prompt) is refused with a
``TemplateFeatureError`` rather than rendered without it. ``ChatRenderer.for_policy`` picks the template a policy is
served with (the model's own, ``policy.chat_template``, or its family's default tool format when the model's
template cannot render tools); ``template_source`` says which, and every rendered prompt records it.
Stop ids come from the model itself (the tokenizer's EOS, every ``eos_token_id`` of the generation config, the
family's end-of-turn tokens) and are checked at construction.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_sdk.errors import TemplateFeatureError, TokenizationError
from lightning_sdk.tokens._families import Family, detect_family, get_family
from lightning_sdk.tokens._messages import message_text, to_template_messages
from lightning_sdk.tokens._templates import TemplateCapabilities, builtin_template, probe_capabilities, read_template

__all__ = ["ChatRenderer"]

logger = logging.getLogger(__name__)

Message = dict[str, Any]


class ChatRenderer:
    """A policy tokenizer + chat template.

    ``family`` defaults to the one detected from the template. ``template_kwargs`` are passed to every rendering
    (e.g. ``{"date_string": "26 Jul 2024"}`` for Llama 3.2, ``{"reasoning_effort": "low"}`` for gpt-oss);
    pin anything date-dependent so renderings stay stable across a day boundary.

    ``name``: the policy's name in error messages (default: the tokenizer's ``name_or_path``).
    ``template_source``: where the template came from (``model``, ``builtin:NAME``, ``file:PATH``), recorded with
    every rendered prompt. ``eos_token_ids``: the generation config's EOS ids (default: read from the
    ``generation_config.json`` next to the tokenizer, when there is one).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        family: str | Family | None = None,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        name: str | None = None,
        template_source: str | None = None,
        eos_token_ids: Sequence[int] | None = None,
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
        self.name: str = name or str(getattr(tokenizer, "name_or_path", "") or "policy")
        self.template_source: str = template_source or ("model" if chat_template is None else "given")
        self.generation_eos_ids: tuple[int, ...] = tuple(
            eos_token_ids if eos_token_ids is not None else _generation_eos(tokenizer)
        )
        self.stop_token_ids = self._stop_token_ids()
        self.capabilities: TemplateCapabilities = probe_capabilities(self._render_unchecked, self.family.reasoning_key)
        logger.info(
            "chat renderer: family %s, template %s, stop ids %s, capabilities %s",
            self.family.name,
            self.template_source,
            sorted(self.stop_token_ids),
            self.capabilities.as_dict(),
        )

    @classmethod
    def for_policy(
        cls,
        tokenizer: Any,
        chat_template: str | None = None,
        *,
        name: str | None = None,
        base: Path | None = None,
        **kwargs: Any,
    ) -> ChatRenderer:
        """The renderer a policy is served with: ``chat_template`` (``policy.chat_template``: a built-in name or a
        file, relative to ``base``) when given; else the model's own template, or its family's default tool format
        (``Family.tool_template``) when the model's template cannot render tools. Raises ``TokenizationError``
        when the chosen template still cannot render tools while it was chosen to."""
        own = cls(tokenizer, name=name, **kwargs)
        if chat_template is None:
            if own.capabilities.tools is not False or own.family.tool_template is None:
                return own
            chat_template = own.family.tool_template
            logger.warning(
                "the chat template of %s does not render tools: serving it with the built-in %r tool format "
                "(set policy.chat_template to choose another)",
                own.name,
                chat_template,
            )
        text, source = read_template(chat_template, base)
        if text == "builtin":
            text = builtin_template(source, lambda msgs: own._render_unchecked(msgs, None, False))
            source = f"builtin:{source}"
        kwargs.pop("family", None)
        chosen = cls(tokenizer, chat_template=text, name=own.name, template_source=source, **kwargs)
        if chosen.capabilities.tools is False:
            raise TokenizationError(f"chat_template {chat_template!r} ({source}) does not render tools either")
        return chosen

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
    def check_request(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        """Raise ``TemplateFeatureError`` when the request uses a feature the template drops (``capabilities``)."""
        caps = self.capabilities
        if tools and caps.tools is False:
            self._refuse("tools", "tools", "tool definitions")
        for msg in messages:
            role = msg.get("role")
            if role == "assistant" and msg.get("tool_calls") and caps.tool_calls is False:
                self._refuse("tool_calls", "messages", "assistant tool calls")
            elif role == "tool" and caps.tool_results is False:
                self._refuse("tool_results", "messages", "tool results")
            elif role == "system" and message_text(msg.get("content")) and caps.system is False:
                self._refuse("system", "messages", "a system prompt")
            reasoning = msg.get("reasoning_content", msg.get("reasoning")) if role == "assistant" else None
            if isinstance(reasoning, str) and reasoning and caps.reasoning is False:
                self._refuse("reasoning", "messages", "reasoning")

    def _refuse(self, feature: str, param: str, what: str) -> None:
        raise TemplateFeatureError(
            f"{param}: the chat template of model {self.name!r} (template: {self.template_source}) does not render "
            f"{what}; they would be dropped from the prompt. Set [policy] chat_template to a template file or a "
            f"built-in that renders them (built-in: 'hermes' for ChatML models), or leave them out of the request",
            feature=feature,
            param=param,
        )

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's text for ``messages`` (OpenAI shape) and ``tools``; ``TemplateFeatureError`` when the
        template would drop part of them (``check_request``)."""
        self.check_request(messages, tools)
        return self._render_unchecked(messages, tools, add_generation_prompt)

    def _render_unchecked(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
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
        """The family's end-of-turn tokens, the tokenizer's EOS and the generation config's EOS ids, checked: the
        template's end of turn must be one token of the vocabulary, and the EOS must not be the token that opens a
        turn (a GGUF conversion once gave SmolLM2 ``eos_token = "<|im_start|>"``).

        A ChatML family also stops at the token that opens a turn: a reply that opens a new turn (a small model
        writes ``<|im_start|>system`` where its turn should end) has ended its own, and sampling on would write a
        made-up system or user turn into the reply (Ollama's ChatML models stop there too). The sampled token is
        kept in the call's ids like any stop; the bridge closes the turn with the template's end marker after it."""
        ids: set[int] = set()
        for marker in self.family.stops:
            tid = self.token_id(marker)
            if tid is not None:
                ids.add(tid)
        if not ids:
            raise TokenizationError(
                f"{self.name}: none of the {self.family.name} end-of-turn markers {self.family.stops} is a token of "
                "the vocabulary: generation could not stop at the end of a turn"
            )
        eos = getattr(self.tokenizer, "eos_token_id", None)
        eos_text = getattr(self.tokenizer, "eos_token", None)
        opening = _TURN_OPENINGS.get(self.family.name)
        if opening is not None and eos_text == opening:
            raise TokenizationError(
                f"{self.name}: the tokenizer's eos_token is {eos_text!r}, the token that opens a turn; its config is "
                f"wrong (set eos_token to the end-of-turn token {self.family.stops[0]!r})"
            )
        if opening is not None:
            tid = self.token_id(opening)
            if tid is not None:
                ids.add(tid)
        if isinstance(eos, int):
            ids.add(eos)
        vocab = len(self.tokenizer) if hasattr(self.tokenizer, "__len__") else None
        for tid in self.generation_eos_ids:
            if tid < 0 or (vocab is not None and tid >= vocab):
                raise TokenizationError(f"{self.name}: generation config eos_token_id {tid} is not in the vocabulary")
            ids.add(tid)
        return frozenset(ids)

    @property
    def stop_texts(self) -> tuple[str, ...]:
        """The text of every stop id (what a reply's end may carry when it stopped there)."""
        return tuple(sorted({self.decode([tid]) for tid in self.stop_token_ids}, key=len, reverse=True))


#: The token that opens a turn, by family: never an EOS, but a stop (a reply that opens a turn has ended).
_TURN_OPENINGS = {"chatml": "<|im_start|>", "qwen2.5": "<|im_start|>", "qwen3": "<|im_start|>"}


def _generation_eos(tokenizer: Any) -> list[int]:
    """Every ``eos_token_id`` of the ``generation_config.json`` next to the tokenizer (an int or a list), if any."""
    where = getattr(tokenizer, "name_or_path", None)
    if not where:
        return []
    path = Path(str(where)) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise TokenizationError(f"cannot read {path}: {exc}") from exc
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value]
    return []
