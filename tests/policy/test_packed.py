"""Packed rows (``lightning_sdk.policy.packed``): one sequence per micro-batch, attention per row. Against the padded
rows of ``token_logprobs`` on real models (the project's tiny Qwen3 policy, a Llama with grouped keys/values as
SmolLM2 has, both with and without a LoRA adapter): the same log-probs, entropies and gradients, shared heads
included; the learner's update the same with packing on and off, in one model call per micro-batch."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sdk.policy.model import load_policy
from lightning_sdk.policy.packed import PACKED_ATTENTION, pack_rows, packed_token_logprobs, supports_packing
from lightning_sdk.trainer.learner import Learner, LearnerConfig, TrainBatch, token_logprobs
from tests.trainer.kv_reference import grads, lora_tiny
from tests.trainer.tiny import build_small_policy


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


def _llama() -> Any:
    """A small Llama (SmolLM2's architecture): 4 query heads over 2 key/value heads, random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _model(policy_dir: Path, kind: str) -> Any:
    if kind.startswith("llama"):
        model = _llama()
    else:
        model, _ = load_policy(policy_dir)
    return lora_tiny(model) if kind.endswith("lora") else model


def _rows(seed: int = 3, vocab: int = 300) -> tuple[torch.Tensor, list[int], list[tuple[list[int], int]]]:
    """Ragged right-padded rows as a step has them: two groups whose rows share a prompt (10 and 14 tokens, the
    first 6 the same head in both), each row with a tail of its own, and two rows that share nothing (one of them
    as long as the widest)."""
    g = torch.Generator().manual_seed(seed)
    width = 32
    head = torch.randint(5, vocab, (6,), generator=g)
    rows: list[torch.Tensor] = []
    lengths: list[int] = []
    parts: list[tuple[list[int], int]] = []
    for prompt_len, n in ((10, 3), (14, 4)):
        prompt = torch.cat([head, torch.randint(5, vocab, (prompt_len - 6,), generator=g)])
        members = []
        for r in range(n):
            length = prompt_len + 3 + 4 * r
            row = torch.zeros(width, dtype=torch.long)
            row[:prompt_len] = prompt
            row[prompt_len:length] = torch.randint(5, vocab, (length - prompt_len,), generator=g)
            members.append(len(rows))
            rows.append(row)
            lengths.append(length)
        parts.append((members, prompt_len))
    for length in (9, width):
        row = torch.zeros(width, dtype=torch.long)
        row[:length] = torch.randint(5, vocab, (length,), generator=g)
        parts.append(([len(rows)], 0))
        rows.append(row)
        lengths.append(length)
    return torch.stack(rows), lengths, parts


def _padded(
    model: Any, ids: torch.Tensor, lengths: list[int], parts: list[tuple[list[int], int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded path: each part through ``token_logprobs`` with its shared prefix (the reference)."""
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    ent = torch.zeros_like(out)
    pieces_lp, pieces_ent = [], []
    for rows, prefix in parts:
        width = max(lengths[i] for i in rows)
        attn = (torch.arange(width) < torch.tensor([lengths[i] for i in rows]).unsqueeze(1)).long()
        lp, e = token_logprobs(model, ids[rows, :width], attn, 0.7, prefix=prefix if len(rows) > 1 else 0)
        pieces_lp.append((rows, width, lp))
        pieces_ent.append(e)
    for (rows, width, lp), e in zip(pieces_lp, pieces_ent, strict=True):
        out = out.index_put((torch.tensor(rows).unsqueeze(1), torch.arange(width - 1).unsqueeze(0)), lp)
        ent[rows, : width - 1] = e.detach()
    return out, ent


@pytest.mark.parametrize("kind", ["tiny", "tiny-lora", "llama", "llama-lora"])
def test_packed_rows_give_the_padded_logprobs_entropies_and_gradients(policy_dir: Path, kind: str) -> None:
    base = _model(policy_dir, kind)
    assert supports_packing(base)
    ids, lengths, parts = _rows()
    real = torch.arange(ids.shape[1] - 1).unsqueeze(0) < (torch.tensor(lengths) - 1).unsqueeze(1)
    wanted = real.clone()
    wanted[:, :5] = False  # a few columns not wanted: they come back 0
    wanted[1, 9] = True  # the prediction made at the last prompt position of a group's row (inside the head)
    padded_model, packed_model = copy.deepcopy(base), copy.deepcopy(base)
    ref, ref_ent = _padded(padded_model, ids, lengths, parts)
    pack = pack_rows(ids, lengths, parts, wanted)
    # each group's prompt once, every row's own tokens, the lone rows whole
    assert (
        pack.tokens
        == 10 + 14 + sum(lengths[i] - 10 for i in parts[0][0]) + sum(lengths[i] - 14 for i in parts[1][0]) + 9 + 32
    )
    logp, ent = packed_token_logprobs(packed_model, pack, 0.7)
    assert logp.shape == ref.shape == ent.shape
    assert torch.allclose(logp[wanted], ref[wanted].detach(), atol=1e-5)
    assert torch.allclose(ent[wanted], ref_ent[wanted], atol=1e-5)
    assert torch.count_nonzero(logp[~wanted]) == 0 and torch.count_nonzero(ent[~wanted]) == 0
    weights = wanted.float() * torch.linspace(-1, 1, ids.shape[1] - 1)
    (ref * weights).sum().backward()  # type: ignore[no-untyped-call]
    (logp * weights).sum().backward()  # type: ignore[no-untyped-call]
    g_ref, g_packed = grads(padded_model), grads(packed_model)
    assert g_ref.keys() == g_packed.keys() and g_ref
    for name in g_ref:
        assert torch.allclose(g_packed[name], g_ref[name], atol=1e-5, rtol=1e-4), name
    # the attention setting is the model's own again: a plain call after a packed one is the plain call
    config = (base.get_base_model() if hasattr(base, "get_base_model") else base).config
    packed_config = (packed_model.get_base_model() if hasattr(packed_model, "get_base_model") else packed_model).config
    assert packed_config._attn_implementation == config._attn_implementation != PACKED_ATTENTION


def test_packed_heads_carry_the_gradient_of_every_row_that_reads_them(policy_dir: Path) -> None:
    """A loss on one row's own tokens only moves the gradient through the shared head's keys/values: with the head's
    embedding rows of the vocabulary as the witness (tokens only the prompt holds), packing gives them the padded
    path's gradient, which is not 0."""
    base = _model(policy_dir, "tiny")
    ids, lengths, parts = _rows()
    wanted = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    wanted[2, 11 : lengths[2] - 1] = True  # the third row of the first group, past its prompt
    padded_model, packed_model = copy.deepcopy(base), copy.deepcopy(base)
    ref, _ = _padded(padded_model, ids, lengths, parts)
    logp, _ = packed_token_logprobs(packed_model, pack_rows(ids, lengths, parts, wanted), 0.7)
    (ref * wanted).sum().backward()  # type: ignore[no-untyped-call]
    (logp * wanted).sum().backward()  # type: ignore[no-untyped-call]
    prompt_only = sorted(set(ids[0, :10].tolist()) - set(ids[2, 10 : lengths[2]].tolist()))
    emb_ref = padded_model.get_input_embeddings().weight.grad[prompt_only]
    emb_packed = packed_model.get_input_embeddings().weight.grad[prompt_only]
    assert float(emb_ref.abs().sum()) > 0
    assert torch.allclose(emb_packed, emb_ref, atol=1e-6)


def test_pack_rows_refuses_parts_that_do_not_describe_the_rows() -> None:
    ids, lengths, parts = _rows()
    wanted = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="do not cover"):
        pack_rows(ids, lengths, parts[:-1], wanted)
    with pytest.raises(ValueError, match="two parts"):
        pack_rows(ids, lengths, [*parts, ([0], 0)], wanted)
    with pytest.raises(ValueError, match="has length"):  # a prefix must leave each row a token of its own
        pack_rows(ids, lengths, [([0, 1, 2], lengths[0]), *parts[1:]], wanted)
    late = wanted.clone()
    late[7, 8] = True  # row 7 is 9 tokens long: column 8 would predict its first padding
    with pytest.raises(ValueError, match="past its row's end"):
        pack_rows(ids, lengths, parts, late)


def test_supports_packing_only_full_attention_decoders() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    assert supports_packing(_llama())
    assert not supports_packing(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2)))
    assert not supports_packing(MistralForCausalLM(MistralConfig(**small, sliding_window=8)))
    assert supports_packing(MistralForCausalLM(MistralConfig(**small, sliding_window=None)))


def _grouped_batch(seed: int = 5) -> TrainBatch:
    ids, lengths, _ = _rows(seed)
    attn = (torch.arange(ids.shape[1]) < torch.tensor(lengths).unsqueeze(1)).long()
    mask = attn.float() * (torch.arange(ids.shape[1]) >= 8).float()
    adv = torch.where(torch.arange(ids.shape[0]) % 3 == 0, 1.0, -0.4).unsqueeze(1) * mask
    return TrainBatch(ids, attn, mask, torch.full_like(mask, -2.0) * mask, adv)


@pytest.mark.parametrize("kind", ["tiny", "tiny-lora"])
def test_the_learner_packs_a_micro_batch_into_one_call_with_the_padded_update(policy_dir: Path, kind: str) -> None:
    """Two PPO passes (pi_old from the first pass, the clip on the second), a KL reference for the full model: the
    packed learner's metrics and weights after the step equal the padded learner's; it calls the model once per
    micro-batch and update (the padded path: once per part, twice with a shared prefix)."""
    base = _model(policy_dir, kind)
    batch = _grouped_batch()
    settings: dict[str, Any] = {"lr": 1e-3, "warmup_steps": 1, "share_prefix": 4, "ppo_epochs": 2,
                                "temperature": 0.8, "kl_coef": 0.0 if kind.endswith("lora") else 0.05}  # fmt: skip
    packed = Learner(copy.deepcopy(base), LearnerConfig(**settings))
    padded = Learner(copy.deepcopy(base), LearnerConfig(**settings, pack=False))
    assert packed.packs and not padded.packs
    calls = {"packed": 0, "padded": 0}
    for name, learner in (("packed", packed), ("padded", padded)):
        inner = learner.model.get_base_model() if hasattr(learner.model, "get_base_model") else learner.model

        def count(*_: Any, name: str = name) -> None:
            calls[name] += 1

        inner.model.register_forward_hook(count)
    a, b = packed.update(batch), padded.update(batch)
    assert calls["packed"] == 2  # one micro-batch, two updates
    assert calls["padded"] > 2 * 4
    for key in ("loss", "entropy", "is_weight", "rollout_kl", "grad_norm", "tokens", "clip_frac", "ppo_kl"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    if "kl_ref" in a:
        assert a["kl_ref"] == pytest.approx(b["kl_ref"], rel=1e-3, abs=1e-7)
    # the weights after two Adam steps (lr 1e-3) within 1% of one step: Adam divides each element's update by its
    # gradients' root mean square, so where the two passes' gradients nearly cancel it magnifies the fp32 rounding
    # of two summation orders (measured on a 2-core AMD EPYC: 1.5e-6 on one LoRA A element, the gradients equal to
    # 2.5e-5 relative); a packing error moves elements by the order of a whole step
    for (name, pa), (_, pb) in zip(packed.model.named_parameters(), padded.model.named_parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-5), name
    start = dict(base.named_parameters())
    moved = max(float((pa - start[name]).detach().abs().max()) for name, pa in packed.model.named_parameters())
    assert moved > 1e-4  # the step did move the weights


@pytest.mark.parametrize("kind", ["tiny", "llama-lora"])
def test_recompute_gives_the_same_update_and_restores_the_layers(policy_dir: Path, kind: str) -> None:
    """``learner.recompute``: the decoder layers checkpointed during a packed update (their backward replays them
    under the packed attention and the same autocast): the update is the one without it; after the step the layers'
    checkpointing flags are their own again (off) and a plain forward call needs no pack."""
    base = _model(policy_dir, kind)
    batch = _grouped_batch()
    settings: dict[str, Any] = {"lr": 1e-3, "warmup_steps": 1, "share_prefix": 4, "ppo_epochs": 2}
    for precision in ("fp32", "bf16"):
        plain = Learner(copy.deepcopy(base), LearnerConfig(**settings, precision=precision))
        again = Learner(copy.deepcopy(base), LearnerConfig(**settings, precision=precision, recompute=True))
        replays: list[int] = []
        inner = again.model.get_base_model() if hasattr(again.model, "get_base_model") else again.model
        # a pre-hook: the replay stops once it has what the backward pass needs (before any post-forward hook)
        inner.model.layers[0].register_forward_pre_hook(lambda *_a, seen=replays: seen.append(1))
        a, b = plain.update(batch), again.update(batch)
        assert len(replays) == 4  # two updates, each layer's forward once and its replay once
        tol = 1e-6 if precision == "fp32" else 1e-3
        assert a["loss"] == pytest.approx(b["loss"], rel=tol, abs=tol)
        for pa, pb in zip(plain.model.parameters(), again.model.parameters(), strict=True):
            assert torch.allclose(pa, pb, atol=tol), precision
        layers = [m for m in inner.modules() if hasattr(m, "gradient_checkpointing")]
        assert layers and not any(m.gradient_checkpointing for m in layers)
        assert not any(hasattr(m, "_gradient_checkpointing_func") for m in layers)
        ids = batch.input_ids[:2, :12]
        with torch.no_grad():
            plain_call = again.model(input_ids=ids).logits
            assert torch.allclose(plain_call, again.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits)


def test_the_learner_packs_within_its_token_budget(policy_dir: Path) -> None:
    """A budget smaller than the batch: several packs, each within it (a part larger than the budget alone), the
    same update."""
    base = _model(policy_dir, "tiny")
    batch = _grouped_batch()
    small = Learner(copy.deepcopy(base), LearnerConfig(lr=1e-3, warmup_steps=1, micro_batch_tokens=40))
    large = Learner(copy.deepcopy(base), LearnerConfig(lr=1e-3, warmup_steps=1))
    rows = list(range(batch.input_ids.shape[0]))
    micros = small._micros(batch, rows)
    assert len(micros) > 2 and len(large._micros(batch, rows)) == 1
    assert sorted(r for m in micros for r in m.rows) == rows
    assert all(m.pack is not None and (m.pack.tokens <= 40 or len(m.rows) == 1) for m in micros)
    a, b = small.update(batch), large.update(batch)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    for pa, pb in zip(small.model.parameters(), large.model.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6)
