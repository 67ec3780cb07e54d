"""The learner and its losses: verl's math, loss going down on a fixed batch, micro-batching, checkpoints."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_sdk.errors import ConfigError, TrainerError
from lightning_sdk.policy.model import load_policy
from lightning_sdk.trainer.learner import (
    Learner,
    LearnerConfig,
    TrainBatch,
    cpu_has_bf16,
    first_trained,
    token_logprobs,
)
from lightning_sdk.trainer.losses import LossSettings, get_policy_loss, policy_loss_names
from tests.trainer.tiny import build_small_policy


class _VerlActorConfig(SimpleNamespace):
    """The four fields verl's vanilla loss reads from its ActorConfig (a dict-like ``get`` included)."""

    def get(self, key: str, default: object = None) -> object:
        return getattr(self, key, default)


@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_equals_verl_vanilla(clip: tuple[float, float]) -> None:
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    g = torch.Generator().manual_seed(0)
    shape = (6, 17)
    old = -torch.rand(shape, generator=g) * 3
    new = old + torch.randn(shape, generator=g) * 0.4  # ratios well outside the clip range too
    adv = torch.randn(shape, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    weights = torch.rand(shape, generator=g) * 2
    low, high = clip
    cfg = _VerlActorConfig(
        clip_ratio=low, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0, global_batch_info={}
    )
    verl_loss, verl_metrics = compute_policy_loss_vanilla(
        old, new, adv, mask, loss_agg_mode="token-mean", config=cfg, rollout_is_weights=weights
    )
    per_token, metrics = get_policy_loss("ppo_clip")(old, new, adv, mask, LossSettings(low, high, 3.0))
    ours = (per_token * weights * mask).sum() / mask.sum()
    assert float(ours) == pytest.approx(float(verl_loss), rel=1e-6, abs=1e-7)
    assert metrics["clip_frac"] == pytest.approx(verl_metrics["actor/pg_clipfrac"], abs=1e-6)
    assert metrics["ppo_kl"] == pytest.approx(verl_metrics["actor/ppo_kl"], abs=1e-6)


def test_unknown_loss_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="ppo_clip"):
        get_policy_loss("nope")
    assert "ppo_clip" in policy_loss_names()


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


def _batch(seed: int = 0, rows: int = 6, width: int = 24, vocab: int = 300) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    for i in range(rows):  # ragged rows, right padded
        n = width - 2 * i
        attn[i, n:] = 0
        ids[i, n:] = 0
    loss_mask = torch.zeros(rows, width)
    loss_mask[:, 10:] = 1
    loss_mask *= attn
    adv = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0).unsqueeze(1).expand(rows, width) * loss_mask
    return TrainBatch(ids, attn, loss_mask, torch.zeros(rows, width), adv.clone())


def _with_rollout_logprobs(model: torch.nn.Module, batch: TrainBatch) -> TrainBatch:
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask)
    full = torch.zeros_like(batch.logprobs)
    full[:, 1:] = lp * batch.loss_mask[:, 1:]
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, full, batch.advantages)


def test_update_raises_the_likelihood_of_good_rows(policy_dir: Path) -> None:
    model, _ = load_policy(policy_dir)
    batch = _with_rollout_logprobs(model, _batch())
    learner = Learner(model, LearnerConfig(lr=3e-3, warmup_steps=1))

    def objective() -> float:
        with torch.no_grad():
            lp, _ = token_logprobs(learner.model, batch.input_ids, batch.attention_mask)
        m = batch.loss_mask[:, 1:]
        return float((lp * batch.advantages[:, 1:] * m).sum() / m.sum())

    start = objective()
    losses = [learner.update(_with_rollout_logprobs(learner.model, batch))["loss"] for _ in range(8)]
    assert objective() > start + 0.05
    assert all(torch.isfinite(torch.tensor(losses)))
    assert learner.steps == 8


def test_on_policy_importance_weights_are_one_and_off_policy_are_capped(policy_dir: Path) -> None:
    model, _ = load_policy(policy_dir)
    learner = Learner(model, LearnerConfig(lr=1e-4, tis_cap=2.0))
    on = _with_rollout_logprobs(model, _batch(1))
    assert learner.update(on)["is_weight"] == pytest.approx(1.0, abs=1e-4)
    off = TrainBatch(on.input_ids, on.attention_mask, on.loss_mask, on.logprobs - 5.0 * on.loss_mask, on.advantages)
    assert learner.update(off)["is_weight"] == pytest.approx(2.0, abs=1e-4)


def test_micro_batches_give_the_same_update(policy_dir: Path) -> None:
    model, _ = load_policy(policy_dir)
    batch = _with_rollout_logprobs(model, _batch(2))
    whole = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1, micro_batch_tokens=10_000))
    split = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1, micro_batch_tokens=30))
    a, b = whole.update(batch), split.update(batch)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for (k, pa), (_, pb) in zip(whole.model.state_dict().items(), split.model.state_dict().items(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6), k


def test_kl_to_reference_is_reported(policy_dir: Path) -> None:
    model, _ = load_policy(policy_dir)
    learner = Learner(model, LearnerConfig(lr=1e-2, warmup_steps=1, kl_coef=0.1))
    batch = _with_rollout_logprobs(model, _batch(3))
    first = learner.update(batch)
    second = learner.update(_with_rollout_logprobs(learner.model, batch))
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert second["kl_ref"] > 0.0


def test_state_dict_round_trip_resumes_exactly(policy_dir: Path) -> None:
    model, _ = load_policy(policy_dir)
    a = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=3))
    a.update(_with_rollout_logprobs(a.model, _batch(4)))
    b = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=3))
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    nxt = _with_rollout_logprobs(a.model, _batch(5))
    ma, mb = a.update(nxt), b.update(nxt)
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-7) and ma["lr"] == mb["lr"]
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_batch_shapes_are_checked() -> None:
    b = _batch()
    with pytest.raises(TrainerError, match="loss_mask"):
        TrainBatch(b.input_ids, b.attention_mask, b.loss_mask[:, :-1], b.logprobs, b.advantages)


def test_one_update_per_step_never_clips_several_updates_do(policy_dir: Path) -> None:
    """With one update the ratio is 1 when the gradient is taken (a policy gradient); with ``ppo_epochs`` /
    ``mini_batches`` the later updates see the moved policy and the clip acts."""
    model, _ = load_policy(policy_dir)
    batch = _with_rollout_logprobs(model, _batch(3))
    single = Learner(copy.deepcopy(model), LearnerConfig(lr=3e-2, warmup_steps=1))
    one = single.update(batch)
    assert one["updates"] == 1 and one["clip_frac"] == 0.0 and one["ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    several = Learner(copy.deepcopy(model), LearnerConfig(lr=3e-2, warmup_steps=1, ppo_epochs=3, mini_batches=2))
    out = several.update(batch)
    assert out["updates"] == 6 and several.steps == 1
    assert out["clip_frac"] > 0.0  # later updates moved past 1 +- 0.2 and were clipped
    assert out["tokens"] == float(batch.loss_mask[:, 1:].sum())


def test_precomputed_old_logprobs_give_the_single_update(policy_dir: Path) -> None:
    """``ppo_epochs=1, mini_batches=1`` takes pi_old from the update's own forward; one slice with pi_old computed up
    front (the path of several updates) must make the same update."""
    model, _ = load_policy(policy_dir)
    batch = _with_rollout_logprobs(model, _batch(4))
    a = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1))
    b = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1))
    ra = a.update(batch)
    rows = list(range(batch.input_ids.shape[0]))
    rb = b._update(batch, rows, b._micros(batch, rows), b._logprobs(batch))
    assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-5)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_step_takes_records_and_builds_its_own_batch(policy_dir: Path) -> None:
    """The learner protocol is ``step(records)``: the embedded learner pads them itself (``train_batch``, advantages
    weighted by each row's share of its rollout), the same update as ``update`` on that batch."""
    import numpy as np

    from lightning_sdk.records.record import CallSpan, Record, Segment
    from lightning_sdk.trainer.learner import train_batch

    model, _ = load_policy(policy_dir)
    records = []
    for i, n in enumerate([9, 12, 7]):
        ids = np.arange(10, 10 + n, dtype=np.int32) + i
        mask = np.array([0] * 4 + [1] * (n - 4), dtype=np.int8)
        seg = Segment(attempt_id=f"a{i}", rollout_id=f"r{i}", index=0, input_ids=ids, loss_mask=mask,
                      logprobs=-0.5 * mask.astype(np.float64),
                      spans=(CallSpan(call_id=f"c{i}", seq=0, start=4, end=n, policy_version=0),))  # fmt: skip
        records.append(Record(seg, "g", float(i % 2), (1.0 if i % 2 else -1.0) * mask, weight=0.5 + 0.25 * i))
    batch = train_batch(records, pad_id=0)
    assert batch.input_ids.shape == (3, 12) and batch.input_ids[2, 7:].tolist() == [0] * 5
    assert batch.advantages[2, 4:7].tolist() == pytest.approx([-1.0] * 3)  # weight 1.0
    assert batch.advantages[1, 4:].tolist() == pytest.approx([0.75] * 8)
    a = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1))
    b = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1))
    assert a.step(records)["loss"] == pytest.approx(b.update(batch)["loss"], abs=1e-6)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def _grouped_batch(seed: int = 7, vocab: int = 300) -> TrainBatch:
    """Rows as a step's groups have them: each group's rows start with the group's prompt (12 and 15 tokens, the
    first 9 the same system head in both), then their own ragged completions (right padded); one row shares
    nothing."""
    g = torch.Generator().manual_seed(seed)
    width = 30
    head = torch.randint(10, vocab, (9,), generator=g)
    spec = [(0, 12, 4), (1, 15, 3), (2, 0, 1)]  # (group, prompt length, rows)
    ids, attn, loss_mask = [], [], []
    for group, prompt_len, n in spec:
        prompt = torch.cat([head, torch.randint(10, vocab, (prompt_len - 9,), generator=g)]) if prompt_len else None
        for r in range(n):
            length = width - 3 * r - group
            row = torch.zeros(width, dtype=torch.long)
            if prompt is not None:
                row[:prompt_len] = prompt
            row[prompt_len:length] = torch.randint(10, vocab, (length - prompt_len,), generator=g)
            ids.append(row)
            attn.append((torch.arange(width) < length).long())
            loss_mask.append(((torch.arange(width) >= max(prompt_len, 10)) & (torch.arange(width) < length)).float())
    ids_t, attn_t, mask_t = torch.stack(ids), torch.stack(attn), torch.stack(loss_mask)
    rows = ids_t.shape[0]
    adv = torch.where(torch.arange(rows) % 3 == 0, 1.0, -0.3).unsqueeze(1) * mask_t
    return TrainBatch(ids_t, attn_t, mask_t, torch.zeros(rows, width), adv)


def test_prefix_pieces_group_rows_by_their_shared_prompt() -> None:
    from lightning_sdk.trainer.learner import _prefix_pieces

    batch = _grouped_batch()
    lengths = [int(n) for n in batch.attention_mask.sum(-1).tolist()]
    pieces, rest = _prefix_pieces(batch.input_ids, lengths, 8, 10_000)
    assert sorted((sorted(rows), prefix) for rows, prefix in pieces) == [([0, 1, 2, 3], 12), ([4, 5, 6], 15)]
    assert rest == [7]
    # all seven share the 9-token head, but cutting by group saves more (3 x 12 + 2 x 15 against 6 x 9 tokens)
    assert _prefix_pieces(batch.input_ids, lengths, 4, 10_000)[0] == pieces
    # a tight budget cuts a group into several micro-batches, each still sharing the prompt (a lone row: none)
    small, _ = _prefix_pieces(batch.input_ids, lengths, 8, 12 + 2 * 18)
    assert sorted((sorted(rows), prefix) for rows, prefix in small) == [
        ([0, 1], 12),
        ([2, 3], 12),
        ([4], 0),
        ([5, 6], 15),
    ]
    assert _prefix_pieces(batch.input_ids, lengths, 0, 10_000) == ([], list(range(8)))


def test_shared_prefix_gives_the_same_logprobs_and_update(policy_dir: Path) -> None:
    model, _ = load_policy(policy_dir)
    batch = _with_rollout_logprobs(model, _grouped_batch())
    ids, attn = batch.input_ids[:4], batch.attention_mask[:4]
    with torch.no_grad():
        plain, plain_entropy = token_logprobs(model, ids, attn)
        shared, shared_entropy = token_logprobs(model, ids, attn, prefix=12)
    real = attn[:, 1:].bool()
    assert torch.allclose(plain[real], shared[real], atol=1e-5)
    assert torch.allclose(plain_entropy[real], shared_entropy[real], atol=1e-5)

    off = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1, share_prefix=0))
    on = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1, share_prefix=8))
    assert len(on._pieces(batch.input_ids, batch.attention_mask)) == 3  # two shared groups + the lone row
    a, b = off.update(batch), on.update(batch)
    assert a["loss"] != 0.0
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    _assert_same_update(model, off.model, on.model)


def _assert_same_update(start: torch.nn.Module, a: torch.nn.Module, b: torch.nn.Module) -> None:
    """``a`` and ``b`` took the same optimizer update from ``start``: their weight changes agree to 1e-4 of the
    update's norm, and no more than 1 in 5,000 weights differ by over 1e-6 (Adam's first step is about lr times the
    gradient's sign, so a weight whose gradient is ~1e-9 in both may move either way on float rounding alone)."""
    base = start.state_dict()
    da = torch.cat([(v - base[k]).flatten() for k, v in a.state_dict().items()])
    db = torch.cat([(v - base[k]).flatten() for k, v in b.state_dict().items()])
    assert float(da.norm()) > 0
    assert float((da - db).norm() / da.norm()) < 1e-4
    assert int(((da - db).abs() > 1e-6).sum()) <= max(1, da.numel() // 5000)


def test_keep_from_skips_the_untrained_columns_with_the_same_values_and_update(policy_dir: Path) -> None:
    """``keep_from`` (the first trained column, ``first_trained``): the output head runs only from there; the kept
    columns' log-probs, entropies and gradients equal the full pass's, with and without a shared prefix, and the
    columns before it are 0. The learner's update with it moves the weights as the full pass did."""
    model, _ = load_policy(policy_dir)
    batch = _with_rollout_logprobs(model, _grouped_batch())
    ids, attn, mask = batch.input_ids[:4], batch.attention_mask[:4], batch.loss_mask[:4]
    keep = first_trained(mask)
    assert keep == int(torch.nonzero(mask.any(0))[0, 0]) - 1 and keep > 0
    assert first_trained(torch.zeros_like(mask)) == 0
    cols = attn[:, 1:].bool()
    cols[:, :keep] = False
    assert keep < 12  # the four rows share a 12-token prompt
    for prefix in (0, 12, keep - 2):  # no prefix, a shared prefix past the first kept column, one before it
        full_model, kept_model = copy.deepcopy(model), copy.deepcopy(model)
        full, full_ent = token_logprobs(full_model, ids, attn, prefix=prefix)
        kept, kept_ent = token_logprobs(kept_model, ids, attn, prefix=prefix, keep_from=keep)
        assert kept.shape == full.shape and kept_ent.shape == full_ent.shape
        assert torch.allclose(full[cols], kept[cols], atol=1e-5), prefix
        assert torch.allclose(full_ent[cols], kept_ent[cols], atol=1e-5), prefix
        assert torch.count_nonzero(kept[:, :keep]) == 0 and torch.count_nonzero(full[:, :keep]) > 0
        weights = mask[:, 1:] * torch.linspace(-1, 1, mask.shape[1] - 1)
        (full * weights).sum().backward()
        (kept * weights).sum().backward()
        for (name, a), (_, b) in zip(full_model.named_parameters(), kept_model.named_parameters(), strict=True):
            assert a.grad is not None and b.grad is not None, name
            assert torch.allclose(a.grad, b.grad, atol=1e-5), (prefix, name)

    # the padded path's keep_from (packed rows compute only the trained columns anyway: tests/policy/test_packed.py)
    learner = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, warmup_steps=1, share_prefix=8, pack=False))
    plain = copy.deepcopy(learner)
    calls: list[int] = []
    real = token_logprobs

    def full_pass(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(int(kwargs.pop("keep_from", 0)))  # type: ignore[call-overload]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    import lightning_sdk.trainer.learner as learner_module

    a = learner.update(batch)
    learner_module.token_logprobs = full_pass  # type: ignore[assignment]
    try:
        b = plain.update(batch)
    finally:
        learner_module.token_logprobs = real
    assert calls and max(calls) > 0  # the update asked for the kept columns only
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["loss"] != 0.0
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    _assert_same_update(model, learner.model, plain.model)


def test_an_update_sets_its_threads_intra_op_threads(policy_dir: Path) -> None:
    """The learner's step runs in a worker thread next to the engine's: it sets that thread's own count and leaves
    the other threads' alone (torch keeps the count per thread)."""
    import threading

    model, _ = load_policy(policy_dir)
    learner = Learner(model, LearnerConfig(lr=1e-3, warmup_steps=1, threads=1))
    batch = _with_rollout_logprobs(model, _batch(6))
    torch.set_num_threads(2)
    seen: list[int] = []

    def work() -> None:
        torch.set_num_threads(2)
        learner.update(batch)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == 2


def _demonstration_batch(policy_dir: Path, n: int = 12) -> TrainBatch:
    """Real rows: calc demonstrations rendered with the policy's own tokenizer and chat template (the warm start's
    rows: the assistant turns trained), with advantages of +-1 and the policy's own log-probs as the rollout's."""
    from lightning_sdk.policy.warm_start import render_demonstration_rows
    from tests.trainer.tiny import calc_tasks

    model, tokenizer = load_policy(policy_dir)
    tasks = calc_tasks()
    rows: list[tuple[list[int], list[int]]] = []
    for task in tasks.make_tasks(n, "train", seed=5):
        demo = tasks.demonstration(task)
        rows += render_demonstration_rows(tokenizer, demo["messages"], demo["tools"])
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.zeros(len(rows), width, dtype=torch.long)
    attn_t = torch.zeros(len(rows), width, dtype=torch.long)
    mask_t = torch.zeros(len(rows), width)
    for i, (ids, mask) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        attn_t[i, : len(ids)] = 1
        mask_t[i, : len(ids)] = torch.tensor(mask, dtype=torch.float)
    adv = torch.where(torch.arange(len(rows)) % 2 == 0, 1.0, -1.0).unsqueeze(1) * mask_t
    return _with_rollout_logprobs(model, TrainBatch(ids_t, attn_t, mask_t, torch.zeros(len(rows), width), adv))


def _update_of(policy_dir: Path, batch: TrainBatch, **settings: object) -> tuple[dict[str, float], torch.Tensor]:
    """One step's metrics and the weights' change (flattened) from the same starting weights."""
    model, _ = load_policy(policy_dir)
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    learner = Learner(model, LearnerConfig(lr=1e-3, warmup_steps=1, ppo_epochs=2, temperature=0.6, **settings))
    metrics = learner.update(batch)
    return metrics, torch.cat([p.detach().flatten() for p in model.parameters()]) - start


def test_pi_old_from_the_first_pass_gives_the_same_update_as_a_separate_pass(policy_dir: Path) -> None:
    """``reuse_first_pass``: with two PPO passes the first update's forward pass runs on the step's starting weights,
    so its log-probs are pi_old: the same losses, clip fractions and update as computing them in a pass of their
    own (one forward pass fewer per step)."""
    batch = _demonstration_batch(policy_dir)
    separate, d_separate = _update_of(policy_dir, batch, reuse_first_pass=False)
    reused, d_reused = _update_of(policy_dir, batch, reuse_first_pass=True)
    assert separate["updates"] == reused["updates"] == 2.0
    assert separate["clip_frac"] > 0 or separate["ppo_kl"] != 0  # the second update saw a ratio away from 1
    for key in ("loss", "clip_frac", "ppo_kl", "entropy", "is_weight"):
        assert reused[key] == pytest.approx(separate[key], rel=1e-5, abs=1e-7), key
    assert float((d_reused - d_separate).norm() / d_separate.norm()) < 1e-5


@pytest.mark.skipif(not cpu_has_bf16(), reason="the CPU has no AVX-512 BF16 / AMX (bf16 would be emulated)")
def test_bf16_autocast_stays_within_tolerance_of_fp32(policy_dir: Path) -> None:
    """``precision = "bf16"`` (autocast of the forward passes; weights, gradients and the optimizer fp32): on real
    calc rows the step's loss stays within 2% (relative, or 2e-3 absolute) of fp32's and the update within 10%
    (relative norm of the difference of the weights' change), the same direction (cosine > 0.99)."""
    batch = _demonstration_batch(policy_dir)
    fp32, d32 = _update_of(policy_dir, batch, precision="fp32")
    bf16, d16 = _update_of(policy_dir, batch, precision="bf16")
    assert fp32["loss"] != 0.0
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2, abs=2e-3)
    assert bf16["entropy"] == pytest.approx(fp32["entropy"], rel=2e-2)
    rel = float((d16 - d32).norm() / d32.norm())
    cosine = float(torch.nn.functional.cosine_similarity(d16, d32, dim=0))
    assert rel < 0.10 and cosine > 0.99, (rel, cosine)
    assert rel > 0  # bf16 did run: the update is not bit-identical
