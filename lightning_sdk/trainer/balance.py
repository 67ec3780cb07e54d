"""The split of the cores between the learner and the embedded engine, chosen from the job's own first RL steps
(``[learner] balance_threads``).

During RL the engine's thread and the learner's step compute at once. How many intra-op threads each should ask
torch for depends on the machine (its cores, their load, how fast the learner is against the engine): with all
cores the learner's step is shorter but the engine, sharing them, generates less meanwhile; one thread each splits
two cores without oversubscribing them. So the first steps measure instead of assuming: step 1 is skipped
(allocations, a first batch of odd size), then each candidate split (learner threads, engine threads) runs
``trials`` steps, alternated, and the rest of the job keeps the split whose steps ran the pipeline fastest. A
candidate's rate is the slower of its two sides, in trained tokens per second: the learner's (trained tokens /
learner seconds) and generation's (generated tokens per second of the step's wall time, times the trained tokens
per generated token of all trial steps), because the asynchronous job runs at the pace of the slower side. Costs
nothing but the trial steps themselves; the choice is printed and goes into ``summary.json`` (``balance``).

The default candidates on ``n`` cores: (1, n) and (n, n) (the learner on one core or all, the engine on all, as
before) and, where the engine's threads can be set (the embedded engine), the even split (n // 2, n - n // 2).

The trial steps see generation while the learner computes (the first steps have a backlog of groups from the
evaluation before RL), so a split that gives the engine fewer threads looks as good there as one that gives it all
cores, and loses the cores the learner leaves idle once generation is the slower side (measured on a 2-core AMD
EPYC: the even split chosen by 1-4% in the trials, then the learner waited for groups 68% of RL at 282 generated
tok/s, against 370 tok/s with the engine on both cores). So after the choice the balance watches the learner's
wait: once it waited at least ``idle_share`` of the last ``watch`` steps' wall time while the engine has fewer
threads than the most any candidate gives it (with the same learner threads), the engine gets those threads, once
per job; printed and recorded (``summary.json`` ``balance.moved``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.trainer.learner import Learner
    from lightning_sdk.trainer.process import ProcessLearner

__all__ = ["BalancedThreads", "Split", "ThreadBalance", "default_splits"]

#: (learner threads, engine threads); engine threads None: the engine's are not changed (a remote engine)
Split = tuple[int, int | None]


def default_splits(cores: int | None = None, *, engine: bool = True) -> tuple[Split, ...]:
    """The candidates on ``cores`` (default: this machine's): see the module docstring."""
    n = max(1, cores or os.cpu_count() or 1)
    whole: int | None = n if engine else None
    splits: list[Split] = [(1, whole), (n, whole)]
    if engine and n > 1:
        splits.append((n // 2, n - n // 2))
    return tuple(dict.fromkeys(splits))


def split_name(split: Split) -> str:
    """``"1+1"``: learner threads + engine threads (``"2+-"`` where the engine's are not set)."""
    return f"{split[0]}+{'-' if split[1] is None else split[1]}"


@dataclass
class _Trial:
    split: Split
    learner_s: float
    trained_tokens: float
    generated_per_s: float
    generated_tokens: float


@dataclass
class ThreadBalance:
    """Picks the (learner, engine) threads among ``candidates`` (default: ``default_splits()``) from measured
    steps."""

    candidates: tuple[Split, ...] = field(default_factory=default_splits)
    trials: int = 1
    skip: int = 1
    chosen: Split | None = None
    watch: int = 3
    idle_share: float = 0.25
    moved: dict[str, Any] | None = None  # the move after the choice (module docstring), once made
    _seen: int = 0
    _trials: list[_Trial] = field(default_factory=list)
    _idle: list[float] = field(default_factory=list)  # wait / wall of each step since the choice

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("ThreadBalance needs at least one candidate split")
        if len(self.candidates) == 1:
            self.chosen = self.candidates[0]

    def next_split(self) -> Split:
        """The (learner, engine) threads of the next step."""
        if self.chosen is not None:
            return self.chosen
        return self.candidates[len(self._trials) % len(self.candidates)]

    def observe(
        self,
        split: Split,
        learner_s: float,
        trained_tokens: float,
        generated_per_s: float,
        generated_tokens: float,
        wait_s: float = 0.0,
        wall_s: float = 0.0,
    ) -> bool:
        """One step's measures (run with ``split``; ``wait_s`` of its ``wall_s`` the learner waited for groups);
        True when this step made the choice or moved it (``message()`` says which)."""
        self._seen += 1
        if self.chosen is not None:
            return self._watch(wait_s, wall_s)
        if self._seen <= self.skip or learner_s <= 0 or trained_tokens <= 0:
            return False
        self._trials.append(_Trial(split, learner_s, trained_tokens, generated_per_s, generated_tokens))
        if len(self._trials) < self.trials * len(self.candidates):
            return False
        rates = self.rates()
        self.chosen = max(rates, key=lambda s: rates[s])
        return True

    def _watch(self, wait_s: float, wall_s: float) -> bool:
        """After the choice: give the engine more threads once the learner waits for it (module docstring)."""
        chosen = self.chosen
        if self.moved is not None or chosen is None or chosen[1] is None or wall_s <= 0:
            return False
        self._idle = [*self._idle, min(1.0, max(0.0, wait_s / wall_s))][-self.watch :]
        more = [c for c in self.candidates if c[0] == chosen[0] and c[1] is not None and c[1] > chosen[1]]
        if not more or len(self._idle) < self.watch:
            return False
        share = sum(self._idle) / len(self._idle)
        if share < self.idle_share:
            return False
        to = max(more, key=lambda c: c[1] or 0)
        self.moved = {
            "after_step": self._seen,
            "from": split_name(chosen),
            "to": split_name(to),
            "learner_idle_share": round(share, 3),
            "steps_watched": len(self._idle),
        }
        self.chosen = to
        return True

    def rates(self) -> dict[Split, float]:
        """Each tried candidate's pipeline rate (trained tokens/s: the slower of the learner's and generation's)."""
        trials = self._trials
        per_generated = sum(t.trained_tokens for t in trials) / max(1.0, sum(t.generated_tokens for t in trials))
        out: dict[Split, float] = {}
        for c in self.candidates:
            mine = [t for t in trials if t.split == c]
            if not mine:
                continue
            learner = sum(t.trained_tokens for t in mine) / sum(t.learner_s for t in mine)
            generation = per_generated * sum(t.generated_per_s for t in mine) / len(mine)
            out[c] = min(learner, generation)
        return out

    def message(self) -> str:
        """The console's line about the choice."""
        chosen = self.chosen or self.next_split()
        rates = ", ".join(f"{split_name(s)} {v:.0f}" for s, v in self.rates().items())
        engine = "unchanged" if chosen[1] is None else str(chosen[1])
        if self.moved is not None:
            m = self.moved
            return (
                f"learner threads: {chosen[0]}, engine threads: {engine} (was {m['from']}: the learner waited for "
                f"groups {100 * m['learner_idle_share']:.0f}% of the last {m['steps_watched']} steps, so generation "
                "is the slower side and gets the cores the learner leaves idle)"
            )
        return (
            f"learner threads: {chosen[0]}, engine threads: {engine} "
            f"(pipeline rate by learner+engine threads, trained tokens/s: {rates})"
        )

    def as_dict(self) -> dict[str, Any]:
        """What ``summary.json`` records: the choice and what it was made from."""
        return {
            "learner_threads": self.chosen[0] if self.chosen else None,
            "engine_threads": self.chosen[1] if self.chosen else None,
            "chosen": split_name(self.chosen) if self.chosen else None,
            "moved": self.moved,
            "candidates": [split_name(c) for c in self.candidates],
            "rates": {split_name(k): round(v, 1) for k, v in self.rates().items()} if self._trials else {},
            "trials": [
                {
                    "split": split_name(t.split),
                    "learner_threads": t.split[0],
                    "engine_threads": t.split[1],
                    "learner_s": round(t.learner_s, 3),
                    "trained_tokens": t.trained_tokens,
                    "generated_per_s": round(t.generated_per_s, 1),
                }
                for t in self._trials
            ],
        }


class BalancedThreads:
    """A ``ThreadBalance`` applied to a job: before each step the learner's threads (its config's ``threads``, which
    its step sets in the thread it runs in) and the embedded engine's (``set_threads``, from its next forward pass)
    are the split to try or the one chosen; ``after_step`` hands it the step's measures."""

    def __init__(
        self, balance: ThreadBalance, learner: Learner | ProcessLearner, engine: EmbeddedEngine | None
    ) -> None:
        self.balance, self.learner, self.engine = balance, learner, engine
        self.apply()

    @classmethod
    def for_job(cls, learner: object, engine: object, *, engine_threads_set: bool) -> BalancedThreads | None:
        """The balance of a job whose learner is the embedded one with ``balance_threads`` on and no fixed
        ``threads`` (None otherwise); the engine's threads are among the candidates where it is the embedded engine
        and ``[engine] threads`` is unset (``engine_threads_set`` False)."""
        from lightning_sdk.engines.embedded import EmbeddedEngine
        from lightning_sdk.trainer.learner import Learner
        from lightning_sdk.trainer.process import ProcessLearner

        if (
            not isinstance(learner, Learner | ProcessLearner)
            or not learner.config.balance_threads
            or learner.config.threads is not None
        ):
            return None
        embedded = engine if isinstance(engine, EmbeddedEngine) else None
        return cls(
            ThreadBalance(default_splits(engine=embedded is not None and not engine_threads_set)), learner, embedded
        )

    def apply(self) -> None:
        """Set the split of the next step."""
        split = self.balance.next_split()
        self.learner.config = self.learner.config.model_copy(update={"threads": split[0]})
        if self.engine is not None and split[1] is not None:
            self.engine.set_threads(split[1])

    def after_step(
        self,
        learner_s: float,
        trained_tokens: float,
        generated_per_s: float,
        generated_tokens: float,
        wait_s: float = 0.0,
        wall_s: float = 0.0,
    ) -> str | None:
        """Observe a step run on the split set before it, set the next; the console's line when this step made
        the choice or moved it."""
        used = (self.learner.config.threads or 0, self.engine.threads if self.engine is not None else None)
        chose = self.balance.observe(
            used, learner_s, trained_tokens, generated_per_s, generated_tokens, wait_s=wait_s, wall_s=wall_s
        )
        self.apply()
        return self.balance.message() if chose else None
