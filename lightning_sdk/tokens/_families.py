"""Chat-template families: how a policy's template wants messages shaped and how its turns end.

A family names a chat format (Hermes/ChatML with ``<tool_call>``, Llama-3, harmony, Mistral tekken, DeepSeek-V3).
It tells the renderer how to hand OpenAI messages to the template (tool-call arguments as a JSON string or an
object, the field that carries reasoning, Mistral's 9-character tool-call ids), which strings end a turn (used to
find where one rendered message stops and the next starts), and which output parser reads the model's replies.
The family is detected from the chat template when not given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from lightning_sdk.errors import TokenizationError

__all__ = ["FAMILIES", "Family", "detect_family", "get_family", "register_family"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """One chat format.

    ``arguments``: how tool-call arguments reach the template (``"string"``: the JSON text as sampled, ``"dict"``:
    the parsed object, which templates render with ``tojson``). ``reasoning_key``: the message field the template
    reads reasoning from (``None``: the template has no reasoning). ``tool_call_id_length``: the exact id length the
    template demands (Mistral: 9). ``single_tool_call``: the template renders one tool call per assistant message.
    ``end_markers``: strings that close a rendered turn; ``stop_markers``: those that end a generation when
    they differ (harmony's ``<|end|>`` closes an analysis message, yet the model goes on).
    ``parser``: the name of its output parser.
    ``detect``: substrings that all occur in the chat template of this family (checked in registration order).
    ``tool_template``: the built-in template (``tokens/_templates.py``) that gives this family a tool format when
    a model's own template cannot render tools (ChatML: ``hermes``); None: such a request is refused.
    """

    name: str
    parser: str
    end_markers: tuple[str, ...]
    arguments: Literal["string", "dict"] = "dict"
    reasoning_key: str | None = None
    tool_call_id_length: int | None = None
    single_tool_call: bool = False
    stop_markers: tuple[str, ...] = ()
    detect: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    tool_template: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        """The strings whose tokens end a generation (``stop_markers``, else ``end_markers``)."""
        return self.stop_markers or self.end_markers


FAMILIES: dict[str, Family] = {}
"""The registered families by name (aliases included)."""


def register_family(family: Family) -> Family:
    """Add (or replace) a family; its aliases point to it too."""
    for name in (family.name, *family.aliases):
        FAMILIES[name] = family
    return family


def get_family(name: str) -> Family:
    """The family called ``name``; raises ``TokenizationError`` listing the known names."""
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise TokenizationError(f"unknown chat-template family {name!r}; known: {known}") from None


def detect_family(chat_template: str) -> Family:
    """The first registered family whose ``detect`` substrings all occur in ``chat_template``."""
    seen: set[str] = set()
    for family in FAMILIES.values():
        if family.name in seen:
            continue
        seen.add(family.name)
        if family.detect and all(marker in chat_template for marker in family.detect):
            logger.debug("chat template detected as family %s", family.name)
            return family
    raise TokenizationError(
        "cannot tell the chat-template family from the template; pass family= (one of "
        + ", ".join(sorted({f.name for f in FAMILIES.values()}))
        + ")"
    )


# Order matters for detection: the more specific template first.
register_family(
    Family(
        name="gpt-oss",
        parser="harmony",
        end_markers=("<|end|>", "<|return|>", "<|call|>"),
        arguments="dict",
        reasoning_key="thinking",
        single_tool_call=True,
        stop_markers=("<|return|>", "<|call|>"),
        detect=("<|channel|>", "<|message|>"),
        aliases=("harmony",),
    )
)
register_family(
    Family(
        name="qwen3",
        parser="hermes",
        end_markers=("<|im_end|>",),
        arguments="string",
        reasoning_key="reasoning_content",
        detect=("<|im_start|>", "<tool_call>", "reasoning_content"),
    )
)
register_family(
    Family(
        name="qwen2.5",
        parser="hermes-nothink",
        end_markers=("<|im_end|>",),
        arguments="string",
        detect=("<|im_start|>", "<tool_call>"),
        aliases=("qwen2", "hermes"),
    )
)
register_family(
    Family(
        name="llama3",
        parser="llama3-json",
        end_markers=("<|eot_id|>", "<|eom_id|>"),
        arguments="dict",
        single_tool_call=True,
        detect=("<|start_header_id|>", "<|eot_id|>"),
        aliases=("llama3.1", "llama3.2", "llama3.3"),
    )
)
register_family(
    Family(
        name="mistral",
        parser="mistral",
        end_markers=("</s>",),
        arguments="dict",
        tool_call_id_length=9,
        detect=("[INST]", "[TOOL_CALLS]"),
        aliases=("mistral-nemo",),
    )
)
register_family(
    Family(
        name="deepseek-v3",
        parser="deepseek-v3",
        end_markers=("<｜end▁of▁sentence｜>",),
        arguments="string",
        detect=("<｜tool▁calls▁begin｜>",),
        aliases=("deepseek",),
    )
)
register_family(
    Family(
        # Plain ChatML without tools in the template (e.g. SmolLM2-Instruct): registered last, so Qwen's templates
        # (ChatML plus <tool_call>) are detected as theirs first. Such a template cannot render tools: the policy
        # is then served with the built-in hermes template (ChatML + Qwen2.5's tool layout, family qwen2.5).
        name="chatml",
        parser="hermes-nothink",
        end_markers=("<|im_end|>",),
        arguments="string",
        detect=("<|im_start|>", "<|im_end|>"),
        tool_template="hermes",
    )
)
