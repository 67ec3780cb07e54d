"""Per-split sampling is the proxy's request policy, not an engine attribute flipped at run time.

One proxy in token mode serves a train attempt and an evaluation attempt at the same time on one engine; each call
gets its split's rule (``proxy/sampling.py``), whatever the agent asked: the real embedded engine (a tiny real
policy), and the vLLM and SGLang clients against loopback servers that speak their wire formats (neither runs here
without a GPU; see tests/engines/test_vllm.py and test_sglang.py for the sources of those formats). Real HTTP on
loopback, the real ``openai`` client, a real SQLite store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from lightning_sdk.engines.base import DelegatingEngine, Engine, Generation, GenerationDelta, Sampling
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.engines.sglang import SGLangEngine
from lightning_sdk.engines.vllm import VLLMEngine
from lightning_sdk.errors import ConfigError
from lightning_sdk.proxy.sampling import SplitSampling
from lightning_sdk.proxy.token_mode import TokenModeBackend, TokenModeConfig
from lightning_sdk.store.sqlite import SQLiteStore
from lightning_sdk.tokens import ChatRenderer
from tests.engines.test_sglang import FakeSGLang
from tests.engines.test_vllm import FakeVLLM
from tests.support.proxy import proxy_app
from tests.support.servers import serve_async
from tests.support.tokenizers import load_tokenizer
from tests.trainer.tiny import build_small_policy

TRAIN = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 5}
EVAL = {"temperature": 0.0, "max_tokens": 3}
RULES = SplitSampling({"train": TRAIN, "eval*": EVAL})
CALLS = 3  # per attempt


class Seen(DelegatingEngine):
    """Wraps the engine under test and keeps the ``Sampling`` each attempt's calls reached it with (by the
    ``session_id`` the proxy passes: the attempt id). The engine itself does the work."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.by_attempt: dict[str, list[Sampling]] = {}

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        self.by_attempt.setdefault(str(session_id), []).append(sampling)
        return await self.inner.generate(input_ids, sampling, session_id=session_id)

    def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        self.by_attempt.setdefault(str(session_id), []).append(sampling)
        return self.inner.stream(input_ids, sampling, session_id=session_id)

    async def update_weights(self, source: Any, version: int) -> None:
        await self.inner.update_weights(source, version)

    async def close(self) -> None:
        await self.inner.close()


async def _train_and_eval_at_once(engine: Engine, renderer: ChatRenderer, db: Path) -> dict[str, Any]:
    """A train attempt and an ``eval-before`` attempt, each making ``CALLS`` calls concurrently with the other (the
    agent asks temperature 0.5 and 50 tokens every time); returns what each attempt's calls reached the engine with
    and what the store recorded."""
    store = SQLiteStore(db)
    seen = Seen(engine)
    backend = TokenModeBackend(seen, renderer, config=TokenModeConfig(sampling=RULES))  # type: ignore[arg-type]
    app = proxy_app(store, policy_backend=backend)
    await store.enqueue([{"q": "train"}], n=1, split="train", group_ids=["g-train"])
    await store.enqueue([{"q": "eval"}], n=1, split="eval-before", group_ids=["g-eval"])
    train = await store.claim("w", split="train")
    evaluation = await store.claim("w", split="eval-before")
    assert train is not None and evaluation is not None
    try:
        async with serve_async(app) as srv:

            async def agent(name: str, token: str) -> None:
                async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=token, max_retries=0) as client:
                    for i in range(CALLS):
                        messages = [{"role": "user", "content": f"{name} question {i}"}]
                        if i == 1:  # the streamed path applies the rule too
                            stream = await client.chat.completions.create(
                                model="policy", messages=messages, temperature=0.5, max_tokens=50, stream=True
                            )
                            async for _ in stream:
                                pass
                        else:
                            await client.chat.completions.create(
                                model="policy", messages=messages, temperature=0.5, max_tokens=50
                            )
                        await asyncio.sleep(0)  # let the other attempt's call in between

            await asyncio.gather(agent("train", train.attempt.token), agent("eval", evaluation.attempt.token))
            await app.state.proxy.recorder.drain()
        recorded = {
            name: [c for a in (await store.get_rollout(claim.rollout.rollout_id)).attempts for c in a.calls]
            for name, claim in (("train", train), ("eval", evaluation))
        }
    finally:
        await store.close()
    return {
        "train": seen.by_attempt.get(train.attempt.attempt_id, []),
        "eval": seen.by_attempt.get(evaluation.attempt.attempt_id, []),
        "recorded": recorded,
    }


def _check_rules_applied(out: dict[str, Any]) -> None:
    assert len(out["train"]) == CALLS and len(out["eval"]) == CALLS
    assert {(s.temperature, s.top_p, s.max_tokens) for s in out["train"]} == {(0.7, 1.0, 5)}
    assert {(s.temperature, s.max_tokens) for s in out["eval"]} == {(0.0, 3)}
    for name, cap in (("train", 5), ("eval", 3)):
        calls = out["recorded"][name]
        assert len(calls) == CALLS and all(1 <= len(c.completion_ids) <= cap for c in calls), (
            name,
            [(len(c.completion_ids), c.error) for c in calls],
        )


async def test_concurrent_train_and_eval_attempts_on_the_embedded_engine(tmp_path: Path) -> None:
    engine = EmbeddedEngine.from_pretrained(build_small_policy(tmp_path / "policy"), max_batch_size=8)
    try:
        out = await _train_and_eval_at_once(engine, ChatRenderer(engine.tokenizer), tmp_path / "store.db")
    finally:
        await engine.close()
    _check_rules_applied(out)
    assert not hasattr(engine, "sampling_override")  # nothing on the engine decides sampling any more


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_concurrent_train_and_eval_attempts_on_a_served_engine(kind: str, tmp_path: Path) -> None:
    """The rules reach the server's wire format: vLLM's ``temperature`` / ``max_tokens``, SGLang's
    ``sampling_params.temperature`` / ``max_new_tokens`` (its fake never stops early: exactly the cap)."""
    fake = FakeVLLM(token_delay=0.002) if kind == "vllm" else FakeSGLang(token_delay=0.002)
    renderer = ChatRenderer(load_tokenizer("qwen3"))
    async with serve_async(fake.app) as server:
        engine: Engine = VLLMEngine(server.url) if kind == "vllm" else SGLangEngine(server.url)
        try:
            out = await _train_and_eval_at_once(engine, renderer, tmp_path / "store.db")
        finally:
            await engine.close()
    _check_rules_applied(out)
    for name, cap in (("train", 5), ("eval", 3)):
        assert [len(c.completion_ids) for c in out["recorded"][name]] == [cap] * CALLS
    if kind == "vllm":
        wire = sorted((b["temperature"], b["max_tokens"]) for b in fake.requests)
    else:
        wire = sorted(
            (b["sampling_params"]["temperature"], b["sampling_params"]["max_new_tokens"]) for b in fake.requests
        )
    assert wire == [(0.0, 3)] * CALLS + [(0.7, 5)] * CALLS


def test_rules_match_splits_in_order_and_cap_max_tokens() -> None:
    rules = SplitSampling({"eval-after": {"temperature": 0.2}, "eval*": EVAL, "*": {"max_tokens": 7}})
    asked = Sampling(temperature=0.5, max_tokens=2, top_p=0.9)
    assert rules.apply(asked, "eval-after").temperature == 0.2  # the first matching rule wins
    held_out = rules.apply(asked, "eval-check-3")
    assert (held_out.temperature, held_out.max_tokens, held_out.top_p) == (0.0, 2, 0.9)  # max_tokens only caps
    assert rules.apply(Sampling(max_tokens=50), "traced").max_tokens == 7
    assert rules.apply(asked, None) is asked  # a call whose split is unknown is sampled as asked
    assert SplitSampling({"train": TRAIN}).apply(asked, "eval-before") is asked
    with pytest.raises(ConfigError, match=r"temprature.*valid: .*temperature"):
        SplitSampling({"train": {"temprature": 0.0}})
