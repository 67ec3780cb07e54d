"""Our training records as verl ``DataProto`` batches, and back. The one place where the two layouts meet.

A record is one token sequence with a loss mask over the whole of it (multi-turn: the model's completions are 1,
the tool results and user turns between them are 0). verl lays a row out as a left-padded *prompt* followed by a
right-padded *response*, with ``response_mask`` over the response only. We split each record at its first trained
token: everything before it is the prompt, everything from it on is the response (later context tokens stay in the
response with mask 0, which is verl's own multi-turn agent-loop convention). Shapes, with P the longest prompt and
R the longest response of the batch::

    prompts            (B, P)      left-padded with pad_id
    responses          (B, R)      right-padded with pad_id
    input_ids          (B, P+R)    prompts ++ responses
    attention_mask     (B, P+R)    1 on real tokens
    position_ids       (B, P+R)    cumsum(attention_mask) - 1, clipped at 0
    response_mask      (B, R)      our loss mask over the response span
    rollout_log_probs  (B, R)      the engine's log-probs (0 where the mask is 0)
    advantages         (B, R)      our per-token advantages (0 where the mask is 0)
    returns            (B, R)      the same as advantages (outcome-reward estimators have no critic)
    token_level_scores (B, R)      the reward on the last trained token, 0 elsewhere (verl's convention)
    token_level_rewards(B, R)      the same as token_level_scores (no KL-in-reward)
    non_tensor_batch   uid (group), rollout_id, attempt_id, segment, weight

``records_to_dataproto`` builds it, ``dataproto_to_rows`` reads it back (the round trip is exact and tested).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lightning_sdk.errors import RecordError

__all__ = ["TrainRow", "dataproto_to_rows", "records_to_dataproto", "rows_from_records"]


@dataclass(frozen=True)
class TrainRow:
    """One record in the plain shape the verl side needs (lists, equal lengths checked).

    ``advantages`` is per token; a scalar record advantage is broadcast over the trained tokens.
    """

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    advantages: list[float]
    reward: float
    group: str
    rollout_id: str = ""
    attempt_id: str = ""
    segment: int = 0
    weight: float = 1.0
    policy_versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lengths = {"loss_mask": len(self.loss_mask), "logprobs": len(self.logprobs), "advantages": len(self.advantages)}
        bad = {k: v for k, v in lengths.items() if v != n}
        if bad:
            raise RecordError(f"record {self.attempt_id}/{self.segment}: input_ids has {n} tokens but {bad}")

    @property
    def prompt_len(self) -> int:
        """Tokens before the first trained one (verl's prompt)."""
        for i, m in enumerate(self.loss_mask):
            if m:
                return i
        return len(self.loss_mask)


def _per_token(advantage: Any, mask: Sequence[int]) -> list[float]:
    if isinstance(advantage, int | float):
        return [float(advantage) if m else 0.0 for m in mask]
    values = [float(a) for a in advantage]
    return [a if m else 0.0 for a, m in zip(values, mask, strict=False)] + values[len(mask) :]


def _row_from_mapping(row: Mapping[str, Any]) -> TrainRow:
    """An exported record row (the contract columns of ARCHITECTURE.md)."""
    mask = [int(m) for m in row["loss_mask"]]
    return TrainRow(
        input_ids=[int(t) for t in row["input_ids"]],
        loss_mask=mask,
        logprobs=[float(x) for x in row["logprobs"]],
        advantages=_per_token(row["advantage"], mask),
        reward=float(row.get("reward", 0.0)),
        group=str(row.get("group", "")),
        rollout_id=str(row.get("rollout_id", "")),
        attempt_id=str(row.get("attempt_id", "")),
        segment=int(row.get("segment", 0)),
        weight=float(row.get("weight", 1.0)),
        policy_versions=[int(v) for v in row.get("policy_versions", [])],
    )


def _row_from_object(rec: Any) -> TrainRow:
    """A ``lightning_sdk.records.Record`` (segment + group_id + per-token advantages + weight)."""
    seg = rec.segment
    mask = [int(m) for m in np.asarray(seg.loss_mask).tolist()]
    return TrainRow(
        input_ids=[int(t) for t in np.asarray(seg.input_ids).tolist()],
        loss_mask=mask,
        logprobs=[float(x) for x in np.asarray(seg.logprobs).tolist()],
        advantages=_per_token(np.asarray(rec.advantages).tolist(), mask),
        reward=float(rec.reward),
        group=str(rec.group_id),
        rollout_id=str(seg.rollout_id),
        attempt_id=str(seg.attempt_id),
        segment=int(seg.index),
        weight=float(getattr(rec, "weight", 1.0)),
        policy_versions=list(seg.policy_versions),
    )


def rows_from_records(records: Iterable[Any]) -> list[TrainRow]:
    """Normalise records (``Record`` objects, exported row dicts, or ``TrainRow``) to ``TrainRow``."""
    rows: list[TrainRow] = []
    for rec in records:
        if isinstance(rec, TrainRow):
            rows.append(rec)
        elif isinstance(rec, Mapping):
            rows.append(_row_from_mapping(rec))
        elif hasattr(rec, "segment"):
            rows.append(_row_from_object(rec))
        else:
            raise RecordError(f"cannot read a training record from {type(rec).__name__}")
    return rows


def records_to_dataproto(records: Iterable[Any], *, pad_id: int = 0, max_prompt_len: int | None = None) -> Any:
    """Build verl's ``DataProto`` from our records (see the module docstring for the layout).

    A record with no trained token, or whose first token is trained (verl needs a prompt of at least one token),
    raises ``RecordError``. ``max_prompt_len`` keeps only the last tokens of longer prompts (left truncation).
    """
    from verl import DataProto

    rows = rows_from_records(records)
    if not rows:
        raise RecordError("no records to train on")
    splits: list[int] = []
    for r in rows:
        p = r.prompt_len
        if p == len(r.input_ids):
            raise RecordError(f"record {r.attempt_id}/{r.segment} has no trained token")
        if p == 0:
            raise RecordError(f"record {r.attempt_id}/{r.segment} trains its first token (no prompt to condition on)")
        splits.append(p)
    prompt_cut = [max(0, p - max_prompt_len) if max_prompt_len else 0 for p in splits]
    plen = max(p - c for p, c in zip(splits, prompt_cut, strict=True))
    rlen = max(len(r.input_ids) - p for r, p in zip(rows, splits, strict=True))
    b = len(rows)

    prompts = torch.full((b, plen), pad_id, dtype=torch.long)
    responses = torch.full((b, rlen), pad_id, dtype=torch.long)
    attention = torch.zeros((b, plen + rlen), dtype=torch.long)
    response_mask = torch.zeros((b, rlen), dtype=torch.long)
    rollout_lp = torch.zeros((b, rlen), dtype=torch.float32)
    advantages = torch.zeros((b, rlen), dtype=torch.float32)
    scores = torch.zeros((b, rlen), dtype=torch.float32)
    for i, (r, p, cut) in enumerate(zip(rows, splits, prompt_cut, strict=True)):
        prompt = r.input_ids[cut:p]
        resp = r.input_ids[p:]
        n = len(resp)
        prompts[i, plen - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention[i, plen - len(prompt) : plen] = 1
        responses[i, :n] = torch.tensor(resp, dtype=torch.long)
        attention[i, plen : plen + n] = 1
        mask = torch.tensor(r.loss_mask[p:], dtype=torch.long)
        response_mask[i, :n] = mask
        rollout_lp[i, :n] = torch.tensor(r.logprobs[p:], dtype=torch.float32) * mask
        advantages[i, :n] = torch.tensor(r.advantages[p:], dtype=torch.float32) * mask
        last = int(torch.nonzero(mask).max())
        scores[i, last] = r.reward
    position_ids = torch.clip(torch.cumsum(attention, dim=-1) - 1, min=0)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_lp,
        "advantages": advantages,
        "returns": advantages.clone(),
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
    }
    non_tensors = {
        "uid": np.array([r.group for r in rows], dtype=object),
        "rollout_id": np.array([r.rollout_id for r in rows], dtype=object),
        "attempt_id": np.array([r.attempt_id for r in rows], dtype=object),
        "segment": np.array([r.segment for r in rows], dtype=object),
        "weight": np.array([r.weight for r in rows], dtype=object),
        "policy_versions": np.array([list(r.policy_versions) for r in rows] + [None], dtype=object)[:-1],
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"pad_id": pad_id})


def dataproto_to_rows(data: Any) -> list[TrainRow]:
    """Read ``TrainRow``s back from a ``DataProto`` built by ``records_to_dataproto`` (the inverse, for checks)."""
    batch = data.batch
    nt = data.non_tensor_batch
    plen = batch["prompts"].shape[1]
    rows: list[TrainRow] = []
    for i in range(len(data)):
        att = batch["attention_mask"][i]
        p_ids = batch["prompts"][i][att[:plen].bool()].tolist()
        n = int(att[plen:].sum())
        r_ids = batch["responses"][i][:n].tolist()
        mask = [0] * len(p_ids) + batch["response_mask"][i][:n].tolist()
        rows.append(
            TrainRow(
                input_ids=p_ids + r_ids,
                loss_mask=mask,
                logprobs=[0.0] * len(p_ids) + batch["rollout_log_probs"][i][:n].tolist(),
                advantages=[0.0] * len(p_ids) + batch["advantages"][i][:n].tolist(),
                reward=float(batch["token_level_scores"][i].sum()),
                group=str(nt["uid"][i]),
                rollout_id=str(nt["rollout_id"][i]),
                attempt_id=str(nt["attempt_id"][i]),
                segment=int(nt["segment"][i]),
                weight=float(nt["weight"][i]),
                policy_versions=list(nt["policy_versions"][i]),
            )
        )
    return rows
