"""Codex CLI trains SmolLM2-135M-Instruct: ``lightning-sdk train examples/codex_agent``, whole (marker ``real_cli``).

Codex CLI 0.169 from npm runs by its own entry point (``run_codex.sh``: ``codex exec``) against the trainer's proxy in
token mode; the policy is the real pretrained SmolLM2-135M-Instruct served with the hermes tool layout (its own
template renders no tools), warm-started on demonstrations under Codex's own captured first request, then trained
with LoRA for two RL steps. The test asserts what issue 21 asks of a real coding CLI on the real model:

- the tools reach the prompt: every recorded call's prompt holds Codex's instructions and its ``exec_command`` tool,
  rendered (never dropped);
- a whole tool loop runs at least sometimes: a call answered with a parsed ``exec_command`` call, Codex ran it, and
  a later call of the same attempt carries its result;
- every RL episode is one training segment (the CLI's own prompts, nothing split), and the learner trained records;
- no reply holds a special token as text (the model stops at its end of turn).

``.ci/run``'s ``real-cli-train`` stage runs it; with ``$LIGHTNING_SDK_CI_REPORTS`` set it writes the run's figures
(phases, a learner step's cost, calls, tool loops, peak RSS) to ``codex_train.txt`` there.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.commands import merged_rollouts, train_example

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "codex_agent"

pytestmark = pytest.mark.real_cli


def _rollouts(store_path: Path) -> list[Any]:
    from lightning_sdk.store.sqlite import SQLiteStore

    async def read() -> list[Any]:
        store = SQLiteStore(str(store_path))
        try:
            out: list[Any] = []
            after = None
            while True:
                page, after = await store.list_rollout_details(limit=100, after=after)
                out += page
                if after is None:
                    return out
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.mark.timeout(1800)
def test_codex_cli_trains_smollm2_through_the_proxy(cli_bin: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PATH": f"{cli_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "LSDK_CODEX_HOME": str(tmp_path / "codex_home"),
    }
    run = train_example(EXAMPLE, out, tmp_path, env)
    text = check_run(out, tmp_path, env, run.wall_s, run.peak_rss_mb)
    print(text)
    reports = os.environ.get("LIGHTNING_SDK_CI_REPORTS")
    if reports:
        Path(reports).mkdir(parents=True, exist_ok=True)
        (Path(reports) / "codex_train.txt").write_text(text)


def check_run(out: Path, tmp_path: Path, env: dict[str, str], wall_s: float, peak_rss_mb: float) -> str:
    """The assertions on a finished run directory ``out``; returns the run's report."""
    from transformers import AutoTokenizer

    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(out / "model"))

    rollouts = _rollouts(out / "store.db")
    calls = [c for r in rollouts for a in r.attempts for c in a.calls]
    assert calls, "no call was recorded"
    special = {t for t in tokenizer.all_special_tokens if t}
    loops = cut = 0
    for r in rollouts:
        for a in r.attempts:
            ordered = sorted(a.calls, key=lambda c: c.seq)
            for i, call in enumerate(ordered):
                if call.error is not None:
                    # only Codex stopped by run_codex.sh's bound ($LSDK_CODEX_TIMEOUT) in the middle of a reply: the
                    # attempt's last call, recorded with the disconnect (never trained); any other error fails
                    assert i == len(ordered) - 1 and "disconnected" in call.error, call.error
                    cut += 1
                    continue
                prompt = tokenizer.decode(call.prompt_ids)
                # the tools reach the prompt, with Codex's own instructions
                assert "<tools>" in prompt and '"name": "exec_command"' in prompt
                assert "You are a coding agent running in the Codex CLI" in prompt
                message = (call.response.get("choices") or [{}])[0].get("message") or {}
                text = str(message.get("content") or "")
                assert not any(t in text for t in special), text  # stops at its end of turn, no special token as text
                tool_calls = message.get("tool_calls") or []
                if any(tc["function"]["name"] == "exec_command" for tc in tool_calls) and i + 1 < len(ordered):
                    later = tokenizer.decode(ordered[i + 1].prompt_ids[len(call.prompt_ids) :])
                    if "Process exited with code" in later:  # Codex ran the call and sent back its result
                        loops += 1
    assert loops >= 1, "no whole tool loop: no exec_command call was run by Codex and answered back"
    assert cut < len(calls), "every call was cut"

    # the RL records: one segment per episode, and the learner trained some
    merged = merged_rollouts(out, out / "model", tmp_path, env)
    assert summary["steps"] == 2 and [m["step"] for m in metrics] == [1, 2]
    assert sum(m["records"] for m in metrics) > 0, f"no group had a reward spread: nothing trained ({metrics})"

    return _report(summary, metrics, wall_s, peak_rss_mb, len(calls), loops, len(merged), cut)


def _report(
    summary: dict[str, Any],
    metrics: list[dict[str, Any]],
    wall: float,
    peak_rss_mb: float,
    calls: int,
    loops: int,
    rollouts: int,
    cut: int,
) -> str:
    t = summary.get("timeline", {})
    ws = summary.get("warm_start", {})
    steps = ", ".join(
        f"step {m['step']}: {m['records']} records, mean reward {m['reward_mean']:.2f}, "
        f"learner {m['learner_s']:.0f} s of the step's {m['wall_s']:.0f} s"
        for m in metrics
    )
    lines = [
        "codex agent (lightning-sdk train examples/codex_agent, tests/examples/test_codex_train.py)",
        f"  whole command {wall:.0f} s, peak RSS {peak_rss_mb:.0f} MB; warm start {ws.get('steps')} steps "
        f"(shared prefix {ws.get('shared_prefix')} tokens) ends at {t.get('warm_start_end_s', 0):.0f} s; "
        f"RL ends at {t.get('rl_end_s', 0):.0f} s",
        f"  held-out (n = {summary['eval_after']['n']}): {100 * summary['eval_before']['success_rate']:.0f}% -> "
        f"{100 * summary['eval_after']['success_rate']:.0f}%",
        f"  {calls} calls recorded ({cut} cut mid-reply by Codex's time bound), {loops} whole tool loops, "
        f"{rollouts} RL rollouts each one segment",
        f"  {steps}",
    ]
    return "\n".join(lines) + "\n"
