"""Export records (JSONL or Parquet, the contract's columns) and the fidelity report (no I/O but the output files:
``lightning_sdk.store.iter_group_pages`` / ``load_groups`` read the groups).

``export_stream`` is what ``lightning-sdk records`` runs: it builds and writes one page of groups at a time, so its
memory is one page's whatever the size of the store, and writes exactly what ``export_records`` writes for all the
groups at once. Two things look beyond a page and cost a pass more over the store: an estimator that whitens over
the batch (``is_batch_wide``: a first pass collects every item's score, the advantages are computed once over them
all, then the second pass writes), and a Parquet file whose ``advantage`` column turns out to need per-token lists
(it is written as float64 until a row needs a list, then written again from the start with lists).

Columns, one row per segment of every trained attempt (ARCHITECTURE.md, "Records export")::

    rollout_id, attempt_id, group, segment, input_ids, loss_mask, logprobs, advantage, reward,
    policy_versions, split_reason, truncated

``advantage`` is a float when every trained token of the row shares it (outcome rewards) and a per-token list
otherwise (per-turn credit). Parquet needs one type per column, so there the column is float64 when every row has a
float, else a list of float64 for every row.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson

from lightning_sdk.errors import ConfigError, RecordError
from lightning_sdk.records.advantages import F64, AdvantageInput, compute_advantages, is_batch_wide
from lightning_sdk.records.build import BuildResult, RecordsConfig, RolloutReport, build_records
from lightning_sdk.records.record import Record
from lightning_sdk.types import FinishedGroup

__all__ = [
    "COLUMNS",
    "ExportResult",
    "PageSource",
    "export_records",
    "export_stream",
    "read_jsonl",
    "record_row",
    "report_json",
    "write_jsonl",
    "write_parquet",
    "write_records",
]

logger = logging.getLogger(__name__)

COLUMNS = (
    "rollout_id",
    "attempt_id",
    "group",
    "segment",
    "input_ids",
    "loss_mask",
    "logprobs",
    "advantage",
    "reward",
    "policy_versions",
    "split_reason",
    "truncated",
)


def record_row(record: Record) -> dict[str, Any]:
    """The contract's row for one record (plain Python values, JSON-ready)."""
    seg = record.segment
    return {
        "rollout_id": seg.rollout_id,
        "attempt_id": seg.attempt_id,
        "group": record.group_id,
        "segment": seg.index,
        "input_ids": seg.input_ids.tolist(),
        "loss_mask": seg.loss_mask.tolist(),
        "logprobs": seg.logprobs.tolist(),
        "advantage": record.scalar_advantage(),
        "reward": float(record.reward),
        "policy_versions": seg.policy_versions,
        "split_reason": seg.split_reason,
        "truncated": bool(seg.truncated),
    }


def write_jsonl(records: Iterable[Record], path: str | Path) -> int:
    """Write one JSON object per record; returns the number of rows."""
    n = 0
    with open(path, "wb") as fh:
        for rec in records:
            fh.write(orjson.dumps(record_row(rec)))
            fh.write(b"\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL export (for checks and tools)."""
    with open(path, "rb") as fh:
        return [orjson.loads(line) for line in fh if line.strip()]


def _parquet_schema(per_token: bool) -> Any:
    try:
        import pyarrow as pa
    except ImportError as exc:  # pragma: no cover - pyarrow is in the export extra
        raise ConfigError("Parquet export needs pyarrow: pip install 'lightning-rl-sdk[export]'") from exc
    return pa.schema(
        [
            ("rollout_id", pa.string()),
            ("attempt_id", pa.string()),
            ("group", pa.string()),
            ("segment", pa.int64()),
            ("input_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int8())),
            ("logprobs", pa.list_(pa.float64())),
            ("advantage", pa.list_(pa.float64()) if per_token else pa.float64()),
            ("reward", pa.float64()),
            ("policy_versions", pa.list_(pa.int64())),
            ("split_reason", pa.string()),
            ("truncated", pa.bool_()),
        ]
    )


def _parquet_rows(records: Sequence[Record], per_token: bool) -> list[dict[str, Any]]:
    rows = [record_row(r) for r in records]
    if per_token:
        for row, rec in zip(rows, records, strict=True):
            row["advantage"] = rec.advantages.tolist()
    return rows


def write_parquet(records: Sequence[Record], path: str | Path) -> int:
    """Write the records as a Parquet file with the contract's columns (needs ``pyarrow``, the ``export`` extra)."""
    per_token = any(isinstance(r.scalar_advantage(), list) for r in records)
    schema = _parquet_schema(per_token)
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _parquet_rows(records, per_token)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), str(path))
    return len(rows)


def write_records(records: Sequence[Record], path: str | Path) -> int:
    """JSONL, or Parquet when ``path`` ends in ``.parquet``."""
    if str(path).endswith(".parquet"):
        return write_parquet(records, path)
    return write_jsonl(records, path)


def export_records(
    groups: Sequence[FinishedGroup], out: str | Path, config: RecordsConfig | None = None
) -> BuildResult:
    """Build records from ``groups`` (``lightning_sdk.store.load_groups`` reads them) and write them to ``out``."""
    result = build_records(groups, config)
    n = write_records(result.records, out)
    logger.info("wrote %d records of %d groups to %s", n, len(groups), out)
    return result


# ---- streamed export --------------------------------------------------------------------------------------------

PageSource = Callable[[], AsyncIterator[Sequence[FinishedGroup]]]
"""A fresh pass over the groups to export, a page at a time, e.g. ``lambda: iter_group_pages(store, split=None)``."""


@dataclass(slots=True, repr=False)
class ExportResult:
    """What ``export_stream`` wrote: the report's totals, and only the first reports and records (for printing)."""

    totals: dict[str, Any] = field(default_factory=dict)
    reports: list[RolloutReport] = field(default_factory=list)  # the first ``keep_reports`` rollouts
    records: list[Record] = field(default_factory=list)  # the first ``keep_records`` records
    rows: int = 0
    pages: int = 0  # pages read in the pass that wrote the file
    passes: int = 1  # passes over the store (see the module docstring)

    def summary(self) -> dict[str, Any]:
        """The same summary ``BuildResult.summary()`` gives for all the groups at once."""
        return self.totals

    def __repr__(self) -> str:  # short: see BuildResult.__repr__
        return f"ExportResult(rows={self.rows}, pages={self.pages}, passes={self.passes})"


class _NeedsPerToken(RecordError):
    """A scalar-advantage Parquet file met a row with per-token advantages: write it again with lists."""


def _add_summary(totals: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, dict):
            into = totals.setdefault(key, {})
            for k, v in value.items():
                into[k] = into.get(k, 0) + v
        else:
            totals[key] = totals.get(key, 0) + value


class _Sink:
    """The output file, written a page of records at a time."""

    def __init__(self, path: str | Path, per_token: bool) -> None:
        self.parquet = str(path).endswith(".parquet")
        self.per_token = per_token
        self._fh: IO[bytes] | None = None
        self._writer: Any = None
        if self.parquet:
            import pyarrow.parquet as pq

            self._schema = _parquet_schema(per_token)
            self._writer = pq.ParquetWriter(str(path), self._schema)
        else:
            self._fh = open(path, "wb")  # noqa: SIM115 - closed in close()

    def write(self, records: Sequence[Record]) -> None:
        if self._fh is not None:
            self._fh.write(b"".join(orjson.dumps(record_row(r)) + b"\n" for r in records))
            self._fh.flush()  # a page's rows are in the file before the next page is read
            return
        if not self.per_token and any(isinstance(r.scalar_advantage(), list) for r in records):
            raise _NeedsPerToken
        if records:
            import pyarrow as pa

            rows = _parquet_rows(records, self.per_token)
            self._writer.write_table(pa.Table.from_pylist(rows, schema=self._schema))

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self._writer is not None:
            self._writer.close()


async def _batch_advantages(pages: PageSource, config: RecordsConfig) -> F64:
    """The advantages of every item of the export, computed at once (for a batch-wide estimator)."""
    parts: list[AdvantageInput] = []
    offset = 0

    def collect(items: AdvantageInput) -> F64:
        nonlocal offset
        parts.append(AdvantageInput(items.scores, items.group_index + offset, items.token_counts))
        if items.group_index.shape[0]:  # the page's baselines (groups, or a group's turns) after the last page's
            offset += int(items.group_index.max()) + 1
        return np.zeros(items.scores.shape[0], dtype=np.float64)

    async for page in pages():
        build_records(page, config, advantages=collect)
    if not parts:
        return np.zeros(0, dtype=np.float64)
    items = AdvantageInput(
        np.concatenate([p.scores for p in parts]),
        np.concatenate([p.group_index for p in parts]),
        np.concatenate([p.token_counts for p in parts]),
    )
    return compute_advantages(items, config.advantage)


async def export_stream(
    pages: PageSource,
    out: str | Path,
    config: RecordsConfig | None = None,
    *,
    report: str | Path | None = None,
    keep_records: int = 0,
    keep_reports: int = 50,
    check: Callable[[list[Record]], None] | None = None,
) -> ExportResult:
    """Build and write the records of every page of ``pages`` (JSONL, or Parquet when ``out`` ends in
    ``.parquet``), one page at a time, and the fidelity report (``report_json``'s shape) to ``report`` if given.
    ``check`` sees each page's records before they are written (it may raise)."""
    config = config or RecordsConfig()
    every: F64 | None = await _batch_advantages(pages, config) if is_batch_wide(config.advantage.estimator) else None
    passes = 1 if every is None else 2
    per_token = False
    while True:
        try:
            result = await _write_pass(pages, out, config, every, per_token, report, keep_records, keep_reports, check)
        except _NeedsPerToken:
            per_token, passes = True, passes + 1
            continue
        result.passes = passes
        logger.info(
            "wrote %d records of %d groups to %s (%d pages, %d passes)",
            result.rows,
            result.totals.get("groups", 0),
            out,
            result.pages,
            passes,
        )
        return result


async def _write_pass(
    pages: PageSource,
    out: str | Path,
    config: RecordsConfig,
    every: F64 | None,
    per_token: bool,
    report: str | Path | None,
    keep_records: int,
    keep_reports: int,
    check: Callable[[list[Record]], None] | None,
) -> ExportResult:
    result = ExportResult()
    used = 0  # items of ``every`` handed out so far

    def precomputed(items: AdvantageInput) -> F64:
        nonlocal used
        assert every is not None
        n = items.scores.shape[0]
        used += n
        return every[used - n : used]

    sink = _Sink(out, per_token)
    # the report's rollouts, one per line, until the totals are known
    entries = tempfile.TemporaryFile() if report is not None else None  # noqa: SIM115 - closed below
    try:
        async for page in pages():
            built = build_records(page, config, advantages=None if every is None else precomputed)
            if check is not None:
                check(built.records)
            sink.write(built.records)
            if entries is not None:
                entries.write(b"".join(b"    " + orjson.dumps(r.as_dict()) + b",\n" for r in built.reports))
            _add_summary(result.totals, built.summary())
            result.rows += len(built.records)
            result.pages += 1
            result.records.extend(built.records[: max(0, keep_records - len(result.records))])
            result.reports.extend(built.reports[: max(0, keep_reports - len(result.reports))])
        if not result.totals:
            _add_summary(result.totals, build_records([], config).summary())
        if report is not None and entries is not None:
            _write_report(report, result.totals, entries)
    finally:
        sink.close()
        if entries is not None:
            entries.close()
    return result


def _write_report(path: str | Path, totals: dict[str, Any], entries: IO[bytes]) -> None:
    """``report_json``'s document: the summary, then the rollouts copied from ``entries`` (a line each)."""
    summary = orjson.dumps(totals, option=orjson.OPT_INDENT_2).replace(b"\n", b"\n  ")
    entries.seek(0)
    with open(path, "wb") as fh:
        fh.write(b'{\n  "summary": ' + summary + b',\n  "rollouts": [\n')
        previous = b""
        for line in entries:
            if previous:
                fh.write(previous)
            previous = line
        fh.write(previous[:-2] + b"\n" if previous else b"")  # the last entry without its comma
        fh.write(b"  ]\n}\n")


def report_json(result: BuildResult) -> dict[str, Any]:
    """The fidelity report as JSON: a summary and one entry per rollout."""
    return {"summary": result.summary(), "rollouts": [r.as_dict() for r in result.reports]}
