"""What the run viewer shows, read from a run directory and its store: plain dicts, one bounded read at a time.

    RUN_DIR/summary.json, metrics.jsonl     ─▶ ``RunData.overview`` (curves, steps, held-out checks)
    store: list_group_details, a page at a time ─▶ ``rollouts_page`` (filters applied page by page; a request reads
                                                 at most ``max_reads`` pages of groups, then hands back a cursor)
    store: get_rollout + its group's page   ─▶ ``rollout`` (calls as a conversation; records built with
                                                 ``lightning_sdk.records``: tokens with mask, log-prob, advantage
                                                 and policy version)
    every group page, streamed              ─▶ ``fidelity`` (split reasons, failed and truncated calls; memory
                                                 bounded by a page, the totals cached until the store changes)

Records are built here the way ``lightning-sdk records`` builds them (every succeeded attempt, zero-variance groups
included with advantage 0), with the run's ``[rl] estimator``; advantages are those of the rollout's group (what a
group-wise estimator trains; a batch-wide one, e.g. ``reinforce_plus_plus_baseline``, is approximated by the page).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_sdk.errors import ConfigError
from lightning_sdk.records import AdvantageConfig, RecordsConfig, build_records
from lightning_sdk.records.build import RolloutReport
from lightning_sdk.records.record import Record
from lightning_sdk.store.base import Store
from lightning_sdk.types import AttemptDetail, AttemptStatus, Call, FinishedGroup, RolloutDetail, RolloutStatus

__all__ = ["GROUPS_PER_READ", "RolloutFilter", "RunData", "conversation", "open_run", "status_filter"]

logger = logging.getLogger(__name__)

GROUPS_PER_READ = 32
"""Groups per store read of the rollouts table (one ``list_group_details`` page)."""

_MAX_TOKENS_SHOWN = 4096  # per record: a longer one is shown up to here, and says so
_MAX_LISTED = 50  # failed calls / truncated segments listed by the fidelity report


@dataclass(frozen=True, slots=True)
class RolloutFilter:
    """The rollouts table's filters (all optional): split, group id (substring), status, reward range."""

    split: str | None = None
    group: str | None = None
    status: RolloutStatus | None = None
    reward_min: float | None = None
    reward_max: float | None = None

    def keeps(self, row: dict[str, Any]) -> bool:
        if self.group and self.group not in row["group"]:
            return False
        if self.status is not None and row["status"] != self.status.value:
            return False
        reward = row["reward"]
        if self.reward_min is not None and (reward is None or reward < self.reward_min):
            return False
        return not (self.reward_max is not None and (reward is None or reward > self.reward_max))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return rows


def _split_cursor(after: str | None) -> tuple[str | None, int]:
    """The table's cursor: the store's group cursor, and ``~N`` when the page it starts is resumed at its N-th
    matching row."""
    if not after:
        return None, 0
    base, sep, skip = after.rpartition("~")
    if not sep:
        return after, 0
    if not skip.isdigit():
        raise ConfigError(f"after: not a cursor of this table: {after!r}")
    return base or None, int(skip)


def _attempt_reward(att: AttemptDetail) -> float | None:
    if not att.rewards:
        return None
    return float(sum(r.value for r in att.rewards))


def _shown_attempt(detail: RolloutDetail) -> AttemptDetail | None:
    """The succeeded attempt, else the last one."""
    for att in detail.attempts:
        if att.attempt.status == AttemptStatus.SUCCEEDED:
            return att
    return detail.attempts[-1] if detail.attempts else None


def _row(detail: RolloutDetail, split: str, rep: RolloutReport | None) -> dict[str, Any]:
    att = _shown_attempt(detail)
    reward = rep.reward if rep is not None and rep.reward is not None else (_attempt_reward(att) if att else None)
    calls = [c for a in detail.attempts for c in a.calls]
    return {
        "rollout_id": detail.rollout.rollout_id,
        "group": detail.rollout.group_id,
        "split": split,
        "status": detail.rollout.status.value,
        "attempts": len(detail.attempts),
        "calls": len(calls),
        "failed_calls": sum(1 for c in calls if c.error),
        "reward": reward,
        "trained": bool(rep and rep.trained),
        "tokens_trained": rep.tokens_trained if rep else 0,
        "segments": rep.segments if rep else 0,
        "split_reasons": dict(rep.split_reasons) if rep else {},
        "note": rep.note if rep else None,
    }


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "\n".join(str(p.get("text", p)) if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content)


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        return {"role": "?", "content": str(m), "tool_calls": []}
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function", {}) if isinstance(tc, dict) else {}
        calls.append({"name": fn.get("name", ""), "arguments": str(fn.get("arguments", ""))})
    return {"role": str(m.get("role", "?")), "content": _message_text(m.get("content")), "tool_calls": calls}


def _reply(call: Call) -> dict[str, Any] | None:
    choices = call.response.get("choices") if isinstance(call.response, dict) else None
    if not choices:
        return None
    first = choices[0]
    if "message" in first:
        return _message(first["message"])
    return {"role": "assistant", "content": str(first.get("text", "")), "tool_calls": []}


def _render_split_reason(call: Call) -> str | None:
    render = call.checks.get("render")
    reason = render.get("split_reason") if isinstance(render, dict) else None
    return str(reason) if reason else None


def conversation(calls: Sequence[Call]) -> list[dict[str, Any]]:
    """One entry per call in ``seq`` order: the messages it added to what the call before it saw and said (all of
    them when its context is not an extension: ``context_changed``), and the reply."""
    out: list[dict[str, Any]] = []
    seen: list[Any] = []
    for call in sorted(calls, key=lambda c: (c.seq, c.started_at)):
        messages = call.request.get("messages")
        if not isinstance(messages, list):
            prompt = call.request.get("prompt")
            messages = [] if prompt is None else [{"role": "prompt", "content": _message_text(prompt)}]
        extends = len(messages) >= len(seen) and messages[: len(seen)] == seen
        new = messages[len(seen) :] if extends else messages
        reply = _reply(call)
        out.append(
            {
                "call_id": call.call_id,
                "seq": call.seq,
                "model": call.model,
                "is_policy": call.is_policy,
                "token_source": call.token_source,
                "policy_version": call.policy_version,
                "finish_reason": call.finish_reason,
                "prompt_tokens": len(call.prompt_ids),
                "completion_tokens": len(call.completion_ids),
                "error": call.error,
                "split_reason": _render_split_reason(call),
                "context_changed": bool(seen) and not extends,
                "messages": [_message(m) for m in new],
                "reply": reply,
            }
        )
        seen = list(messages)
        if isinstance(call.response, dict) and call.response.get("choices"):
            msg = call.response["choices"][0].get("message")
            if isinstance(msg, dict):
                seen.append({k: v for k, v in msg.items() if v is not None})
    return out


class _FileTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library (imports in milliseconds, unlike transformers),
    decoding special tokens too: the viewer shows every token the model saw."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


class RunData:
    """A run directory (``summary.json``, ``metrics.jsonl``, ``config.json``, the model) and its ``store``."""

    def __init__(
        self,
        run_dir: str | Path,
        store: Store,
        *,
        tokenizer_dir: str | Path | None = None,
        tokenizer: Any = None,
        max_reads: int = 8,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.store = store
        self.max_reads = max_reads
        self._tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
        self._tokenizer: Any = tokenizer
        self._tokenizer_tried = tokenizer is not None
        self._fidelity: tuple[Any, dict[str, Any]] | None = None

    # -- the run's files ---------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        cfg = _read_json(self.run_dir / "config.json")
        return cfg if isinstance(cfg, dict) else {}

    def records_config(self) -> RecordsConfig:
        rl = self.config().get("rl") or {}
        return RecordsConfig(advantage=AdvantageConfig(estimator=str(rl.get("estimator", "grpo"))))

    def tokenizer_dir(self) -> Path | None:
        """The tokenizer to decode with: the one given, else the trained model, the policy the run started from, or
        the configured model directory."""
        if self._tokenizer_dir is not None:
            return self._tokenizer_dir
        summary = _read_json(self.run_dir / "summary.json") or {}
        policy = str((self.config().get("policy") or {}).get("model", ""))
        for cand in (summary.get("model_dir"), self.run_dir / "model", self.run_dir / "policy_init", policy):
            if cand and (Path(cand) / "tokenizer.json").exists():
                return Path(cand)
        return None

    def tokenizer(self) -> Any:
        """A decoder of single ids (``decode([id])``), loaded once; None when the run has no tokenizer."""
        if not self._tokenizer_tried:
            self._tokenizer_tried = True
            path = self.tokenizer_dir()
            if path is not None:
                try:
                    self._tokenizer = _FileTokenizer(path / "tokenizer.json")
                except Exception as exc:  # a broken model dir: show ids instead of text, and say so
                    logger.warning("the viewer cannot load the tokenizer in %s (%s): showing token ids", path, exc)
        return self._tokenizer

    def overview(self) -> dict[str, Any]:
        """The summary (None while the run is going), the steps of ``metrics.jsonl`` and the held-out points."""
        summary = _read_json(self.run_dir / "summary.json")
        steps = _read_jsonl(self.run_dir / "metrics.jsonl")
        state = _read_json(self.run_dir / "state.json") or {}
        source = summary if isinstance(summary, dict) else state
        heldout = []
        for key in ("eval_before", "eval_after"):
            ev = source.get(key) if isinstance(source, dict) else None
            if isinstance(ev, dict) and ev.get("success_rate") is not None:
                heldout.append({"label": key.removeprefix("eval_"), **ev})
        checks = ((source.get("rl") or {}).get("checks") or []) if isinstance(source, dict) else []
        return {
            "name": self.config().get("name") or self.run_dir.name,
            "run_dir": str(self.run_dir),
            "summary": summary if isinstance(summary, dict) else None,
            "steps": steps,
            "heldout": heldout,
            "checks": checks,
        }

    # -- the store ---------------------------------------------------------------------------------------------
    async def rollouts_page(
        self, filters: RolloutFilter, after: str | None = None, *, limit: int = 50
    ) -> dict[str, Any]:
        """Rows of the rollouts table from ``after`` on: whole group pages are read (``GROUPS_PER_READ`` groups
        each) until ``limit`` rows matched or ``max_reads`` pages were read; ``next`` resumes (None at the end).
        Each row carries ``page``, the cursor its group's page was read from (the rollout page reads it again)."""
        rows: list[dict[str, Any]] = []
        cursor, skip = _split_cursor(after)
        reads, groups = 0, 0
        config = self.records_config()
        while reads < self.max_reads:
            page_from = cursor
            page, cursor = await self.store.list_group_details(
                split=filters.split, limit=GROUPS_PER_READ, after=page_from
            )
            reads += 1
            groups += len(page)
            reports = {r.rollout_id: r for r in build_records(page, config).reports}
            matched = [
                {**row, "page": page_from or ""}
                for fg in page
                for row in (_row(d, fg.group.split, reports.get(d.rollout.rollout_id)) for d in fg.rollouts)
                if filters.keeps(row)
            ][skip:]
            room = limit - len(rows)
            if len(matched) > room:  # the next request resumes inside this page
                rows += matched[:room]
                return {
                    "rollouts": rows,
                    "next": f"{page_from or ''}~{skip + room}",
                    "groups_read": groups,
                    "reads": reads,
                }
            rows += matched
            skip = 0
            if cursor is None or len(rows) == limit:
                break
        return {"rollouts": rows, "next": cursor, "groups_read": groups, "reads": reads}

    async def _group_of(self, detail: RolloutDetail, page: str | None) -> FinishedGroup | None:
        """The rollout's group with every rollout: from the page the table read it from, else by scanning the
        rollout's split a page at a time."""
        gid, split = detail.rollout.group_id, detail.rollout.split
        if page is not None:
            groups, _ = await self.store.list_group_details(split=split, limit=GROUPS_PER_READ, after=page or None)
            for fg in groups:
                if fg.group.group_id == gid:
                    return fg
        after: str | None = None
        while True:
            groups, after = await self.store.list_group_details(split=split, limit=GROUPS_PER_READ, after=after)
            for fg in groups:
                if fg.group.group_id == gid:
                    return fg
            if after is None:
                return None

    async def rollout(self, rollout_id: str, page: str | None = None) -> dict[str, Any]:
        """One rollout: its attempts with their calls as a conversation, rewards, and its training records token by
        token. Raises ``NotFoundError``."""
        detail = await self.store.get_rollout(rollout_id)
        group = await self._group_of(detail, page)
        result = build_records([group] if group is not None else [], self.records_config())
        rep = next((r for r in result.reports if r.rollout_id == rollout_id), None)
        records = [r for r in result.records if r.rollout_id == rollout_id]
        siblings = [] if group is None else [_row(d, group.group.split, None) for d in group.rollouts]
        by_id = {r.rollout_id: r for r in result.reports}
        for s in siblings:
            sib = by_id.get(s["rollout_id"])
            if sib is not None and sib.reward is not None:
                s["reward"] = sib.reward
        return {
            "rollout_id": rollout_id,
            "group": detail.rollout.group_id,
            "split": detail.rollout.split,
            "status": detail.rollout.status.value,
            "task": detail.rollout.task,
            "row": _row(detail, detail.rollout.split, rep),
            "report": rep.as_dict() if rep is not None else None,
            "attempts": [
                {
                    "attempt_id": a.attempt.attempt_id,
                    "index": a.attempt.index,
                    "status": a.attempt.status.value,
                    "error": a.attempt.error,
                    "trained": rep is not None and rep.trained and rep.attempt_id == a.attempt.attempt_id,
                    "rewards": [{"name": r.name, "value": r.value, "call_id": r.call_id} for r in a.rewards],
                    "conversation": conversation(a.calls),
                }
                for a in detail.attempts
            ],
            "records": [self._record(r) for r in records],
            "group_rollouts": siblings,
            "tokens_trained": sum(r.segment.n_trained for r in records),
        }

    def _record(self, rec: Record) -> dict[str, Any]:
        seg = rec.segment
        n = min(len(seg), _MAX_TOKENS_SHOWN)
        ids = [int(x) for x in seg.input_ids[:n]]
        tok = self.tokenizer()
        texts = [tok.decode([i]) for i in ids] if tok is not None else [str(i) for i in ids]
        version: list[int | None] = [None] * n
        for span in seg.spans:
            for pos in range(span.start, min(span.end, n)):
                version[pos] = span.policy_version
        tokens = [
            {
                "id": ids[i],
                "text": texts[i],
                "mask": int(seg.loss_mask[i]),
                "logprob": float(seg.logprobs[i]),
                "advantage": float(rec.advantages[i]),
                "version": version[i],
            }
            for i in range(n)
        ]
        return {
            "attempt_id": seg.attempt_id,
            "segment": seg.index,
            "split_reason": seg.split_reason,
            "truncated": seg.truncated,
            "length": len(seg),
            "tokens_trained": seg.n_trained,
            "reward": rec.reward,
            "advantage": rec.scalar_advantage() if isinstance(rec.scalar_advantage(), float) else None,
            "policy_versions": seg.policy_versions,
            "weight": rec.weight,
            "tokens": tokens,
            "cut": len(seg) > n,
        }

    async def fidelity(self) -> dict[str, Any]:
        """The fidelity report of every split: totals, split reasons, the first failed calls and truncated
        segments. Streams the store a page at a time; cached until the store's counts change."""
        key = await self.store.counts()
        if self._fidelity is not None and self._fidelity[0] == key:
            return self._fidelity[1]
        config = self.records_config()
        totals: dict[str, Any] = {
            "groups": 0,
            "rollouts": 0,
            "rollouts_trained": 0,
            "records": 0,
            "calls": 0,
            "failed_calls": 0,
            "retokenized_calls": 0,
            "text_only_calls": 0,
            "tokens": 0,
            "tokens_trained": 0,
            "truncated_segments": 0,
            "split_reasons": {},
            "by_split": {},
        }
        failed: list[dict[str, Any]] = []
        failed_calls = 0  # of every attempt (the records' stats count those of trained attempts only)
        truncated: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            page, after = await self.store.list_group_details(split=None, limit=GROUPS_PER_READ, after=after)
            result = build_records(page, config)
            _add(totals, result.summary())
            split_of = {d.rollout.rollout_id: fg.group.split for fg in page for d in fg.rollouts}
            for rep in result.reports:
                split = split_of.get(rep.rollout_id, "?")
                entry = totals["by_split"].setdefault(split, {"rollouts": 0, "trained": 0, "split_reasons": {}})
                entry["rollouts"] += 1
                entry["trained"] += int(rep.trained)
                for k, v in rep.split_reasons.items():
                    entry["split_reasons"][k] = entry["split_reasons"].get(k, 0) + v
            for fg in page:
                for d in fg.rollouts:
                    for a in d.attempts:
                        for c in a.calls:
                            failed_calls += int(bool(c.error))
                            if c.error and len(failed) < _MAX_LISTED:
                                failed.append({"rollout_id": c.rollout_id, "call_id": c.call_id, "error": c.error})
            for rec in result.records:
                if rec.segment.truncated and len(truncated) < _MAX_LISTED:
                    truncated.append({"rollout_id": rec.rollout_id, "segment": rec.segment.index, "length": len(rec)})
            if after is None:
                break
        report = {**totals, "failed_calls": failed_calls, "failed": failed, "truncated": truncated}
        self._fidelity = (key, report)
        return report


def _add(totals: dict[str, Any], part: dict[str, Any]) -> None:
    for k, v in part.items():
        if k in ("split_reasons",):
            for reason, n in v.items():
                totals[k][reason] = totals[k].get(reason, 0) + n
        elif k in totals and isinstance(v, int) and not isinstance(totals[k], dict):
            totals[k] += v


def open_run(run_dir: str | Path, *, tokenizer_dir: str | Path | None = None) -> RunData:
    """The ``RunData`` of ``RUN_DIR`` over its ``store.db`` (which must exist: the viewer never creates one)."""
    from lightning_sdk.store import open_store

    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"{path}: not a run directory")
    db = path / "store.db"
    if not db.exists():
        raise ConfigError(f"{path}: no store.db (is it the --output of lightning-sdk train or daemon?)")
    return RunData(path, open_store(db), tokenizer_dir=tokenizer_dir)


def status_filter(value: str | None) -> RolloutStatus | None:
    """A status name of the filter form (empty: any); an unknown one raises ``ConfigError`` naming the valid ones."""
    if not value:
        return None
    try:
        return RolloutStatus(value)
    except ValueError:
        valid = ", ".join(s.value for s in RolloutStatus)
        raise ConfigError(f"unknown rollout status {value!r}; valid: {valid}") from None
