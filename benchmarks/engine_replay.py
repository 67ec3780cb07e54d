"""The embedded engine on a finished run's own calls: the train split's recorded prompts, replayed.

    python benchmarks/engine_replay.py --run-dir RUN [--baseline-root DIR] [--rollouts 1200] [--agents 64]
                                       [--threads 2] [--repeats 2]

Reads the run's train rollouts from its store (``RUN/store.db``: each rollout's calls in order, the prompt token ids
the proxy sent) and drives an ``EmbeddedEngine`` on the run's trained model (``RUN/model``) with ``--agents``
concurrent agents, each taking one rollout at a time and sending its calls in order, sampled at the run's
temperature with the run's ``max_tokens`` (what the calc agent's workers do; a group's rollouts are adjacent, so their
identical first prompts arrive together, as in RL). Prints generated tokens/s, the engine's busy seconds, the
process's CPU seconds and the prefill counters. With ``--baseline-root`` (a checkout of other code, e.g. ``git
worktree add /tmp/base REV``) every repeat runs both checkouts, alternated, each in a fresh interpreter, and prints
the ratios (this checkout over the baseline). Replies differ from the run's (new samples), so the second prompts
carry the run's replies, not the replayed ones: the load is the run's, the tokens are the engine's.

Issue 25, fourteenth round (docs/development.md): identical prompts admitted together prefill once, compaction and
merges gather rows straight into the new buffers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load_rollouts(run_dir: Path, limit: int) -> list[list[list[int]]]:
    """The first ``limit`` train rollouts of the run, each its calls' prompt ids in call order."""
    db = sqlite3.connect(f"file:{run_dir / 'store.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT c.rollout_id, c.seq, c.prompt_ids FROM calls c JOIN rollouts r ON r.rollout_id = c.rollout_id "
            "WHERE r.split = 'train' ORDER BY c.started_at"
        ).fetchall()
    finally:
        db.close()
    by_rollout: dict[str, list[tuple[int, list[int]]]] = {}
    for rollout_id, seq, blob in rows:
        by_rollout.setdefault(rollout_id, []).append((seq, list(array("i", blob))))
    rollouts = [[ids for _, ids in sorted(calls)] for calls in by_rollout.values()]
    if not rollouts:
        sys.exit(f"{run_dir}: no train calls in the store")
    return rollouts[:limit]


def child(args: argparse.Namespace) -> None:
    """One replay in this interpreter, with ``lightning_sdk`` imported from ``args.child``; prints one JSON line."""
    sys.path.insert(0, args.child)
    import resource

    from lightning_sdk.engines.base import Sampling
    from lightning_sdk.engines.embedded import EmbeddedEngine

    config = json.loads((args.run_dir / "config.json").read_text())
    rl = config.get("rl", {})
    sampling = Sampling(max_tokens=int(rl.get("max_tokens", 64)), temperature=float(rl.get("temperature", 1.0)))
    rollouts = load_rollouts(args.run_dir, args.rollouts)
    engine = EmbeddedEngine.from_pretrained(args.run_dir / "model", threads=args.threads)

    async def agent(queue: list[list[list[int]]]) -> int:
        tokens = 0
        while queue:
            for prompt in queue.pop():
                tokens += len((await engine.generate(prompt, sampling)).completion_ids)
        return tokens

    async def main() -> dict[str, Any]:
        queue = list(reversed(rollouts))  # pop() takes them in the run's order
        t0, cpu0 = time.perf_counter(), time.process_time()
        tokens = sum(await asyncio.gather(*(agent(queue) for _ in range(args.agents))))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        stats = dict(engine.stats)
        await engine.close()
        return {
            "root": args.child,
            "rollouts": len(rollouts),
            "tokens": tokens,
            "wall_s": wall,
            "cpu_s": cpu,
            "tokens_per_s": tokens / wall,
            "cpu_ms_per_token": 1000 * cpu / max(1, tokens),
            "busy_s": stats["busy_s"],
            "prefills": stats["batches"],
            "decode_steps": stats["steps"],
            "prompt_tokens": stats["prompt_tokens"],
            "reused_tokens": stats["reused_tokens"],
            "twin_tokens": stats.get("twin_tokens", 0),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }

    print(json.dumps(asyncio.run(main())))


def replay(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(root), "--run-dir", str(args.run_dir)]
    cmd += ["--rollouts", str(args.rollouts), "--agents", str(args.agents)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"the replay with {root} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def line(r: dict[str, Any]) -> str:
    computed = r["prompt_tokens"] - r["reused_tokens"] - r["twin_tokens"]
    return (
        f"{r['tokens_per_s']:7.0f} tok/s  wall {r['wall_s']:5.1f} s  cpu {r['cpu_s']:5.1f} s "
        f"({r['cpu_ms_per_token']:.2f} ms/token)  busy {r['busy_s']:5.1f} s  prefills {r['prefills']}  "
        f"decode steps {r['decode_steps']}  prompt tokens {r['prompt_tokens']} (cached {r['reused_tokens']}, "
        f"twins {r['twin_tokens']}, computed ~{computed})  rss {r['peak_rss_mb']:.0f} MB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, required=True, help="a finished `lightning-sdk train` run directory")
    ap.add_argument("--baseline-root", type=Path, default=None, help="a checkout of the code to compare against")
    ap.add_argument("--rollouts", type=int, default=1200)
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="the engine's intra-op threads")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    roots = [ROOT] + ([args.baseline_root.resolve()] if args.baseline_root else [])
    print(f"replaying {args.run_dir}: {args.rollouts} train rollouts, {args.agents} agents, {args.threads} threads")
    print(f"load average {os.getloadavg()[0]:.2f} at start")
    results: dict[Path, list[dict[str, Any]]] = {root: [] for root in roots}
    for i in range(args.repeats):
        for root in roots if i % 2 == 0 else list(reversed(roots)):
            r = replay(root, args)
            results[root].append(r)
            print(f"{'this' if root == ROOT else 'base'} {i + 1}: {line(r)}")
    if args.baseline_root:
        mine, base = results[ROOT], results[roots[1]]

        def mean(rs: list[dict[str, Any]], key: str) -> float:
            return float(sum(r[key] for r in rs)) / len(rs)

        print(
            f"this / base: tokens/s {mean(mine, 'tokens_per_s') / mean(base, 'tokens_per_s'):.2f}x, "
            f"CPU per token {mean(mine, 'cpu_ms_per_token') / mean(base, 'cpu_ms_per_token'):.2f}x "
            f"(means over {args.repeats} repeats each)"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
