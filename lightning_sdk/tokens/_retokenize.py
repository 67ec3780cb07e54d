"""The retokenization fallback: token ids for a reply that the engine returned as text only. Never silent.

When the policy is served by an engine that answers with text (an OpenAI-compatible server without
``return_token_ids``), the proxy renders the prompt with the policy's template (``render_prompt``) and encodes the
reply the way the template writes an assistant turn. Those ids are a reconstruction, not what was sampled, so the
call is marked ``retokenized`` and every check that can be made is recorded:

- ``decode_encode_roundtrip``: encoding the decoded ids gives the same ids (the encoding is canonical);
- ``reply_roundtrip``: parsing the ids gives back the reply the engine sent (content and tool calls);
- ``logprob_count``: ``[log-probs the engine sent, ids]``; the log-probs are kept only when the counts agree.

Records train such calls only when the user opts in; the fidelity report counts them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_sdk.errors import TokenizationError
from lightning_sdk.tokens._messages import message_key
from lightning_sdk.tokens._parsers import OutputParser
from lightning_sdk.tokens._render import ChatRenderer

__all__ = ["Retokenized", "render_reply_text", "retokenize_reply", "retokenize_text"]


@dataclass
class Retokenized:
    """Reconstructed completion ids, the log-probs kept (empty unless their count matched) and the checks."""

    completion_ids: list[int]
    logprobs: list[float]
    checks: dict[str, Any] = field(default_factory=dict)


def render_reply_text(renderer: ChatRenderer, reply: Mapping[str, Any]) -> str:
    """The text the template writes for an assistant ``reply`` after its generation prompt, up to and including
    the turn-end marker (rendered after a one-line user turn, so that history quirks do not leak in)."""
    context = [{"role": "user", "content": "."}]
    prompt = renderer.render_text(context, add_generation_prompt=True)
    whole = renderer.render_text([*context, dict(reply, role="assistant")], add_generation_prompt=False)
    opener = prompt.rstrip("\n")
    if opener.endswith("<think>") and not whole.startswith(prompt):  # DeepSeek opens reasoning in the prompt
        prompt = opener[: -len("<think>")]
    if not whole.startswith(prompt):
        raise TokenizationError(f"{renderer.family.name}: the reply does not follow the generation prompt")
    text = whole[len(prompt) :]
    ends = [text.rfind(m) + len(m) for m in renderer.family.end_markers if m in text]
    if not ends:
        raise TokenizationError(f"{renderer.family.name}: the rendered reply has no turn-end marker")
    return text[: max(ends)]


def _checks(renderer: ChatRenderer, ids: list[int], logprobs: Sequence[float] | None) -> tuple[dict[str, Any], bool]:
    n_lp = None if logprobs is None else len(logprobs)
    keep = n_lp is not None and n_lp == len(ids)
    checks: dict[str, Any] = {
        "retokenized": True,
        "decode_encode_roundtrip": renderer.encode(renderer.decode(ids)) == ids,
        "logprob_count": [n_lp, len(ids)],
        "logprobs_kept": keep,
    }
    return checks, keep


def retokenize_reply(
    renderer: ChatRenderer,
    parser: OutputParser,
    reply: Mapping[str, Any],
    logprobs: Sequence[float] | None = None,
    *,
    prompt_ids: Sequence[int] | None = None,
) -> Retokenized:
    """Encode a chat reply (an OpenAI assistant message) as the policy would have written it, with checks."""
    ids = renderer.encode(render_reply_text(renderer, reply))
    checks, keep = _checks(renderer, ids, logprobs)
    parsed = parser.parse(ids, prompt_ids=prompt_ids).to_message()
    checks["reply_roundtrip"] = message_key(parsed) == message_key({**reply, "role": "assistant"})
    return Retokenized(ids, list(logprobs) if keep and logprobs is not None else [], checks)


def retokenize_text(renderer: ChatRenderer, text: str, logprobs: Sequence[float] | None = None) -> Retokenized:
    """Encode a text completion's reply, with checks."""
    ids = renderer.encode(text)
    checks, keep = _checks(renderer, ids, logprobs)
    checks["text_roundtrip"] = renderer.decode(ids) == text
    return Retokenized(ids, list(logprobs) if keep and logprobs is not None else [], checks)
