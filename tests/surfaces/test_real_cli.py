"""The real coding-agent CLIs through the proxy: Claude Code (Messages API) and Codex CLI (Responses API).

Marker ``real_cli`` (not in the default suite): the CLIs are installed from npm, pinned, into a cache directory
outside the repository (``$LIGHTNING_SDK_REAL_CLI_DIR``, default ``~/.cache/lightning_sdk_real_cli``) by the
``cli_bin`` fixture (``.ci/run`` runs this stage; Node 20 and npm are needed). Each CLI runs as a subprocess in a
scratch directory with a scratch ``HOME``, pointed at the real proxy; in passthrough the proxy forwards to
``ScriptedUpstream`` (a vLLM-style loopback server; tests/surfaces/upstream.py) whose script decides the tool call
and the final answer, and the CLI really runs the shell command (its output, computed by the shell, comes back in
the tool result and into the final answer). In token mode the proxy serves the tiny default policy on the embedded
engine: Claude Code's prompt is far past its context, and the refusal must be clean, recorded and shown by the CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.proxy import ProxyHandle
from tests.surfaces.conftest import ScriptedReply, one_segment, passthrough_proxy, recorded_calls

pytestmark = pytest.mark.real_cli


def _run(
    argv: list[str], tmp_path: Path, env: dict[str, str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
    full = {**base, "HOME": str(home), "NO_COLOR": "1", **env}
    return subprocess.run(argv, cwd=work, env=full, capture_output=True, text=True, timeout=timeout)


def _last_tool_text(body: dict[str, Any]) -> str | None:
    last = body["messages"][-1]
    return str(last.get("content")) if last.get("role") == "tool" else None


def _check_episode(px: ProxyHandle, session: dict[str, Any], sampled: list[Any], api: str) -> None:
    assert px.finish(session["token"]).status_code == 200
    calls = recorded_calls(px, session["rollout_id"])
    assert len(calls) == len(sampled) >= 2
    for call, (prompt, completion, lps) in zip(calls, sampled, strict=True):
        assert call.error is None and call.attempt_id == session["attempt_id"]
        assert (call.prompt_ids, call.completion_ids, call.logprobs) == (prompt, completion, lps)
        assert call.request["surface"]["api"] == api
    assert one_segment(calls)  # the whole episode, tool call and answer, is one training sequence


def test_claude_code_runs_a_shell_tool_through_the_passthrough_proxy(cli_bin: Path, tmp_path: Path) -> None:
    def decide(body: dict[str, Any]) -> ScriptedReply:
        result = _last_tool_text(body)
        if result is None:
            command = {"command": "echo claude-$((6*7))", "description": "Print a number"}
            return ScriptedReply("Running it.", tool_calls=[("Bash", json.dumps(command))])
        return ScriptedReply(f"FINAL: {'claude-42' if 'claude-42' in result else 'no output: ' + result}")

    with passthrough_proxy(tmp_path, [decide] * 6) as (px, upstream):
        s = px.session({"cli": "claude"})
        env = {"ANTHROPIC_BASE_URL": px.url, "ANTHROPIC_AUTH_TOKEN": s["token"], "DISABLE_TELEMETRY": "1"}
        argv = [str(cli_bin / "claude"), "-p", "Print 6*7 with the shell.", "--model", "policy"]
        proc = _run([*argv, "--allowedTools", "Bash"], tmp_path, env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "FINAL: claude-42" in proc.stdout  # the shell really ran: only it prints claude-42
        _check_episode(px, s, upstream.sampled, "messages")
        calls = recorded_calls(px, s["rollout_id"])
    assert calls[0].request["surface"]["headers"]["x-claude-code-session-id"]
    assert [t["function"]["name"] for t in calls[0].request["tools"]].count("Bash") == 1


def test_codex_runs_a_shell_tool_through_the_passthrough_proxy(cli_bin: Path, tmp_path: Path) -> None:
    def decide(body: dict[str, Any]) -> ScriptedReply:
        result = _last_tool_text(body)
        if result is None:
            return ScriptedReply(tool_calls=[("exec_command", json.dumps({"cmd": "echo codex-$((6*7))"}))])
        return ScriptedReply(f"FINAL: {'codex-42' if 'codex-42' in result else 'no output: ' + result}")

    with passthrough_proxy(tmp_path, [decide] * 6) as (px, upstream):
        s = px.session({"cli": "codex"})
        provider = f'model_providers.P={{name="P",base_url="{px.url}/v1",wire_api="responses",env_key="LSDK_TOKEN"}}'
        argv = [str(cli_bin / "codex"), "exec", "--skip-git-repo-check", "-c", "model_provider=P", "-c", provider]
        argv += ["-s", "danger-full-access", "-m", "policy", "Print 6*7 with the shell."]
        proc = _run(argv, tmp_path, {"LSDK_TOKEN": s["token"]})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "FINAL: codex-42" in proc.stdout
        _check_episode(px, s, upstream.sampled, "responses")
        calls = recorded_calls(px, s["rollout_id"])
    surface = calls[0].request["surface"]
    assert surface["headers"]["session-id"] and "web_search" in surface["hidden_tools"]
    assert surface["request"]["store"] is False


@pytest.mark.parametrize("cli", ["claude", "codex"])
def test_cli_episode_in_token_mode_over_the_qwen3_template(cli_bin: Path, tmp_path: Path, cli: str) -> None:
    """Token mode with the real Qwen3 template (a scripted engine samples the template's own rendering of the
    replies): the CLI's whole request (system blocks or developer items, its dozens of tools, namespaces, hosted
    tools) renders, the shell tool call parses out of the sampled ids, the CLI runs it, and the follow-up call
    extends the first one token for token (one segment)."""
    from tests.surfaces.conftest import token_proxy
    from tests.tokens.conversations import assistant, tool_call

    if cli == "claude":
        call = tool_call("Bash", {"command": "echo claude-$((6*7))", "description": "Print a number"}, "c1")
    else:
        call = tool_call("exec_command", {"cmd": "echo codex-$((6*7))"}, "c1")
    plans: list[Any] = [assistant(None, reasoning="Use the shell.", calls=[call]), assistant("FINAL: done.")]
    with token_proxy(tmp_path, plans) as (px, engine):
        s = px.session({"cli": cli, "mode": "token"})
        if cli == "claude":
            env = {"ANTHROPIC_BASE_URL": px.url, "ANTHROPIC_AUTH_TOKEN": s["token"], "DISABLE_TELEMETRY": "1"}
            argv = [str(cli_bin / "claude"), "-p", "Print 6*7 with the shell.", "--model", "policy"]
            argv += ["--allowedTools", "Bash"]
        else:
            env = {"LSDK_TOKEN": s["token"]}
            provider = (
                f'model_providers.P={{name="P",base_url="{px.url}/v1",wire_api="responses",env_key="LSDK_TOKEN"}}'
            )
            argv = [str(cli_bin / "codex"), "exec", "--skip-git-repo-check", "-c", "model_provider=P", "-c", provider]
            argv += ["-s", "danger-full-access", "-m", "policy", "Print 6*7 with the shell."]
        proc = _run(argv, tmp_path, env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "FINAL: done." in proc.stdout
        _check_episode(px, s, list(zip(engine.received, engine.sampled, engine.logprobs, strict=True)), _API[cli])
    tool_result = engine.renderer.decode(engine.received[1][len(engine.received[0]) :])
    assert f"{cli}-42" in tool_result  # the shell really ran, and its output reached the policy's prompt


_API = {"claude": "messages", "codex": "responses"}


def test_claude_code_prompt_past_the_tiny_policy_context_is_refused_cleanly(cli_bin: Path, tmp_path: Path) -> None:
    """Token mode with a tiny policy (1024 positions) on the embedded engine: Claude Code's prompt (~35k of its
    tokens) does not fit. The proxy refuses it in Anthropic's shape ("prompt is too long"), the engine never sees
    it, every refused call is recorded with its error (never trained), and the CLI shows its own error."""
    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.proxy.token_mode import TokenModeBackend, TokenModeConfig
    from lightning_sdk.tokens import ChatRenderer
    from tests.support.proxy import run_proxy
    from tests.trainer.tiny import build_small_policy

    engine = EmbeddedEngine.from_pretrained(build_small_policy(tmp_path / "policy"), max_batch_size=4)
    config = TokenModeConfig(max_model_len=1024)
    backend = TokenModeBackend(engine, ChatRenderer(engine.tokenizer), config=config)
    try:
        with run_proxy(policy_backend=backend, store_path=tmp_path / "store.db") as px:
            s = px.session({"cli": "claude", "mode": "token"})
            env = {"ANTHROPIC_BASE_URL": px.url, "ANTHROPIC_AUTH_TOKEN": s["token"], "DISABLE_TELEMETRY": "1"}
            argv = [str(cli_bin / "claude"), "-p", "Print 6*7 with the shell.", "--model", "policy"]
            proc = _run([*argv, "--allowedTools", "Bash"], tmp_path, env)
            calls = recorded_calls(px, s["rollout_id"])
    finally:
        asyncio.run(engine.close())
    assert proc.returncode == 1
    # the CLI's own message for this refusal ("Prompt is too long · this conversation is a single exchange and
    # cannot be compacted ..."): it recognised the error and did not retry
    assert proc.stdout.startswith("Prompt is too long"), proc.stdout + proc.stderr
    assert engine.stats["requests"] == 0  # the engine never saw a prompt that does not fit
    assert len(calls) == 1 and calls[0].error and "maximum context length is 1024" in calls[0].error
    assert calls[0].checks["error_code"] == "context_length_exceeded" and calls[0].checks["http_status"] == 400
    assert calls[0].completion_ids == [] and calls[0].request["surface"]["api"] == "messages"
    assert calls[0].request["surface"]["headers"]["x-claude-code-session-id"]
