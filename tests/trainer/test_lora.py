"""LoRA in the embedded learner (``[learner] lora``, PEFT): only the adapter trains, and what is published is the
base model with the adapter merged, which the embedded engine serves exactly as the trained model computes.

Real parts: PEFT's LoRA over a small Qwen3 built from a config (the default tiny policy's architecture), the real
learner step and the real embedded engine; nothing is faked.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lightning_sdk.engines.base import Sampling
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.engines.serving import ServedEngine
from lightning_sdk.errors import EngineError, TrainerError
from lightning_sdk.trainer.learner import (
    Learner,
    LearnerConfig,
    LoraSettings,
    TrainBatch,
    lora_config,
    token_logprobs,
)


def _model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True, eos_token_id=1,
        pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg)  # type: ignore[no-untyped-call]


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 64, (4, 12), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand_as(ids).clone()
    return TrainBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask,
        logprobs=torch.full(ids.shape, -4.0), advantages=advantages,
    )  # fmt: skip


def test_lora_trains_only_the_adapter_and_publishes_the_merged_weights() -> None:
    base = _model()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    learner = Learner(base, LearnerConfig(lr=5e-2, lora=lora))
    n_train = sum(p.numel() for p in learner.trainable())
    assert n_train == 2 * 2 * (4 * 32 + 32 * 4)  # 2 layers x (q, v) x (A + B)
    for _ in range(3):
        learner.update(_batch())
    merged = learner.weights()
    assert set(merged) == set(before)  # the base model's own names: the engine loads it as any full state
    changed = {k for k in merged if not torch.equal(merged[k], before[k])}
    assert changed == {f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in ("q_proj", "v_proj")}
    frozen = {n for n, p in learner.model.named_parameters() if ".lora_" not in n}
    assert all(not dict(learner.model.named_parameters())[n].requires_grad for n in frozen)
    # the merged weights compute what the adapted model computes
    plain = _model()
    plain.load_state_dict(merged)
    ids = _batch().input_ids
    with torch.no_grad():
        ours, _ = token_logprobs(learner.model, ids, torch.ones_like(ids), 1.0)
        theirs, _ = token_logprobs(plain, ids, torch.ones_like(ids), 1.0)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_the_embedded_engine_serves_the_published_adapter() -> None:
    """Base + adapter: the engine's copy of the base gets the merged weights; its sampled log-probs equal the
    trained (adapted) model's own log-probs of those tokens."""
    base = _model()
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    )
    tok.eos_token, tok.pad_token = "t1", "t0"
    engine = EmbeddedEngine(copy.deepcopy(base), tok)
    learner = Learner(base, LearnerConfig(lr=5e-2, lora=LoraSettings(rank=4, alpha=8, target_modules=["q_proj"])))
    learner.update(_batch())

    async def run() -> tuple[list[int], list[float]]:
        try:
            await engine.update_weights(learner.weights(), version=1)
            gen = await engine.generate([5, 6, 7, 8], Sampling(max_tokens=6, temperature=1.0, seed=3))
            return list(gen.completion_ids), list(gen.logprobs)
        finally:
            await engine.close()

    ids, lps = asyncio.run(run())
    full = torch.tensor([[5, 6, 7, 8, *ids]])
    with torch.no_grad():
        ours, _ = token_logprobs(learner.model, full, torch.ones_like(full), 1.0)
    assert torch.allclose(ours[0, 3:], torch.tensor(lps), atol=1e-4)


def test_unknown_target_modules_are_refused() -> None:
    with pytest.raises(TrainerError, match=r"target_modules \['nope'\]"):
        Learner(_model(), LearnerConfig(lora=LoraSettings(target_modules=["nope"])))


def _word_tokenizer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    )
    tok.eos_token, tok.pad_token = "t1", "t0"
    return tok


def test_the_embedded_engine_serves_several_adapters_unmerged_over_one_base() -> None:
    """Two policies (planner, coder), each a LoRA learner over its own copy of one base, trained on different
    batches; the engine serves both adapters unmerged over one shared base. Requests of the base and of both
    adapters run in one mixed batch; each answer's log-probs equal its own learner's (1e-4), each carries its
    adapter's published version, and the same prompt asked of the other adapter right after does not reuse the
    first one's cached KV (prefix cache kept per adapter)."""
    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    engine = EmbeddedEngine(_model(), _word_tokenizer())
    learners = {name: Learner(_model(), LearnerConfig(lr=5e-2, lora=lora)) for name in ("planner", "coder")}
    learners["planner"].update(_batch())
    flipped = _batch()
    flipped.advantages = -flipped.advantages
    for _ in range(2):
        learners["coder"].update(flipped)
    adapters = {name: engine.add_adapter(name, lora_config(lora)) for name in learners}
    base_ref = _model()
    prompt = [5, 6, 7, 8, 9]
    sampling = Sampling(max_tokens=6, temperature=1.0, seed=3)

    async def run() -> dict[str, Any]:
        try:
            await adapters["planner"].update_weights(learners["planner"].adapter_weights(), version=3)
            await adapters["coder"].update_weights(learners["coder"].adapter_weights(), version=7)
            mixed = await asyncio.gather(
                engine.generate(prompt, sampling),
                adapters["planner"].generate(prompt, sampling),
                adapters["coder"].generate(prompt, sampling),
            )
            again = await adapters["coder"].generate([*prompt, 10], sampling)  # the same head, after all three
            return {"base": mixed[0], "planner": mixed[1], "coder": mixed[2], "again": again}
        finally:
            await engine.close()

    got = asyncio.run(run())
    assert engine.stats["max_batch"] == 3  # the three ran as one batch
    refs = {"base": base_ref, "planner": learners["planner"].model, "coder": learners["coder"].model}
    for key, model in (*refs.items(), ("again", learners["coder"].model)):
        gen = got[key]
        head = [*prompt, 10] if key == "again" else prompt
        full = torch.tensor([[*head, *gen.completion_ids]])
        with torch.no_grad():
            ours, _ = token_logprobs(model, full, torch.ones_like(full), 1.0)
        assert torch.allclose(ours[0, len(head) - 1 :], torch.tensor(gen.logprobs), atol=1e-4), key
    assert [got[k].policy_version for k in ("base", "planner", "coder", "again")] == [0, 3, 7, 7]
    assert engine.adapters == {"planner": 3, "coder": 7}
    # the two adapters differ from each other and from the base (otherwise the checks above prove nothing)
    full = torch.tensor([prompt])
    with torch.no_grad():
        outs = [token_logprobs(m, full, torch.ones_like(full), 1.0)[0] for m in refs.values()]
    assert not torch.allclose(outs[0], outs[1], atol=1e-3) and not torch.allclose(outs[1], outs[2], atol=1e-3)


def test_adapter_weights_that_do_not_fit_are_refused() -> None:
    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj"])
    engine = EmbeddedEngine(_model(), _word_tokenizer())
    planner = engine.add_adapter("planner", lora_config(lora))
    other = Learner(_model(), LearnerConfig(lora=LoraSettings(rank=4, alpha=8, target_modules=["v_proj"])))

    async def run() -> None:
        try:
            with pytest.raises(EngineError, match="adapter 'planner' do not fit"):
                await planner.update_weights(other.adapter_weights(), version=1)
            with pytest.raises(EngineError, match="publish each adapter"):
                await engine.update_weights(_model().state_dict(), version=1)
            with pytest.raises(EngineError, match="no adapter 'coder'"):
                engine.adapter("coder")
        finally:
            await engine.close()

    asyncio.run(run())
    assert planner.policy_version == 0


def test_with_vllm_each_publication_is_the_adapter_alone(tmp_path: Path) -> None:
    """``build_parts`` with LoRA and ``kind = "vllm"``: a publication (and a state dict the warm start hands over)
    is written as the PEFT adapter alone, which ``VLLMEngine`` loads through vLLM's LoRA endpoint
    (``is_adapter_dir``); the adapter read back with PEFT is the learner's, after a step. No server is contacted
    here (``urls`` are only called on a generation or a load); the loading itself is tests/engines/test_vllm_lora.py
    (marker ``vllm``, a real vLLM-CPU server)."""
    from peft import PeftModel

    from lightning_sdk.app.parts import build_parts
    from lightning_sdk.engines.serving import EngineConfig
    from lightning_sdk.engines.vllm import is_adapter_dir
    from lightning_sdk.policy.model import load_policy
    from tests.trainer.tiny import build_small_policy

    model_dir = build_small_policy(tmp_path / "policy")
    learner = LearnerConfig(lr=1e-2, lora=LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    parts = build_parts(
        tmp_path / "run", model_dir, engine=EngineConfig(kind="vllm", urls=["http://127.0.0.1:9"]), learner=learner
    )
    try:
        trainer = parts.learner
        assert isinstance(trainer, Learner)
        first = Path(parts.weights())
        batch = _batch()
        batch.input_ids.clamp_(max=int(trainer.model.config.vocab_size) - 1)
        trainer.update(batch)
        second = Path(parts.weights())
        assert is_adapter_dir(first) and is_adapter_dir(second) and first != second
        assert not (second / "model.safetensors").exists() and (second / "adapter_model.safetensors").exists()
        engine = parts.engine
        assert isinstance(engine, ServedEngine) and engine.write_state is not None
        assert is_adapter_dir(engine.write_state({}))  # the warm start's state dict: the same model's adapter
        base, _ = load_policy(model_dir)
        served = PeftModel.from_pretrained(base, str(second))
        ids = batch.input_ids[:1]
        with torch.no_grad():
            torch.testing.assert_close(served(ids).logits, trainer.model(ids).logits, atol=1e-5, rtol=1e-5)
    finally:
        asyncio.run(parts.close())


def test_the_engine_refuses_weights_under_names_its_model_does_not_have() -> None:
    """A state under PEFT's names (``...q_proj.base_layer.weight``, ``...lora_A.default.weight``) fits no tensor of
    the engine's plain copy: ``load_state_dict(strict=False)`` would skip them and keep serving the old attention
    weights (what the warm start's evaluations did with a LoRA learner until it published ``learner.weights()``).
    The engine refuses such a state, naming the tensors, and serves the merged state."""
    base = _model()
    engine = EmbeddedEngine(copy.deepcopy(base), _word_tokenizer())
    learner = Learner(base, LearnerConfig(lr=5e-2, lora=LoraSettings(rank=4, alpha=8, target_modules=["q_proj"])))
    learner.update(_batch())

    async def run() -> None:
        try:
            for peft_state in (base.state_dict(), learner.model.state_dict()):
                with pytest.raises(EngineError, match=r"tensor\(s\) this model does not have"):
                    await engine.update_weights(peft_state, version=1)
            assert engine.policy_version == 0  # nothing was swapped in
            await engine.update_weights(learner.weights(), version=1)
            assert engine.policy_version == 1
        finally:
            await engine.close()

    asyncio.run(run())
    served = engine._model.state_dict()
    merged = learner.weights()
    assert all(torch.equal(served[k], merged[k]) for k in merged)
