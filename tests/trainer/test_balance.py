"""The split of the cores between learner and engine chosen from measured steps (``trainer/balance.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sdk.trainer.balance import Split, ThreadBalance, default_splits, split_name


def _run(balance: ThreadBalance, measure: dict[Split, tuple[float, float]], steps: int = 6) -> list[Split]:
    """Feed ``steps`` steps: ``measure[split]`` = (learner seconds for 1,000 trained tokens, generated tok/s)."""
    used = []
    for _ in range(steps):
        split = balance.next_split()
        used.append(split)
        learner_s, generated_per_s = measure[split]
        balance.observe(split, learner_s, 1000.0, generated_per_s, 4000.0)
    return used


def test_default_splits_add_the_even_split_where_the_engine_threads_can_be_set() -> None:
    assert default_splits(2) == ((1, 2), (2, 2), (1, 1))
    assert default_splits(8) == ((1, 8), (8, 8), (4, 4))
    assert default_splits(2, engine=False) == ((1, None), (2, None))
    assert default_splits(1) == ((1, 1),)
    assert split_name((1, None)) == "1+-" and split_name((2, 1)) == "2+1"


def test_a_learner_bound_job_gives_the_learner_all_cores() -> None:
    """Generation is fast either way; the learner's step is 1.8x faster on two threads: two win."""
    balance = ThreadBalance(candidates=((1, 2), (2, 2)))
    used = _run(balance, {(1, 2): (9.0, 900.0), (2, 2): (5.0, 800.0)})
    assert used == [(1, 2), (1, 2), (2, 2), (2, 2), (2, 2), (2, 2)]  # step 1 skipped, one trial each, the choice
    assert balance.chosen == (2, 2)
    rates = balance.rates()
    assert rates[(1, 2)] == pytest.approx(1000 / 9.0) and rates[(2, 2)] == pytest.approx(1000 / 5.0)
    summary = balance.as_dict()
    assert summary["learner_threads"] == 2 and summary["engine_threads"] == 2 and summary["chosen"] == "2+2"


def test_a_generation_bound_job_keeps_the_learner_on_one_core() -> None:
    """Two learner threads make its step shorter but starve the engine: the pipeline runs at generation's pace,
    which is faster with the learner on one thread."""
    balance = ThreadBalance(candidates=((1, 2), (2, 2)))
    _run(balance, {(1, 2): (2.0, 400.0), (2, 2): (1.5, 200.0)})
    assert balance.chosen == (1, 2)
    rates = balance.rates()
    assert rates[(1, 2)] == pytest.approx(400 * 0.25) and rates[(2, 2)] == pytest.approx(200 * 0.25)


def test_the_even_split_wins_where_oversubscribing_the_cores_slows_both_sides() -> None:
    """One thread each on two cores: neither side waits for the other's threads; both sides are faster than with
    the engine on both cores, so the engine's threads change too, and the console line says so."""
    balance = ThreadBalance(candidates=default_splits(2))
    used = _run(balance, {(1, 2): (8.0, 300.0), (2, 2): (6.0, 250.0), (1, 1): (5.0, 380.0)}, steps=6)
    assert used[:4] == [(1, 2), (1, 2), (2, 2), (1, 1)] and used[4:] == [(1, 1), (1, 1)]
    assert balance.chosen == (1, 1)
    assert [t["split"] for t in balance.as_dict()["trials"]] == ["1+2", "2+2", "1+1"]
    assert balance.message().startswith("learner threads: 1, engine threads: 1 (")


def _choose_even_split() -> ThreadBalance:
    """A 2-core balance whose trials chose the even split (1, 1) by a few percent, as the calc job's did."""
    balance = ThreadBalance(candidates=default_splits(2))
    _run(balance, {(1, 2): (5.0, 700.0), (2, 2): (6.0, 650.0), (1, 1): (4.9, 720.0)}, steps=4)
    assert balance.chosen == (1, 1)
    return balance


def test_the_engine_gets_the_cores_a_waiting_learner_leaves_idle() -> None:
    """After the choice the learner waits for groups 40-60% of each step: generation is the slower side, so the
    engine moves to both cores (same learner threads), once; printed and recorded with what it was seen on."""
    balance = _choose_even_split()
    assert not balance.observe((1, 1), 3.0, 1000.0, 300.0, 4000.0, wait_s=4.0, wall_s=7.0)
    assert not balance.observe((1, 1), 3.0, 1000.0, 300.0, 4000.0, wait_s=3.0, wall_s=7.5)
    assert balance.next_split() == (1, 1)  # two steps watched: not yet
    assert balance.observe((1, 1), 3.0, 1000.0, 300.0, 4000.0, wait_s=5.0, wall_s=8.0)
    assert balance.chosen == (1, 2) and balance.next_split() == (1, 2)
    share = (4 / 7 + 3 / 7.5 + 5 / 8) / 3
    assert balance.moved == {
        "after_step": 7,
        "from": "1+1",
        "to": "1+2",
        "learner_idle_share": round(share, 3),
        "steps_watched": 3,
    }
    assert balance.as_dict()["moved"] == balance.moved and balance.as_dict()["chosen"] == "1+2"
    assert balance.message() == (
        f"learner threads: 1, engine threads: 2 (was 1+1: the learner waited for groups {100 * share:.0f}% of the "
        "last 3 steps, so generation is the slower side and gets the cores the learner leaves idle)"
    )
    for _ in range(5):  # once per job: the new split stays, whatever the wait
        assert not balance.observe((1, 2), 3.0, 1000.0, 300.0, 4000.0, wait_s=0.0, wall_s=3.0)
    assert balance.chosen == (1, 2)


def test_a_busy_learner_or_an_engine_on_all_cores_keeps_the_choice() -> None:
    """The learner waits 10% of its steps: the choice stays. A chosen split whose engine already has the most
    threads, or a remote engine (threads not set), never moves however long the learner waits."""
    balance = _choose_even_split()
    for _ in range(6):
        assert not balance.observe((1, 1), 5.0, 1000.0, 300.0, 4000.0, wait_s=0.6, wall_s=6.0)
    assert balance.chosen == (1, 1) and balance.moved is None and balance.as_dict()["moved"] is None
    whole = ThreadBalance(candidates=default_splits(2))
    _run(whole, {(1, 2): (4.0, 900.0), (2, 2): (6.0, 650.0), (1, 1): (5.0, 720.0)}, steps=4)
    remote = ThreadBalance(candidates=default_splits(2, engine=False))
    _run(remote, {(1, None): (4.0, 900.0), (2, None): (6.0, 650.0)}, steps=3)
    assert whole.chosen == (1, 2) and remote.chosen == (1, None)
    for b, split in ((whole, (1, 2)), (remote, (1, None))):
        for _ in range(5):
            assert not b.observe(split, 2.0, 1000.0, 300.0, 4000.0, wait_s=6.0, wall_s=8.0)
        assert b.chosen == split and b.moved is None


def test_steps_that_trained_nothing_are_not_trials_and_one_candidate_is_chosen_at_once() -> None:
    balance = ThreadBalance(candidates=((1, None), (2, None)))
    balance.observe((1, None), 3.0, 100.0, 500.0, 400.0)  # skipped: step 1
    assert not balance.observe((1, None), 0.0, 0.0, 500.0, 400.0)  # no update: not a trial
    assert balance.next_split() == (1, None) and balance.chosen is None
    assert ThreadBalance(candidates=((2, None),)).next_split() == (2, None)
    with pytest.raises(ValueError, match="at least one candidate"):
        ThreadBalance(candidates=())


def test_balanced_threads_set_each_split_on_the_learner_and_the_embedded_engine(tmp_path: Path) -> None:
    """A real ``Learner`` and ``EmbeddedEngine`` (the tiny policy): each step runs on the split set before it, the
    measured steps choose one, and the choice stays on both sides; a learner with fixed threads, a learner that is not
    the embedded one, or ``balance_threads = false`` get no balance."""
    import asyncio

    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.policy.model import load_policy
    from lightning_sdk.trainer.balance import BalancedThreads
    from lightning_sdk.trainer.learner import Learner, LearnerConfig
    from tests.trainer.tiny import build_small_policy

    model, tokenizer = load_policy(build_small_policy(tmp_path / "tiny"))
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=2, threads=2)
    try:
        learner = Learner(model, LearnerConfig())
        assert BalancedThreads.for_job(object(), engine, engine_threads_set=False) is None
        assert (
            BalancedThreads.for_job(Learner(model, LearnerConfig(threads=1)), engine, engine_threads_set=False) is None
        )
        assert (
            BalancedThreads.for_job(
                Learner(model, LearnerConfig(balance_threads=False)), engine, engine_threads_set=False
            )
            is None
        )
        fixed_engine = BalancedThreads.for_job(Learner(model, LearnerConfig()), engine, engine_threads_set=True)
        assert fixed_engine is not None and all(s[1] is None for s in fixed_engine.balance.candidates)

        balanced = BalancedThreads.for_job(learner, engine, engine_threads_set=False)
        assert balanced is not None and balanced.engine is engine
        candidates = balanced.balance.candidates
        assert (learner.config.threads, engine.threads) == candidates[0]  # set before the first step
        # measured: the learner at 1,000 trained tokens per learner_s; the split (1, 1) runs fastest
        speed = {s: (0.5 if s == (1, 1) else 2.0) for s in candidates}
        messages, used = [], []
        for _ in range(1 + len(candidates) + 2):  # step 1 skipped, one trial each, then the choice holds
            split = (learner.config.threads, engine.threads)
            used.append(split)
            messages.append(balanced.after_step(speed[split], 1000.0, 1e6, 1000.0))
        assert [m for m in messages if m is not None] == [balanced.balance.message()]
        assert balanced.balance.chosen == (1, 1) and (learner.config.threads, engine.threads) == (1, 1)
        assert set(used[1 : 1 + len(candidates)]) == set(candidates)
        # then the learner waits for groups most of each step: the engine gets both cores from its next pass
        moves = [balanced.after_step(0.5, 1000.0, 1e6, 1000.0, wait_s=3.0, wall_s=4.0) for _ in range(3)]
        assert moves[:2] == [None, None] and moves[2] is not None and moves[2].startswith("learner threads: 1, engine")
        assert (learner.config.threads, engine.threads) == (1, 2) and balanced.balance.moved is not None
    finally:
        asyncio.run(engine.close())
