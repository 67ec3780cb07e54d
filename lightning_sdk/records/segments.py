"""Merge the calls of one attempt into segments: prefix merge, loss mask, split reasons, dedup, truncation.

The rule (docs/records.md): call ``b`` *extends* call ``a`` when ``a.prompt_ids + a.completion_ids`` is a prefix of
``b.prompt_ids``. Each trained call gets as parent the call with the longest such sequence, which makes the calls
of an attempt a forest (a prefix trie whose nodes are calls). One segment is emitted per leaf: its tokens are the
leaf's prompt + completion, which contain every ancestor's completion at the position where it was sampled, with
exactly the context the engine was given. Walking the forest depth-first (children in ``seq`` order), each call's
completion is trained (mask 1) in the first segment that reaches it and is context (mask 0) in later ones, so every
completion appears exactly once with mask 1 and the number of segments (the number of leaves) is the fewest
possible. A segment that does not continue the one before it records why (``split_reason``):

- ``branch``: it forks from a line that goes on without it (parallel calls, sub-agents), it samples again from a
  context already seen (a retry), or it was sent while the call it diverges from was still in flight;
- ``template_rewrite``: the context diverges inside an earlier model reply and only sampled tokens were changed
  (a chat template that drops earlier reasoning, for instance);
- ``compaction``: the context is shorter than the one it replaces (history summarised or dropped);
- ``history_edit``: anything else (earlier messages edited, same length or longer).

When the proxy rendered the call itself it saw the messages, and its reason (``Call.checks["render"]
["split_reason"]``, which also knows ``tools_changed``) is used for a call that starts a new tree; the token rules
above decide otherwise.

Everything here is numpy slicing per call, never a Python loop per token.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from lightning_sdk.records.record import (
    SPLIT_REASONS,
    CallSpan,
    FloatArray,
    IntArray,
    MaskArray,
    Segment,
    SplitReason,
)
from lightning_sdk.types import Call

__all__ = ["MergeOptions", "MergeResult", "MergeStats", "merge_attempt"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MergeOptions:
    """How calls become segments.

    ``include_retokenized``: train calls whose ids the proxy re-encoded from text (off: they are context only).
    ``max_length``: cut longer segments to this many tokens and flag them ``truncated`` (None: no limit).
    """

    include_retokenized: bool = False
    max_length: int | None = None


@dataclass(slots=True)
class MergeStats:
    """What happened to an attempt's calls (the fidelity report is built from this)."""

    calls: int = 0
    trained_calls: int = 0
    external_calls: int = 0  # not the policy: traced, never trained
    retokenized_calls: int = 0
    retokenized_excluded: int = 0
    text_only_calls: int = 0  # the engine returned text only and no ids were rebuilt: never trained
    duplicate_calls: int = 0  # retried identical calls (same prompt and completion ids)
    invalid_calls: int = 0  # logprobs missing or of the wrong length: not trained
    empty_calls: int = 0  # no completion ids
    failed_calls: int = 0  # answered with an error (refused, aborted, upstream failure): never trained
    prompt_tokens_by_source: dict[str, int] = field(default_factory=dict)
    completion_tokens_by_source: dict[str, int] = field(default_factory=dict)
    truncated_segments: int = 0
    lost_completion_tokens: int = 0  # sampled tokens cut off by truncation


@dataclass(frozen=True, slots=True)
class MergeResult:
    segments: list[Segment]
    stats: MergeStats


class _Node:
    """One trained call in the prefix forest."""

    __slots__ = ("call", "children", "completion", "logprobs", "n_prompt", "n_total", "parent", "prompt", "seq")

    def __init__(self, call: Call, seq: int, prompt: IntArray, completion: IntArray, logprobs: FloatArray) -> None:
        self.call = call
        self.seq = seq  # position in the attempt's call order (ties in Call.seq broken by start time)
        self.prompt = prompt
        self.completion = completion
        self.logprobs = logprobs
        self.n_prompt = int(prompt.shape[0])
        self.n_total = self.n_prompt + int(completion.shape[0])
        self.parent: _Node | None = None
        self.children: list[_Node] = []

    def sequence(self) -> IntArray:
        return np.concatenate((self.prompt, self.completion))

    def path(self) -> list[_Node]:
        out: list[_Node] = []
        node: _Node | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out


def _lcp(a: IntArray, b: IntArray) -> int:
    """Length of the longest common prefix of two id arrays."""
    k = min(a.shape[0], b.shape[0])
    if k == 0:
        return 0
    diff = np.flatnonzero(a[:k] != b[:k])
    return int(diff[0]) if diff.size else int(k)


def _lcp_with_sequence(prompt: IntArray, node: _Node) -> int:
    """Longest common prefix of ``prompt`` and ``node``'s prompt + completion, without concatenating."""
    first = _lcp(prompt, node.prompt)
    if first < node.n_prompt:
        return first
    return node.n_prompt + _lcp(prompt[node.n_prompt :], node.completion)


def _extends(prompt: IntArray, node: _Node) -> bool:
    """True when ``node``'s prompt + completion is a prefix of ``prompt``."""
    n, m = node.n_prompt, node.n_total
    if m > prompt.shape[0] or m == 0:
        return False
    if prompt[m - 1] != node.completion[-1]:  # cheap rejection before the full comparison
        return False
    return bool(np.array_equal(prompt[:n], node.prompt)) and bool(np.array_equal(prompt[n:m], node.completion))


def _count(d: dict[str, int], key: str, n: int) -> None:
    d[key] = d.get(key, 0) + n


def _collect(calls: Sequence[Call], options: MergeOptions, stats: MergeStats) -> list[_Node]:
    """Filter, validate and de-duplicate the calls that are trained; convert their ids to arrays once."""
    ordered = sorted(calls, key=lambda c: (c.seq, c.started_at))
    nodes: list[_Node] = []
    seen: dict[tuple[int, int, int, int], list[_Node]] = {}
    for pos, call in enumerate(ordered):
        stats.calls += 1
        if not call.is_policy or call.token_source == "external":
            stats.external_calls += 1
            continue
        if call.error is not None:
            stats.failed_calls += 1
            continue
        _count(stats.prompt_tokens_by_source, call.token_source, len(call.prompt_ids))
        _count(stats.completion_tokens_by_source, call.token_source, len(call.completion_ids))
        if call.token_source == "text_only":
            stats.text_only_calls += 1
            continue
        if call.token_source == "retokenized":
            stats.retokenized_calls += 1
            if not options.include_retokenized:
                stats.retokenized_excluded += 1
                continue
        if not call.completion_ids:
            stats.empty_calls += 1
            continue
        if len(call.logprobs) != len(call.completion_ids):
            stats.invalid_calls += 1
            logger.warning(
                "call %s has %d logprobs for %d completion ids: not trained",
                call.call_id,
                len(call.logprobs),
                len(call.completion_ids),
            )
            continue
        prompt = np.asarray(call.prompt_ids, dtype=np.int32)
        completion = np.asarray(call.completion_ids, dtype=np.int32)
        key = (prompt.shape[0], completion.shape[0], int(prompt[-1]) if prompt.shape[0] else -1, int(completion[-1]))
        twins = seen.setdefault(key, [])
        if any(np.array_equal(t.prompt, prompt) and np.array_equal(t.completion, completion) for t in twins):
            stats.duplicate_calls += 1
            continue
        node = _Node(call, pos, prompt, completion, np.asarray(call.logprobs, dtype=np.float64))
        twins.append(node)
        nodes.append(node)
    stats.trained_calls = len(nodes)
    return nodes


def _link(nodes: list[_Node]) -> list[_Node]:
    """Give each node its parent (the call with the longest prompt + completion that prefixes its prompt)."""
    by_length = sorted(nodes, key=lambda n: (-n.n_total, n.seq))
    lengths = [-n.n_total for n in by_length]  # ascending, for bisect
    roots: list[_Node] = []
    for node in nodes:  # seq order, so children lists come out in seq order
        start = bisect.bisect_left(lengths, -node.n_prompt)
        for cand in by_length[start:]:
            if cand is not node and _extends(node.prompt, cand):
                node.parent = cand
                cand.children.append(node)
                break
        else:
            roots.append(node)
    return roots


def _leaf_paths(roots: list[_Node]) -> list[tuple[_Node, list[_Node]]]:
    """Depth-first leaves: (leaf, the nodes of its root path first trained by this leaf's segment)."""
    trained: set[int] = set()
    out: list[tuple[_Node, list[_Node]]] = []
    for root in roots:
        stack = [root]
        path: list[_Node] = []
        while stack:
            node = stack.pop()
            while path and path[-1] is not node.parent:
                path.pop()
            path.append(node)
            if node.children:
                stack.extend(reversed(node.children))
                continue
            k = len(path)
            while k > 0 and id(path[k - 1]) not in trained:
                k -= 1
            new = path[k:]
            trained.update(id(n) for n in new)
            out.append((node, new))
    return out


def _split_reason(first: _Node, earlier: list[_Node]) -> SplitReason:
    """Why the segment whose first trained call is ``first`` does not continue an earlier segment."""
    if first.parent is not None or not earlier:
        return "branch"
    recorded = _recorded_reason(first.call)
    if recorded is not None:
        return recorded
    # The reference: the earlier call whose sequence shares the longest prefix with this prompt (latest on ties).
    best_len, ref = -1, earlier[0]
    for cand in earlier:
        length = _lcp_with_sequence(first.prompt, cand)
        if length >= best_len:
            best_len, ref = length, cand
    continues = any(d.seq > first.seq for d in _descendants(ref))
    in_flight = ref.call.ended_at is not None and first.call.started_at < ref.call.ended_at
    resample = best_len >= first.n_prompt  # its whole context was already seen: another sample from it
    if continues or in_flight or resample:
        return "branch"
    spans = [(a.n_prompt, a.n_total) for a in ref.path()]
    in_reply = any(s <= best_len < e for s, e in spans)
    sampled_after = sum(max(0, e - max(s, best_len)) for s, e in spans)
    if in_reply and first.n_prompt >= ref.n_total - sampled_after:
        return "template_rewrite"
    if first.n_prompt < ref.n_total:
        return "compaction"
    return "history_edit"


def _recorded_reason(call: Call) -> SplitReason | None:
    """The reason the proxy's renderer gave when it could not extend an earlier call (it sees the messages)."""
    render = call.checks.get("render")
    reason = render.get("split_reason") if isinstance(render, dict) else None
    for known in SPLIT_REASONS:
        if reason == known:
            return known
    return None


def _descendants(node: _Node) -> list[_Node]:
    out: list[_Node] = []
    stack = list(node.children)
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children)
    return out


def _build_segment(
    call0: Call,
    index: int,
    leaf: _Node,
    new: list[_Node],
    reason: SplitReason | None,
    options: MergeOptions,
    stats: MergeStats,
) -> Segment:
    input_ids = leaf.sequence()
    n = input_ids.shape[0]
    mask: MaskArray = np.zeros(n, dtype=np.int8)
    logprobs: FloatArray = np.zeros(n, dtype=np.float64)
    spans: list[CallSpan] = []
    for node in new:
        mask[node.n_prompt : node.n_total] = 1
        logprobs[node.n_prompt : node.n_total] = node.logprobs
        spans.append(CallSpan(node.call.call_id, node.call.seq, node.n_prompt, node.n_total, node.call.policy_version))
    truncated = False
    limit = options.max_length
    if limit is not None and n > limit:
        truncated = True
        stats.truncated_segments += 1
        lost = int(np.count_nonzero(mask[limit:]))
        stats.lost_completion_tokens += lost
        logger.info(
            "segment %d of attempt %s cut from %d to %d tokens (%d sampled tokens lost)",
            index,
            call0.attempt_id,
            n,
            limit,
            lost,
        )
        input_ids, mask, logprobs = input_ids[:limit].copy(), mask[:limit].copy(), logprobs[:limit].copy()
        spans = [
            CallSpan(s.call_id, s.seq, s.start, min(s.end, limit), s.policy_version) for s in spans if s.start < limit
        ]
    return Segment(
        attempt_id=call0.attempt_id,
        rollout_id=call0.rollout_id,
        index=index,
        input_ids=input_ids,
        loss_mask=mask,
        logprobs=logprobs,
        spans=tuple(spans),
        split_reason=reason,
        truncated=truncated,
    )


def merge_attempt(calls: Sequence[Call], options: MergeOptions | None = None) -> MergeResult:
    """Merge one attempt's calls into the fewest segments that train every sampled completion exactly once.

    ``calls`` are the attempt's calls in any order (sorted here by ``seq``). Calls that are not the policy's,
    retokenized calls (unless ``options.include_retokenized``), calls without completion or with mismatched
    logprobs are not trained; identical retries are trained once. Returns the segments in the order of their first
    trained call and the counts behind the fidelity report.
    """
    options = options or MergeOptions()
    stats = MergeStats()
    nodes = _collect(calls, options, stats)
    if not nodes:
        return MergeResult([], stats)
    roots = _link(nodes)
    leaves = _leaf_paths(roots)
    leaves.sort(key=lambda t: t[1][0].seq)
    segments: list[Segment] = []
    for index, (leaf, new) in enumerate(leaves):
        first = new[0]
        reason: SplitReason | None = None
        if index > 0:
            reason = _split_reason(first, [n for n in nodes if n.seq < first.seq])
        segments.append(_build_segment(first.call, index, leaf, new, reason, options, stats))
    return MergeResult(segments, stats)
