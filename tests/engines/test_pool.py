"""Routing over several policy servers: ``Router`` (pure) and ``EnginePool`` over two real embedded engines."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from lightning_sdk.engines.base import Engine, Sampling
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.engines.pool import EnginePool, Router
from lightning_sdk.errors import EngineError
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy, load_policy

CORPUS = ["<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n"] * 10


def test_router_sticky_then_least_loaded() -> None:
    r = Router(3)
    assert [r.pick("a"), r.pick("b"), r.pick("c")] == [0, 0, 0]  # nothing in flight: lowest index
    r.inflight[0] = 2
    r.inflight[1] = 1
    assert r.pick("d") == 2 and r.pick("a") == 0  # new session to the idlest; old one stays put
    r.inflight[2] = 5
    assert r.pick(None) == 1 and r.pick("d") == 2
    r.forget("d")
    assert r.pick("d") == 1
    with pytest.raises(EngineError):
        Router(0)


def test_router_bounds_its_session_table() -> None:
    r = Router(2, max_sessions=2)
    r.pick("a")
    r.inflight[0] = 1
    assert r.pick("b") == 1
    r.pick("c")  # evicts "a", the least recently used
    r.inflight = [0, 3]
    assert r.pick("b") == 1 and r.pick("a") == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = TinyPolicyConfig(vocab_size=280, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return build_policy(tmp_path_factory.mktemp("pool-policy"), CORPUS, cfg)


async def test_pool_of_embedded_engines(model_dir: Path, tmp_path: Path) -> None:
    engines = [EmbeddedEngine(*load_policy(model_dir), device="cpu") for _ in range(2)]
    pool = EnginePool(engines)
    assert isinstance(pool, Engine)
    s = Sampling(max_tokens=4, temperature=1.0, seed=0)
    first = await asyncio.gather(
        pool.generate([5, 6, 7], s, session_id="a"), pool.generate([5, 6, 7], s, session_id="b")
    )
    again = [await pool.generate([5, 6, 7, 8], s, session_id="a") for _ in range(3)]
    streamed = [d async for d in pool.stream([5, 6, 7], s, session_id="b")]
    assert {g.meta["engine_index"] for g in first} == {0, 1}  # concurrent new sessions spread out
    assert {g.meta["engine_index"] for g in again} == {first[0].meta["engine_index"]}  # an attempt sticks
    assert first[0].completion_ids == first[1].completion_ids  # same weights, same seed
    assert [t for d in streamed for t in d.ids] == first[1].completion_ids

    # a new policy version reaches every engine of the pool
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in engines[0]._model.state_dict().items()}
    await pool.update_weights(state, version=1)
    assert pool.policy_version == 1 and [e.policy_version for e in engines] == [1, 1]
    after = await asyncio.gather(
        pool.generate([5, 6, 7], s, session_id="a"), pool.generate([5, 6, 7], s, session_id="b")
    )
    assert after[0].completion_ids == after[1].completion_ids and {g.policy_version for g in after} == {1}
    assert after[0].logprobs != first[0].logprobs
    await pool.close()
