"""The one job runner under ``lightning-sdk train`` and ``lightning-sdk daemon``: set-up and teardown in one place.

    open_job(config, run_dir)  ─▶  run dir (checked writable) + the proxy's socket (bound first: a bad port fails
                                   at once) + torch threads/seed + the task sets (``[data]``) + view and metrics
                                   log + the policy directory (``[policy]``) + engine and learner (``[engine]``,
                                   ``[learner]`` or ``[verl]``: ``app/parts.py``) + store + the training loop
                                   (``[rl]``: ``app/loop.py``, resumed from the checkpoint) + the proxy
                                   (``app/server.py``, with the per-split sampling of ``[rl]`` and ``[eval]``) +
                                   ``daemon.json`` (URL, admin key)
    ... the job (``app/train.py`` or ``app/daemon.py``) ...
    teardown, always, in this order: the engine's pending weights, proxy (last to stop serving: workers are done by
    now), engine and learner, store, metrics, socket

Each part is handed its own section of the config, settled when the config was loaded (paths absolute, the
learner's temperature the sampling one: ``trainer/config.py``); nothing here copies a field from one section into
another. Both jobs warm-start the same way (``app/warmup.py``).
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

import torch

from lightning_sdk.app.loop import TrainingLoop
from lightning_sdk.app.parts import Parts, build_parts
from lightning_sdk.app.server import ProxyServer
from lightning_sdk.app.view import MetricsLog, ProgressView
from lightning_sdk.errors import ConfigError
from lightning_sdk.listen import bind_socket, socket_url
from lightning_sdk.memory import guard_resident
from lightning_sdk.monitoring import OpsMetrics
from lightning_sdk.policy.prepare import prepare_policy
from lightning_sdk.proxy.sampling import SplitSampling
from lightning_sdk.store import open_store
from lightning_sdk.telemetry import open_telemetry
from lightning_sdk.trainer.checkpoint import load_checkpoint
from lightning_sdk.trainer.config import EvalConfig, RLConfig, TrainConfig
from lightning_sdk.trainer.data import Tasks, load_tasks

logger = logging.getLogger(__name__)

__all__ = ["Job", "open_job", "prepare_run_dir", "split_sampling"]


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


def split_sampling(rl: RLConfig, ev: EvalConfig) -> SplitSampling:
    """The proxy's per-split sampling: train rollouts at ``[rl]`` settings (the learner's temperature), the held-out
    evaluations (``eval-before``, ``eval-check-N``, ``eval-after``) and the warm start's (``warmup-N``) at ``[eval]``
    settings; other splits are sampled as their requests ask."""
    evaluation = {"temperature": ev.temperature, "max_tokens": ev.max_tokens}
    return SplitSampling(
        {
            "train": {"temperature": rl.temperature, "top_p": 1.0, "max_tokens": rl.max_tokens},
            "eval*": evaluation,
            "warmup-*": evaluation,
        }
    )


@dataclass
class Job:
    """What a running job has: its config and run directory, the training loop (store, engine, learner), the parts
    it was built from, the proxy and its per-split sampling, the task sets, the view and the metrics log."""

    config: TrainConfig
    out: Path
    loop: TrainingLoop
    parts: Parts
    server: ProxyServer
    sampling: SplitSampling
    admin_key: str
    view: ProgressView
    metrics: MetricsLog
    tasks: Tasks
    resumed: bool
    t_start: float
    timeline: dict[str, float] = field(default_factory=dict)  # seconds since the start when each phase ended
    model_dir: Path | None = None  # the policy directory the parts were built from

    def mark(self, name: str) -> None:
        self.timeline[name] = round(time.perf_counter() - self.t_start, 2)

    @property
    def needs_warm_start(self) -> bool:
        return not self.resumed and self.config.warm_start.enabled and bool(self.tasks.demonstrations)


@contextlib.asynccontextmanager
async def open_job(
    config: TrainConfig,
    run_dir: str | Path,
    *,
    view: ProgressView | None = None,
    admin_key: str | None = None,
    on_ready: Callable[[str, str], None] | None = None,
    require_train: bool = True,
    heldout: bool = False,
    max_attempts: int = 1,
) -> AsyncIterator[Job]:
    """Set the job up (see the module docstring), yield it, and tear it down whatever happens. ``heldout``: load
    the held-out tasks (``eval.n`` of them, when ``[eval]`` is on)."""
    t_start = time.perf_counter()
    sampling = split_sampling(config.rl, config.eval)
    out = prepare_run_dir(run_dir)
    sock = bind_socket(config.host, config.port)
    url = socket_url(sock, config.host)
    try:
        (out / "config.json").write_text(config.model_dump_json(indent=2))
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.rl.seed)
        resumed = load_checkpoint(out) is not None
        may_warm_start = not resumed and config.warm_start.enabled
        tasks = load_tasks(
            config.data,
            require_train=require_train,
            heldout_n=config.eval.n if heldout and config.eval.enabled else None,
            validation_tail=config.warm_start.validation_tasks if may_warm_start else None,
        )
        if may_warm_start and tasks.demonstrations and config.backend != "embedded":
            raise ConfigError(  # checked before anything is built, so the error comes at once
                f"warm_start needs backend 'embedded' (backend {config.backend!r} trains elsewhere): "
                "set [warm_start] enabled = false, or warm-start with the embedded backend first and point "
                "policy.model at its run's model/ directory"
            )
        view = view or ProgressView(config.name, config.rl.steps)
        metrics = MetricsLog(out, backends=config.metrics, name=config.name)
        try:
            kind = config.engine.kind
            launching = kind in ("vllm", "sglang") and not config.engine.urls
            view.set_phase(
                f"building the policy and launching the {kind} server" if launching else "building the policy"
            )
            model_dir = prepare_policy(config.policy, out, tasks.demonstrations)
            # the learner's section: [verl] when backend = "verl" (the config made one then), else [learner]
            parts = build_parts(
                out,
                model_dir,
                engine=config.engine,
                learner=config.verl or config.learner,
                policy=config.policy,
                cluster=config.cluster,
                policies=config.policies,
            )
            store = open_store(config.store.spec(out))
            loop = TrainingLoop.configured(
                store, parts, out, config.rl, train_tasks=tasks.train, url=url, max_attempts=max_attempts
            )
            key = admin_key or secrets.token_urlsafe(24)
            try:
                await loop.resume()
                ops = OpsMetrics()  # GET /metrics: the proxy's calls and recorder, the loop's steps, the served version
                ops.served_version_from(lambda: parts.engine.policy_version)
                loop.ops = ops
                loop.telemetry = telemetry = open_telemetry(config.telemetry)  # None unless [telemetry] / OTEL_* set
                server = ProxyServer(sock, config.host)
                async with server.serving(
                    store,
                    parts.engine,
                    parts.renderer or parts.engine.tokenizer,
                    admin_key=key,
                    sampling=sampling,
                    metrics=ops,
                    run_dir=out,
                    telemetry=telemetry,
                ):
                    try:
                        logger.info("serving on %s (policy version %d, step %d)", url, loop.version, loop.step)
                        (out / "daemon.json").write_text(json.dumps({"url": url, "admin_key": key}))
                        view.note(f"proxy on {url} (admin key in {out / 'daemon.json'})")
                        if on_ready is not None:
                            on_ready(url, key)
                        job = Job(
                            config, out, loop, parts, server, sampling, key, view, metrics, tasks, resumed, t_start
                        )
                        job.model_dir = model_dir
                        job.mark("startup_s")
                        guard = asyncio.create_task(guard_resident())  # a small policy's peaks (memory.py)
                        try:
                            yield job
                        finally:
                            guard.cancel()
                    finally:  # the workers are done (or released their attempts) by now: the proxy stops next
                        await loop.flush_weights()
            finally:
                if loop.telemetry is not None:  # export what is queued (the SDK's thread; bounded by its timeout)
                    await asyncio.to_thread(loop.telemetry.shutdown)
                await parts.close()
                await store.close()
        finally:
            metrics.close()
    finally:
        sock.close()
