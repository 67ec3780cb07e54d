"""The embedded learner's step on a real run's batches, each of its speed settings as a ratio against the current
default, in one run.

    python benchmarks/learner_step.py --run-dir RUN [--steps 4] [--groups 20] [--repeats 2] [--modes a,b,...]
        [--ppo-epochs 2] [--keep-zero-variance]

Takes the finished RL groups of a real run (``RUN/store.db``, e.g. a ``lightning-sdk train examples/calc_agent`` run
directory) and its model (``RUN/model``), builds the trainer's records for batches of ``--groups`` groups that taught
something (as a step does; ``--keep-zero-variance`` keeps the others too, with advantage 0, for a run with few
informative groups: the same rows and shapes), and times ``Learner.step`` on the same batches under each mode with the
main job's learner settings (two PPO passes, temperature 0.6, 4,096-token micro-batches). Modes (each starts from
the same weights and optimizer state; modes alternate per repeat, each in a fresh thread, so that the machine's load
hits them alike and torch's per-thread settings do not leak):

- ``whole``: every row computed whole (``share_prefix = 0``);
- ``separate``: the shared prompt, pi_old from a separate no-grad pass (the code before ``reuse_first_pass``);
- ``default``: ``LearnerConfig()``'s defaults (packed rows where the model supports them);
- ``padded`` / ``padbf16`` / ``padt1``: the defaults with ``pack = false`` (the padded rows before packing; fp32,
  bf16, one thread);
- ``bf16``: the defaults with ``precision = "bf16"`` (autocast);
- ``t1`` / ``t2``: the defaults with ``threads = 1`` / ``2``; ``bf16t1``: bf16 on one thread;
- ``fused``: the defaults with torch's fused AdamW kernel (``fused=True``) instead of its per-tensor loop;
- ``allcols``: the defaults with the output head and softmax over every column, prompt included (the code before
  ``keep_from``: the learner now starts them at the micro-batch's first trained token);
- ``compile`` / ``bf16compile``: the model wrapped by ``torch.compile(dynamic=True)`` (fp32 / bf16); its compile
  time is inside the first repeat's seconds (the later repeats reuse torch's compile cache of this process).

Prints seconds per step (wall, and the process's CPU seconds: on a loaded machine the CPU seconds a step costs
vary less than its wall time) and the ratios against ``separate`` (the code before this round), tokens through
the model,
and for each mode the largest loss difference and the relative difference of the whole update (the weights' change
over all steps) against ``separate``: an exact change should be ~1e-6, bf16 within the tolerance the tests state.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import lightning_sdk.trainer.learner as learner_module
from lightning_sdk.policy.model import load_policy
from lightning_sdk.records import AdvantageConfig, RecordsConfig, build_records
from lightning_sdk.records.record import Record
from lightning_sdk.store import load_groups, open_store
from lightning_sdk.trainer.learner import Learner, LearnerConfig, cpu_has_bf16, train_batch
from lightning_sdk.types import FinishedGroup

MODES: dict[str, dict[str, Any]] = {
    "whole": {"share_prefix": 0, "reuse_first_pass": False, "precision": "fp32"},
    "separate": {"reuse_first_pass": False, "precision": "fp32"},
    "default": {},
    "padded": {"pack": False},
    "padbf16": {"pack": False, "precision": "bf16"},
    "padt1": {"pack": False, "threads": 1},
    "bf16": {"precision": "bf16"},
    "t1": {"threads": 1},
    "t2": {"threads": 2},
    "bf16t1": {"precision": "bf16", "threads": 1},
    "fused": {"_fused_adamw": True},
    "compile": {"_compile": True},
    "bf16compile": {"precision": "bf16", "_compile": True},
    "allcols": {"_all_columns": True},
}
BEFORE = "separate"


def batches(run_dir: Path, steps: int, groups: int, keep_zero_variance: bool) -> list[list[Record]]:
    async def load() -> list[FinishedGroup]:
        store = open_store(run_dir / "store.db")
        try:
            return await load_groups(store, split="train")
        finally:
            await store.close()

    finished = asyncio.run(load())
    config = RecordsConfig(advantage=AdvantageConfig(drop_zero_variance=not keep_zero_variance))
    out: list[list[Record]] = []
    taught: list[FinishedGroup] = []
    for group in finished:
        if build_records([group], config).records:
            taught.append(group)
        if len(taught) == groups:
            out.append(build_records(taught, config).records)
            taught = []
        if len(out) == steps:
            break
    if not out:
        sys.exit(f"fewer than {groups} groups that taught something in {run_dir / 'store.db'}")
    return out


def in_thread(fn: Any) -> Any:
    """Run ``fn()`` in a fresh thread (torch's thread count is per thread) and return its result."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join()
    return box[0]


def time_mode(
    model: torch.nn.Module, config: LearnerConfig, work: list[list[Record]], hooks: dict[str, Any]
) -> tuple[tuple[float, float], list[float], dict[str, torch.Tensor]]:
    learner = Learner(copy.deepcopy(model), config)  # type: ignore[arg-type]
    if hooks.get("_fused_adamw"):
        cfg = learner.config
        learner.optimizer = torch.optim.AdamW(
            learner.trainable(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True
        )
        learner.scheduler = torch.optim.lr_scheduler.LambdaLR(learner.optimizer, learner._lr_factor)
    if hooks.get("_compile"):
        learner.model = torch.compile(learner.model, dynamic=True)  # type: ignore[assignment]
    first = learner_module.first_trained
    if hooks.get("_all_columns"):
        learner_module.first_trained = lambda _mask: 0  # type: ignore[assignment]
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        losses = [learner.step(records)["loss"] for records in work]
        seconds = (time.perf_counter() - t0) / len(work)
        cpu_s = (time.process_time() - c0) / len(work)
    finally:
        learner_module.first_trained = first
    # a compiled model's state_dict names its tensors under ``_orig_mod.``: the plain module's names
    plain = getattr(learner.model, "_orig_mod", learner.model)
    return (seconds, cpu_s), losses, {k: v.detach().clone() for k, v in plain.state_dict().items()}


def model_tokens(config: LearnerConfig, model: torch.nn.Module, records: list[Record]) -> int:
    learner = Learner(model, config)  # type: ignore[arg-type]
    batch = train_batch(records)
    lengths = batch.attention_mask.sum(-1).tolist()
    total = 0
    for rows, prefix in learner._pieces(batch.input_ids, batch.attention_mask):
        total += sum(int(lengths[r]) for r in rows) - (len(rows) - 1) * prefix
    return total


def update_difference(start: dict[str, torch.Tensor], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|(b - start) - (a - start)| / |a - start| over all weights: how far update b is from update a."""
    num = sum(float(((b[k] - a[k]).double() ** 2).sum()) for k in start if start[k].is_floating_point())
    den = sum(float(((a[k] - start[k]).double() ** 2).sum()) for k in start if start[k].is_floating_point())
    return (num / max(den, 1e-30)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4, help="learner steps per mode and repeat")
    parser.add_argument("--groups", type=int, default=20, help="groups per step (groups that taught something)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="whole,separate,default,bf16,t1,t2", help=f"of {', '.join(MODES)}")
    parser.add_argument("--ppo-epochs", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--keep-zero-variance", action="store_true")
    args = parser.parse_args()
    names = [m for m in args.modes.split(",") if m]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        sys.exit(f"unknown modes {unknown}; valid: {', '.join(MODES)}")
    if BEFORE not in names:
        names.insert(0, BEFORE)
    work = batches(args.run_dir, args.steps, args.groups, args.keep_zero_variance)
    model, _ = load_policy(args.run_dir / "model")
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    base = {
        "lr": 1e-4,
        "warmup_steps": 5,
        "micro_batch_tokens": args.micro_batch_tokens,
        "ppo_epochs": args.ppo_epochs,
        "temperature": 0.6,
    }
    modes = {
        name: LearnerConfig(**{**base, **{k: v for k, v in MODES[name].items() if not k.startswith("_")}})
        for name in names
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    cpu: dict[str, list[float]] = {name: [] for name in modes}
    losses: dict[str, list[float]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, config in modes.items():
            (seconds, cpu_s), losses[name], weights[name] = in_thread(
                lambda c=config, n=name: time_mode(model, c, work, {k: v for k, v in MODES[n].items() if k[0] == "_"})
            )
            times[name].append(seconds)
            cpu[name].append(cpu_s)
        load.append(os.getloadavg()[0])
    rows = sum(len(r) for r in work) / len(work)
    print(
        f"{len(work)} steps of {rows:.0f} rows ({args.groups} groups, ppo_epochs {args.ppo_epochs}) from "
        f"{args.run_dir}; torch threads {torch.get_num_threads()}; cpu bf16: {cpu_has_bf16()}; load "
        f"{min(load):.1f}-{max(load):.1f}; {args.repeats} repeats alternated, medians"
    )
    before = statistics.median(times[BEFORE])
    before_cpu = statistics.median(cpu[BEFORE])
    for name, config in modes.items():
        tokens = statistics.mean(model_tokens(config, model, r) for r in work)
        median = statistics.median(times[name])
        median_cpu = statistics.median(cpu[name])
        loss_diff = max(abs(a - b) for a, b in zip(losses[BEFORE], losses[name], strict=True))
        upd = update_difference(start, weights[BEFORE], weights[name])
        print(
            f"  {name:11s} {median:6.2f} s/step {before / median:5.2f}x, CPU {median_cpu:6.2f} s/step "
            f"{before_cpu / median_cpu:5.2f}x vs {BEFORE}  {tokens:6.0f} tokens/step  "
            f"loss diff {loss_diff:.1e}  update diff {upd:.1e}  (all: {', '.join(f'{t:.2f}' for t in times[name])})"
        )


if __name__ == "__main__":
    main()
