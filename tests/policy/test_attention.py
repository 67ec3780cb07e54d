"""``use_gqa_attention`` on the training side: the learner's and the warm start's masked passes (padded rows, rows
after a shared prefix's cache) keep a grouped-query model's keys/values grouped and compute the same log-probs and
gradients as transformers' own SDPA attention (a real Llama of 4 query heads over 2 key/value heads, random
weights, with and without LoRA)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_sdk.policy.attention import GQA_ATTENTION, use_gqa_attention
from lightning_sdk.trainer.learner import Learner, LearnerConfig, LoraSettings, token_logprobs


def _llama(kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=256, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, 40), generator=gen)
    ids[:, :24] = ids[0, :24]  # a shared head of 24 tokens
    mask = torch.ones_like(ids)
    mask[1, 33:] = 0  # right-padded rows
    mask[2, 29:] = 0
    return ids, mask


@pytest.mark.parametrize("prefix", [0, 24])
def test_masked_passes_equal_transformers_sdpa(prefix: int) -> None:
    reference = _llama()
    model = copy.deepcopy(reference)
    assert use_gqa_attention(model) and model.config._attn_implementation == GQA_ATTENTION
    assert reference.config._attn_implementation == "sdpa"
    ids, mask = _batch()
    out = []
    for m in (reference, model):
        m.zero_grad()
        logp, _ = token_logprobs(m, ids, mask, prefix=prefix, keep_from=prefix, prefix_grad=False)
        (logp * mask[:, 1:]).sum().backward()
        out.append((logp.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (ref_lp, ref_grads), (lp, grads) = out
    assert lp.abs().sum() > 0 and torch.allclose(lp, ref_lp, atol=1e-5)
    assert ref_grads.keys() == grads.keys() and len(grads) > 0
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-5), name


def test_the_learner_sets_grouped_attention_on_its_lora_model() -> None:
    learner = Learner(_llama(), LearnerConfig(lora=LoraSettings(rank=4, alpha=8.0), share_prefix=8))
    assert learner.model.config._attn_implementation == GQA_ATTENTION


def test_models_without_grouped_heads_or_sdpa_are_left_alone() -> None:
    plain = _llama(kv_heads=4)  # no groups: the function itself defers to transformers' SDPA
    assert use_gqa_attention(plain)
    eager = _llama()
    eager.set_attn_implementation("eager")
    assert not use_gqa_attention(eager) and eager.config._attn_implementation == "eager"
