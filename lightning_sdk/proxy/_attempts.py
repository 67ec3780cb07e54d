"""Bearer token → running attempt, cached so the hot path does not read the store on every call.

A token's attempt is looked up once and trusted for ``ttl_s`` seconds (the store may time an attempt out on lease
expiry without the proxy knowing, so entries are re-read after that; ``finish`` through this proxy updates the
entry at once). Each entry also keeps the attempt's call order (``seq``) and the calls finished in this process,
which the token-in/token-out backend reads to reuse the ids of earlier calls. The first call of an attempt loads
the calls the store already has (a restarted proxy continues the numbering).

Memory and cost with many running attempts: at most ``max_entries`` entries keep their calls (least recently used
first, the calls of an idle entry are *shed*: read again from the store if a later call needs them, while its
``seq`` counter, split and barrier state stay), and at most ``max_light`` entries are kept in all. So a request
costs the same with 10 or 10,000 running attempts: its entry is found in a dict, never rebuilt from the store.

Whether an entry keeps its finished calls at all: with ``keep_calls`` (the default; token mode reads the earlier
calls of every call) from the start; without (the passthrough backend never reads them) only from the first time
something asks for them (a Responses/Messages call, a per-call reward for a call of an earlier process): the
entry then waits until the recorder has committed what it holds for the attempt (``settle``), reads the calls from
the store and keeps the later ones. A long passthrough attempt thus holds no calls in memory, which the garbage
collector would otherwise walk again and again (about a dozen tracked objects per call).

The barrier of ``finish`` rests on three rules kept here:

* a request is counted in flight (``enter``) in the same step as the check that its attempt is running, with no
  ``await`` in between, so ``finish`` either sees it in flight or it sees the attempt closed;
* ``close`` is sticky: once an attempt is finishing or ended, a stale store read never reopens it;
* an entry is never evicted while it is busy (requests in flight, or records the recorder has not committed), so
  its call counter and in-flight count survive any number of running attempts and ``seq`` stays unique.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from lightning_sdk.errors import AttemptNotRunningError, AuthError
from lightning_sdk.store.base import Store
from lightning_sdk.types import Attempt, AttemptStatus, Call

__all__ = ["AttemptCache", "AttemptState"]


class AttemptState:
    """What the proxy keeps per attempt while it is running."""

    __slots__ = (
        "_inflight",
        "_load_lock",
        "_settle",
        "attempt",
        "call_ids",
        "calls",
        "checked_at",
        "closing",
        "idle",
        "keep",
        "keyed",
        "loaded",
        "n_calls",
        "n_errors",
        "next_seq",
        "numbered",
        "split",
        "tasks",
    )

    def __init__(
        self,
        attempt: Attempt,
        checked_at: float,
        *,
        keep: bool = True,
        settle: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.attempt = attempt
        self.checked_at = checked_at
        self.next_seq = 0
        self.calls: list[Call] = []  # finished calls of this attempt, in seq order (while ``keep``)
        self.keep = keep  # finished calls are kept in ``calls`` (else: from the first read of them on)
        self._settle = settle  # waits until the recorder committed what it holds for an attempt
        self.call_ids: set[str] = set()  # every call id handed out for this attempt in this process (per-call rewards)
        self.loaded = False  # the store's calls of this attempt are in ``calls``
        self.numbered = False  # ``next_seq`` and ``split`` know the store (kept when the calls are shed)
        self.split: str | None = None  # the rollout's split, known once loaded (take_seq loads)
        self._inflight = 0  # requests (calls, rewards) being served right now (finish waits for them)
        self.closing: str | None = None  # why no new request is accepted (finishing / ended), sticky
        self.tasks: set[asyncio.Task[object]] = set()  # the tasks serving LLM calls now (finish may abort them)
        self.idle = asyncio.Event()
        self.idle.set()
        self.n_calls = 0  # calls handed to the recorder in this process (failed ones included)
        self.n_errors = 0  # of which recorded with an error
        self.keyed: set[str] | None = None  # ids of the calls with an Idempotency-Key recorded here (re-sent ones)
        self._load_lock = asyncio.Lock()

    @property
    def inflight(self) -> int:
        """Requests (calls, rewards) of this attempt being served now; ``idle`` is set when there are none."""
        return self._inflight

    @inflight.setter
    def inflight(self, value: int) -> None:
        self._inflight = max(0, value)
        if self._inflight:
            self.idle.clear()
        else:
            self.idle.set()

    def enter(self) -> None:
        """Count a request in flight; raises ``AttemptNotRunningError`` when the attempt is closed (no await here)."""
        if self.closing is not None or self.attempt.status is not AttemptStatus.RUNNING:
            raise AttemptNotRunningError(
                f"attempt {self.attempt.attempt_id} is {self.closing or self.attempt.status.value}, no longer running"
            )
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1

    async def take_seq(self, store: Store) -> int:
        """The ``seq`` of a new call (continuing what the store has, the first time)."""
        if not self.numbered:
            await self._load(store, calls=False)
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

    def first_of(self, call: Call) -> bool:
        """Whether ``call`` is the first record of its id here: False for a re-sent call (``Call.idempotency_key``)
        whose first record this proxy made, which the store replaces (counted once)."""
        if call.idempotency_key is None:
            return True
        if self.keyed is None:
            self.keyed = set()
        if call.call_id in self.keyed:
            return False
        self.keyed.add(call.call_id)
        return True

    def add_call(self, call: Call) -> None:
        if not self.keep:  # nobody reads them (yet): the store has them once the recorder commits them
            return
        if call.idempotency_key is not None:  # a re-sent call replaces the first here too, in its place
            for i, kept in enumerate(self.calls):
                if kept.call_id == call.call_id:
                    call.seq = kept.seq
                    self.calls[i] = call
                    return
        if not self.calls or self.calls[-1].seq < call.seq:
            self.calls.append(call)
        else:  # calls of one attempt may finish out of order
            bisect.insort(self.calls, call, key=lambda c: c.seq)

    def shed(self) -> None:
        """Forget the calls kept here (memory): a later reader loads them from the store again. Only for an idle
        entry whose records are all committed; ``seq``, the split and the barrier state stay."""
        self.calls = []
        self.loaded = False

    async def _load(self, store: Store, *, calls: bool = True) -> None:
        """Read the attempt's split, numbering and (``calls``, or when the entry keeps its calls) stored calls."""
        async with self._load_lock:
            if self.loaded or (not calls and self.numbered):
                return
            if calls and not self.keep:
                self.keep = True  # calls finishing from now on are kept (the merge below drops doubles)
                if self._settle is not None:  # the earlier ones reach the store before it is read
                    await self._settle(self.attempt.attempt_id)
            detail = await store.get_rollout(self.attempt.rollout_id)
            self.split = detail.rollout.split
            stored = [c for a in detail.attempts if a.attempt.attempt_id == self.attempt.attempt_id for c in a.calls]
            if stored:
                self.next_seq = max(self.next_seq, max(c.seq for c in stored) + 1)
            self.numbered = True
            if self.keep:
                if stored:
                    ids = {c.call_id for c in stored}
                    self.calls = sorted(stored + [c for c in self.calls if c.call_id not in ids], key=lambda c: c.seq)
                self.loaded = True


class AttemptCache:
    """Resolve attempt tokens (401 unknown, 409 not running) with a short-lived cache (see the module docstring).

    ``max_entries`` entries keep their calls and ``max_light`` entries are kept in all (least recently used go
    first). ``busy(attempt_id)`` says whether records of that attempt are still waiting to be committed (the
    recorder's count); such an entry, or one with requests in flight, is never shed nor dropped.
    """

    def __init__(
        self,
        store: Store,
        *,
        ttl_s: float = 2.0,
        max_entries: int = 4096,
        max_light: int = 65536,
        busy: Callable[[str], bool] | None = None,
        keep_calls: bool = True,
        settle: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.keep_calls = keep_calls  # entries keep their finished calls from the start (else: once read)
        self._settle = settle
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_light = max(max_light, max_entries)
        self._busy = busy or (lambda attempt_id: False)
        self._by_token: OrderedDict[str, AttemptState] = OrderedDict()  # every entry, least recently used first
        self._heavy: OrderedDict[str, None] = OrderedDict()  # the tokens whose entries may hold calls, LRU first
        self._by_attempt: dict[str, str] = {}  # attempt id -> token (for a store-side finish)

    def __len__(self) -> int:
        return len(self._by_token)

    async def resolve(self, token: str | None) -> AttemptState:
        """The running attempt that owns ``token``; raises ``AuthError`` / ``AttemptNotRunningError``.

        Callers that serve a request call ``state.enter()`` right after (no await between: see the module
        docstring) and ``state.leave()`` when done.
        """
        if not token:
            raise AuthError("missing attempt token: send 'Authorization: Bearer <attempt token>' or use /t/<token>/v1")
        now = time.monotonic()
        state = self._by_token.get(token)
        if state is None or (state.closing is None and now - state.checked_at > self.ttl_s):
            attempt = await self.store.attempt_by_token(token)
            state = self._by_token.get(token)  # another request may have filled the entry meanwhile: share it
            if attempt is None:
                if state is None or state.inflight == 0:
                    self._drop(token)
                raise AuthError("unknown attempt token")
            if state is None or state.attempt.attempt_id != attempt.attempt_id:
                state = AttemptState(attempt, now, keep=self.keep_calls, settle=self._settle)
                self._by_token[token] = state
                self._by_attempt[attempt.attempt_id] = token
            elif state.closing is None:  # a closed entry stays closed (the read may predate the finish)
                state.attempt = attempt
                state.checked_at = now
        self._by_token.move_to_end(token)
        if token in self._heavy:
            self._heavy.move_to_end(token)
        else:  # new, or shed: this request may give it calls again
            self._heavy[token] = None
            self._evict()
        if state.closing is not None or state.attempt.status is not AttemptStatus.RUNNING:
            raise AttemptNotRunningError(
                f"attempt {state.attempt.attempt_id} is {state.closing or state.attempt.status.value}, "
                "no longer running"
            )
        return state

    def state_of(self, attempt_id: str) -> AttemptState | None:
        """The cached entry of ``attempt_id`` (None when it is not cached)."""
        token = self._by_attempt.get(attempt_id)
        return self._by_token.get(token) if token is not None else None

    def ended(self, token: str, attempt: Attempt) -> None:
        """Record that the attempt behind ``token`` ended (its calls are no longer accepted)."""
        state = self._by_token.get(token)
        if state is not None:
            state.attempt = attempt
            state.closing = attempt.status.value
            state.calls = []  # no later call can extend them
            state.call_ids = set()
            state.checked_at = time.monotonic()

    def _drop(self, token: str) -> None:
        state = self._by_token.pop(token, None)
        self._heavy.pop(token, None)
        if state is not None and self._by_attempt.get(state.attempt.attempt_id) == token:
            del self._by_attempt[state.attempt.attempt_id]

    def _idle(self, state: AttemptState) -> bool:
        return state.inflight == 0 and not state.tasks and not self._busy(state.attempt.attempt_id)

    def _evict(self) -> None:
        """Over ``max_entries`` entries with calls, shed the calls of the least recently used idle running entries
        (an ended one is dropped); over ``max_light`` entries, drop the least recently used idle ones. Busy entries
        (in flight, or records not yet committed) are moved on, never touched."""
        checked = 0
        while len(self._heavy) > self.max_entries and checked < len(self._heavy):
            token = next(iter(self._heavy))
            checked += 1
            state = self._by_token.get(token)
            if state is not None and not self._idle(state):
                self._heavy.move_to_end(token)
                continue
            del self._heavy[token]
            if state is not None and (state.closing is not None or state.attempt.status is not AttemptStatus.RUNNING):
                self._drop(token)
            elif state is not None:
                state.shed()
        checked = 0
        while len(self._by_token) > self.max_light and checked < len(self._by_token):
            token, state = next(iter(self._by_token.items()))
            checked += 1
            if not self._idle(state):
                self._by_token.move_to_end(token)
                continue
            self._drop(token)
