"""What the user sees: a live progress view (rich), metrics files (JSONL, TensorBoard) and the reward curve (PNG).

``MetricsLog`` appends one JSON object per training step to ``RUN_DIR/metrics.jsonl`` and mirrors the numbers to
TensorBoard (``RUN_DIR/tensorboard``) when it is installed, and to W&B / MLflow when asked for
(``metrics = ["wandb"]`` in the config). ``ProgressView`` draws the current phase and the last
steps in a rich ``Live`` table on a terminal, and falls back to one plain line per step elsewhere (CI logs).
Under the table, a rich progress display: the current phase with a spinner and its elapsed time (the warm start, an
evaluation, a vLLM/SGLang launch waiting for its server) and a bar of the RL steps done.
``plot_reward_curve`` writes ``RUN_DIR/reward_curve.png`` (matplotlib, headless).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from lightning_sdk.app.loop import StepReport
from lightning_sdk.errors import ConfigError

__all__ = ["MetricsLog", "ProgressView", "plot_reward_curve"]

logger = logging.getLogger(__name__)


class MetricsLog:
    """metrics.jsonl (+ TensorBoard when available)."""

    def __init__(
        self, run_dir: str | Path, *, tensorboard: bool = True, backends: Sequence[str] = (), name: str = "run"
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb: Any = None
        self._wandb: Any = None
        self._mlflow: Any = None
        for backend in backends:
            if backend == "wandb":
                self._wandb = _require("wandb").init(project="lightning-sdk", name=name, dir=str(run_dir))
            elif backend == "mlflow":
                self._mlflow = _require("mlflow")
                self._mlflow.start_run(run_name=name)
            else:
                raise ConfigError(f"unknown metrics backend {backend!r}; valid: wandb, mlflow")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                logger.info("tensorboard is not installed; metrics go to %s only", self.path)

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=float) + "\n")
        if self._tb is not None and "step" in row:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, int(row["step"]))
            self._tb.flush()
        numbers = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._wandb is not None:
            self._wandb.log(numbers, step=int(row.get("step", 0)))
        if self._mlflow is not None:
            self._mlflow.log_metrics(numbers, step=int(row.get("step", 0)))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"metrics backend {module!r} was asked for but is not installed: pip install {module}"
        ) from exc


class ProgressView:
    """A live table of the run: phase, step, reward, success, tokens/s, staleness, queue depth."""

    def __init__(self, title: str, total_steps: int, *, console: Console | None = None) -> None:
        self.title = title
        self.total_steps = total_steps
        self.console = console or Console(stderr=True)
        self.phase = "starting"
        self.rows: deque[StepReport] = deque(maxlen=8)
        self.notes: list[str] = []
        self._live: Live | None = None
        # the phase (a spinner with its elapsed time: a vLLM launch or an evaluation shows it is alive) and the
        # RL steps done (a bar), drawn under the table
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._phase_task = self.progress.add_task("starting", total=None)
        self._steps_task = self.progress.add_task("RL steps", total=max(1, total_steps), completed=0)

    def __enter__(self) -> ProgressView:
        if self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(exc_type, exc, tb)
            self._live = None

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.progress.reset(self._phase_task, description=phase, total=None)  # its elapsed time starts again
        self._refresh()
        if self._live is None:
            self.console.print(f"{self.title}: {phase}", markup=False)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self._refresh()
        if self._live is None:
            self.console.print(f"{self.title}: {text}", markup=False)

    def step(self, report: StepReport) -> None:
        self.rows.append(report)
        self.progress.update(self._steps_task, completed=min(report.step, self.total_steps))
        self._refresh()
        if self._live is None:
            r = report
            self.console.print(
                f"{self.title}: step {r.step}/{self.total_steps} v{r.version} reward {r.reward_mean:.3f} "
                f"success {100 * r.success_rate:.1f}% {r.tokens_per_s:.0f} tok/s staleness {r.staleness_mean:.2f} "
                f"dropped {r.dropped_stale} queue {r.queue_depth} ({r.wall_s:.1f} s)",
                markup=False,
                soft_wrap=True,
            )

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def _render(self) -> Group:
        table = Table(title=f"{self.title} — {self.phase}", expand=False)
        for col in ("step", "version", "reward", "success", "tok/s", "staleness", "dropped", "queue", "loss", "s"):
            table.add_column(col, justify="right")
        for r in self.rows:
            table.add_row(
                f"{r.step}/{self.total_steps}",
                str(r.version),
                f"{r.reward_mean:.3f}",
                f"{100 * r.success_rate:.1f}%",
                f"{r.tokens_per_s:.0f}",
                f"{r.staleness_mean:.2f}",
                str(r.dropped_stale),
                str(r.queue_depth),
                f"{r.metrics.get('loss', 0.0):+.4f}",
                f"{r.wall_s:.1f}",
            )
        return Group(table, self.progress, *(Text(n) for n in self.notes[-6:]))


def plot_reward_curve(
    rows: list[dict[str, Any]], out: str | Path, *, before: float | None = None, after: float | None = None
) -> Path | None:
    """Reward and success per step (and the held-out success before/after as dashed lines) to a PNG."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    rewards = [float(r["reward_mean"]) for r in rows]
    window = 5
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    ax.plot(steps, rewards, label="train reward (sampled)", alpha=0.35)
    ax.plot(steps, smooth, label=f"train reward, mean of {window} steps")
    ax.plot(steps, [r["success_rate"] for r in rows], label="train success (sampled)", alpha=0.35, linestyle=":")
    if before is not None:
        ax.axhline(before, linestyle="--", color="gray", label=f"held-out before {before:.1%}")
    if after is not None:
        ax.axhline(after, linestyle="--", color="green", label=f"held-out after {after:.1%}")
    ax.set_xlabel("training step")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
