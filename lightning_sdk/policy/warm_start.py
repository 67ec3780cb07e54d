"""The warm start: a short supervised phase on demonstrations, stopped on measured success.

A freshly initialised policy never emits a well-formed tool call, so RL would have no signal (every reward 0).
Real recipes start from a model that already follows the format; here a few dozen supervised steps on the example's
demonstrations teach it. Success jumps sharply between steps, so the phase stops on measured success (the first
evaluation at or above ``target_success``), not on a fixed step count: the policy then knows the format but not yet
the task, which is what RL is for.

Only assistant turns are trained (the loss mask), each up to and including its end-of-turn token: the same tokens
the policy will later sample.

With ``share_prefix``, the head that a step's rows all start with (the system prompt and tools: 37 of the calc
example's ~89 tokens, ~5.7k of ~5.7k+ for Codex) runs once and each row's own tokens run after its keys/values: the
loss is the whole-row loss; with ``prefix_grad`` (the default) the gradient is the whole-row gradient too, without it
the head runs without autograd and its keys/values are held constant (the head is context, never trained: what a
multi-thousand-token head needs for memory).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_sdk.errors import TokenizationError
from lightning_sdk.policy.attention import use_gqa_attention
from lightning_sdk.policy.packed import pack_rows, packed_logits, supports_packing
from lightning_sdk.precision import Precision, autocast, wants_bf16

__all__ = [
    "ThreadChoice",
    "WarmStartConfig",
    "WarmStartResult",
    "render_demonstration",
    "render_demonstration_rows",
    "warm_start",
]

logger = logging.getLogger(__name__)


class WarmStartConfig(BaseModel):
    """The supervised warm start (``[warm_start]`` in the training config)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    batch_size: int = Field(32, ge=1, description="demonstrations per supervised step")
    max_steps: int = Field(400, ge=1, description="give up after this many steps")
    eval_every: int = Field(10, ge=1, description="evaluate through the proxy every this many steps")
    eval_below_loss: float | None = Field(
        1.0, description="evaluate only once the supervised loss is this low (the format is learnt); None: always"
    )
    target_success: float = Field(0.2, ge=0, le=1, description="stop at the first evaluation with this success")
    warmup_steps: int = Field(10, ge=1, description="linear learning-rate warmup")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clip")
    seed: int = Field(0, description="order of the demonstrations")
    threads: int | None = Field(
        None,
        ge=1,
        description="intra-op threads of the supervised steps; None: measured, every `retune_every` steps one "
        "step on 1 thread and one on all of them, the faster kept until the next measurement",
    )
    retune_every: int = Field(20, ge=2, description="with `threads` None: measure the thread counts this often")
    share_prefix: int = Field(
        0,
        ge=0,
        description="when a step's rows all start with the same N or more tokens (a system prompt and tools), their "
        "longest common prefix, cut before the first trained token's prediction, runs once and its keys/values "
        "serve every row's own tokens: the same loss and, with prefix_grad, the same gradient as whole rows at a "
        "fraction of the tokens (the calc example's rows share 37 of ~89 tokens); 0: off",
    )
    prefix_grad: bool = Field(
        True,
        description="with share_prefix: the gradient also flows through the shared prefix's keys/values (the exact "
        "whole-row gradient, the prefix's activations kept once for the backward pass). False runs the prefix under "
        "no_grad as constant context: the gradient with its keys/values held constant (the prompt is never trained; "
        "with LoRA, the gradient through how the adapter changes the prompt's keys/values is dropped) and none of its "
        "activations kept: for multi-thousand-token shared prompts (a coding CLI's), where the whole-row step's time "
        "and memory are the prefix's",
    )
    precision: Precision = Field(
        "fp32",
        description="the forward passes' compute dtype, as learner.precision: bf16 autocasts them to bfloat16 "
        "(weights, gradients and the optimizer stay fp32); auto: bf16 where the CPU has AVX-512 BF16 or AMX "
        "(cpu_has_bf16), else fp32",
    )
    pack: bool = Field(
        True,
        description="a step's rows run as one packed sequence (policy/packed.py, as learner.pack: the shared prefix "
        "once, then each row's own tokens; the output head only where a token is trained): the same loss and "
        "gradient in one model call. Where the model supports it, with prefix_grad or no shared prefix; else padded",
    )


@dataclass
class WarmStartResult:
    steps: int
    success: float
    history: list[tuple[int, float]]
    wall_s: float
    stopped: bool = False  # ``should_stop`` ended it before the target or ``max_steps``
    threads: list[tuple[int, int]] = field(default_factory=list)  # (from step, threads) each time the choice moved
    shared_prefix: int = 0  # tokens the last step's rows shared and ran once (share_prefix; 0: none)


class ThreadChoice:
    """The intra-op thread count of the supervised steps, chosen by measuring rather than assumed.

    On a quiet 2-core machine two threads run a step of the tiny policy ~1.8x faster than one; with any other
    runnable process on the machine (a neighbour, the engine) two threads wait on each other at every operation's
    barrier and the same step runs 3-4x slower than on one thread (measured: 0.54 vs 0.97 s a step quiet, 4.6 vs
    1.3 s with one other 2-thread job). So every ``every`` steps one step runs on each candidate count (real training
    steps, nothing wasted) and the count with the lower time per token is kept until the next measurement. The first
    step (allocations, caches) is never a measurement. ``fixed`` turns the measuring off. RL's counterpart, which
    splits the cores between the learner and the engine once from its first steps, is
    ``lightning_sdk.trainer.balance.ThreadBalance``.

    A count other than the current one takes over only when it measured at least ``margin`` faster per token: one
    step each is a noisy measure (rows differ, the machine hiccups), and the cases the choice is for differ 3-4x.
    Without it one quiet run of the calc example (issue 25, 2026-12-06) measured one thread a little faster at step
    21, kept it for the 20 steps until the next measurement, and its warm start took 72.8 s instead of ~50 s."""

    def __init__(self, fixed: int | None, every: int, most: int, margin: float = 0.15) -> None:
        self.candidates = [fixed] if fixed is not None else sorted({1, most})
        self.every = every
        self.margin = margin
        self.chosen = self.candidates[-1]
        self._probe: dict[int, float] = {}
        self.history: list[tuple[int, int]] = []

    def _slot(self, step: int) -> int | None:
        """Which candidate step ``step`` measures (None: not a measuring step)."""
        if len(self.candidates) == 1 or step == 0:
            return None
        k = (step - 1) % self.every
        return k if k < len(self.candidates) else None

    def threads_for(self, step: int) -> int:
        slot = self._slot(step)
        return self.candidates[slot] if slot is not None else self.chosen

    def observe(self, step: int, threads: int, seconds: float, tokens: int) -> None:
        """Step ``step`` ran on ``threads`` threads in ``seconds`` over ``tokens`` (padded) tokens."""
        if self._slot(step) is None:
            return
        self._probe[threads] = seconds / max(1, tokens)
        if len(self._probe) == len(self.candidates):
            best = min(self._probe, key=lambda n: self._probe[n])
            current = self._probe.get(self.chosen)
            if current is not None and self._probe[best] > (1.0 - self.margin) * current:
                best = self.chosen  # within the margin of the current count: keep it
            if not self.history or best != self.history[-1][1]:
                self.history.append((step + 1, best))
                logger.info(
                    "warm start threads from step %d: %d (s per 1k tokens: %s)",
                    step + 1,
                    best,
                    ", ".join(f"{n}: {1000 * t:.3f}" for n, t in sorted(self._probe.items())),
                )
            self.chosen = best
            self._probe = {}


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], tools: Any, gen: bool) -> list[int]:
    out: Any = tokenizer.apply_chat_template(
        list(messages), tools=tools or None, add_generation_prompt=gen, tokenize=True, return_dict=False
    )
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def _render_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], tools: Any, gen: bool) -> str:
    out: Any = tokenizer.apply_chat_template(
        list(messages), tools=tools or None, add_generation_prompt=gen, tokenize=False
    )
    return str(out)


def _turn_tokens(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], tools: Any, k: int
) -> tuple[list[int], list[int]]:
    """Assistant turn ``k`` as the policy meets it: the generation prompt's ids and the turn's own ids up to EOS.

    Where the template's rendering of the whole turn starts with the prompt's ids, the turn is the rest of it; where
    the tokenizer merges the turn's first characters with the prompt's last (``"\\n"`` + ``"I"`` -> ``"\\nI"``), the
    turn's text is tokenised on its own, as the policy would sample it after that prompt."""
    prompt = _render(tokenizer, messages[:k], tools, gen=True)
    whole = _render(tokenizer, messages[: k + 1], tools, gen=False)
    if whole[: len(prompt)] == prompt:
        turn = whole[len(prompt) :]
    else:
        head = _render_text(tokenizer, messages[:k], tools, gen=True)
        text = _render_text(tokenizer, messages[: k + 1], tools, gen=False)
        if not text.startswith(head):
            raise TokenizationError(
                f"the chat template renders assistant turn {k} after a text that is not its generation prompt"
            )
        turn = [int(i) for i in tokenizer.encode(text[len(head) :], add_special_tokens=False)]
    eos = tokenizer.eos_token_id
    if eos in turn:
        turn = turn[: turn.index(eos) + 1]
    return prompt, turn


def render_demonstration_rows(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], tools: Any = None
) -> list[tuple[list[int], list[int]]]:
    """A conversation as training rows of (token ids, loss mask): 1 on assistant tokens up to their EOS.

    Each assistant turn is trained on exactly the tokens the policy would sample after the template's generation
    prompt. Turns follow one another in one row while each prompt extends the row so far; a turn whose prompt does not
    (the tokenizer merged across a turn boundary) starts a new row, as the record builder splits a rollout there."""
    rows: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    mask: list[int] = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt, turn = _turn_tokens(tokenizer, messages, tools, k)
        if ids and prompt[: len(ids)] != ids:
            rows.append((ids, mask))
            ids, mask = [], []
        mask += [0] * (len(prompt) - len(ids)) + [1] * len(turn)
        ids = prompt + turn
    if ids:
        rows.append((ids, mask))
    return rows


def render_demonstration(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, Any]], tools: Any = None
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and its loss mask (1 on assistant tokens up to their EOS).

    Raises ``TokenizationError`` where the conversation does not fit one row (``render_demonstration_rows``)."""
    rows = render_demonstration_rows(tokenizer, messages, tools)
    if len(rows) != 1:
        raise TokenizationError(
            f"the conversation renders as {len(rows)} rows (the tokenizer merges across a turn boundary); "
            "use render_demonstration_rows"
        )
    return rows[0]


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demonstrations: Sequence[dict[str, Any]],
    evaluate: Callable[[PreTrainedModel], float],
    config: WarmStartConfig | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> WarmStartResult:
    """Supervised steps on ``demonstrations`` (``{"messages", "tools"}``) until ``evaluate(model)`` reaches the target.

    ``evaluate`` returns a success rate in [0, 1]; it is called every ``eval_every`` steps on the model in eval mode.
    ``should_stop`` is asked before every supervised step; once it answers true the warm start ends there with
    ``stopped=True`` in the result (the caller decides what a stop means).
    """
    cfg = config or WarmStartConfig()
    t0 = time.perf_counter()
    use_gqa_attention(model)  # a shared prefix's rows, or padded rows, pass a mask: keys/values kept grouped
    rows = [row for d in demonstrations for row in render_demonstration_rows(tokenizer, d["messages"], d.get("tools"))]
    rng = random.Random(cfg.seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    history: list[tuple[int, float]] = []
    success = 0.0
    step = 0
    stopped = False
    threads_before = torch.get_num_threads()  # torch keeps the count per calling thread: put it back at the end
    choice = ThreadChoice(cfg.threads, cfg.retune_every, threads_before)
    bf16 = wants_bf16(cfg.precision, device)
    shared = 0
    try:
        while step < cfg.max_steps:
            if should_stop is not None and should_stop():
                stopped = True
                logger.info("warm start stopped at step %d", step)
                break
            n_threads = choice.threads_for(step)
            if torch.get_num_threads() != n_threads:
                torch.set_num_threads(n_threads)
            t_step = time.perf_counter()
            loss, tokens, shared = _supervised_step(model, optimizer, scheduler, rows, rng, cfg, pad, device, bf16)
            choice.observe(step, n_threads, time.perf_counter() - t_step, tokens)
            if step == 0 and (cfg.share_prefix or bf16):
                logger.info(
                    "warm start: %d-token shared prefix run once %s (share_prefix %d, longest row %d); %s forward "
                    "passes",
                    shared,
                    "with gradients" if cfg.prefix_grad else "without gradients",
                    cfg.share_prefix,
                    max(len(ids) for ids, _ in rows),
                    "bf16" if bf16 else "fp32",
                )
            step += 1
            loss_ok = cfg.eval_below_loss is None or loss <= cfg.eval_below_loss
            if step % cfg.eval_every == 0 and loss_ok:
                model.eval()  # type: ignore[no-untyped-call]
                success = evaluate(model)
                history.append((step, success))
                logger.info("warm start step %d: loss %.3f, success %.1f%%", step, loss, 100 * success)
                if success >= cfg.target_success:
                    break
    finally:
        torch.set_num_threads(threads_before)
    model.eval()  # type: ignore[no-untyped-call]
    return WarmStartResult(
        steps=step,
        success=success,
        history=history,
        wall_s=time.perf_counter() - t0,
        stopped=stopped,
        threads=choice.history,
        shared_prefix=shared,
    )


def _supervised_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rows: Sequence[tuple[list[int], list[int]]],
    rng: random.Random,
    cfg: WarmStartConfig,
    pad: int,
    device: torch.device,
    bf16: bool = False,
) -> tuple[float, int, int]:
    """One supervised step on a random batch of ``rows``: its loss, its padded tokens (a shared prefix counted once)
    and the length of the prefix its rows shared (``shared_prefix``; 0: whole rows)."""
    model.train()
    chosen = rng.sample(rows, min(cfg.batch_size, len(rows)))
    prefix = _shared_prefix(chosen, cfg.share_prefix)
    with autocast(bf16, device):
        if cfg.pack and (prefix == 0 or cfg.prefix_grad) and supports_packing(model):
            loss, tokens = _packed_loss(model, chosen, pad, prefix)
        else:
            loss, tokens = _batch_loss(model, chosen, pad, device, prefix, cfg.prefix_grad)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    scheduler.step()
    return float(loss.item()), tokens, prefix


def _shared_prefix(chosen: Sequence[tuple[list[int], list[int]]], minimum: int) -> int:
    """The longest prefix that all of ``chosen`` (token ids, loss mask) start with and that can run as constant
    context, or 0 when ``minimum`` is 0 or it is shorter than ``minimum``.

    It leaves every row at least one token of its own and stops before the position that predicts the first trained
    token of any row: that token's prediction is made at the position before it, which must run with gradients (so
    the prefix holds no trained token, nor the last untrained one before it)."""
    if minimum <= 0 or not chosen:
        return 0
    limit = min(min(len(ids), mask.index(1) if 1 in mask else len(ids)) - 1 for ids, mask in chosen)
    if limit < minimum:
        return 0
    first = torch.tensor(chosen[0][0][:limit])
    n = limit
    for ids, _ in chosen[1:]:
        differ = torch.nonzero(torch.tensor(ids[:n]) != first[:n])
        if differ.numel():
            n = int(differ[0, 0].item())
            if n < minimum:
                return 0
    return n


def _packed_loss(
    model: PreTrainedModel, chosen: Sequence[tuple[list[int], list[int]]], pad: int, prefix: int = 0
) -> tuple[torch.Tensor, int]:
    """``_batch_loss`` with the rows packed (``policy/packed.py``): the shared ``prefix`` once, then each row's own
    tokens, in one model call whose output head runs at the trained tokens' predictions only; the same mean loss
    over the trained tokens, and the whole rows' gradient. Returns it and the tokens through the model."""
    lengths = [len(ids) for ids, _ in chosen]
    ids_t = torch.full((len(chosen), max(lengths)), pad, dtype=torch.long)
    wanted = torch.zeros(len(chosen), max(lengths) - 1, dtype=torch.bool)
    for i, (ids, mask) in enumerate(chosen):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        wanted[i, : len(ids) - 1] = torch.tensor(mask[1:]) == 1
    if prefix > 0 and len(chosen) > 1:
        parts = [(list(range(len(chosen))), prefix)]
    else:
        parts = [([i], 0) for i in range(len(chosen))]
    pack = pack_rows(ids_t, lengths, parts, wanted)
    logits = packed_logits(model, pack).float()
    return torch.nn.functional.cross_entropy(logits, pack.targets.to(logits.device)), pack.tokens


def _batch_loss(
    model: PreTrainedModel,
    chosen: Sequence[tuple[list[int], list[int]]],
    pad: int,
    device: torch.device,
    prefix: int = 0,
    prefix_grad: bool = False,
) -> tuple[torch.Tensor, int]:
    """The mean loss over the trained tokens of ``chosen`` (right-padded rows) and the tokens it ran.

    ``prefix > 0`` (``_shared_prefix``): the rows' common first ``prefix`` tokens run once (one row) with the cache
    on; the cache, repeated for every row (``batch_repeat_interleave``, as the learner's shared prefix), is the past
    of the rows' own right-padded tokens, which run with gradients, their positions continuing after the prefix. The
    loss equals the whole rows' (the prefix holds no prediction of a trained token). With ``prefix_grad`` the
    prefix runs with autograd and the repeated keys/values stay in the graph: the gradient is the whole rows' (each
    row's share of the prefix's gradient summed through the repeat); without it the prefix runs under
    ``torch.no_grad()`` and the gradient is the whole rows' with the prefix's keys/values held constant."""
    rows = len(chosen)
    width = max(len(ids) for ids, _ in chosen) - prefix
    ids_t = torch.full((rows, width), pad, dtype=torch.long)
    attn = torch.zeros(rows, prefix + width, dtype=torch.long)
    attn[:, :prefix] = 1
    labels = torch.full_like(ids_t, -100)
    for i, (ids, mask) in enumerate(chosen):
        own, own_mask = torch.tensor(ids[prefix:]), torch.tensor(mask[prefix:])
        ids_t[i, : len(own)] = own
        attn[i, prefix : prefix + len(own)] = 1
        labels[i, : len(own)] = torch.where(own_mask == 1, own, -100)
    if prefix == 0:
        out = model(input_ids=ids_t.to(device), attention_mask=attn.to(device), labels=labels.to(device))
        return out.loss, int(ids_t.numel())
    with contextlib.nullcontext() if prefix_grad else torch.no_grad():
        head = model(input_ids=torch.tensor([chosen[0][0][:prefix]], device=device), use_cache=True, logits_to_keep=1)
    cache = head.past_key_values
    cache.batch_repeat_interleave(rows)
    # explicit positions: the rows' own tokens continue after the prefix whatever a model infers from its inputs
    positions = torch.arange(prefix, prefix + width, device=device).unsqueeze(0).expand(rows, -1)
    out = model(
        input_ids=ids_t.to(device),
        attention_mask=attn.to(device),
        position_ids=positions,
        past_key_values=cache,
        use_cache=False,
        labels=labels.to(device),
    )
    return out.loss, prefix + int(ids_t.numel())
