"""The one job runner under ``lightning-sdk train`` and ``lightning-sdk daemon``: set-up and teardown in one place.

    open_job(config, run_dir)  ─▶  run dir (checked writable) + the proxy's socket (bound first: a bad port fails
                                   at once) + torch threads/seed + tasks and demonstrations + the policy directory
                                   + engine and learner (``app/parts.py``) + store + the training loop
                                   (``app/loop.py``, resumed from the checkpoint) + the proxy (``app/server.py``,
                                   with the per-split sampling) + ``daemon.json`` (URL, admin key) + metrics log
    ... the job (``app/train.py`` or ``app/daemon.py``) ...
    teardown, always, in this order: metrics, the engine's pending weights, proxy (last to stop serving: workers
    are done by now), engine and learner, store, socket

Both jobs warm-start the same way (``Job.warm_start``): the validation tasks are ``data.validation`` when given,
else the last ``warm_start.validation_tasks`` train tasks (the two runners used to differ here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.agent._base import Agent
from lightning_sdk.app.loop import RunStopped, TrainingLoop, evaluate, never
from lightning_sdk.app.parts import Parts, build_parts, check_warm_start
from lightning_sdk.app.server import ProxyServer, bind_socket
from lightning_sdk.app.view import MetricsLog, ProgressView
from lightning_sdk.errors import ConfigError
from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy
from lightning_sdk.policy.smollm2 import SMOLLM2_NAMES, prepare_smollm2
from lightning_sdk.policy.tokenizer import build_tokenizer
from lightning_sdk.policy.warm_start import WarmStartConfig, warm_start
from lightning_sdk.proxy.sampling import SplitSampling
from lightning_sdk.records import AdvantageConfig, MergeOptions, RecordsConfig
from lightning_sdk.store import open_store
from lightning_sdk.telemetry import open_telemetry
from lightning_sdk.trainer.checkpoint import load_checkpoint
from lightning_sdk.trainer.config import TrainConfig
from lightning_sdk.trainer.data import load_rows
from lightning_sdk.trainer.sampling import TaskSampler

logger = logging.getLogger(__name__)

__all__ = [
    "Job",
    "build_loop",
    "open_job",
    "prepare_policy",
    "prepare_run_dir",
    "split_sampling",
    "validation_tasks",
]


def prepare_run_dir(path: str | Path) -> Path:
    """Create the run directory and check it is writable, up front: a clear ``ConfigError``, not a traceback after
    minutes of set-up, when ``--output`` is an existing file or an unwritable place."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--output {out}: cannot write there ({exc.strerror or exc})") from None
    return out


def prepare_policy(config: TrainConfig, run_dir: Path, demonstrations: list[dict[str, Any]]) -> Path:
    """The initial policy directory: the configured model dir, or the tiny default built in ``run_dir``."""
    if config.policy.model in SMOLLM2_NAMES:
        return prepare_smollm2()
    if config.policy.model != "tiny":
        path = Path(config.resolve(config.policy.model))
        if not (path / "config.json").exists():
            raise ConfigError(f"policy.model {path} is not a Hugging Face model directory")
        return path
    out = run_dir / "policy_init"
    if (out / "config.json").exists():
        return out
    if not demonstrations:
        raise ConfigError("the tiny default policy needs data.demonstrations to train its tokenizer and warm start")
    bootstrap = build_tokenizer(["x"], vocab_size=300)  # any tokenizer with the chat template renders the corpus
    corpus = [
        str(bootstrap.apply_chat_template(d["messages"], tools=d.get("tools"), tokenize=False)) for d in demonstrations
    ]
    p = config.policy
    shape = TinyPolicyConfig(p.vocab_size, p.hidden_size, p.num_layers, p.num_heads, p.intermediate_size, seed=p.seed)
    return build_policy(out, corpus, shape)


def records_config(config: TrainConfig, engine: object) -> RecordsConfig:
    """How the trainer builds records: the ``[rl]`` estimator, and rows never longer than the engine's context
    (``max_model_len`` where the engine tells it): a longer segment is cut and flagged ``truncated``, which the
    fidelity report counts, so no row is trained past the context."""
    rl = config.rl
    limit = getattr(engine, "max_model_len", None)
    return RecordsConfig(
        merge=MergeOptions(max_length=limit if isinstance(limit, int) and limit > 0 else None),
        advantage=AdvantageConfig(
            estimator=rl.estimator,
            drop_zero_variance=rl.drop_zero_variance,
            drop_single_groups=not rl.train_single_groups,
        ),
    )


def build_loop(
    config: TrainConfig,
    run_dir: Path,
    model_dir: Path,
    train_tasks: list[dict[str, Any]],
    url: str = "",
    max_attempts: int = 1,
) -> tuple[TrainingLoop, Parts]:
    """The engine and learner of ``config.backend`` / ``config.engine`` (``app/parts.py``) for ``model_dir``, the
    store (``[store] url``, default SQLite in the run dir) and the training loop over them, its agents calling the
    proxy at ``url``. Close the parts, then the store, when done."""
    rl = config.rl
    parts = build_parts(config, run_dir, model_dir)
    store = open_store(config.store_spec(run_dir))
    sampler = (
        TaskSampler(len(train_tasks), replay_share=rl.replay_share, max_replays=rl.max_replays, seed=rl.seed)
        if rl.replay_share > 0 and train_tasks
        else None
    )
    loop = TrainingLoop(
        store,
        parts.engine,
        parts.learner,
        run_dir,
        url=url,
        weights=parts.weights,
        train_tasks=train_tasks,
        tasks_per_step=rl.tasks_per_step,
        samples_per_task=rl.samples_per_task,
        max_staleness=rl.max_staleness,
        records_config=records_config(config, parts.engine),
        max_attempts=max_attempts,
        sampler=sampler,
        screen_samples=rl.screen_samples,
    )
    return loop, parts


def split_sampling(config: TrainConfig) -> SplitSampling:
    """The proxy's per-split sampling: train rollouts at ``[rl]`` settings (the learner's temperature), the held-out
    evaluations (``eval-before``, ``eval-check-N``, ``eval-after``) and the warm start's (``warmup-N``) at ``[eval]``
    settings; other splits are sampled as their requests ask."""
    rl, ev = config.rl, config.eval
    evaluation = {"temperature": ev.temperature, "max_tokens": ev.max_tokens}
    return SplitSampling(
        {
            "train": {"temperature": rl.temperature, "top_p": 1.0, "max_tokens": rl.max_tokens},
            "eval*": evaluation,
            "warmup-*": evaluation,
        }
    )


def validation_tasks(config: TrainConfig, train_tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tasks that decide when the warm start stops: ``data.validation``, else the last train tasks."""
    if config.data.validation:
        return load_rows(config, config.data.validation, "data.validation")
    return train_tasks[-config.warm_start.validation_tasks :]


@dataclass
class Job:
    """What a running job has: its config and run directory, the training loop (store, engine, learner), the parts
    it was built from, the proxy, the tasks, the view and the metrics log."""

    config: TrainConfig
    out: Path
    loop: TrainingLoop
    parts: Parts
    server: ProxyServer
    admin_key: str
    view: ProgressView
    metrics: MetricsLog
    train_tasks: list[dict[str, Any]]
    demos: list[dict[str, Any]]
    resumed: bool
    t_start: float
    timeline: dict[str, float] = field(default_factory=dict)  # seconds since the start when each phase ended
    model_dir: Path | None = None  # the policy directory the parts were built from

    def mark(self, name: str) -> None:
        self.timeline[name] = round(time.perf_counter() - self.t_start, 2)

    @property
    def needs_warm_start(self) -> bool:
        return not self.resumed and self.config.warm_start.enabled and bool(self.demos)

    async def warm_start(self, agent: Agent, stop: Callable[[], bool] = never) -> dict[str, Any] | None:
        """Supervised steps on the learner's model (``policy/warm_start.py``), when configured and not done before
        (a resumed run skips it; None then). Every ``eval_every`` steps the engine gets the weights and the agent is
        evaluated on the validation tasks through the proxy (split ``warmup-N``: sampled as ``[eval]`` says).
        ``stop()`` ends it at the next supervised step or evaluation with ``RunStopped`` (nothing is checkpointed:
        a re-run warm-starts again)."""
        if not self.needs_warm_start or stop():
            return None
        self.view.set_phase("warm start")
        model = self.parts.model
        assert model is not None  # check_warm_start: only the embedded backend warm-starts
        loop, ev, note = self.loop, self.config.eval, self.view.note
        val = validation_tasks(self.config, self.train_tasks)
        event_loop = asyncio.get_running_loop()
        rounds = 0

        def evaluate_model(model: torch.nn.Module) -> float:  # runs in the warm start's thread
            nonlocal rounds
            rounds += 1
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}

            async def go() -> float:
                await loop.engine.update_weights(state, loop.version)
                res = await evaluate(loop, agent, val, f"warmup-{rounds}", ev.workers, stop)
                return float(res["success_rate"])

            success = asyncio.run_coroutine_threadsafe(go(), event_loop).result()
            note(f"warm start eval {rounds}: {100 * success:.1f}% on {len(val)} validation tasks")
            return success

        ws = self.config.warm_start
        cfg = WarmStartConfig.model_validate(ws.model_dump(include=set(WarmStartConfig.model_fields)))
        result = await asyncio.to_thread(
            warm_start, model, loop.engine.tokenizer, self.demos, evaluate_model, cfg, stop
        )
        if result.stopped:
            raise RunStopped(loop.step)
        reset = getattr(loop.learner, "reset_optimizer", None)
        if reset is not None:  # the supervised steps moved the weights the optimizer's moments were for
            reset()
        await loop.engine.update_weights(await asyncio.to_thread(loop.weights), loop.version)
        note(f"warm start: {result.steps} steps, {result.wall_s:.0f} s")
        return {"steps": result.steps, "success": result.success, "history": result.history, "wall_s": result.wall_s}


@contextlib.asynccontextmanager
async def open_job(
    config: TrainConfig,
    run_dir: str | Path,
    *,
    view: ProgressView | None = None,
    admin_key: str | None = None,
    on_ready: Callable[[str, str], None] | None = None,
    require_train: bool = True,
    max_attempts: int = 1,
) -> AsyncIterator[Job]:
    """Set the job up (see the module docstring), yield it, and tear it down whatever happens."""
    t_start = time.perf_counter()
    out = prepare_run_dir(run_dir)
    server = ProxyServer(bind_socket(config.host, config.port), config.host)
    try:
        (out / "config.json").write_text(config.model_dump_json(indent=2))
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.rl.seed)
        data = config.data
        train_tasks = load_rows(config, data.train, "data.train") if data.train or require_train else []
        demos = load_rows(config, data.demonstrations, "data.demonstrations") if data.demonstrations else []
        view = view or ProgressView(config.name, config.rl.steps)
        resumed = load_checkpoint(out) is not None
        check_warm_start(config, not resumed and config.warm_start.enabled and bool(demos))
        kind = config.engine.kind
        launching = kind in ("vllm", "sglang") and not config.engine.urls
        view.set_phase(f"building the policy and launching the {kind} server" if launching else "building the policy")
        model_dir = prepare_policy(config, out, demos)
        loop, parts = build_loop(config, out, model_dir, train_tasks, server.url, max_attempts=max_attempts)
        key = admin_key or secrets.token_urlsafe(24)
        try:
            await loop.resume()
            if loop.sampler is not None:  # resumed: new groups continue after the last enqueued one
                loop.sampler.start_at(loop.next_task)
            ops = OpsMetrics()  # GET /metrics: the proxy's calls and recorder, the loop's steps, the engine's version
            ops.served_version_from(lambda: parts.engine.policy_version)
            loop.ops = ops
            loop.telemetry = telemetry = open_telemetry(config.telemetry)  # None unless [telemetry] / OTEL_* set
            await server.start(
                loop.store,
                parts.engine,
                parts.renderer or parts.engine.tokenizer,
                admin_key=key,
                sampling=split_sampling(config),
                metrics=ops,
                run_dir=out,
                telemetry=telemetry,
            )
            logger.info("serving on %s (policy version %d, step %d)", server.url, loop.version, loop.step)
            (out / "daemon.json").write_text(json.dumps({"url": server.url, "admin_key": key}))
            view.note(f"proxy on {server.url} (admin key in {out / 'daemon.json'})")
            if on_ready is not None:
                on_ready(server.url, key)
            metrics = MetricsLog(out, backends=config.metrics, name=config.name)
            job = Job(config, out, loop, parts, server, key, view, metrics, train_tasks, demos, resumed, t_start)
            job.model_dir = model_dir
            job.mark("startup_s")
            try:
                yield job
            finally:
                metrics.close()
        finally:  # the workers are done (or released their attempts) by now: the proxy stops first of the rest
            await loop.flush_weights()
            await server.stop()
            if loop.telemetry is not None:  # export what is queued (the SDK's thread; bounded by its timeout)
                await asyncio.to_thread(loop.telemetry.shutdown)
            await parts.close()
            await loop.store.close()
    finally:
        server.close_socket()
