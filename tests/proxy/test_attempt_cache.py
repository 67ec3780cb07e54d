"""The proxy's token cache with more running attempts than it keeps calls for: entries over ``max_entries`` shed
their calls but keep their ``seq`` counter, so a request never rebuilds its entry from the store (the cost stays
flat from 10 to 10,000 running attempts: benchmarks/store_scale.py); entries over ``max_light`` are dropped and
rebuilt from the store, numbering on where it left off.

Real components: a SQLite store file (a subclass that counts ``get_rollout``, the read an entry is rebuilt from).
"""

from __future__ import annotations

from pathlib import Path

from lightning_sdk.proxy._attempts import AttemptCache
from lightning_sdk.store import SQLiteStore
from lightning_sdk.types import Call, RolloutDetail


class CountingStore(SQLiteStore):
    """A real SQLite store that counts the rollout reads the proxy's cache makes."""

    reads = 0

    async def get_rollout(self, rollout_id: str) -> RolloutDetail:
        self.reads += 1
        return await super().get_rollout(rollout_id)


async def _call(store: SQLiteStore, cache: AttemptCache, token: str) -> Call:
    """One call of the attempt behind ``token``, numbered by the cache and committed as the recorder would."""
    state = await cache.resolve(token)
    seq = await state.take_seq(store)
    a = state.attempt
    call = Call(call_id=f"{a.attempt_id}-{seq}", attempt_id=a.attempt_id, rollout_id=a.rollout_id, seq=seq,
                model="policy", prompt_ids=[1, 2, seq], completion_ids=[3], logprobs=[-0.5])  # fmt: skip
    state.add_call(call)
    await store.record_calls([call])
    return call


async def test_shed_entries_keep_their_numbering_and_are_not_read_again(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "s.db")
    try:
        await store.enqueue([{"i": i} for i in range(6)])
        tokens = []
        for _ in range(6):
            claim = await store.claim("w", lease_s=600)
            assert claim is not None
            tokens.append(claim.attempt.token)
        cache = AttemptCache(store, ttl_s=600, max_entries=2, max_light=4)

        first = [await _call(store, cache, t) for t in tokens]
        assert [c.seq for c in first] == [0] * 6 and store.reads == 6  # each entry built once
        assert len(cache) == 4 and len(cache._heavy) == 2  # 2 dropped (max_light), 2 shed, 2 with their calls

        kept = tokens[2:]
        second = [await _call(store, cache, t) for t in kept]
        assert [c.seq for c in second] == [1] * 4 and store.reads == 6  # shed or not: no read, numbering goes on

        shed = next(cache._by_token[t] for t in kept if t not in cache._heavy)
        assert shed.calls == [] and not shed.loaded
        earlier = await shed.earlier_calls(store, 5)  # the token backend's read: the calls come back from the store
        assert [c.seq for c in earlier] == [0, 1] and store.reads == 7

        again = await _call(store, cache, tokens[0])  # dropped: rebuilt from the store, numbering on from it
        assert again.seq == 1 and store.reads == 8
        for t in tokens:
            state = await cache.resolve(t)
            stored = (await store.get_rollout(state.attempt.rollout_id)).attempts[0].calls
            assert sorted(c.seq for c in stored) == list(range(len(stored)))  # unique, gap-free seqs
    finally:
        await store.close()
