"""``lightning-sdk proxy --tokenizer DIR``: a real subprocess in front of a text-only OpenAI server (the mock with
``supports_token_ids=False``) records calls with ids rebuilt by the real Qwen2.5 tokenizer and chat template,
``token_source="retokenized"`` and the retokenization checks; without ``--tokenizer`` the same calls keep empty ids
and ``checks["missing_token_ids"]`` (the upstream's own logprobs are kept as sent). A bad ``--tokenizer`` is a
clear error."""

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
from lightning_sdk.tokens import ChatRenderer
from lightning_sdk.types import Call
from tests.support.mock_openai import MockOpenAI
from tests.support.servers import RunningServer, free_port, run_server
from tests.support.tokenizers import tokenizer_dir
from tests.support.waiting import answers, until

ROOT = Path(__file__).resolve().parents[2]
KEY = "retok-key"
REPLY = "Paris is sunny today."


def _cli(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_sdk", "proxy", "--admin-key", KEY, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _trace(upstream: RunningServer, db: Path, *extra: str) -> tuple[list[Call], str, list[dict[str, str]]]:
    """Run the CLI proxy, make one plain and one streamed call, finish; the recorded calls and the stdout."""
    port = free_port()
    proc = _cli("--upstream", upstream.url + "/v1", "--store", str(db), "--port", str(port), *extra)
    url = f"http://127.0.0.1:{port}"
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    follow = [*msgs, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Sure?"}]
    try:

        def healthy() -> bool:
            assert proc.poll() is None, "the proxy exited"
            return answers(url + "/lightning/v1/health")

        until(healthy, timeout=60, what="the proxy to start", every=0.1)
        s = httpx.post(url + "/lightning/v1/sessions", json={}, headers={"Authorization": f"Bearer {KEY}"}).json()
        client = openai.OpenAI(base_url=url + "/v1", api_key=s["token"], max_retries=0)
        assert client.chat.completions.create(model="policy", messages=msgs).choices[0].message.content == REPLY  # type: ignore[arg-type]
        stream = client.chat.completions.create(model="policy", messages=follow, stream=True)  # type: ignore[arg-type]
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == REPLY
        auth = {"Authorization": f"Bearer {s['token']}"}
        assert httpx.post(url + "/lightning/v1/finish", json={"status": "succeeded"}, headers=auth).is_success
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: graceful shutdown, exit code 0
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err

    async def read() -> list[Call]:
        store = SQLiteStore(db)
        try:
            detail = await store.get_rollout(s["rollout_id"])
        finally:
            await store.close()
        return sorted(detail.attempts[0].calls, key=lambda c: c.seq)

    return asyncio.run(read()), out, follow


def test_tokenizer_flag_retokenizes_text_only_replies(tmp_path: Path) -> None:
    mock = MockOpenAI(supports_token_ids=False, reply=REPLY)
    folder = tokenizer_dir("qwen2.5")
    renderer = ChatRenderer.from_pretrained(folder)
    with run_server(mock.app) as upstream:
        calls, out, follow = _trace(upstream, tmp_path / "retok.db", "--tokenizer", str(folder))
        plain, _, _ = _trace(upstream, tmp_path / "plain.db")
    assert f"retokenizing text-only replies with {folder}" in out

    first, streamed = calls
    for call in calls:
        assert call.token_source == "retokenized" and call.error is None
        assert call.checks["retokenized"] is True and call.checks["reply_roundtrip"] is True
        assert call.checks["decode_encode_roundtrip"] is True
        assert renderer.decode(call.completion_ids).startswith(REPLY)
        assert call.completion_ids[-1] in renderer.stop_token_ids
    assert first.prompt_ids == renderer.render(first.request["messages"])
    assert streamed.prompt_ids == renderer.render(follow)
    assert streamed.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids
    )
    assert streamed.checks["render"]["extended"] is True

    for call in plain:  # without --tokenizer: empty ids, flagged, never silently trained
        assert (call.prompt_ids, call.completion_ids) == ([], [])
        assert call.checks["missing_token_ids"] is True and "retokenized" not in call.checks


def test_bad_tokenizer_dir_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    mock = MockOpenAI()
    with run_server(mock.app) as upstream:
        for folder, message in [(tmp_path / "missing", "not a directory"), (tmp_path / "empty", "--tokenizer")]:
            db = str(tmp_path / "s.db")
            proc = _cli("--upstream", upstream.url + "/v1", "--store", db, "--tokenizer", str(folder))
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 2, err
            assert message in err and "Traceback" not in err
