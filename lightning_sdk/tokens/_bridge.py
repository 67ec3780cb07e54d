"""The bridge: render a call's prompt so that it extends an earlier call of the same attempt token for token.

An agent's follow-up call usually sends the earlier call's messages, the reply it got, and a few new messages (tool
results, a user turn). Rendering the whole conversation again would re-encode the reply the model sampled — and
templates rewrite history (Qwen3 drops earlier ``<think>`` blocks, harmony turns ``<|return|>`` into ``<|end|>``,
Mistral moves the tool list to the last user turn), so the new prompt would not start with the tokens that were
trained on. Two history policies:

``exact`` (the default for training)
    The prompt is the earlier call's prompt ids + its sampled completion ids, verbatim, + the ids of only the new
    messages. The new messages' text is found by diffing two renderings of the current conversation: up to and
    including the reply (no generation prompt) and all of it (with the generation prompt). When the template
    rewrote something before the reply, the boundary is located by counting turn-end markers after the point where
    the two renderings diverge. Between the sampled reply and the new text go the characters the template writes
    after a turn's end marker (ChatML's ``\\n``), plus the end marker itself when the sample did not end with one
    (cut off by ``max_tokens``). An append-only conversation never splits, Qwen3 included.

``template``
    The prompt is the official rendering of the whole conversation. The call extends the earlier one only when that
    rendering starts with the earlier prompt + completion ids; otherwise it is a new segment (``template_rewrite``).

A call that does not repeat an earlier call's messages + reply is rendered officially and tagged with why:
``branch`` (the same messages as an earlier call or a prefix of them — a retry, a parallel sample — or a different
conversation: a sub-agent), ``tools_changed``, ``compaction`` (the history got shorter), ``history_edit`` (an
earlier message or the reply was changed).

The two diff renderings leave reasoning out of every message: the sampled reasoning is in the reused ids anyway,
and templates that drop reasoning (harmony drops whole analysis messages) would otherwise change the marker count.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_sdk.errors import TokenizationError
from lightning_sdk.tokens._messages import message_key, tools_key
from lightning_sdk.tokens._render import ChatRenderer
from lightning_sdk.types import Call, SplitReason

__all__ = ["HistoryPolicy", "PriorCall", "RenderedPrompt", "SplitReason", "render_prompt"]

logger = logging.getLogger(__name__)

HistoryPolicy = Literal["exact", "template"]

Message = dict[str, Any]


@dataclass(frozen=True)
class PriorCall:
    """What the bridge needs of an earlier call: its messages and tools, the reply the agent got, and the ids."""

    messages: list[Message]
    tools: list[Message] | None
    reply: Message
    prompt_ids: list[int]
    completion_ids: list[int]

    @classmethod
    def from_call(cls, call: Call) -> PriorCall | None:
        """From a recorded ``Call`` (None when it has no ids or no chat reply: a completion, an external call)."""
        messages = call.request.get("messages")
        choices = call.response.get("choices") or []
        if not isinstance(messages, list) or not choices or not call.prompt_ids or not call.completion_ids:
            return None
        reply = choices[0].get("message")
        if not isinstance(reply, dict):
            return None
        tools = call.request.get("tools")
        return cls(list(messages), list(tools) if tools else None, reply, call.prompt_ids, call.completion_ids)


@dataclass
class RenderedPrompt:
    """A rendered prompt and how it relates to the attempt's earlier calls.

    ``extended``: the prompt starts with the ``parent`` call's prompt + completion ids (``reused`` ids, taken
    verbatim). Otherwise ``split_reason`` says why the call starts a new segment (None for an attempt's first call).
    """

    prompt_ids: list[int]
    extended: bool = False
    parent: int | None = None
    reused: int = 0
    split_reason: SplitReason | None = None
    policy: HistoryPolicy = "exact"
    notes: list[str] = field(default_factory=list)
    template: str | None = None  # which template rendered it (``ChatRenderer.template_source``)

    def as_check(self) -> dict[str, Any]:
        """A JSON-able summary for ``Call.checks["render"]``."""
        return {
            "history": self.policy,
            "extended": self.extended,
            "parent": self.parent,
            "reused_ids": self.reused,
            "split_reason": self.split_reason,
            **({"template": self.template} if self.template else {}),
            **({"notes": self.notes} if self.notes else {}),
        }


def render_prompt(
    renderer: ChatRenderer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    prior: Sequence[PriorCall] = (),
    *,
    policy: HistoryPolicy = "exact",
) -> RenderedPrompt:
    """Render ``messages`` for generation, bridging over ``prior`` calls of the same attempt (module docstring).

    ``TemplateFeatureError`` (a ``TokenizationError``) when the template would drop a feature the request uses."""
    rendered = _render_prompt(renderer, messages, tools, prior, policy=policy)
    rendered.template = renderer.template_source
    return rendered


def _render_prompt(
    renderer: ChatRenderer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    prior: Sequence[PriorCall],
    *,
    policy: HistoryPolicy,
) -> RenderedPrompt:
    if policy not in ("exact", "template"):
        raise TokenizationError(f"unknown history policy {policy!r}; use 'exact' or 'template'")
    msgs = [dict(m) for m in messages]
    renderer.check_request(msgs, tools)  # the bridge renders only the new messages: check them all first
    keys = [message_key(m) for m in msgs]
    tkey = tools_key(tools)
    parent = _find_parent(keys, tkey, prior)
    if parent is None:
        ids = renderer.render(msgs, tools)
        reason = _split_reason(keys, tkey, prior) if prior else None
        return RenderedPrompt(ids, split_reason=reason, policy=policy)
    p = prior[parent]
    base = [*p.prompt_ids, *p.completion_ids]
    if policy == "template":
        ids = renderer.render(msgs, tools)
        if ids[: len(base)] == base:
            return RenderedPrompt(ids, extended=True, parent=parent, reused=len(base), policy=policy)
        return RenderedPrompt(ids, split_reason="template_rewrite", parent=parent, policy=policy)
    suffix, notes = _bridge_suffix(renderer, msgs, tools, len(p.messages), p.completion_ids)
    return RenderedPrompt(base + suffix, extended=True, parent=parent, reused=len(base), policy=policy, notes=notes)


# -- finding the call this one extends ----------------------------------------------------------------------------


def _find_parent(keys: list[str], tkey: str, prior: Sequence[PriorCall]) -> int | None:
    """The prior call whose messages + reply this call repeats (the longest; the latest among equals).

    Candidates are tried longest first and the reply is compared before the history, so a long attempt costs
    about one message comparison per earlier call plus one full prefix check."""
    order = sorted(range(len(prior)), key=lambda i: (len(prior[i].messages), i), reverse=True)
    for i in order:
        p = prior[i]
        n = len(p.messages)
        if n + 1 > len(keys) or keys[n] != message_key({**p.reply, "role": "assistant"}):
            continue
        if tools_key(p.tools) == tkey and all(keys[j] == message_key(p.messages[j]) for j in range(n)):
            return i
    return None


def _split_reason(keys: list[str], tkey: str, prior: Sequence[PriorCall]) -> SplitReason:
    """Why a call that extends no earlier call starts a new segment (see the module docstring)."""
    for p in reversed(prior):
        n = len(p.messages)
        if all(keys[j] == message_key(p.messages[j]) for j in range(min(n, len(keys)))):
            if tools_key(p.tools) != tkey:
                return "tools_changed"
            # the same messages again or a prefix of them (a retry, a parallel sample) branch off; anything else
            # after them means the reply was edited or dropped
            return "branch" if len(keys) <= n else "history_edit"
    shares_start = [p for p in prior if p.messages and message_key(p.messages[0]) == keys[0]]
    if not shares_start:
        return "branch"  # another conversation in the same attempt (a sub-agent, a side question)
    if all(tools_key(p.tools) != tkey for p in shares_start):
        return "tools_changed"
    if len(keys) < max(len(p.messages) + 1 for p in shares_start):
        return "compaction"
    return "history_edit"


# -- exact policy: the ids of the new messages --------------------------------------------------------------------


def _without_reasoning(msg: Message) -> Message:
    if msg.get("role") != "assistant":
        return msg
    return {k: v for k, v in msg.items() if k not in ("reasoning_content", "reasoning", "thinking")}


def _marker_spans(text: str, markers: Sequence[str], start: int = 0) -> list[tuple[int, int]]:
    """(start, end) of every marker occurrence in ``text`` whose end lies after ``start``, in order."""
    spans: list[tuple[int, int]] = []
    longest = max(len(m) for m in markers)
    for marker in markers:
        pos = text.find(marker, max(0, start - longest + 1))
        while pos != -1:
            if pos + len(marker) > start:
                spans.append((pos, pos + len(marker)))
            pos = text.find(marker, pos + 1)
    return sorted(spans)


def _bridge_suffix(
    renderer: ChatRenderer,
    msgs: list[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    reply_index: int,
    completion_ids: Sequence[int],
) -> tuple[list[int], list[str]]:
    """Ids that follow the sampled reply: the template's closing of the reply turn, then the new messages."""
    markers = renderer.family.end_markers
    msgs = [_without_reasoning(m) for m in msgs]
    upto = renderer.render_text(msgs[: reply_index + 1], tools, add_generation_prompt=False)
    full = renderer.render_text(msgs, tools, add_generation_prompt=True)
    notes: list[str] = []
    closing_spans = _marker_spans(upto, markers)
    if not closing_spans:
        raise TokenizationError(f"{renderer.family.name}: the rendered reply has no turn-end marker {markers}")
    last_start, last_end = closing_spans[-1]
    marker, sep = upto[last_start:last_end], upto[last_end:]
    if full.startswith(upto):
        new_text = full[len(upto) :]
    else:
        # the template re-renders the history differently (e.g. drops <think>); the reply's turn ends at the
        # same count of turn-end markers after the point where the two renderings diverge
        diverge = _common_prefix_len(upto, full)
        count = len(_marker_spans(upto, markers, diverge))
        spans = _marker_spans(full, markers, diverge)
        if count == 0 or len(spans) < count:
            raise TokenizationError(f"{renderer.family.name}: cannot locate the new messages in the rendering")
        start, boundary = spans[count - 1]
        marker = full[start:boundary]  # how the template closes the reply when more follows (<|end|>)
        if full.startswith(sep, boundary):
            boundary += len(sep)
        else:
            sep = ""
        new_text = full[boundary:]
        notes.append("history kept as sampled; the official template renders it differently")
    last = renderer.decode(list(completion_ids[-1:])) if completion_ids else ""
    closing = sep if any(last.endswith(m) for m in renderer.family.end_markers) else marker + sep
    if len(msgs) > reply_index + 1 and not new_text:
        raise TokenizationError(f"{renderer.family.name}: the new messages rendered to nothing")
    return renderer.encode(closing + new_text), notes


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b`` (binary search over slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
