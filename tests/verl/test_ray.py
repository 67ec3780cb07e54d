"""The verl backend on a local Ray cluster (2 CPUs): two FSDP ranks as Ray actors, rows sampled by the embedded
engine (standing in for SGLang, which needs a GPU), one update, then the new weights published to the engine.

Two data-parallel ranks must produce the update a single rank produces on the same rows (verl normalises the
token-mean loss by the global token count), so the Ray path is checked against the in-process one.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from lightning_sdk.engines.base import Sampling
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.engines.launch import ManagedServer, free_port, launch_on_ray, launch_server
from lightning_sdk.engines.sglang import SGLangEngine
from lightning_sdk.policy.model import load_policy
from lightning_sdk.trainer.verl.backend import RayRanks, VerlBackend
from lightning_sdk.trainer.verl.batch import TrainRow, records_to_dataproto
from lightning_sdk.trainer.verl.config import VerlConfig
from lightning_sdk.trainer.verl.step import shard_tensordicts
from tests.verl.conftest import render, sample_rows


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _logprobs(backend: VerlBackend, rows: list[TrainRow]) -> torch.Tensor:
    data = records_to_dataproto(rows)
    data.meta_info["temperature"] = 1.0
    world = backend.ranks.world_size
    pad = (-len(data)) % world
    if pad:
        from verl.protocol import pad_dataproto_to_divisor

        data, _ = pad_dataproto_to_divisor(data, world)
    parts = backend.ranks.call("compute_log_prob", shard_tensordicts(data, world))
    width = max(p.shape[1] for p in parts)
    out = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
    return out[: len(rows)]


def test_two_ray_ranks_update_like_one_rank_and_publish(ray_cluster: None, tiny_model_dir: Path) -> None:
    rows = sample_rows(tiny_model_dir, seed=5)  # 9 rows: the Ray path pads to 10 with a row that trains nothing
    cfg = VerlConfig(model_dir=str(tiny_model_dir), device="cpu", lr=5e-3, n_gpus=2)
    backend = VerlBackend(cfg)
    local = VerlBackend(cfg.model_copy(update={"n_gpus": 1}), use_ray=False)
    try:
        assert isinstance(backend.ranks, RayRanks) and backend.ranks.world_size == 2
        metrics = backend.step(rows)
        ref = local.step(rows)
        assert metrics["step/rows"] == 9.0 and backend.version == 1
        assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
        mask = records_to_dataproto(rows).batch["response_mask"].bool()
        torch.testing.assert_close(_logprobs(backend, rows)[mask], _logprobs(local, rows)[mask], atol=1e-4, rtol=1e-4)

        model, tok = load_policy(tiny_model_dir)
        engine = EmbeddedEngine(model, tok, device="cpu")
        prompt = render(tok, "add 1 and 2")

        async def publish_and_sample() -> list[float]:
            await backend.publish(engine)
            gen = await engine.generate(prompt, Sampling(max_tokens=5, temperature=1.0, seed=1))
            await engine.close()
            assert gen.policy_version == 1
            row = TrainRow(
                input_ids=prompt + gen.completion_ids,
                loss_mask=[0] * len(prompt) + [1] * len(gen.completion_ids),
                logprobs=[0.0] * len(prompt) + gen.logprobs,
                advantages=[0.0] * (len(prompt) + len(gen.completion_ids)),
                reward=0.0,
                group="g",
            )
            trainer_lp = _logprobs(backend, [row])[0, : len(gen.completion_ids)]
            torch.testing.assert_close(trainer_lp, torch.tensor(gen.logprobs), atol=2e-4, rtol=1e-4)
            return gen.logprobs

        asyncio.run(publish_and_sample())
        assert engine.policy_version == 1
    finally:
        backend.shutdown()
        local.shutdown()


def fake_sglang_launcher(model_path: str, *, host: str = "127.0.0.1", timeout: float = 60.0) -> ManagedServer:
    """Stands in for ``launch_sglang`` inside a Ray actor: the wire-format fake of tests/engines/test_sglang.py as
    a real child process (SGLang itself needs a GPU)."""
    script = Path(__file__).resolve().parents[1] / "engines" / "test_sglang.py"
    port = free_port()
    cmd = [sys.executable, str(script), "--port", str(port), "--host", host]
    return launch_server(cmd, port=port, host=host, env={"PYTHONPATH": str(script.parents[2])}, timeout=timeout)


def test_servers_placed_by_ray_serve_the_engine_client(ray_cluster: None) -> None:
    """``launch_on_ray``: one placement-group bundle per server (CPU-only here), each server started by its Ray
    actor on that node, reached at the node's IP; attempts spread over them; ``stop`` ends them."""
    servers = launch_on_ray(fake_sglang_launcher, "/unused", n_servers=2, gpus_per_server=0, cpus_per_server=0.5)
    try:
        assert len(servers.urls) == 2 and len(set(servers.urls)) == 2

        async def call() -> list[str]:
            engine = SGLangEngine(servers.urls)
            try:
                gens = await asyncio.gather(
                    engine.generate([4, 5], Sampling(max_tokens=3), session_id="a"),
                    engine.generate([4, 5], Sampling(max_tokens=3), session_id="b"),
                )
                assert gens[0].completion_ids == gens[1].completion_ids and len(gens[0].completion_ids) == 3
                return [g.meta["server"] for g in gens]
            finally:
                await engine.close()

        assert sorted(asyncio.run(call())) == sorted(servers.urls)
    finally:
        servers.stop()
    with pytest.raises(httpx.HTTPError):
        httpx.get(servers.urls[0] + "/health", timeout=2.0)
