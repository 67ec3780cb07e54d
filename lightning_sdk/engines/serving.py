"""The ``[engine]`` section and the engine it names, as the trainer serves it: who generates for the proxy.

    kind = "embedded"          ─▶ ``EmbeddedEngine`` (in process, on a copy of the policy)
    kind = "sglang" / "vllm"   ─▶ their clients on ``urls`` (running servers) or on servers launched here
                                  (``engines/launch.py``), wrapped in ``ServedEngine``

``ServingEngine`` is what the trainer needs of an engine besides the ``Engine`` protocol (the tokenizer, token
counts); ``ServedEngine`` gives a remote one those, loads a state dict by writing a checkpoint directory
(``engines/checkpoints.py``) and stops the servers it launched. A new engine is a module here (the ``Engine`` protocol,
``engines/base.py``), a ``kind`` and its branch in ``open_engine``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_sdk.engines.base import DelegatingEngine, Engine, Generation, GenerationDelta, Sampling
from lightning_sdk.errors import EngineError

__all__ = [
    "ENGINE_KINDS",
    "EngineConfig",
    "EngineKind",
    "ServedEngine",
    "ServingEngine",
    "open_engine",
]

logger = logging.getLogger(__name__)

EngineKind = Literal["embedded", "sglang", "vllm"]
"""``[engine] kind``: who serves the policy to the proxy."""
ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)


class EngineConfig(BaseModel):
    """Who serves the policy: the in-process embedded engine, or SGLang/vLLM servers (``urls`` of running ones, or
    ``launch = true`` to start them with ``lightning_sdk.engines.launch`` on ``model_path``, default the policy)."""

    model_config = ConfigDict(extra="forbid")

    kind: EngineKind = Field("embedded", description="embedded (in process), sglang or vllm servers")
    urls: list[str] = Field(default_factory=list, description="running servers (sglang/vllm)")
    launch: bool = Field(False, description="start the servers (sglang/vllm) with lightning_sdk.engines.launch")
    model_path: str | None = Field(None, description="launch: the model the servers load (default: the policy)")
    gpus: list[list[int]] = Field(
        default_factory=list, description="launch: one server per GPU group (tensor parallel within)"
    )
    extra_args: list[str] = Field(default_factory=list, description="launch: appended to the server's command line")
    python: str | None = Field(
        None, description="launch, kind vllm: vLLM's venv python (default $LIGHTNING_SDK_VLLM_PYTHON)"
    )
    max_batch_size: int = Field(256, ge=1, description="embedded: requests generated together")
    threads: int | None = Field(
        None,
        ge=1,
        description="embedded: torch intra-op threads of the engine's thread (torch keeps them per thread; default: "
        "the process's, all cores)",
    )
    prefix_cache_tokens: int = Field(
        32768,
        ge=0,
        description="embedded: tokens of keys/values the prefix cache keeps (recent prompts and finished rows, reused "
        "by calls that extend them; 0: no cache). Its memory is this times the model's keys/values per token (8 KiB "
        "on the tiny policy, 45 KiB on SmolLM2-135M)",
    )
    precision: Literal["fp32", "bf16", "auto"] = Field(
        "fp32",
        description="embedded: the prefills' compute dtype (bf16: autocast to bfloat16; decode steps stay fp32, and "
        "the first sampled token's log-prob carries bf16 rounding, which the learner's importance ratio sees); auto: "
        "bf16 where the CPU has AVX-512 BF16 or AMX, else fp32. SmolLM2's 5.7k-token prefill took 19 s in fp32 and "
        "5.6 s in bf16 on a 2-core Xeon with AMX",
    )

    @model_validator(mode="after")
    def _servers(self) -> EngineConfig:
        if self.kind == "embedded" and (self.urls or self.launch):
            raise ValueError("engine.urls / engine.launch are for kind 'sglang' or 'vllm', not 'embedded'")
        if self.kind != "embedded" and not self.urls and not self.launch:
            raise ValueError(f"engine.kind {self.kind!r} needs engine.urls (running servers) or engine.launch = true")
        if self.urls and self.launch:
            raise ValueError("engine.urls and engine.launch = true exclude each other")
        return self


class ServingEngine(Engine, Protocol):
    """An ``Engine`` plus what the trainer uses: the tokenizer and ``stats["tokens"]`` (tokens generated so far)."""

    stats: dict[str, int]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...


class ServedEngine(DelegatingEngine):
    """A remote engine (SGLang/vLLM client) with the trainer's extras; stops the servers it launched on close."""

    def __init__(self, inner: Engine, tokenizer: PreTrainedTokenizerBase, servers: Sequence[Any] = ()) -> None:
        self.inner = inner
        self._tokenizer = tokenizer
        self._servers = list(servers)
        self.stats: dict[str, int] = {"tokens": 0, "requests": 0}
        # turns a state dict (what the warm start hands over) into a checkpoint directory the servers can load
        self.write_state: Callable[[dict[str, torch.Tensor]], str] | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        self.stats["requests"] += 1
        gen = await self.inner.generate(input_ids, sampling, session_id=session_id)
        self.stats["tokens"] += len(gen.completion_ids)
        return gen

    async def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        self.stats["requests"] += 1
        async for delta in self.inner.stream(input_ids, sampling, session_id=session_id):
            self.stats["tokens"] += len(delta.ids)
            yield delta

    async def update_weights(self, source: Any, version: int) -> None:
        if isinstance(source, dict):  # a state dict: servers load checkpoints from disk
            if self.write_state is None:
                raise EngineError("this engine loads weights from a checkpoint directory, not a state dict")
            source = await asyncio.to_thread(self.write_state, source)
        await self.inner.update_weights(source, version)

    async def close(self) -> None:
        await self.inner.close()
        self.stop_servers()

    def stop_servers(self) -> None:
        """Stop the servers this engine launched (none when it was given ``urls``)."""
        for server in self._servers:
            server.stop()
        self._servers = []


def open_engine(
    config: EngineConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_dir: Path,
    *,
    lora_rank: int | None = None,
) -> ServingEngine:
    """The engine ``config`` names for the policy ``model`` (loaded from ``model_dir``): the embedded engine on a
    copy of it (the embedded learner trains the original), or a remote one (servers at ``urls``, or launched on
    ``model_path``, default ``model_dir``). ``lora_rank``: the learner trains a LoRA adapter of that rank; launched
    vLLM servers then serve runtime-loaded adapters (``launch.launch_vllm(lora_rank=...)``)."""
    if config.kind != "embedded":
        return _remote_engine(config, model_dir, tokenizer, lora_rank=lora_rank)
    from lightning_sdk.engines.embedded import EmbeddedEngine

    precision = config.precision
    if precision == "auto":
        from lightning_sdk.precision import cpu_has_bf16

        precision = "bf16" if cpu_has_bf16() else "fp32"
    return EmbeddedEngine(
        copy.deepcopy(model),
        tokenizer,
        max_batch_size=config.max_batch_size,
        threads=config.threads,
        precision=precision,
        prefix_cache=config.prefix_cache_tokens > 0,
        prefix_cache_tokens=config.prefix_cache_tokens,
    )


def _remote_engine(
    ec: EngineConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase, *, lora_rank: int | None = None
) -> ServedEngine:
    from lightning_sdk.engines import launch

    servers: list[Any] = []
    urls = list(ec.urls)
    if ec.launch:
        path = ec.model_path or str(model_dir)
        launcher = launch.launch_sglang if ec.kind == "sglang" else launch.launch_vllm
        gpus = ec.gpus or [[0]]
        kwargs: dict[str, Any] = {"extra_args": ec.extra_args}
        if ec.kind == "vllm" and ec.python:
            kwargs["python"] = ec.python
        if ec.kind == "vllm" and lora_rank:
            kwargs["lora_rank"] = lora_rank
        servers = launch.launch_many(launcher, path, gpus=gpus, **kwargs)
        urls = [s.url for s in servers]
    inner: Engine
    if ec.kind == "sglang":
        from lightning_sdk.engines.sglang import SGLangEngine

        inner = SGLangEngine(urls)
    else:
        from lightning_sdk.engines.vllm import VLLMEngine

        inner = VLLMEngine(urls)
    logger.info("policy served by %s at %s", ec.kind, ", ".join(urls))
    return ServedEngine(inner, tokenizer, servers)
