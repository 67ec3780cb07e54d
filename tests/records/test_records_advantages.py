"""Advantage estimators: equal to verl's core_algos on the same tensors, equal to the loop references, and the
record-building rules (failed attempts, fill value, zero-variance groups, per-turn credit, split weights)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos

from lightning_sdk.errors import ConfigError, RecordError
from lightning_sdk.records import (
    AdvantageConfig,
    AdvantageInput,
    RecordsConfig,
    build_records,
    compute_advantages,
    discounted_returns,
    estimator_names,
    get_estimator,
    reference_advantages,
    zero_variance_groups,
)
from lightning_sdk.types import Attempt as AttemptRow
from lightning_sdk.types import (
    AttemptDetail,
    AttemptStatus,
    FinishedGroup,
    Group,
    Reward,
    Rollout,
    RolloutDetail,
    RolloutStatus,
)
from tests.records.calls import Attempt, full

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]


def _batch(seed: int) -> tuple[AdvantageInput, torch.Tensor, torch.Tensor, np.ndarray]:
    """Items in groups of 1..6 (some with equal scores) and verl's (bs, L) tensors for the same items."""
    rng = np.random.default_rng(seed)
    scores: list[float] = []
    groups: list[int] = []
    for g in range(12):
        size = int(rng.integers(1, 7))
        vals = np.full(size, 1.0) if g % 5 == 0 else rng.choice([0.0, 0.5, 1.0, 2.0], size=size)
        scores.extend(vals.tolist())
        groups.extend([g] * size)
    n = len(scores)
    counts = rng.integers(1, 20, size=n)
    width = int(counts.max())
    mask = torch.zeros(n, width, dtype=torch.float64)
    rewards = torch.zeros(n, width, dtype=torch.float64)
    for i, c in enumerate(counts.tolist()):
        mask[i, :c] = 1.0
        rewards[i, c - 1] = scores[i]  # outcome reward on the last response token, as verl's reward manager does
    index = np.array([f"uid-{g}" for g in groups], dtype=object)
    return AdvantageInput.of(scores, groups, counts), rewards, mask, index


def _verl(name: str, rewards: torch.Tensor, mask: torch.Tensor, index: np.ndarray) -> Any:
    if name == "grpo":
        adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=True)
    elif name == "dr_grpo":
        adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    elif name == "rloo":
        adv, _ = core_algos.compute_rloo_outcome_advantage(rewards, mask, index)
    else:
        adv, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    return adv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimators_equal_verl_core_algos(name: str, seed: int) -> None:
    items, rewards, mask, index = _batch(seed)
    ours = compute_advantages(items, AdvantageConfig(estimator=name))
    theirs = _verl(name, rewards.clone(), mask, index)
    expected = ours[:, None] * mask.numpy()
    np.testing.assert_allclose(theirs.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_grpo_without_std_equals_verl_and_dr_grpo() -> None:
    items, rewards, mask, index = _batch(7)
    ours = compute_advantages(items, AdvantageConfig(estimator="grpo", norm_by_std=False))
    theirs = _verl("dr_grpo", rewards, mask, index)
    np.testing.assert_allclose(theirs.numpy(), ours[:, None] * mask.numpy(), atol=1e-9)
    np.testing.assert_allclose(ours, compute_advantages(items, AdvantageConfig(estimator="dr_grpo")))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_vectorised_estimators_equal_loop_references(name: str, norm: bool) -> None:
    for seed in range(5):
        items, *_ = _batch(seed)
        cfg = AdvantageConfig(estimator=name, norm_by_std=norm)
        np.testing.assert_allclose(compute_advantages(items, cfg), reference_advantages(items, cfg), atol=1e-9)


def test_known_values() -> None:
    items = AdvantageInput.of([1.0, 0.0, 0.0, 1.0, 3.0], [0, 0, 0, 0, 1])
    mean, std = 0.5, float(np.std([1, 0, 0, 1], ddof=1))
    grpo = compute_advantages(items, AdvantageConfig())
    np.testing.assert_allclose(grpo[:4], (np.array([1, 0, 0, 1]) - mean) / (std + 1e-6))
    assert grpo[4] == pytest.approx(3.0 / (1 + 1e-6))  # a group of one: baseline 0, std 1 (as verl)
    rloo = compute_advantages(items, AdvantageConfig(estimator="rloo"))
    assert rloo[0] == pytest.approx(1.0 - 1.0 / 3.0) and rloo[1] == pytest.approx(0.0 - 2.0 / 3.0)


def test_unknown_estimator_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        get_estimator("ppo-ish")
    for name in ESTIMATORS:
        assert name in str(err.value)
    assert set(ESTIMATORS) <= set(estimator_names())
    with pytest.raises(RecordError):
        AdvantageInput.of([1.0, 2.0], [0])


def test_zero_variance_groups_and_discounted_returns() -> None:
    items = AdvantageInput.of([1.0, 1.0, 0.0, 1.0, 5.0], [0, 0, 1, 1, 2])
    assert zero_variance_groups(items).tolist() == [True, True, False, False, False]
    np.testing.assert_allclose(discounted_returns(np.array([1.0, 0.0, 2.0]), 0.5), [1.5, 1.0, 2.0])


# ---- building records from rollouts ---------------------------------------------------------------------------


def _rollout(
    gid: str,
    i: int,
    reward: float | None,
    *,
    status: AttemptStatus = AttemptStatus.SUCCEEDED,
    turns: int = 2,
    per_call: list[float] | None = None,
    compact: bool = False,
) -> RolloutDetail:
    rid, aid = f"{gid}-r{i}", f"{gid}-r{i}-a0"
    a = Attempt(aid, rid)
    prompt = [1, 2, 3, 10 + i]
    for t in range(turns):
        c = a.call(prompt, [50 + t, 60 + i])
        prompt = [*full(c), 70 + t]
    if compact:
        c = a.call([1, 2, 99], [98, 97, 96])
    rewards = [] if reward is None else [Reward(rollout_id=rid, attempt_id=aid, value=reward)]
    for c, v in zip(a.calls, per_call or [], strict=False):
        rewards.append(Reward(rollout_id=rid, attempt_id=aid, value=v, name="step", call_id=c.call_id))
    att = AttemptRow(attempt_id=aid, rollout_id=rid, index=0, token=f"tok-{aid}", status=status)
    ro_status = RolloutStatus.SUCCEEDED if status is AttemptStatus.SUCCEEDED else RolloutStatus.FAILED
    ro = Rollout(rollout_id=rid, group_id=gid, task={"q": gid}, status=ro_status)
    return RolloutDetail(rollout=ro, attempts=[AttemptDetail(attempt=att, calls=a.calls, rewards=rewards)])


def _group(gid: str, rollouts: list[RolloutDetail]) -> FinishedGroup:
    return FinishedGroup(Group(group_id=gid, task={"q": gid}, n=len(rollouts)), rollouts)


def test_failed_attempts_are_not_trained_unless_a_fill_value_is_set() -> None:
    g = _group("g", [_rollout("g", 0, 1.0), _rollout("g", 1, 0.0), _rollout("g", 2, None, status=AttemptStatus.FAILED)])
    res = build_records([g])
    assert {r.rollout_id for r in res.records} == {"g-r0", "g-r1"}
    assert [rep.trained for rep in res.reports] == [True, True, False]
    assert res.reports[2].note is not None and "no succeeded attempt" in res.reports[2].note
    adv = {r.rollout_id: r.scalar_advantage() for r in res.records}
    assert adv["g-r0"] == pytest.approx(0.5 / (np.std([1, 0], ddof=1) + 1e-6))
    filled = build_records([g], RecordsConfig(advantage=AdvantageConfig(failed_fill=-1.0)))
    assert {r.rollout_id for r in filled.records} == {"g-r0", "g-r1", "g-r2"}
    assert next(r.reward for r in filled.records if r.rollout_id == "g-r2") == -1.0


def test_zero_variance_groups_are_counted_kept_with_advantage_zero_or_dropped() -> None:
    flat = _group("f", [_rollout("f", 0, 1.0), _rollout("f", 1, 1.0)])
    live = _group("l", [_rollout("l", 0, 1.0), _rollout("l", 1, 0.0)])
    res = build_records([flat, live])
    assert res.zero_variance_groups == 1
    assert [r.scalar_advantage() for r in res.records if r.group_id == "f"] == [0.0, 0.0]
    dropped = build_records([flat, live], RecordsConfig(advantage=AdvantageConfig(drop_zero_variance=True)))
    assert {r.group_id for r in dropped.records} == {"l"} and dropped.dropped_groups == 1


def test_split_rollout_weighs_the_same_as_an_unsplit_one() -> None:
    g = _group("g", [_rollout("g", 0, 1.0, compact=True), _rollout("g", 1, 0.0)])
    res = build_records([g])
    rows0 = [r for r in res.records if r.rollout_id == "g-r0"]
    rows1 = [r for r in res.records if r.rollout_id == "g-r1"]
    assert len(rows0) == 2 and rows0[1].segment.split_reason == "compaction" and len(rows1) == 1
    assert sum(r.weight for r in rows0) == pytest.approx(1.0) and rows1[0].weight == 1.0
    trained = [r.segment.n_trained for r in rows0]
    assert [r.weight for r in rows0] == pytest.approx([t / sum(trained) for t in trained])
    assert rows0[0].scalar_advantage() == rows0[1].scalar_advantage()  # segments share the attempt's advantage


def test_per_turn_credit_gives_each_call_its_discounted_return() -> None:
    g = _group(
        "g",
        [_rollout("g", 0, 1.0, turns=3, per_call=[0.5, 0.0, 0.0]), _rollout("g", 1, 0.0, turns=3, per_call=[0.0])],
    )
    cfg = RecordsConfig(advantage=AdvantageConfig(estimator="dr_grpo", gamma=0.5))
    res = build_records([g], cfg)
    assert all(rep.per_turn for rep in res.reports)
    # the report's reward sums the per-call rewards in; the final reward alone is the outcome ("success")
    assert [(rep.reward, rep.final_reward) for rep in res.reports] == [(1.5, 1.0), (0.0, 0.0)]
    # returns: r0 = [0.5 + 0.5*0 + 0.25*1, 0.5*1, 1] = [0.75, 0.5, 1]; r1 = [0, 0, 0]; group mean 2.25/6
    mean = 2.25 / 6
    rec0 = next(r for r in res.records if r.rollout_id == "g-r0")
    values = [float(rec0.advantages[s.start]) for s in rec0.segment.spans]
    assert values == pytest.approx([0.75 - mean, 0.5 - mean, 1.0 - mean])
    assert isinstance(rec0.scalar_advantage(), list)
    assert np.all(rec0.advantages[rec0.loss_mask == 0] == 0.0)


def _call_advantages(res: Any, rollout_id: str) -> list[float]:
    rec = next(r for r in res.records if r.rollout_id == rollout_id)
    return [float(rec.advantages[s.start]) for s in rec.segment.spans]


def test_turn_baseline_compares_each_call_with_the_same_turn_of_the_other_rollouts() -> None:
    """The calc agent's shape: a tool call rewarded for the right expression, then the answer (the final reward).
    With one baseline over the group's calls every first call (its return includes the answer's reward and its own)
    sits above every answer: in a group where all four rollouts are right in both calls, the group baseline still
    pushes every tool call up and every answer down. The turn baseline compares tool calls with tool calls and
    answers with answers: that group teaches nothing, and in a mixed one each call is judged against its turn."""
    right = [_rollout("a", i, 1.0, turns=2, per_call=[0.5]) for i in range(4)]
    grouped = build_records([_group("a", right)], RecordsConfig(advantage=AdvantageConfig(estimator="dr_grpo")))
    assert _call_advantages(grouped, "a-r0") == pytest.approx([0.25, -0.25])  # returns [1.5, 1.0], mean 1.25
    assert grouped.zero_variance_groups == 0
    cfg = RecordsConfig(advantage=AdvantageConfig(estimator="dr_grpo", turn_baseline="turn"))
    by_turn = build_records([_group("a", right)], cfg)
    assert _call_advantages(by_turn, "a-r0") == [0.0, 0.0] and by_turn.zero_variance_groups == 1

    # mixed: r0 right expression + right answer, r1 right expression + wrong answer, r2 wrong expression + "right"
    # answer (a lucky guess), r3 wrong both. Returns (gamma 1): turn 0 [1.5, 0.5, 1.0, 0.0], turn 1 [1, 0, 1, 0]
    mixed = _group(
        "m",
        [
            _rollout("m", 0, 1.0, per_call=[0.5]),
            _rollout("m", 1, 0.0, per_call=[0.5]),
            _rollout("m", 2, 1.0, per_call=[0.0]),
            _rollout("m", 3, 0.0, per_call=[0.0]),
        ],
    )
    res = build_records([mixed], cfg)
    assert [_call_advantages(res, f"m-r{i}") for i in range(4)] == [
        pytest.approx([0.75, 0.5]),
        pytest.approx([-0.25, -0.5]),
        pytest.approx([0.25, 0.5]),
        pytest.approx([-0.75, -0.5]),
    ]
    # grpo divides each turn by its own std
    std0, std1 = np.std([1.5, 0.5, 1.0, 0.0], ddof=1), np.std([1.0, 0.0, 1.0, 0.0], ddof=1)
    g = build_records([mixed], RecordsConfig(advantage=AdvantageConfig(turn_baseline="turn")))
    assert _call_advantages(g, "m-r0") == pytest.approx([0.75 / (std0 + 1e-6), 0.5 / (std1 + 1e-6)])


def test_turn_baseline_leaves_a_turn_only_one_rollout_reached_untrained() -> None:
    """A third call that only one rollout made has no other third call to compare with: advantage 0 (a grpo
    group of one would hand it its raw return); its first two calls are compared as usual."""
    g = _group(
        "g",
        [_rollout("g", 0, 1.0, turns=3, per_call=[0.5]), _rollout("g", 1, 0.0, turns=2, per_call=[0.0])],
    )
    res = build_records([g], RecordsConfig(advantage=AdvantageConfig(estimator="dr_grpo", turn_baseline="turn")))
    # r0 returns [1.5, 1.0, 1.0], r1 [0.0, 0.0]: turn 0 mean 0.75, turn 1 mean 0.5, turn 2 alone
    assert _call_advantages(res, "g-r0") == pytest.approx([0.75, 0.5, 0.0])
    assert _call_advantages(res, "g-r1") == pytest.approx([-0.75, -0.5])
    assert res.zero_variance_groups == 0
    # outcome rewards only (no per-call reward): one item per attempt, the turn setting changes nothing
    plain = _group("p", [_rollout("p", 0, 1.0), _rollout("p", 1, 0.0)])
    a = build_records([plain], RecordsConfig(advantage=AdvantageConfig(turn_baseline="turn")))
    b = build_records([plain])
    assert [r.scalar_advantage() for r in a.records] == [r.scalar_advantage() for r in b.records]
    with pytest.raises(ConfigError, match="turn_baseline"):
        AdvantageConfig(turn_baseline="call")  # type: ignore[arg-type]


def test_groups_of_one_rollout_are_counted_kept_for_export_or_dropped_for_training() -> None:
    """A group with one trained rollout (a hand-opened session) has no baseline: grpo hands it its raw reward. The
    export keeps it (every succeeded attempt has a row); training leaves it out unless asked
    (``train_single_groups = False``)."""
    single = _group("s", [_rollout("s", 0, 1.0)])
    pair = _group("p", [_rollout("p", 0, 1.0), _rollout("p", 1, 0.0)])
    kept = build_records([single, pair])
    assert kept.single_groups == 1 and {r.group_id for r in kept.records} == {"s", "p"}
    assert kept.summary()["single_groups"] == 1
    dropped = build_records([single, pair], RecordsConfig(advantage=AdvantageConfig(train_single_groups=False)))
    assert {r.group_id for r in dropped.records} == {"p"} and dropped.dropped_groups == 1
    note = next(rep.note for rep in dropped.reports if rep.group_id == "s")
    assert note is not None and "group of one" in note


def _two_roles(gid: str, i: int, reward: float, *, coder: bool = True) -> RolloutDetail:
    """A planner call, then (``coder``) a coder call whose prompt extends the planner's prompt and reply."""
    rid, aid = f"{gid}-r{i}", f"{gid}-r{i}-a0"
    a = Attempt(aid, rid)
    plan = a.call([1, 2, 3, 10 + i], [50, 60 + i])
    a.calls[-1] = plan.model_copy(update={"model": "planner"})
    if coder:
        code = a.call([*full(plan), 70], [80 + i, 81, 82])
        a.calls[-1] = code.model_copy(update={"model": "coder"})
    att = AttemptRow(attempt_id=aid, rollout_id=rid, index=0, token=f"tok-{aid}", status=AttemptStatus.SUCCEEDED)
    ro = Rollout(rollout_id=rid, group_id=gid, task={"q": gid}, status=RolloutStatus.SUCCEEDED)
    rewards = [Reward(rollout_id=rid, attempt_id=aid, value=reward)]
    return RolloutDetail(rollout=ro, attempts=[AttemptDetail(attempt=att, calls=a.calls, rewards=rewards)])


def test_several_policies_get_their_own_records_and_advantages_from_the_same_reward() -> None:
    """Each policy's records come from its own calls only (a coder call that extends the planner's is not merged
    into the planner's segment), and its advantages are the estimator over the rollouts that called it, from the
    rollouts' one reward; a rollout that never called the coder is no part of the coder's group."""
    g = _group("g", [_two_roles("g", 0, 1.0), _two_roles("g", 1, 0.0), _two_roles("g", 2, 0.5, coder=False)])
    one = build_records([g])  # one policy: each rollout's two calls merge into one segment
    assert [len(r.segment.spans) for r in one.records] == [2, 2, 1] and {r.policy for r in one.records} == {None}
    res = build_records([g], RecordsConfig(policies=("planner", "coder")))
    planner = [r for r in res.records if r.policy == "planner"]
    coder = [r for r in res.records if r.policy == "coder"]
    assert len(planner) + len(coder) == len(res.records)
    assert [r.rollout_id for r in planner] == ["g-r0", "g-r1", "g-r2"] and [r.rollout_id for r in coder] == [
        "g-r0",
        "g-r1",
    ]
    calls = {c.call_id: c for ro in g.rollouts for c in ro.attempts[0].calls}
    for r in res.records:
        assert [calls[s.call_id].model for s in r.segment.spans] == [r.policy]
    trained = [int(r.segment.input_ids[np.flatnonzero(r.segment.loss_mask)][0]) for r in coder]
    assert trained == [80, 81]  # the coder's rows train the coder's tokens, the planner's reply is prompt there
    grpo = [float(a) for a in compute_advantages(AdvantageInput.of([1.0, 0.0, 0.5], [0, 0, 0]), AdvantageConfig())]
    assert [r.scalar_advantage() for r in planner] == pytest.approx(grpo)
    pair = [float(a) for a in compute_advantages(AdvantageInput.of([1.0, 0.0], [0, 0]), AdvantageConfig())]
    assert [r.scalar_advantage() for r in coder] == pytest.approx(pair)
    assert {(rep.policy, rep.rollout_id): rep.trained for rep in res.reports}[("coder", "g-r2")] is False
