"""Build the calls of an attempt the way the proxy records them (exact prompt ids, sampled ids, logprobs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_sdk.types import Call, TokenSource


class Attempt:
    """Calls of one attempt; ``call`` appends one with deterministic logprobs unique per token position."""

    def __init__(self, attempt_id: str = "att-1", rollout_id: str = "ro-1") -> None:
        self.attempt_id = attempt_id
        self.rollout_id = rollout_id
        self.calls: list[Call] = []

    def call(
        self,
        prompt: Sequence[int],
        completion: Sequence[int],
        *,
        logprobs: Sequence[float] | None = None,
        source: TokenSource = "engine",
        is_policy: bool = True,
        version: int | None = 0,
        started_at: float | None = None,
        ended_at: float | None = None,
        checks: dict[str, Any] | None = None,
    ) -> Call:
        seq = len(self.calls)
        lp = list(logprobs) if logprobs is not None else [-(seq + 1) - k / 1000 for k in range(len(completion))]
        c = Call(
            call_id=f"{self.attempt_id}-c{seq}",
            attempt_id=self.attempt_id,
            rollout_id=self.rollout_id,
            seq=seq,
            model="policy",
            is_policy=is_policy,
            token_source=source,
            prompt_ids=list(prompt),
            completion_ids=list(completion),
            logprobs=lp,
            policy_version=version,
            started_at=float(seq) * 10 if started_at is None else started_at,
            ended_at=float(seq) * 10 + 5 if ended_at is None else ended_at,
            checks=checks or {},
        )
        self.calls.append(c)
        return c


def full(c: Call) -> list[int]:
    """A call's prompt + completion."""
    return [*c.prompt_ids, *c.completion_ids]
