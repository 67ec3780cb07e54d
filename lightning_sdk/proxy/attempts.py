"""Bearer token → running attempt, cached so the hot path does not read the store on every call.

A token's attempt is looked up once and trusted for ``ttl_s`` seconds (the store may time an attempt out on lease
expiry without the proxy knowing, so entries are re-read after that; ``finish`` through this proxy updates the
entry at once). Each entry also keeps the attempt's call order (``seq``) and the calls finished in this process,
which the token-in/token-out backend reads to reuse the ids of earlier calls. The first call of an attempt loads
the calls the store already has (a restarted proxy continues the numbering).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import OrderedDict

from lightning_sdk.errors import AttemptNotRunningError, AuthError
from lightning_sdk.store.base import Store
from lightning_sdk.types import Attempt, AttemptStatus, Call

__all__ = ["AttemptCache", "AttemptState"]


class AttemptState:
    """What the proxy keeps per attempt while it is running."""

    __slots__ = ("_load_lock", "attempt", "call_ids", "calls", "checked_at", "inflight", "loaded", "next_seq")

    def __init__(self, attempt: Attempt, checked_at: float) -> None:
        self.attempt = attempt
        self.checked_at = checked_at
        self.next_seq = 0
        self.calls: list[Call] = []  # finished calls of this attempt, in seq order
        self.call_ids: set[str] = set()  # every call id handed out for this attempt in this process (per-call rewards)
        self.loaded = False
        self.inflight = 0  # calls being served right now (finish waits for them)
        self._load_lock = asyncio.Lock()

    async def take_seq(self, store: Store) -> int:
        """The ``seq`` of a new call (continuing what the store has, the first time)."""
        if not self.loaded:
            await self._load(store)
        seq = self.next_seq
        self.next_seq += 1
        return seq

    async def earlier_calls(self, store: Store, before_seq: int) -> list[Call]:
        if not self.loaded:
            await self._load(store)
        return [c for c in self.calls if c.seq < before_seq]

    async def has_call(self, store: Store, call_id: str) -> bool:
        """Whether ``call_id`` is a call of this attempt (handed out here, or already in the store)."""
        if call_id in self.call_ids:
            return True
        if not self.loaded:
            await self._load(store)
        return any(c.call_id == call_id for c in self.calls)

    def add_call(self, call: Call) -> None:
        if not self.calls or self.calls[-1].seq < call.seq:
            self.calls.append(call)
        else:  # calls of one attempt may finish out of order
            bisect.insort(self.calls, call, key=lambda c: c.seq)

    async def _load(self, store: Store) -> None:
        async with self._load_lock:
            if self.loaded:
                return
            detail = await store.get_rollout(self.attempt.rollout_id)
            stored = [c for a in detail.attempts if a.attempt.attempt_id == self.attempt.attempt_id for c in a.calls]
            if stored:
                ids = {c.call_id for c in stored}
                self.calls = sorted(stored + [c for c in self.calls if c.call_id not in ids], key=lambda c: c.seq)
                self.next_seq = max(self.next_seq, max(c.seq for c in stored) + 1)
            self.loaded = True


class AttemptCache:
    """Resolve attempt tokens (401 unknown, 409 not running) with a short-lived cache."""

    def __init__(self, store: Store, *, ttl_s: float = 2.0, max_entries: int = 4096) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._by_token: OrderedDict[str, AttemptState] = OrderedDict()

    async def resolve(self, token: str | None) -> AttemptState:
        """The running attempt that owns ``token``; raises ``AuthError`` / ``AttemptNotRunningError``."""
        if not token:
            raise AuthError("missing attempt token: send 'Authorization: Bearer <attempt token>' or use /t/<token>/v1")
        now = time.monotonic()
        state = self._by_token.get(token)
        if state is None or now - state.checked_at > self.ttl_s:
            attempt = await self.store.attempt_by_token(token)
            if attempt is None:
                self._by_token.pop(token, None)
                raise AuthError("unknown attempt token")
            if state is None or state.attempt.attempt_id != attempt.attempt_id:
                state = AttemptState(attempt, now)
                self._by_token[token] = state
                if len(self._by_token) > self.max_entries:
                    self._by_token.popitem(last=False)
            else:
                state.attempt = attempt
                state.checked_at = now
            self._by_token.move_to_end(token)
        if state.attempt.status is not AttemptStatus.RUNNING:
            raise AttemptNotRunningError(
                f"attempt {state.attempt.attempt_id} is {state.attempt.status.value}, no longer running"
            )
        return state

    def ended(self, token: str, attempt: Attempt) -> None:
        """Record that the attempt behind ``token`` ended (its calls are no longer accepted)."""
        state = self._by_token.get(token)
        if state is not None:
            state.attempt = attempt
            state.calls = []  # no later call can extend them
            state.call_ids = set()
            state.checked_at = time.monotonic()
