"""The embedded learner: policy gradient with truncated importance sampling on a local torch model, and PPO-clip
when a step makes more than one update.

    loss = token-mean over trained tokens of  w_t * policy_loss(pi_old, pi_theta, A_t)     (``ppo_clip`` by default)
    w_t  = min(exp(logp_old - logp_rollout), tis_cap)     (truncated importance sampling, detached)

``pi_old`` is the learner's own policy at the start of the step and ``logp_rollout`` is what the engine recorded
when it sampled the token. A step makes ``ppo_epochs x mini_batches`` optimizer updates (the batch's rows cut into
``mini_batches`` slices, each pass over all of them). With the default single update, ``pi_theta == pi_old`` when
the gradient is taken, so the ratio is 1, the clip never acts, and what runs is a policy gradient ``-A w_t log pi``
(the clip's gradient at ratio 1); with more updates the later ones see a ratio away from 1 and the clip acts, as in
PPO (Schulman et al., 2017). The off-policy gap of asynchronous training (a group sampled some versions ago) is
corrected by ``w_t`` and bounded by the daemon's ``max_staleness``. Log-probs use the sampling temperature, as the
embedded engine records them. An optional KL to a frozen reference (k3 estimator) and the entropy metric come from
the same forward pass. Micro-batches are cut by a token budget (gradient accumulation within one update); the rows
of a micro-batch that start alike (a group's prompt) go through the model as that prefix once plus each row's own
tokens (``share_prefix``: the same log-probs and gradients, 2-3x fewer tokens on the calc example's batches; with
``prefix_grad`` False the prefix is constant context, run without autograd, for prompts too long to backpropagate);
gradients are clipped by norm; AdamW with linear warmup (one scheduler step per learner step).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers import PreTrainedModel

from lightning_sdk.errors import TrainerError
from lightning_sdk.policy.attention import use_gqa_attention
from lightning_sdk.policy.packed import Pack, pack_rows, packed_token_logprobs, supports_packing
from lightning_sdk.precision import autocast, cpu_has_bf16, wants_bf16
from lightning_sdk.records.batch import build_batch
from lightning_sdk.records.record import Record
from lightning_sdk.trainer.losses import LossSettings, get_policy_loss, policy_loss_names
from lightning_sdk.trainer.parts import LearnerLike

__all__ = ["Learner", "LearnerConfig", "TrainBatch", "cpu_has_bf16", "token_logprobs", "train_batch"]

logger = logging.getLogger(__name__)


class LoraSettings(BaseModel):
    """``[learner] lora = {rank, alpha, target_modules}``: train a LoRA adapter (PEFT) instead of every weight."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, description="adapter rank r")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (the update is scaled by alpha / rank)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="names of the linear modules that get an adapter",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (0: the trained and the sampled policy agree)")


class LearnerConfig(BaseModel):
    """The embedded learner (``[learner]`` in the training config)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    warmup_steps: int = Field(5, ge=1, description="linear learning-rate warmup, in learner steps")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clip")
    loss: str = Field("ppo_clip", description="policy loss, by name (trainer/losses.py: ppo_clip, reinforce)")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip below 1 (acts from the second update of a step)")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip above 1")
    clip_ratio_c: float = Field(3.0, gt=1, description="dual clip for negative advantages")
    tis_cap: float = Field(2.0, gt=0, description="truncated importance sampling cap on exp(logp_old - logp_rollout)")
    kl_coef: float = Field(0.0, ge=0, description="KL to a frozen copy of the initial policy (k3); 0: none")
    temperature: float = Field(
        1.0, gt=0, description="log-prob temperature; the trainer sets it to the sampling temperature (rl.temperature)"
    )
    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description="token budget of a micro-batch (gradient accumulation): padded, rows x the longest row (a shared "
        "prefix once); packed (pack), the tokens through the model. It bounds the step's activation memory",
    )
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's batch (more than one update: the clip acts)")
    mini_batches: int = Field(1, ge=1, description="optimizer updates per pass (row slices of the batch)")
    threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of the thread a step runs in (torch keeps them per thread; default: "
        "the process's, all cores)",
    )
    precision: Literal["fp32", "bf16", "auto"] = Field(
        "fp32",
        description="the forward passes' compute dtype: bf16 autocasts them to bfloat16 (weights, gradients, optimizer "
        "and the loss's log-softmax stay fp32); auto: bf16 where the CPU has AVX-512 BF16 or AMX (cpu_has_bf16), else "
        "fp32",
    )
    reuse_first_pass: bool = Field(
        True,
        description="with several updates per step and one mini-batch, pi_old is the first update's own forward pass "
        "(it runs on the step's starting weights) instead of a separate no-grad pass over the batch: the same values, "
        "one pass fewer per step",
    )
    balance_threads: bool = Field(
        True,
        description="lightning-sdk train, threads unset: the first RL steps try splits of the cores between the "
        "learner's step and the embedded engine (learner+engine threads 1+all, all+all, and the even split where "
        "engine.threads is unset) and keep the one that ran the job faster; after that choice, once the learner "
        "waited for groups at least 25% of 3 steps while the engine has fewer threads than the most a candidate "
        "gives it, the engine gets those threads, once (trainer/balance.py; printed and in summary.json)",
    )
    share_prefix: int = Field(
        32,
        ge=0,
        description="rows that start with the same N or more tokens (a group's shared prompt) are computed with that "
        "prefix once per micro-batch (its keys/values reused by every row; the same log-probs and gradients); 0: off",
    )
    prefix_grad: bool = Field(
        True,
        description="with share_prefix: the gradient also flows through the shared prefix's keys/values (the exact "
        "gradient). False runs the prefix, up to the first trained token's prediction, under no_grad as constant "
        "context: the same log-probs, every trained token's gradient through the rows' own positions, and none of "
        "the prefix's activations kept for the backward pass. For long shared prompts (a coding CLI's 4-9k-token "
        "system prompt and tools) where the prefix's activations are most of the step's memory and time; the "
        "prompt's own representation is then never trained (with LoRA, the gradient through how the adapter changes "
        "the prompt's keys/values is dropped)",
    )

    pack: bool = Field(
        True,
        description="a micro-batch's rows run as one packed sequence (policy/packed.py: each shared prefix once, then "
        "every row's own tokens, attention per row; the output head only where a token is trained): one model call "
        "per micro-batch with matrices wide enough for bf16 to pay; the same log-probs and gradients. Used where the "
        "model supports it (Qwen3, Qwen2, Llama, Mistral without sliding windows) and with prefix_grad; else the "
        "padded rows",
    )
    recompute: bool = Field(
        False,
        description="packed rows: each decoder layer keeps only its input for the backward pass and runs again there "
        "(activation checkpointing): ~one more forward pass per update for activations of one layer instead of the "
        "whole model's, so larger packs fit the same memory",
    )
    process: bool = Field(
        False,
        description="run the learner in a child process of its own (trainer/process.py): its steps then never wait "
        "for Python's interpreter lock, which the embedded engine's thread and the event loop (proxy, store, "
        "in-process agents) hold between their operations; the embedded engine, without lora, only",
    )

    lora: LoraSettings | None = Field(
        None, description="train a LoRA adapter (PEFT) over the frozen base model; None: every weight"
    )

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        if value not in policy_loss_names():
            raise ValueError(f"unknown policy loss {value!r}; valid: {', '.join(policy_loss_names())}")
        return value


@dataclass
class TrainBatch:
    """Padded training rows (right padding). Position t of ``logprobs``/``advantages``/``loss_mask`` describes token
    ``input_ids[:, t]`` (the token, not the prediction made at t); the learner shifts."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens
    loss_mask: torch.Tensor  # [B, T] 1 on sampled tokens that are trained
    logprobs: torch.Tensor  # [B, T] rollout log-probs (0 where loss_mask is 0)
    advantages: torch.Tensor  # [B, T]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        for name in ("attention_mask", "loss_mask", "logprobs", "advantages"):
            if getattr(self, name).shape != shape:
                raise TrainerError(f"TrainBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {shape}")


def train_batch(records: Sequence[Record], *, pad_id: int = 0) -> TrainBatch:
    """The embedded learner's batch of ``records`` (``records.build_batch``, right padding), each row's advantages
    weighted by its share of its rollout (``Record.weight``)."""
    arrays = build_batch(records, pad_id=pad_id)
    weight = torch.from_numpy(arrays["sample_weight"]).unsqueeze(1)
    return TrainBatch(
        input_ids=torch.from_numpy(arrays["input_ids"]),
        attention_mask=torch.from_numpy(arrays["attention_mask"]),
        loss_mask=torch.from_numpy(arrays["loss_mask"]),
        logprobs=torch.from_numpy(arrays["old_logprobs"]),
        advantages=torch.from_numpy(arrays["advantages"]) * weight,
    )


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    prefix: int = 0,
    keep_from: int = 0,
    prefix_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each token given its prefix, and the entropy of each predictive distribution.

    Returns two [B, T-1] tensors aligned with ``input_ids[:, 1:]``. ``prefix > 0`` says that every row starts with
    the same ``prefix`` tokens: they go through the model once and their keys/values serve every row (the result
    equals the plain forward pass up to float rounding, gradients included). ``keep_from > 0`` says that no column
    before it is wanted (the first trained token is ``input_ids[:, keep_from + 1]``): the output head and the
    softmax run only from there (``logits_to_keep``) and the columns before it are 0, which on a long prompt with a
    large vocabulary saves most of the step's memory and time. ``prefix_grad=False`` runs the shared prefix, up to
    ``keep_from`` at most, under ``torch.no_grad()``: the values are the same and every returned column carries its
    gradient, but the keys/values of those shared positions are constants, so the gradient does not flow into them
    (nor does the prefix keep its activations for the backward pass). With ``keep_from`` 0 it is the exact path.
    """
    width = input_ids.shape[1]
    keep_from = min(max(keep_from, 0), width - 1)
    logits = _logits(model, input_ids, attention_mask, prefix, keep_from, prefix_grad)[:, :-1, :].float()
    if temperature > 0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, -1, input_ids[:, keep_from + 1 :].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    if keep_from:
        logp = torch.nn.functional.pad(logp, (keep_from, 0))
        entropy = torch.nn.functional.pad(entropy, (keep_from, 0))
    return logp, entropy


def first_trained(loss_mask: torch.Tensor) -> int:
    """The first column of ``token_logprobs``' output that any row of ``loss_mask`` ([B, T]) trains: its
    ``keep_from`` (0 when no token is trained, or the first is the second token)."""
    cols = torch.nonzero(loss_mask[:, 1:].any(0), as_tuple=False)
    return int(cols[0, 0].item()) if cols.numel() else 0


def _logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prefix: int,
    keep_from: int = 0,
    prefix_grad: bool = True,
) -> torch.Tensor:
    """Logits of the positions ``keep_from`` .. T-1 (``logits_to_keep``: never 0, which would mean all); with
    ``prefix_grad`` False the shared head runs without autograd (its keys/values are constants), cut at
    ``keep_from``: a wanted column's logits always come from the pass with gradients (in RL the first sampled
    token is predicted at the prompt's last position, inside the shared head)."""
    rows, width = input_ids.shape
    if not prefix_grad:
        prefix = min(prefix, keep_from)
    if prefix <= 0 or rows < 2 or prefix >= width:
        out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=width - keep_from)
        return out.logits  # type: ignore[no-any-return]
    # the shared head's logits are wanted only where it holds kept positions; else one position, dropped
    with contextlib.nullcontext() if prefix_grad else torch.no_grad():
        head = model(input_ids=input_ids[:1, :prefix], use_cache=True, logits_to_keep=max(prefix - keep_from, 1))
    cache = head.past_key_values
    cache.batch_repeat_interleave(rows)  # new tensors in the graph: with prefix_grad, the gradient reaches the head
    tail = model(
        input_ids=input_ids[:, prefix:],
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=False,
        logits_to_keep=width - max(prefix, keep_from),
    )
    if keep_from >= prefix:
        return tail.logits  # type: ignore[no-any-return]
    return torch.cat([head.logits.expand(rows, -1, -1), tail.logits], dim=1)


@dataclass
class _Micro:
    """One micro-batch of a step: its rows (of the batch) and their width, run packed (``pack``) or as padded rows
    sharing their first ``prefix`` tokens (0: none shared)."""

    rows: list[int]
    width: int
    prefix: int = 0
    pack: Pack | None = None


class Learner(LearnerLike):
    """Owns the trainable model and its optimizer; ``step(records)`` trains one step and returns metrics."""

    def __init__(self, model: PreTrainedModel, config: LearnerConfig | None = None, *, pad_id: int = 0) -> None:
        self.config = config or LearnerConfig()
        self.pad_id = pad_id
        if self.config.kl_coef > 0 and self.config.lora is not None:
            raise TrainerError("learner.kl_coef with learner.lora: not supported (the reference would be the base)")
        use_gqa_attention(model)  # padded rows and a shared prefix's rows pass a mask: keys/values kept grouped
        self.reference: PreTrainedModel | None = None
        if self.config.kl_coef > 0:
            self.reference = copy.deepcopy(model)
            self.reference.eval()  # type: ignore[no-untyped-call]
            for p in self.reference.parameters():
                p.requires_grad_(False)
        self.model = wrap_lora(model, self.config.lora) if self.config.lora is not None else model
        self.model.train()
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(
            self.trainable(), lr=self.config.lr, betas=self.config.betas, weight_decay=self.config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.loss_fn = get_policy_loss(self.config.loss)
        self.loss_settings = LossSettings(
            self.config.clip_ratio_low, self.config.clip_ratio_high, self.config.clip_ratio_c
        )
        self.steps = 0
        self.bf16 = wants_bf16(self.config.precision, self.device)
        self.packs = self.config.pack and self.config.prefix_grad and supports_packing(self.model)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward passes' autocast (bf16 when ``precision`` says so; else nothing)."""
        return autocast(self.bf16, self.device)

    def reset_optimizer(self) -> None:
        """Fresh AdamW moments and warmup (after the warm start changed the weights outside this learner)."""
        self.optimizer = torch.optim.AdamW(
            self.trainable(), lr=self.config.lr, betas=self.config.betas, weight_decay=self.config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.steps = 0

    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (with LoRA: the adapter's only)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _lr_factor(self, step: int) -> float:
        return min(1.0, (step + 1) / max(1, self.config.warmup_steps))

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs to resume the optimisation exactly."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])

    def weights(self) -> dict[str, torch.Tensor]:
        """A detached copy of the current weights (what the engine swaps in); with LoRA, the base's state dict
        with every adapted weight merged (``W + scale * B @ A``), under the base model's own names."""
        if self.config.lora is not None:
            return merged_lora_state(self.model)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """With LoRA: a detached copy of the adapter's own weights (PEFT's ``get_peft_model_state_dict``: what an
        engine serving the adapter unmerged loads, ``EmbeddedEngine.add_adapter``)."""
        if self.config.lora is None:
            raise TrainerError("adapter_weights: the learner trains every weight (no learner.lora)")
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def step(self, records: Sequence[Record]) -> dict[str, float]:
        """One training step on ``records``: the padded batch (``train_batch``), then ``update``."""
        return self.update(train_batch(records, pad_id=self.pad_id))

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """``ppo_epochs`` passes over ``batch`` in ``mini_batches`` row slices, one optimizer update per slice;
        returns loss and diagnostics (means over trained tokens and updates)."""
        cfg = self.config
        if float(batch.loss_mask[:, 1:].sum().item()) == 0:
            raise TrainerError("the batch has no trained tokens")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)  # per thread in torch: the calling thread's
        cpu0 = time.thread_time()
        self.model.train()
        # pi_old: the policy at the start of the step. With one update it is the update's own forward pass
        # (detached); with several it is computed once up front, so later updates have a ratio to clip.
        # With one mini-batch the first update's forward pass runs on those weights: it gives pi_old for the later
        # updates (reuse_first_pass), with no pass of its own.
        several = cfg.ppo_epochs * cfg.mini_batches > 1
        reuse = several and cfg.reuse_first_pass and cfg.mini_batches == 1
        old = self._logprobs(batch) if several and not reuse else None
        keep = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1) if reuse else None
        slices = _row_slices(batch.input_ids.shape[0], cfg.mini_batches)
        # each slice's micro-batches (shared prefixes, packs) once, for every epoch
        plans = [(rows, self._micros(batch, rows)) for rows in slices]
        updates = []
        for _ in range(cfg.ppo_epochs):
            for rows, micros in plans:
                updates.append(self._update(batch, rows, micros, old, keep))
                if keep is not None:
                    old, keep = keep, None
        self.scheduler.step()
        self.steps += 1
        out = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0] if k != "tokens"}
        out["tokens"] = updates[0]["tokens"] if len(slices) == 1 else sum(u["tokens"] for u in updates[: len(slices)])
        out["updates"] = float(len(updates))
        out["lr"] = float(self.scheduler.get_last_lr()[0])
        # the calling thread's CPU seconds (torch's other intra-op threads not counted): against the step's wall
        # time it shows how long the step waited for a core or for the interpreter lock
        out["thread_cpu_s"] = time.thread_time() - cpu0
        return out

    def _pieces(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple[list[int], int]]:
        """The micro-batches of these rows, each with the length of the prefix its rows share (0: none shared)."""
        cfg = self.config
        lengths = [int(n) for n in attention_mask.sum(-1).tolist()]
        pieces, rest = _prefix_pieces(input_ids, lengths, cfg.share_prefix, cfg.micro_batch_tokens)
        if rest:
            pieces += [
                ([rest[i] for i in mb], 0) for mb in _micro_batches(attention_mask[rest], cfg.micro_batch_tokens)
            ]
        return pieces

    def _micros(self, batch: TrainBatch, subset: list[int]) -> list[_Micro]:
        """The micro-batches of the rows ``subset`` of ``batch``: padded pieces (``_pieces``), or with packing those
        pieces packed together up to ``micro_batch_tokens`` tokens through the model each."""
        pieces = self._pieces(batch.input_ids[subset], batch.attention_mask[subset])
        lengths = [int(n) for n in batch.attention_mask[subset].sum(-1).tolist()]
        if not self.packs:
            return [
                _Micro([subset[i] for i in local], max(lengths[i] for i in local), prefix) for local, prefix in pieces
            ]
        micros: list[_Micro] = []
        chosen: list[tuple[list[int], int]] = []
        tokens = 0
        for local, prefix in pieces:
            shared = prefix if len(local) > 1 else 0  # tokens through the model: the prefix once, then each row's own
            cost = shared + sum(lengths[i] - shared for i in local)
            if chosen and tokens + cost > self.config.micro_batch_tokens:
                micros.append(self._pack(batch, subset, lengths, chosen))
                chosen, tokens = [], 0
            chosen.append((local, prefix))
            tokens += cost
        if chosen:
            micros.append(self._pack(batch, subset, lengths, chosen))
        return micros

    def _pack(
        self, batch: TrainBatch, subset: list[int], lengths: list[int], pieces: list[tuple[list[int], int]]
    ) -> _Micro:
        """``pieces`` (rows local to ``subset``, shared prefix) as one packed micro-batch of their trained tokens."""
        local = [i for rows, _ in pieces for i in rows]
        rows = [subset[i] for i in local]
        width = max(lengths[i] for i in local)
        parts, at = [], 0
        for piece_rows, prefix in pieces:
            parts.append((list(range(at, at + len(piece_rows))), prefix))
            at += len(piece_rows)
        wanted = batch.loss_mask[rows][:, 1:width] > 0
        pack = pack_rows(batch.input_ids[rows][:, :width], [lengths[i] for i in local], parts, wanted)
        return _Micro(rows, width, pack=pack)

    def _forward(self, model: PreTrainedModel, batch: TrainBatch, micro: _Micro) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_logprobs``' [rows, width-1] log-probs and entropies of ``micro`` under ``model`` (packed: at the
        trained columns only, 0 elsewhere)."""
        if micro.pack is not None:
            return packed_token_logprobs(model, micro.pack, self.config.temperature, self.config.recompute)
        ids = batch.input_ids[micro.rows][:, : micro.width].to(self.device)
        attn = batch.attention_mask[micro.rows][:, : micro.width].to(self.device)
        start = first_trained(batch.loss_mask[micro.rows][:, : micro.width])
        return token_logprobs(
            model, ids, attn, self.config.temperature, prefix=micro.prefix, keep_from=start,
            prefix_grad=self.config.prefix_grad,
        )  # fmt: skip

    @torch.no_grad()
    def _logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T-1] log-probs of the current policy for every row (0 past a row's end), micro-batched."""
        out = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
        for micro in self._micros(batch, list(range(batch.input_ids.shape[0]))):
            with self._autocast():
                logp, _ = self._forward(self.model, batch, micro)
            out[micro.rows, : micro.width - 1] = logp.float().cpu()
        return out

    def _update(
        self,
        batch: TrainBatch,
        subset: list[int],
        micros: list[_Micro],
        old_all: torch.Tensor | None,
        keep: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer update on the rows ``subset`` of ``batch`` (gradients accumulated over micro-batches);
        ``keep`` (rows of the whole batch) gets this update's detached log-probs, pi_old of the updates after it."""
        cfg = self.config
        n_tokens = float(batch.loss_mask[subset][:, 1:].sum().item())
        if n_tokens == 0:  # a mini-batch of rows with no trained token: nothing to update
            return {"loss": 0.0, "entropy": 0.0, "is_weight": 0.0, "rollout_kl": 0.0, "grad_norm": 0.0, "tokens": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {"loss": 0.0, "entropy": 0.0, "is_weight": 0.0, "kl_ref": 0.0, "rollout_kl": 0.0}
        extra: dict[str, float] = {}
        for micro in micros:
            rows, width = micro.rows, micro.width
            mask = batch.loss_mask[rows][:, 1:width].to(self.device).float()
            rollout_lp = batch.logprobs[rows][:, 1:width].to(self.device).float()
            adv = batch.advantages[rows][:, 1:width].to(self.device).float()
            with self._autocast():
                logp, entropy = self._forward(self.model, batch, micro)
            old = logp.detach() if old_all is None else old_all[rows][:, : width - 1].to(self.device)
            if keep is not None:
                keep[rows, : width - 1] = logp.detach().float().cpu()
            is_weight = torch.clamp(torch.exp(old - rollout_lp), max=cfg.tis_cap) * mask
            per_token, metrics = self.loss_fn(old, logp, adv, mask, self.loss_settings)
            per_token = per_token * is_weight
            if self.reference is not None:
                with torch.no_grad(), self._autocast():
                    ref_lp, _ = self._forward(self.reference, batch, micro)
                log_r = ref_lp - logp
                kl = torch.exp(log_r) - log_r - 1.0  # k3: unbiased, non-negative
                per_token = per_token + cfg.kl_coef * kl
                totals["kl_ref"] += float((kl.detach() * mask).sum().item())
            loss = (per_token * mask).sum() / n_tokens
            loss.backward()  # type: ignore[no-untyped-call]
            share = float(mask.sum().item()) / n_tokens
            totals["loss"] += float(loss.item())
            totals["entropy"] += float((entropy * mask).sum().item())
            totals["is_weight"] += float(is_weight.sum().item())
            totals["rollout_kl"] += float(((rollout_lp - old) * mask).sum().item())
            for k, v in metrics.items():
                extra[k] = extra.get(k, 0.0) + v * share
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable(), cfg.grad_clip).item())
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainerError("non-finite gradient norm; the update was skipped")
        self.optimizer.step()
        out = {
            "loss": totals["loss"],
            "entropy": totals["entropy"] / n_tokens,
            "is_weight": totals["is_weight"] / n_tokens,
            "rollout_kl": totals["rollout_kl"] / n_tokens,
            "grad_norm": grad_norm,
            "tokens": n_tokens,
        }
        if self.reference is not None:
            out["kl_ref"] = totals["kl_ref"] / n_tokens
        out.update(extra)
        return out


def _row_slices(n_rows: int, mini_batches: int) -> list[list[int]]:
    """``mini_batches`` contiguous, near-equal row slices (fewer when there are fewer rows)."""
    k = max(1, min(mini_batches, n_rows))
    bounds = [round(i * n_rows / k) for i in range(k + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]


def _micro_batches(attention_mask: torch.Tensor, token_budget: int) -> Iterator[list[int]]:
    """Rows grouped by length so that rows x longest row stays within ``token_budget`` (at least one row each)."""
    lengths = attention_mask.sum(-1).tolist()
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    group: list[int] = []
    longest = 0
    for i in order:
        longest_if = max(longest, int(lengths[i]))
        if group and longest_if * (len(group) + 1) > token_budget:
            yield group
            group, longest_if = [], int(lengths[i])
        group.append(i)
        longest = longest_if
    if group:
        yield group


def _prefix_pieces(
    input_ids: torch.Tensor, lengths: list[int], min_prefix: int, token_budget: int
) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Rows that share their first ``min_prefix`` tokens or more, cut into micro-batches with the length of the
    prefix they share, and the other rows. Where rows share a short head (a system prompt) and, within subsets, a
    longer one (each group's own prompt), the cut that saves the most tokens wins. A prefix always leaves each row at
    least one token of its own; a micro-batch costs its prefix once plus each row's own tokens, within
    ``token_budget``."""
    if min_prefix <= 0:
        return [], list(range(len(lengths)))
    buckets: dict[bytes, list[int]] = {}
    rest: list[int] = []
    for i, n in enumerate(lengths):
        if n > min_prefix:
            buckets.setdefault(input_ids[i, :min_prefix].numpy().tobytes(), []).append(i)
        else:
            rest.append(i)
    shared: list[tuple[list[int], int]] = []
    for rows in buckets.values():
        _, best = _best_cut(input_ids, lengths, rows, min_prefix)
        shared += best
    pieces: list[tuple[list[int], int]] = []
    for rows, prefix in shared:
        if len(rows) < 2:
            rest += rows
            continue
        rows.sort(key=lambda i: lengths[i])
        chunk: list[int] = []
        longest = 0
        for i in rows:
            longest_if = max(longest, lengths[i])
            if chunk and prefix + (len(chunk) + 1) * (longest_if - prefix) > token_budget:
                pieces.append((chunk, prefix if len(chunk) > 1 else 0))
                chunk, longest_if = [], lengths[i]
            chunk.append(i)
            longest = longest_if
        pieces.append((chunk, prefix if len(chunk) > 1 else 0))
    return pieces, sorted(rest)


def _best_cut(
    input_ids: torch.Tensor, lengths: list[int], rows: list[int], min_prefix: int
) -> tuple[int, list[tuple[list[int], int]]]:
    """(tokens saved, pieces) for ``rows``, which share at least ``min_prefix`` tokens: either one piece with their
    common prefix, or the rows split by the first token where they differ, each part cut the same way."""
    if len(rows) < 2:
        return 0, [(rows, 0)]
    shortest = min(lengths[i] for i in rows)
    same = (input_ids[rows, : shortest - 1] == input_ids[rows[0], : shortest - 1]).all(0)
    prefix = int(same.int().cumprod(0).sum().item())
    whole = (len(rows) - 1) * prefix, [(list(rows), prefix)]
    if prefix >= shortest - 1:  # the shortest row has no token left to split on
        return whole
    parts: dict[int, list[int]] = {}
    for i in rows:
        parts.setdefault(int(input_ids[i, prefix].item()), []).append(i)
    saved, pieces = 0, []
    for part in parts.values():
        part_saved, part_pieces = _best_cut(input_ids, lengths, part, min_prefix)
        saved += part_saved
        pieces += part_pieces
    return (saved, pieces) if saved > whole[0] else whole


def wrap_lora(model: PreTrainedModel, settings: LoraSettings) -> Any:
    """``model`` with LoRA adapters on ``settings.target_modules`` (PEFT's ``get_peft_model``: the base weights are
    frozen, only the adapters train). PEFT injects the adapters into ``model``'s own modules."""
    try:
        from peft import get_peft_model
    except ImportError as exc:
        raise TrainerError("learner.lora needs the PyPI package peft (in the train extra): pip install peft") from exc
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in settings.target_modules if m not in names]
    if missing:
        raise TrainerError(f"learner.lora.target_modules {missing}: no such modules in the model")
    return get_peft_model(model, lora_config(settings))


def lora_config(settings: LoraSettings) -> Any:
    """PEFT's ``LoraConfig`` of ``settings`` (the learner's and the engine's adapter are built from the same one)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # PEFT types it int; a float scale is fine
        target_modules=list(settings.target_modules),
        lora_dropout=settings.dropout,
        bias="none",
    )


def merged_lora_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict with each LoRA layer's weight merged (non-destructive: the adapters stay)."""
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, torch.Tensor] = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            layer: Any = module  # lora.Linear and its kin: get_delta_weight(adapter) = scale * B @ A
            delta: torch.Tensor = torch.zeros_like(layer.get_base_layer().weight)
            for adapter in layer.active_adapters:
                delta = delta + layer.get_delta_weight(adapter)
            deltas[name + ".base_layer.weight"] = delta
    out: dict[str, torch.Tensor] = {}
    prefix = "base_model.model."
    for key, value in peft_model.state_dict().items():
        if ".lora_" in key:
            continue
        tensor = value.detach()
        tensor = tensor + deltas[key].to(tensor.dtype) if key in deltas else tensor.clone()
        clean = key[len(prefix) :] if key.startswith(prefix) else key
        out[clean.replace(".base_layer.", ".")] = tensor
    return out
