"""The learner's share of the cores, chosen from the job's own first RL steps (``[learner] balance_threads``).

During RL the engine's thread and the learner's step compute at once. Whether the learner's step should ask torch
for one core or all of them depends on the machine (its cores, their load, how fast the learner is against the
engine): with all cores the learner's step is shorter but the engine, sharing them, generates less meanwhile. So
the first steps measure instead of assuming: step 1 is skipped (allocations, a first batch of odd size), then each
candidate (1 thread, all cores) runs ``trials`` steps, alternated, and the rest of the job keeps the candidate whose
steps ran the pipeline fastest. A candidate's rate is the slower of its two sides, in trained tokens per second: the
learner's (trained tokens / learner seconds) and generation's (generated tokens per second of the step's wall time,
times the trained tokens per generated token of all trial steps), because the asynchronous job runs at the pace
of the slower side. Costs nothing but the trial steps themselves; the choice is printed and goes into
``summary.json`` (``balance``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ThreadBalance"]


@dataclass
class _Trial:
    threads: int
    learner_s: float
    trained_tokens: float
    generated_per_s: float
    generated_tokens: float


@dataclass
class ThreadBalance:
    """Picks the learner's intra-op threads among ``candidates`` (default: 1 and all cores) from measured steps."""

    candidates: tuple[int, ...] = field(default_factory=lambda: tuple(sorted({1, os.cpu_count() or 1})))
    trials: int = 1
    skip: int = 1
    chosen: int | None = None
    _seen: int = 0
    _trials: list[_Trial] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.candidates) == 1:
            self.chosen = self.candidates[0]

    def next_threads(self) -> int:
        """The threads the next step's learner should use."""
        if self.chosen is not None:
            return self.chosen
        return self.candidates[len(self._trials) % len(self.candidates)]

    def observe(
        self, threads: int, learner_s: float, trained_tokens: float, generated_per_s: float, generated_tokens: float
    ) -> bool:
        """One step's measures (with ``threads`` the learner used); True when this step made the choice."""
        self._seen += 1
        if self.chosen is not None or self._seen <= self.skip or learner_s <= 0 or trained_tokens <= 0:
            return False
        self._trials.append(_Trial(threads, learner_s, trained_tokens, generated_per_s, generated_tokens))
        if len(self._trials) < self.trials * len(self.candidates):
            return False
        rates = self.rates()
        self.chosen = max(rates, key=lambda t: rates[t])
        return True

    def rates(self) -> dict[int, float]:
        """Each tried candidate's pipeline rate (trained tokens/s: the slower of the learner's and generation's)."""
        trials = self._trials
        per_generated = sum(t.trained_tokens for t in trials) / max(1.0, sum(t.generated_tokens for t in trials))
        out: dict[int, float] = {}
        for c in self.candidates:
            mine = [t for t in trials if t.threads == c]
            if not mine:
                continue
            learner = sum(t.trained_tokens for t in mine) / sum(t.learner_s for t in mine)
            generation = per_generated * sum(t.generated_per_s for t in mine) / len(mine)
            out[c] = min(learner, generation)
        return out

    def as_dict(self) -> dict[str, Any]:
        """What ``summary.json`` records: the choice and what it was made from."""
        return {
            "learner_threads": self.chosen,
            "candidates": list(self.candidates),
            "rates": {str(k): round(v, 1) for k, v in self.rates().items()} if self._trials else {},
            "trials": [
                {
                    "threads": t.threads,
                    "learner_s": round(t.learner_s, 3),
                    "trained_tokens": t.trained_tokens,
                    "generated_per_s": round(t.generated_per_s, 1),
                }
                for t in self._trials
            ],
        }
