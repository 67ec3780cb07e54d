"""The run viewer's pages and JSON over plain HTTP (no browser): a real SQLite store in a run directory, filled
through the store's API with calls whose ids and rewards the test chose, served by the viewer app over a loopback
socket (uvicorn) and read with httpx. The numbers shown must be the ones recorded: rewards, trained tokens, split
reasons, failed calls; filters and paging must hand back every matching rollout exactly once."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from lightning_sdk.store import open_store
from lightning_sdk.types import AttemptStatus, Call, Reward
from lightning_sdk.viewer import create_viewer_app, open_run
from lightning_sdk.viewer.serve import bind
from tests.support.waiting import until


def _call(claim_attempt: str, rollout: str, seq: int, prompt: list[int], completion: list[int], **kw: object) -> Call:
    return Call(
        call_id=f"{claim_attempt}-c{seq}", attempt_id=claim_attempt, rollout_id=rollout, seq=seq, model="policy",
        request={"messages": kw.pop("messages", [{"role": "user", "content": f"question {seq}"}])},
        response={"choices": [{"message": {"role": "assistant", "content": f"answer {seq}"}}]},
        prompt_ids=prompt, completion_ids=completion, logprobs=[-0.5 - 0.01 * i for i in range(len(completion))],
        policy_version=seq, finish_reason="stop", started_at=100.0 + seq, ended_at=100.5 + seq, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def _fill(db: Path) -> dict[str, str]:
    """Group g-a (train): rollout 0 has 2 calls merged into one segment, reward 1.0; rollout 1 has 2 calls whose
    second edits the history (a second segment) and a failed third call, reward 0.25. Group g-b (eval): one
    rollout whose attempt failed. 40 more train groups of one rollout each, reward = its index / 100."""
    store = open_store(db)
    ids: dict[str, str] = {}
    await store.enqueue([{"q": "a"}], n=2, group_ids=["g-a"])
    for i, reward in enumerate((1.0, 0.25)):
        claim = await store.claim("w")
        assert claim is not None
        att, rid = claim.attempt.attempt_id, claim.rollout.rollout_id
        ids[f"a{i}"] = rid
        if i == 0:
            calls = [_call(att, rid, 0, [1, 2, 3], [4, 5]), _call(att, rid, 1, [1, 2, 3, 4, 5, 6], [7, 8, 9])]
        else:
            calls = [
                _call(att, rid, 0, [1, 2, 3], [4, 5]),
                _call(att, rid, 1, [1, 2, 9, 9, 9, 9, 9], [10, 11, 12, 13]),
                _call(att, rid, 2, [1, 2, 3], [], error="the engine failed"),
            ]
        await store.record_calls(calls)
        await store.record_rewards([Reward(rollout_id=rid, attempt_id=att, value=reward)])
        await store.finish_attempt(att, AttemptStatus.SUCCEEDED)
    await store.enqueue([{"q": "b"}], n=1, split="eval", group_ids=["g-b"])
    claim = await store.claim("w", split="eval")
    assert claim is not None
    ids["b0"] = claim.rollout.rollout_id
    await store.finish_attempt(claim.attempt.attempt_id, AttemptStatus.FAILED, error="the agent crashed")
    await store.enqueue([{"q": f"m{k}"} for k in range(40)], n=1, group_ids=[f"g-m{k:02d}" for k in range(40)])
    for k in range(40):
        claim = await store.claim("w")
        assert claim is not None
        att, rid = claim.attempt.attempt_id, claim.rollout.rollout_id
        await store.record_calls([_call(att, rid, 0, [1, 2], [3] * (k % 5 + 1))])
        await store.record_rewards([Reward(rollout_id=rid, attempt_id=att, value=k / 100)])
        await store.finish_attempt(att, AttemptStatus.SUCCEEDED)
    await store.close()
    return ids


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str], Path]]:
    run = tmp_path_factory.mktemp("run")
    ids = asyncio.run(_fill(run / "store.db"))
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "reward_mean": 0.1 * s, "success_rate": 0.2 * s, "loss": 1.0 / s,
                              "staleness_mean": 0.5, "wait_s": 0.01 * s, "version": s}) for s in (1, 2, 3)) + "\n"
    )  # fmt: skip
    (run / "summary.json").write_text(json.dumps({
        "eval_before": {"success_rate": 0.125, "mean_reward": 0.1, "n": 8},
        "eval_after": {"success_rate": 0.625, "mean_reward": 0.5, "n": 8}, "steps": 3, "wall_s": 9.5,
        "model_dir": str(run / "model")}))  # fmt: skip
    data = open_run(run)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_viewer_app(data), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    until(lambda: server.started, timeout=30, what="the viewer to serve")
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", ids, run
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_rollout_json_equals_what_was_recorded(served: tuple[str, dict[str, str], Path]) -> None:
    url, ids, _ = served
    merged = httpx.get(f"{url}/api/rollouts/{ids['a0']}").json()
    assert merged["row"]["reward"] == 1.0
    assert [r["split_reason"] for r in merged["records"]] == [None]
    assert merged["tokens_trained"] == 2 + 3  # both completions, one segment
    (rec,) = merged["records"]
    assert [t["id"] for t in rec["tokens"]] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [t["mask"] for t in rec["tokens"]] == [0, 0, 0, 1, 1, 0, 1, 1, 1]
    assert [t["version"] for t in rec["tokens"]] == [None, None, None, 0, 0, None, 1, 1, 1]
    assert rec["tokens"][3]["logprob"] == pytest.approx(-0.5) and rec["tokens"][8]["logprob"] == pytest.approx(-0.52)
    # GRPO over the group (rewards 1.0 and 0.25): (r - mean) / sample std, on the trained tokens only
    assert rec["advantage"] == pytest.approx((1.0 - 0.625) / statistics.stdev([1.0, 0.25]), abs=1e-4)
    assert rec["tokens"][0]["advantage"] == 0.0

    split = httpx.get(f"{url}/api/rollouts/{ids['a1']}").json()
    assert split["row"]["reward"] == 0.25
    assert [r["split_reason"] for r in split["records"]] == [None, "history_edit"]
    assert split["tokens_trained"] == 2 + 4
    assert split["row"]["failed_calls"] == 1
    conv = split["attempts"][0]["conversation"]
    assert [c["error"] for c in conv] == [None, None, "the engine failed"]
    assert conv[0]["messages"][0]["content"] == "question 0" and conv[0]["reply"]["content"] == "answer 0"
    assert [c["completion_tokens"] for c in conv] == [2, 4, 0]

    failed = httpx.get(f"{url}/api/rollouts/{ids['b0']}").json()
    assert (
        failed["status"] == "failed"
        and failed["records"] == []
        and failed["attempts"][0]["error"] == "the agent crashed"
    )


def test_rollouts_table_filters_and_pages_every_match_once(served: tuple[str, dict[str, str], Path]) -> None:
    url, ids, _ = served
    every = httpx.get(f"{url}/api/rollouts", params={"limit": 500}).json()
    assert len(every["rollouts"]) == 2 + 1 + 40 and every["next"] is None
    seen: list[str] = []
    after: str | None = None
    while True:  # pages of 7: every rollout exactly once, in creation order
        params: dict[str, str | int] = {"limit": 7, **({"after": after} if after else {})}
        page = httpx.get(f"{url}/api/rollouts", params=params).json()
        assert len(page["rollouts"]) <= 7
        seen += [r["rollout_id"] for r in page["rollouts"]]
        after = page["next"]
        if after is None:
            break
    assert seen == [r["rollout_id"] for r in every["rollouts"]]

    high = httpx.get(f"{url}/api/rollouts", params={"split": "train", "reward_min": 0.3}).json()["rollouts"]
    assert sorted(r["reward"] for r in high) == [*[k / 100 for k in range(30, 40)], 1.0]
    band = httpx.get(f"{url}/api/rollouts", params={"reward_min": 0.1, "reward_max": 0.12}).json()["rollouts"]
    assert sorted(r["reward"] for r in band) == [0.1, 0.11, 0.12]
    failed = httpx.get(f"{url}/api/rollouts", params={"status": "failed"}).json()["rollouts"]
    assert [(r["rollout_id"], r["split"]) for r in failed] == [(ids["b0"], "eval")]
    evals = httpx.get(f"{url}/api/rollouts", params={"split": "eval"}).json()["rollouts"]
    assert [r["rollout_id"] for r in evals] == [ids["b0"]]
    group = httpx.get(f"{url}/api/rollouts", params={"group": "g-a"}).json()["rollouts"]
    assert sorted(r["rollout_id"] for r in group) == sorted([ids["a0"], ids["a1"]])
    row = next(r for r in group if r["rollout_id"] == ids["a1"])
    assert row["split_reasons"] == {"history_edit": 1} and row["tokens_trained"] == 6


def test_bad_filters_are_refused_naming_the_parameter(served: tuple[str, dict[str, str], Path]) -> None:
    url, _, _ = served
    for params, param in (
        ({"reward_min": "high"}, "reward_min"),
        ({"reward_max": "nan"}, "reward_max"),
        ({"status": "done"}, "status"),
        ({"limit": "0"}, "limit"),
        ({"after": "zz~x"}, "after"),
    ):
        r = httpx.get(f"{url}/api/rollouts", params=params)
        assert r.status_code == 400, params
        assert r.json()["error"]["param"] == param
    assert httpx.get(f"{url}/rollouts", params={"status": "done"}).status_code == 400
    missing = httpx.get(f"{url}/api/rollouts/ro-nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"]


def test_pages_render_the_recorded_numbers(served: tuple[str, dict[str, str], Path]) -> None:
    url, ids, _ = served
    index = httpx.get(f"{url}/").text
    assert '<td id="eval-before">0.125</td>' in index and '<td id="eval-after">0.625</td>' in index
    assert index.count('data-series="train reward"') == 3 and 'data-y="0.3"' in index  # reward 0.1 * 3
    page = httpx.get(f"{url}/rollouts/{ids['a1']}").text
    assert '<td id="reward">0.25</td>' in page and '<td id="tokens-trained">6</td>' in page
    assert page.count('class="tok m1"') == 6 and '<span class="split-reason">history_edit</span>' in page
    assert "the engine failed" in page
    table = httpx.get(f"{url}/rollouts", params={"status": "failed"}).text
    assert f'data-rollout="{ids["b0"]}"' in table and table.count("<tr data-rollout=") == 1
    assert httpx.get(f"{url}/static/viewer.js").status_code == 200


def test_fidelity_report_counts_splits_failures_and_tokens(served: tuple[str, dict[str, str], Path]) -> None:
    url, ids, _ = served
    f = httpx.get(f"{url}/api/fidelity").json()
    assert f["rollouts"] == 43 and f["rollouts_trained"] == 42
    assert f["split_reasons"] == {"history_edit": 1}
    assert f["tokens_trained"] == 5 + 6 + sum(k % 5 + 1 for k in range(40))
    assert f["failed_calls"] == 1 and f["failed"] == [
        {"rollout_id": ids["a1"], "call_id": f["failed"][0]["call_id"], "error": "the engine failed"}
    ]
    assert f["by_split"]["eval"] == {"rollouts": 1, "trained": 0, "split_reasons": {}}
    assert '<span id="f-tokens-trained">' in httpx.get(f"{url}/fidelity").text
