"""The store over HTTP: auth, the error shape and codes, and HTTPStore's retry rules, against real loopback servers."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from lightning_sdk.errors import ConfigError, InvalidTransitionError, NotFoundError, StoreError, StoreUnavailableError
from lightning_sdk.store import HTTPStore, ManualClock, MemoryStore, SQLiteStore, open_store, reap_leases, run_sync
from lightning_sdk.types import AttemptStatus, RolloutDetail
from tests.support.waiting import until_async

from .conftest import ADMIN_KEY, ServerThread, free_socket


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = SQLiteStore(tmp_path / "s.db")
    server = ServerThread(store).start()
    yield server, store
    server.stop()
    asyncio.run(store.close())


async def test_every_route_needs_the_admin_key(served: tuple[ServerThread, SQLiteStore]) -> None:
    server, _ = served
    async with httpx.AsyncClient(base_url=server.url) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": ADMIN_KEY}):
            resp = await client.get("/counts", headers=headers)
            assert resp.status_code == 401
            err = resp.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"  # one table
            assert resp.headers["x-should-retry"] == "false"
            assert "admin key" in err["message"]
            resp = await client.post("/enqueue", json={"tasks": [{"q": 1}]}, headers=headers)
            assert resp.status_code == 401
        resp = await client.get("/counts", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert resp.status_code == 200 and resp.json()["counts"]["queued"] == 0


async def test_error_codes_and_shape(served: tuple[ServerThread, SQLiteStore]) -> None:
    server, _ = served
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(base_url=server.url, headers=auth) as client:
        resp = await client.post("/claim", json={"lease_s": 5})
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert "worker_id" in resp.json()["error"]["message"]
        resp = await client.post("/enqueue", json={"tasks": [{"q": 1}], "n": "many"})
        assert resp.status_code == 400 and "'n'" in resp.json()["error"]["message"]
        resp = await client.post("/enqueue", content=b"{not json")
        assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
        resp = await client.get("/rollouts", params={"status": "sleeping"})
        assert resp.status_code == 400 and "status" in resp.json()["error"]["message"]
        resp = await client.get("/rollouts", params={"limit": "ten"})
        assert resp.status_code == 400 and "limit" in resp.json()["error"]["message"]
        resp = await client.get("/rollouts/ro-nope")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
        resp = await client.post("/enqueue", json={"tasks": [{"q": 1}]})
        assert resp.status_code == 200
        claim = (await client.post("/claim", json={"worker_id": "w"})).json()["claim"]
        aid = claim["attempt"]["attempt_id"]
        assert (await client.post(f"/attempts/{aid}/finish", json={"status": "succeeded"})).status_code == 200
        resp = await client.post(f"/attempts/{aid}/finish", json={"status": "failed"})
        assert resp.status_code == 409
        assert resp.json()["error"] == {
            "message": resp.json()["error"]["message"],
            "type": "conflict_error",
            "param": None,
            "code": "invalid_transition",
        }
        assert resp.headers["x-should-retry"] == "false"
        assert "succeeded" in resp.json()["error"]["message"]
        detail = RolloutDetail.model_validate(
            (await client.get(f"/rollouts/{claim['rollout']['rollout_id']}")).json()["detail"]
        )
        assert detail.rollout.status.value == "succeeded"


class _CountingStore(MemoryStore):
    """A MemoryStore that counts calls and fails the first ``failures`` counts() with an unexpected error."""

    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.failures = failures

    async def get_rollout(self, rollout_id: str) -> RolloutDetail:
        self.calls["get_rollout"] = self.calls.get("get_rollout", 0) + 1
        return await super().get_rollout(rollout_id)

    async def counts(self) -> dict[str, int]:
        self.calls["counts"] = self.calls.get("counts", 0) + 1
        if self.calls["counts"] <= self.failures:
            raise RuntimeError("disk hiccup")
        return await super().counts()


async def test_4xx_is_not_retried_and_5xx_is() -> None:
    backing = _CountingStore(failures=2)
    server = ServerThread(backing).start()
    client = HTTPStore(server.url, ADMIN_KEY, retries=4, backoff_s=0.01)
    try:
        with pytest.raises(NotFoundError):
            await client.get_rollout("ro-missing")
        assert backing.calls["get_rollout"] == 1
        counts = await client.counts()  # two 500s, then an answer
        assert counts["queued"] == 0 and backing.calls["counts"] == 3
        backing.failures = 100
        with pytest.raises(StoreError, match="disk hiccup"):
            await client.counts()
        assert backing.calls["counts"] == 3 + 5
        wrong = HTTPStore(server.url, "not-the-key", retries=4, backoff_s=0.01)
        with pytest.raises(Exception, match="admin key") as info:
            await wrong.counts()
        assert type(info.value).__name__ == "AuthError"
        await wrong.close()
    finally:
        await client.close()
        server.stop()


async def test_client_waits_for_a_server_that_comes_up_late(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The client retries a refused connection until the server listens: the server starts only after the client
    was refused twice (its retry log), whatever the machine's speed."""
    sock = free_socket()  # bound, not listening yet: connections are refused
    backing = SQLiteStore(tmp_path / "late.db")
    client = HTTPStore(f"http://127.0.0.1:{sock.getsockname()[1]}/lightning/v1/store", ADMIN_KEY, retries=8,
                       backoff_s=0.05)  # fmt: skip
    server = ServerThread(backing, sock)
    caplog.set_level(logging.INFO, logger="lightning_sdk._retry")

    def refused() -> int:
        return sum("store POST /enqueue" in r.getMessage() and "retry" in r.getMessage() for r in caplog.records)

    try:
        pending = asyncio.create_task(client.enqueue([{"q": "late"}], group_ids=["g-late"]))
        await until_async(lambda: refused() >= 2 or pending.done(), what="two refused tries")
        assert not pending.done()  # still waiting for the server, not failed
        server.start()
        (group,) = await asyncio.wait_for(pending, timeout=20)
        assert group.group_id == "g-late"
        assert (await backing.counts())["queued"] == 1
    finally:
        await client.close()
        server.stop()
        await backing.close()


async def test_unreachable_server_raises_store_unavailable() -> None:
    sock = free_socket()
    client = HTTPStore(f"http://127.0.0.1:{sock.getsockname()[1]}", ADMIN_KEY, retries=2, backoff_s=0.01)
    try:
        with pytest.raises(StoreUnavailableError, match="unreachable"):
            await client.counts()
    finally:
        await client.close()
        sock.close()


async def test_lost_answers_are_retried_only_for_repeatable_operations() -> None:
    """A raw TCP server that reads each request and hangs up without answering (the answer is lost)."""
    connections = 0

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HTTPStore(f"http://127.0.0.1:{port}", ADMIN_KEY, retries=3, backoff_s=0.01)
    try:
        with pytest.raises(StoreUnavailableError):
            await client.claim("w")  # may have claimed on the server: never repeated blindly
        assert connections == 1
        with pytest.raises(StoreUnavailableError):
            await client.counts()
        assert connections == 1 + 4
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_open_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(open_store("memory"), MemoryStore)
    sqlite_store = open_store(tmp_path / "a.db")
    assert isinstance(sqlite_store, SQLiteStore) and (tmp_path / "a.db").exists()
    await sqlite_store.close()
    monkeypatch.delenv("LIGHTNING_SDK_ADMIN_KEY", raising=False)
    with pytest.raises(ConfigError, match="admin key"):
        open_store("http://127.0.0.1:1/lightning/v1/store")
    monkeypatch.setenv("LIGHTNING_SDK_ADMIN_KEY", "k")
    http_store = open_store("http://127.0.0.1:1/lightning/v1/store/")
    assert isinstance(http_store, HTTPStore) and http_store.base_url == "http://127.0.0.1:1/lightning/v1/store"
    await http_store.close()
    with pytest.raises(ConfigError):
        open_store("  ")


async def test_reap_leases_and_run_sync(tmp_path: Path) -> None:
    clock = ManualClock()
    store = SQLiteStore(tmp_path / "r.db", clock=clock)
    try:
        await store.enqueue([{"q": 1}], max_attempts=2)
        claim = await store.claim("w", lease_s=0.1)
        assert claim is not None
        reaper = asyncio.create_task(reap_leases(store, interval_s=0.05))

        async def timed_out() -> bool:
            return (await store.get_attempt(claim.attempt.attempt_id)).status is AttemptStatus.TIMED_OUT

        assert not await timed_out()
        clock.advance(0.2)  # the lease is over in store time: the reaper's next pass times the attempt out
        await until_async(timed_out, timeout=30, what="the reaper to time the attempt out")
        reaper.cancel()
        assert (await store.counts())["queued"] == 1
        assert run_sync(MemoryStore().counts())["queued"] == 0  # works inside a running loop (helper thread)
    finally:
        await store.close()

    async def five() -> int:
        return 5

    assert run_sync(five()) == 5


class _AnswerDropper:
    """A loopback TCP relay in front of a real store server that forwards the first request whose path contains
    ``drop`` and then hangs up instead of relaying the answer (the server did the work; the client never hears)."""

    def __init__(self, backend_port: int, drop: bytes) -> None:
        self.backend_port = backend_port
        self.drop = drop
        self.dropped = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return head + (await reader.readexactly(length) if length else b"")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        try:
            while True:
                try:
                    request = await self._read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                up_writer.write(request)
                await up_writer.drain()
                head = await up_reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")
                )
                answer = head + await up_reader.readexactly(length)
                if self.drop in request.split(b"\r\n", 1)[0] and self.dropped == 0:
                    self.dropped += 1
                    return  # hang up: the answer is lost
                writer.write(answer)
                await writer.drain()
        finally:
            writer.close()
            up_writer.close()


@pytest.mark.parametrize("drop", [b"/finish", b"/enqueue"])
async def test_repeated_requests_after_a_lost_answer_are_harmless(tmp_path: Path, drop: bytes) -> None:
    backing = SQLiteStore(tmp_path / "lost.db")
    server = ServerThread(backing).start()
    relay = _AnswerDropper(server.port, drop)
    port = await relay.start()
    client = HTTPStore(f"http://127.0.0.1:{port}/lightning/v1/store", ADMIN_KEY, retries=3, backoff_s=0.01)
    try:
        (group,) = await client.enqueue(
            [{"q": 1}], n=2, max_attempts=2
        )  # a lost answer here is retried with the same group id
        assert (await backing.counts())["queued"] == 2
        claim = await client.claim("w")
        assert claim is not None and claim.rollout.group_id == group.group_id
        done = await client.finish_attempt(claim.attempt.attempt_id, AttemptStatus.FAILED, "boom")
        assert done.status is AttemptStatus.FAILED and done.error == "boom"  # our own earlier finish, not a 409
        assert relay.dropped == 1
        assert (await backing.counts())["queued"] == 2
        with pytest.raises(InvalidTransitionError):  # a real second finish still conflicts
            await client.finish_attempt(claim.attempt.attempt_id, AttemptStatus.FAILED, "boom")
    finally:
        await client.close()
        relay.server.close()
        server.stop()
        await backing.close()


async def test_lease_s_is_bounded(served: tuple[ServerThread, SQLiteStore]) -> None:
    """``lease_s`` past ``MAX_LEASE_S`` (or not positive, or not finite) answers 400 naming the field; a lease within
    it is granted as asked (``1e308`` answered 200 and made a lease that never expires)."""
    from lightning_sdk.store._wire import MAX_LEASE_S

    server, store = served
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}
    await store.enqueue([{"q": 1}], n=1)
    async with httpx.AsyncClient(base_url=server.url, headers=auth) as client:
        for bad in (1e308, MAX_LEASE_S + 1, 0, -5):
            resp = await client.post("/claim", json={"worker_id": "w", "lease_s": bad})
            assert resp.status_code == 400, bad
            err = resp.json()["error"]
            assert err["type"] == "invalid_request_error" and "lease_s" in err["message"]
        for raw in (b'{"worker_id": "w", "lease_s": Infinity}', b'{"worker_id": "w", "lease_s": NaN}'):
            assert (await client.post("/claim", content=raw)).status_code == 400
        assert await store.counts() == {**await store.counts(), "queued": 1}  # nothing claimed by a refusal
        resp = await client.post("/claim", json={"worker_id": "w", "lease_s": MAX_LEASE_S})
        assert resp.status_code == 200
        attempt_id = resp.json()["claim"]["attempt"]["attempt_id"]
        resp = await client.post(f"/attempts/{attempt_id}/heartbeat", json={"lease_s": 1e308})
        assert resp.status_code == 400 and "lease_s" in resp.json()["error"]["message"]
        resp = await client.post(f"/attempts/{attempt_id}/heartbeat", json={"lease_s": 30})
        assert resp.status_code == 200
