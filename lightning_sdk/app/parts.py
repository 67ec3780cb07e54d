"""The one place that turns the ``[engine]`` and learner sections into the training parts: who serves the policy, who
updates it, and what the serving engine is handed after each update.

    [learner] / [verl] ─▶ learner  [learner]: ``Learner`` (torch, in process) | [verl]: ``VerlLearner`` (FSDP ranks)
    [engine]           ─▶ engine   embedded: ``EmbeddedEngine``     | sglang / vllm: servers at ``urls`` or launched
    both               ─▶ weights  embedded engine: a state dict in memory | sglang / vllm: a checkpoint dir on disk

The training loop (``app/loop.py``) only sees ``Parts``: it calls ``learner.step(records)``, ``weights()`` and
``engine.update_weights`` and never asks which backend or engine it has. Remote engines are wrapped in
``ServedEngine`` so they offer what the trainer needs of an engine besides the ``Engine`` protocol (the tokenizer,
token counts). Sampling settings are not the engine's: the proxy applies them per request, by the attempt's split
(``proxy/sampling.py``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_sdk.engines.base import Engine, Generation, GenerationDelta, Sampling
from lightning_sdk.errors import EngineError
from lightning_sdk.records.record import Record
from lightning_sdk.trainer.config import EngineConfig, VerlSettings
from lightning_sdk.trainer.learner import Learner, LearnerConfig

__all__ = [
    "LearnerLike",
    "Parts",
    "ServedEngine",
    "ServingEngine",
    "build_parts",
]

logger = logging.getLogger(__name__)


class ServingEngine(Engine, Protocol):
    """An ``Engine`` plus what the trainer uses: the tokenizer and ``stats["tokens"]`` (tokens generated so far)."""

    stats: dict[str, int]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...


class LearnerLike(Protocol):
    """What the training loop asks of a learner (``Learner`` and ``VerlLearner`` both are one)."""

    steps: int

    def step(self, records: Sequence[Record]) -> dict[str, float]: ...

    def weights(self) -> dict[str, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ServedEngine:
    """A remote engine (SGLang/vLLM client) with the trainer's extras; stops the servers it launched on close."""

    def __init__(self, inner: Engine, tokenizer: PreTrainedTokenizerBase, servers: Sequence[Any] = ()) -> None:
        self.inner = inner
        self._tokenizer = tokenizer
        self._servers = list(servers)
        self.stats: dict[str, int] = {"tokens": 0, "requests": 0}
        # turns a state dict (what the warm start hands over) into a checkpoint directory the servers can load
        self.write_state: Callable[[dict[str, torch.Tensor]], str] | None = None

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

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


@dataclass
class Parts:
    """What ``build_parts`` made. ``weights()`` is what ``engine.update_weights`` gets after a step (run it off the
    event loop: it may write a checkpoint); ``model`` is the torch model a warm start trains (None: the backend
    keeps its weights elsewhere, so no warm start)."""

    engine: ServingEngine
    learner: LearnerLike
    weights: Callable[[], Any]
    save_model: Callable[[Path], None]
    model: PreTrainedModel | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    async def close(self) -> None:
        """Close the engine (and the servers it launched), then shut the backend down."""
        await self.engine.close()
        for close in self.closers:
            close()


def _remote_engine(ec: EngineConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> ServedEngine:
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


def _disk_weights(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, root: Path
) -> Callable[[dict[str, torch.Tensor] | None], str]:
    """``weights()`` of the embedded learner for a remote engine: an HF checkpoint per published version (the two
    newest are kept: the one being loaded and the one served before it)."""
    count = 0

    def write(state: dict[str, torch.Tensor] | None = None) -> str:
        """Save the model's current weights, or ``state`` (a state dict of the same model), as a checkpoint."""
        nonlocal count
        count += 1
        out = root / f"v{count:06d}"
        model.save_pretrained(str(out), state_dict=state)
        tokenizer.save_pretrained(str(out))
        old = root / f"v{count - 2:06d}"
        if count > 2 and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        return str(out)

    return write


def build_parts(
    run_dir: Path, model_dir: Path, *, engine: EngineConfig, learner: LearnerConfig | VerlSettings
) -> Parts:
    """Engine + learner + weight publishing for ``model_dir``: the engine ``engine`` says, and the learner of the
    learner section handed over (``[learner]``: the embedded ``Learner``; ``[verl]``: verl's ranks)."""
    from lightning_sdk.policy.model import load_policy

    remote = engine.kind != "embedded"
    model, tokenizer = load_policy(model_dir)
    served: ServingEngine
    if remote:
        served = _remote_engine(engine, model_dir, tokenizer)
    else:
        from lightning_sdk.engines.embedded import EmbeddedEngine

        # the engine serves a copy of the policy; the embedded learner trains the original
        served = EmbeddedEngine(
            copy.deepcopy(model), tokenizer, max_batch_size=engine.max_batch_size, threads=engine.threads
        )
    if isinstance(learner, VerlSettings):
        try:
            return _verl_parts(learner, run_dir, model_dir, served, tokenizer, remote)
        except BaseException:
            if isinstance(served, ServedEngine):
                served.stop_servers()
            raise
    pad = tokenizer.pad_token_id
    trainer = Learner(model, learner, pad_id=int(pad) if pad is not None else 0)
    weights: Callable[[], Any] = trainer.weights
    if isinstance(served, ServedEngine):
        writer = _disk_weights(model, tokenizer, run_dir / "weights")
        served.write_state = writer
        weights = lambda: writer(None)  # noqa: E731

    def save(out: Path) -> None:
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))

    return Parts(engine=served, learner=trainer, weights=weights, save_model=save, model=model)


def _verl_parts(
    launch: VerlSettings,
    run_dir: Path,
    model_dir: Path,
    engine: ServingEngine,
    tokenizer: PreTrainedTokenizerBase,
    remote: bool,
) -> Parts:
    from lightning_sdk.trainer.verl.adapter import VerlLearner
    from lightning_sdk.trainer.verl.backend import VerlBackend

    pad = tokenizer.pad_token_id
    backend = VerlBackend(
        launch.verl_config(str(model_dir)),
        ray_address=launch.ray_address,
        ray_num_cpus=launch.ray_num_cpus,
        use_ray=launch.use_ray,
        publish_dir=run_dir / "weights",
        pad_id=int(pad) if pad is not None else 0,
    )
    learner = VerlLearner(backend)

    def on_disk() -> str:
        return str(backend.save_weights())

    def save(out: Path) -> None:
        backend.ranks.call_all("save_hf", str(out))
        tokenizer.save_pretrained(str(out))

    return Parts(
        engine=engine,
        learner=learner,
        weights=on_disk if remote else learner.weights,
        save_model=save,
        model=None,
        closers=[backend.shutdown],
    )
