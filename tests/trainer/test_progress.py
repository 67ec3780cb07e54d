"""Progress where people wait: the train view's phase spinner (with its elapsed time) and RL-steps bar on a real
rich terminal console, and the records export's count of groups and rollouts read, page by page."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator

from rich.console import Console

from lightning_sdk.app.loop import StepReport
from lightning_sdk.app.view import ProgressView
from lightning_sdk.cli.records_cmd import counted_pages, export_progress
from lightning_sdk.types import FinishedGroup, Group, Rollout, RolloutDetail


def _report(step: int) -> StepReport:
    return StepReport(step, step, 0.5, 4, 0, 8, 0.25, 0.5, 0.0, 0, 0, 0, 100.0, 0.1, 0.2, metrics={"loss": 0.5})


def test_the_view_shows_the_phase_and_the_rl_steps_done() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    frame = Console(file=io.StringIO(), width=160, color_system=None)
    with ProgressView("calc", 3, console=console) as view:
        view.set_phase("building the policy and launching the vllm server")
        frame.print(view._render())  # what the live display draws now (it refreshes 4 times a second)
        assert "⠋ building the policy and launching the vllm server" in frame.file.getvalue()  # type: ignore[attr-defined]
        view.set_phase("RL")
        view.step(_report(1))
        view.step(_report(2))
    text = out.getvalue()
    last = text[text.rindex("calc — RL") :]  # the final frame
    assert "RL" in last and "2/3" in last  # the steps bar: two of three steps done
    assert view.progress.tasks[1].completed == 2 and view.progress.tasks[0].description == "RL"


def _group(i: int, n: int) -> FinishedGroup:
    g = Group(group_id=f"g{i}", task={}, n=n)
    return FinishedGroup(
        g, [RolloutDetail(rollout=Rollout(rollout_id=f"r{i}-{k}", group_id=g.group_id, task={})) for k in range(n)]
    )


def test_the_export_counts_groups_and_rollouts_read_per_pass() -> None:
    pages = [[_group(0, 2), _group(1, 3)], [_group(2, 4)]]

    async def source() -> AsyncIterator[list[FinishedGroup]]:
        for page in pages:
            yield page

    async def main() -> list[list[FinishedGroup]]:
        progress = export_progress()
        seen = [page async for page in counted_pages(source(), progress)]
        seen += [page async for page in counted_pages(source(), progress)]  # a second pass: its own line
        assert [(t.completed, t.fields["rollouts"]) for t in progress.tasks] == [(3, 9), (3, 9)]
        assert [t.description for t in progress.tasks] == [
            "records: read the store (pass 1)",
            "records: read the store (pass 2)",
        ]
        return seen

    assert asyncio.run(main()) == pages + pages  # the pages themselves pass through unchanged
