"""The warm start's ``share_prefix`` (the rows' common head run once, its keys/values the past of each row's own
tokens) and ``precision``: the same loss as whole rows, the whole-row gradient with ``prefix_grad`` and the gradient
with the head's keys/values held constant without it, whole rows where the rows share too little, and the head cut
before the first trained token."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sdk.policy.model import load_policy
from lightning_sdk.policy.warm_start import (
    WarmStartConfig,
    _batch_loss,
    _shared_prefix,
    _supervised_step,
    render_demonstration_rows,
    warm_start,
)
from tests.trainer.kv_reference import grads, lora_tiny, prefix_kv_detached
from tests.trainer.tiny import build_small_policy, calc_tasks

Rows = list[tuple[list[int], list[int]]]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden=32, layers=2)


def _calc_rows(tokenizer: Any, n: int = 6) -> Rows:
    """Real warm-start rows: calc demonstrations, all starting with the same system prompt and tools."""
    tasks = calc_tasks()
    rows: Rows = []
    for task in tasks.make_tasks(n, "train", seed=5):
        demo = tasks.demonstration(task)
        rows += render_demonstration_rows(tokenizer, demo["messages"], demo["tools"])
    return rows


def _step(
    model: torch.nn.Module, rows: Rows, share_prefix: int, pad: int, prefix_grad: bool = False, pack: bool = False
) -> tuple[float, int, int]:
    """``_supervised_step`` on all of ``rows`` (a fixed seed: the same order every call) with an optimizer that does
    not move the weights and a clip that never acts, so the gradients stay in ``.grad`` as computed. Padded rows
    unless ``pack`` (the packed path is checked against them in ``test_packed_rows_give_the_padded_step``)."""
    cfg = WarmStartConfig(
        batch_size=len(rows), grad_clip=1e9, share_prefix=share_prefix, prefix_grad=prefix_grad, pack=pack
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _s: 1.0)
    return _supervised_step(model, optimizer, scheduler, rows, random.Random(0), cfg, pad, CPU)  # type: ignore[arg-type]


def _whole_row_loss(model: torch.nn.Module, rows: Sequence[tuple[list[int], list[int]]], pad: int) -> torch.Tensor:
    """The reference loss, by hand: right-padded whole rows, labels on the trained tokens, the model's own mean."""
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.full((len(rows), width), pad)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (ids, mask) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        attn[i, : len(ids)] = 1
        labels[i, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
    model.train()
    return model(input_ids=ids_t, attention_mask=attn, labels=labels).loss  # type: ignore[no-any-return]


def _calc_setup(policy_dir: Path, kind: str) -> tuple[Any, int, Rows]:
    """The policy (``kind`` "lora": with a random LoRA adapter), its pad id and real calc warm-start rows."""
    model, tokenizer = load_policy(policy_dir)
    if kind == "lora":
        model = lora_tiny(model)
    return model, int(tokenizer.pad_token_id), _calc_rows(tokenizer)


def _flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten() for v in g.values()])


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_shared_prefix_gives_the_whole_row_loss_and_the_constant_context_gradient(policy_dir: Path, kind: str) -> None:
    model, pad, rows = _calc_setup(policy_dir, kind)
    order = random.Random(0).sample(rows, len(rows))  # what _step's batch is, in its order
    prefix = _shared_prefix(order, 8)
    first_trained = min(mask.index(1) for _, mask in rows)
    assert 8 < prefix < first_trained  # the system prompt and tools, up to where the user's questions differ
    assert len({tuple(ids[:prefix]) for ids, _ in rows}) == 1 and len({ids[prefix] for ids, _ in rows}) > 1

    off_model, on_model, ref_model = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    off_loss, off_tokens, off_prefix = _step(off_model, rows, 0, pad)
    on_loss, on_tokens, on_prefix = _step(on_model, rows, 8, pad)
    assert (off_prefix, on_prefix) == (0, prefix)
    assert on_loss == pytest.approx(off_loss, abs=1e-5) and off_loss > 0
    width = max(len(ids) for ids, _ in rows)
    assert off_tokens == len(rows) * width and on_tokens == prefix + len(rows) * (width - prefix)

    # the reference: whole rows with the prefix's keys/values detached in every layer
    with prefix_kv_detached(ref_model, prefix):
        ref_loss = _whole_row_loss(ref_model, order, pad)
    ref_loss.backward()  # type: ignore[no-untyped-call]
    assert float(ref_loss.detach()) == pytest.approx(off_loss, abs=1e-5)
    on, ref, off = grads(on_model), grads(ref_model), grads(off_model)
    assert on.keys() == ref.keys() and (kind == "full" or all("lora_" in k for k in on))
    for name in on:
        assert torch.allclose(on[name], ref[name], atol=1e-5, rtol=1e-4), name
    # and that is not the whole-row gradient: the prefix's keys/values are not trained
    diff = float((_flat(on) - _flat(off)).norm() / _flat(off).norm())
    assert diff > 1e-3, diff


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_shared_prefix_with_prefix_grad_gives_the_whole_row_gradient(policy_dir: Path, kind: str) -> None:
    """``prefix_grad`` (the default): the head runs once with autograd and its repeated keys/values stay in the
    graph, so the step's loss and gradient are the whole rows' (LoRA: the adapter's gradient through the head too),
    at ``prefix + rows x (width - prefix)`` tokens instead of ``rows x width``."""
    model, pad, rows = _calc_setup(policy_dir, kind)
    prefix = _shared_prefix(random.Random(0).sample(rows, len(rows)), 8)
    assert prefix > 8
    whole_model, shared_model = copy.deepcopy(model), copy.deepcopy(model)
    whole_loss, whole_tokens, _ = _step(whole_model, rows, 0, pad)
    shared_loss, shared_tokens, shared = _step(shared_model, rows, 8, pad, prefix_grad=True)
    assert shared == prefix and shared_tokens == whole_tokens - (len(rows) - 1) * prefix
    assert shared_loss == pytest.approx(whole_loss, abs=1e-5)
    whole, with_head = grads(whole_model), grads(shared_model)
    assert whole.keys() == with_head.keys()
    for name in whole:
        assert torch.allclose(with_head[name], whole[name], atol=1e-5, rtol=1e-4), name
    assert WarmStartConfig().prefix_grad  # the exact path is the default


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_packed_rows_give_the_padded_step(policy_dir: Path, kind: str) -> None:
    """``pack`` (the default): the step's rows as one packed sequence, whole or with the shared head once, give the
    padded whole rows' loss and gradient in one model call over the real tokens only (no padding)."""
    model, pad, rows = _calc_setup(policy_dir, kind)
    prefix = _shared_prefix(random.Random(0).sample(rows, len(rows)), 8)
    whole_model = copy.deepcopy(model)
    whole_loss, whole_tokens, _ = _step(whole_model, rows, 0, pad)
    whole = grads(whole_model)
    assert WarmStartConfig().pack
    for share in (0, 8):
        packed_model = copy.deepcopy(model)
        calls: list[int] = []
        inner = packed_model.get_base_model() if kind == "lora" else packed_model
        inner.model.register_forward_hook(lambda *_a, seen=calls: seen.append(1))
        loss, tokens, shared = _step(packed_model, rows, share, pad, prefix_grad=True, pack=True)
        assert calls == [1] and shared == (prefix if share else 0)
        real = sum(len(ids) for ids, _ in rows)
        assert tokens == (real - (len(rows) - 1) * prefix if share else real) < whole_tokens
        assert loss == pytest.approx(whole_loss, abs=1e-5)
        packed = grads(packed_model)
        assert packed.keys() == whole.keys()
        for name in whole:
            assert torch.allclose(packed[name], whole[name], atol=1e-5, rtol=1e-4), (share, name)


def test_rows_that_share_fewer_than_share_prefix_tokens_run_whole_rows(policy_dir: Path) -> None:
    model, tokenizer = load_policy(policy_dir)
    pad = int(tokenizer.pad_token_id)
    rows = _calc_rows(tokenizer, 4)
    shared = _shared_prefix(rows, 1)
    assert shared > 0
    assert _shared_prefix(rows, shared) == shared and _shared_prefix(rows, shared + 1) == 0
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    off = _step(a, rows, 0, pad)
    too_long = _step(b, rows, shared + 1, pad)
    assert too_long == off  # the same path: bit for bit, tokens and prefix 0 included
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.grad is not None and pb.grad is not None and torch.equal(pa.grad, pb.grad), name
    # rows that differ early share nothing worth it
    other = [([5, 6, 7, *ids[3:]], mask) for ids, mask in rows[:1]]
    assert _shared_prefix(rows + other, 8) == 0
    assert _shared_prefix(rows, 0) == 0  # off


def test_the_prefix_is_cut_before_the_first_trained_token(policy_dir: Path) -> None:
    """Three rows share their first 20 tokens; one of them trains from position 10, whose prediction is made at
    position 9: the prefix is the first 9 tokens (none trained, nor the one that predicts a trained token), and
    the loss is still the whole rows'. Each row keeps at least one token of its own."""
    model, tokenizer = load_policy(policy_dir)
    pad = int(tokenizer.pad_token_id)
    g = torch.Generator().manual_seed(3)
    head = torch.randint(10, 300, (20,), generator=g).tolist()
    rows: Rows = []
    for n, first in ((30, 25), (27, 10), (33, 22)):
        ids = head + torch.randint(10, 300, (n - 20,), generator=g).tolist()
        rows.append((ids, [0] * first + [1] * (n - first)))
    assert _shared_prefix(rows, 4) == 9
    assert _shared_prefix(rows, 10) == 0  # the cut leaves fewer than share_prefix tokens: whole rows
    assert _shared_prefix(rows[:1] + rows[2:], 4) == 20  # without that row: the whole common head
    same = [(head, [0] * 20), (head, [0] * 20)]
    assert _shared_prefix(same, 4) == 19  # identical untrained rows: one token left to each
    off, _ = _batch_loss(model, rows, pad, CPU, 0)
    on, tokens = _batch_loss(model, rows, pad, CPU, 9)
    assert float(on.detach()) == pytest.approx(float(off.detach()), abs=1e-5)
    assert tokens == 9 + 3 * (33 - 9)


def test_warm_start_reports_the_prefix_and_autocasts_with_bf16(
    policy_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``warm_start`` with ``share_prefix``: the result says the prefix the last step shared; ``precision = "bf16"``
    (and ``auto`` where the CPU has bf16) runs both the prefix's and the rows' passes under bf16 autocast, with a
    loss near fp32's; fp32 runs none."""
    import lightning_sdk.precision as precision
    from lightning_sdk.trainer import learner

    assert learner.cpu_has_bf16 is precision.cpu_has_bf16  # the learner's name still works
    model, tokenizer = load_policy(policy_dir)
    tasks = calc_tasks()
    demos = [tasks.demonstration(t) for t in tasks.make_tasks(8, "train", seed=3)]

    def run(precision_: str, pack: bool = False) -> tuple[Any, list[bool]]:
        m = copy.deepcopy(model)
        seen: list[bool] = []
        m.register_forward_hook(lambda *_a: seen.append(torch.is_autocast_enabled("cpu")))
        cfg = WarmStartConfig(batch_size=4, max_steps=1, eval_every=100, threads=1, share_prefix=8,
                              precision=precision_, pack=pack)  # fmt: skip
        return warm_start(m, tokenizer, demos, lambda _m: 0.0, cfg), seen

    fp32, seen32 = run("fp32")
    assert fp32.steps == 1 and fp32.shared_prefix > 8
    assert seen32 == [False, False]  # the prefix's pass and the rows' pass
    bf16, seen16 = run("bf16")
    assert bf16.shared_prefix == fp32.shared_prefix and seen16 == [True, True]
    packed, seen_packed = run("bf16", pack=True)
    assert packed.shared_prefix == fp32.shared_prefix and seen_packed == [True]  # one packed pass
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    _, seen_auto = run("auto")
    assert seen_auto == [True, True]
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    _, seen_auto = run("auto")
    assert seen_auto == [False, False]


def test_bf16_loss_stays_near_fp32(policy_dir: Path) -> None:
    model, tokenizer = load_policy(policy_dir)
    pad = int(tokenizer.pad_token_id)
    rows = _calc_rows(tokenizer, 4)
    prefix = _shared_prefix(rows, 8)
    fp32, _ = _batch_loss(model, rows, pad, CPU, prefix)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16, _ = _batch_loss(model, rows, pad, CPU, prefix)
    assert float(bf16) == pytest.approx(float(fp32), rel=2e-2)
