"""Graceful stop on SIGINT/SIGTERM for ``lightning-sdk train`` and ``lightning-sdk daemon``.

The first signal only sets a flag that the run polls (``stop()``): the workers release their in-flight attempts,
the learner finishes its step and checkpoints it, and the proxy stops last, so no agent is left calling a closed
server. A second signal exits at once (``128 + signal``) for when a graceful stop takes too long.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from collections.abc import Callable

__all__ = ["GainTarget", "GracefulStop", "WallBudget"]

logger = logging.getLogger(__name__)


class GracefulStop:
    """A stop flag set by SIGINT/SIGTERM; call it (``stop()``) to read it. ``install`` must run on the event loop."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, note: Callable[[str], None] | None = None) -> None:
        self.signal: int | None = None
        self._note = note

    def __call__(self) -> bool:
        return self.signal is not None

    @property
    def exit_code(self) -> int:
        """``128 + signal`` (130 for SIGINT, 143 for SIGTERM), the shell's convention; 1 without a signal."""
        return 128 + self.signal if self.signal is not None else 1

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = loop or asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, int(sig))

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.signal is not None:
            logger.warning("%s again: exiting now", name)
            os._exit(128 + sig)
        self.signal = sig
        message = f"{name}: stopping after the current step (send it again to exit at once)"
        logger.info(message)
        if self._note is not None:
            self._note(message)


class GainTarget:
    """When RL should stop to check, on the held-out tasks, whether it reached its target gain.

    The trainer feeds it the sampled success of each step's *fresh* groups (tasks never trained on, so the replays
    of ``TaskSampler`` do not bias it). Once the success over the last ``window`` fresh rollouts reaches
    ``baseline + gain + margin`` (``baseline``: held-out success before RL), ``due()`` turns true: RL pauses and the
    held-out evaluation runs. ``reached(success)`` says whether that evaluation met the target; if not, RL goes on
    and the next check comes when the rolling success reaches a higher trigger (``margin`` grows by ``bump``; at
    least ``min_steps`` steps after the last check) or, sooner, at the step where the held-out progress measured so
    far says the target is met (at least ``recheck_min_steps`` after the last check), whichever comes first. The
    progress is the held-out points per step since RL began, since the first check and between the last two
    checks: the slowest of those that gained, because the climb slows near the target and a plateau should space
    the checks out (none gained: only the trigger). With ``max_steps`` a check also comes at the latest that many
    steps after the last one (the first: after RL began), whatever the sampled success says: the fresh tasks' success
    can sit below the trigger long after the held-out success passed the target (a calc run of the twenty-first
    round: its rolling success stayed at 0.33-0.46 from step 11 to 28 under a 0.47 trigger; the check it fired at
    step 29 found +35 points). (The sampled success is noisy and runs below greedy held-out
    success, so after a first check the measured held-out rate is the better guide: on the calc example the second
    check came 12-18 steps after the first with the trigger alone, overshooting the target by up to 12 points; with
    every re-check held to ``min_steps`` = 5, a check half a point short at step 22 was followed by one at step 27
    that found 12 points more than the target.)
    """

    def __init__(
        self,
        baseline: float,
        gain: float,
        *,
        margin: float = 0.0,
        window: int = 256,
        min_steps: int = 5,
        recheck_min_steps: int | None = None,
        bump: float = 0.05,
        max_steps: int | None = None,
    ) -> None:
        self.baseline = baseline
        self.gain = gain
        self.margin = margin
        self.window = window
        self.min_steps = min_steps
        self.recheck_min_steps = min_steps if recheck_min_steps is None else max(1, min(recheck_min_steps, min_steps))
        self.bump = bump
        self.max_steps = None if max_steps is None else max(1, max_steps)
        self._checked: list[tuple[int, float]] = []  # (step, held-out success) of each check that missed
        self.checks = 0
        self._outcomes: list[float] = []
        self._steps = 0
        self._since_check = 0
        self._due = False
        self._projected: int | None = None  # the step at which held-out progress so far projects the target
        self.why: str | None = None  # what made the due check due: "trigger", "projection" or "max_steps"

    @property
    def trigger(self) -> float:
        """The rolling fresh-task success that triggers the next held-out check."""
        return self.baseline + self.gain + self.margin

    @property
    def rolling(self) -> float | None:
        """The sampled success over the last ``window`` fresh rollouts (None before any)."""
        return sum(self._outcomes) / len(self._outcomes) if self._outcomes else None

    def observe_step(self, fresh_outcomes: list[float]) -> None:
        """One RL step's fresh-task rollout outcomes (1.0 success, 0.0 failure)."""
        self._steps += 1
        self._since_check += 1
        self._outcomes = (self._outcomes + list(fresh_outcomes))[-self.window :]
        rolling = self.rolling
        enough = len(self._outcomes) >= min(self.window, 64)
        triggered = self._since_check >= self.min_steps and rolling is not None and rolling >= self.trigger
        projected = (
            self._projected is not None
            and self._steps >= self._projected
            and self._since_check >= self.recheck_min_steps
        )
        overdue = self.max_steps is not None and self._since_check >= self.max_steps
        self._due = enough and (triggered or projected or overdue)
        self.why = None
        if self._due:
            self.why = "trigger" if triggered else "projection" if projected else "max_steps"

    def due(self) -> bool:
        return self._due

    def reached(self, success: float) -> bool:
        """The held-out success of the check that ``due()`` asked for: True when the target gain is met."""
        self.checks += 1
        self._due = False
        self._since_check = 0
        if success - self.baseline >= self.gain:
            return True
        self.margin += self.bump
        rates = [(success - self.baseline) / max(1, self._steps)]
        for step, earlier in self._checked[:1] + self._checked[-1:]:  # the first and the last check before this
            if self._steps > step:
                rates.append((success - earlier) / (self._steps - step))
        self._checked.append((self._steps, success))
        positive = [r for r in rates if r > 0]
        self._projected = None
        if positive:
            steps = (self.baseline + self.gain - success) / min(positive)
            self._projected = self._steps + math.ceil(round(steps, 6))  # 4.000000001 steps is 4
        return False


class WallBudget:
    """The wall-clock budget of a run (``[rl] max_wall_s``) and what RL must leave of it for its final held-out
    evaluation, so that evaluation (a target check) always runs before the budget ends.

    ``end`` is when the whole run should be done (``clock()`` time). RL is over (``rl_over()``) once the time left
    no longer covers one more step's own work (the slowest of the last three steps, waits for groups excluded: the
    learner's update cannot be cut short) plus the final evaluation (``check_reserve_s``: the slowest evaluation so
    far, ``slack`` times, plus ``pad_s``; the evaluation before RL is the first measure). A check that runs while RL
    is over is the run's last: its result is the final evaluation, and whether it met the target is what the run
    reports. The clock is a parameter so the rule is tested on a controlled one.
    """

    def __init__(
        self,
        end: float,
        *,
        check_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        slack: float = 1.25,
        pad_s: float = 2.0,
    ) -> None:
        self.end = end
        self.clock = clock
        self.slack = slack
        self.pad_s = pad_s
        self._check_s = max(0.0, check_s)
        self._steps: list[float] = []

    @property
    def check_reserve_s(self) -> float:
        """Seconds kept for the final held-out evaluation."""
        return self.slack * self._check_s + self.pad_s

    @property
    def step_reserve_s(self) -> float:
        """Seconds one more RL step's own work may take (0 before any step)."""
        return max(self._steps[-3:], default=0.0)

    def left_s(self) -> float:
        """Seconds left of the whole budget (negative once it is spent)."""
        return self.end - self.clock()

    def observe_step(self, busy_s: float) -> None:
        """One RL step's own work (its wall time less its wait for groups)."""
        self._steps.append(max(0.0, busy_s))

    def observe_check(self, wall_s: float) -> None:
        """A held-out evaluation's wall time (the reserve follows the slowest so far)."""
        self._check_s = max(self._check_s, wall_s)

    def rl_over(self) -> bool:
        """True once another step would eat into the final evaluation's reserve."""
        return self.left_s() <= self.step_reserve_s + self.check_reserve_s
