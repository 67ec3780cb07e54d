"""Merging an attempt's calls into segments: masks, logprobs, every split reason, trees, dedup, truncation."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_sdk.errors import RecordError
from lightning_sdk.records import CallSpan, MergeOptions, Record, Segment, merge_attempt, visualize
from tests.records.calls import Attempt, full

SYS = [100, 101, 102, 103]


def test_append_only_conversation_is_one_segment_with_exact_mask_and_logprobs() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10, 11], [20, 21, 22])
    c1 = a.call([*full(c0), 30, 31], [40, 41])
    c2 = a.call([*full(c1), 50], [60], version=3)
    res = merge_attempt(a.calls)
    assert len(res.segments) == 1
    seg = res.segments[0]
    assert seg.input_ids.tolist() == full(c2)
    assert seg.loss_mask.tolist() == [0] * 6 + [1, 1, 1] + [0, 0] + [1, 1] + [0] + [1]
    expected_lp = [0.0] * 6 + c0.logprobs + [0.0, 0.0] + c1.logprobs + [0.0] + c2.logprobs
    assert seg.logprobs.tolist() == expected_lp
    assert seg.split_reason is None and not seg.truncated
    assert seg.policy_versions == [0, 3]
    assert [(s.call_id, s.start, s.end) for s in seg.spans] == [
        (c0.call_id, 6, 9),
        (c1.call_id, 11, 13),
        (c2.call_id, 14, 15),
    ]
    assert res.stats.trained_calls == 3 and res.stats.calls == 3


def test_calls_are_ordered_by_seq_not_list_order() -> None:
    a = Attempt()
    c0 = a.call([1, 2], [3])
    c1 = a.call([*full(c0), 4], [5])
    res = merge_attempt(list(reversed(a.calls)))
    assert len(res.segments) == 1 and res.segments[0].input_ids.tolist() == full(c1)


def test_compaction_starts_a_new_segment() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10, 11, 12, 13], [20, 21])
    c1 = a.call([*full(c0), 30, 31, 32], [40, 41])
    c2 = a.call([*SYS, 77, 78], [80])  # history replaced by a short summary
    c3 = a.call([*full(c2), 90], [91])
    res = merge_attempt(a.calls)
    assert [s.split_reason for s in res.segments] == [None, "compaction"]
    assert res.segments[0].input_ids.tolist() == full(c1)
    assert res.segments[1].input_ids.tolist() == full(c3)


def test_history_edit_starts_a_new_segment() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10, 11, 12, 13], [20, 21])
    c1 = a.call([*full(c0), 30, 31, 32], [40, 41])
    edited = full(c1)
    edited[5] = 99  # an earlier user message edited, everything after it kept
    c2 = a.call([*edited, 50], [60])
    res = merge_attempt(a.calls)
    assert [s.split_reason for s in res.segments] == [None, "history_edit"]
    assert res.segments[1].input_ids.tolist() == full(c2)
    assert res.segments[1].loss_mask.tolist() == [0] * len(c2.prompt_ids) + [1]


def test_template_rewrite_when_only_earlier_reasoning_is_dropped() -> None:
    think, end_think = 7, 8
    a = Attempt()
    c0 = a.call([*SYS, 10, 11], [think, 1, 2, 3, end_think, 20, 21])
    # The template renders the earlier reply without its reasoning, then appends a new user turn.
    c1 = a.call([*SYS, 10, 11, 20, 21, 30, 31], [40])
    res = merge_attempt(a.calls)
    assert [s.split_reason for s in res.segments] == [None, "template_rewrite"]
    # both completions trained exactly once
    assert sum(s.n_trained for s in res.segments) == len(c0.completion_ids) + len(c1.completion_ids)


def test_parallel_calls_form_a_tree_with_one_segment_per_leaf() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10], [20, 21])
    c1 = a.call([*full(c0), 30], [40])  # two parallel calls on the same history
    c2 = a.call([*full(c0), 31], [41])
    c3 = a.call([*full(c1), 50], [60])
    res = merge_attempt(a.calls)
    assert [s.split_reason for s in res.segments] == [None, "branch"]
    first, second = res.segments
    assert first.input_ids.tolist() == full(c3)
    assert second.input_ids.tolist() == full(c2)
    # c0's completion is trained in the first segment only; in the branch it is context
    assert second.loss_mask.tolist() == [0] * len(c2.prompt_ids) + [1]
    assert [s.call_id for s in first.spans] == [c0.call_id, c1.call_id, c3.call_id]


def test_sub_agent_with_its_own_context_is_a_branch_while_the_main_line_goes_on() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10], [20])
    c1 = a.call([200, 201, 202], [210])  # sub-agent: its own system prompt
    c2 = a.call([*full(c1), 220], [230])
    c3 = a.call([*full(c0), 30], [40])  # main agent continues its own context
    res = merge_attempt(a.calls)
    assert [s.split_reason for s in res.segments] == [None, "branch"]
    assert res.segments[0].input_ids.tolist() == full(c3)
    assert res.segments[1].input_ids.tolist() == full(c2)


def test_concurrent_calls_on_a_shared_history_are_branches() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10, 11, 12], [20, 21], started_at=0.0, ended_at=5.0)
    c1 = a.call([*SYS, 10, 11, 13], [22], started_at=1.0, ended_at=4.0)  # sent while c0 was in flight
    res = merge_attempt([c0, c1])
    assert [s.split_reason for s in res.segments] == [None, "branch"]


def test_retry_with_another_sample_is_a_branch_and_identical_retry_is_deduplicated() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10], [20, 21])
    a.call([*SYS, 10], [20, 21])  # identical retry
    c2 = a.call([*SYS, 10], [22])  # same prompt, another sample
    res = merge_attempt(a.calls)
    assert res.stats.duplicate_calls == 1
    assert [s.split_reason for s in res.segments] == [None, "branch"]
    assert [s.input_ids.tolist() for s in res.segments] == [full(c0), full(c2)]


def test_the_renderers_recorded_reason_wins_for_a_new_tree() -> None:
    """The proxy saw the messages: a changed tool list re-renders the system prompt (tokens alone say edit)."""
    a = Attempt()
    c0 = a.call([*SYS, 10, 11], [20])
    a.call([100, 101, 55, 103, 10, 11, 20, 30], [40], checks={"render": {"split_reason": "tools_changed"}})
    a.call([*full(c0), 31], [41], checks={"render": {"split_reason": "nonsense"}})
    res = merge_attempt(a.calls)
    assert [s.split_reason for s in res.segments] == [None, "tools_changed"]
    b = Attempt()
    b.call([*SYS, 10, 11], [20])
    b.call([100, 101, 55, 103, 10, 11, 20, 30], [40])
    assert [s.split_reason for s in merge_attempt(b.calls).segments] == [None, "history_edit"]


def test_external_and_retokenized_calls_are_not_trained_unless_opted_in() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10], [20])
    a.call([], [], source="external", is_policy=False, logprobs=[])
    c2 = a.call([*full(c0), 30], [40, 41], source="retokenized")
    c3 = a.call([*full(c2), 50], [60])
    res = merge_attempt(a.calls)
    assert res.stats.external_calls == 1 and res.stats.retokenized_excluded == 1
    seg = res.segments[0]
    assert seg.input_ids.tolist() == full(c3)
    assert seg.n_trained == 2  # c0 and c3; the retokenized reply is context
    assert res.stats.completion_tokens_by_source == {"engine": 2, "retokenized": 2}
    opted = merge_attempt(a.calls, MergeOptions(include_retokenized=True))
    assert opted.segments[0].n_trained == 4


def test_text_only_calls_are_counted_as_text_only_never_as_retokenized() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10], [20])
    a.call([], [], source="text_only", logprobs=[])  # the engine sent text only; nothing rebuilt the ids
    res = merge_attempt(a.calls, MergeOptions(include_retokenized=True))
    assert (res.stats.text_only_calls, res.stats.retokenized_calls, res.stats.empty_calls) == (1, 0, 0)
    assert res.stats.trained_calls == 1
    assert [seg.input_ids.tolist() for seg in res.segments] == [full(c0)]


def test_calls_with_wrong_logprob_counts_are_not_trained() -> None:
    a = Attempt()
    a.call([*SYS, 10], [20, 21], logprobs=[-0.5])
    res = merge_attempt(a.calls)
    assert res.segments == [] and res.stats.invalid_calls == 1


def test_truncation_is_flagged_and_counted() -> None:
    a = Attempt()
    c0 = a.call([*SYS, 10], [20, 21, 22])
    a.call([*full(c0), 30], [40, 41, 42])
    res = merge_attempt(a.calls, MergeOptions(max_length=10))
    seg = res.segments[0]
    assert len(seg) == 10 and seg.truncated
    assert seg.loss_mask.tolist() == [0] * 5 + [1, 1, 1, 0, 1]
    assert res.stats.truncated_segments == 1 and res.stats.lost_completion_tokens == 2
    assert seg.spans[-1].end == 10
    assert not merge_attempt(a.calls, MergeOptions(max_length=12)).segments[0].truncated


def test_segment_and_record_check_lengths_with_record_error() -> None:
    ids = np.arange(4, dtype=np.int32)
    with pytest.raises(RecordError, match="lengths differ"):
        Segment("a", "r", 0, ids, np.zeros(3, dtype=np.int8), np.zeros(4))
    with pytest.raises(RecordError, match="outside the segment"):
        Segment("a", "r", 0, ids, np.zeros(4, dtype=np.int8), np.zeros(4), spans=(CallSpan("c", 0, 2, 6, None),))
    with pytest.raises(RecordError, match="unknown split reason"):
        Segment("a", "r", 0, ids, np.zeros(4, dtype=np.int8), np.zeros(4), split_reason="nope")  # type: ignore[arg-type]
    seg = Segment("a", "r", 0, ids, np.zeros(4, dtype=np.int8), np.zeros(4))
    with pytest.raises(RecordError, match="advantages has length 2"):
        Record(seg, "g", 1.0, np.zeros(2))


def test_visualize_brackets_the_trained_tokens() -> None:
    a = Attempt()
    c0 = a.call([1, 2], [3, 4])
    a.call([*full(c0), 5], [6])
    text = visualize(merge_attempt(a.calls).segments[0])
    assert text.splitlines()[1] == "1 2 [3 4] 5 [6]"


def test_visualize_decodes_with_a_real_tokenizer_and_real_template_rewrite_on_qwen3() -> None:
    """Qwen3's official template drops the reasoning of assistant turns before the last user message: the
    second call's context diverges inside the first reply, so the merge records a template rewrite."""
    from tests.support.tokenizers import load_tokenizer

    tok = load_tokenizer("qwen3")
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}]
    p0 = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    reply = "<think>\nadd them\n</think>\n\n4<|im_end|>"
    c0_ids = tok.encode(reply, add_special_tokens=False)
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "and 3+3?"},
    ]
    p1 = tok.apply_chat_template(msgs2, add_generation_prompt=True, tokenize=True, return_dict=False)
    a = Attempt()
    a.call(list(p0), c0_ids)
    a.call(list(p1), tok.encode("<think>\n\n</think>\n\n6<|im_end|>", add_special_tokens=False))
    res = merge_attempt(a.calls)
    assert [s.split_reason for s in res.segments] == [None, "template_rewrite"]
    shown = visualize(res.segments[0], tok)
    assert shown.endswith("[<think>\nadd them\n</think>\n\n4<|im_end|>]")
    assert "<|im_start|>user\n2+2?<|im_end|>" in shown
