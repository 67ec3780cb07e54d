"""Print the fidelity report with rich: per rollout, what was traced, what is trained, where the tokens came from."""

from __future__ import annotations

from typing import Any, Protocol

from rich.console import Console
from rich.table import Table

from lightning_sdk.records.build import RolloutReport

__all__ = ["render_report"]


class _Reported(Protocol):
    """A ``BuildResult``, or a streamed export's ``ExportResult`` (which keeps only the first reports)."""

    @property
    def reports(self) -> list[RolloutReport]: ...

    def summary(self) -> dict[str, Any]: ...


def _fmt(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def render_report(result: _Reported, console: Console | None = None, *, max_rows: int = 50) -> None:
    """Print a table of the first ``max_rows`` rollouts and a summary line to ``console``."""
    console = console or Console()
    table = Table(title="records: token fidelity per rollout", show_lines=False)
    for col in (
        "rollout",
        "calls",
        "trained",
        "segments",
        "split reasons",
        "tokens",
        "trained tok",
        "completion tokens by source",
        "prompt tokens by source",
        "reward",
        "advantage",
        "note",
    ):
        table.add_column(col, overflow="fold")
    for rep in result.reports[:max_rows]:
        s = rep.stats
        table.add_row(
            rep.rollout_id,
            str(s.calls),
            str(s.trained_calls),
            str(rep.segments),
            _fmt(rep.split_reasons),
            str(rep.tokens),
            str(rep.tokens_trained),
            _fmt(s.completion_tokens_by_source),
            _fmt(s.prompt_tokens_by_source),
            "-" if rep.reward is None else f"{rep.reward:.4g}",
            "-" if rep.advantage is None else f"{rep.advantage:.4g}",
            rep.note or ("zero-variance group" if rep.zero_variance_group else ""),
        )
    console.print(table)
    summ = result.summary()
    if summ["rollouts"] > max_rows:
        console.print(f"... {summ['rollouts'] - max_rows} more rollouts (see --report FILE for all)")
    console.print(
        f"{summ['records']} records from {summ['rollouts_trained']}/{summ['rollouts']} rollouts in "
        f"{summ['groups']} groups; {summ['tokens_trained']}/{summ['tokens']} tokens trained; "
        f"zero-variance groups: {summ['zero_variance_groups']}; split reasons: {_fmt(summ['split_reasons'])}; "
        f"truncated segments: {summ['truncated_segments']}; retokenized calls: {summ['retokenized_calls']}; "
        f"text-only calls (no ids, not trained): {summ['text_only_calls']}; "
        f"failed calls (not trained): {summ['failed_calls']}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
