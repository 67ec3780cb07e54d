"""The warm start of a job (both ``train`` and ``daemon``): supervised steps on the learner's model
(``policy/warm_start.py``, with the ``[warm_start]`` section as its config), stopped on the success measured through
the proxy on the job's validation tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_sdk.agent import Agent
from lightning_sdk.app.loop import RunStopped, never
from lightning_sdk.app.rl import evaluate
from lightning_sdk.memory import release_free_heap
from lightning_sdk.policy.warm_start import warm_start

if TYPE_CHECKING:
    from lightning_sdk.app.job import Job

__all__ = ["run_warm_start"]


async def run_warm_start(job: Job, agent: Agent, stop: Callable[[], bool] = never) -> dict[str, Any] | None:
    """Supervised steps on the learner's model, when configured and not done before (a resumed run skips it; None
    then). Every ``eval_every`` steps the engine gets the weights and the agent is evaluated on the validation tasks
    through the proxy (split ``warmup-N``: sampled as ``[eval]`` says). ``stop()`` ends it at the next supervised
    step or evaluation with ``RunStopped`` (nothing is checkpointed: a re-run warm-starts again)."""
    if not job.needs_warm_start or stop():
        return None
    job.view.set_phase("warm start")
    model = job.parts.model
    assert model is not None  # open_job checked: only the embedded backend warm-starts
    loop, workers, note, val = job.loop, job.config.eval.workers, job.view.note, job.tasks.validation
    event_loop = asyncio.get_running_loop()
    rounds = 0

    def evaluate_model(model: torch.nn.Module) -> float:  # runs in the warm start's thread
        nonlocal rounds
        rounds += 1
        # what RL publishes too (loop.weights: the merged state with LoRA, a checkpoint for a server): the model's
        # own state_dict holds PEFT's names under LoRA, which the engine's plain copy does not have. A learner kept
        # elsewhere (a child process, a Ray actor) has not seen the warm start yet: its parts name the model's own
        # weights (Parts.warm_start_weights)
        state = (job.parts.warm_start_weights or loop.weights)()

        async def go() -> float:
            await loop.engine.update_weights(state, loop.version)
            res = await evaluate(loop, agent, val, f"warmup-{rounds}", workers, stop)
            return float(res["success_rate"])

        success = asyncio.run_coroutine_threadsafe(go(), event_loop).result()
        note(f"warm start eval {rounds}: {100 * success:.1f}% on {len(val)} validation tasks")
        return success

    result = await asyncio.to_thread(
        warm_start,
        model,
        loop.engine.tokenizer,
        job.tasks.demonstrations,
        evaluate_model,
        job.config.warm_start,
        stop,
    )
    release_free_heap()  # a small policy's steps left their freed activations in the heap (memory.py)
    if result.stopped:
        raise RunStopped(loop.step)
    loop.learner.reset_optimizer()  # the supervised steps moved the weights the optimizer's moments were for
    await loop.engine.update_weights(await asyncio.to_thread(loop.weights), loop.version)
    threads = ", ".join(f"{n} from step {s}" for s, n in result.threads) or "as set"
    shared = f", shared prefix {result.shared_prefix} tokens" if job.config.warm_start.share_prefix else ""
    note(f"warm start: {result.steps} steps, {result.wall_s:.0f} s (threads: {threads}){shared}")
    return {
        "steps": result.steps,
        "success": result.success,
        "history": result.history,
        "wall_s": result.wall_s,
        "threads": result.threads,
        "shared_prefix": result.shared_prefix,
    }
