"""``lightning-sdk records``: export training records (JSONL or Parquet) and the fidelity report from a store."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lightning_sdk.cli._app import app
from lightning_sdk.errors import ConfigError, LightningSDKError, RecordError
from lightning_sdk.records.advantages import AdvantageConfig, estimator_names
from lightning_sdk.records.build import RecordsConfig
from lightning_sdk.records.export import ExportResult, export_stream
from lightning_sdk.records.record import Record, visualize
from lightning_sdk.records.report import render_report
from lightning_sdk.records.segments import MergeOptions
from lightning_sdk.store import iter_group_pages, open_store
from lightning_sdk.store.base import Store
from lightning_sdk.types import FinishedGroup

logger = logging.getLogger(__name__)


def _open_store(spec: str, admin_key: str | None) -> Store:
    """The store behind ``spec`` (a SQLite file that must exist, an http(s) URL of a daemon's store, or a
    postgresql:// URL)."""
    if "://" not in spec and not Path(spec).expanduser().exists():
        raise ConfigError(f"store {spec!r} does not exist")
    return open_store(spec, admin_key=admin_key)


def _check_vocab(records: list[Record], tokenizer: Any) -> None:
    vocab = len(tokenizer)
    for rec in records:
        if len(rec) and int(rec.input_ids.max()) >= vocab:
            raise RecordError(
                f"record of attempt {rec.attempt_id} has token id {int(rec.input_ids.max())} outside the "
                f"tokenizer's vocabulary ({vocab}): wrong --tokenizer?"
            )


async def _run(
    spec: str,
    admin_key: str | None,
    out: Path,
    config: RecordsConfig,
    split: str | None,
    report: Path | None,
    show: int,
    tokenizer: Any,
) -> ExportResult:
    """Stream the store's groups a page at a time into ``out`` (memory bounded by a page, not the store), with a
    progress display of the groups and rollouts read (on stderr; a plain summary line where it is not a terminal)."""
    store = _open_store(spec, admin_key)
    progress = export_progress()
    try:
        with progress:
            return await export_stream(
                lambda: counted_pages(iter_group_pages(store, split=split), progress),
                out,
                config,
                report=report,
                keep_records=show,
                check=None if tokenizer is None else (lambda records: _check_vocab(records, tokenizer)),
            )
    finally:
        await store.close()


def export_progress() -> Progress:
    """Groups and rollouts read so far, per pass over the store (a batch-wide estimator reads it twice)."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.completed} groups, {task.fields[rollouts]} rollouts"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )


async def counted_pages(
    pages: AsyncIterator[list[FinishedGroup]], progress: Progress
) -> AsyncIterator[list[FinishedGroup]]:
    """``pages`` unchanged, each page counted on a new line of ``progress`` (one line per pass)."""
    n = len(progress.tasks) + 1
    task = progress.add_task(f"records: reading the store (pass {n})", total=None, rollouts=0)
    groups = rollouts = 0
    async for page in pages:
        groups += len(page)
        rollouts += sum(len(g.rollouts) for g in page)
        progress.update(task, completed=groups, rollouts=rollouts)
        yield page
    progress.update(task, description=f"records: read the store (pass {n})", total=groups)


@app.command("records")
def records(
    store: str = typer.Option(
        ...,
        "--store",
        help="The store: a SQLite file path, a postgresql://USER@HOST/DB URL, or a daemon's URL (http://HOST:PORT, "
        "or its store's http://HOST:PORT/lightning/v1/store; with --admin-key).",
    ),
    out: Path = typer.Option(..., "--out", help="Output file: JSONL, or Parquet when it ends in .parquet."),
    tokenizer: Path | None = typer.Option(
        None, "--tokenizer", help="The policy's HF tokenizer directory: checks ids and decodes --show."
    ),
    estimator: str = typer.Option("grpo", "--estimator", help=f"Advantage estimator: {', '.join(estimator_names())}."),
    no_std: bool = typer.Option(False, "--no-std", help="GRPO without dividing by the group std."),
    max_length: int | None = typer.Option(None, "--max-length", help="Cut longer segments (flagged truncated)."),
    include_retokenized: bool = typer.Option(
        False, "--include-retokenized", help="Also train calls the proxy retokenized from text."
    ),
    drop_zero_variance: bool = typer.Option(False, "--drop-zero-variance", help="Leave out zero-variance groups."),
    failed_fill: float | None = typer.Option(
        None, "--failed-fill", help="Train failed/timed-out attempts with this reward (default: not trained)."
    ),
    gamma: float = typer.Option(1.0, "--gamma", help="Discount over calls for per-call rewards."),
    turn_baseline: str = typer.Option(
        "group",
        "--turn-baseline",
        help="Per-call rewards: compare each call with every call of its group (group) or with the calls at the "
        "same turn (turn).",
    ),
    split: str = typer.Option(
        "all", "--split", help="Export only this split (e.g. 'train'); default: every succeeded attempt."
    ),
    report: Path | None = typer.Option(None, "--report", help="Also write the fidelity report as JSON here."),
    show: int = typer.Option(0, "--show", help="Print the first N records with their loss mask."),
    quiet: bool = typer.Option(False, "--quiet", help="Do not print the report table."),
    admin_key: str | None = typer.Option(
        None, "--admin-key", envvar="LIGHTNING_SDK_ADMIN_KEY", help="Admin key of a daemon's store (http URL)."
    ),
) -> None:
    """Export training records (one row per segment of every succeeded attempt) and a token-fidelity report."""
    console = Console()
    try:
        config = RecordsConfig(
            merge=MergeOptions(include_retokenized=include_retokenized, max_length=max_length),
            advantage=AdvantageConfig(
                estimator=estimator,
                norm_by_std=not no_std,
                gamma=gamma,
                failed_fill=failed_fill,
                turn_baseline=turn_baseline,  # type: ignore[arg-type]  # checked by AdvantageConfig
                drop_zero_variance=drop_zero_variance,
            ),
        )
        if max_length is not None and max_length < 1:
            raise ConfigError("--max-length must be at least 1")
        for path, flag in ((out, "--out"), (report, "--report")):
            if path is not None and (path.is_dir() or not path.parent.is_dir()):
                raise ConfigError(f"{flag} {path}: not a writable file path (is its folder there?)")
        tok: Any = None
        if tokenizer is not None and not tokenizer.is_dir():
            raise ConfigError(f"--tokenizer {tokenizer}: no such directory (expected an HF tokenizer directory)")
        if tokenizer is not None:
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(str(tokenizer))
            except Exception as exc:  # transformers raises OSError/ValueError/...: translate at the boundary
                raise ConfigError(f"cannot load the tokenizer in {tokenizer}: {exc}") from exc
        result = asyncio.run(_run(store, admin_key, out, config, None if split == "all" else split, report, show, tok))
    except LightningSDKError as exc:
        console.print(f"error: {exc}", style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if not quiet:
        render_report(result, console)
    for rec in result.records[:show]:
        console.print(visualize(rec, tok, max_tokens=2000), markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {result.rows} records to {out}", markup=False, highlight=False, soft_wrap=True)
