"""Records → verl ``DataProto`` → records: the layout verl's FSDP workers expect, and an exact round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto

from lightning_sdk.errors import RecordError
from lightning_sdk.records import build_records
from lightning_sdk.records.record import CallSpan, Record, Segment
from lightning_sdk.trainer.verl.batch import TrainRow, dataproto_to_rows, records_to_dataproto, rows_from_records
from lightning_sdk.types import Attempt as AttemptRow
from lightning_sdk.types import (
    AttemptDetail,
    AttemptStatus,
    FinishedGroup,
    Group,
    Reward,
    Rollout,
    RolloutDetail,
    RolloutStatus,
)
from tests.records.calls import Attempt as CallsOf


def _record(ids: list[int], mask: list[int], lps: list[float], adv: float, group: str, attempt: str) -> Record:
    seg = Segment(
        attempt_id=attempt,
        rollout_id=f"r-{attempt}",
        index=0,
        input_ids=np.array(ids, dtype=np.int32),
        loss_mask=np.array(mask, dtype=np.int8),
        logprobs=np.array(lps, dtype=np.float32),
        spans=(CallSpan(call_id="c1", seq=0, start=mask.index(1), end=len(ids), policy_version=3),),
    )
    advantages = np.array([adv if m else 0.0 for m in mask], dtype=np.float32)
    return Record(segment=seg, group_id=group, reward=1.0 if adv > 0 else 0.0, advantages=advantages, weight=0.5)


def test_multi_turn_record_layout() -> None:
    """Prompt = tokens before the first trained one (left-padded); response = the rest, context tokens mask 0."""
    rec = _record(
        [1, 2, 3, 10, 11, 4, 5, 12], [0, 0, 0, 1, 1, 0, 0, 1], [0, 0, 0, -0.5, -0.25, 0, 0, -1.0], 0.7, "g", "a1"
    )
    short = {
        "input_ids": [7, 8, 9],
        "loss_mask": [0, 1, 1],
        "logprobs": [0.0, -0.1, -0.2],
        "advantage": -0.3,
        "reward": 0.0,
        "group": "g",
        "rollout_id": "r2",
        "attempt_id": "a2",
        "segment": 1,
        "policy_versions": [4],
    }
    data = records_to_dataproto([rec, short], pad_id=0)
    assert isinstance(data, DataProto) and len(data) == 2
    b = data.batch
    assert b["prompts"].tolist() == [[1, 2, 3], [0, 0, 7]]
    assert b["responses"].tolist() == [[10, 11, 4, 5, 12], [8, 9, 0, 0, 0]]
    assert b["input_ids"].tolist() == [[1, 2, 3, 10, 11, 4, 5, 12], [0, 0, 7, 8, 9, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 8, [0, 0, 1, 1, 1, 0, 0, 0]]
    assert b["position_ids"].tolist() == [list(range(8)), [0, 0, 0, 1, 2, 2, 2, 2]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    want_lp = torch.tensor([[-0.5, -0.25, 0, 0, -1.0], [-0.1, -0.2, 0, 0, 0]])
    torch.testing.assert_close(b["rollout_log_probs"], want_lp)
    torch.testing.assert_close(b["advantages"], torch.tensor([[0.7, 0.7, 0, 0, 0.7], [-0.3, -0.3, 0, 0, 0]]))
    assert torch.equal(b["returns"], b["advantages"])
    # outcome reward on the last trained token, as verl's reward managers place it
    assert b["token_level_scores"].tolist() == [[0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0]]
    assert list(data.non_tensor_batch["uid"]) == ["g", "g"]
    assert list(data.non_tensor_batch["policy_versions"]) == [[3], [4]]
    assert list(data.non_tensor_batch["weight"]) == [0.5, 1.0]


def test_round_trip_is_exact() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(6):
        n = int(rng.integers(4, 12))
        p = int(rng.integers(1, n - 1))
        mask = [0] * p + [int(x) for x in rng.integers(0, 2, n - p)]
        mask[p] = 1
        lps = [float(np.float32(-rng.random())) if m else 0.0 for m in mask]
        adv = [float(np.float32(rng.normal())) if m else 0.0 for m in mask]
        rows.append(
            TrainRow(
                input_ids=[int(t) for t in rng.integers(1, 50, n)],
                loss_mask=mask,
                logprobs=lps,
                advantages=adv,
                reward=float(i % 2),
                group=f"g{i // 3}",
                rollout_id=f"r{i}",
                attempt_id=f"a{i}",
                segment=i,
                weight=0.25,
                policy_versions=[i],
            )
        )
    back = dataproto_to_rows(records_to_dataproto(rows))
    assert back == rows


def test_record_objects_and_rows_agree() -> None:
    rec = _record([1, 2, 3, 4], [0, 1, 1, 1], [0, -1.0, -2.0, -3.0], 0.5, "g", "a")
    (row,) = rows_from_records([rec])
    assert row.input_ids == [1, 2, 3, 4] and row.advantages == [0.0, 0.5, 0.5, 0.5] and row.policy_versions == [3]
    per_token = rows_from_records(
        [
            {
                "input_ids": [1, 2, 3],
                "loss_mask": [0, 1, 1],
                "logprobs": [0, -1, -1],
                "advantage": [0.0, 0.2, 0.4],
                "reward": 1.0,
                "group": "g",
            }
        ]
    )
    assert per_token[0].advantages == [0.0, 0.2, 0.4]


def test_bad_records_raise() -> None:
    with pytest.raises(RecordError, match="no trained token"):
        records_to_dataproto([{"input_ids": [1, 2], "loss_mask": [0, 0], "logprobs": [0, 0], "advantage": 1.0}])
    with pytest.raises(RecordError, match="first token"):
        records_to_dataproto([{"input_ids": [1, 2], "loss_mask": [1, 1], "logprobs": [0, 0], "advantage": 1.0}])
    with pytest.raises(RecordError, match="input_ids has 3 tokens"):
        TrainRow(input_ids=[1, 2, 3], loss_mask=[0, 1], logprobs=[0, 0, 0], advantages=[0, 0, 0], reward=0, group="")
    with pytest.raises(RecordError, match="no records"):
        records_to_dataproto([])


def _finished_group(gid: str, rewards: list[float]) -> FinishedGroup:
    """A group of single-call rollouts with the given outcome rewards, as the store hands them to the trainer."""
    details = []
    for i, value in enumerate(rewards):
        rid, aid = f"{gid}-r{i}", f"{gid}-r{i}-a0"
        calls = CallsOf(aid, rid)
        calls.call([1, 2, 3, 10 + i], [50 + i, 60, 61 + i])
        attempt = AttemptRow(attempt_id=aid, rollout_id=rid, index=0, token=f"t-{aid}", status=AttemptStatus.SUCCEEDED)
        reward = Reward(rollout_id=rid, attempt_id=aid, value=value)
        rollout = Rollout(rollout_id=rid, group_id=gid, task={"q": gid}, status=RolloutStatus.SUCCEEDED)
        details.append(
            RolloutDetail(
                rollout=rollout, attempts=[AttemptDetail(attempt=attempt, calls=calls.calls, rewards=[reward])]
            )
        )
    return FinishedGroup(Group(group_id=gid, task={"q": gid}, n=len(rewards)), details)


def test_verl_batch_of_built_records_carries_uids_and_scores_and_verls_grpo_agrees() -> None:
    """Records built from finished groups → ``records_to_dataproto``: ``uid`` is the group, ``token_level_scores``
    the reward on the last trained token, so verl's own GRPO over the batch gives our advantages."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    groups = [_finished_group("g-a", [1.0, 0.0, 0.0, 1.0]), _finished_group("g-b", [2.0, 0.5, 0.0])]
    built = build_records(groups)
    data = records_to_dataproto(built.records, pad_id=0)
    nt, b = data.non_tensor_batch, data.batch
    assert list(nt["uid"]) == [r.group_id for r in built.records] == ["g-a"] * 4 + ["g-b"] * 3
    assert b["token_level_scores"].sum(-1).tolist() == [1.0, 0.0, 0.0, 1.0, 2.0, 0.5, 0.0]
    last = b["response_mask"].shape[1] - 1 - b["response_mask"].flip(-1).argmax(-1)
    assert all(b["token_level_scores"][i, last[i]] == b["token_level_scores"][i].sum() for i in range(len(data)))
    verl_adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"], index=nt["uid"]
    )
    torch.testing.assert_close(verl_adv, b["advantages"], rtol=1e-5, atol=1e-5)
    assert b["advantages"].abs().sum() > 0
