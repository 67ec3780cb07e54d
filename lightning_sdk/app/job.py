"""The one job runner under ``lightning-sdk train`` and ``lightning-sdk daemon``: set-up and teardown in one place.

    open_job(config, run_dir)  ─▶  run dir (checked writable) + the proxy's socket (bound first: a bad port fails
                                   at once) + torch threads/seed + tasks and demonstrations + the policy directory
                                   + store, proxy, engine and learner (``TrainerDaemon`` over ``build_parts``)
                                   + ``daemon.json`` (URL, admin key) + metrics log
    ... the job (``app/train.py`` or ``app/daemon.py``) ...
    teardown, always, in this order: metrics, proxy (last to stop serving: workers are done by now), engine and
    learner, store, socket

Both jobs warm-start the same way (``Job.warm_start``): the validation tasks are ``data.validation`` when given,
else the last ``warm_start.validation_tasks`` train tasks (the two runners used to differ here).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.agent._base import Agent
from lightning_sdk.errors import ConfigError
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy
from lightning_sdk.policy.smollm2 import SMOLLM2_NAMES, prepare_smollm2
from lightning_sdk.policy.tokenizer import build_tokenizer
from lightning_sdk.proxy.sampling import SplitSampling
from lightning_sdk.records import AdvantageConfig, MergeOptions, RecordsConfig
from lightning_sdk.store import open_store
from lightning_sdk.trainer.checkpoint import load_checkpoint
from lightning_sdk.trainer.config import TrainConfig
from lightning_sdk.trainer.daemon import TrainerDaemon, bind_socket
from lightning_sdk.trainer.data import load_rows
from lightning_sdk.trainer.factory import Parts, build_parts, check_warm_start
from lightning_sdk.trainer.phases import never, warm_start_phase
from lightning_sdk.trainer.sampling import TaskSampler
from lightning_sdk.trainer.view import MetricsLog, ProgressView

__all__ = [
    "Job",
    "build_daemon",
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


def build_daemon(
    config: TrainConfig,
    run_dir: Path,
    model_dir: Path,
    train_tasks: list[dict[str, Any]],
    sock: socket.socket | None = None,
    max_attempts: int = 1,
) -> tuple[TrainerDaemon, Parts]:
    """Store (SQLite in the run dir) + the engine and learner of ``config.backend`` / ``config.engine``
    (``factory.build_parts``) + daemon for ``model_dir``, serving on ``sock`` if given (bound up front by
    ``bind_socket``), else on ``config.host:config.port``. Close the parts after the daemon stopped."""
    rl = config.rl
    parts = build_parts(config, run_dir, model_dir)
    store = open_store(run_dir / "store.db")
    records = records_config(config, parts.engine)
    sampler = (
        TaskSampler(len(train_tasks), replay_share=rl.replay_share, max_replays=rl.max_replays, seed=rl.seed)
        if rl.replay_share > 0 and train_tasks
        else None
    )
    daemon = TrainerDaemon(
        store,
        parts.engine,
        parts.learner,
        run_dir,
        weights=parts.weights,
        train_tasks=train_tasks,
        tasks_per_step=rl.tasks_per_step,
        samples_per_task=rl.samples_per_task,
        max_staleness=rl.max_staleness,
        records_config=records,
        max_attempts=max_attempts,
        sampling=split_sampling(config),
        admin_key=secrets.token_urlsafe(24),
        host=config.host,
        port=config.port,
        sock=sock,
        sampler=sampler,
    )
    if sampler is not None:
        sampler.start_at(daemon.next_task)
    return daemon, parts


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
    """What a running job has: its config and run directory, the daemon (store, proxy, engine, learner) and the
    parts it was built from, the tasks, the view and the metrics log."""

    config: TrainConfig
    out: Path
    daemon: TrainerDaemon
    parts: Parts
    view: ProgressView
    metrics: MetricsLog
    train_tasks: list[dict[str, Any]]
    demos: list[dict[str, Any]]
    resumed: bool
    t_start: float
    timeline: dict[str, float] = field(default_factory=dict)  # seconds since the start when each phase ended

    def mark(self, name: str) -> None:
        self.timeline[name] = round(time.perf_counter() - self.t_start, 2)

    @property
    def needs_warm_start(self) -> bool:
        return not self.resumed and self.config.warm_start.enabled and bool(self.demos)

    async def warm_start(self, agent: Agent, stop: Callable[[], bool] = never) -> dict[str, Any] | None:
        """The warm start, when configured and not done before (a resumed run skips it); None when skipped."""
        if not self.needs_warm_start or stop():
            return None
        self.view.set_phase("warm start")
        assert self.parts.model is not None  # check_warm_start: only the embedded backend warm-starts
        val = validation_tasks(self.config, self.train_tasks)
        result = await warm_start_phase(
            self.daemon, agent, self.config, self.demos, val, self.view.note, self.parts.model, stop
        )
        self.view.note(f"warm start: {result['steps']} steps, {result['wall_s']:.0f} s")
        return result


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
    sock = bind_socket(config.host, config.port)
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
        view.set_phase("building the policy")
        model_dir = prepare_policy(config, out, demos)
        daemon, parts = build_daemon(config, out, model_dir, train_tasks, sock, max_attempts=max_attempts)
        if admin_key:
            daemon.admin_key = admin_key
        try:
            await daemon.start()
            (out / "daemon.json").write_text(json.dumps({"url": daemon.url, "admin_key": daemon.admin_key}))
            view.note(f"proxy on {daemon.url} (admin key in {out / 'daemon.json'})")
            if on_ready is not None:
                on_ready(daemon.url, daemon.admin_key)
            metrics = MetricsLog(out, backends=config.metrics, name=config.name)
            job = Job(config, out, daemon, parts, view, metrics, train_tasks, demos, resumed, t_start)
            job.mark("startup_s")
            try:
                yield job
            finally:
                metrics.close()
        finally:  # the workers are done (or released their attempts) by now: the proxy stops first of the rest
            await daemon.stop()
            await parts.close()
            await daemon.store.close()
    finally:
        sock.close()
