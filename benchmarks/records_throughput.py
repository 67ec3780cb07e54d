"""Records throughput: merge + advantages on a synthetic corpus of multi-turn agent rollouts, on one core.

The corpus (seeded, 10k rollouts by default, groups of 8): tool-using conversations whose turns append to the
context (model reply, then a tool result), with some compactions (the history replaced by a summary), some
sub-agents (a second context that runs while the main one waits), some parallel calls on the same history and some
identical retries. The script times ``build_records`` (merge every attempt, GRPO advantages, records) and prints:

- tokens/s of merge + advantages (counted on the input calls and on the merged rows);
- training tokens with one row per call (prompt + completion of every policy call);
- training tokens after merging (the sum of the records' lengths);
- the prefix-tree minimum (unique tokens of a trie over each attempt's call sequences), and the ratios.

Targets (issue 3): >= 1M tokens/s on one core; merged <= 1.05 x the minimum.

    PYTHONPATH=. python benchmarks/records_throughput.py [--rollouts 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import time

import numpy as np

from lightning_sdk.records import RecordsConfig, build_records
from lightning_sdk.types import (
    Attempt,
    AttemptDetail,
    AttemptStatus,
    Call,
    FinishedGroup,
    Group,
    Reward,
    Rollout,
    RolloutDetail,
    RolloutStatus,
)

VOCAB = 150_000

# ---- the synthetic corpus ------------------------------------------------------------------------------------


class _Builder:
    """The calls of one attempt, built the way an agent's contexts grow."""

    def __init__(self, rng: np.random.Generator, rid: str) -> None:
        self.rng = rng
        self.rid = rid
        self.aid = rid + "-a0"
        self.calls: list[Call] = []

    def toks(self, lo: int, hi: int) -> list[int]:
        return self.rng.integers(0, VOCAB, size=int(self.rng.integers(lo, hi))).tolist()  # type: ignore[no-any-return]

    def call(self, prompt: list[int], completion: list[int] | None = None) -> list[int]:
        completion = completion if completion is not None else self.toks(40, 300)
        seq = len(self.calls)
        self.calls.append(
            Call.model_construct(
                call_id=f"{self.aid}-c{seq}",
                attempt_id=self.aid,
                rollout_id=self.rid,
                seq=seq,
                model="policy",
                is_policy=True,
                token_source="engine",
                request={},
                response={},
                prompt_ids=prompt,
                completion_ids=completion,
                logprobs=(-self.rng.random(len(completion))).tolist(),
                policy_version=0,
                finish_reason="stop",
                usage={},
                checks={},
                started_at=float(seq),
                ended_at=float(seq) + 0.5,
                error=None,
            )
        )
        return prompt + completion


def _rollout(rng: np.random.Generator, rid: str, system: list[int]) -> list[Call]:
    b = _Builder(rng, rid)
    kind = rng.random()
    context = system + b.toks(100, 300)  # the task
    turns = int(rng.integers(3, 11))
    special = int(rng.integers(0, turns))  # the turn of the retry, fork, sub-agent or compaction
    for t in range(turns):
        seq = b.call(context)
        if kind < 0.03 and t == special:  # an identical retry (same prompt, same completion)
            b.call(context, list(b.calls[-1].completion_ids))
        if 0.03 <= kind < 0.08 and t == special:  # two parallel calls on the same history
            b.call(context + b.toks(10, 40))
        if 0.08 <= kind < 0.18 and t == special:  # a sub-agent with its own context; the main line goes on
            sub = b.toks(150, 250)
            for _ in range(int(rng.integers(1, 4))):
                sub = b.call(sub) + b.toks(50, 200)
        context = seq + b.toks(50, 400)  # tool result, next turn header
        if 0.18 <= kind < 0.28 and t == max(special, 2) and t < turns - 1:  # compaction: history -> a summary
            context = system + b.toks(150, 300)
    return b.calls


def corpus(n_rollouts: int, seed: int, group_size: int = 8) -> list[FinishedGroup]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, size=300).tolist()
    groups: list[FinishedGroup] = []
    for g in range(n_rollouts // group_size):
        gid = f"g{g}"
        details = []
        for i in range(group_size):
            rid = f"{gid}-r{i}"
            calls = _rollout(rng, rid, system)
            att = Attempt.model_construct(
                attempt_id=rid + "-a0",
                rollout_id=rid,
                index=0,
                token="t",
                status=AttemptStatus.SUCCEEDED,
                worker_id=None,
                error=None,
                lease_expires_at=None,
                started_at=0.0,
                ended_at=1.0,
            )
            reward = Reward.model_construct(
                rollout_id=rid,
                attempt_id=att.attempt_id,
                value=float(rng.random() < 0.5),
                name="reward",
                call_id=None,
                created_at=0.0,
            )
            ro = Rollout.model_construct(
                rollout_id=rid,
                group_id=gid,
                task={},
                split="train",
                status=RolloutStatus.SUCCEEDED,
                max_attempts=1,
                attempts_used=1,
                created_at=0.0,
                updated_at=0.0,
            )
            details.append(
                RolloutDetail.model_construct(
                    rollout=ro, attempts=[AttemptDetail.model_construct(attempt=att, calls=calls, rewards=[reward])]
                )
            )
        grp = Group.model_construct(
            group_id=gid, task={}, n=group_size, split="train", created_at=0.0, consumed_step=None
        )
        groups.append(FinishedGroup(grp, details))
    return groups


# ---- the prefix-tree minimum ---------------------------------------------------------------------------------


def trie_tokens(sequences: list[np.ndarray]) -> int:
    """Unique tokens of a trie over ``sequences``: sort them (big-endian bytes sort like token lists), then the total
    length minus the common prefix of each neighbour pair."""
    keyed = sorted(sequences, key=lambda s: s.astype(">i4").tobytes())
    total = sum(int(s.shape[0]) for s in keyed)
    shared = 0
    for a, b in itertools.pairwise(keyed):
        k = min(a.shape[0], b.shape[0])
        diff = np.flatnonzero(a[:k] != b[:k])
        shared += int(diff[0]) if diff.size else int(k)
    return total - shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=10_000, help="rollouts in the corpus (groups of 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core

    t0 = time.perf_counter()
    groups = corpus(args.rollouts, args.seed)
    built_s = time.perf_counter() - t0
    calls = [c for g in groups for r in g.rollouts for a in r.attempts for c in a.calls]
    per_call = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)

    gc.collect()
    gc.freeze()  # the corpus is input data: keep the collector from rescanning it while timing
    t0 = time.perf_counter()
    result = build_records(groups, RecordsConfig())
    elapsed = time.perf_counter() - t0

    merged = sum(len(r) for r in result.records)
    minimum = 0
    for g in groups:
        for r in g.rollouts:
            seqs = {}
            for c in r.attempts[0].calls:  # identical retries count once
                s = np.asarray(c.prompt_ids + c.completion_ids, dtype=np.int32)
                seqs[s.tobytes()] = s
            minimum += trie_tokens(list(seqs.values()))
    summary = result.summary()
    print(f"corpus: {len(groups) * 8} rollouts, {len(groups)} groups, {len(calls)} calls (built in {built_s:.1f}s)")
    print(f"split reasons: {summary['split_reasons']}; records: {summary['records']}")
    print(f"merge + advantages: {elapsed:.2f}s on one core")
    print(f"  throughput (input call tokens): {per_call / elapsed / 1e6:.2f}M tokens/s")
    print(f"  throughput (merged row tokens): {merged / elapsed / 1e6:.2f}M tokens/s")
    print(f"training tokens, one row per call:  {per_call:>12,d}  ({per_call / minimum:.3f} x minimum)")
    print(f"training tokens, merged:           {merged:>12,d}  ({merged / minimum:.3f} x minimum)")
    print(f"prefix-tree minimum (unique):      {minimum:>12,d}")
    ok_speed = merged / elapsed >= 1e6
    ok_size = merged <= 1.05 * minimum
    print(
        f"targets: >= 1M tokens/s {'met' if ok_speed else 'MISSED'}; merged <= 1.05 x minimum "
        f"{'met' if ok_size else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
