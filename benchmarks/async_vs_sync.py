"""Async vs strictly synchronous training with a skewed agent latency: wall-clock ratio and learner idle fraction.

    python benchmarks/async_vs_sync.py [--steps 16] [--tasks-per-step 8] [--samples 4]

Both modes run the same training: the same policy (the default tiny one, untrained), the same train tasks, the same
number of steps, the real store, proxy, embedded engine, learner and in-process workers. Only the trainer's
pipelining differs:

- sync:  ``max_staleness = 0`` — one step's groups are enqueued, all rollouts finish, the learner trains, the next
  step's groups are enqueued (rollout, then train, then rollout);
- async: ``max_staleness = 3`` (``--staleness``) — the queue holds four steps of groups; rollouts keep flowing
  while the learner trains, and groups at most three versions old are trained.

The agent makes one real LLM call through the proxy, then waits a skewed "tool latency" (log-normal, a long tail:
most rollouts take ~0.2 s, a few take seconds) and returns a random reward, so every group has reward variance
and every step trains. Prints wall seconds per mode, the ratio, and the learner's idle fraction two ways: the
share of the loop the trainer spent waiting for finished groups (idle in the strict sense), and 1 - time in
``Learner.step`` / wall time of the RL loop (which also counts building records, checkpoints and weight publication
as idle); both also without the first step, which waits for the pipeline to fill.
Targets: async >= 1.5x faster, learner idle <= 10% (issue 14).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

import lightning_sdk as ls
from lightning_sdk.agent import WorkerPool
from lightning_sdk.cli import passive_openmp
from lightning_sdk.proxy.sampling import SplitSampling
from lightning_sdk.records import AdvantageConfig, RecordsConfig
from lightning_sdk.store import open_store

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "calc_agent"))
import tasks as calc  # noqa: E402

_client: openai.AsyncOpenAI | None = None


@ls.rollout(timeout=120)
async def skewed_agent(task: dict[str, Any], llm: ls.LLM) -> float:
    """One policy call through the proxy, then a long-tailed wait, then a random reward."""
    global _client
    if _client is None:
        _client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    client = _client.with_options(base_url=llm.base_url, api_key=llm.api_key)
    await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["question"]}],
        tools=[calc.CALCULATOR_TOOL],  # type: ignore[list-item]
        max_tokens=24,
    )
    rng = random.Random(hash(task["question"]) ^ random.getrandbits(16))
    await asyncio.sleep(min(4.0, rng.lognormvariate(-1.6, 1.0)))
    return float(rng.random() < 0.5)


async def run_mode(
    policy: Path, work: Path, *, staleness: int, steps: int, per_step: int, samples: int
) -> dict[str, float]:
    from lightning_sdk.app.loop import TrainingLoop
    from lightning_sdk.app.server import ProxyServer, bind_socket
    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.policy.model import load_policy
    from lightning_sdk.trainer.learner import Learner, LearnerConfig

    model, tokenizer = load_policy(policy)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_batch_size=256)
    learner = Learner(model, LearnerConfig(lr=1e-4))
    store = open_store(work / "store.db")
    server = ProxyServer(bind_socket("127.0.0.1", 0), "127.0.0.1")
    daemon = TrainingLoop(
        store,
        engine,
        learner,
        work,
        url=server.url,
        train_tasks=calc.make_tasks(steps * per_step * 4, "train", seed=1),
        tasks_per_step=per_step,
        samples_per_task=samples,
        max_staleness=staleness,
        records_config=RecordsConfig(advantage=AdvantageConfig(drop_zero_variance=False)),
    )
    await daemon.resume()
    train = SplitSampling({"train": {"temperature": 1.0, "max_tokens": 24}})
    await server.start(store, engine, tokenizer, admin_key=secrets.token_urlsafe(16), sampling=train)
    pool = WorkerPool(skewed_agent, store, daemon.url, n_workers=128, split="train", poll_s=0.02)
    stopping = False
    pool_task = asyncio.create_task(pool.run_until(lambda: stopping))
    t0 = time.perf_counter()
    reports = await daemon.train_steps(steps)
    wall = time.perf_counter() - t0
    stopping = True
    pool.stop(release=True)
    await pool_task
    await pool.close()
    await daemon.flush_weights()
    await server.stop()
    await engine.close()
    await store.close()
    steady = wall - (reports[0].wall_s if reports else 0.0)
    steady_busy = daemon.learner_busy_s - (reports[0].learner_s if reports else 0.0)
    return {
        "wall_s": wall,
        "learner_s": daemon.learner_busy_s,
        "idle": 1.0 - daemon.learner_busy_s / wall,
        "idle_steady": 1.0 - steady_busy / steady if steady > 0 else 0.0,
        "staleness": sum(r.staleness_mean for r in reports) / max(1, len(reports)),
        # idle in the strict sense: the learner had nothing to train and waited for finished groups
        "waiting_steady": sum(r.wait_s for r in reports[1:]) / steady if steady > 0 else 0.0,
        "wait_s": sum(r.wait_s for r in reports[1:]) / max(1, len(reports) - 1),
        "other_s": sum(r.wall_s - r.wait_s - r.learner_s for r in reports[1:]) / max(1, len(reports) - 1),
        "steps": float(len(reports)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--staleness", type=int, default=3, help="max_staleness of the async run")
    parser.add_argument(
        "--openmp-spin",
        action="store_true",
        help="keep libgomp's default spin-waiting (the lightning-sdk command makes OpenMP threads wait passively)",
    )
    args = parser.parse_args()
    if not args.openmp_spin:
        passive_openmp()  # before torch is imported, as the lightning-sdk command does
    from lightning_sdk.policy.model import build_policy
    from lightning_sdk.policy.tokenizer import build_tokenizer

    print(f"load average {os.getloadavg()[0]:.2f} at start; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bootstrap = build_tokenizer(["x"], vocab_size=300)
        demos = [calc.demonstration(t) for t in calc.make_tasks(500, "train", seed=3)]
        corpus = [str(bootstrap.apply_chat_template(d["messages"], tools=d["tools"], tokenize=False)) for d in demos]
        policy = build_policy(root / "policy", corpus)
        results = {}
        for name, staleness in (("sync", 0), ("async", args.staleness)):
            (root / name).mkdir()
            results[name] = asyncio.run(
                run_mode(
                    policy,
                    root / name,
                    staleness=staleness,
                    steps=args.steps,
                    per_step=args.tasks_per_step,
                    samples=args.samples,
                )
            )
    for name, r in results.items():
        print(
            f"{name:5s}: {r['steps']:.0f} steps in {r['wall_s']:6.1f} s, learner busy {r['learner_s']:5.1f} s, "
            f"idle {100 * r['idle']:4.1f}% (after the first step: {100 * r['idle_steady']:4.1f}%), "
            f"mean staleness {r['staleness']:.2f}; per step: waiting for groups {r['wait_s']:.2f} s, "
            f"records + checkpoint + publish {r['other_s']:.2f} s"
        )
    ratio = results["sync"]["wall_s"] / results["async"]["wall_s"]
    a = results["async"]
    print(
        f"async is {ratio:.2f}x faster than sync (target >= 1.5x); async learner idle (target <= 10%): "
        f"waiting for groups {100 * a['waiting_steady']:.1f}% of the loop once the pipeline is full; outside "
        f"Learner.step (waiting + records + checkpoint + publish) {100 * a['idle']:.1f}% of the whole loop, "
        f"{100 * a['idle_steady']:.1f}% once the pipeline is full"
    )


if __name__ == "__main__":
    main()
