"""``lightning-sdk proxy --upstream URL --store PATH --host --port --admin-key``: a real subprocess serving a real
port in front of the loopback engine; clear errors (no traceback) for bad flags and an unreachable upstream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from lightning_sdk.store import SQLiteStore
from tests.support.mock_openai import MockOpenAI
from tests.support.servers import RunningServer, free_port
from tests.support.waiting import answers, until

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("LIGHTNING_SDK_ADMIN_KEY", None) if env is None else None
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_sdk", "proxy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=ROOT,
    )


def _wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"proxy exited early: {proc.stderr.read() if proc.stderr else ''}")
        return answers(url + "/lightning/v1/health")

    until(healthy, timeout=timeout, what="the proxy to become healthy", every=0.1)


def test_proxy_command_traces_into_the_store(upstream: RunningServer, mock: MockOpenAI, tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "traces.db"
    proc = _cli("--upstream", upstream.url + "/v1", "--store", str(db), "--port", str(port), "--admin-key", "cli-key")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        s = httpx.post(
            url + "/lightning/v1/sessions", json={"task": {"t": 1}}, headers={"Authorization": "Bearer cli-key"}
        )
        assert s.status_code == 200
        token = s.json()["token"]
        client = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "Hello from the mock upstream."
        assert (
            httpx.post(
                url + "/lightning/v1/finish", json={"status": "succeeded"}, headers={"Authorization": f"Bearer {token}"}
            ).status_code
            == 200
        )
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: graceful shutdown (recorder flushed, store closed), no traceback
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert f"tracing proxy on http://127.0.0.1:{port}/v1" in out
    assert "admin key (generated)" not in out

    async def read() -> list[list[int]]:
        store = SQLiteStore(db)
        try:
            page, _ = await store.list_rollouts()
            d = await store.get_rollout(page[0].rollout_id)
        finally:
            await store.close()
        return [c.prompt_ids for a in d.attempts for c in a.calls]

    [prompt_ids] = asyncio.run(read())
    assert prompt_ids == mock.expected_ids([{"role": "user", "content": "hi"}], "x")[0]


def test_admin_key_is_generated_and_printed_when_not_given(upstream: RunningServer, tmp_path: Path) -> None:
    port = free_port()
    proc = _cli("--upstream", upstream.url + "/v1", "--store", str(tmp_path / "s.db"), "--port", str(port))
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    key = next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("admin key (generated)"))
    assert len(key) >= 24


def test_admin_key_from_the_environment(upstream: RunningServer, tmp_path: Path) -> None:
    port = free_port()
    proc = _cli(
        "--upstream",
        upstream.url + "/v1",
        "--store",
        str(tmp_path / "s.db"),
        "--port",
        str(port),
        env={"LIGHTNING_SDK_ADMIN_KEY": "env-key"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        ok = httpx.post(url + "/lightning/v1/sessions", json={}, headers={"Authorization": "Bearer env-key"})
        assert ok.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert "admin key (generated)" not in out


def test_clear_errors_without_tracebacks(upstream: RunningServer, tmp_path: Path) -> None:
    cases = [
        (["--upstream", "ftp://u:secret@x/v1", "--store", str(tmp_path / "s.db")], "is not an http(s) URL"),
        (["--upstream", "ftp://x", "--store", str(tmp_path / "s.db")], "is not an http(s) URL"),
        (["--upstream", upstream.url + "/v1", "--store", str(tmp_path / "s.db"), "--port", "70000"], "not a TCP port"),
        (["--upstream", upstream.url + "/v1", "--store", str(tmp_path / "no" / "dir" / "s.db")], "does not exist"),
        (["--upstream", upstream.url, "--store", str(tmp_path / "s.db")], "has no /models"),
    ]
    for args, message in cases:
        proc = _cli(*args)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, (args, out, err)
        assert message in err, (args, err)
        assert "Traceback" not in err and "secret" not in err
