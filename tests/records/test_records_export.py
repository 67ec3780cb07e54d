"""Export round trip through a real SQLite store file and the ``lightning-sdk records`` command; batches."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner, Result

import lightning_sdk.cli.records_cmd  # noqa: F401  (registers the command)
from lightning_sdk.cli._app import app
from lightning_sdk.errors import RecordError
from lightning_sdk.records import build_records
from lightning_sdk.records.advantages import AdvantageConfig
from lightning_sdk.records.batch import build_batch, to_torch
from lightning_sdk.records.build import RecordsConfig
from lightning_sdk.records.export import COLUMNS, export_records, export_stream, read_jsonl, report_json
from lightning_sdk.store import iter_group_pages, load_groups
from lightning_sdk.store.sqlite import SQLiteStore
from lightning_sdk.types import AttemptStatus, Call, FinishedGroup, Reward
from tests.records.calls import Attempt, full

QWEN_IM_START = 151644


def _invoke(args: list[str]) -> Result:
    """Run ``lightning-sdk records ...`` on the shared app (typer collapses an app with one command into it)."""
    if not hasattr(typer.main.get_command(app), "commands"):
        args = args[1:]
    return CliRunner().invoke(app, args)


async def _fill(path: Path) -> dict[str, list[Call]]:
    """Two groups of two rollouts; one rollout compacts, one fails, one group has equal rewards."""
    store = SQLiteStore(path)
    calls_by_attempt: dict[str, list[Call]] = {}
    try:
        await store.enqueue([{"q": "a"}, {"q": "b"}], n=2, group_ids=["grp-a", "grp-b"])
        plan = {0: (1.0, "ok"), 1: (0.0, "compact"), 2: (1.0, "ok"), 3: (None, "fail")}
        for i in range(4):
            claim = await store.claim(f"w{i}")
            assert claim is not None
            att = claim.attempt
            a = Attempt(att.attempt_id, att.rollout_id)
            c0 = a.call([QWEN_IM_START, 10 + i, 11], [20, 21, 22], version=1)
            c1 = a.call([*full(c0), 30], [40, 41], version=2)
            if plan[i][1] == "compact":
                a.call([QWEN_IM_START, 10 + i, 90], [91])
            a.call([], [], source="external", is_policy=False, logprobs=[])
            await store.record_calls(a.calls)
            calls_by_attempt[att.attempt_id] = a.calls
            reward, kind = plan[i]
            if kind == "fail":
                await store.finish_attempt(att.attempt_id, AttemptStatus.FAILED, error="boom")
                continue
            assert reward is not None and c1.call_id
            await store.record_rewards([Reward(rollout_id=att.rollout_id, attempt_id=att.attempt_id, value=reward)])
            await store.finish_attempt(att.attempt_id, AttemptStatus.SUCCEEDED)
    finally:
        await store.close()
    return calls_by_attempt


async def test_export_round_trip_through_sqlite_file(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    calls = await _fill(db)
    store = SQLiteStore(db)
    try:
        groups = await load_groups(store)
        result = export_records(groups, tmp_path / "out.jsonl")
    finally:
        await store.close()
    assert [g.group.group_id for g in groups] == ["grp-a", "grp-b"]
    rows = read_jsonl(tmp_path / "out.jsonl")
    assert all(tuple(r) == COLUMNS for r in rows)
    # 3 succeeded attempts: 1 + 2 (compaction) + 1 segments; the failed attempt has none
    assert len(rows) == 4 and len(result.records) == 4
    by_attempt: dict[str, list[dict[str, object]]] = {}
    for r in rows:
        by_attempt.setdefault(str(r["attempt_id"]), []).append(r)
    assert len(by_attempt) == 3
    for aid, rs in by_attempt.items():
        policy = [c for c in calls[aid] if c.is_policy]
        trained = {tuple(c.completion_ids): c.logprobs for c in policy}
        seen = []
        for r in rs:
            ids, mask, lps = r["input_ids"], r["loss_mask"], r["logprobs"]
            assert isinstance(ids, list) and isinstance(mask, list) and isinstance(lps, list)
            assert len(ids) == len(mask) == len(lps)
            run: list[int] = []
            for k, m in enumerate(mask):
                if m:
                    run.append(k)
                if run and (not m or k == len(mask) - 1):
                    seen.append((tuple(ids[run[0] : run[-1] + 1]), lps[run[0] : run[-1] + 1]))
                    run = []
        assert sorted(seen) == sorted(trained.items())  # every completion once, exact logprobs
    grp_a = [r for r in rows if r["group"] == "grp-a"]
    assert {r["reward"] for r in grp_a} == {0.0, 1.0}
    assert [r["split_reason"] for r in grp_a if r["reward"] == 0.0] == [None, "compaction"]
    assert [r["segment"] for r in grp_a if r["reward"] == 0.0] == [0, 1]
    first = next(r for r in grp_a if r["reward"] == 1.0)
    assert first["policy_versions"] == [1, 2] and first["truncated"] is False
    assert first["advantage"] == pytest.approx(0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-6))
    grp_b = [r for r in rows if r["group"] == "grp-b"]  # one success, one failure: a group of one
    assert len(grp_b) == 1 and result.zero_variance_groups == 0


async def _add_two_call_group(
    path: Path, gid: str, first: int, finals: tuple[float, float], first_call_reward: float | None
) -> None:
    """A group of two rollouts, two calls each (token ids from ``first``), final rewards ``finals``; with
    ``first_call_reward`` the first rollout also rewards its first call (per-turn credit: per-token advantages)."""
    store = SQLiteStore(path)
    try:
        await store.enqueue([{"q": gid}], n=2, group_ids=[gid])
        for i in range(2):
            claim = await store.claim(f"w-{gid}-{i}")
            assert claim is not None
            att = claim.attempt
            a = Attempt(att.attempt_id, att.rollout_id)
            c0 = a.call([QWEN_IM_START, first + i, 11], [first + 10, first + 11], version=3)
            a.call([*full(c0), 30], [first + 20, first + 21 + i], version=3)
            await store.record_calls(a.calls)
            rewards = [Reward(rollout_id=att.rollout_id, attempt_id=att.attempt_id, value=finals[i])]
            if i == 0 and first_call_reward is not None:
                rewards.append(
                    Reward(
                        rollout_id=att.rollout_id,
                        attempt_id=att.attempt_id,
                        value=first_call_reward,
                        call_id=c0.call_id,
                    )
                )
            await store.record_rewards(rewards)
            await store.finish_attempt(att.attempt_id, AttemptStatus.SUCCEEDED)
    finally:
        await store.close()


async def _add_per_call_group(path: Path) -> None:
    """A third group whose first attempt rewards a call (per-turn credit: per-token advantages)."""
    await _add_two_call_group(path, "grp-c", 50, (0.0, 1.0), 0.5)


async def _add_outcome_group(path: Path) -> None:
    """A fourth group, after the per-call one: outcome rewards 1 and 0.5."""
    await _add_two_call_group(path, "grp-d", 80, (1.0, 0.5), None)


@pytest.mark.parametrize(
    ("estimator", "turn_baseline"),
    [("grpo", "group"), ("reinforce_plus_plus_baseline", "group"), ("reinforce_plus_plus_baseline", "turn")],
)
async def test_streamed_export_writes_what_the_whole_export_writes(
    tmp_path: Path, estimator: str, turn_baseline: str
) -> None:
    """A page of one group at a time gives the same file and report as all groups at once; an estimator that whitens
    over the whole batch costs a first pass that collects every item's score (with ``turn_baseline = "turn"`` a page
    holds several baselines, one per turn of its group, kept apart from the next page's)."""
    db = tmp_path / "store.db"
    await _fill(db)
    await _add_per_call_group(db)
    await _add_outcome_group(db)
    config = RecordsConfig(advantage=AdvantageConfig(estimator=estimator, turn_baseline=turn_baseline))  # type: ignore[arg-type]
    store = SQLiteStore(db)
    try:
        whole = export_records(await load_groups(store, split=None), tmp_path / "whole.jsonl", config)
        streamed = await export_stream(
            lambda: iter_group_pages(store, split=None, page=1),
            tmp_path / "streamed.jsonl",
            config,
            report=tmp_path / "report.json",
            keep_records=2,
            keep_reports=3,
        )
    finally:
        await store.close()
    assert (tmp_path / "streamed.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()
    assert streamed.rows == len(whole.records) == 8 and streamed.pages == 4
    assert streamed.passes == (2 if estimator == "reinforce_plus_plus_baseline" else 1)
    assert streamed.summary() == whole.summary()
    assert json.loads((tmp_path / "report.json").read_bytes()) == json.loads(orjson.dumps(report_json(whole)))
    assert [r.attempt_id for r in streamed.records] == [r.attempt_id for r in whole.records[:2]]
    assert [r.rollout_id for r in streamed.reports] == [r.rollout_id for r in whole.reports[:3]]


async def test_streamed_parquet_switches_to_per_token_advantages_like_the_whole_export(tmp_path: Path) -> None:
    """The first page has one advantage per row; the second needs per-token lists: the file is written again with
    lists, equal to the in-memory export's."""
    db = tmp_path / "store.db"
    await _fill(db)
    await _add_per_call_group(db)
    store = SQLiteStore(db)
    try:
        whole = export_records(await load_groups(store, split=None), tmp_path / "whole.parquet")
        streamed = await export_stream(
            lambda: iter_group_pages(store, split=None, page=2), tmp_path / "streamed.parquet"
        )
    finally:
        await store.close()
    assert streamed.passes == 2 and streamed.rows == len(whole.records)
    table = pq.read_table(tmp_path / "streamed.parquet")
    assert str(table.schema.field("advantage").type) == "list<element: double>"
    assert table.to_pylist() == pq.read_table(tmp_path / "whole.parquet").to_pylist()


async def test_streamed_export_writes_each_page_before_reading_the_next(tmp_path: Path) -> None:
    """Bounded memory, as behaviour: pages hold at most ``page`` groups and the rows of a page are in the file before
    the next page is read (the peak RSS at 1M calls is in benchmarks/store_scale.py)."""
    db = tmp_path / "store.db"
    await _fill(db)
    await _add_per_call_group(db)
    out = tmp_path / "rows.jsonl"
    store = SQLiteStore(db)
    seen: list[tuple[int, int]] = []  # (groups in the page, rows in the file when the page was read)

    async def pages() -> AsyncIterator[list[FinishedGroup]]:
        async for page in iter_group_pages(store, split=None, page=1):
            seen.append((len(page), len(read_jsonl(out)) if out.exists() else 0))
            yield page

    try:
        result = await export_stream(pages, out)
    finally:
        await store.close()
    assert seen == [(1, 0), (1, 3), (1, 4)] and result.rows == 6 and len(read_jsonl(out)) == 6


def test_cli_writes_jsonl_parquet_and_report(tmp_path: Path) -> None:
    import asyncio

    from tests.support.tokenizers import tokenizer_dir

    db = tmp_path / "store.db"
    asyncio.run(_fill(db))
    out, report = tmp_path / "rec.jsonl", tmp_path / "report.json"
    args = ["records", "--store", str(db), "--tokenizer", str(tokenizer_dir("qwen3")), "--out", str(out)]
    res = _invoke([*args, "--report", str(report), "--show", "1", "--max-length", "8"])
    assert res.exit_code == 0, res.output
    assert "wrote 4 records" in res.output and "<|im_start|>" in res.output
    rows = read_jsonl(out)
    assert len(rows) == 4 and any(r["truncated"] for r in rows)
    assert all(len(r["input_ids"]) <= 8 for r in rows)
    rep = json.loads(report.read_text())
    assert rep["summary"]["records"] == 4 and rep["summary"]["rollouts"] == 4
    failed = [r for r in rep["rollouts"] if not r["trained"]]
    assert len(failed) == 1 and "no succeeded attempt" in failed[0]["note"]
    compacted = next(r for r in rep["rollouts"] if r["segments"] == 2)
    assert compacted["split_reasons"] == {"compaction": 1} and compacted["external_calls"] == 1
    assert compacted["completion_tokens_by_source"] == {"engine": 6}

    pq_out = tmp_path / "rec.parquet"
    res = _invoke([*args[:-1], str(pq_out), "--estimator", "rloo", "--quiet"])
    assert res.exit_code == 0, res.output
    table = pq.read_table(pq_out)
    assert tuple(table.column_names) == COLUMNS
    res = _invoke([*args, "--estimator", "rloo", "--quiet"])
    assert res.exit_code == 0, res.output
    jsonl_rows = read_jsonl(out)
    pq_rows = table.to_pylist()
    assert [r["input_ids"] for r in pq_rows] == [r["input_ids"] for r in jsonl_rows]
    assert [r["logprobs"] for r in pq_rows] == [r["logprobs"] for r in jsonl_rows]
    assert [r["advantage"] for r in pq_rows] == pytest.approx([r["advantage"] for r in jsonl_rows])


def test_cli_errors_are_clear(tmp_path: Path) -> None:
    res = _invoke(["records", "--store", str(tmp_path / "missing.db"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "does not exist" in res.output
    db = tmp_path / "s.db"
    import asyncio

    asyncio.run(_fill(db))
    res = _invoke(["records", "--store", str(db), "--out", str(tmp_path / "o"), "--estimator", "ppo"])
    assert res.exit_code == 1 and "unknown advantage estimator 'ppo'" in res.output and "rloo" in res.output
    res = _invoke(["records", "--store", str(db), "--out", str(tmp_path / "o"), "--turn-baseline", "call"])
    assert res.exit_code == 1 and "turn_baseline must be 'group' or 'turn'" in res.output


def test_batch_pads_records_and_converts_to_torch() -> None:
    from tests.records.test_records_advantages import _group, _rollout

    res = build_records([_group("g", [_rollout("g", 0, 1.0), _rollout("g", 1, 0.0)])])
    batch = build_batch(res.records, pad_id=-1, pad_to_multiple_of=8)
    n0 = len(res.records[0])
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"][0, n0:].tolist() == [-1] * (16 - n0)
    assert batch["attention_mask"][0].sum() == n0
    assert batch["position_ids"][0, :n0].tolist() == list(range(n0))
    np.testing.assert_array_equal(batch["loss_mask"][0, :n0], res.records[0].loss_mask)
    np.testing.assert_allclose(batch["old_logprobs"][0, :n0], res.records[0].logprobs, rtol=1e-6)
    np.testing.assert_allclose(batch["advantages"][1, :n0], res.records[1].advantages, rtol=1e-6)
    assert batch["sample_weight"].tolist() == [1.0, 1.0]
    tensors = to_torch(batch)
    assert tuple(tensors["input_ids"].shape) == (2, 16) and str(tensors["input_ids"].dtype) == "torch.int64"
    with pytest.raises(RecordError, match="max_length"):
        build_batch(res.records, max_length=3)
    with pytest.raises(RecordError):
        build_batch([])


def test_cli_reads_a_daemons_store_from_its_root_url(tmp_path: Path) -> None:
    """``--store http://HOST:PORT`` (the daemon's root URL, as printed) reads the store served at
    ``/lightning/v1/store`` on a real loopback server; it used to fail with "no route GET /group-details"."""
    import asyncio

    from tests.store.conftest import ADMIN_KEY, ServerThread

    db = tmp_path / "store.db"
    asyncio.run(_fill(db))
    store = SQLiteStore(db)
    server = ServerThread(store).start()
    try:
        root = server.url.removesuffix("/lightning/v1/store")
        for url in (root, root + "/", root + "/lightning/v1", server.url):
            out = tmp_path / "rec.jsonl"
            res = _invoke(["records", "--store", url, "--admin-key", ADMIN_KEY, "--out", str(out), "--quiet"])
            assert res.exit_code == 0, (url, res.output)
            assert len(read_jsonl(out)) == 4
    finally:
        server.stop()
        asyncio.run(store.close())
    command = typer.main.get_command(app)
    records = command.commands["records"] if hasattr(command, "commands") else command  # type: ignore[attr-defined]
    help_text = next(p.help for p in records.params if p.name == "store") or ""
    assert "http://HOST:PORT" in help_text and "/lightning/v1/store" in help_text  # what --help says
