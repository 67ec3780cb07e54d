"""The embedded learner's step with and without the shared prompt computed once per group (``share_prefix``).

    python benchmarks/learner_step.py --run-dir RUN [--steps 6] [--groups 9] [--repeats 2]

Takes the finished RL groups of a real run (``RUN/store.db``, e.g. a ``lightning-sdk train examples/calc_agent`` run
directory) and its model (``RUN/model``), builds the trainer's records for batches of ``--groups`` groups that taught
something (as a step does), and times ``Learner.step`` on the same batches with ``share_prefix = 0`` (every row
computed whole) and the default (the rows of a group share their prompt's forward pass). Prints seconds per step,
tokens through the model per step, the ratio, and the largest difference in loss between the two (they compute the
same update). Each mode starts from the same weights and optimizer state; modes alternate per repeat so that the
machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lightning_sdk.policy.model import load_policy
from lightning_sdk.records import AdvantageConfig, RecordsConfig, build_records
from lightning_sdk.records.record import Record
from lightning_sdk.store import load_groups, open_store
from lightning_sdk.trainer.learner import Learner, LearnerConfig, train_batch
from lightning_sdk.types import FinishedGroup


def batches(run_dir: Path, steps: int, groups: int) -> list[list[Record]]:
    async def load() -> list[FinishedGroup]:
        store = open_store(run_dir / "store.db")
        try:
            return await load_groups(store, split="train")
        finally:
            await store.close()

    finished = asyncio.run(load())
    config = RecordsConfig(advantage=AdvantageConfig(drop_zero_variance=True))
    out: list[list[Record]] = []
    for start in range(0, len(finished), groups):
        records = build_records(finished[start : start + groups], config).records
        if records:
            out.append(records)
        if len(out) == steps:
            break
    if not out:
        sys.exit(f"no trained records in {run_dir / 'store.db'}")
    return out


def time_mode(model: torch.nn.Module, config: LearnerConfig, work: list[list[Record]]) -> tuple[float, list[float]]:
    learner = Learner(copy.deepcopy(model), config)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    losses = [learner.step(records)["loss"] for records in work]
    return (time.perf_counter() - t0) / len(work), losses


def model_tokens(config: LearnerConfig, model: torch.nn.Module, records: list[Record]) -> int:
    learner = Learner(model, config)  # type: ignore[arg-type]
    batch = train_batch(records)
    lengths = batch.attention_mask.sum(-1).tolist()
    total = 0
    for rows, prefix in learner._pieces(batch.input_ids, batch.attention_mask):
        total += sum(int(lengths[r]) for r in rows) - (len(rows) - 1) * prefix
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6, help="learner steps per mode and repeat")
    parser.add_argument("--groups", type=int, default=9, help="groups per step (groups that taught something)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    args = parser.parse_args()
    work = batches(args.run_dir, args.steps, args.groups)
    model, _ = load_policy(args.run_dir / "model")
    base = {"lr": 1e-4, "warmup_steps": 5, "micro_batch_tokens": args.micro_batch_tokens}
    modes = {"whole rows": LearnerConfig(share_prefix=0, **base), "shared prompt": LearnerConfig(**base)}
    times: dict[str, list[float]] = {name: [] for name in modes}
    losses: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, config in modes.items():
            seconds, losses[name] = time_mode(model, config, work)
            times[name].append(seconds)
    rows = sum(len(r) for r in work) / len(work)
    print(
        f"{len(work)} steps of {rows:.0f} rows ({args.groups} groups) from {args.run_dir}; torch threads "
        f"{torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}"
    )
    baseline = statistics.median(times["whole rows"])
    for name, config in modes.items():
        tokens = statistics.mean(model_tokens(config, model, r) for r in work)
        median = statistics.median(times[name])
        print(f"  {name:14s} {median:6.2f} s/step  {tokens:7.0f} tokens through the model  {baseline / median:5.2f}x")
    diff = max(abs(a - b) for a, b in zip(losses["whole rows"], losses["shared prompt"], strict=True))
    print(f"  largest loss difference between the modes over {len(work)} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
