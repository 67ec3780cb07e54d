"""From finished groups to training records: pick the trained attempts, merge, score, assign advantages.

Pure over plain typed data (``FinishedGroup`` / ``RolloutDetail`` in, ``Record`` and ``RolloutReport`` out); the
store, the exporter and the trainer call ``build_records``.

Rules (docs/records.md):
- only a succeeded attempt is trained; with ``AdvantageConfig.failed_fill`` set, the last failed or timed-out
  attempt of a rollout without success is trained with that reward instead (released attempts never are);
- an attempt's reward is the sum of its rewards; with per-turn credit (rewards that name a call) every trained call
  is its own item with the discounted return from that call on (the final reward counts at the last call);
- a row's ``weight`` is its share of its rollout's trained tokens, so each rollout weighs the same however many
  segments it was split into;
- groups whose items all have the same score are counted (``zero_variance_groups``) and, with
  ``drop_zero_variance``, left out.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_sdk.errors import RecordError
from lightning_sdk.records.advantages import (
    F64,
    AdvantageConfig,
    AdvantageInput,
    compute_advantages,
    discounted_returns,
    get_estimator,
    zero_variance_groups,
)
from lightning_sdk.records.record import Record, Segment
from lightning_sdk.records.segments import MergeOptions, MergeStats, merge_attempt
from lightning_sdk.types import AttemptDetail, AttemptStatus, FinishedGroup, RolloutDetail

__all__ = ["BuildResult", "RecordsConfig", "RolloutReport", "build_records"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecordsConfig:
    """Everything that shapes records: how calls merge and how advantages are computed."""

    merge: MergeOptions = field(default_factory=MergeOptions)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    #: several policies in one run: build each policy's records from its own calls only (a call's ``model`` names
    #: the policy that served it), its advantages over the rollouts that called it, from the same rollout reward;
    #: every record carries its ``policy``. Empty: one policy, every policy call.
    policies: tuple[str, ...] = ()


@dataclass(slots=True)
class RolloutReport:
    """The fidelity report of one rollout: what was traced, what is trained, and where the tokens came from."""

    rollout_id: str
    group_id: str
    status: str
    attempt_id: str | None = None
    policy: str | None = None  # several policies in one run: the policy this report is about
    trained: bool = False
    note: str | None = None  # why the rollout is not trained
    reward: float | None = None  # the final reward plus any per-call rewards
    final_reward: float | None = None  # the attempt's final reward alone (what "success" counts)
    advantage: float | None = None  # the attempt's advantage (mean over its items for per-turn credit)
    per_turn: bool = False
    zero_variance_group: bool = False
    segments: int = 0
    split_reasons: dict[str, int] = field(default_factory=dict)
    tokens: int = 0  # tokens in the attempt's rows
    tokens_trained: int = 0
    stats: MergeStats = field(default_factory=MergeStats)

    def as_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "rollout_id": self.rollout_id,
            "group": self.group_id,
            "policy": self.policy,
            "status": self.status,
            "attempt_id": self.attempt_id,
            "trained": self.trained,
            "note": self.note,
            "reward": self.reward,
            "final_reward": self.final_reward,
            "advantage": self.advantage,
            "per_turn": self.per_turn,
            "zero_variance_group": self.zero_variance_group,
            "calls": s.calls,
            "trained_calls": s.trained_calls,
            "external_calls": s.external_calls,
            "retokenized_calls": s.retokenized_calls,
            "retokenized_excluded": s.retokenized_excluded,
            "text_only_calls": s.text_only_calls,
            "duplicate_calls": s.duplicate_calls,
            "invalid_calls": s.invalid_calls,
            "empty_calls": s.empty_calls,
            "failed_calls": s.failed_calls,
            "segments": self.segments,
            "split_reasons": dict(self.split_reasons),
            "tokens": self.tokens,
            "tokens_trained": self.tokens_trained,
            "truncated_segments": s.truncated_segments,
            "lost_completion_tokens": s.lost_completion_tokens,
            "prompt_tokens_by_source": dict(s.prompt_tokens_by_source),
            "completion_tokens_by_source": dict(s.completion_tokens_by_source),
        }


@dataclass(slots=True, repr=False)
class BuildResult:
    records: list[Record]
    reports: list[RolloutReport]
    groups: int = 0
    zero_variance_groups: int = 0
    dropped_groups: int = 0
    single_groups: int = 0

    def __repr__(self) -> str:
        # Short on purpose: CPython 3.11's asyncio.run reprs the result of its main task (restoring the SIGINT
        # handler), and the records' arrays made that 90% of a 10k-call export's time.
        return f"BuildResult(records={len(self.records)}, reports={len(self.reports)}, groups={self.groups})"

    def summary(self) -> dict[str, Any]:
        trained = [r for r in self.reports if r.trained]
        reasons: dict[str, int] = {}
        by_source: dict[str, int] = {}
        for r in self.reports:
            for k, v in r.split_reasons.items():
                reasons[k] = reasons.get(k, 0) + v
            for k, v in r.stats.completion_tokens_by_source.items():
                by_source[k] = by_source.get(k, 0) + v
        return {
            "groups": self.groups,
            "rollouts": len(self.reports),
            "rollouts_trained": len(trained),
            "records": len(self.records),
            "zero_variance_groups": self.zero_variance_groups,
            "dropped_groups": self.dropped_groups,
            "single_groups": self.single_groups,
            "calls": sum(r.stats.calls for r in self.reports),
            "trained_calls": sum(r.stats.trained_calls for r in trained),
            "failed_calls": sum(r.stats.failed_calls for r in self.reports),
            "retokenized_calls": sum(r.stats.retokenized_calls for r in self.reports),
            "text_only_calls": sum(r.stats.text_only_calls for r in self.reports),
            "tokens": sum(len(rec) for rec in self.records),
            "tokens_trained": sum(rec.segment.n_trained for rec in self.records),
            "split_reasons": reasons,
            "completion_tokens_by_source": by_source,
            "truncated_segments": sum(r.stats.truncated_segments for r in self.reports),
        }


@dataclass(slots=True)
class _Attempt:
    """An attempt chosen for training, merged, with its items (one per attempt, or one per call)."""

    detail: AttemptDetail
    report: RolloutReport
    group_pos: int
    segments: list[Segment]
    final: float
    per_call: dict[str, float]
    item_call_ids: list[str | None] = field(default_factory=list)  # [None]: the whole attempt is one item
    item_scores: list[float] = field(default_factory=list)
    item_tokens: list[int] = field(default_factory=list)
    item_start: int = 0

    @property
    def reward(self) -> float:
        return self.final + sum(self.per_call.values())


def _pick_attempt(detail: RolloutDetail, fill: float | None) -> tuple[AttemptDetail | None, str | None]:
    ok = detail.succeeded_attempt()
    if ok is not None:
        return ok, None
    if fill is not None:
        for att in reversed(detail.attempts):
            if att.attempt.status in (AttemptStatus.FAILED, AttemptStatus.TIMED_OUT):
                return att, None
    return None, f"no succeeded attempt (rollout {detail.rollout.status.value})"


def _items(
    att: AttemptDetail, segments: list[Segment], final: float, per_call: dict[str, float], gamma: float, per_turn: bool
) -> tuple[list[str | None], list[float], list[int]]:
    """The advantage items of a trained attempt: itself, or each trained call with its discounted return."""
    span_tokens: dict[str, int] = {}
    for seg in segments:
        for s in seg.spans:
            span_tokens[s.call_id] = span_tokens.get(s.call_id, 0) + (s.end - s.start)
    if not per_turn:
        return [None], [final + sum(per_call.values())], [sum(span_tokens.values())]
    calls = sorted(att.calls, key=lambda c: (c.seq, c.started_at))
    trained = [c for c in calls if c.call_id in span_tokens]
    trained_pos = [calls.index(c) for c in trained]
    rewards = np.zeros(len(trained), dtype=np.float64)
    position = {c.call_id: i for i, c in enumerate(calls)}
    for call_id, value in per_call.items():
        pos = position.get(call_id, len(calls) - 1)
        k = max(bisect.bisect_right(trained_pos, pos) - 1, 0)  # the trained call at or before the rewarded one
        rewards[k] += value
    rewards[-1] += final
    returns = discounted_returns(rewards, gamma)
    return [c.call_id for c in trained], returns.tolist(), [span_tokens[c.call_id] for c in trained]


def build_records(
    groups: Sequence[FinishedGroup],
    config: RecordsConfig | None = None,
    *,
    advantages: Callable[[AdvantageInput], F64] | None = None,
) -> BuildResult:
    """Records (one per segment of every trained attempt) with advantages, and a fidelity report per rollout.

    ``advantages`` replaces the estimator call over the batch's items (one per trained attempt, or per trained call
    with per-turn credit, in group order): a streamed export builds a page at a time and hands each page the
    advantages an estimator that looks beyond the group computed over the whole export."""
    config = config or RecordsConfig()
    if config.policies:
        return _per_policy(groups, config, advantages)
    return _build(groups, config, advantages)


def _per_policy(
    groups: Sequence[FinishedGroup], config: RecordsConfig, advantages: Callable[[AdvantageInput], F64] | None
) -> BuildResult:
    """Each policy's records from its own calls (``RecordsConfig.policies``), one after the other."""
    out = BuildResult(records=[], reports=[], groups=len(groups))
    for name in config.policies:
        part = _build(groups, config, advantages, policy=name)
        out.records += part.records
        out.reports += part.reports
        out.zero_variance_groups += part.zero_variance_groups
        out.dropped_groups += part.dropped_groups
        out.single_groups += part.single_groups
    return out


def _build(
    groups: Sequence[FinishedGroup],
    config: RecordsConfig,
    advantages: Callable[[AdvantageInput], F64] | None,
    policy: str | None = None,
) -> BuildResult:
    adv_cfg = config.advantage
    get_estimator(adv_cfg.estimator)  # fail early on an unknown name
    reports: list[RolloutReport] = []
    chosen: list[_Attempt] = []
    for gpos, fg in enumerate(groups):
        group_attempts: list[_Attempt] = []
        for detail in fg.rollouts:
            rep = RolloutReport(
                detail.rollout.rollout_id, fg.group.group_id, detail.rollout.status.value, policy=policy
            )
            reports.append(rep)
            att, note = _pick_attempt(detail, adv_cfg.failed_fill)
            if att is None:
                rep.note = note
                continue
            rep.attempt_id = att.attempt.attempt_id
            calls = att.calls if policy is None else [c for c in att.calls if c.model == policy]
            merged = merge_attempt(calls, config.merge)
            rep.stats = merged.stats
            if att.attempt.status is AttemptStatus.SUCCEEDED:
                final = sum(r.value for r in att.rewards if r.call_id is None)
                per_call: dict[str, float] = {}
                for r in att.rewards:
                    if r.call_id is not None:
                        per_call[r.call_id] = per_call.get(r.call_id, 0.0) + r.value
            else:
                final, per_call = float(adv_cfg.failed_fill or 0.0), {}
            rep.final_reward = final
            if not merged.segments:
                rep.note = "no trainable calls"
                rep.reward = final + sum(per_call.values())
                continue
            group_attempts.append(_Attempt(att, rep, gpos, merged.segments, final, per_call))
        per_turn = adv_cfg.per_turn
        if per_turn is None:
            per_turn = any(a.per_call for a in group_attempts)
        for a in group_attempts:
            a.report.per_turn = per_turn
            a.report.reward = a.reward
            a.report.trained = True
            a.item_call_ids, a.item_scores, a.item_tokens = _items(
                a.detail, a.segments, a.final, a.per_call, adv_cfg.gamma, per_turn
            )
        chosen.extend(group_attempts)

    # One estimator call over every item of every group. Items that share a baseline share an index: the group's
    # position, or with per-turn credit and ``turn_baseline = "turn"`` the group's position and the call's turn.
    scores: list[float] = []
    gidx: list[int] = []
    owner: list[int] = []  # the group position of every item
    by_turn: list[bool] = []  # whether the item's baseline is its turn's
    tokens: list[int] = []
    baselines: dict[tuple[int, int], int] = {}
    for a in chosen:
        a.item_start = len(scores)
        scores.extend(a.item_scores)
        turns = adv_cfg.turn_baseline == "turn" and a.item_call_ids != [None]
        for k in range(len(a.item_scores)):
            gidx.append(baselines.setdefault((a.group_pos, k if turns else -1), len(baselines)))
        owner.extend([a.group_pos] * len(a.item_scores))
        by_turn.extend([turns] * len(a.item_scores))
        tokens.extend(a.item_tokens)
    items = AdvantageInput.of(scores, gidx, tokens)
    adv = compute_advantages(items, adv_cfg) if advantages is None else advantages(items)
    if adv.shape != items.scores.shape:
        raise RecordError(f"advantages: {adv.shape[0]} values for {items.scores.shape[0]} items")
    flat = zero_variance_groups(items)
    if any(by_turn):
        # a turn that only one rollout of its group reached has nothing to compare with: advantage 0, teaching nothing
        members = np.bincount(items.group_index, minlength=len(baselines))
        alone = np.asarray(by_turn, dtype=bool) & (members[items.group_index] == 1)
        adv = np.where(alone, 0.0, adv)
        flat = flat | alone
    # a zero-variance group: every item of it flat (or alone at its turn)
    taught = {owner[i] for i in np.flatnonzero(~flat).tolist()}
    flat_groups = {owner[i] for i in np.flatnonzero(flat).tolist()} - taught

    sizes = np.bincount(np.asarray([a.group_pos for a in chosen], dtype=np.int64), minlength=len(groups))
    single_groups = {int(g) for g in np.flatnonzero(sizes == 1).tolist()}

    records: list[Record] = []
    dropped: set[int] = set()
    for a in chosen:
        a.report.zero_variance_group = a.group_pos in flat_groups
        if adv_cfg.drop_zero_variance and a.report.zero_variance_group:
            a.report.trained = False
            a.report.note = "zero-variance group dropped"
            dropped.add(a.group_pos)
            continue
        if not adv_cfg.train_single_groups and a.group_pos in single_groups:
            a.report.trained = False
            a.report.note = "group of one rollout dropped (no baseline)"
            dropped.add(a.group_pos)
            continue
        mine = adv[a.item_start : a.item_start + len(a.item_scores)]
        by_call = {cid: float(v) for cid, v in zip(a.item_call_ids, mine, strict=True) if cid is not None}
        whole = float(mine[0]) if a.item_call_ids == [None] else None
        total_trained = sum(seg.n_trained for seg in a.segments)
        a.report.advantage = whole if whole is not None else float(np.mean(mine))
        a.report.segments = len(a.segments)
        for seg in a.segments:
            values = np.zeros(len(seg), dtype=np.float64)
            for s in seg.spans:
                values[s.start : s.end] = whole if whole is not None else by_call[s.call_id]
            weight = seg.n_trained / total_trained if total_trained else 0.0
            records.append(Record(seg, a.report.group_id, a.reward, values, weight, policy))
            a.report.tokens += len(seg)
            a.report.tokens_trained += seg.n_trained
            if seg.split_reason is not None:
                a.report.split_reasons[seg.split_reason] = a.report.split_reasons.get(seg.split_reason, 0) + 1
    if flat_groups:
        logger.info("%d of %d groups have zero reward variance", len(flat_groups), len(groups))
    return BuildResult(
        records=records,
        reports=reports,
        groups=len(groups),
        zero_variance_groups=len(flat_groups),
        dropped_groups=len(dropped),
        single_groups=len(single_groups),
    )
