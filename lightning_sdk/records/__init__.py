"""Records: an attempt's calls merged into segments, scored with advantages, batched for trainers, exported.

The data path is pure functions over plain typed data::

    calls ──merge_attempt──▶ segments ──build_records (advantages)──▶ records ──build_batch──▶ padded arrays
                                                                           └──write_records──▶ JSONL / Parquet
    store pages ──export_stream (a page of groups at a time)──▶ JSONL / Parquet + report (lightning-sdk records)

See docs/records.md for the format, the merge rules and the estimators.
"""

from lightning_sdk.records.advantages import (
    AdvantageConfig,
    AdvantageInput,
    Estimator,
    compute_advantages,
    discounted_returns,
    estimator_names,
    get_estimator,
    is_batch_wide,
    reference_advantages,
    register_estimator,
    zero_variance_groups,
)
from lightning_sdk.records.batch import build_batch, to_torch
from lightning_sdk.records.build import BuildResult, RecordsConfig, RolloutReport, build_records
from lightning_sdk.records.export import (
    COLUMNS,
    ExportResult,
    PageSource,
    export_records,
    export_stream,
    read_jsonl,
    record_row,
    report_json,
    write_jsonl,
    write_parquet,
    write_records,
)
from lightning_sdk.records.record import SPLIT_REASONS, CallSpan, Record, Segment, SplitReason, visualize
from lightning_sdk.records.report import render_report
from lightning_sdk.records.segments import MergeOptions, MergeResult, MergeStats, merge_attempt

__all__ = [
    "COLUMNS",
    "SPLIT_REASONS",
    "AdvantageConfig",
    "AdvantageInput",
    "BuildResult",
    "CallSpan",
    "Estimator",
    "ExportResult",
    "MergeOptions",
    "MergeResult",
    "MergeStats",
    "PageSource",
    "Record",
    "RecordsConfig",
    "RolloutReport",
    "Segment",
    "SplitReason",
    "build_batch",
    "build_records",
    "compute_advantages",
    "discounted_returns",
    "estimator_names",
    "export_records",
    "export_stream",
    "get_estimator",
    "is_batch_wide",
    "merge_attempt",
    "read_jsonl",
    "record_row",
    "reference_advantages",
    "register_estimator",
    "render_report",
    "report_json",
    "to_torch",
    "visualize",
    "write_jsonl",
    "write_parquet",
    "write_records",
    "zero_variance_groups",
]
