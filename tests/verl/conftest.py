"""Fixtures of the verl tests: the project's tiny Qwen2 policy (built from a config, no download) and records."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from lightning_sdk.policy.model import TinyPolicyConfig, build_policy

CORPUS = [
    "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n",
    "<|im_start|>user\nWhat is 3 * 4?<|im_end|>\n<|im_start|>assistant\n12<|im_end|>\n",
    "<|im_start|>system\nYou are a calculator.<|im_end|>\n<|im_start|>user\nadd 1 and 2<|im_end|>\n",
] * 20


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~100k-parameter Qwen2 policy with the project's BPE tokenizer and chat template, saved as an HF dir."""
    out = tmp_path_factory.mktemp("tiny-policy")
    cfg = TinyPolicyConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
    return build_policy(out, CORPUS, cfg)


PROMPTS = ["What is 12 + 7?", "What is 3 * 4?", "add 1 and 2"]


def render(tok: Any, prompt: str) -> list[int]:
    """The user turn rendered with the policy's chat template, as token ids."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def sample_rows(model_dir: Path, *, group_size: int = 3, max_tokens: int = 8, seed: int = 0) -> list[Any]:
    """Roll out the tiny policy with the real embedded engine and turn the samples into training rows.

    Prompts are rendered with the policy's chat template; every completion keeps the engine's exact ids and
    log-probs; the reward is a fixed function of the ids (so groups differ); advantages are our GRPO.
    """
    from lightning_sdk.engines.base import Sampling
    from lightning_sdk.engines.embedded import EmbeddedEngine
    from lightning_sdk.policy.model import load_policy
    from lightning_sdk.records.advantages import AdvantageConfig, AdvantageInput, compute_advantages
    from lightning_sdk.trainer.verl.batch import TrainRow

    model, tok = load_policy(model_dir)
    engine = EmbeddedEngine(model, tok, device="cpu")

    async def roll() -> list[tuple[int, list[int], Any]]:
        jobs = []
        for g, prompt in enumerate(PROMPTS):
            ids = render(tok, prompt)
            for k in range(group_size):
                sampling = Sampling(max_tokens=max_tokens, temperature=1.0, seed=seed * 100 + g * 10 + k)
                jobs.append((g, list(ids), engine.generate(list(ids), sampling)))
        gens = await asyncio.gather(*(j[2] for j in jobs))
        await engine.close()
        return [(g, ids, gen) for (g, ids, _), gen in zip(jobs, gens, strict=True)]

    samples = asyncio.run(roll())
    rewards = [float(sum(gen.completion_ids) % 3 == 0) for _, _, gen in samples]
    adv = compute_advantages(
        AdvantageInput.of(rewards, [g for g, _, _ in samples], [len(gen.completion_ids) for _, _, gen in samples]),
        AdvantageConfig(estimator="grpo"),
    )
    rows = []
    for (g, ids, gen), r, a in zip(samples, rewards, adv, strict=True):
        n = len(gen.completion_ids)
        rows.append(
            TrainRow(
                input_ids=ids + gen.completion_ids,
                loss_mask=[0] * len(ids) + [1] * n,
                logprobs=[0.0] * len(ids) + gen.logprobs,
                advantages=[0.0] * len(ids) + [float(a)] * n,
                reward=r,
                group=f"task-{g}",
                policy_versions=[gen.policy_version or 0],
            )
        )
    return rows
