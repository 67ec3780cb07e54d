"""A real verl FSDP actor update on CPU: verl's ``ActorRolloutRefWorker`` (FSDP2, gloo, one rank, in this process)
on the project's tiny Qwen2 policy, fed with records sampled by the real embedded engine.

verl 0.9.1 has no CPU platform; ``lightning_sdk.trainer.verl._cpu_platform`` registers one through verl's
``PlatformRegistry``/``set_platform`` extension point, which is all it takes (see docs/scale-out.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sdk.engines.base import Sampling
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.policy.model import load_policy
from lightning_sdk.trainer.verl.backend import VerlBackend
from lightning_sdk.trainer.verl.batch import TrainRow, records_to_dataproto
from lightning_sdk.trainer.verl.config import VerlConfig
from lightning_sdk.trainer.verl.step import shard_tensordicts
from tests.verl.conftest import render, sample_rows


@pytest.fixture(scope="module")
def tis_backend(tiny_model_dir: Path) -> Iterator[VerlBackend]:
    backend = VerlBackend(
        VerlConfig(model_dir=str(tiny_model_dir), device="cpu", lr=5e-3, rollout_correction="tis"), use_ray=False
    )
    yield backend
    backend.shutdown()


def _actor_logprobs(backend: VerlBackend, rows: list[TrainRow]) -> tuple[torch.Tensor, torch.Tensor]:
    data = records_to_dataproto(rows)
    data.meta_info["temperature"] = 1.0
    (lp,) = backend.ranks.call("compute_log_prob", shard_tensordicts(data, 1))
    return lp, data.batch["response_mask"].bool()


def test_trainer_logprobs_equal_engine_logprobs(tis_backend: VerlBackend, tiny_model_dir: Path) -> None:
    """verl's recomputed log-probs on our DataProto equal the embedded engine's sampled log-probs (same weights):
    the prompt/response split, padding and position ids line up token for token."""
    rows = sample_rows(tiny_model_dir)
    lp, mask = _actor_logprobs(tis_backend, rows)
    engine_lp = records_to_dataproto(rows).batch["rollout_log_probs"]
    assert mask.sum() == sum(sum(r.loss_mask) for r in rows)
    torch.testing.assert_close(lp[mask], engine_lp[mask], atol=2e-4, rtol=1e-4)


def test_one_tis_step_moves_the_policy_along_the_advantages(tis_backend: VerlBackend, tiny_model_dir: Path) -> None:
    rows = sample_rows(tiny_model_dir, seed=1)
    before, mask = _actor_logprobs(tis_backend, rows)
    data = records_to_dataproto(rows)
    adv = data.batch["advantages"]
    assert (adv[mask] > 0).any() and (adv[mask] < 0).any()

    metrics = tis_backend.step(rows)

    assert tis_backend.version == 1 and metrics["step/policy_version"] == 1.0
    # on-policy data: ratio 1 and TIS weights 1, so verl's token-mean loss is -mean(A) over trained tokens
    assert metrics["actor/pg_loss"] == pytest.approx(-float(adv[mask].mean()), abs=1e-3)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["grad_norm"] > 0
    after, _ = _actor_logprobs(tis_backend, rows)
    delta = (after - before)[mask]
    sign = adv[mask].sign()
    assert float((delta * sign).sum()) > 0  # up where A > 0, down where A < 0, on balance
    assert float(((after - before) * adv)[mask].mean()) > 0


def test_publish_to_the_embedded_engine(tis_backend: VerlBackend, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Weights go from verl to the engine through an HF checkpoint; the engine then samples what verl computes."""
    model, tok = load_policy(tiny_model_dir)
    engine = EmbeddedEngine(model, tok, device="cpu")
    if tis_backend.version == 0:
        tis_backend.step(sample_rows(tiny_model_dir, seed=2))
    prompt = render(tok, "What is 3 * 4?")

    async def go() -> tuple[float, Any]:
        seconds = await tis_backend.publish(engine)
        gen = await engine.generate(list(prompt), Sampling(max_tokens=6, temperature=1.0, seed=7))
        await engine.close()
        return seconds, gen

    seconds, gen = asyncio.run(go())
    assert seconds > 0 and engine.policy_version == tis_backend.version and gen.policy_version == tis_backend.version
    saved = sorted(p.name for p in (tis_backend._publish_root / f"v{tis_backend.version:06d}").iterdir())
    assert "model.safetensors" in saved and "config.json" in saved and "tokenizer.json" in saved
    row = TrainRow(
        input_ids=list(prompt) + gen.completion_ids,
        loss_mask=[0] * len(prompt) + [1] * len(gen.completion_ids),
        logprobs=[0.0] * len(prompt) + gen.logprobs,
        advantages=[0.0] * (len(prompt) + len(gen.completion_ids)),
        reward=0.0,
        group="g",
    )
    lp, mask = _actor_logprobs(tis_backend, [row])
    torch.testing.assert_close(lp[mask], torch.tensor(gen.logprobs), atol=2e-4, rtol=1e-4)


def test_bypass_mode_uses_rollout_logprobs(tiny_model_dir: Path) -> None:
    """``bypass``: no recompute pass; verl's ``bypass_mode`` loss takes the ratio against the engine's log-probs."""
    backend = VerlBackend(
        VerlConfig(model_dir=str(tiny_model_dir), device="cpu", lr=5e-3, rollout_correction="bypass"), use_ray=False
    )
    try:
        rows = sample_rows(tiny_model_dir, seed=3)
        data = records_to_dataproto(rows)
        mask = data.batch["response_mask"].bool()
        metrics = backend.step(rows)
        assert metrics["actor/pg_loss"] == pytest.approx(-float(data.batch["advantages"][mask].mean()), abs=1e-3)
        assert abs(metrics["actor/ppo_kl"]) < 1e-3  # engine and trainer agree: ratio 1
        assert "rollout_corr/rollout_is_mean" in metrics  # computed inside the bypass loss
    finally:
        backend.shutdown()


def test_kl_to_a_frozen_reference(tiny_model_dir: Path) -> None:
    """``kl_coef > 0`` builds verl's reference worker (role ``ref``, forward only); KL is 0 until the actor moves."""
    backend = VerlBackend(VerlConfig(model_dir=str(tiny_model_dir), device="cpu", lr=2e-2, kl_coef=0.1), use_ray=False)
    try:
        rows = sample_rows(tiny_model_dir, seed=4)
        first = backend.step(rows)
        second = backend.step(rows)
        assert first["kl_coef"] == pytest.approx(0.1)
        assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)  # actor == reference before the first update
        assert second["kl_loss"] > 1e-4
        data = records_to_dataproto(rows)
        data.meta_info["temperature"] = 1.0
        (ref_lp,) = backend.ranks.call("compute_ref_log_prob", shard_tensordicts(data, 1))
        mask = data.batch["response_mask"].bool()
        torch.testing.assert_close(ref_lp[mask], data.batch["rollout_log_probs"][mask], atol=2e-4, rtol=1e-4)
    finally:
        backend.shutdown()


def test_verl_learner_takes_records_with_their_groups(tis_backend: VerlBackend, tiny_model_dir: Path) -> None:
    """``VerlLearner.step(records)``: the records go to verl as they are (uid = group, reward as the score; no padded
    detour); ``weights()`` is a full HF state dict."""
    import numpy as np

    from lightning_sdk.records.record import CallSpan, Record, Segment
    from lightning_sdk.trainer.verl.adapter import VerlLearner
    from lightning_sdk.trainer.verl.batch import records_to_dataproto

    records = []
    for i, r in enumerate(sample_rows(tiny_model_dir, seed=6)):
        start = r.prompt_len
        seg = Segment(
            attempt_id=f"a{i}",
            rollout_id=f"r{i}",
            index=0,
            input_ids=np.array(r.input_ids, dtype=np.int32),
            loss_mask=np.array(r.loss_mask, dtype=np.int8),
            logprobs=np.array(r.logprobs, dtype=np.float64),
            spans=(CallSpan(call_id=f"c{i}", seq=0, start=start, end=len(r.input_ids), policy_version=0),),
        )
        adv = np.array(r.advantages, dtype=np.float64)
        records.append(Record(segment=seg, group_id=r.group, reward=r.reward, advantages=adv))
    sent = records_to_dataproto(records, pad_id=tis_backend.pad_id)
    uids = [r.group_id for r in records]
    assert list(sent.non_tensor_batch["uid"]) == uids and len(set(uids)) > 1
    assert sent.batch["token_level_scores"].sum(-1).tolist() == [r.reward for r in records]
    learner = VerlLearner(tis_backend)
    version = tis_backend.version
    metrics = learner.step(records)
    assert learner.steps == 1 and tis_backend.version == version + 1 and metrics["grad_norm"] > 0
    assert metrics["step/rows"] == len(records)
    weights = learner.weights()
    model, _ = load_policy(tiny_model_dir)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    state = learner.state_dict()
    assert state["steps"] == 1 and state["policy_version"] == tis_backend.version


def test_lora_step_trains_the_adapter_and_publishes_merged_weights(tiny_model_dir: Path) -> None:
    """``lora = {...}``: verl's FSDP engine wraps the actor in PEFT; a real CPU step moves only the targeted
    projections (the merged export, float32, differs from the base there and is bit-equal elsewhere: verl's own
    merged export would round it all to bfloat16), and the published full weights, loaded by the embedded engine,
    give what verl's actor computes."""
    from lightning_sdk.trainer.learner import LoraSettings

    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    backend = VerlBackend(
        VerlConfig(model_dir=str(tiny_model_dir), device="cpu", lr=5e-2, rollout_correction="tis", lora=lora),
        use_ray=False,
    )
    try:
        base, tok = load_policy(tiny_model_dir)
        rows = sample_rows(tiny_model_dir, seed=5)
        before, mask = _actor_logprobs(backend, rows)
        metrics = backend.step(rows)
        assert metrics["grad_norm"] > 0 and backend.version == 1
        after, _ = _actor_logprobs(backend, rows)
        assert float((after - before)[mask].abs().max()) > 1e-4  # the adapter moved the policy
        merged = backend.state_dict()
        reference = base.state_dict()
        assert set(merged) <= set(reference) and not any("lora" in k for k in merged)
        changed = {k for k, v in merged.items() if not torch.equal(v, reference[k])}
        assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), sorted(changed)
        engine = EmbeddedEngine(base, tok, device="cpu")
        prompt = render(tok, "What is 3 * 4?")

        async def go() -> Any:
            await backend.publish(engine)
            gen = await engine.generate(list(prompt), Sampling(max_tokens=6, temperature=1.0, seed=3))
            await engine.close()
            return gen

        gen = asyncio.run(go())
        row = TrainRow(
            input_ids=list(prompt) + gen.completion_ids,
            loss_mask=[0] * len(prompt) + [1] * len(gen.completion_ids),
            logprobs=[0.0] * len(prompt) + gen.logprobs,
            advantages=[0.0] * (len(prompt) + len(gen.completion_ids)),
            reward=0.0,
            group="g",
        )
        lp, m = _actor_logprobs(backend, [row])
        torch.testing.assert_close(lp[m], torch.tensor(gen.logprobs), atol=2e-4, rtol=1e-4)
    finally:
        backend.shutdown()
