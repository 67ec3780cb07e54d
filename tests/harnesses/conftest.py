"""Fixtures of the harness matrix: ``rig`` (parametrized: passthrough and token mode, see ``rig.py``).

Every framework is kept off the network (no telemetry, no price-map downloads, no caches outside ``tmp_path``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.policy.model import TinyPolicyConfig, build_policy
from tests.harnesses.rig import Rig, passthrough_rig, token_rig
from tests.trainer.tiny import corpus


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The frameworks come with the `harnesses` extra, not `dev`: collect these files only when `-m harness` asks."""
    markexpr = config.getoption("markexpr") or ""
    if "harness" in markexpr and "not harness" not in markexpr:
        return None
    return collection_path.name.startswith("test_")


for _k, _v in {
    "AGNO_TELEMETRY": "false",
    "HAYSTACK_TELEMETRY_ENABLED": "False",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "MSWEA_CONFIGURED": "true",
    "MSWEA_SILENT_STARTUP": "1",
    "ANONYMIZED_TELEMETRY": "False",
    "OTEL_SDK_DISABLED": "true",
}.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEngine]:
    """A small random Qwen3 with the project's tokenizer/template; 8k positions (framework prompts are long)."""
    config = TinyPolicyConfig(
        vocab_size=400, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_positions=8192, seed=0
    )
    model_dir = build_policy(tmp_path_factory.mktemp("policy") / "tiny", corpus(), config)
    engine = EmbeddedEngine.from_pretrained(model_dir, max_batch_size=8)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(params=["passthrough", "token"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    if request.param == "passthrough":
        with passthrough_rig(tmp_path) as r:
            yield r
    else:
        engine = request.getfixturevalue("tiny_engine")
        with token_rig(tmp_path, engine) as r:
            yield r
