"""The warm start's supervised step under glibc's mmap thresholds: what a small policy's 8 MiB buys over 1 MiB.

    python benchmarks/warm_start_step.py [--steps 24] [--thresholds 1,8] [--threads 1,2] [--model DIR]

Builds the calc example's tiny policy (or takes ``--model``, e.g. a run's ``policy_init``), renders the example's
demonstrations as the warm start does, and runs its real supervised steps (``policy/warm_start.py``: batch 32, the
37-token shared head once, packed rows) in one child process per mmap threshold (``MALLOC_MMAP_THRESHOLD_``, two
arenas as ``lightning-sdk`` sets them), alternating the thread counts step by step. Prints, per threshold and
thread count, the median seconds per step (the first step of each count left out), and per threshold the child's
minor page faults and system CPU; ratios against the first threshold (1 MiB: what ``lightning-sdk`` used for every
policy before ``memory.tune_for_policy`` gave small ones 8 MiB) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "calc_agent"


def _demonstrations() -> list[dict[str, object]]:
    sys.path.insert(0, str(EXAMPLE))
    import tasks  # type: ignore[import-not-found]  # the example's own module

    return list(tasks.demonstrations())


def child(model_dir: str, steps: int, threads: list[int]) -> dict[str, object]:
    """Runs in the child: ``steps`` supervised steps, thread counts alternated; seconds per step by count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_sdk.policy.warm_start import WarmStartConfig, _supervised_step, render_demonstration_rows

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [
        row
        for d in _demonstrations()
        for row in render_demonstration_rows(tokenizer, d["messages"], d.get("tools"))  # type: ignore[arg-type]
    ]
    cfg = WarmStartConfig(lr=1e-3, batch_size=32, share_prefix=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    rng = random.Random(0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seconds: dict[int, list[float]] = {n: [] for n in threads}
    before = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(steps):
        n = threads[i % len(threads)]
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        _supervised_step(model, optimizer, scheduler, rows, rng, cfg, pad, torch.device("cpu"))
        seconds[n].append(time.perf_counter() - t0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "s_per_step": {str(n): statistics.median(v[1:] or v) for n, v in seconds.items()},
        "faults": after.ru_minflt - before.ru_minflt,
        "system_s": after.ru_stime - before.ru_stime,
    }


def build_model(out: Path) -> Path:
    from lightning_sdk.policy.prepare import PolicyConfig, prepare_policy

    return prepare_policy(PolicyConfig(), out, _demonstrations())  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--thresholds", default="1,8", help="mmap thresholds in MiB; the first is the baseline")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--model", help="a policy directory (default: the calc example's tiny policy, built)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = [int(n) for n in args.threads.split(",")]
    if args.child:
        print(json.dumps(child(args.child, args.steps, threads)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_model(Path(tmp)))
        results: dict[int, dict[str, object]] = {}
        for mib in [int(m) for m in args.thresholds.split(",")]:
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(mib << 20), "MALLOC_ARENA_MAX": "2"}
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
            cmd = [sys.executable, __file__, "--child", model, "--steps", str(args.steps), "--threads", args.threads]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"the {mib} MiB child failed:\n{proc.stderr[-3000:]}")
            results[mib] = json.loads(proc.stdout.strip().splitlines()[-1])
    base_mib = next(iter(results))
    base = results[base_mib]
    load = os.getloadavg()[0]
    print(f"warm-start steps of the calc example's policy, {args.steps} per threshold, load {load:.1f}")
    for mib, r in results.items():
        per = r["s_per_step"]
        assert isinstance(per, dict) and isinstance(base["s_per_step"], dict)
        cells = ", ".join(
            f"{n} thread{'s' if n != '1' else ''} {s:.3f} s/step ({base['s_per_step'][n] / s:.2f}x)"
            for n, s in per.items()
        )
        faults, system = r["faults"], r["system_s"]
        assert isinstance(faults, int) and isinstance(system, float)
        print(f"  {mib:>3} MiB: {cells}; {faults / 1e6:.2f} M page faults, system CPU {system:.1f} s")
    print(f"  (ratios: seconds at {base_mib} MiB over seconds at each threshold)")


if __name__ == "__main__":
    main()
