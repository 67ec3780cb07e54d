"""What the calc policy gets wrong: each held-out evaluation of a calc-example run, its failures by kind.

    python benchmarks/calc_errors.py RUN_DIR [--examples 3]

Reads ``RUN_DIR/store.db`` (read-only): every rollout of the ``eval-*`` splits, its task and its recorded calls, and
sorts each rollout into one kind:

- ``ok``: rewarded;
- ``no tool call``: the first reply called no tool;
- ``bad arguments``: the call's arguments are not JSON with an ``expression``;
- ``malformed``: the expression is not ``a op b``;
- ``wrong op`` / ``swapped`` / ``wrong digits``: the expression differs from the task's by its operator, by its
  operands' order, or by an operand's digits;
- ``right expression, wrong answer``: the right call, then a final answer that is not the tool's result.

Issue 25 (the main job's learning per step) asks where RL's steps go; the run of 2026-12-06 (``docs/development.md``,
tenth round) found most failures are copying errors (an operand's digits, or the tool's result), not the operation.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

_EXPR = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


def kind_of(task: dict[str, Any], reward: float | None, calls: list[dict[str, Any]]) -> str:
    """The failure kind of one rollout (``ok`` when rewarded)."""
    if reward == 1.0:
        return "ok"
    if not calls:
        return "no call recorded"
    message = calls[0].get("response", {}).get("choices", [{}])[0].get("message", {})
    tool_calls = message.get("tool_calls") or []
    if not tool_calls:
        return "no tool call"
    try:
        expression = str(json.loads(tool_calls[0]["function"]["arguments"])["expression"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return "bad arguments"
    if expression.replace(" ", "") == task["expression"]:
        return "right expression, wrong answer"
    got, want = _EXPR.match(expression), _EXPR.match(task["expression"])
    if got is None or want is None:
        return "malformed"
    if got.group(2) != want.group(2):
        return "wrong op"
    if (got.group(1), got.group(3)) == (want.group(3), want.group(1)):
        return "swapped"
    return "wrong digits"


def _split_order(split: str) -> tuple[int, int]:
    if split == "eval-before":
        return (0, 0)
    number = re.search(r"(\d+)$", split)
    return (1, int(number.group(1)) if number else 0)


def report(run_dir: Path, examples: int = 3, ends_only: bool = False) -> str:
    """The failure kinds of every held-out evaluation (``ends_only``: the one before RL and the last), each with
    up to ``examples`` questions per kind."""
    db = sqlite3.connect(f"file:{run_dir / 'store.db'}?mode=ro", uri=True)
    rows = db.execute(
        "SELECT r.rollout_id, r.split, g.task FROM rollouts r JOIN groups g ON g.group_id = r.group_id "
        "WHERE r.split LIKE 'eval-%'"
    ).fetchall()
    if not rows:
        raise SystemExit(f"{run_dir}: no held-out evaluation in store.db")
    rewards = dict(db.execute("SELECT rollout_id, value FROM rewards").fetchall())
    calls: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for rollout_id, body in db.execute(
        "SELECT rollout_id, body FROM calls WHERE rollout_id IN "
        "(SELECT rollout_id FROM rollouts WHERE split LIKE 'eval-%') ORDER BY rollout_id, seq"
    ):
        calls[rollout_id].append(json.loads(body) if body else {})
    kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    seen: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for rollout_id, split, task_json in rows:
        task = json.loads(task_json)
        kind = kind_of(task, rewards.get(rollout_id), calls[rollout_id])
        kinds[split][kind] += 1
        if kind != "ok" and examples > 0 and len(seen[(split, kind)]) < examples:
            seen[(split, kind)].append(task["question"])
    lines = []
    splits = sorted(kinds, key=_split_order)
    if ends_only and len(splits) > 2:
        splits = [splits[0], splits[-1]]
    for split in splits:
        counts = kinds[split]
        n = sum(counts.values())
        parts = ", ".join(f"{k} {v}" for k, v in counts.most_common())
        lines.append(f"{split} (n = {n}, {100 * counts['ok'] / n:.1f}% ok): {parts}")
        for (s, kind), questions in seen.items():
            if s == split:
                lines.append(f"    {kind}: {'; '.join(questions)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--examples", type=int, default=3, help="questions shown per failure kind")
    args = ap.parse_args()
    print(report(args.run_dir, args.examples))


if __name__ == "__main__":
    main()
