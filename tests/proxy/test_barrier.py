"""``finish`` is a barrier, always: a call racing it waits or gets 409, long calls are waited for or aborted (and the
answer says which), thousands of running attempts never lose in-flight state, and a store-side finish closes the
token at once.

Real components: the proxy app under uvicorn on loopback, a real SQLite store file, the loopback mock upstream
(vLLM wire format), httpx/openai clients over real sockets.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from lightning_sdk.proxy import ProxyConfig
from lightning_sdk.proxy._call import ABORTED
from lightning_sdk.proxy.passthrough import PassthroughBackend
from lightning_sdk.store import MemoryStore, SQLiteStore
from lightning_sdk.types import AttemptStatus
from tests.support.mock_openai import MockOpenAI
from tests.support.proxy import ADMIN_KEY, ProxyHandle, proxy_app
from tests.support.servers import RunningServer, serve_async
from tests.support.waiting import until_async

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _race_once(http: httpx.AsyncClient, rng: random.Random) -> tuple[int, dict[str, Any], str]:
    s = (await http.post("/lightning/v1/sessions", json={}, headers=ADMIN)).json()
    gap = rng.random() * 0.002
    call_first = rng.random() < 0.5

    async def call() -> httpx.Response:
        if not call_first:
            await asyncio.sleep(gap)
        return await http.post("/v1/chat/completions", json=CHAT, headers=_auth(s["token"]))

    async def finish() -> httpx.Response:
        if call_first:
            await asyncio.sleep(gap)
        return await http.post("/lightning/v1/finish", json={"status": "succeeded"}, headers=_auth(s["token"]))

    rc, rf = await asyncio.gather(call(), finish())
    assert rf.status_code == 200, rf.text
    return rc.status_code, rf.json(), s["rollout_id"]


async def test_first_call_and_finish_race_never_records_after_finish(tmp_path: Path) -> None:
    """200 tries of a session's first call and its finish sent 0-2 ms apart (either order): the call is either
    answered 200 and counted by finish (committed before finish answered), or refused with 409 and not recorded."""
    mock = MockOpenAI()
    store = SQLiteStore(tmp_path / "race.db")
    rng = random.Random(7)
    outcomes = {200: 0, 409: 0}
    async with serve_async(mock.app) as upstream:
        backend = PassthroughBackend(upstream.url + "/v1", backoff_s=0.01)
        app = proxy_app(store, policy_backend=backend)
        async with serve_async(app) as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            results = [await _race_once(http, rng) for _ in range(200)]
            for status, fin, rollout_id in results:
                detail = await store.get_rollout(rollout_id)
                (attempt,) = detail.attempts
                assert attempt.attempt.status is AttemptStatus.SUCCEEDED
                assert status in (200, 409), status
                outcomes[status] += 1
                if status == 200:
                    assert fin["calls"] == 1 and len(attempt.calls) == 1
                    (c,) = attempt.calls
                    assert c.error is None and c.ended_at is not None
                    assert attempt.attempt.ended_at is not None and c.ended_at <= attempt.attempt.ended_at
                else:
                    assert fin["calls"] == 0 and attempt.calls == []
    await store.close()
    assert outcomes[200] + outcomes[409] == 200
    assert outcomes[200] > 0 and outcomes[409] > 0  # both sides of the race were exercised


async def test_finish_waits_for_a_long_call_then_aborts_it_and_says_so(tmp_path: Path) -> None:
    """A call still running when finish's wait (the call timeout) runs out is aborted upstream and recorded as
    failed with ``ABORTED``; finish's answer says how long it waited and how many calls it aborted."""
    mock = MockOpenAI(delay_s=30.0)
    store = SQLiteStore(tmp_path / "long.db")
    async with serve_async(mock.app) as upstream:
        backend = PassthroughBackend(upstream.url + "/v1")
        config = ProxyConfig(finish_timeout_s=0.5)
        app = proxy_app(store, policy_backend=backend, config=config)
        async with serve_async(app) as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            s = (await http.post("/lightning/v1/sessions", json={}, headers=ADMIN)).json()
            call = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT, headers=_auth(s["token"])))
            await until_async(lambda: mock.n_requests > 0, what="the call at the upstream")
            fin = await http.post("/lightning/v1/finish", json={"status": "succeeded"}, headers=_auth(s["token"]))
            rc = await call
            assert fin.status_code == 200
            answer = fin.json()
            assert answer["inflight"]["aborted"] == 1 and answer["inflight"]["waited_s"] >= 0.5
            assert answer["calls"] == 1 and answer["calls_failed"] == 1 and answer["status"] == "succeeded"
            assert rc.status_code == 409 and rc.headers["x-should-retry"] == "false"
            assert rc.json()["error"]["code"] == "attempt_finished"
            # the upstream saw the proxy close the request (generation aborted)
            await until_async(lambda: mock.cancelled >= 1, timeout=2, what="the upstream to see the abort")
            assert mock.cancelled == 1
            (attempt,) = (await store.get_rollout(s["rollout_id"])).attempts
            (c,) = attempt.calls
            assert c.error == ABORTED and c.completion_ids == [] and c.checks["http_status"] == 409
    await store.close()


async def test_finish_waits_for_a_call_that_ends_within_the_timeout(tmp_path: Path) -> None:
    mock = MockOpenAI(delay_s=0.6)
    store = SQLiteStore(tmp_path / "wait.db")
    async with serve_async(mock.app) as upstream:
        app = proxy_app(store, upstream.url + "/v1")
        async with serve_async(app) as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            s = (await http.post("/lightning/v1/sessions", json={}, headers=ADMIN)).json()
            call = asyncio.create_task(http.post("/v1/chat/completions", json=CHAT, headers=_auth(s["token"])))
            await until_async(lambda: mock.n_requests > 0, what="the call at the upstream")
            fin = await http.post("/lightning/v1/finish", json={"status": "succeeded"}, headers=_auth(s["token"]))
            assert (await call).status_code == 200
            answer = fin.json()
            assert answer["inflight"]["aborted"] == 0 and answer["inflight"]["waited_s"] >= 0.3
            assert answer["calls"] == 1 and answer["calls_failed"] == 0
            (attempt,) = (await store.get_rollout(s["rollout_id"])).attempts
            assert [c.error for c in attempt.calls] == [None]
    await store.close()


class _Gate:
    """An ASGI wrapper that holds every call (POST) at the upstream until ``gate`` is set (a call kept in flight);
    the proxy's readiness probes (``GET /models``) pass, or the proxy would wait for an upstream that never answers."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.gate = asyncio.Event()
        self.held = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not self.gate.is_set():
            self.held += 1
            await self.gate.wait()
        await self.app(scope, receive, send)


@pytest.mark.slow  # ~15 s on an idle 2-core machine, ~55 s under load: 5,060 HTTP requests
async def test_more_than_5000_running_attempts_keep_in_flight_state_and_unique_seqs() -> None:
    """5,100 running attempts (over the 4,096-entry token cache): 40 of them have a call held in flight at the
    upstream while the other 5,060 are resolved (a reward each, over HTTP). No attempt loses its in-flight count
    or call counter: a second call gets a new ``seq`` and every finish waits for both calls."""
    upstream_app = _Gate(MockOpenAI().app)
    store = MemoryStore()
    n, k = 5100, 40
    async with serve_async(upstream_app) as upstream:
        app = proxy_app(store, upstream.url + "/v1")
        proxy = app.state.proxy
        claims = [await store.open_session({"i": i}) for i in range(n)]
        tokens = [c.attempt.token for c in claims]
        async with serve_async(app) as srv:
            limits = httpx.Limits(max_connections=2 * k)
            async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
                sem = asyncio.Semaphore(16)

                async def call(token: str) -> int:
                    r = await http.post("/v1/chat/completions", json=CHAT, headers=_auth(token))
                    return r.status_code

                async def reward(token: str) -> int:
                    async with sem:
                        r = await http.post("/lightning/v1/reward", json={"value": 1.0}, headers=_auth(token))
                        return r.status_code

                held = [asyncio.create_task(call(t)) for t in tokens[:k]]
                await until_async(lambda: upstream_app.held >= k, what=f"{k} calls held upstream")
                assert all(s == 200 for s in await asyncio.gather(*(reward(t) for t in tokens[k:])))
                assert len(proxy.attempts) >= proxy.attempts.max_entries
                for t in tokens[:k]:  # never evicted: still counted in flight
                    assert (await proxy.attempts.resolve(t)).inflight == 1
                second = [asyncio.create_task(call(t)) for t in tokens[:k]]
                await until_async(lambda: upstream_app.held >= 2 * k, what=f"{2 * k} calls held upstream")
                # the finishes get connections of their own (the calls hold all of ``http``'s)
                finisher = httpx.AsyncClient(base_url=srv.url, timeout=120)
                fins = [
                    asyncio.create_task(
                        finisher.post("/lightning/v1/finish", json={"status": "succeeded"}, headers=_auth(t))
                    )
                    for t in tokens[:k]
                ]
                states = [proxy.attempts.state_of(c.attempt.attempt_id) for c in claims[:k]]
                await until_async(lambda: all(st is not None and st.closing for st in states), what="finishing")
                assert not any(f.done() for f in fins)  # every finish began and waits for the calls in flight
                upstream_app.gate.set()
                assert all(s == 200 for s in await asyncio.gather(*held, *second))
                assert [(await f).json()["calls"] for f in fins] == [2] * k
                await finisher.aclose()
    for claim in claims[:k]:
        (attempt,) = (await store.get_rollout(claim.rollout.rollout_id)).attempts
        assert sorted(c.seq for c in attempt.calls) == [0, 1]
        assert attempt.attempt.status is AttemptStatus.SUCCEEDED


def test_store_side_finish_closes_the_token_at_once(px: ProxyHandle) -> None:
    """An admin finish through the store routes (``/lightning/v1/store/attempts/{id}/finish``) answers after the
    attempt's calls are committed and the very next call with its token gets 409 (no 200s after it)."""
    s = px.session()
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    r = px.http.post(
        f"/lightning/v1/store/attempts/{s['attempt_id']}/finish", json={"status": "succeeded"}, headers=px.admin
    )
    assert r.status_code == 200 and r.json()["attempt"]["status"] == "succeeded"
    for _ in range(3):
        late = px.http.post("/v1/chat/completions", json=CHAT, headers=_auth(s["token"]))
        assert late.status_code == 409 and late.headers["x-should-retry"] == "false"
    assert len(px.calls(s["rollout_id"])) == 1


def test_the_openai_client_does_not_retry_a_409(px: ProxyHandle, upstream: RunningServer, mock: MockOpenAI) -> None:
    """``x-should-retry: false`` on 409: the OpenAI SDK (which retries 409 by default) sends a late call once."""
    s = px.session()
    assert px.finish(s["token"]).status_code == 200
    before = mock.n_requests
    client = openai.OpenAI(base_url=px.url + "/v1", api_key=s["token"], max_retries=3)
    seen: list[int] = []
    client._client.event_hooks["response"].append(lambda r: seen.append(r.status_code))
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert seen == [409] and mock.n_requests == before


class _RefusingStore(MemoryStore):
    """A MemoryStore whose call writes fail (a stand-in for a store that refuses a row: a real SQLite store does
    not refuse well-formed calls, so the failure is injected here)."""

    async def record_calls(self, calls: list[Any]) -> None:
        from lightning_sdk.errors import StoreError

        raise StoreError("disk says no")


async def test_a_call_that_could_not_be_recorded_never_lets_the_attempt_succeed_silently() -> None:
    mock = MockOpenAI()
    store = _RefusingStore()
    async with serve_async(mock.app) as upstream:
        app = proxy_app(store, upstream.url + "/v1")
        async with serve_async(app) as srv, httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            s = (await http.post("/lightning/v1/sessions", json={}, headers=ADMIN)).json()
            r = await http.post("/v1/chat/completions", json=CHAT, headers=_auth(s["token"]))
            assert r.status_code == 200
            fin = await http.post("/lightning/v1/finish", json={"status": "succeeded"}, headers=_auth(s["token"]))
    answer = fin.json()
    assert fin.status_code == 200 and answer["status"] == "failed"
    assert answer["calls"] == 0 and answer["calls_not_recorded"] == 1 and "disk says no" in answer["error"]
    (attempt,) = (await store.get_rollout(s["rollout_id"])).attempts
    assert attempt.attempt.status is AttemptStatus.FAILED and "could not be recorded" in (attempt.attempt.error or "")
