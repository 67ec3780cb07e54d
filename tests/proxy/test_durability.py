"""The contract's durability test: ``lightning-sdk proxy`` as a real subprocess (mock upstream served here, real
SQLite file), SIGKILLed right after ``POST /lightning/v1/finish`` answered — every call (exact ids and logprobs) and
the reward of the attempt are in the file and the attempt is succeeded. An attempt cut off before its finish
(SIGKILL with calls in flight, a finish waiting on them) never reads as succeeded."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import openai

from lightning_sdk.store import SQLiteStore
from lightning_sdk.types import AttemptStatus, RolloutDetail, RolloutStatus
from tests.support.mock_openai import MockOpenAI
from tests.support.servers import RunningServer, free_port
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
KEY = "durability-key"
REPLY = "Forty-two, as always."


def _start(upstream: str, db: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = ["--upstream", upstream, "--store", str(db), "--port", str(port), "--admin-key", KEY, "--retries", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_sdk", "proxy", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, "the proxy exited early"
        try:
            return httpx.get(url + "/lightning/v1/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until(healthy, timeout=60, what="the proxy to become healthy")
    except AssertionError:
        proc.kill()
        raise
    return proc, url


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def _session(url: str) -> dict[str, Any]:
    r = httpx.post(url + "/lightning/v1/sessions", json={"task": {"q": 1}}, headers={"Authorization": f"Bearer {KEY}"})
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def _read(db: Path, rollout_id: str) -> RolloutDetail:
    async def read() -> RolloutDetail:
        store = SQLiteStore(db)
        try:
            return await store.get_rollout(rollout_id)
        finally:
            await store.close()

    return asyncio.run(read())


def test_finished_attempt_survives_sigkill(upstream: RunningServer, mock: MockOpenAI, tmp_path: Path) -> None:
    mock.reply = REPLY
    db = tmp_path / "traces.db"
    proc, url = _start(upstream.url + "/v1", db)
    try:
        s = _session(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key=s["token"], max_retries=0)
        conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(5)]
        ids = []
        for i, msgs in enumerate(conversations):
            if i % 2:  # streamed and unstreamed calls alike
                with client.chat.completions.with_streaming_response.create(
                    model="policy",
                    messages=msgs,  # type: ignore[arg-type]
                    stream=True,
                ) as r:
                    ids.append(r.headers["x-lightning-call-id"])
                    assert "".join(c.choices[0].delta.content or "" for c in r.parse() if c.choices) == REPLY
            else:
                raw = client.chat.completions.with_raw_response.create(model="policy", messages=msgs)  # type: ignore[arg-type]
                ids.append(raw.headers["x-lightning-call-id"])
        auth = {"Authorization": f"Bearer {s['token']}"}
        assert httpx.post(url + "/lightning/v1/reward", json={"value": 0.75, "name": "score"}, headers=auth).is_success
        assert httpx.post(url + "/lightning/v1/reward", json={"value": 0.5, "call_id": ids[3]}, headers=auth).is_success
        fin = httpx.post(url + "/lightning/v1/finish", json={"status": "succeeded"}, headers=auth)
        assert fin.status_code == 200 and fin.json()["calls"] == 5
    finally:
        _kill(proc)  # at once: no graceful shutdown, no recorder drain, no store close

    detail = _read(db, s["rollout_id"])
    (attempt,) = detail.attempts
    assert attempt.attempt.status is AttemptStatus.SUCCEEDED
    assert detail.rollout.status is RolloutStatus.SUCCEEDED
    calls = sorted(attempt.calls, key=lambda c: c.seq)
    assert [c.call_id for c in calls] == ids
    for call, msgs in zip(calls, conversations, strict=True):
        prompt_ids, completion_ids, logprobs, finish = MockOpenAI.expected_ids(msgs, REPLY)
        assert (call.prompt_ids, call.completion_ids, call.logprobs) == (prompt_ids, completion_ids, logprobs)
        assert call.finish_reason == finish and call.error is None and call.token_source == "engine"
    assert sorted((w.name, w.value, w.call_id) for w in attempt.rewards) == [
        ("reward", 0.5, ids[3]),
        ("score", 0.75, None),
    ]


def test_attempt_cut_off_before_finish_is_never_succeeded(
    upstream: RunningServer, mock: MockOpenAI, tmp_path: Path
) -> None:
    mock.reply = REPLY
    db = tmp_path / "traces.db"
    proc, url = _start(upstream.url + "/v1", db)
    outcomes: list[str] = []
    try:
        s = _session(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key=s["token"], max_retries=0, timeout=30)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "done"}])
        mock.delay_s = 2.0  # the next calls hang upstream: in flight in the proxy when it dies
        seen = mock.n_requests

        def call(i: int) -> None:
            try:
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"slow {i}"}])
                outcomes.append("answered")
            except openai.APIError as exc:
                outcomes.append(type(exc).__name__)

        def finish() -> None:
            try:
                httpx.post(
                    url + "/lightning/v1/finish",
                    json={"status": "succeeded"},
                    headers={"Authorization": f"Bearer {s['token']}"},
                    timeout=30,
                )
                outcomes.append("finish answered")
            except httpx.HTTPError as exc:
                outcomes.append(type(exc).__name__)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        until(lambda: mock.n_requests >= seen + 3, timeout=20, what="the three calls at the upstream")
        assert mock.n_requests == seen + 3  # all three are waiting on the upstream
        closer = threading.Thread(target=finish)  # the finish waits for the calls in flight
        closer.start()

        def finishing() -> bool:  # a reward for no call: 400 while the attempt runs, 409 once its finish began
            probe = {"value": 0.0, "call_id": "no-such-call"}
            auth = {"Authorization": f"Bearer {s['token']}"}
            answer = httpx.post(url + "/lightning/v1/reward", json=probe, headers=auth, timeout=10)
            assert answer.status_code in (400, 409), answer.text
            return answer.status_code == 409

        until(finishing, timeout=20, what="the finish to wait for the calls in flight", every=0.02)
    finally:
        _kill(proc)
    for t in [*threads, closer]:
        t.join(timeout=30)
    assert "answered" not in outcomes and "finish answered" not in outcomes and len(outcomes) == 4

    detail = _read(db, s["rollout_id"])
    (attempt,) = detail.attempts
    assert attempt.attempt.status is AttemptStatus.RUNNING  # cut off: the store's lease expiry will fail it
    assert detail.rollout.status is not RolloutStatus.SUCCEEDED
    assert detail.succeeded_attempt() is None
    assert len(attempt.calls) <= 1  # at most the call answered before; never a half-answered one
    for call in attempt.calls:
        assert (
            call.error is None
            and call.completion_ids == MockOpenAI.expected_ids([{"role": "user", "content": "done"}], REPLY)[1]
        )
