"""The parts of a job as Ray actors: engines where the GPUs are, agent workers on CPU nodes, restarted when they die.

    connect(address)                 join the cluster (``ray.init``), this checkout's import path in the actors' env
    RayEngine.launch(config, ...)    ``engines`` engine actors, each needing ``{engine_resource: 1}``; the driver's
                                     ``ServingEngine``: a call goes to its attempt's engine (prefix cache)
    RayLearner.launch(config, ...)   the embedded learner as an actor (``learner_resource``, ``learner_cpus``): the
                                     training loop's ``LearnerLike``; its weights go from the learner's node to the
                                     engines' through Ray's object store (the driver only passes the reference)
    ClusterRun.start(...)            ``proxies`` proxy actors (token mode over the engine actors, recording into
                                     the daemon's store over HTTP), then ``workers`` worker actors, each a
                                     ``WorkerPool`` of ``worker_concurrency`` agent workers claiming train attempts
                                     from the daemon's store and calling a proxy actor (or the daemon's proxy)

An engine that dies (its process or its node) is restarted by Ray (``max_restarts``) on a node that has the
resource. The calls it was serving fail inside ``RayEngine.generate``, which waits for the restarted actor, gives it
the weights of the version being served and sends the call again (up to ``engine_retry_s``; after that the call
answers 502 and its attempt fails: it is never trained). Nothing was recorded for the failed try: a call is
recorded once, with the generation that answered it. A worker actor that dies is restarted and runs its pool again
(``max_task_retries``); the attempts it was running lose their lease and are retried (``max_attempts``); a cut-off
attempt never reads as succeeded, so nothing half-done is trained. A learner actor that dies is restarted too: the
step it was running is run again, from the state of the last step (each step's state comes back to the driver with
it, for the checkpoint), on the same records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from transformers import PreTrainedTokenizerBase

from lightning_sdk.engines.base import Engine, Generation, GenerationDelta, Sampling
from lightning_sdk.engines.serving import ServingEngine
from lightning_sdk.errors import ConfigError, EngineError, TrainerError
from lightning_sdk.records.record import Record
from lightning_sdk.trainer.config import ClusterConfig
from lightning_sdk.trainer.learner import LearnerConfig
from lightning_sdk.trainer.parts import LearnerLike, Parts, learner_elsewhere_parts

__all__ = ["ClusterRun", "RayEngine", "RayLearner", "connect", "ray_learner_parts"]

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


class RayEngine(Engine):
    """The driver's ``ServingEngine`` over the engine actors (see the module docstring). ``events`` lists what
    happened to them: ``{"part", "event": "down"|"back", "t", "error"?}`` (seconds since launch)."""

    def __init__(
        self,
        handles: list[Any],
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_model_len: int | None = None,
        retry_s: float = 120.0,
        watch: bool = True,
    ) -> None:
        if not handles:
            raise ConfigError("cluster.engines must be at least 1")
        self._handles = handles
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self.retry_s = retry_s
        self.stats: dict[str, int] = {"tokens": 0, "requests": 0, "resent": 0}
        self._version = 0
        self._weights: tuple[Any, int] | None = None  # (object ref of the served state dict, its version)
        self._locks = [asyncio.Lock() for _ in handles]
        self._t0 = time.monotonic()
        self._pids: list[int | None] = [None] * len(handles)  # each engine's process, as last seen
        self._events: list[dict[str, Any]] = []
        self.watch_s = 1.0 if watch else 0.0  # 0: no watch (a proxy actor's view: the driver gives the weights)
        self._watch: asyncio.Task[None] | None = None

    @property
    def events(self) -> list[dict[str, Any]]:
        """Each engine actor's restarts (``part``, ``event``, when, its new process)."""
        return self._events

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

    @property
    def handles(self) -> list[Any]:
        """The engine actors (a proxy actor's ``RayEngine`` calls the same ones)."""
        return list(self._handles)

    # -- ServingEngine -------------------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    def _watching(self) -> None:
        """Start the watch (on the first call: it needs the running loop)."""
        if self.watch_s > 0 and (self._watch is None or self._watch.done()):
            self._watch = asyncio.get_running_loop().create_task(self._watch_loop(), name="ray-engine-watch")

    async def _watch_loop(self) -> None:
        """Every ``watch_s``: an engine Ray restarted while no call was failing gets the served weights too (else it
        would serve its initial weights until the next publication)."""
        while self._handles:
            await asyncio.sleep(self.watch_s)
            for i, handle in enumerate(list(self._handles)):
                try:
                    where = await asyncio.wait_for(handle.where.remote(), 5.0)
                except (*_DOWN, TimeoutError):
                    continue  # down or restarting: looked at again next time
                if where["pid"] != self._pids[i]:
                    with contextlib.suppress(EngineError, *_DOWN):
                        await self._recover(i, "restart seen by the watch", time.monotonic() + self.retry_s)

    def _pick(self, session_id: str | None) -> int:
        if session_id is None or len(self._handles) == 1:
            return 0
        return zlib.crc32(session_id.encode()) % len(self._handles)

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        self._watching()
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

    async def _recover(self, i: int, exc: BaseException | str, deadline: float) -> None:
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
            self._events.append(
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
        self._watching()
        ref = source if isinstance(source, ray.ObjectRef) else ray.put(source)  # a RayLearner's: already there
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

    async def check(self) -> None:
        """Wait (up to ``retry_s``) until every engine answers, and give one Ray restarted the served weights (its
        restart then is in ``events``): the daemon runs it before writing its summary."""
        for i in range(len(self._handles)):
            with contextlib.suppress(EngineError):
                await self._recover(i, "restart seen at the end of the run", time.monotonic() + self.retry_s)

    async def where(self) -> list[dict[str, Any]]:
        """Where each engine runs now: ``{"part", "node_id", "pid"}``."""
        found = await asyncio.gather(*(h.where.remote() for h in self._handles))
        return [{"part": f"engine-{i}", **w} for i, w in enumerate(found)]

    async def close(self) -> None:
        handles, self._handles = self._handles, []
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for h in handles:
            ray.kill(h, no_restart=True)


# -- the learner actor ----------------------------------------------------------------------------------------------
class LearnerHost:
    """The embedded ``Learner`` in an actor (created by ``RayLearner.launch``; a sync actor: one method at a time).

    ``token`` names the state the driver gave it (``adopt``, ``load_*``): a restarted actor has none, so a call that
    carries the driver's token finds out it runs on a fresh actor (even when no call saw the death) and answers
    ``None`` instead of training or publishing the initial weights."""

    def __init__(self, model_dir: str, config: dict[str, Any], pad_id: int) -> None:
        from lightning_sdk.policy.model import load_policy
        from lightning_sdk.trainer.learner import Learner

        model, _ = load_policy(model_dir)
        self.base = model
        self.learner = Learner(model, LearnerConfig.model_validate(config), pad_id=pad_id)
        self.token: str | None = None

    def where(self) -> dict[str, Any]:
        return {**_where(), "steps": self.learner.steps}

    def adopt(self, token: str) -> None:
        self.token = token

    def step(self, records: list[Record], token: str) -> tuple[dict[str, float], dict[str, Any]] | None:
        """One step; answers its metrics and the state after it (the driver's checkpoint, a restart's start)."""
        if token != self.token:
            return None
        metrics = self.learner.step(records)
        return metrics, self.learner.state_dict()

    @ray.method(num_returns=2)
    def weights(self, token: str) -> tuple[bool, dict[str, Any] | None]:
        if token != self.token:
            return False, None
        return True, self.learner.weights()

    def state_dict(self, token: str) -> dict[str, Any] | None:
        return self.learner.state_dict() if token == self.token else None

    def load_state_dict(self, state: dict[str, Any], token: str) -> None:
        self.learner.load_state_dict(state)
        self.token = token

    def load_weights(self, weights: dict[str, Any], token: str) -> None:
        """The model's weights from the driver (after a warm start there), with a fresh optimizer."""
        self.base.load_state_dict(weights)
        self.learner.reset_optimizer()
        self.token = token


class RayLearner(LearnerLike):
    """The training loop's learner (``LearnerLike``) over a ``LearnerHost`` actor. A call that finds the actor dead,
    or restarted (its state is not the driver's: ``LearnerHost``'s token), waits (up to ``retry_s``) for Ray's
    restart, gives the new actor the state of the last step (or the driver's weights before the first) and is made
    again; ``events`` lists the restarts."""

    def __init__(self, handle: Any, model: Any, *, retry_s: float) -> None:
        self._handle = handle
        self._model = model  # the driver's copy of the policy: what the warm start trains, what a save writes
        self.retry_s = retry_s
        self.steps = 0
        self._state: dict[str, Any] | None = None  # after the last step (or as loaded): what a restart resumes
        self._token = uuid.uuid4().hex  # the state the actor has is the driver's (see LearnerHost)
        self._pid: int | None = None
        self._t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []

    @classmethod
    def launch(
        cls, cluster: ClusterConfig, model_dir: Path, config: LearnerConfig, model: Any, *, pad_id: int
    ) -> RayLearner:
        """The learner actor on a node with ``learner_resource`` (any node when None), ``learner_cpus`` CPUs."""
        actor: Any = ray.remote(LearnerHost).options(
            num_cpus=cluster.learner_cpus,
            resources={cluster.learner_resource: 1.0} if cluster.learner_resource else None,
            max_restarts=cluster.max_restarts,
            max_task_retries=0,  # a step cut off by a death is run again by RayLearner, from the last state
        )
        learner = cls(
            actor.remote(str(model_dir), config.model_dump(mode="json"), pad_id), model, retry_s=cluster.engine_retry_s
        )
        try:
            learner._pid = int(ray.get(learner._handle.where.remote(), timeout=cluster.start_timeout_s)["pid"])
        except GetTimeoutError:
            ray.kill(learner._handle)
            raise ConfigError(
                f"the learner actor did not start within {cluster.start_timeout_s:.0f} s: does a node of the "
                f"cluster offer {cluster.learner_cpus} CPUs and the resource {cluster.learner_resource!r} "
                f"({_resources()})?"
            ) from None
        ray.get(learner._handle.adopt.remote(learner._token))
        return learner

    def _call(self, what: str, method: str, *args: Any) -> Any:
        """``method(*args, token)`` on the actor until it answers on the driver's state (None: a restarted actor)."""
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                out = ray.get(getattr(self._handle, method).remote(*args, self._token))
                if out is not None:
                    return out
                self._recover(what, "a restarted actor (its state is not the driver's)", deadline)
            except _DOWN as exc:
                self._recover(what, exc, deadline)

    def _recover(self, what: str, exc: BaseException | str, deadline: float) -> None:
        """Wait for the restarted actor, then give it the last state."""
        t_down = round(time.monotonic() - self._t0, 2)
        while True:
            try:
                where = ray.get(self._handle.where.remote(), timeout=max(1.0, deadline - time.monotonic()))
                break
            except (*_DOWN, GetTimeoutError) as again:
                if time.monotonic() >= deadline:
                    raise TrainerError(
                        f"the learner actor died ({what}) and did not come back within {self.retry_s:.0f} s"
                    ) from again
                time.sleep(0.5)
        if self._state is not None:
            ray.get(self._handle.load_state_dict.remote(self._state, self._token))
        else:
            ray.get(self._handle.load_weights.remote(self._model.state_dict(), self._token))
        self.events.append(
            {"part": "learner", "event": "restarted", "during": what, "down_at_s": t_down,
             "back_at_s": round(time.monotonic() - self._t0, 2), "old_pid": self._pid, **where,
             "error": str(exc).splitlines()[0][:300]}
        )  # fmt: skip
        self._pid = int(where["pid"])
        logger.warning("the learner actor was restarted by Ray (pid %s) during %s: resumed at step %d", self._pid,
                       what, self.steps)  # fmt: skip

    # -- LearnerLike ---------------------------------------------------------------------------------------------------
    def step(self, records: Sequence[Record]) -> dict[str, float]:
        metrics, state = self._call(f"step {self.steps + 1}", "step", list(records))
        self._state = state
        self.steps += 1
        return dict(metrics)

    def weights(self) -> Any:
        """The learner's weights as an object reference (``RayEngine.update_weights`` hands it to the engines as it
        is; ``ray.get`` it for the tensors): only the small ``ok`` answer comes to the driver."""
        deadline = time.monotonic() + self.retry_s
        while True:
            ok, ref = self._handle.weights.remote(self._token)
            try:
                if ray.get(ok):
                    return ref
                self._recover("weights", "a restarted actor (its state is not the driver's)", deadline)
            except _DOWN as exc:
                self._recover("weights", exc, deadline)

    def state_dict(self) -> dict[str, Any]:
        if self._state is None:
            self._state = self._call("state_dict", "state_dict")
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state
        self.steps = int(state["steps"])
        self._load("load_state_dict", self._handle.load_state_dict, state)

    def reset_optimizer(self) -> None:
        """The driver's weights (a warm start trained them) to the actor, with a fresh optimizer."""
        self._state = None
        self.steps = 0
        self._load("load_weights", self._handle.load_weights, self._model.state_dict())

    def _load(self, what: str, method: Any, value: Any) -> None:
        """Give the actor ``value`` with the token (a dead one gets the same from ``_recover``: ``_state`` is set)."""
        try:
            ray.get(method.remote(value, self._token))
        except _DOWN as exc:
            self._recover(what, exc, time.monotonic() + self.retry_s)

    def save(self, out: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        """The trained model into ``out`` (the learner's weights, written here with the driver's model config)."""
        self._model.save_pretrained(str(out), state_dict=ray.get(self.weights()))
        tokenizer.save_pretrained(str(out))

    def where(self) -> dict[str, Any]:
        try:
            return {"part": "learner", **ray.get(self._handle.where.remote())}
        except _DOWN as exc:
            self._recover("where", exc, time.monotonic() + self.retry_s)
            return {"part": "learner", **ray.get(self._handle.where.remote())}

    def close(self) -> None:
        ray.kill(self._handle, no_restart=True)


# -- the proxy actors -----------------------------------------------------------------------------------------------
class ProxyHost:
    """A proxy in an actor: token mode over the engine actors, recording into ``store`` (``open_store``'s spec: the
    daemon's store over HTTP, or the run's PostgreSQL store itself, shared with the daemon's proxy: a call is then
    committed before it is answered, numbered by the store). It serves from its first ``url()`` call (again after a
    restart: same host and port)."""

    def __init__(
        self, engines: list[Any], model_dir: str, store: str, admin_key: str, sampling: Any, host: str, port: int
    ) -> None:
        self.engines, self.model_dir, self.store_url, self.admin_key = engines, model_dir, store, admin_key
        self.sampling, self.host, self.port = sampling, host, port
        self.server: Any = None

    async def where(self) -> dict[str, Any]:
        return {**_where(), "url": self.server.url if self.server is not None else None}

    async def url(self) -> str:
        if self.server is None:
            from transformers import AutoTokenizer

            from lightning_sdk.app.server import ProxyServer, bind_socket
            from lightning_sdk.store import open_store

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            store = open_store(self.store_url, admin_key=self.admin_key)
            engine = RayEngine(self.engines, tokenizer, watch=False)
            server = ProxyServer(bind_socket(self.host, self.port), self.host)
            await server.start(
                store, engine, tokenizer, admin_key=self.admin_key, sampling=self.sampling, publish=False
            )
            self.server = server
        return str(self.server.url)


# -- the worker actors ----------------------------------------------------------------------------------------------
class WorkerHost:
    """A ``WorkerPool`` of agent workers in an actor, claiming train attempts from the daemon's store over HTTP and
    calling ``server_url`` (the daemon's proxy, or a proxy actor); the agents' ``LLM`` fails over to
    ``fallback_urls`` (the other proxies: a call cut off by its proxy's death is sent again to the next one)."""

    def __init__(
        self,
        agent: str,
        store_url: str,
        server_url: str,
        admin_key: str,
        concurrency: int,
        lease_s: float,
        name: str,
        fallback_urls: tuple[str, ...] = (),
    ) -> None:
        self.agent, self.store_url, self.server_url, self.admin_key = agent, store_url, server_url, admin_key
        self.concurrency, self.lease_s, self.name = concurrency, lease_s, name
        self.fallback_urls = fallback_urls
        self.stopping = False
        self.pool: Any = None

    async def where(self) -> dict[str, Any]:
        return _where()

    async def run(self) -> dict[str, Any]:
        """Run the pool until ``stop``; answers how many attempts it ran."""
        from lightning_sdk.agent import WorkerPool, load_agent
        from lightning_sdk.store.http_client import HTTPStore

        store = HTTPStore(self.store_url, self.admin_key)
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
                fallback_urls=self.fallback_urls,
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
    """The proxy and worker actors of a daemon on a cluster (``start``, ``placements``, ``stop``)."""

    def __init__(self, cluster: ClusterConfig, proxies: list[Any], handles: list[Any], runs: list[Any]) -> None:
        self.cluster = cluster
        self._proxies = proxies
        self._handles = handles
        self._runs = runs
        self._watch: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        cluster: ClusterConfig,
        agent: str,
        server_url: str,
        admin_key: str,
        *,
        engine: Any = None,
        model_dir: Path | None = None,
        sampling: Any = None,
        host: str = "127.0.0.1",
        shared_store: str | None = None,
    ) -> ClusterRun:
        """``cluster.proxies`` proxy actors over ``engine``'s actors (a ``RayEngine``), then ``cluster.workers``
        worker actors, each calling a proxy actor in turn (the daemon's proxy at ``server_url`` when none) and
        failing over to the others and the daemon's proxy. ``shared_store``: the run's PostgreSQL URL, which the
        proxy actors then open themselves (else they record into the daemon's store over HTTP)."""
        store_url = f"{server_url}/lightning/v1/store"
        proxies: list[Any] = []
        urls = [server_url]
        if cluster.proxies:
            if not isinstance(engine, RayEngine) or model_dir is None:
                raise ConfigError(
                    "cluster.proxies needs the engines on the cluster (cluster.ray, engine.kind embedded)"
                )
            from lightning_sdk.app.server import free_port

            proxy: Any = ray.remote(ProxyHost).options(
                num_cpus=cluster.proxy_cpus,
                resources={cluster.proxy_resource: 1.0} if cluster.proxy_resource else None,
                max_restarts=cluster.max_restarts,
                max_task_retries=cluster.max_restarts,
            )
            spec = shared_store or store_url
            proxies = [
                proxy.remote(engine.handles, str(model_dir), spec, admin_key, sampling, host, free_port(host))
                for _ in range(cluster.proxies)
            ]
            urls = list(await asyncio.gather(*(p.url.remote() for p in proxies)))
        actor: Any = ray.remote(WorkerHost).options(
            num_cpus=cluster.worker_cpus,
            max_restarts=cluster.max_restarts,
            max_task_retries=cluster.max_restarts,  # a restarted worker runs its pool again
            max_concurrency=4,  # run() and stop() at once
        )
        everyone = list(dict.fromkeys([*urls, server_url]))  # the proxy actors, then the daemon's own
        handles = [
            actor.remote(
                agent,
                store_url,
                urls[i % len(urls)],
                admin_key,
                cluster.worker_concurrency,
                cluster.lease_s,
                f"ray-worker-{i}",
                tuple(u for u in everyone if u != urls[i % len(urls)]),
            )
            for i in range(cluster.workers)
        ]
        run = cls(cluster, proxies, handles, [h.run.remote() for h in handles])
        if proxies:
            run._watch = asyncio.create_task(run._keep_serving())
        return run

    async def _keep_serving(self, every_s: float = 1.0) -> None:
        """A proxy actor Ray restarted serves again at once (on its host and port): ``url()`` starts it."""
        while True:
            await asyncio.sleep(every_s)
            await asyncio.gather(*(p.url.remote() for p in self._proxies), return_exceptions=True)

    async def placements(self) -> list[dict[str, Any]]:
        proxies = await asyncio.gather(*(h.where.remote() for h in self._proxies))
        workers = await asyncio.gather(*(h.where.remote() for h in self._handles))
        return [
            *({"part": f"proxy-{i}", **w} for i, w in enumerate(proxies)),
            *({"part": f"worker-{i}", **w} for i, w in enumerate(workers)),
        ]

    async def stop(self, timeout_s: float = 60.0) -> list[dict[str, Any] | str]:
        """Stop claiming, release what is running, and answer each actor's result (or why it has none)."""
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(h.stop.remote() for h in self._handles), return_exceptions=True)
        done: list[dict[str, Any] | str] = []
        for ref in self._runs:
            try:
                done.append(await asyncio.wait_for(ref, timeout_s))
            except (*_DOWN, TimeoutError, ray.exceptions.RayTaskError) as exc:
                done.append(f"{type(exc).__name__}: {exc}")
        for h in [*self._handles, *self._proxies]:
            ray.kill(h, no_restart=True)
        return done


def ray_learner_parts(
    cluster: ClusterConfig,
    learner: LearnerConfig,
    model_dir: Path,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    served: ServingEngine,
) -> Parts:
    """The parts of a run whose embedded learner is a Ray actor (``[cluster] learner``: ``RayLearner``): its weights
    go to the engine actors by reference; the driver keeps its copy of the policy for the warm start (the actor gets
    its weights after it) and the save."""
    pad = tokenizer.pad_token_id
    actor = RayLearner.launch(cluster, model_dir, learner, model, pad_id=int(pad) if pad is not None else 0)
    return learner_elsewhere_parts(actor, served, model, tokenizer)
