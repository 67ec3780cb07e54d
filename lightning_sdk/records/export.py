"""Export records (JSONL or Parquet, the contract's columns) and the fidelity report (no I/O but the output file:
``lightning_sdk.store.load_groups`` reads the groups).

Columns, one row per segment of every trained attempt (ARCHITECTURE.md, "Records export")::

    rollout_id, attempt_id, group, segment, input_ids, loss_mask, logprobs, advantage, reward,
    policy_versions, split_reason, truncated

``advantage`` is a float when every trained token of the row shares it (outcome rewards) and a per-token list
otherwise (per-turn credit). Parquet needs one type per column, so there the column is float64 when every row has a
float, else a list of float64 for every row.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from lightning_sdk.errors import ConfigError
from lightning_sdk.records.build import BuildResult, RecordsConfig, build_records
from lightning_sdk.records.record import Record
from lightning_sdk.types import FinishedGroup

__all__ = [
    "COLUMNS",
    "export_records",
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


def write_parquet(records: Sequence[Record], path: str | Path) -> int:
    """Write the records as a Parquet file with the contract's columns (needs ``pyarrow``, the ``export`` extra)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is in the export extra
        raise ConfigError("Parquet export needs pyarrow: pip install 'lightning-rl-sdk[export]'") from exc
    rows = [record_row(r) for r in records]
    per_token = any(isinstance(r["advantage"], list) for r in rows)
    if per_token:
        for row, rec in zip(rows, records, strict=True):
            row["advantage"] = rec.advantages.tolist()
    schema = pa.schema(
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
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, str(path))
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


def report_json(result: BuildResult) -> dict[str, Any]:
    """The fidelity report as JSON: a summary and one entry per rollout."""
    return {"summary": result.summary(), "rollouts": [r.as_dict() for r in result.reports]}
