"""Rendering and the bridge on real tokenizers and chat templates (the families of TOKENIZERS.md).

Every multi-turn tool conversation (single and parallel tool calls) is played call by call: the "model" emits the
template's own rendering of each reply (``conversations.reply_ids``), the next call sends the conversation so far,
and ``render_prompt`` must reuse the earlier prompt + sampled ids verbatim (``exact``) or split exactly where the
official template rewrites history (``template``).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sdk.errors import TokenizationError
from lightning_sdk.tokens import PriorCall, get_parser, render_prompt
from tests.tokens.conversations import (
    FAMILY_NAMES,
    TOOLS,
    Message,
    assistant,
    conversation,
    play,
    renderer_for,
    reply_ids,
    same_message,
    tool_call,
    tool_result,
    tools_for,
)

# harmony has no parallel tool calls: the engine stops at the first <|call|>
CASES = [
    (name, parallel) for name in FAMILY_NAMES for parallel in (False, True) if (name, parallel) != ("gpt-oss", True)
]
# templates that keep the token prefix of an append-only conversation (TOKENIZERS.md)
PREFIX_KEEPING = {"qwen2.5", "llama3.1", "llama3.2"}


@pytest.mark.parametrize(("name", "parallel"), CASES)
@pytest.mark.parametrize("echo_reasoning", [True, False])
def test_exact_reuses_every_sampled_id(name: str, parallel: bool, echo_reasoning: bool) -> None:
    renderer = renderer_for(name)
    parser = get_parser(renderer)
    msgs = conversation(reasoning=renderer.family.reasoning_key is not None, parallel=parallel)
    played = play(renderer, msgs, policy="exact", echo_reasoning=echo_reasoning)
    assert len(played) == 4
    assert played[0].prompt.extended is False and played[0].prompt.split_reason is None
    assert played[0].prompt.prompt_ids == renderer.render(played[0].history, tools_for(renderer))
    for before, call in itertools.pairwise(played):
        base = before.prompt.prompt_ids + before.completion_ids
        assert call.prompt.extended and call.prompt.split_reason is None
        assert call.prompt.parent == played.index(before)
        assert call.prompt.prompt_ids[: len(base)] == base  # prompt and sampled ids verbatim
        assert call.prompt.reused == len(base)
        # the new part is exactly how the official template renders the new messages at the end of the conversation
        new_text = renderer.decode(call.prompt.prompt_ids[len(base) :])
        official = renderer.render_text(call.history, tools_for(renderer))
        assert new_text and official.endswith(new_text)
        if name in PREFIX_KEEPING and not (parallel and name.startswith("llama")):
            assert call.prompt.prompt_ids == renderer.render(call.history, tools_for(renderer))
    for call in played:  # and every sampled reply parses back to the message
        assert same_message(
            parser.parse(call.completion_ids, prompt_ids=call.prompt.prompt_ids).to_message(), call.reply
        )


def _expected_template_splits(name: str, parallel: bool) -> list[str | None]:
    """Where the official templates rewrite the conversation of ``conversation()`` (call 0 has no reason)."""
    if name in PREFIX_KEEPING and not (parallel and name.startswith("llama")):
        return [None, None, None, None]
    return {
        "qwen3": [None, None, "template_rewrite", None],  # the user turn drops the earlier <think> blocks
        "gpt-oss": [None, None, "template_rewrite", None],  # a final answer: analysis dropped, <|return|> -> <|end|>
        "llama3.1": [None, "template_rewrite", None, None],  # parallel calls sampled as one turn, rendered as two
        "llama3.2": [None, "template_rewrite", None, None],
        # Mistral's template shows the system prompt only while the last message is a user turn
        "mistral-nemo": [None, "template_rewrite", "template_rewrite", "template_rewrite"],
        # DeepSeek's generation prompt opens <think>, which its template never renders back
        "deepseek-v3": [None, "template_rewrite", None, "template_rewrite"],
    }[name]


@pytest.mark.parametrize(("name", "parallel"), CASES)
def test_template_policy_splits_only_where_the_template_rewrites(name: str, parallel: bool) -> None:
    renderer = renderer_for(name)
    msgs = conversation(reasoning=renderer.family.reasoning_key is not None, parallel=parallel)
    played = play(renderer, msgs, policy="template")
    for call in played:
        official = renderer.render(call.history, tools_for(renderer))
        assert call.prompt.prompt_ids == official  # always the official rendering
    reasons = [call.prompt.split_reason for call in played]
    assert reasons == _expected_template_splits(name, parallel)
    for i, call in enumerate(played[1:], start=1):
        base = played[i - 1].prompt.prompt_ids + played[i - 1].completion_ids
        assert call.prompt.extended == (call.prompt.prompt_ids[: len(base)] == base)
        assert call.prompt.extended == (reasons[i] is None)


# -- Qwen3: splits exactly where the template drops reasoning, and never under exact --------------------------------


@st.composite
def qwen3_conversations(draw: st.DrawFn) -> list[Message]:
    """User turns, each followed by 0-2 rounds of (1-2 parallel) tool calls and a final answer; any reply may
    come with reasoning or without."""
    msgs: list[Message] = [{"role": "user", "content": "Start."}]
    n = 0
    for turn in range(draw(st.integers(1, 3))):
        if turn:
            msgs.append({"role": "user", "content": f"Question {turn}?"})
        for _ in range(draw(st.integers(0, 2))):
            calls = []
            for _ in range(draw(st.integers(1, 2))):
                n += 1
                calls.append(tool_call("add", {"a": n, "b": 1}, f"call{n:05d}"))
            reasoning = draw(st.sampled_from([None, "Need a tool.", "Plan:\nadd."]))
            msgs.append(assistant(None, reasoning=reasoning, calls=calls))
            msgs.extend(tool_result(c, str(i)) for i, c in enumerate(calls))
        reasoning = draw(st.sampled_from([None, "Done.", "So the answer\nfollows."]))
        msgs.append(assistant(f"Answer {turn}.", reasoning=reasoning))
    return msgs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=qwen3_conversations())
def test_qwen3_splits_exactly_where_reasoning_is_dropped(msgs: list[Message]) -> None:
    renderer = renderer_for("qwen3")
    exact = play(renderer, msgs, policy="exact")
    assert all(call.prompt.extended for call in exact[1:])  # exact: an append-only conversation never splits
    template = play(renderer, msgs, policy="template")
    for before, call in itertools.pairwise(template):
        sampled = renderer.decode(before.prompt.prompt_ids + before.completion_ids)
        official = renderer.render_text(call.history, tools_for(renderer))
        # the template drops reasoning <=> the official rendering has fewer <think> blocks than what was sampled
        dropped = official.count("<think>") < sampled.count("<think>")
        assert call.prompt.split_reason == ("template_rewrite" if dropped else None)
        assert call.prompt.extended == (not dropped)


# -- split reasons ------------------------------------------------------------------------------------------------


def _first_two_calls() -> tuple[list[Message], list[PriorCall]]:
    renderer = renderer_for("qwen2.5")
    msgs = conversation(reasoning=False, parallel=False)
    played = play(renderer, msgs[:6])
    prior = [PriorCall(p.history, tools_for(renderer), p.reply, p.prompt.prompt_ids, p.completion_ids) for p in played]
    return msgs, prior


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ("retry", "branch"),
        ("subagent", "branch"),
        ("tools", "tools_changed"),
        ("edit_user", "history_edit"),
        ("edit_reply", "history_edit"),
        ("compaction", "compaction"),
    ],
)
def test_split_reasons(edit: str, reason: str) -> None:
    renderer = renderer_for("qwen2.5")
    msgs, prior = _first_two_calls()
    after = [*msgs[:6], {"role": "user", "content": "And Rome?"}]
    tools: list[Message] | None = TOOLS
    if edit == "retry":
        after = msgs[:2]  # the first call again (a retry of the second would extend the first)
    elif edit == "subagent":
        after = [{"role": "user", "content": "Summarise this page."}]
    elif edit == "tools":
        tools = TOOLS[:1]
    elif edit == "edit_user":
        after = [msgs[0], {"role": "user", "content": "What's the weather in Rome?"}, *after[2:]]
    elif edit == "edit_reply":
        after = [*msgs[:2], {"role": "assistant", "content": "It is sunny."}, after[-1]]  # not what was sampled
    elif edit == "compaction":
        after = [msgs[0], {"role": "user", "content": "Summary: Paris is sunny. And Rome?"}]
    result = render_prompt(renderer, after, tools, prior)
    assert not result.extended
    assert result.split_reason == reason
    assert result.prompt_ids == renderer.render(after, tools)


def test_no_prior_call_has_no_reason_and_bad_policy_raises() -> None:
    renderer = renderer_for("qwen2.5")
    msgs = [{"role": "user", "content": "hi"}]
    result = render_prompt(renderer, msgs)
    assert result.split_reason is None and not result.extended
    assert result.as_check() == {
        "history": "exact",
        "extended": False,
        "parent": None,
        "reused_ids": 0,
        "split_reason": None,
        "template": "model",
    }
    with pytest.raises(TokenizationError, match="history policy"):
        render_prompt(renderer, msgs, policy="official")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["qwen3", "llama3.1", "mistral-nemo", "gpt-oss"])
def test_cut_off_reply_is_closed_by_the_template_marker(name: str) -> None:
    """A reply cut off by max_tokens has no turn-end marker: the bridge writes the template's one after it."""
    renderer = renderer_for(name)
    user = {"role": "user", "content": "Tell me a story."}
    reply = {"role": "assistant", "content": "Once upon a time"}
    first = render_prompt(renderer, [user])
    sampled = reply_ids(renderer, [user], reply, None)
    stop = [i for i, t in enumerate(sampled) if t in renderer.stop_token_ids]
    cut = sampled[: stop[-1]] if stop else sampled  # without the stop token
    prior = [PriorCall([user], None, reply, first.prompt_ids, cut)]
    follow = [user, reply, {"role": "user", "content": "Go on."}]
    result = render_prompt(renderer, follow, None, prior)
    assert result.extended
    closing = result.prompt_ids[len(first.prompt_ids) + len(cut) :]
    assert closing[0] in renderer.stop_token_ids or renderer.decode(closing).startswith(renderer.family.end_markers)
    assert renderer.render_text(follow).endswith(renderer.decode(closing))


def test_a_part_the_text_policy_cannot_see_is_a_placeholder_in_the_prompt() -> None:
    """An image or audio part of a chat message is rendered as ``[type]`` (as the Responses and Messages surfaces do),
    never dropped without a trace; text and refusal parts give their text; a text part without text gives nothing."""
    renderer = renderer_for("qwen2.5")
    content = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "text", "text": None},
        "?",
    ]
    msgs = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot see images."}]},
        {"role": "user", "content": "ok"},
    ]
    text = renderer.decode(render_prompt(renderer, msgs).prompt_ids)
    assert "What is in [image_url][input_audio]?" in text
    assert "I cannot see images." in text
    assert "[text]" not in text and "[refusal]" not in text
