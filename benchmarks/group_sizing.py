"""What sizing groups to the task (``[rl] screen_samples``) would have spent on a finished whole-group run.

    python benchmarks/group_sizing.py --run-dir RUN [--run-dir RUN2 ...]

Reads the run's ``store.db`` (every consumed train group, its rollouts in creation order and their final rewards)
and replays each group as if its first k rollouts had been generated first: a group whose first k rewards agree
stops there (screened out), any other one grows to its whole size. Prints, for k = 2..6 and for screening every
group or only the groups on a task's first run (fresh tasks; replays run whole), the rollouts spent against the
run's own, the informative groups kept (a group is informative when its rewards differ) and the rollouts spent
per informative group. The run's own figures are the baseline in the same output.

It is an offline replay of one run's rewards: it cannot say how the policy would have learned on other groups,
only what the same groups would have cost; ``benchmarks/main_job.py --set rl.screen_samples=K`` measures that.
"""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path

QUERY = """
SELECT g.group_id, g.task, (
    SELECT SUM(w.value) FROM attempts a JOIN rewards w ON w.attempt_id = a.attempt_id AND w.call_id = ''
    WHERE a.rollout_id = r.rollout_id AND a.status = 'succeeded')
FROM rollouts r JOIN groups g ON g.group_id = r.group_id
WHERE g.split = 'train' AND g.consumed_step IS NOT NULL
ORDER BY g.seq, r.seq
"""


def groups_of(db: Path) -> list[tuple[bool, list[float]]]:
    """(fresh: the task's first group in the run, final rewards in creation order) per whole consumed group."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(QUERY).fetchall()
    by_group: dict[str, tuple[str, list[float]]] = {}
    for gid, task, reward in rows:
        by_group.setdefault(gid, (task, []))[1].append(0.0 if reward is None else float(reward))
    sizes = {len(r) for _, r in by_group.values()}
    if len(sizes) > 1:
        raise SystemExit(f"{db}: groups of different sizes {sorted(sizes)}: not a whole-group run")
    seen: set[str] = set()
    out = []
    for task, rewards in by_group.values():
        out.append((task not in seen, rewards))
        seen.add(task)
    return out


def varies(rewards: list[float]) -> bool:
    return max(rewards) > min(rewards)


def report(run_dir: Path) -> None:
    groups = groups_of(run_dir / "store.db")
    if not groups:
        raise SystemExit(f"{run_dir}: no consumed train groups")
    n = len(groups[0][1])
    spent = n * len(groups)
    informative = sum(varies(r) for _, r in groups)
    fresh = sum(f for f, _ in groups)
    print(
        f"{run_dir}: {len(groups)} groups of {n} ({fresh} on fresh tasks), {informative} informative "
        f"({100 * informative / len(groups):.0f}%); {spent} rollouts, {spent / max(1, informative):.1f} per "
        f"informative group, {100 * (spent - n * informative) / spent:.0f}% of rollouts on groups that taught nothing"
    )
    for k in range(2, n - 1):
        for who in ("fresh", "all"):
            cost = kept = wasted = 0
            for is_fresh, rewards in groups:
                if (is_fresh or who == "all") and not varies(rewards[:k]):
                    cost += k
                    wasted += k
                    continue
                cost += n
                kept += varies(rewards)
                wasted += 0 if varies(rewards) else n
            print(
                f"  k={k} screening {who + ' tasks':<11} rollouts {cost / spent:.2f}x, informative groups kept "
                f"{kept / max(1, informative):.2f}x, {cost / max(1, kept):.1f} rollouts per informative group, "
                f"{100 * wasted / max(1, cost):.0f}% on groups that taught nothing"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, action="append", required=True, help="a finished whole-group run")
    for run_dir in ap.parse_args().run_dir:
        report(run_dir)


if __name__ == "__main__":
    main()
