"""The warm start: a short supervised phase on demonstrations, stopped on measured success.

A freshly initialised policy never emits a well-formed tool call, so RL would have no signal (every reward 0).
Real recipes start from a model that already follows the format; here a few dozen supervised steps on the example's
demonstrations teach it. Success jumps sharply between steps, so the phase stops on measured success (the first
evaluation at or above ``target_success``), not on a fixed step count: the policy then knows the format but not yet
the task, which is what RL is for.

Only assistant turns are trained (the loss mask), each up to and including its end-of-turn token: the same tokens
the policy will later sample.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_sdk.errors import TokenizationError

__all__ = ["WarmStartConfig", "WarmStartResult", "render_demonstration", "render_demonstration_rows", "warm_start"]

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


@dataclass
class WarmStartResult:
    steps: int
    success: float
    history: list[tuple[int, float]]
    wall_s: float
    stopped: bool = False  # ``should_stop`` ended it before the target or ``max_steps``


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
    while step < cfg.max_steps:
        if should_stop is not None and should_stop():
            stopped = True
            logger.info("warm start stopped at step %d", step)
            break
        model.train()
        chosen = rng.sample(rows, min(cfg.batch_size, len(rows)))
        width = max(len(ids) for ids, _ in chosen)
        ids_t = torch.full((len(chosen), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids_t)
        labels = torch.full_like(ids_t, -100)
        for i, (ids, mask) in enumerate(chosen):
            ids_t[i, : len(ids)] = torch.tensor(ids)
            attn[i, : len(ids)] = 1
            labels[i, : len(ids)] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), -100)
        out = model(input_ids=ids_t.to(device), attention_mask=attn.to(device), labels=labels.to(device))
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        loss_ok = cfg.eval_below_loss is None or float(out.loss.item()) <= cfg.eval_below_loss
        if step % cfg.eval_every == 0 and loss_ok:
            model.eval()  # type: ignore[no-untyped-call]
            success = evaluate(model)
            history.append((step, success))
            logger.info("warm start step %d: loss %.3f, success %.1f%%", step, out.loss.item(), 100 * success)
            if success >= cfg.target_success:
                break
    model.eval()  # type: ignore[no-untyped-call]
    return WarmStartResult(
        steps=step, success=success, history=history, wall_s=time.perf_counter() - t0, stopped=stopped
    )
