"""The embedded engine: an in-process Hugging Face causal LM that batches concurrent requests.

One worker thread owns the model. Requests queue up while a batch runs and join the next one (left-padded, KV-cached
decoding, finished rows dropped from the batch as they stop), so the asyncio loop of the proxy stays free and many
agents share one forward pass per token.

Log-probs: each sampled token is recorded with its log-probability under the distribution it was sampled from with
the temperature applied, before top-p truncation: ``log_softmax(logits / temperature)[token]`` (``temperature == 0``
is greedy and records ``log_softmax(logits)``). The learner computes its log-probs the same way, with the same
temperature, so the importance ratio is exactly 1 for on-policy data.

Weights: ``update_weights`` takes the model lock, which a batch holds from its first to its last token, so in-flight
batches finish on the old weights and record the old policy version; the next batch runs on the new ones.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from lightning_sdk.engines.base import Generation, GenerationDelta, Sampling
from lightning_sdk.errors import EngineError

__all__ = ["EmbeddedEngine"]

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """One generation request, filled by the worker thread and read by the event loop."""

    input_ids: list[int]
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerationDelta | BaseException]
    streaming: bool
    generator: torch.Generator
    stop_ids: set[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent: int = 0
    finish_reason: str | None = None

    def deliver(self, version: int, final: bool) -> None:
        """Send what is new (every token when streaming, else everything at the end) to the waiting coroutine."""
        if not final and not self.streaming:
            return
        reason = self.finish_reason if final else None
        delta = GenerationDelta(
            ids=self.ids[self.sent :],
            logprobs=self.logprobs[self.sent :],
            finish_reason=reason,
            policy_version=version,
        )
        self.sent = len(self.ids)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, exc)


class EmbeddedEngine:
    """Token-in/token-out generation with a local HF model on CPU or one GPU (implements ``Engine``)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 64,
        policy_version: int = 0,
        device: str | None = None,
    ) -> None:
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model.to(self._device)  # type: ignore[arg-type]
        model.eval()  # type: ignore[no-untyped-call]
        self._model = model
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._version = policy_version
        self._eos_ids = _eos_ids(model, tokenizer)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self._eos_ids)
        self._max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()
        self._closed = False
        # Set by the trainer: RL and evaluation fix the temperature (the learner must use the same one) and cap
        # max_tokens, whatever the agent asks for.
        self.sampling_override: dict[str, Any] | None = None
        self.stats = {"batches": 0, "tokens": 0, "requests": 0, "max_batch": 0}
        self._thread = threading.Thread(target=self._run, name="embedded-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> EmbeddedEngine:
        """Load a local HF model directory (float32) and serve it."""
        from lightning_sdk.policy.model import load_policy

        model, tokenizer = load_policy(model_dir)
        return cls(model, tokenizer, **kwargs)

    # -- Engine protocol ------------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) the model takes: its ``max_position_embeddings``."""
        return self._max_positions

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        ids: list[int] = []
        logprobs: list[float] = []
        reason: str | None = None
        version: int | None = None
        async for delta in self._submit(input_ids, sampling, streaming=False):
            ids += delta.ids
            logprobs += delta.logprobs
            reason, version = delta.finish_reason, delta.policy_version
        return Generation(
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason=reason or "abort",
            policy_version=version,
        )

    def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        return self._submit(input_ids, sampling, streaming=True)

    async def update_weights(self, source: Any, version: int) -> None:
        """Swap in ``source`` (a state dict or a saved model directory) and serve it as ``version``."""
        state = _load_state(source)
        await asyncio.to_thread(self._swap, state, version)

    async def close(self) -> None:
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, []
            self._cond.notify_all()
        for req in pending:
            req.fail(EngineError("the engine was closed"))
        await asyncio.to_thread(self._thread.join, 10.0)

    # -- internals ------------------------------------------------------------------------------------------------
    def _swap(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        with self._model_lock:
            try:
                self._model.load_state_dict(state, strict=False)
            except RuntimeError as exc:
                raise EngineError(f"the new weights do not fit the model: {exc}") from exc
            self._version = version
        logger.info("embedded engine now serves policy version %d", version)

    async def _submit(
        self, input_ids: list[int], sampling: Sampling, *, streaming: bool
    ) -> AsyncIterator[GenerationDelta]:
        if self._closed:
            raise EngineError("the engine is closed")
        if not input_ids:
            raise EngineError("empty prompt")
        if self.sampling_override:
            sampling = _override(sampling, self.sampling_override)
        gen = torch.Generator()
        gen.manual_seed(sampling.seed if sampling.seed is not None else random.getrandbits(63))
        req = _Request(
            input_ids=list(input_ids),
            sampling=sampling,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            streaming=streaming,
            generator=gen,
            stop_ids=self._eos_ids | set(sampling.stop_token_ids),
        )
        with self._cond:
            self._pending.append(req)
            self._cond.notify()
        while True:
            item = await req.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = self._pending[: self._max_batch_size]
                self._pending = self._pending[self._max_batch_size :]
            try:
                with self._model_lock, torch.inference_mode():
                    version = self._version
                    self._decode(batch, version)
            except Exception as exc:  # every waiting request must hear about the failure
                logger.exception("embedded generation failed")
                for req in batch:
                    if req.finish_reason is None:
                        req.fail(EngineError(f"generation failed: {exc}"))

    def _decode(self, batch: list[_Request], version: int) -> None:
        """Prefill the left-padded prompts, then sample token by token until every row has stopped."""
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
        width = max(len(r.input_ids) for r in batch)
        ids = torch.full((len(batch), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.input_ids) :] = torch.tensor(r.input_ids)
            mask[i, width - len(r.input_ids) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self._model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        )
        logits = out.logits[:, -1, :].float()
        rows = list(range(len(batch)))  # batch index of each live row of the cache
        next_pos = positions[:, -1] + 1
        while rows:
            tokens: list[int] = []
            keep: list[int] = []
            for j, b in enumerate(rows):
                req = batch[b]
                token, logprob = _sample(logits[j], req.sampling, req.generator)
                req.ids.append(token)
                req.logprobs.append(logprob)
                self.stats["tokens"] += 1
                req.finish_reason = self._finish_reason(req, len(req.input_ids))
                req.deliver(version, final=req.finish_reason is not None)
                if req.finish_reason is None:
                    keep.append(j)
                    tokens.append(token)
            if not keep:
                return
            if len(keep) < len(rows):
                idx = torch.tensor(keep, device=self._device)
                cache.batch_select_indices(idx)
                mask, next_pos = mask[idx], next_pos[idx]
                rows = [rows[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=self._device)], dim=1)
            step = torch.tensor(tokens, device=self._device).unsqueeze(1)
            out = self._model(
                input_ids=step,
                attention_mask=mask,
                position_ids=next_pos.unsqueeze(1),
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1

    def _finish_reason(self, req: _Request, prompt_len: int) -> str | None:
        if req.ids[-1] in req.stop_ids:
            return "stop"
        if req.sampling.stop:
            text = self._tokenizer.decode(req.ids, skip_special_tokens=False)
            if any(s in text for s in req.sampling.stop):
                return "stop"
        if len(req.ids) >= req.sampling.max_tokens or prompt_len + len(req.ids) >= self._max_positions:
            return "length"
        return None


def _override(sampling: Sampling, override: dict[str, Any]) -> Sampling:
    """Apply the trainer's sampling override: values replace the request's, except ``max_tokens`` which caps it."""
    update = dict(override)
    if "max_tokens" in update:
        update["max_tokens"] = min(int(update["max_tokens"]), sampling.max_tokens)
    return sampling.model_copy(update=update)


def _sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> tuple[int, float]:
    """Sample one token from ``logits`` ([vocab]); returns it with its log-prob (temperature applied, pre top-p)."""
    if sampling.temperature <= 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits).item())
        return token, float(logp[token].item())
    logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        cut = cumulative - sorted_probs >= sampling.top_p  # drop tokens once the mass before them reaches top_p
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    token = int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
    return token, float(logp[token].item())


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    if not ids:
        raise EngineError("the model has no EOS token id")
    return ids


def _load_state(source: Any) -> Mapping[str, torch.Tensor]:
    if isinstance(source, Mapping):
        return source
    if isinstance(source, (str, Path)):
        path = Path(source)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files:
            raise EngineError(f"no *.safetensors weights in {path}")
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    raise EngineError(f"unsupported weight source: {type(source).__name__}")
