"""``LearnerConfig.prefix_grad``: False runs the shared prefix of ``token_logprobs`` under no_grad. The log-probs are
those of the exact path and of whole rows; the gradient is the whole rows' with the prefix's keys/values held
constant (a hand-built reference), which differs from the exact gradient; every call site gets the flag."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sdk.policy.model import load_policy
from lightning_sdk.trainer.learner import Learner, LearnerConfig, TrainBatch, first_trained, token_logprobs
from tests.trainer.kv_reference import grads, lora_tiny, prefix_kv_detached
from tests.trainer.tiny import build_small_policy

PROMPT = 12


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


def _group(seed: int = 4, rows: int = 4, width: int = 26, vocab: int = 300, train_from: int = 8) -> TrainBatch:
    """One group's rows: the same 12-token prompt, then ragged completions (right padded), trained from token
    ``train_from`` to each row's end (8: inside the prompt, so columns the shared prefix's positions predict are
    trained, as a group's first sampled token always is); advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(10, vocab, (PROMPT,), generator=g)
    ids = torch.zeros(rows, width, dtype=torch.long)
    attn = torch.zeros(rows, width, dtype=torch.long)
    for i in range(rows):
        n = width - 3 * i
        ids[i, :PROMPT] = prompt
        ids[i, PROMPT:n] = torch.randint(10, vocab, (n - PROMPT,), generator=g)
        attn[i, :n] = 1
    mask = attn.float() * (torch.arange(width) >= train_from).float()
    adv = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0).unsqueeze(1) * mask
    with torch.no_grad():
        logp = torch.full((rows, width), -3.0) * mask
    return TrainBatch(ids, attn, mask, logp, adv)


def _model(policy_dir: Path, kind: str) -> Any:
    model, _ = load_policy(policy_dir)
    return lora_tiny(model) if kind == "lora" else model


def test_prefix_grad_false_gives_the_same_logprobs(policy_dir: Path) -> None:
    model = _model(policy_dir, "full")
    batch = _group()
    ids, attn = batch.input_ids, batch.attention_mask
    real = attn[:, 1:].bool()
    keep = first_trained(batch.loss_mask)
    assert 0 < keep < PROMPT  # the prefix holds kept columns: its logits come out of the no-grad pass
    with torch.no_grad():
        plain, plain_ent = token_logprobs(model, ids, attn)
    for keep_from in (0, keep):
        cols = real.clone()
        cols[:, :keep_from] = False
        exact, _ = token_logprobs(model, ids, attn, prefix=PROMPT, keep_from=keep_from)
        const, const_ent = token_logprobs(model, ids, attn, prefix=PROMPT, keep_from=keep_from, prefix_grad=False)
        assert torch.allclose(const[cols], exact[cols].detach(), atol=1e-5), keep_from
        assert torch.allclose(const[cols], plain[cols], atol=1e-5), keep_from
        assert torch.allclose(const_ent[cols], plain_ent[cols], atol=1e-5), keep_from
        assert const.requires_grad  # the rows' own tokens still carry the gradient


@pytest.mark.parametrize(("kind", "train_from"), [("full", 8), ("lora", 8), ("full", 16), ("lora", 16)])
def test_prefix_grad_false_is_the_gradient_with_the_prefix_held_constant(
    policy_dir: Path, kind: str, train_from: int
) -> None:
    """The reference: whole rows with the keys/values of the constant head detached by hand, the head being the
    shared prompt cut at the first trained column (``keep_from``: from there every column carries its gradient,
    the first own token's included, whose prediction is made at the prompt's last position)."""
    base = _model(policy_dir, kind)
    batch = _group(train_from=train_from)
    ids, attn, mask = batch.input_ids, batch.attention_mask, batch.loss_mask
    keep = first_trained(mask)
    constant = min(PROMPT, keep)
    assert constant == (keep if train_from < PROMPT else PROMPT)
    weights = mask[:, 1:] * torch.linspace(-1, 1, mask.shape[1] - 1)
    const_model, exact_model, ref_model = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    const, _ = token_logprobs(const_model, ids, attn, prefix=PROMPT, keep_from=keep, prefix_grad=False)
    (const * weights).sum().backward()  # type: ignore[no-untyped-call]
    exact, _ = token_logprobs(exact_model, ids, attn, prefix=PROMPT, keep_from=keep)
    (exact * weights).sum().backward()  # type: ignore[no-untyped-call]
    with prefix_kv_detached(ref_model, constant):  # whole rows, the head's keys/values detached by hand
        ref, _ = token_logprobs(ref_model, ids, attn)
    (ref * weights).sum().backward()  # type: ignore[no-untyped-call]
    g_const, g_exact, g_ref = grads(const_model), grads(exact_model), grads(ref_model)
    assert g_const.keys() == g_ref.keys() and (kind == "full" or all("lora_" in k for k in g_const))
    for name in g_const:
        assert torch.allclose(g_const[name], g_ref[name], atol=1e-5, rtol=1e-4), name
    flat_const = torch.cat([v.flatten() for v in g_const.values()])
    flat_exact = torch.cat([v.flatten() for v in g_exact.values()])
    diff = float((flat_const - flat_exact).norm() / flat_exact.norm())
    assert diff > 1e-3, diff  # the prompt's representation matters: the exact gradient is another one


def test_the_learner_threads_prefix_grad_to_every_call(policy_dir: Path) -> None:
    """``LearnerConfig.prefix_grad`` reaches every ``token_logprobs`` call of a step (pi_old's pass, the update's,
    the KL reference's); an update's loss is the exact path's (same log-probs), its gradient another. Both learners
    run padded rows (``pack = False``; packing runs only with ``prefix_grad``, tests/policy/test_packed.py)."""
    import lightning_sdk.trainer.learner as learner_module

    model, _ = load_policy(policy_dir)
    batch = _group()
    settings = {"lr": 1e-3, "warmup_steps": 1, "share_prefix": 8, "kl_coef": 0.1, "ppo_epochs": 2,
                "reuse_first_pass": False, "pack": False}  # fmt: skip
    exact = Learner(copy.deepcopy(model), LearnerConfig(**settings))
    const = Learner(copy.deepcopy(model), LearnerConfig(**settings, prefix_grad=False))
    real = token_logprobs
    calls: list[tuple[int, bool]] = []

    def spy(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((int(kwargs.get("prefix", 0)), bool(kwargs.get("prefix_grad", True))))
        return real(*args, **kwargs)

    learner_module.token_logprobs = spy
    try:
        a = exact.update(batch)
        exact_calls, calls[:] = list(calls), []
        b = const.update(batch)
    finally:
        learner_module.token_logprobs = real
    # pi_old's pass, then per update the policy's and the reference's: 1 + 2 x 2
    assert len(calls) == len(exact_calls) == 5
    assert all(prefix == PROMPT for prefix, _ in calls)
    assert all(flag for _, flag in exact_calls) and not any(flag for _, flag in calls)
    assert a["updates"] == b["updates"] == 2.0
    # one update: its loss and KL are the log-probs' (the same), its gradient is not the exact one
    one = {**settings, "ppo_epochs": 1}
    a = Learner(copy.deepcopy(model), LearnerConfig(**one)).update(batch)
    b = Learner(copy.deepcopy(model), LearnerConfig(**one, prefix_grad=False)).update(batch)
    assert a["loss"] != 0.0 and a["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # the reference is the starting policy
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert b["grad_norm"] != pytest.approx(a["grad_norm"], rel=1e-3)


def test_prefix_grad_defaults_on() -> None:
    assert LearnerConfig().prefix_grad is True
    assert "prefix_grad" in LearnerConfig.model_fields
