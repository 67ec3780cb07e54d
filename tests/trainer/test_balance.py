"""The learner's share of the cores chosen from measured steps (``trainer/balance.py``)."""

from __future__ import annotations

import pytest

from lightning_sdk.trainer.balance import ThreadBalance


def _run(balance: ThreadBalance, measure: dict[int, tuple[float, float]], steps: int = 6) -> list[int]:
    """Feed ``steps`` steps: ``measure[threads]`` = (learner seconds for 1,000 trained tokens, generated tok/s)."""
    used = []
    for _ in range(steps):
        threads = balance.next_threads()
        used.append(threads)
        learner_s, generated_per_s = measure[threads]
        balance.observe(threads, learner_s, 1000.0, generated_per_s, 4000.0)
    return used


def test_a_learner_bound_job_gives_the_learner_all_cores() -> None:
    """Generation is fast either way; the learner's step is 1.8x faster on two threads: two win."""
    balance = ThreadBalance(candidates=(1, 2))
    used = _run(balance, {1: (9.0, 900.0), 2: (5.0, 800.0)})
    assert used == [1, 1, 2, 2, 2, 2]  # step 1 skipped, one trial each, then the choice
    assert balance.chosen == 2
    rates = balance.rates()
    assert rates[1] == pytest.approx(1000 / 9.0) and rates[2] == pytest.approx(1000 / 5.0)
    assert balance.as_dict()["learner_threads"] == 2


def test_a_generation_bound_job_keeps_the_learner_on_one_core() -> None:
    """Two learner threads make its step shorter but starve the engine: the pipeline runs at generation's pace,
    which is faster with the learner on one thread."""
    balance = ThreadBalance(candidates=(1, 2))
    _run(balance, {1: (2.0, 400.0), 2: (1.5, 200.0)})
    assert balance.chosen == 1
    rates = balance.rates()
    assert rates[1] == pytest.approx(400 * 0.25) and rates[2] == pytest.approx(200 * 0.25)  # 1,000 / 4,000 tokens


def test_steps_that_trained_nothing_are_not_trials_and_one_candidate_is_chosen_at_once() -> None:
    balance = ThreadBalance(candidates=(1, 2))
    balance.observe(1, 3.0, 100.0, 500.0, 400.0)  # skipped: step 1
    assert not balance.observe(1, 0.0, 0.0, 500.0, 400.0)  # no update: not a trial
    assert balance.next_threads() == 1 and balance.chosen is None
    assert ThreadBalance(candidates=(2,)).next_threads() == 2
