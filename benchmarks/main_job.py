"""The main job, timed: ``lightning-sdk train examples/calc_agent``, its time to +30 points and where the time went.

    python benchmarks/main_job.py [--output DIR] [--set rl.replay_share=0 ...] [--example DIR]   # runs the command
    python benchmarks/main_job.py --run-dir DIR                                  # reads a finished run

Runs the real command in a subprocess (peak RSS from the child's rusage: the largest process; and the peak of all
its processes together, sampled: ``TreeMemory``), then reads the run's own
``summary.json`` and ``metrics.jsonl`` and prints:

- the whole command's wall time, held-out success before/after (n = 200) and the time to +30 points: when the
  held-out check that met the target ended (``timeline.target_reached_s``), or the end of the final evaluation if
  that one met it;
- the phases: start-up (policy built, proxy up), warm start, evaluations (before, target checks, after), RL, and
  saving the model;
- the RL steps from the learner's side: waiting for groups (learner idle: the first three steps, the two after each
  held-out check and the others; and the share counting the evaluation before RL, when the learner cannot train
  yet), building records, the learner's update, checkpoint + consume, weight publication; beside them the engine's
  generation time and the CPU of the event-loop thread (proxy, store, in-process agents), which run concurrently;
- wasted generation: the share of generated groups that taught nothing (zero reward variance, dropped as stale,
  or screened out at their first rollouts: ``rl.screen_samples``), the same share of the rollouts and of the
  generated tokens (what the run spent on them), the rollouts and tokens spent per group that taught, and how many
  groups were replays of informative tasks;
- the machine's load average at start and end (the figures are only comparable at similar load).

``--set KEY=VALUE`` passes config overrides (``rl.replay_share=0``, ``rl.target_gain=null``...) to compare variants.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "calc_agent"


def run(out: Path, overrides: list[str], example: Path = EXAMPLE) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "lightning_sdk", "train", str(example), "--output", str(out)]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree = TreeMemory(proc.pid)
    tree.start()
    try:
        _, stderr = proc.communicate()
    finally:
        tree.stop()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"the command failed ({proc.returncode}):\n{stderr[-3000:]}")
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {
        "wall_s": wall,
        "peak_rss_mb": peak_kb / 1024,
        "peak_tree_mb": tree.peak_mb,
        "load_start": load0,
        "load_end": os.getloadavg()[0],
    }


class TreeMemory:
    """The peak memory of a process and all its descendants together, sampled every ``every_s`` from Linux's /proc.

    The rusage peak is the largest single process's: a run with ``learner.process = true`` has a learner child beside
    the main process, and the two together are what the machine must hold. Each process counts its proportional set
    size (``Pss`` of ``smaps_rollup``: a page shared by n processes counts 1/n in each), so the libraries and the
    pages a child shares with its parent are not counted twice as a plain sum of resident sets would."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak_mb: float | None = None  # None: /proc not readable here (not Linux)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tree-memory", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(self.every_s):
            self.sample()

    def processes(self) -> list[int]:
        """The process and its living descendants (parent links read from /proc/PID/stat)."""
        parents: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry))
        tree, i = [self.pid], 0
        while i < len(tree):
            tree.extend(parents.get(tree[i], []))
            i += 1
        return tree

    def sample(self) -> tuple[float, float] | None:
        """One sample: (proportional set sizes, resident sets) of the tree summed, in MB; None without /proc."""
        if not os.path.isdir("/proc"):
            return None
        pss = rss = 0
        for pid in self.processes():
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            pss += int(line.split()[1])
                        elif line.startswith("Rss:"):
                            rss += int(line.split()[1])
            except (OSError, ValueError):  # gone meanwhile, or no smaps_rollup (kernels before 4.14)
                continue
        now = pss / 1024, rss / 1024
        if pss and (self.peak_mb is None or now[0] > self.peak_mb):
            self.peak_mb = now[0]
        return now


def cpu_line() -> str:
    """``lscpu``'s model name, family and model, and the flags that decide the learner's kernels (the figures depend
    on the CPU)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "cpu: (lscpu unavailable)"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile"]
    have = [f for f in wanted if f in flags]
    # the family and model tell apart CPUs of one name ("AMD EPYC": family 25 model 1 is AVX2-only, model 17 has
    # AVX-512 BF16), whose figures differ by a third
    kind = ", ".join(f"{k.lower()} {fields[k].strip()}" for k in ("CPU family", "Model") if k in fields)
    name = fields.get("Model name", "?").strip() + (f" ({kind})" if kind else "")
    return f"cpu: {name}, {os.cpu_count()} CPUs; flags: {' '.join(have) or 'none'}"


def report(run_dir: Path, measured: dict[str, Any] | None) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = run_dir / "metrics.jsonl"  # absent when RL ran no step (the budget went on the warm start)
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    before, after = summary["eval_before"]["success_rate"], summary["eval_after"]["success_rate"]
    tl: dict[str, float] = summary.get("timeline") or {}
    rl = summary.get("rl") or {}
    checks = rl.get("checks") or []
    wall = measured["wall_s"] if measured else summary["wall_s"]
    gain = after - before
    print(f"run: {run_dir}")
    print(cpu_line())
    if summary.get("stopped_short"):
        print(f"stopped short: {summary['stopped_short']}")
    if summary.get("balance"):
        b = summary["balance"]
        print(
            f"learner threads: {b['learner_threads']}, engine threads: {b.get('engine_threads')} "
            f"(pipeline rates by learner+engine threads, trained tokens/s: {b['rates']})"
        )
        if b.get("moved"):
            m = b["moved"]
            print(
                f"  moved from {m['from']} to {m['to']} after step {m['after_step']}: the learner waited "
                f"{100 * m['learner_idle_share']:.0f}% of {m['steps_watched']} steps"
            )
    if measured:
        print(
            f"load average: {measured['load_start']:.2f} at start, {measured['load_end']:.2f} at end "
            f"({os.cpu_count()} CPUs)"
        )
        tree = measured.get("peak_tree_mb")
        together = "" if tree is None else f"; all its processes together {tree:.0f} MB (proportional sets, sampled)"
        print(f"peak RSS: {measured['peak_rss_mb']:.0f} MB (the largest process){together}")
    print(
        f"command: {wall:.0f} s; held-out success {100 * before:.1f}% -> {100 * after:.1f}% "
        f"({100 * gain:+.1f} points, n = {summary['eval_after']['n']}); {summary['steps']} RL steps"
    )
    if "target_reached_s" in tl:
        steps_list = ", ".join(f"{c['step']} ({c.get('why', '?')})" for c in checks)  # why each check came
        reached_s = tl["target_reached_s"]
        print(f"time to +30: {reached_s:.0f} s (held-out check at step {checks[-1]['step']}; checks: {steps_list})")
    elif gain >= 0.30:
        end = tl.get("eval_after_end_s", summary["wall_s"])
        print(f"time to +30: {end:.0f} s (the final evaluation; RL ran to its budget)")
    else:
        print("time to +30: not reached")

    ws = (summary.get("warm_start") or {}).get("wall_s", 0.0)
    ev_before = summary["eval_before"].get("wall_s", 0.0)
    # the final evaluation is the last target check when a target is set (counted there), else eval-after
    last_is_check = str(summary["eval_after"].get("split", "")).startswith("eval-check")
    ev_after = 0.0 if "target_reached_s" in tl or last_is_check else summary["eval_after"].get("wall_s", 0.0)
    ev_checks = sum(c["wall_s"] for c in checks)
    rl_wall = rl.get("wall_s", 0.0) - ev_checks
    startup = tl.get("startup_s")
    print("phases (s):")
    if startup is not None:
        print(f"  start-up {startup:.1f}")
    print(f"  warm start {ws:.1f}")
    print(
        f"  evaluations {ev_before + ev_checks + ev_after:.1f} (before {ev_before:.1f}, "
        f"{len(checks)} target checks {ev_checks:.1f}, after {ev_after:.1f})"
    )
    print(f"  RL {rl_wall:.1f}")
    if startup is not None:
        rest = summary["wall_s"] - startup - ws - ev_before - ev_checks - ev_after - rl_wall
        print(f"  other (loading tasks and agent, saving the model, summary) {rest:.1f}")

    def total(key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) if vals else None

    steps_wall = total("wall_s") or 0.0
    print(f"RL steps ({len(rows)}, {steps_wall:.1f} s), the learner's side:")
    for key, label in (
        ("wait_s", "waiting for groups (learner idle)"),
        ("records_s", "records + batch"),
        ("learner_s", "learner update"),
        ("save_s", "checkpoint + consume"),
        ("publish_s", "weight publication"),
    ):
        v = total(key)
        share = f" ({100 * v / steps_wall:.0f}%)" if v is not None and steps_wall else ""
        print(f"  {label:<36} {'n/a' if v is None else f'{v:.1f}'}{share}")
        if key == "wait_s" and v is not None and steps_wall:
            idle_breakdown(rows, checks, v, steps_wall, ev_before, tl)
        cpu = total("thread_cpu_s")
        if key == "learner_s" and v and cpu is not None:
            # the step's own thread's CPU (trainer/learner.py): the rest of its wall time it waited for a core or,
            # in one process with the engine and the event loop, for Python's interpreter lock
            share = f"{100 * cpu / v:.0f}%"
            print(f"    of which the step's thread on a CPU {cpu:.1f} ({share}; else waiting for a core or the lock)")
    print("  concurrently:")
    for key, label in (("engine_busy_s", "generation (engine thread busy)"), ("loop_cpu_s", "proxy/store/agents CPU")):
        v = total(key)
        print(f"  {label:<36} {'n/a' if v is None else f'{v:.1f}'}")
    tokens = sum(r.get("tokens_per_s", 0.0) * r.get("wall_s", 0.0) for r in rows)
    print(f"  generated tokens {tokens:.0f} ({tokens / max(steps_wall, 1e-9):.0f}/s over the RL steps)")
    decode, prefills = total("engine_decode_steps"), total("engine_prefills")
    if decode:  # runs before the counters have neither
        busy, cpu = total("engine_busy_s") or 0.0, total("engine_cpu_s")
        passes = decode + (prefills or 0)
        print(
            f"  engine forward passes: {decode:.0f} decode (mean batch {tokens / decode:.1f} rows), "
            f"{prefills or 0:.0f} prefill; {1e3 * busy / passes:.1f} ms busy a pass"
            + (f", its thread on a CPU {1e3 * cpu / passes:.1f} ms of it" if cpu else "")
        )

    trained = sum(r["groups"] for r in rows)
    stale = sum(r["dropped_stale"] for r in rows)
    zero = sum(r["zero_variance_groups"] for r in rows)
    screened = sum(r.get("screened_groups", 0) for r in rows)
    generated = trained + stale + screened
    fresh = total("fresh_groups")

    def pct(part: float, whole: float) -> str:
        return f"{100 * part / max(1, whole):.0f}%"

    print(
        f"groups: {generated} generated, {zero} zero reward variance ({pct(zero, generated)}), "
        f"{stale} dropped stale ({pct(stale, generated)}), {screened} screened out at their first rollouts "
        f"({pct(screened, generated)}): {pct(zero + stale + screened, generated)} taught nothing"
        + (f"; {trained - fresh:.0f} of the trained were replays" if fresh is not None else "")
    )
    rollouts, wasted = total("rollouts"), total("wasted_rollouts")
    taught = generated - zero - stale - screened
    if rollouts:  # runs before these counters: groups only
        toks, wasted_toks = total("generated_tokens") or 0.0, total("wasted_tokens") or 0.0
        print(
            f"generation on groups that taught nothing: {wasted:.0f} of {rollouts:.0f} rollouts "
            f"({pct(wasted or 0.0, rollouts)}), {wasted_toks:.0f} of {toks:.0f} generated tokens "
            f"({pct(wasted_toks, toks)}); spent per group that taught: {rollouts / max(1, taught):.1f} rollouts, "
            f"{toks / max(1, taught):.0f} tokens"
        )
    if (run_dir / "store.db").exists():  # what the policy still gets wrong (benchmarks/calc_errors.py)
        spec = importlib.util.spec_from_file_location("calc_errors", Path(__file__).with_name("calc_errors.py"))
        assert spec is not None and spec.loader is not None
        calc_errors = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(calc_errors)
        print("held-out failures by kind (benchmarks/calc_errors.py):")
        print(calc_errors.report(run_dir, examples=0, ends_only=True))


def idle_breakdown(
    rows: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    waited: float,
    steps_wall: float,
    ev_before: float,
    tl: dict[str, float],
) -> None:
    """Where the learner's wait went: the first steps (the pipeline filling: each needs a batch generated after
    the previous step's weights), the two steps after each held-out check (RL generation paused for it), the rest
    (a learner step shorter than generating the next batch); and the idle share counting the evaluation before RL,
    during which the learner cannot train (the baseline is measured on the starting weights) and, with ``[rl]
    generate_during_eval``, the first groups are generated."""
    first = sum(r["wait_s"] for r in rows[:3])
    after_check = {c["step"] + k for c in checks for k in (1, 2)}
    post = sum(r["wait_s"] for r in rows[3:] if r["step"] in after_check)
    parts = " + ".join(f"{r['wait_s']:.1f}" for r in rows[:3])
    print(
        f"    of which: first 3 steps {first:.1f} ({parts}), "
        f"2 steps after each held-out check {post:.1f}, other steps {waited - first - post:.1f}"
    )
    overlap = tl.get("eval_before_end_s", 0.0) - tl.get("rl_workers_start_s", tl.get("eval_before_end_s", 0.0))
    print(
        f"    counting the evaluation before RL ({ev_before:.1f} s"
        + (f", train rollouts generated during its {overlap:.1f} s" if "rl_workers_start_s" in tl else "")
        + f"): {100 * (waited + ev_before) / (steps_wall + ev_before):.0f}% idle"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, help="report on a finished run instead of running the command")
    ap.add_argument("--output", type=Path, help="run directory (default: a temporary one)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    ap.add_argument("--example", type=Path, default=EXAMPLE, help="example directory (default: examples/calc_agent)")
    args = ap.parse_args()
    if args.run_dir:
        report(args.run_dir, None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = args.output or Path(tmp) / "run"
        measured = run(out, args.set, args.example.resolve())
        report(out, measured)


if __name__ == "__main__":
    main()
