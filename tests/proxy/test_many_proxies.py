"""Many proxies, one store: two real ``lightning-sdk proxy`` processes on one PostgreSQL database (the session's real
server, tests/conftest.py) in front of one loopback mock upstream serve the same attempts.

- an attempt's calls alternate between the two proxies: one numbering, every call recorded once with its exact ids,
  and the finish (on either proxy) counts the calls both recorded;
- a finish on one proxy raced against a call on the other, 200 times: a call is answered 200 only if it landed
  before the finish (and the finish counted it), else 409, and nothing lands after a finish;
- one proxy SIGKILLed under load while the agents (``LLM(fallback_urls=...)``) fail over to the other: no answered
  call lost, none recorded twice, every recorded call's ids and answer exactly what the agent got;
- a call committed by a proxy SIGKILLed before it answered (the window held open with a synchronous-standby wait)
  and re-sent by the agent with the same ``Idempotency-Key``: one record;
- a stream cut by a proxy SIGKILLed mid-stream: no record of it, the agent's call made again recorded once;
- a stream is committed before its end: while its commit waits the agent has every content chunk but not the end,
  and a proxy SIGKILLed in that wait leaves the agent a failed stream (never a whole answer with no record).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightning_sdk.agent import LLM
from lightning_sdk.store.postgres import PostgresStore
from lightning_sdk.types import AttemptStatus, RolloutDetail
from tests.support.mock_openai import MockOpenAI
from tests.support.postgres import PostgresServer
from tests.support.servers import free_port, run_server
from tests.support.waiting import answers, until, until_async

ROOT = Path(__file__).resolve().parents[2]
KEY = "many-proxies-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}


class ProxyProcess:
    def __init__(self, upstream: str, store_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--upstream", upstream, "--store", store_url, "--port", str(self.port), "--admin-key", KEY]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_sdk", "proxy", *args, "--retries", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            cwd=ROOT,
        )

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            assert self.proc.poll() is None, "the proxy exited early"
            return answers(self.url + "/lightning/v1/health")

        until(healthy, timeout=90, what=f"the proxy on {self.url} to become healthy", every=0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def mock() -> MockOpenAI:
    return MockOpenAI(record_requests=False)


@pytest.fixture(scope="module")
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """One database for the module's two proxies (started once: ~10 s each on a loaded machine)."""
    url = postgres_server.create_db("lsdk_many_proxies")
    try:
        yield url
    finally:
        postgres_server.drop_db("lsdk_many_proxies")


@pytest.fixture(scope="module")
def proxies(mock: MockOpenAI, postgres_url: str) -> Iterator[tuple[ProxyProcess, ProxyProcess]]:
    """Two proxy processes on one store; the SIGKILL test, last in this file, kills the first."""
    with run_server(mock.app) as upstream:
        a, b = ProxyProcess(upstream.url + "/v1", postgres_url), ProxyProcess(upstream.url + "/v1", postgres_url)
        try:
            a.wait_healthy()
            b.wait_healthy()
            yield a, b
        finally:
            a.stop()
            b.stop()


def _read(url: str, rollout_id: str) -> RolloutDetail:
    async def read() -> RolloutDetail:
        store = PostgresStore(url, listen=False)
        try:
            return await store.get_rollout(rollout_id)
        finally:
            await store.close()

    return asyncio.run(read())


def _messages(i: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"question number {i}: what is {i} + {i}?"}]


def test_an_attempts_calls_alternate_between_two_proxies(
    proxies: tuple[ProxyProcess, ProxyProcess], mock: MockOpenAI, postgres_url: str
) -> None:
    a, b = proxies
    before = [_recorded(p) for p in (a, b)]
    s = httpx.post(a.url + "/lightning/v1/sessions", json={"task": {"q": 1}}, headers=ADMIN).json()
    auth = {"Authorization": f"Bearer {s['token']}"}
    ids = []
    for i in range(10):
        proxy = (a, b)[i % 2]
        r = httpx.post(
            proxy.url + "/v1/chat/completions", json={"model": "policy", "messages": _messages(i)}, headers=auth
        )
        assert r.status_code == 200, r.text
        ids.append(r.headers["x-lightning-call-id"])
    done = httpx.post(b.url + "/lightning/v1/finish", json={"status": "succeeded"}, headers=auth).json()
    assert done["status"] == "succeeded" and done["calls"] == 10  # b counts the calls a recorded too
    calls = _read(postgres_url, s["rollout_id"]).attempts[0].calls
    assert [c.call_id for c in calls] == ids and [c.seq for c in calls] == list(range(10))
    for i, c in enumerate(calls):
        prompt, completion, logprobs, _ = mock.expected_ids(_messages(i), mock.reply_for({"messages": _messages(i)}))
        assert (c.prompt_ids, c.completion_ids, c.logprobs) == (prompt, completion, logprobs)
    late = httpx.post(a.url + "/v1/chat/completions", json={"model": "policy", "messages": _messages(0)}, headers=auth)
    assert late.status_code == 409  # a finished on b: a may still trust its cache, the store refuses the call
    # each proxy's /metrics counts the calls it committed (the refused one is neither recorded nor a store error)
    after = [_recorded(p) for p in (a, b)]
    assert [(x[0] - y[0], x[1] - y[1]) for x, y in zip(after, before, strict=True)] == [(5, 0), (5, 0)]


def _recorded(proxy: ProxyProcess) -> tuple[float, float]:
    """``(lightning_sdk_recorded_total{kind="call"}, lightning_sdk_store_errors_total)`` scraped from ``proxy``."""
    text = httpx.get(proxy.url + "/metrics").text
    recorded = errors = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "lightning_sdk_recorded_total" and sample.labels.get("kind") == "call":
                recorded += sample.value
            elif sample.name == "lightning_sdk_store_errors_total":
                errors += sample.value
    return recorded, errors


def test_finish_raced_against_calls_on_the_other_proxy(
    proxies: tuple[ProxyProcess, ProxyProcess], postgres_url: str
) -> None:
    a, b = proxies
    tries = 200

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, int, int]:
        s = (await client.post(a.url + "/lightning/v1/sessions", json={"task": {"i": i}}, headers=ADMIN)).json()
        auth = {"Authorization": f"Bearer {s['token']}"}
        warm = await client.post(b.url + "/v1/chat/completions", json={"model": "policy", "messages": _messages(i)},
                                 headers=auth)  # fmt: skip
        assert warm.status_code == 200  # b now trusts the token for its TTL
        call = client.post(b.url + "/v1/chat/completions", json={"model": "policy", "messages": _messages(i + 1)},
                           headers=auth)  # fmt: skip
        finish = client.post(a.url + "/lightning/v1/finish", json={"status": "succeeded"}, headers=auth)
        answered, done = await asyncio.gather(call, finish)
        assert answered.status_code in (200, 409), answered.text
        assert done.status_code == 200, done.text
        return s["rollout_id"], 1 + (answered.status_code == 200), done.json()["calls"]

    async def run() -> list[tuple[str, int, int]]:
        gate = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=60) as client:

            async def bounded(i: int) -> tuple[str, int, int]:
                async with gate:
                    return await one(client, i)

            return await asyncio.gather(*(bounded(i) for i in range(tries)))

    results = asyncio.run(run())
    with psycopg.connect(postgres_url) as conn:
        mine = [rid for rid, _, _ in results]
        stored = dict(
            conn.execute(
                "SELECT rollout_id, COUNT(*) FROM calls WHERE rollout_id = ANY(%s) GROUP BY rollout_id", (mine,)
            ).fetchall()
        )
    # per attempt: the calls in the store == the calls answered 200 == what its finish counted under the row lock
    # (a call landing after the finish would make the store hold more than the finish counted)
    wrong = [
        (rid, ok, counted, stored.get(rid, 0))
        for rid, ok, counted in results
        if not stored.get(rid, 0) == ok == counted
    ]
    assert wrong == []
    assert sum(n for _, n, _ in results) == sum(stored.values())
    late_ok = sum(1 for _, n, _ in results if n == 2)
    print(f"{tries} races: {late_ok} calls landed before their finish, {tries - late_ok} refused with 409")


def _backend_waiting(conn: psycopg.Connection[Any], db: str, *, reserving: bool) -> bool:
    """Whether a backend of ``db`` waits for a synchronous standby: at its ``reserve_seq`` (``reserving``) or at the
    commit of a call batch."""
    rows = conn.execute(
        "SELECT query FROM pg_stat_activity WHERE datname = %s AND wait_event = 'SyncRep'", (db,)
    ).fetchall()
    return any(str(q).startswith("UPDATE attempts SET next_seq") == reserving for (q,) in rows)


def _standby(conn: psycopg.Connection[Any], names: str) -> None:
    conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{names}'")  # type: ignore[arg-type]
    conn.execute("SELECT pg_reload_conf()")


def test_a_call_committed_by_a_proxy_killed_before_it_answered_is_recorded_once(
    mock: MockOpenAI, postgres_server: PostgresServer
) -> None:
    """The window "committed, not answered" held open for real: the test database commits with
    ``synchronous_commit = on`` and the server is told to wait for a standby that does not exist, so proxy A's
    commit of the call is written but waits (``SyncRep`` in ``pg_stat_activity``); A is SIGKILLed there, the agent's
    client fails over to B with the same ``Idempotency-Key``, and the wait is lifted: A's transaction commits, B's
    call lands on the same id. One record (not two), with the first's ``seq``, the answer the agent got, and B's
    finish counting it once. On the code before the key this stored the call twice."""
    db = "lsdk_resent_call"
    url = postgres_server.create_db(db)
    admin = psycopg.connect(postgres_server.url(), autocommit=True)
    mock.delay_s = 3.0  # the engine's answer comes well after the test closed the window again
    try:
        postgres_server.sql(f'ALTER DATABASE "{db}" SET synchronous_commit = on')
        with run_server(mock.app) as upstream:
            a, b = ProxyProcess(upstream.url + "/v1", url), ProxyProcess(upstream.url + "/v1", url)
            try:
                a.wait_healthy()
                b.wait_healthy()
                s = httpx.post(a.url + "/lightning/v1/sessions", json={"task": {"q": 1}}, headers=ADMIN).json()
                auth = {"Authorization": f"Bearer {s['token']}"}
                for proxy in (a, b):  # both trust the token now; seq 0 and 1
                    r = httpx.post(proxy.url + "/v1/chat/completions", headers=auth, timeout=30,
                                   json={"model": "policy", "messages": _messages(0)})  # fmt: skip
                    assert r.status_code == 200, r.text
                got: dict[str, Any] = {}

                async def agent() -> None:
                    llm = LLM(base_url=a.url + "/v1", api_key=s["token"], fallback_urls=(b.url + "/v1",))
                    client = llm.async_openai_client(max_retries=0, timeout=60)
                    try:
                        raw = await client.chat.completions.with_raw_response.create(
                            model="policy", messages=_messages(7)
                        )  # type: ignore[arg-type]
                        got["call_id"] = raw.headers["x-lightning-call-id"]
                        got["content"] = raw.parse().choices[0].message.content
                    finally:
                        await client.close()

                async def run() -> None:
                    task = asyncio.create_task(agent())
                    _standby(admin, "nobody")

                    async def until_waiting(reserving: bool, waiting: bool = True) -> None:
                        def seen() -> bool:
                            assert not task.done(), f"standby wait never {waiting}"
                            return _backend_waiting(admin, db, reserving=reserving) == waiting

                        await until_async(seen, timeout=60, what=f"the standby wait {waiting}", every=0.01)

                    await until_waiting(True)  # A's reserve_seq: let it through, then hold A's commit
                    _standby(admin, "")
                    await until_waiting(True, waiting=False)  # released (two reloads at once may read as one)
                    _standby(admin, "nobody")
                    await until_waiting(False)
                    a.proc.send_signal(signal.SIGKILL)
                    assert a.proc.wait(timeout=30) == -signal.SIGKILL
                    _standby(admin, "")  # A's commit goes through; B's reserve_seq (held by A's row lock) goes on
                    await asyncio.wait_for(task, 120)

                asyncio.run(run())
                done = httpx.post(b.url + "/lightning/v1/finish", json={"status": "succeeded"}, headers=auth).json()
                calls = _read(url, s["rollout_id"]).attempts[0].calls
                assert [c.seq for c in calls] == [0, 1, 2]  # one record, in the first's place (B numbered it 3)
                again = calls[2]
                assert again.call_id == got["call_id"] and again.idempotency_key is not None
                assert again.response["choices"][0]["message"]["content"] == got["content"]
                prompt, completion, logprobs, _ = mock.expected_ids(
                    _messages(7), mock.reply_for({"messages": _messages(7)})
                )
                assert (again.prompt_ids, again.completion_ids, again.logprobs) == (prompt, completion, logprobs)
                assert done["calls"] == 3
            finally:
                a.stop()
                b.stop()
    finally:
        mock.delay_s = 0.0
        _standby(admin, "")
        admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
        admin.execute("SELECT pg_reload_conf()")
        admin.close()
        postgres_server.drop_db(db)


def test_a_stream_cut_by_a_proxy_killed_mid_stream_is_not_recorded_and_its_retry_is_once(
    mock: MockOpenAI, postgres_server: PostgresServer
) -> None:
    """A streamed call is committed after its last content chunk (proxy/_shared.py): proxy A SIGKILLed mid-stream
    leaves no record of it at all (nothing half-recorded can be trained), the agent's stream fails, and the call it
    makes again (failing over to B) is the one it used: recorded once, whole, with exactly the text the agent read;
    B's finish counts one call."""
    db = "lsdk_cut_stream"
    url = postgres_server.create_db(db)
    mock.chunk_delay_s, mock.chunk_tokens = 0.2, 1  # ~one token a chunk, slow enough to be killed in the middle
    messages = _messages(3)
    try:
        with run_server(mock.app) as upstream:
            a, b = ProxyProcess(upstream.url + "/v1", url), ProxyProcess(upstream.url + "/v1", url)
            try:
                a.wait_healthy()
                b.wait_healthy()
                s = httpx.post(a.url + "/lightning/v1/sessions", json={"task": {"q": 1}}, headers=ADMIN).json()
                llm = LLM(base_url=a.url + "/v1", api_key=s["token"], fallback_urls=(b.url + "/v1",))

                async def agent() -> tuple[str, str, str]:
                    client = llm.async_openai_client(max_retries=0, timeout=60)
                    try:
                        first = await client.chat.completions.create(model="policy", messages=messages, stream=True)  # type: ignore[arg-type]
                        got, cut = "", ""
                        try:
                            async for chunk in first:
                                got += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                                if len(got) >= 2 and a.proc.poll() is None:
                                    a.proc.send_signal(signal.SIGKILL)  # mid-stream, the next chunks never come
                        except Exception as exc:  # the cut stream: the agent makes the call again
                            cut = type(exc).__name__
                        again = await client.chat.completions.with_raw_response.create(
                            model="policy",
                            messages=messages,  # type: ignore[arg-type]
                            stream=True,
                        )
                        text = ""
                        async for chunk in again.parse():
                            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                        return cut, text, again.headers["x-lightning-call-id"]
                    finally:
                        await client.close()

                cut, text, call_id = asyncio.run(agent())
                assert cut and a.proc.wait(timeout=30) == -signal.SIGKILL
                done = httpx.post(b.url + "/lightning/v1/finish", json={"status": "succeeded"},
                                  headers={"Authorization": f"Bearer {s['token']}"}).json()  # fmt: skip
                calls = _read(url, s["rollout_id"]).attempts[0].calls
                assert [c.call_id for c in calls] == [call_id] and done["calls"] == 1
                c = calls[0]
                reply = mock.reply_for({"messages": messages})
                prompt, completion, logprobs, _ = mock.expected_ids(messages, reply)
                assert (c.prompt_ids, c.completion_ids, c.logprobs) == (prompt, completion, logprobs)
                assert c.error is None and c.response["choices"][0]["message"]["content"] == text
            finally:
                a.stop()
                b.stop()
    finally:
        mock.chunk_delay_s, mock.chunk_tokens = 0.0, MockOpenAI().chunk_tokens
        postgres_server.drop_db(db)


def test_a_stream_ends_only_once_its_call_is_committed(mock: MockOpenAI, postgres_server: PostgresServer) -> None:
    """A shared store commits a streamed call after its last content chunk and before the event that ends the
    stream (proxy/_shared.py), held open for real with a synchronous-standby wait at the commit: the agent has read
    every content chunk (the whole text) but its stream has not ended while the commit waits; released, the stream
    ends and the call is in the store with exactly the text read. Then the same wait with proxy A SIGKILLed in it:
    the agent's stream fails (it never holds a whole answer whose call is not recorded), and the call A committed is
    there whole. On the code before (the final event sent, then the commit) the first stream ended during the wait."""
    db = "lsdk_stream_commit"
    url = postgres_server.create_db(db)
    admin = psycopg.connect(postgres_server.url(), autocommit=True)
    mock.chunk_delay_s, mock.chunk_tokens = 0.1, 1  # the content streams for a second or so: time to hold the commit
    try:
        postgres_server.sql(f'ALTER DATABASE "{db}" SET synchronous_commit = on')
        with run_server(mock.app) as upstream:
            a = ProxyProcess(upstream.url + "/v1", url)
            try:
                a.wait_healthy()
                s = httpx.post(a.url + "/lightning/v1/sessions", json={"task": {"q": 1}}, headers=ADMIN).json()
                llm = LLM(base_url=a.url + "/v1", api_key=s["token"])
                read: dict[int, list[str]] = {}
                ended: dict[int, str] = {}

                async def agent(i: int) -> None:
                    client = llm.async_openai_client(max_retries=0, timeout=60)
                    read[i] = []
                    try:
                        stream = await client.chat.completions.create(
                            model="policy", messages=_messages(i), stream=True
                        )  # type: ignore[arg-type]
                        async for chunk in stream:
                            read[i].append((chunk.choices[0].delta.content or "") if chunk.choices else "")
                        ended[i] = "ended"
                    except Exception as exc:  # the cut stream
                        ended[i] = type(exc).__name__
                    finally:
                        await client.close()

                async def hold_commit(task: asyncio.Task[None]) -> None:
                    async def until_waiting(reserving: bool, waiting: bool = True) -> None:
                        def seen() -> bool:
                            assert not task.done(), f"the stream ended before the standby wait was {waiting}"
                            return _backend_waiting(admin, db, reserving=reserving) == waiting

                        await until_async(seen, timeout=60, what=f"the standby wait {waiting}", every=0.01)

                    _standby(admin, "nobody")
                    await until_waiting(True)  # the call's reserve_seq: let it through, then hold its commit
                    _standby(admin, "")
                    await until_waiting(True, waiting=False)
                    _standby(admin, "nobody")
                    await until_waiting(False)

                def whole(i: int) -> str:
                    return mock.reply_for({"messages": _messages(i)}).text

                async def run() -> None:
                    task = asyncio.create_task(agent(1))
                    await hold_commit(task)
                    # the commit waits: every content chunk has arrived, the stream has not ended
                    await until_async(lambda: "".join(read[1]) == whole(1), timeout=30, what="the whole text")
                    assert not task.done() and 1 not in ended
                    _standby(admin, "")
                    await asyncio.wait_for(task, 60)
                    assert ended[1] == "ended"
                    # the same wait, and the proxy dies in it
                    task = asyncio.create_task(agent(2))
                    await hold_commit(task)
                    await until_async(lambda: "".join(read[2]) == whole(2), timeout=30, what="the whole text")
                    a.proc.send_signal(signal.SIGKILL)
                    assert a.proc.wait(timeout=30) == -signal.SIGKILL
                    _standby(admin, "")
                    await asyncio.wait_for(task, 60)
                    assert ended[2] not in ("ended", None), "a stream whose proxy died before its end ended normally"

                asyncio.run(run())
                calls = _read(url, s["rollout_id"]).attempts[0].calls
                assert [c.seq for c in calls] == [0, 1]
                for c, i in zip(calls, (1, 2), strict=True):
                    prompt, completion, logprobs, _ = mock.expected_ids(
                        _messages(i), mock.reply_for({"messages": _messages(i)})
                    )
                    assert (c.prompt_ids, c.completion_ids, c.logprobs) == (prompt, completion, logprobs)
                    assert c.error is None and c.response["choices"][0]["message"]["content"] == whole(i)
            finally:
                a.stop()
    finally:
        mock.chunk_delay_s, mock.chunk_tokens = 0.0, MockOpenAI().chunk_tokens
        _standby(admin, "")
        admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
        admin.execute("SELECT pg_reload_conf()")
        admin.close()
        postgres_server.drop_db(db)


def test_a_proxy_killed_under_load_loses_no_answered_call(
    proxies: tuple[ProxyProcess, ProxyProcess], mock: MockOpenAI, postgres_url: str
) -> None:
    a, b = proxies
    mock.delay_s = 0.01  # calls are in flight when the proxy dies
    n_agents, n_calls = 8, 12
    answered: dict[str, list[tuple[str, str, int]]] = {}  # rollout -> (call id, content, message index)
    killed = asyncio.Event()

    async def agent(i: int, client_http: httpx.AsyncClient) -> None:
        s = (await client_http.post(a.url + "/lightning/v1/sessions", json={"task": {"i": i}}, headers=ADMIN)).json()
        llm = LLM(base_url=a.url + "/v1", api_key=s["token"], fallback_urls=(b.url + "/v1",))
        client = llm.async_openai_client(max_retries=0, timeout=30)
        mine = answered.setdefault(s["rollout_id"], [])
        try:
            for k in range(n_calls):
                m = i * 100 + k
                raw = await client.chat.completions.with_raw_response.create(model="policy", messages=_messages(m))  # type: ignore[arg-type]
                reply = raw.parse()
                mine.append((raw.headers["x-lightning-call-id"], reply.choices[0].message.content or "", m))
                if sum(len(v) for v in answered.values()) >= n_agents * 3 and not killed.is_set():
                    killed.set()
                    a.proc.send_signal(signal.SIGKILL)
        finally:
            await client.close()
        done = await client_http.post(b.url + "/lightning/v1/finish", json={"status": "succeeded"},
                                      headers={"Authorization": f"Bearer {s['token']}"})  # fmt: skip
        assert done.status_code == 200 and done.json()["calls"] >= len(mine), done.text

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client_http:
            await asyncio.gather(*(agent(i, client_http) for i in range(n_agents)))

    asyncio.run(run())
    assert killed.is_set() and a.proc.wait(timeout=30) == -signal.SIGKILL
    for rollout_id, mine in answered.items():
        detail = _read(postgres_url, rollout_id)
        assert detail.attempts[0].attempt.status is AttemptStatus.SUCCEEDED
        calls = {c.call_id: c for c in detail.attempts[0].calls}
        assert len(mine) == n_calls
        assert len({cid for cid, _, _ in mine}) == n_calls  # no answer given twice
        for call_id, content, m in mine:  # 0 lost, ids and answer intact
            c = calls[call_id]
            prompt, completion, logprobs, _ = mock.expected_ids(
                _messages(m), mock.reply_for({"messages": _messages(m)})
            )
            assert (c.prompt_ids, c.completion_ids, c.logprobs) == (prompt, completion, logprobs)
            assert c.response["choices"][0]["message"]["content"] == content
        assert len({c.seq for c in calls.values()}) == len(calls)  # one numbering across both proxies
        # 0 twice: a call the killed proxy committed but never answered was re-sent with its Idempotency-Key and
        # its record replaced (the deterministic case: test_a_call_committed_by_a_proxy_killed_before_...)
        assert sorted(calls) == sorted(cid for cid, _, _ in mine)
        assert all(c.idempotency_key is not None for c in calls.values())
    print(f"killed one proxy under load: {n_agents * n_calls} answered calls recorded once each")
