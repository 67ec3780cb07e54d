"""Behaviour of the Store protocol: one conformance suite run identically over MemoryStore, SQLiteStore, HTTPStore
and PostgresStore (``store``), and over the durable ones for reopening (``durable``; see conftest)."""

from __future__ import annotations

import asyncio

import pytest

from lightning_sdk.errors import ConfigError, InvalidTransitionError, NotFoundError, StoreUnavailableError
from lightning_sdk.store import ManualClock, Store
from lightning_sdk.types import (
    AttemptStatus,
    Call,
    PolicyVersion,
    Resource,
    Reward,
    RolloutStatus,
)

from .conftest import Durable

# -- enqueue / claim / heartbeat / finish ----------------------------------------------------------------------------


async def test_enqueue_makes_n_queued_rollouts_per_task(store: Store) -> None:
    groups = await store.enqueue([{"q": "1+1"}, {"q": "2+2"}], n=3, max_attempts=2)
    assert [g.task for g in groups] == [{"q": "1+1"}, {"q": "2+2"}]
    assert [g.n for g in groups] == [3, 3]
    assert all(g.split == "train" and g.consumed_step is None for g in groups)
    rollouts, cursor = await store.list_rollouts()
    assert cursor is None
    assert len(rollouts) == 6
    assert [r.group_id for r in rollouts] == [groups[0].group_id] * 3 + [groups[1].group_id] * 3
    assert all(r.status is RolloutStatus.QUEUED and r.max_attempts == 2 and r.attempts_used == 0 for r in rollouts)
    assert rollouts[4].task == {"q": "2+2"}
    counts = await store.counts()
    assert counts == {"queued": 6, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 0, "groups_ready": 0}


async def test_claim_heartbeat_finish_roundtrip(store: Store) -> None:
    (group,) = await store.enqueue([{"q": "x"}], n=1)
    claim = await store.claim("worker-1", lease_s=30)
    assert claim is not None
    assert claim.rollout.group_id == group.group_id
    assert claim.rollout.status is RolloutStatus.RUNNING
    assert claim.rollout.attempts_used == 1
    att = claim.attempt
    assert att.status is AttemptStatus.RUNNING and att.worker_id == "worker-1" and att.index == 0
    assert att.lease_expires_at is not None and att.lease_expires_at > att.started_at + 29
    assert len(att.token) >= 40
    assert await store.claim("worker-2") is None  # nothing else queued

    found = await store.attempt_by_token(att.token)
    assert found is not None and found.attempt_id == att.attempt_id
    assert await store.attempt_by_token("lsk-unknown") is None

    beat = await store.heartbeat(att.attempt_id, lease_s=120)
    assert beat.lease_expires_at is not None and beat.lease_expires_at > att.lease_expires_at + 80
    done = await store.finish_attempt(att.attempt_id, AttemptStatus.SUCCEEDED)
    assert done.status is AttemptStatus.SUCCEEDED and done.ended_at is not None
    detail = await store.get_rollout(claim.rollout.rollout_id)
    assert detail.rollout.status is RolloutStatus.SUCCEEDED
    assert [a.attempt.status for a in detail.attempts] == [AttemptStatus.SUCCEEDED]
    assert (await store.get_attempt(att.attempt_id)).status is AttemptStatus.SUCCEEDED
    by_token = await store.attempt_by_token(att.token)
    assert by_token is not None and by_token.status is AttemptStatus.SUCCEEDED  # cache invalidated on finish


async def test_claim_takes_oldest_and_respects_split(store: Store) -> None:
    await store.enqueue([{"i": 0}], split="eval")
    await store.enqueue([{"i": 1}, {"i": 2}])
    first = await store.claim("w", split="train")
    assert first is not None and first.rollout.task == {"i": 1} and first.rollout.split == "train"
    any_split = await store.claim("w")
    assert any_split is not None and any_split.rollout.task == {"i": 0} and any_split.rollout.split == "eval"
    second = await store.claim("w", split="train")
    assert second is not None and second.rollout.task == {"i": 2}
    assert await store.claim("w", split="train") is None


async def test_concurrent_claims_never_share_a_rollout(store: Store) -> None:
    await store.enqueue([{"i": i} for i in range(10)])
    claims = await asyncio.gather(*(store.claim(f"w{i}") for i in range(15)))
    got = [c.rollout.rollout_id for c in claims if c is not None]
    assert len(got) == 10 and len(set(got)) == 10
    assert sum(c is None for c in claims) == 5


async def test_open_session_is_running_without_lease(store: Store) -> None:
    claim = await store.open_session({"q": "hi"}, group_id="grp-session")
    assert claim.rollout.status is RolloutStatus.RUNNING and claim.rollout.group_id == "grp-session"
    assert claim.rollout.task == {"q": "hi"}
    assert claim.attempt.lease_expires_at is None
    second = await store.open_session(None, group_id="grp-session")
    assert second.rollout.group_id == "grp-session" and second.rollout.task == {"q": "hi"}
    assert second.attempt.token != claim.attempt.token
    assert await store.claim("w") is None  # sessions are outside any queue
    assert await store.expire_leases() == []  # and never expire
    beat = await store.heartbeat(claim.attempt.attempt_id)
    assert beat.lease_expires_at is None
    await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    assert await store.finished_groups() == []  # second session still running
    await store.finish_attempt(second.attempt.attempt_id, AttemptStatus.FAILED, "boom")
    (ready,) = await store.finished_groups()
    assert ready.group.group_id == "grp-session" and ready.group.n == 2
    assert sorted(d.rollout.status.value for d in ready.rollouts) == ["failed", "succeeded"]


# -- illegal transitions ---------------------------------------------------------------------------------------------


async def test_every_illegal_transition_raises(store: Store) -> None:
    await store.enqueue([{"i": 0}, {"i": 1}])
    claim = await store.claim("w")
    assert claim is not None
    aid = claim.attempt.attempt_id
    with pytest.raises(InvalidTransitionError):
        await store.finish_attempt(aid, AttemptStatus.RUNNING)  # running -> running
    with pytest.raises(InvalidTransitionError):
        await store.cancel_rollout(claim.rollout.rollout_id)  # running -> cancelled
    await store.finish_attempt(aid, AttemptStatus.SUCCEEDED)
    for status in AttemptStatus:  # a terminal attempt cannot move anywhere
        with pytest.raises(InvalidTransitionError):
            await store.finish_attempt(aid, status)
    with pytest.raises(InvalidTransitionError):
        await store.heartbeat(aid)
    with pytest.raises(InvalidTransitionError):
        await store.cancel_rollout(claim.rollout.rollout_id)  # succeeded -> cancelled

    rollouts, _ = await store.list_rollouts(status=RolloutStatus.QUEUED)
    (queued,) = rollouts
    cancelled = await store.cancel_rollout(queued.rollout_id)
    assert cancelled.status is RolloutStatus.CANCELLED
    with pytest.raises(InvalidTransitionError):
        await store.cancel_rollout(queued.rollout_id)  # cancelled -> cancelled
    assert await store.claim("w") is None  # a cancelled rollout is never claimed


async def test_unknown_ids_raise_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError):
        await store.get_rollout("ro-missing")
    with pytest.raises(NotFoundError):
        await store.get_attempt("at-missing")
    with pytest.raises(NotFoundError):
        await store.finish_attempt("at-missing", AttemptStatus.FAILED)
    with pytest.raises(NotFoundError):
        await store.heartbeat("at-missing")
    with pytest.raises(NotFoundError):
        await store.cancel_rollout("ro-missing")
    with pytest.raises(NotFoundError):
        await store.consume_groups(1, ["gr-missing"])
    call = Call(call_id="c", attempt_id="at-missing", rollout_id="ro-missing", model="m")
    with pytest.raises(NotFoundError):
        await store.record_calls([call])
    with pytest.raises(NotFoundError):
        await store.record_rewards([Reward(rollout_id="ro-missing", attempt_id="at-missing", value=1.0)])


async def test_bad_arguments_raise_config_error(store: Store) -> None:
    with pytest.raises(ConfigError):
        await store.enqueue([{"a": 1}], n=0)
    with pytest.raises(ConfigError):
        await store.enqueue([{"a": 1}], max_attempts=0)
    with pytest.raises(ConfigError):
        await store.enqueue([{"a": 1}], group_ids=["g1", "g2"])
    with pytest.raises(ConfigError):
        await store.list_rollouts(after="not-a-cursor")
    assert (await store.list_rollouts()) == ([], None)


# -- leases and retries ----------------------------------------------------------------------------------------------


async def test_lease_expiry_retries_until_max_attempts(store: Store, clock: ManualClock) -> None:
    (group,) = await store.enqueue([{"q": "retry"}], max_attempts=2)
    first = await store.claim("w1", lease_s=20)
    assert first is not None
    clock.advance(19.9)
    assert await store.expire_leases() == []  # not yet expired
    clock.advance(0.1)  # the lease ends at claim + lease_s exactly
    (expired,) = await store.expire_leases()
    assert expired.attempt_id == first.attempt.attempt_id and expired.status is AttemptStatus.TIMED_OUT
    assert (await store.get_rollout(first.rollout.rollout_id)).rollout.status is RolloutStatus.QUEUED
    with pytest.raises(InvalidTransitionError):
        await store.heartbeat(first.attempt.attempt_id)  # the late worker learns its attempt is gone
    stale = await store.attempt_by_token(first.attempt.token)
    assert stale is not None and stale.status is AttemptStatus.TIMED_OUT

    second = await store.claim("w2", lease_s=20)
    assert second is not None and second.rollout.rollout_id == first.rollout.rollout_id
    assert second.attempt.index == 1 and second.rollout.attempts_used == 2
    clock.advance(20)
    assert [a.attempt_id for a in await store.expire_leases()] == [second.attempt.attempt_id]
    detail = await store.get_rollout(first.rollout.rollout_id)
    assert detail.rollout.status is RolloutStatus.FAILED and detail.rollout.attempts_used == 2
    assert [a.attempt.status for a in detail.attempts] == [AttemptStatus.TIMED_OUT, AttemptStatus.TIMED_OUT]
    assert await store.claim("w3") is None
    (ready,) = await store.finished_groups()
    assert ready.group.group_id == group.group_id


async def test_heartbeat_keeps_a_lease_alive(store: Store, clock: ManualClock) -> None:
    await store.enqueue([{"q": 1}])
    claim = await store.claim("w", lease_s=30)
    assert claim is not None
    for _ in range(3):  # 60 s in all, twice the lease: only the heartbeats keep it
        clock.advance(20)
        beat = await store.heartbeat(claim.attempt.attempt_id, lease_s=30)
        assert beat.lease_expires_at == clock() + 30
        assert await store.expire_leases() == []
    assert (await store.get_attempt(claim.attempt.attempt_id)).status is AttemptStatus.RUNNING
    clock.advance(30)  # no heartbeat: the lease runs out
    assert [a.attempt_id for a in await store.expire_leases()] == [claim.attempt.attempt_id]


async def test_failed_attempt_requeues_then_fails(store: Store) -> None:
    await store.enqueue([{"q": 1}], max_attempts=2)
    a = await store.claim("w")
    assert a is not None
    failed = await store.finish_attempt(a.attempt.attempt_id, AttemptStatus.FAILED, "tool crashed")
    assert failed.error == "tool crashed"
    b = await store.claim("w")
    assert b is not None and b.rollout.rollout_id == a.rollout.rollout_id
    await store.finish_attempt(b.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    detail = await store.get_rollout(a.rollout.rollout_id)
    assert detail.rollout.status is RolloutStatus.SUCCEEDED
    assert [x.attempt.error for x in detail.attempts] == ["tool crashed", None]
    ok = detail.succeeded_attempt()
    assert ok is not None and ok.attempt.attempt_id == b.attempt.attempt_id


async def test_released_attempts_do_not_count(store: Store) -> None:
    await store.enqueue([{"q": 1}], max_attempts=1)
    for _ in range(3):
        claim = await store.claim("w")
        assert claim is not None and claim.rollout.attempts_used == 1
        await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.RELEASED)
        rollout = (await store.get_rollout(claim.rollout.rollout_id)).rollout
        assert rollout.status is RolloutStatus.QUEUED and rollout.attempts_used == 0
    last = await store.claim("w")
    assert last is not None and last.attempt.index == 3
    await store.finish_attempt(last.attempt.attempt_id, AttemptStatus.FAILED, "no")
    detail = await store.get_rollout(last.rollout.rollout_id)
    assert detail.rollout.status is RolloutStatus.FAILED and len(detail.attempts) == 4


# -- idempotency -----------------------------------------------------------------------------------------------------


async def test_enqueue_is_idempotent_on_group_ids(store: Store) -> None:
    first = await store.enqueue([{"a": 1}, {"a": 2}], n=2, group_ids=["g-a", "g-b"])
    again = await store.enqueue([{"a": 1}, {"a": 3}], n=2, group_ids=["g-a", "g-c"])
    assert [g.group_id for g in first] == ["g-a", "g-b"]
    assert [g.group_id for g in again] == ["g-a", "g-c"]
    assert again[0].task == {"a": 1} and again[0].created_at == first[0].created_at
    rollouts, _ = await store.list_rollouts()
    assert len(rollouts) == 6  # g-a not enqueued twice


async def test_consume_groups_is_idempotent_per_step(store: Store) -> None:
    groups = await store.enqueue([{"i": 0}, {"i": 1}, {"i": 2}], n=2)
    while (claim := await store.claim("w")) is not None:
        await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    ready = await store.finished_groups()
    assert [f.group.group_id for f in ready] == [g.group_id for g in groups]
    assert (await store.counts())["groups_ready"] == 3
    ids = [groups[0].group_id, groups[1].group_id]
    assert await store.consume_groups(7, ids) == ids
    assert await store.consume_groups(7, ids) == []  # same step again: nothing changes
    with pytest.raises(InvalidTransitionError):
        await store.consume_groups(8, [groups[2].group_id, groups[0].group_id])  # g0 belongs to step 7
    left = await store.finished_groups()
    assert [f.group.group_id for f in left] == [groups[2].group_id]  # the failed call above changed nothing
    assert await store.consume_groups(8, [groups[2].group_id]) == [groups[2].group_id]
    assert await store.finished_groups() == []
    assert (await store.counts())["groups_ready"] == 0


async def test_consume_unfinished_group_raises(store: Store) -> None:
    (group,) = await store.enqueue([{"i": 0}], n=2)
    claim = await store.claim("w")
    assert claim is not None
    await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    with pytest.raises(InvalidTransitionError):
        await store.consume_groups(1, [group.group_id])


async def test_finished_groups_semantics(store: Store) -> None:
    train = await store.enqueue([{"i": 0}, {"i": 1}], n=2)
    (evalg,) = await store.enqueue([{"i": 9}], n=1, split="eval")
    claims = []
    while (claim := await store.claim("w")) is not None:
        claims.append(claim)
    assert await store.finished_groups() == []  # everything running
    by_group: dict[str, list[str]] = {}
    for c in claims:
        by_group.setdefault(c.rollout.group_id, []).append(c.attempt.attempt_id)
    for aid in by_group[train[1].group_id] + by_group[evalg.group_id]:
        await store.finish_attempt(aid, AttemptStatus.SUCCEEDED)
    await store.finish_attempt(by_group[train[0].group_id][0], AttemptStatus.FAILED, "x")
    (ready,) = await store.finished_groups()
    assert ready.group.group_id == train[1].group_id
    assert len(ready.rollouts) == 2 and all(d.rollout.status is RolloutStatus.SUCCEEDED for d in ready.rollouts)
    (eval_ready,) = await store.finished_groups(split="eval")
    assert eval_ready.group.group_id == evalg.group_id
    await store.finish_attempt(by_group[train[0].group_id][1], AttemptStatus.SUCCEEDED)
    both = await store.finished_groups()
    assert [f.group.group_id for f in both] == [train[0].group_id, train[1].group_id]  # oldest first
    assert [f.group.group_id for f in await store.finished_groups(limit=1)] == [train[0].group_id]
    statuses = sorted(d.rollout.status.value for d in both[0].rollouts)
    assert statuses == ["failed", "succeeded"]


async def test_cancelled_rollouts_finish_their_group(store: Store) -> None:
    (group,) = await store.enqueue([{"i": 0}], n=2)
    rollouts, _ = await store.list_rollouts()
    for r in rollouts:
        await store.cancel_rollout(r.rollout_id)
    (ready,) = await store.finished_groups()
    assert ready.group.group_id == group.group_id
    counts = await store.counts()
    assert counts["cancelled"] == 2 and counts["groups_ready"] == 1


# -- pagination ------------------------------------------------------------------------------------------------------


async def test_list_rollouts_paginates_in_creation_order(store: Store) -> None:
    await store.enqueue([{"i": i} for i in range(7)])
    claim = await store.claim("w")
    assert claim is not None
    seen: list[int] = []
    cursor: str | None = None
    pages = 0
    while True:
        page, cursor = await store.list_rollouts(limit=3, after=cursor)
        pages += 1
        seen.extend(r.task["i"] for r in page)
        if cursor is None:
            break
    assert seen == list(range(7)) and pages == 3
    queued, nxt = await store.list_rollouts(status=RolloutStatus.QUEUED, limit=10)
    assert [r.task["i"] for r in queued] == list(range(1, 7)) and nxt is None
    running, _ = await store.list_rollouts(status=RolloutStatus.RUNNING)
    assert [r.rollout_id for r in running] == [claim.rollout.rollout_id]
    exact, nxt = await store.list_rollouts(limit=7)
    assert len(exact) == 7 and nxt is None


async def test_rollout_details_page_like_get_rollout_and_load_groups_reads_a_page_at_a_time(store: Store) -> None:
    from lightning_sdk.store import load_groups

    groups = await store.enqueue([{"i": i} for i in range(5)], n=2, split="train")
    await store.enqueue([{"i": 99}], split="eval")
    claim = await store.claim("w", split="train")
    assert claim is not None
    call = Call(call_id="c-1", attempt_id=claim.attempt.attempt_id, rollout_id=claim.rollout.rollout_id, model="policy",
                prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5])  # fmt: skip
    await store.record_calls([call])
    await store.record_rewards([Reward(rollout_id=call.rollout_id, attempt_id=call.attempt_id, value=1.0)])
    await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    pages: list[list[str]] = []
    cursor: str | None = None
    while True:
        details, cursor = await store.list_rollout_details(limit=4, after=cursor)
        pages.append([d.rollout.rollout_id for d in details])
        for d in details:
            assert d == await store.get_rollout(d.rollout.rollout_id)
        if cursor is None:
            break
    assert [len(p) for p in pages] == [4, 4, 3]
    loaded = await load_groups(store, page=4)
    assert [g.group.group_id for g in loaded] == [g.group_id for g in groups]
    assert all(len(g.rollouts) == 2 and g.group.split == "train" for g in loaded)
    [first] = [d for g in loaded for d in g.rollouts if d.rollout.rollout_id == claim.rollout.rollout_id]
    assert first.attempts[0].calls[0].completion_ids == [3] and first.attempts[0].rewards[0].value == 1.0
    assert [g.group.task for g in await load_groups(store, split="eval")] == [{"i": 99}]


async def test_finished_groups_read_again_see_joined_sessions_and_forget_consumed_groups(store: Store) -> None:
    """The trainer reads the finished groups again and again until it has a step's worth (the SQL stores keep the
    details they loaded: ``FinishedCache``). A read after a session joined a finished group and ended, with no read
    between the two, has the group with the new rollout and its call; a consumed group is gone from the next read."""
    await store.enqueue([{"i": 0}, {"i": 1}], n=2, group_ids=["ga", "gb"])
    claim = await store.claim("w", split="train")
    while claim is not None:
        call = Call(call_id=f"c-{claim.attempt.attempt_id}", attempt_id=claim.attempt.attempt_id,
                    rollout_id=claim.rollout.rollout_id, model="policy", prompt_ids=[1], completion_ids=[5],
                    logprobs=[-0.5])  # fmt: skip
        await store.record_calls([call])
        await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
        claim = await store.claim("w", split="train")
    first = await store.finished_groups(split="train")
    assert [(g.group.group_id, len(g.rollouts)) for g in first] == [("ga", 2), ("gb", 2)]
    again = await store.finished_groups(split="train")
    assert again == first
    joined = await store.open_session(group_id="ga")
    call = Call(call_id="c-joined", attempt_id=joined.attempt.attempt_id, rollout_id=joined.rollout.rollout_id,
                model="policy", prompt_ids=[1], completion_ids=[7], logprobs=[-0.25])  # fmt: skip
    await store.record_calls([call])
    await store.record_rewards(
        [Reward(rollout_id=joined.rollout.rollout_id, attempt_id=joined.attempt.attempt_id, value=1.0)]
    )
    await store.finish_attempt(joined.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    after = {g.group.group_id: g for g in await store.finished_groups(split="train")}
    assert after["ga"].group.n == 3 and len(after["ga"].rollouts) == 3
    new = after["ga"].rollouts[2].attempts[0]
    assert new.calls[0].completion_ids == [7] and [r.value for r in new.rewards] == [1.0]
    assert after["gb"] == first[1]
    assert await store.consume_groups(1, ["ga"]) == ["ga"]
    assert [g.group.group_id for g in await store.finished_groups(split="train")] == ["gb"]
    assert await store.finished_groups(split="eval") == []


async def test_group_details_page_groups_in_creation_order_with_every_rollout(store: Store) -> None:
    """A group's rollouts are all in its page, also one that joined the group after later groups were made; consumed
    groups and other splits are listed too (an export wants everything)."""
    await store.enqueue([{"i": 0}, {"i": 1}], n=2, group_ids=["ga", "gb"])
    await store.enqueue([{"i": 9}], split="eval", group_ids=["ge"])
    await store.enqueue([{"i": 2}], group_ids=["gc"])
    joined = await store.open_session(group_id="ga")
    call = Call(call_id="c-j", attempt_id=joined.attempt.attempt_id, rollout_id=joined.rollout.rollout_id,
                model="policy", prompt_ids=[1], completion_ids=[2], logprobs=[-0.1])  # fmt: skip
    await store.record_calls([call])
    await store.finish_attempt(joined.attempt.attempt_id, AttemptStatus.SUCCEEDED)
    claim = await store.claim("w", split="train")
    while claim is not None:
        await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.SUCCEEDED)
        claim = await store.claim("w", split="train")
    assert await store.consume_groups(1, ["gc"]) == ["gc"]

    pages: list[list[str]] = []
    seen = {}
    cursor: str | None = None
    while True:
        page, cursor = await store.list_group_details(split="train", limit=2, after=cursor)
        pages.append([g.group.group_id for g in page])
        seen.update({g.group.group_id: g for g in page})
        if cursor is None:
            break
    assert pages == [["ga", "gb"], ["gc"]]
    ga = seen["ga"]
    assert ga.group.n == 3 and len(ga.rollouts) == 3
    assert ga.rollouts[2] == await store.get_rollout(joined.rollout.rollout_id)
    assert ga.rollouts[2].attempts[0].calls[0].completion_ids == [2]
    every, cursor = await store.list_group_details(split=None, limit=4)
    assert [g.group.group_id for g in every] == ["ga", "gb", "ge", "gc"] and cursor is None  # no empty last page
    assert every[3].group.consumed_step == 1 and every[2].group.split == "eval"
    assert all(d.rollout.group_id == g.group.group_id for g in every for d in g.rollouts)
    assert await store.list_group_details(split="nope") == ([], None)
    with pytest.raises(ConfigError):
        await store.list_group_details(limit=0)


# -- calls, rewards, versions, resources, meta -----------------------------------------------------------------------


async def test_calls_and_rewards_roundtrip_exactly(store: Store) -> None:
    await store.enqueue([{"q": "calls"}])
    claim = await store.claim("w")
    assert claim is not None
    aid, rid = claim.attempt.attempt_id, claim.rollout.rollout_id
    logprobs = [-0.1, -1e-12, -23.456789012345678, 0.0, -3.4028234663852886e38, -7.0e-310]
    big_ids = [0, 1, 151_643, 2_147_483_647, 42, 7]
    call0 = Call(
        call_id="call-0",
        attempt_id=aid,
        rollout_id=rid,
        seq=0,
        model="policy",
        request={"messages": [{"role": "user", "content": "héllo ✓"}], "tools": [], "temperature": 0.7},
        response={"choices": [{"message": {"role": "assistant", "content": "hi"}}]},
        prompt_ids=list(range(1000)),
        completion_ids=big_ids,
        logprobs=logprobs,
        policy_version=3,
        finish_reason="stop",
        usage={"prompt_tokens": 1000, "completion_tokens": 6},
        checks={"roundtrip": True},
        ended_at=123.5,
    )
    call1 = Call(
        call_id="call-1",
        attempt_id=aid,
        rollout_id=rid,
        seq=1,
        model="judge",
        is_policy=False,
        token_source="external",
        usage={"prompt_tokens": 5},
    )
    await store.record_calls([call1, call0])
    await store.record_calls([call0])  # idempotent on call_id
    await store.record_rewards([Reward(rollout_id=rid, attempt_id=aid, value=0.25, call_id="call-0", name="step")])
    await store.record_rewards([Reward(rollout_id=rid, attempt_id=aid, value=0.5)])
    await store.record_rewards([Reward(rollout_id=rid, attempt_id=aid, value=1.0)])  # same key: replaces
    await store.finish_attempt(aid, AttemptStatus.SUCCEEDED)
    detail = await store.get_rollout(rid)
    (att,) = detail.attempts
    assert [c.call_id for c in att.calls] == ["call-0", "call-1"]
    assert att.calls[0] == call0
    assert att.calls[0].logprobs == logprobs and att.calls[0].completion_ids == big_ids
    assert att.calls[1] == call1
    rewards = sorted((r.name, r.value, r.call_id) for r in att.rewards)
    assert rewards == [("reward", 1.0, None), ("step", 0.25, "call-0")]


async def test_record_many_calls_in_one_batch(store: Store) -> None:
    await store.enqueue([{"q": "batch"}])
    claim = await store.claim("w")
    assert claim is not None
    calls = [
        Call(
            call_id=f"c{i}",
            attempt_id=claim.attempt.attempt_id,
            rollout_id=claim.rollout.rollout_id,
            seq=i,
            model="policy",
            prompt_ids=[i] * 5,
            completion_ids=[i, i + 1],
            logprobs=[-0.5, -0.25],
        )
        for i in range(200)
    ]
    await store.record_calls(calls[:150])
    await store.record_calls(calls[100:])  # overlapping batch
    (att,) = (await store.get_rollout(claim.rollout.rollout_id)).attempts
    assert [c.call_id for c in att.calls] == [f"c{i}" for i in range(200)]
    assert att.calls[199].prompt_ids == [199] * 5


async def test_versions_resources_meta(store: Store) -> None:
    assert await store.current_version() is None
    await store.publish_version(PolicyVersion(version=1, step=10, meta={"path": "/ckpt/1"}))
    await store.publish_version(PolicyVersion(version=2, step=20))
    cur = await store.current_version()
    assert cur is not None and cur.version == 2 and cur.step == 20
    assert await store.get_resources() == []
    res = Resource(name="policy", base_url="http://127.0.0.1:1/v1", kind="vllm", meta={"tp": 2})
    await store.set_resource(res)
    await store.set_resource(Resource(name="judge", kind="litellm", is_policy=False))
    await store.set_resource(res.model_copy(update={"kind": "sglang"}))
    got = await store.get_resources()
    assert [(r.name, r.kind) for r in got] == [("judge", "litellm"), ("policy", "sglang")]
    assert got[1].meta == {"tp": 2}
    assert await store.get_meta("ckpt") is None
    await store.set_meta("ckpt", {"step": 3, "path": "/x", "vals": [1.5, None]})
    assert await store.get_meta("ckpt") == {"step": 3, "path": "/x", "vals": [1.5, None]}
    await store.set_meta("ckpt", 7)
    assert await store.get_meta("ckpt") == 7


async def test_a_batch_of_calls_keeps_the_first_of_each_id(store: Store) -> None:
    """250 calls in one batch (SQLite: three multi-row statements; PostgreSQL: one pipelined executemany) are all
    stored with exact ids and log-probs; an id repeated in the same batch, or already stored, keeps its first
    version."""
    claim = await store.open_session({"q": 1})
    aid, rid = claim.attempt.attempt_id, claim.rollout.rollout_id

    def call(i: int, model: str = "policy") -> Call:
        return Call(
            call_id=f"c{i:03d}",
            attempt_id=aid,
            rollout_id=rid,
            seq=i,
            model=model,
            prompt_ids=[i, i + 1],
            completion_ids=[2**31 - 1 - i],
            logprobs=[-1.0 / (i + 3)],
            started_at=1000.0 + i,
        )

    await store.record_calls([call(0, "stored-first")])
    await store.record_calls([call(i) for i in range(250)] + [call(7, "repeated")])
    calls = (await store.get_rollout(rid)).attempts[0].calls
    assert [c.call_id for c in calls] == [f"c{i:03d}" for i in range(250)]
    assert calls[0].model == "stored-first" and calls[7].model == "policy"
    assert all(c == call(c.seq) for c in calls[1:])


async def test_a_re_sent_call_replaces_the_first_and_keeps_its_seq(store: Store) -> None:
    """A call with an ``idempotency_key`` whose id is stored is the same logical call made again (the agent never
    got the first answer): its record replaces the first (content, ids, log-probs) and keeps the first's ``seq``,
    across batches and inside one batch; one record per id. A plain call of a stored id still keeps the first; the
    attempt's other calls are untouched and the order by ``seq`` holds."""
    claim = await store.open_session({"q": 1})
    aid, rid = claim.attempt.attempt_id, claim.rollout.rollout_id

    def call(call_id: str, seq: int, tag: int, key: str | None = "k") -> Call:
        return Call(
            call_id=call_id,
            attempt_id=aid,
            rollout_id=rid,
            seq=seq,
            model=f"m{tag}",
            prompt_ids=[tag, 1, 2],
            completion_ids=[tag * 10, 2**31 - 1],
            logprobs=[-0.5 / tag, -0.25],
            response={"tag": tag},
            started_at=1000.0 + tag,
            idempotency_key=key,
        )

    await store.record_calls([call("a", 0, 1), call("b", 1, 2, key=None), call("c", 2, 3)])
    await store.record_calls([call("a", 5, 4)])  # "a" re-sent: numbered 5 by the proxy that served it again
    await store.record_calls([call("c", 6, 5), call("c", 7, 6), call("d", 3, 7)])  # re-sent twice in one batch
    await store.record_calls([call("b", 8, 8, key=None)])  # a plain call again: the first stays
    calls = (await store.get_rollout(rid)).attempts[0].calls
    assert [(c.call_id, c.seq, c.model) for c in calls] == [("a", 0, "m4"), ("b", 1, "m2"), ("c", 2, "m6"),
                                                            ("d", 3, "m7")]  # fmt: skip
    assert calls[0] == call("a", 0, 4) and calls[2] == call("c", 2, 6)
    assert calls[0].prompt_ids == [4, 1, 2] and calls[0].logprobs == [-0.125, -0.25]
    assert calls[0].idempotency_key == "k" and calls[1].idempotency_key is None


# -- durable stores (SQLite, PostgreSQL): a reopen keeps everything ------------------------------------------------
async def test_reopen_keeps_everything(durable: Durable) -> None:
    store = durable.open()
    await store.enqueue([{"q": 1}, {"q": 2}], n=1, group_ids=["g1", "g2"])
    claim = await store.claim("w", lease_s=60)
    assert claim is not None
    await store.set_meta("ckpt", {"step": 1})
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(StoreUnavailableError):
        await store.counts()

    again = durable.open()
    try:
        assert await again.attempt_by_token(claim.attempt.token) == claim.attempt
        assert await again.get_meta("ckpt") == {"step": 1}
        assert (await again.counts())["running"] == 1
        await again.finish_attempt(claim.attempt.attempt_id, AttemptStatus.FAILED, "x")
        found = await again.attempt_by_token(claim.attempt.token)
        assert found is not None and found.status is AttemptStatus.FAILED
        groups = await again.enqueue([{"q": 1}], group_ids=["g1"])  # idempotent across the reopen
        assert groups[0].task == {"q": 1}
        assert (await again.counts())["queued"] == 1
    finally:
        await again.close()
