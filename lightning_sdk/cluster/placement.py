"""The parts of a job as Ray actors: engines where the GPUs are, agent workers on CPU nodes, restarted when they die.

    connect(address)                 join the cluster (``ray.init``), this checkout's import path in the actors' env
    RayEngine.launch(config, ...)    ``engines`` engine actors, each needing ``{engine_resource: 1}``; the driver's
                                     ``ServingEngine``: a call goes to its attempt's engine (prefix cache)
    ClusterRun.start(...)            ``workers`` worker actors, each a ``WorkerPool`` of ``worker_concurrency``
                                     agent workers claiming train attempts from the daemon's store over HTTP

An engine that dies (its process or its node) is restarted by Ray (``max_restarts``) on a node that has the
resource. The calls it was serving fail inside ``RayEngine.generate``, which waits for the restarted actor, gives it
the weights of the version being served and sends the call again (up to ``engine_retry_s``; after that the call
answers 502 and its attempt fails: it is never trained). Nothing was recorded for the failed try: a call is
recorded once, with the generation that answered it. A worker actor that dies is restarted and runs its pool again
(``max_task_retries``); the attempts it was running lose their lease and are retried (``max_attempts``); a cut-off
attempt never reads as succeeded, so nothing half-done is trained.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from transformers import PreTrainedTokenizerBase

from lightning_sdk.engines.base import Generation, GenerationDelta, Sampling
from lightning_sdk.errors import ConfigError, EngineError
from lightning_sdk.trainer.config import ClusterConfig

__all__ = ["ClusterRun", "RayEngine", "connect"]

logger = logging.getLogger(__name__)

_DOWN = (RayActorError, ActorUnavailableError)


def _import_path() -> str:
    """The actors import this checkout (and the agent's folder) as the driver does: its ``sys.path`` entries."""
    entries = [p for p in sys.path if p and Path(p).is_dir()]
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(dict.fromkeys([root, *entries]))


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` (``auto``: the one ``ray start`` runs on this machine) once."""
    if ray.is_initialized():
        return
    try:
        ray.init(
            address=address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": _import_path(), "LIGHTNING_SDK_LOG_LEVEL": "WARNING"}},
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cluster.ray {address!r}: cannot join the Ray cluster: {exc}") from exc
    logger.info("Ray cluster %s: %s", address, _resources())


def _resources() -> dict[str, float]:
    return dict(ray.cluster_resources())  # type: ignore[no-untyped-call]


def _where() -> dict[str, Any]:
    return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


# -- the engine actor ------------------------------------------------------------------------------------------------
class EngineHost:
    """The embedded engine in an actor (created by ``RayEngine.launch``; every method runs on the actor's loop)."""

    def __init__(self, model_dir: str, max_batch_size: int, threads: int | None) -> None:
        from lightning_sdk.engines.embedded import EmbeddedEngine

        self.engine = EmbeddedEngine.from_pretrained(model_dir, max_batch_size=max_batch_size, threads=threads)

    async def where(self) -> dict[str, Any]:
        return {**_where(), "version": self.engine.policy_version}

    async def generate(self, ids: list[int], sampling: dict[str, Any], session_id: str | None) -> dict[str, Any]:
        gen = await self.engine.generate(ids, Sampling.model_validate(sampling), session_id=session_id)
        return gen.model_dump()

    async def update_weights(self, state: Any, version: int) -> None:
        await self.engine.update_weights(state, version)

    async def close(self) -> None:
        await self.engine.close()


class RayEngine:
    """The driver's ``ServingEngine`` over the engine actors (see the module docstring). ``events`` lists what
    happened to them: ``{"part", "event": "down"|"back", "t", "error"?}`` (seconds since launch)."""

    def __init__(
        self,
        handles: list[Any],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_model_len: int | None = None,
        retry_s: float = 120.0,
    ) -> None:
        if not handles:
            raise ConfigError("cluster.engines must be at least 1")
        self._handles = handles
        self._tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.retry_s = retry_s
        self.stats: dict[str, int] = {"tokens": 0, "requests": 0, "resent": 0}
        self._version = 0
        self._weights: tuple[Any, int] | None = None  # (object ref of the served state dict, its version)
        self._locks = [asyncio.Lock() for _ in handles]
        self._t0 = time.monotonic()
        self._pids: list[int | None] = [None] * len(handles)  # each engine's process, as last seen
        self.events: list[dict[str, Any]] = []

    @classmethod
    def launch(
        cls, cluster: ClusterConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase, *, max_batch_size: int
    ) -> RayEngine:
        """``cluster.engines`` engine actors serving ``model_dir``, each on a node with ``engine_resource``."""
        actor: Any = ray.remote(EngineHost).options(
            resources={cluster.engine_resource: 1.0},
            num_cpus=cluster.engine_cpus,
            max_restarts=cluster.max_restarts,
            max_task_retries=0,  # a call cut off by a death is re-sent by RayEngine, with the served weights
            max_concurrency=1000,
        )
        handles = [actor.remote(str(model_dir), max_batch_size, cluster.engine_threads) for _ in range(cluster.engines)]
        from transformers import AutoConfig

        limit = getattr(AutoConfig.from_pretrained(str(model_dir)), "max_position_embeddings", None)
        engine = cls(handles, tokenizer, max_model_len=int(limit) if limit else None, retry_s=cluster.engine_retry_s)
        try:  # fail now, clearly, when no node offers the resource (Ray would wait for one for ever)
            found = ray.get([h.where.remote() for h in handles], timeout=cluster.start_timeout_s)
            engine._pids = [int(w["pid"]) for w in found]
        except GetTimeoutError:
            for h in handles:
                ray.kill(h)
            raise ConfigError(
                f"no engine actor started within {cluster.start_timeout_s:.0f} s: does a node of the cluster offer "
                f"the resource {cluster.engine_resource!r} ({_resources()})?"
            ) from None
        return engine

    # -- ServingEngine -------------------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    def _pick(self, session_id: str | None) -> int:
        if session_id is None or len(self._handles) == 1:
            return 0
        return zlib.crc32(session_id.encode()) % len(self._handles)

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        i = self._pick(session_id)
        deadline = time.monotonic() + self.retry_s
        self.stats["requests"] += 1
        while True:
            try:
                out = await self._handles[i].generate.remote(input_ids, sampling.model_dump(), session_id)
                break
            except _DOWN as exc:
                if time.monotonic() >= deadline:
                    raise EngineError(f"engine-{i} is down and did not come back within {self.retry_s:.0f} s") from exc
                await self._recover(i, exc, deadline)
                self.stats["resent"] += 1
        gen = Generation.model_validate(out)
        self.stats["tokens"] += len(gen.completion_ids)
        return gen

    async def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        """The whole generation as one piece (an actor call answers once)."""
        gen = await self.generate(input_ids, sampling, session_id=session_id)
        yield GenerationDelta(
            ids=gen.completion_ids,
            logprobs=gen.logprobs,
            finish_reason=gen.finish_reason,
            policy_version=gen.policy_version,
        )

    async def _recover(self, i: int, exc: BaseException, deadline: float) -> None:
        """Wait for engine ``i``'s restart and give it the weights being served (once, whoever asks first)."""
        async with self._locks[i]:
            handle = self._handles[i]
            t_down = self._since()
            while True:
                try:
                    where = await asyncio.wait_for(handle.where.remote(), max(1.0, deadline - time.monotonic()))
                    break
                except (*_DOWN, TimeoutError) as again:
                    if time.monotonic() >= deadline:
                        raise EngineError(f"engine-{i} did not come back within {self.retry_s:.0f} s") from again
                    await asyncio.sleep(0.5)
            if where["pid"] == self._pids[i]:
                return  # another call already brought it back
            served = self._weights[1] if self._weights is not None else 0
            if self._weights is not None and where["version"] != served:
                await handle.update_weights.remote(*self._weights)
            self.events.append(
                {
                    "part": f"engine-{i}",
                    "event": "restarted",
                    "down_at_s": t_down,
                    "back_at_s": self._since(),
                    "old_pid": self._pids[i],
                    **where,
                    "given_version": served,
                    "error": str(exc).splitlines()[0][:300],
                }
            )
            self._pids[i] = int(where["pid"])
            logger.warning("engine-%d was restarted by Ray (pid %s): serving version %d again", i, where["pid"], served)

    def _since(self) -> float:
        return round(time.monotonic() - self._t0, 2)

    async def update_weights(self, source: Any, version: int) -> None:
        """Send ``source`` (a state dict) to every engine once, through Ray's object store."""
        ref = ray.put(source)
        self._weights = (ref, version)
        results = await asyncio.gather(
            *(h.update_weights.remote(ref, version) for h in self._handles), return_exceptions=True
        )
        for i, result in enumerate(results):
            if isinstance(result, _DOWN):  # it gets these weights when it is back (_recover)
                logger.warning("engine-%d is down during the weight update to version %d", i, version)
            elif isinstance(result, BaseException):
                raise EngineError(f"engine-{i}: weight update to version {version} failed: {result}") from result
        self._version = version

    async def where(self) -> list[dict[str, Any]]:
        """Where each engine runs now: ``{"part", "node_id", "pid"}``."""
        found = await asyncio.gather(*(h.where.remote() for h in self._handles))
        return [{"part": f"engine-{i}", **w} for i, w in enumerate(found)]

    async def close(self) -> None:
        for h in self._handles:
            ray.kill(h, no_restart=True)
        self._handles = []


# -- the worker actors ----------------------------------------------------------------------------------------------
class WorkerHost:
    """A ``WorkerPool`` of agent workers in an actor, claiming train attempts from the daemon over HTTP."""

    def __init__(self, agent: str, server_url: str, admin_key: str, concurrency: int, lease_s: float, name: str):
        self.agent, self.server_url, self.admin_key = agent, server_url, admin_key
        self.concurrency, self.lease_s, self.name = concurrency, lease_s, name
        self.stopping = False
        self.pool: Any = None

    async def where(self) -> dict[str, Any]:
        return _where()

    async def run(self) -> dict[str, Any]:
        """Run the pool until ``stop``; answers how many attempts it ran."""
        from lightning_sdk.agent import WorkerPool, load_agent
        from lightning_sdk.store.http_client import HTTPStore

        store = HTTPStore(f"{self.server_url}/lightning/v1/store", self.admin_key)
        try:
            self.pool = WorkerPool(
                load_agent(self.agent),
                store,
                self.server_url,
                n_workers=self.concurrency,
                worker_id=f"{self.name}-{os.getpid()}",
                lease_s=self.lease_s,
                split="train",
                poll_s=0.2,
            )
            try:
                await self.pool.run_until(lambda: self.stopping)
            finally:
                await self.pool.close()
            return {"attempts": len(self.pool.results)}
        finally:
            await store.close()

    async def stop(self) -> None:
        self.stopping = True
        if self.pool is not None:
            self.pool.stop(release=True)


class ClusterRun:
    """The worker actors of a daemon on a cluster (``start``, ``placements``, ``stop``)."""

    def __init__(self, cluster: ClusterConfig, handles: list[Any], runs: list[Any]) -> None:
        self.cluster = cluster
        self._handles = handles
        self._runs = runs

    @classmethod
    def start(cls, cluster: ClusterConfig, agent: str, server_url: str, admin_key: str) -> ClusterRun:
        actor: Any = ray.remote(WorkerHost).options(
            num_cpus=cluster.worker_cpus,
            max_restarts=cluster.max_restarts,
            max_task_retries=cluster.max_restarts,  # a restarted worker runs its pool again
            max_concurrency=4,  # run() and stop() at once
        )
        handles = [
            actor.remote(agent, server_url, admin_key, cluster.worker_concurrency, cluster.lease_s, f"ray-worker-{i}")
            for i in range(cluster.workers)
        ]
        return cls(cluster, handles, [h.run.remote() for h in handles])

    async def placements(self) -> list[dict[str, Any]]:
        found = await asyncio.gather(*(h.where.remote() for h in self._handles))
        return [{"part": f"worker-{i}", **w} for i, w in enumerate(found)]

    async def stop(self, timeout_s: float = 60.0) -> list[dict[str, Any] | str]:
        """Stop claiming, release what is running, and answer each actor's result (or why it has none)."""
        await asyncio.gather(*(h.stop.remote() for h in self._handles), return_exceptions=True)
        done: list[dict[str, Any] | str] = []
        for ref in self._runs:
            try:
                done.append(await asyncio.wait_for(ref, timeout_s))
            except (*_DOWN, TimeoutError, ray.exceptions.RayTaskError) as exc:
                done.append(f"{type(exc).__name__}: {exc}")
        for h in self._handles:
            ray.kill(h, no_restart=True)
        return done
