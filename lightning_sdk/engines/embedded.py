"""The embedded engine: an in-process Hugging Face causal LM with continuous batching and a prefix cache.

One worker thread owns the model and runs one batch that requests join and leave token by token (continuous
batching): a request that arrives while others decode is prefilled and merged into the running batch at the next
step, and a finished row leaves it at once, so the asyncio loop of the proxy stays free and many agents share one
forward pass per token. Rows sit left-padded in one KV cache; each row has its own positions and attention mask.

Prefix cache: an agent's next call extends its previous prompt and completion (under the ``exact`` policy the
proxy re-renders exactly those ids), and the rollouts of a group share their first prompt. The engine keeps the KV
of recent prompts and of finished rows (prompt + completion) in an LRU bounded by ``prefix_cache_tokens``; a
request whose prompt starts with a cached sequence prefills only the rest. The cache is computed by the weights
being served and is emptied when they change, so a hit gives the log-probs of a cold prefill (up to float
rounding). ``prefix_cache=False`` / ``continuous=False`` turn either off (the benchmark's baseline modes; static
batching: a batch runs until its last row stops and only then do waiting requests start).

Log-probs: each sampled token is recorded with its log-probability under the distribution it was sampled from with
the temperature applied, before top-p truncation: ``log_softmax(logits / temperature)[token]`` (``temperature == 0``
is greedy and records ``log_softmax(logits)``). The learner computes its log-probs the same way, with the same
temperature, so the importance ratio is exactly 1 for on-policy data.

Weights: ``update_weights`` stops new rows from joining, waits until the running rows have finished (on the old
weights, recording the old policy version), swaps, empties the prefix cache, and lets the waiting requests start on
the new weights.

Adapters (several policies over one base): ``add_adapter(name, lora_config)`` wraps the model in PEFT (once) and adds
a LoRA adapter, unmerged; ``adapter(name)`` is an ``Engine`` whose requests run that adapter over the shared base, with
its own policy version and its own ``update_weights`` (the adapter's PEFT state dict: a publication of that policy).
Rows of different adapters (and of the bare base) share one batch: each forward pass names every row's adapter
(PEFT's mixed-adapter batches), and the prefix cache keeps each adapter's KV apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from lightning_sdk.engines.base import Engine, Generation, GenerationDelta, Sampling
from lightning_sdk.errors import EngineError
from lightning_sdk.policy.attention import use_gqa_attention

__all__ = ["AdapterEngine", "EmbeddedEngine", "PrefixCache"]

#: PEFT's name for "no adapter" in a mixed-adapter batch (the bare base model's rows)
_BASE = "__base__"

logger = logging.getLogger(__name__)

#: per layer: (keys, values), each [heads, tokens, head_dim] (one sequence) or [batch, heads, tokens, head_dim]
_KV = list[tuple[torch.Tensor, torch.Tensor]]
#: a prefix cache key: (length, hash of the ids, namespace: the adapter that computed the KV, None for the base)
_Key = tuple[int, int, str | None]


@dataclass
class _Request:
    """One generation request, filled by the worker thread and read by the event loop."""

    input_ids: list[int]
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[GenerationDelta | BaseException]
    streaming: bool
    generator: random.Random  # the request's own draws (a seed gives the same tokens in any batch)
    stop_ids: set[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent: int = 0
    finish_reason: str | None = None
    version: int = 0
    reused: int = 0  # prompt tokens taken from the prefix cache
    queued_at: int = 0  # the engine's decode step count when the request arrived
    adapter: str | None = None  # the LoRA adapter that serves it (None: the base model)

    def deliver(self, final: bool) -> None:
        """Send what is new (every token when streaming, else everything at the end) to the waiting coroutine."""
        if not final and not self.streaming:
            return
        reason = self.finish_reason if final else None
        delta = GenerationDelta(
            ids=self.ids[self.sent :],
            logprobs=self.logprobs[self.sent :],
            finish_reason=reason,
            policy_version=self.version,
        )
        self.sent = len(self.ids)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, exc)


def _prefix_hashes(ids: list[int]) -> list[int]:
    """``out[i]``: a hash of ``ids[: i + 1]`` (chained, one pass)."""
    out: list[int] = []
    h = 0
    for t in ids:
        h = hash((h, t))
        out.append(h)
    return out


class PrefixCache:
    """The KV of recent token sequences, looked up by longest cached prefix; an LRU bounded in tokens.

    Each sequence's KV is stored once. Its prefixes at multiples of ``chunk`` tokens (a shared head: the system
    prompt and tools every call of a harness starts with) are indexed to it, and a lookup that matches one gives a
    view of the sequence's first tokens: a 5.7k-token prompt is one entry, not one copy per chunk (storing every
    chunk's prefix as its own copy cloned ~40 GB of KV for one cold coding-CLI prompt on SmolLM2)."""

    def __init__(self, max_tokens: int, chunk: int = 16) -> None:
        self.max_tokens = max_tokens
        self.chunk = chunk
        self.tokens = 0
        self._entries: OrderedDict[_Key, tuple[tuple[int, ...], _KV, list[_Key]]] = OrderedDict()
        self._index: dict[_Key, _Key] = {}  # a prefix (chunk multiple or whole) -> the newest entry that holds it
        self._lengths: dict[int, int] = {}  # indexed prefix length -> index keys of that length
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self, namespace: str | None = None, *, everything: bool = True) -> None:
        """Forget every entry, or (``everything=False``) only those of ``namespace`` (one adapter's KV)."""
        if everything:
            self._entries.clear()
            self._index.clear()
            self._lengths.clear()
            self.tokens = 0
            return
        for key in [k for k in self._entries if k[2] == namespace]:
            self._drop(key)

    def put(self, ids: list[int], kv: _KV, namespace: str | None = None) -> None:
        """Remember the KV of ``ids`` (one sequence: [heads, len(ids), head_dim] per layer; stored as given), computed
        by ``namespace`` (an adapter; None: the base model)."""
        n = len(ids)
        if n == 0 or n > self.max_tokens:
            return
        hashes = _prefix_hashes(ids)
        key = (n, hashes[-1], namespace)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        prefixes = [(m, hashes[m - 1], namespace) for m in [*range(self.chunk, n, self.chunk), n]]
        self._entries[key] = (tuple(ids), kv, prefixes)
        for p in prefixes:
            if p not in self._index:
                self._lengths[p[0]] = self._lengths.get(p[0], 0) + 1
            self._index[p] = key  # the newest entry holding a prefix serves it (the last to be evicted)
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: _Key) -> None:
        _, _, prefixes = self._entries.pop(key)
        self.tokens -= key[0]
        for p in prefixes:
            if self._index.get(p) == key:
                del self._index[p]
                self._lengths[p[0]] -= 1
                if not self._lengths[p[0]]:
                    del self._lengths[p[0]]

    def lookup(self, ids: list[int], namespace: str | None = None) -> tuple[int, _KV | None]:
        """The longest cached prefix of ``ids`` computed by ``namespace``: (its length, its KV: views of the first
        tokens of the entry that holds it), or (0, None)."""
        n, kv = self.peek(ids, namespace)
        if kv is None:
            self.misses += 1
        else:
            self.hits += 1
        return n, kv

    def peek(self, ids: list[int], namespace: str | None = None) -> tuple[int, _KV | None]:
        """``lookup`` without counting a hit or a miss."""
        if not self._entries:
            return 0, None
        hashes = _prefix_hashes(ids)
        for n in sorted(self._lengths, reverse=True):
            if n > len(ids):
                continue
            entry_key = self._index.get((n, hashes[n - 1], namespace))
            if entry_key is None:
                continue
            seq, kv, _ = self._entries[entry_key]
            if seq[:n] == tuple(ids[:n]):
                self._entries.move_to_end(entry_key)
                return n, kv if n == len(seq) else [(k[:, :n], v[:, :n]) for k, v in kv]
        return 0, None


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class EmbeddedEngine(Engine):
    """Token-in/token-out generation with a local HF model on CPU or one GPU (implements ``Engine``)."""

    #: a waiting request joins the running batch after at most this many decode steps (see ``_admit_now``)
    ADMIT_AFTER_STEPS = 4
    #: prompts are also cached at prefixes of multiples of this many tokens (shared heads: system prompt, tools)
    PREFIX_CHUNK = 16

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 64,
        policy_version: int = 0,
        device: str | None = None,
        prefix_cache: bool = True,
        prefix_cache_tokens: int = 32768,
        continuous: bool = True,
        threads: int | None = None,
        precision: str = "fp32",
    ) -> None:
        if precision not in ("fp32", "bf16"):
            raise EngineError(f"engine precision must be 'fp32' or 'bf16', got {precision!r}")
        self.precision = precision
        self._threads = threads
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model.to(self._device)  # type: ignore[arg-type]
        model.eval()  # type: ignore[no-untyped-call]
        use_gqa_attention(model)  # a masked call (always: left-padded rows) keeps grouped keys/values grouped
        self._model = model
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._version = policy_version
        self._adapters: dict[str, int] = {}  # LoRA adapter name -> the policy version it serves
        self._eos_ids = _eos_ids(model, tokenizer)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self._eos_ids)
        self._max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()
        self._closed = False
        self._draining = 0  # weight swaps waiting for the running rows to finish
        self._running = 0  # rows in the running batch
        self._continuous = continuous
        full_attention = all(t == "full_attention" for t in (getattr(model.config, "layer_types", None) or []))
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(prefix_cache_tokens, self.PREFIX_CHUNK) if prefix_cache and full_attention else None
        )
        self.stats: dict[str, Any] = {
            "batches": 0,  # prefills (a group of requests joining the batch)
            "tokens": 0,
            "requests": 0,
            "max_batch": 0,
            "steps": 0,  # decode forward passes
            "prompt_tokens": 0,
            "reused_tokens": 0,  # prompt tokens served from the prefix cache
            "busy_s": 0.0,  # seconds the worker spent prefilling and decoding
            "cpu_s": 0.0,  # of those, the worker thread's own CPU (not its intra-op helpers'): the rest it waited for
            # a core or the interpreter lock
            "shared_head_tokens": 0,  # prompt heads shared by rows admitted together, prefilled once for all
            "twin_tokens": 0,  # prompt tokens of rows admitted with an identical prompt, which ran once for both
        }
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

    @property
    def threads(self) -> int | None:
        """The engine thread's intra-op threads asked for (None: the process's)."""
        return self._threads

    def set_threads(self, threads: int) -> None:
        """The engine thread's torch intra-op threads from its next forward pass on (``trainer/balance.py`` sets
        them from measured steps)."""
        if threads < 1:
            raise EngineError(f"engine threads must be >= 1, got {threads}")
        self._threads = threads

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

    # -- adapters (several policies over one base) ------------------------------------------------------------------
    def add_adapter(self, name: str, config: Any, *, version: int = 0) -> AdapterEngine:
        """Serve a LoRA adapter ``name`` (``config``: PEFT's ``LoraConfig``) over this engine's base model, unmerged;
        it starts as PEFT initialises it (B = 0: the base's answers) until its first ``update_weights``."""
        if not name or name == _BASE:
            raise EngineError(f"adapter name {name!r} is reserved or empty")
        if name in self._adapters:
            raise EngineError(f"the engine already serves an adapter {name!r}")
        try:
            from peft import PeftModel, get_peft_model
        except ImportError as exc:
            raise EngineError("serving adapters needs the PyPI package peft (in the train extra)") from exc
        with self._model_lock:
            if isinstance(self._model, PeftModel):
                self._model.add_adapter(name, config)
            else:
                self._model = get_peft_model(self._model, config, adapter_name=name)
            self._model.eval()  # type: ignore[no-untyped-call]
            self._adapters[name] = version
        return AdapterEngine(self, name)

    def adapter(self, name: str) -> AdapterEngine:
        """The ``Engine`` of adapter ``name`` (added by ``add_adapter``)."""
        if name not in self._adapters:
            raise EngineError(f"the engine serves no adapter {name!r} (adapters: {sorted(self._adapters)})")
        return AdapterEngine(self, name)

    @property
    def adapters(self) -> dict[str, int]:
        """The adapters served and the policy version of each."""
        return dict(self._adapters)

    # -- internals ------------------------------------------------------------------------------------------------
    def _swap(self, state: Mapping[str, torch.Tensor], version: int, adapter: str | None = None) -> None:
        if adapter is None and self._adapters:
            raise EngineError("this engine serves LoRA adapters over a frozen base: publish each adapter's weights")
        with self._cond:
            self._draining += 1
            try:
                while self._running and not self._closed:
                    self._cond.wait()
                with self._model_lock:
                    if adapter is None:
                        unknown = sorted(set(state) - set(self._model.state_dict()))
                        if unknown:  # load_state_dict(strict=False) would skip them: weights silently not served
                            raise EngineError(
                                f"the new weights name {len(unknown)} tensor(s) this model does not have "
                                f"(e.g. {', '.join(unknown[:3])}): publish the model's own names (a LoRA "
                                "learner's merged state, not the PEFT model's state_dict)"
                            )
                        try:
                            self._model.load_state_dict(state, strict=False)
                        except RuntimeError as exc:
                            raise EngineError(f"the new weights do not fit the model: {exc}") from exc
                        self._version = version
                    else:
                        _load_adapter(self._model, state, adapter)
                        self._adapters[adapter] = version
                    if self.prefix_cache is not None:  # computed by the old weights
                        self.prefix_cache.clear(adapter, everything=adapter is None)
            finally:
                self._draining -= 1
                self._cond.notify_all()
        served = f"adapter {adapter!r}" if adapter else "policy"
        logger.info("embedded engine now serves %s version %d", served, version)

    def _adapter_names(self, rows: list[_Request]) -> dict[str, Any]:
        """The forward pass's ``adapter_names`` (one per row; PEFT's mixed-adapter batch) when adapters are served."""
        if not self._adapters:
            return {}
        return {"adapter_names": [r.adapter or _BASE for r in rows]}

    async def _submit(
        self, input_ids: list[int], sampling: Sampling, *, streaming: bool, adapter: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        if self._closed:
            raise EngineError("the engine is closed")
        if adapter is not None and adapter not in self._adapters:
            raise EngineError(f"the engine serves no adapter {adapter!r}")
        if not input_ids:
            raise EngineError("empty prompt")
        gen = random.Random(sampling.seed if sampling.seed is not None else random.getrandbits(63))
        req = _Request(
            input_ids=list(input_ids),
            sampling=sampling,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
            streaming=streaming,
            generator=gen,
            stop_ids=self._eos_ids | set(sampling.stop_token_ids),
            queued_at=self.stats["steps"],
            adapter=adapter,
        )
        with self._cond:
            self._pending.append(req)
            self._cond.notify_all()
        while True:
            item = await req.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def _run(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)  # this thread's intra-op threads (torch keeps them per thread)
        self.stats["threads"] = torch.get_num_threads()
        batch = _Batch(self._device)
        while True:
            with self._cond:
                while not self._closed and not batch.rows and (not self._pending or self._draining):
                    self._cond.wait()
                if self._closed:
                    for req in batch.rows:
                        req.fail(EngineError("the engine was closed"))
                    return
                admit: list[_Request] = []
                if self._pending and not self._draining and (not batch.rows or self._admit_now(batch)):
                    room = self._max_batch_size - batch.live
                    admit, self._pending = self._pending[:room], self._pending[room:]
                self._running = len(batch.rows) + len(admit)
            if self._threads and self._threads != self.stats["threads"]:  # set_threads asked for others
                torch.set_num_threads(self._threads)
                self.stats["threads"] = torch.get_num_threads()
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                with self._model_lock, torch.inference_mode():
                    if admit:
                        for req in admit:
                            req.version = self._version if req.adapter is None else self._adapters[req.adapter]
                        self._prefill(batch, admit)
                    self._step(batch)
            except Exception as exc:  # every waiting request must hear about the failure
                logger.exception("embedded generation failed")
                for req in batch.rows + admit:
                    if req.finish_reason is None:
                        req.fail(EngineError(f"generation failed: {exc}"))
                batch = _Batch(self._device)
            self.stats["busy_s"] += time.perf_counter() - t0
            self.stats["cpu_s"] += time.thread_time() - cpu0
            if not batch.rows:
                with self._cond:
                    self._running = 0
                    self._cond.notify_all()

    def _autocast(self) -> Any:
        """The prefills' autocast: bfloat16 matrix products with ``precision="bf16"`` (the first sampled token's
        log-prob carries bf16 rounding, ~1e-2; the keys/values come out fp32), else none. Decode steps stay fp32:
        one token's step over a 5.7k-token cache ran 0.10-0.13 s in fp32 and 0.15-3.5 s under bf16 autocast on SmolLM2
        (a Xeon with AMX), where a 5.7k-token prefill ran 19 s in fp32 and 5.6 s in bf16."""
        if self.precision != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, dtype=torch.bfloat16)

    def _admit_now(self, batch: _Batch) -> bool:
        """Whether waiting requests join the running batch now: a prefill is a forward pass of its own, so they
        join once they are many (half the running rows) or the oldest has waited ``ADMIT_AFTER_STEPS`` steps."""
        if not self._continuous or batch.live >= self._max_batch_size:
            return False
        waited = self.stats["steps"] - self._pending[0].queued_at
        return len(self._pending) * 2 >= batch.live or waited >= self.ADMIT_AFTER_STEPS

    def _prefill(self, batch: _Batch, admit: list[_Request]) -> None:
        """Run the new rows' prompts (past the cached prefix of each, each distinct prompt once) and merge them into
        the running batch."""
        self.stats["batches"] += 1
        self.stats["requests"] += len(admit)
        self.stats["prompt_tokens"] += sum(len(r.input_ids) for r in admit)
        # identical prompts admitted together run once: a group's rollouts send the same first prompt at the same
        # moment, and its rows would each compute it (same keys/values, same logits; each row samples on its own)
        index: dict[tuple[str | None, tuple[int, ...]], int] = {}
        runs: list[_Request] = []  # the rows of the forward pass: each prompt's first request
        twins: list[int] = []  # admit[i]'s row in it
        for req in admit:
            key = (req.adapter, tuple(req.input_ids))
            if key not in index:
                index[key] = len(runs)
                runs.append(req)
            else:
                self.stats["twin_tokens"] += len(req.input_ids)
            twins.append(index[key])
        kv, mask, logits = self._prefill_rows(runs)
        rows = None
        if len(runs) < len(admit):
            for i, req in enumerate(admit):
                req.reused = runs[twins[i]].reused
            rows = torch.tensor(twins, device=self._device)  # the twins' keys/values: gathered as the batch takes them
            mask, logits = mask[rows], logits[rows]
        lengths = torch.tensor([len(r.input_ids) for r in admit], device=self._device)
        batch.merge(admit, kv, mask, lengths, logits, rows=rows)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch.rows))

    def _prefill_rows(self, admit: list[_Request]) -> tuple[_KV, torch.Tensor, torch.Tensor]:
        """One forward pass over the prompts of ``admit`` (past their cached prefixes): their keys/values, attention
        mask (rows right-aligned) and next-token logits; each prompt long enough goes into the prefix cache.

        Every row's tokens stay contiguous in the cache (its columns run from its first token to the last column):
        the new parts all get the width of the longest one, and a row whose cached prefix leaves a shorter new part
        reuses less of it (runs a few cached tokens again) instead of leaving a hole."""
        if self.prefix_cache is not None and len(admit) > 1:
            self._prefill_shared_heads(admit)
        past: list[_KV | None] = []
        hits: list[int] = []
        for req in admit:
            n, kv = (0, None) if self.prefix_cache is None else self.prefix_cache.lookup(req.input_ids, req.adapter)
            hits.append(min(n, len(req.input_ids) - 1))  # at least one prompt token runs, for the next logits
            past.append(kv)
        width_new = max(len(r.input_ids) - n for r, n in zip(admit, hits, strict=True))
        for req in admit:
            req.reused = max(0, len(req.input_ids) - width_new)
            self.stats["reused_tokens"] += req.reused
        width_past = max(r.reused for r in admit)
        total = width_past + width_new
        b, dev = len(admit), self._device
        ids = torch.full((b, width_new), self._pad_id, dtype=torch.long)
        mask = torch.zeros((b, total), dtype=torch.long)
        positions = torch.zeros((b, width_new), dtype=torch.long)
        for i, r in enumerate(admit):
            new = r.input_ids[r.reused :]
            ids[i, width_new - len(new) :] = torch.tensor(new)
            mask[i, total - len(r.input_ids) :] = 1
            positions[i, width_new - len(new) :] = torch.arange(r.reused, len(r.input_ids))
        cache = DynamicCache()
        if width_past:
            cache = DynamicCache(ddp_cache_data=_stack_past(past, [r.reused for r in admit], width_past))
        with self._autocast():
            out = self._model(
                input_ids=ids.to(dev),
                attention_mask=mask.to(dev),
                position_ids=positions.to(dev),
                past_key_values=cache,
                use_cache=True,
                **self._adapter_names(admit),
            )
        logits = out.logits[:, -1, :].float()
        kv = _cache_kv(cache)
        if self.prefix_cache is not None:
            for i, r in enumerate(admit):
                if len(r.input_ids) - hits[i] < self.PREFIX_CHUNK:
                    continue
                # its group's other rollouts start with this prompt, and other prompts with its head (system prompt,
                # tools): keep it (the cache indexes its prefixes at multiples of PREFIX_CHUNK tokens)
                start = total - len(r.input_ids)
                self.prefix_cache.put(r.input_ids, _row_copy(kv, i, start), r.adapter)
        return kv, mask.to(dev), logits

    def _prefill_shared_heads(self, admit: list[_Request]) -> None:
        """Run once, alone, each long head that several admitted prompts share and the cache lacks, and cache it.

        A group's rollouts send the same first prompt at once, and every call of a coding CLI starts with the same
        thousands of tokens (its instructions and tools): prefilled in one batch, each row would compute that head
        on its own (four 5.7k-token rows: four times the work and a [4, heads, 5.7k, 5.7k] attention). The head runs
        as one row and goes into the prefix cache, so the batch's lookups below reuse it."""
        assert self.prefix_cache is not None
        chunk = self.PREFIX_CHUNK
        groups: dict[tuple[str | None, tuple[int, ...]], list[_Request]] = {}
        for r in admit:
            if len(r.input_ids) > 4 * chunk:
                groups.setdefault((r.adapter, tuple(r.input_ids[:chunk])), []).append(r)
        for (adapter, _), rows in groups.items():
            if len(rows) < 2:
                continue
            first = rows[0].input_ids
            head = min(min(_common_prefix(first, r.input_ids), len(r.input_ids) - 1) for r in rows[1:])
            head = min(head, len(first) - 1) // chunk * chunk
            cached = max(self.prefix_cache.peek(r.input_ids[:head], adapter)[0] for r in rows)
            if head - cached < 4 * chunk:  # little to share: the batch prefills it as it is
                continue
            self._prefill_alone(first[:head], adapter)
            self.stats["shared_head_tokens"] += head - cached

    def _prefill_alone(self, ids: list[int], adapter: str | None) -> None:
        """Prefill ``ids`` as one row (past its cached prefix) and put its KV in the prefix cache."""
        assert self.prefix_cache is not None
        n, kv = self.prefix_cache.lookup(ids, adapter)
        n = min(n, len(ids) - 1)
        cache = DynamicCache()
        if kv is not None and n > 0:
            cache = DynamicCache(ddp_cache_data=[(k[None, :, :n], v[None, :, :n]) for k, v in kv])
        dev = self._device
        with self._autocast():
            self._model(
                input_ids=torch.tensor([ids[n:]], device=dev),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=dev),
                position_ids=torch.arange(n, len(ids), device=dev).unsqueeze(0),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **({"adapter_names": [adapter or _BASE]} if self._adapters else {}),
            )
        self.prefix_cache.put(ids, [(k[0], v[0]) for k, v in _cache_kv(cache)], adapter)

    def _step(self, batch: _Batch) -> None:
        """Sample one token for every live row and run the batch one position on.

        A row that stops stays in the batch, masked, until a quarter of the rows are such (or rows join): dropping
        it at once would copy the whole cache each time any row stops."""
        assert batch.logits is not None
        live = [j for j, r in enumerate(batch.rows) if r.finish_reason is None]
        logits = batch.logits if len(live) == len(batch.rows) else batch.logits[live]
        rows = [batch.rows[j] for j in live]
        tokens, logprobs = _sample_rows(logits, [r.sampling for r in rows], [r.generator for r in rows])
        step_tokens = [self._pad_id] * len(batch.rows)
        attend = [0] * len(batch.rows)
        for i, (j, req) in enumerate(zip(live, rows, strict=True)):
            req.ids.append(tokens[i])
            req.logprobs.append(logprobs[i])
            self.stats["tokens"] += 1
            req.finish_reason = self._finish_reason(req, len(req.input_ids))
            if req.finish_reason is None:
                step_tokens[j], attend[j] = tokens[i], 1
            elif self.prefix_cache is not None:  # its KV: prompt + completion but the last token (never run)
                n = len(req.input_ids) + len(req.ids) - 1
                self.prefix_cache.put(req.input_ids + req.ids[:-1], _row_copy(batch.kv(), j, -n), req.adapter)
            req.deliver(final=req.finish_reason is not None)
        alive = [j for j in range(len(batch.rows)) if attend[j]]
        if not alive:
            batch.select([])
            return
        if 4 * (len(batch.rows) - len(alive)) >= len(batch.rows):
            batch.select(alive)
            step_tokens = [step_tokens[j] for j in alive]
            attend = [1] * len(alive)
        self.stats["steps"] += 1
        step_ids = torch.tensor(step_tokens, device=self._device).unsqueeze(1)
        out = self._model(
            input_ids=step_ids,
            attention_mask=batch.extend_mask(attend),
            position_ids=batch.positions.unsqueeze(1),
            past_key_values=batch.cache,
            use_cache=True,
            **self._adapter_names(batch.rows),
        )
        batch.logits = out.logits[:, -1, :].float()
        batch.positions = batch.positions + 1

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


class AdapterEngine(Engine):
    """One LoRA adapter of an ``EmbeddedEngine`` as an ``Engine`` (a policy of a multi-policy run): its requests run
    the adapter over the shared base; ``update_weights`` loads the adapter's PEFT state dict (``Learner.weights`` of a
    LoRA learner with ``merged=False``) and serves it as that policy's ``version``. ``close`` leaves the shared
    engine running: its owner closes it."""

    def __init__(self, engine: EmbeddedEngine, name: str) -> None:
        self.base = engine
        self.name = name

    @property
    def policy_version(self) -> int:
        return self.base.adapters[self.name]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.base.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.base.max_model_len

    @property
    def stats(self) -> dict[str, Any]:
        return self.base.stats

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        ids: list[int] = []
        logprobs: list[float] = []
        reason: str | None = None
        version: int | None = None
        async for delta in self.base._submit(input_ids, sampling, streaming=False, adapter=self.name):
            ids += delta.ids
            logprobs += delta.logprobs
            reason, version = delta.finish_reason, delta.policy_version
        return Generation(
            completion_ids=ids, logprobs=logprobs, finish_reason=reason or "abort", policy_version=version
        )

    def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        return self.base._submit(input_ids, sampling, streaming=True, adapter=self.name)

    async def update_weights(self, source: Any, version: int) -> None:
        state = _load_state(source)
        await asyncio.to_thread(self.base._swap, state, version, self.name)

    async def close(self) -> None:
        return None


def _load_adapter(model: Any, state: Mapping[str, torch.Tensor], name: str) -> None:
    """Load a PEFT adapter state dict (``get_peft_model_state_dict``'s keys, no adapter name) as adapter ``name``;
    a state that does not cover the adapter's every weight is refused (a partial load would serve a mix)."""
    from peft import set_peft_model_state_dict

    expected = {k for k in model.state_dict() if f".{name}." in k and ".lora_" in k}
    try:
        result: Any = set_peft_model_state_dict(model, dict(state), adapter_name=name)
    except RuntimeError as exc:
        raise EngineError(f"the weights of adapter {name!r} do not fit it: {exc}") from exc
    missing = expected & set(result.missing_keys)
    if missing or result.unexpected_keys:
        raise EngineError(
            f"the weights of adapter {name!r} do not fit it: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(result.unexpected_keys)[:3]}"
        )


class _Batch:
    """The running rows: one left-padded KV cache, an attention mask, each row's next position and logits."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[_Request] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.positions = torch.zeros((0,), dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None

    def kv(self) -> _KV:
        return _cache_kv(self.cache) if self.cache is not None else []

    @property
    def live(self) -> int:
        """Rows still generating (stopped rows stay until the batch is compacted)."""
        return sum(1 for r in self.rows if r.finish_reason is None)

    def merge(
        self,
        requests: list[_Request],
        kv: _KV,
        mask: torch.Tensor,
        positions: torch.Tensor,
        logits: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Add prefilled rows: both caches are left-padded to the wider one and stacked. ``rows``: the rows of
        ``kv`` that the requests take, in order (an index tensor; None: one row each)."""
        live = [j for j, r in enumerate(self.rows) if r.finish_reason is None]
        # stopped rows leave here: their rows and unused columns dropped in the same copy that adds the new rows
        kept, rows_kept = self._take(live) if len(live) < len(self.rows) else (self.kv(), None)
        if not self.rows:
            self.rows, self.cache, self.mask, self.positions, self.logits = (
                list(requests),
                _room_cache(kv, rows=[rows]),
                mask,
                positions,
                logits,
            )
            return
        assert self.logits is not None
        width = max(self.mask.shape[1], mask.shape[1])
        self.cache = _room_cache(kept, kv, width=width, rows=[rows_kept, rows])  # each part copied once, with room
        self.mask = torch.cat(
            [F.pad(self.mask, (width - self.mask.shape[1], 0)), F.pad(mask, (width - mask.shape[1], 0))]
        )
        self.positions = torch.cat([self.positions, positions])
        self.logits = torch.cat([self.logits, logits])
        self.rows += requests

    def select(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (indices into ``rows``); drop the columns no remaining row uses."""
        kv, rows = self._take(keep)
        self.cache = _room_cache(kv, rows=[rows]) if self.rows else None

    def _take(self, keep: list[int]) -> tuple[_KV, torch.Tensor | None]:
        """``select`` but for the cache: the rows' and the mask's bookkeeping done, the keys/values of the columns
        still used (views) and the rows to take from them returned, for the caller to build the cache from (one
        copy, gathering the rows straight into the new buffers)."""
        self.rows = [self.rows[j] for j in keep]
        if not keep:
            self.cache, self.logits = None, None
            self.mask = self.mask[:0]
            self.positions = self.positions[:0]
            return [], None
        assert self.cache is not None and self.logits is not None
        idx = torch.tensor(keep, device=self.device)
        self.mask, self.positions, self.logits = self.mask[idx], self.positions[idx], self.logits[idx]
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0].item()) if used.numel() else self.mask.shape[1]
        self.mask = self.mask[:, first:]
        return [(k[:, :, first:], v[:, :, first:]) for k, v in self.kv()], idx

    def extend_mask(self, attend: list[int]) -> torch.Tensor:
        """The mask with one more column for the token about to run (attended by the live rows, 1 in ``attend``)."""
        column = torch.tensor(attend, dtype=self.mask.dtype, device=self.device).unsqueeze(1)
        self.mask = torch.cat([self.mask, column], dim=1)
        return self.mask


class _RoomLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A ``DynamicLayer`` whose keys and values live at the front of a buffer with room for more tokens, so that a
    decode step writes its token in place. ``DynamicLayer.update`` concatenates: every decode step copied the whole
    batch's cache, each layer (py-spy on the calc example's RL phase, 2026-12-06: ~28% of the engine thread's busy
    samples in that ``torch.cat``, and memory traffic the learner on the other core shares). Here a step copies only
    when the room runs out, and then makes room for a quarter more (at least ``ROOM`` tokens)."""

    ROOM = 32

    @classmethod
    def room_for(cls, tokens: int) -> int:
        """The buffer's length for ``tokens`` cached tokens: a quarter more, at least ``ROOM`` more."""
        return tokens + max(cls.ROOM, tokens // 4)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k: torch.Tensor | None = None  # the buffers; ``keys``/``values`` are views of their cached front
        self._v: torch.Tensor | None = None

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, used: int) -> None:
        """Take ``keys``/``values`` ([rows, heads, room, dim]) as the buffers, their first ``used`` tokens cached."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._k, self._v = keys, values
        self.keys, self.values = keys[..., :used, :], values[..., :used, :]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k, v = self._k, self._v
        n = 0 if k is None else self.get_seq_length()  # the cached front of the buffers
        end = n + key_states.shape[-2]
        if k is None or v is None or end > k.shape[-2]:
            room = self.room_for(end)
            grown_k = key_states.new_empty((*key_states.shape[:-2], room, key_states.shape[-1]))
            grown_v = value_states.new_empty((*value_states.shape[:-2], room, value_states.shape[-1]))
            if k is not None and v is not None and n:
                grown_k[..., :n, :] = k[..., :n, :]
                grown_v[..., :n, :] = v[..., :n, :]
            k, v = grown_k, grown_v
        k[..., n:end, :] = key_states
        v[..., n:end, :] = value_states
        self.adopt(k, v, end)
        return k[..., :end, :], v[..., :end, :]

    # transformers' own edits of the cache replace keys/values: take them as the buffers (no room left behind)
    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        self._readopt()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._readopt()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._readopt()

    def _readopt(self) -> None:
        keys, values = self.keys, self.values
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == 4:
            self.adopt(keys, values, keys.shape[-2])


def _room_cache(
    *parts: _KV, width: int | None = None, rows: Sequence[torch.Tensor | None] | None = None
) -> DynamicCache:
    """A ``DynamicCache`` of ``_RoomLayer`` over the rows of ``parts`` stacked (each part one (keys, values) per
    layer, [rows, heads, tokens, dim]), each part left-padded with zeros to ``width`` tokens (default: the widest):
    the running batch's cache, every part copied once into a buffer with room to decode into. ``rows[i]``, when
    given and not None, picks part i's rows (an index tensor): they are gathered straight into the buffer."""
    picks = list(rows) if rows is not None else [None] * len(parts)
    layers: list[_RoomLayer] = []
    for per_layer in zip(*parts, strict=True):
        w = width if width is not None else max(k.shape[2] for k, _ in per_layer)
        k0, v0 = per_layer[0]
        sizes = [k.shape[0] if pick is None else pick.numel() for (k, _), pick in zip(per_layer, picks, strict=True)]
        room = _RoomLayer.room_for(w)
        keys = k0.new_empty((sum(sizes), k0.shape[1], room, k0.shape[3]))
        values = v0.new_empty((sum(sizes), v0.shape[1], room, v0.shape[3]))
        r = 0
        for (k, v), pick, b in zip(per_layer, picks, sizes, strict=True):
            t = k.shape[2]
            if t < w:  # left padding: masked, but never garbage (a NaN key would poison the masked softmax)
                keys[r : r + b, :, : w - t].zero_()
                values[r : r + b, :, : w - t].zero_()
            if pick is None:
                keys[r : r + b, :, w - t : w] = k
                values[r : r + b, :, w - t : w] = v
            else:  # gathered into place: one copy (indexing first, then copying, was two and 2.5x slower)
                torch.index_select(k, 0, pick, out=keys[r : r + b, :, w - t : w])
                torch.index_select(v, 0, pick, out=values[r : r + b, :, w - t : w])
            r += b
        layer = _RoomLayer()
        layer.adopt(keys, values, w)
        layers.append(layer)
    cache = DynamicCache()
    cache.layers = layers  # type: ignore[assignment]
    return cache


def _row_copy(kv: _KV, row: int, start: int) -> _KV:
    """Row ``row``'s keys and values from column ``start`` on, every layer, in two copies: the keys of all layers
    stacked ([layers, heads, tokens, dim]) and the values, handed out as per-layer views. The prefix cache keeps
    every finished row; a ``clone`` per layer's keys and per layer's values was eight operations a row on the tiny
    policy, each giving up and taking back the interpreter lock, and in the main job's engine thread they took
    102 of 961 samples, about as many as the decode steps' sampling and compaction together (py-spy, issue 25)."""
    keys = torch.stack([k[row, :, start:] for k, _ in kv])
    values = torch.stack([v[row, :, start:] for _, v in kv])
    return [(keys[i], values[i]) for i in range(len(kv))]


def _cache_kv(cache: DynamicCache) -> _KV:
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[union-attr,misc]


def _stack_past(past: list[_KV | None], lengths: list[int], width: int) -> _KV:
    """The cached prefixes of the new rows as one batch: each row's first ``lengths[i]`` tokens, left-padded."""
    template = next(kv for kv in past if kv is not None)
    out: _KV = []
    for layer, (k_t, v_t) in enumerate(template):
        heads, dim = k_t.shape[0], k_t.shape[2]
        keys = k_t.new_zeros((len(past), heads, width, dim))
        values = v_t.new_zeros((len(past), heads, width, v_t.shape[2]))
        for i, (kv, n) in enumerate(zip(past, lengths, strict=True)):
            if kv is not None and n > 0:
                keys[i, :, width - n :] = kv[layer][0][:, :n]
                values[i, :, width - n :] = kv[layer][1][:, :n]
        out.append((keys, values))
    return out


def _sample_rows(
    logits: torch.Tensor, samplings: list[Sampling], generators: list[random.Random]
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` ([rows, vocab]) with its log-prob (temperature applied, before top-p).

    The sampled rows draw together, by inversion: each row's uniform number (from its request's own generator, so
    a seed gives the same tokens whatever else is in the batch) is placed in its row's cumulative distribution, one
    ``searchsorted`` for the batch. Drawing each row with ``torch.multinomial`` and a ``torch.Generator`` cost
    ~60 us a row: 3.9 ms of a 64-row decode step whose forward pass takes ~16 ms (the tiny policy, one thread)."""
    temps = [s.temperature if s.temperature > 0.0 else 1.0 for s in samplings]
    if all(t == temps[0] for t in temps):
        logp = torch.log_softmax(logits / temps[0] if temps[0] != 1.0 else logits, dim=-1)
    else:
        logp = torch.log_softmax(logits / torch.tensor(temps, device=logits.device).unsqueeze(1), dim=-1)
    finite = torch.isfinite(logp.max(dim=-1).values)
    if not bool(finite.all()):  # NaN or infinite logits: a broken model, never a silent token
        bad = int((~finite).sum())
        raise FloatingPointError(f"the model's logits are not finite in {bad} of {len(samplings)} rows")
    tokens: list[int] = torch.argmax(logits, dim=-1).tolist()
    drawn = [j for j, s in enumerate(samplings) if s.temperature > 0.0]
    if drawn:
        rows = logp if len(drawn) == len(samplings) else logp[drawn]
        probs = rows.to(torch.float32 if rows.device.type == "mps" else torch.float64).exp()  # MPS has no float64
        for i, j in enumerate(drawn):
            top_p = samplings[j].top_p
            if top_p < 1.0:  # drop tokens once the mass before them reaches top_p
                sorted_probs, order = torch.sort(probs[i], descending=True)
                cut = sorted_probs.cumsum(-1) - sorted_probs >= top_p
                probs[i] = torch.zeros_like(probs[i]).scatter(0, order, sorted_probs.masked_fill(cut, 0.0))
        cdf = probs.cumsum(-1)
        u = torch.tensor([generators[j].random() for j in drawn], dtype=cdf.dtype, device=cdf.device)
        # the first token whose cumulative mass passes u * total: never a token of zero mass (its cumulative mass
        # equals the one before it); u * total rounding up to the total falls back to the last token with mass
        picks = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        last = probs.shape[1] - 1 - torch.argmax((probs.flip(1) > 0).to(torch.uint8), dim=1)
        for j, token in zip(drawn, torch.minimum(picks, last).tolist(), strict=True):
            tokens[j] = int(token)
    picked = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    return tokens, [float(x) for x in picked]


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
