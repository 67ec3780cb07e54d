"""The @rollout decorator: both forms, plain calls, and how run_attempt reports success, crash and timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

import lightning_sdk as ls
import lightning_sdk.agent as la
from lightning_sdk.agent._context import AttemptContext
from lightning_sdk.errors import ConfigError

LLM = la.LLM(base_url="http://127.0.0.1:9/v1", api_key="tok", model="m")


def _ctx() -> AttemptContext:
    return AttemptContext("at-1", "ro-1", {"q": "2+2"}, LLM)


def test_decorator_forms_keep_the_function() -> None:
    assert (ls.rollout, ls.LLM, ls.emit_reward, ls.CommandAgent) == (
        la.rollout,
        la.LLM,
        la.emit_reward,
        la.CommandAgent,
    )

    @ls.rollout
    def plain(task: dict[str, str], llm: la.LLM) -> float:
        """Docstring kept."""
        return 1.0

    @la.rollout(timeout=3.5, max_attempts=2)
    async def configured(task: dict[str, str], llm: la.LLM) -> float:
        return 2.0

    assert plain({"q": ""}, LLM) == 1.0 and plain.__doc__ == "Docstring kept." and plain.__name__ == "plain"
    assert (plain.timeout, plain.max_attempts, plain.is_async) == (None, 1, False)
    assert (configured.timeout, configured.max_attempts, configured.is_async) == (3.5, 2, True)
    assert asyncio.run(configured({"q": ""}, LLM)) == 2.0
    with pytest.raises(ConfigError):
        la.rollout(timeout=0)(lambda t, llm: None)
    with pytest.raises(ConfigError):
        la.rollout(max_attempts=0)(lambda t, llm: None)


async def test_crash_becomes_a_failed_outcome_with_the_traceback() -> None:
    @la.rollout
    def sync_crash(task: dict[str, str], llm: la.LLM) -> float:
        raise ValueError("sync boom")

    @la.rollout
    async def async_crash(task: dict[str, str], llm: la.LLM) -> float:
        raise KeyError("async boom")

    for agent, text in ((sync_crash, "ValueError: sync boom"), (async_crash, "KeyError: 'async boom'")):
        out = await agent.run_attempt(_ctx(), timeout=5)
        assert out.status == "failed"
        assert out.error is not None and text in out.error and "Traceback" in out.error


async def test_timeout_and_bad_return_values() -> None:
    @la.rollout
    def slow_sync(task: dict[str, str], llm: la.LLM) -> float:
        time.sleep(2)
        return 1.0

    @la.rollout
    async def slow_async(task: dict[str, str], llm: la.LLM) -> float:
        await asyncio.sleep(30)
        return 1.0

    @la.rollout
    def wrong(task: dict[str, str], llm: la.LLM) -> str:
        return "yes"

    for agent in (slow_sync, slow_async):
        out = await agent.run_attempt(_ctx(), timeout=0.2)
        assert out.status == "timed_out" and "timed out after 0.2 s" in (out.error or "")
    out = await wrong.run_attempt(_ctx(), timeout=5)
    assert out.status == "failed" and "return a float reward or None" in (out.error or "")


def test_llm_helpers_point_clients_at_the_endpoint() -> None:
    client = LLM.openai_client()
    aclient = LLM.async_openai_client()
    chat = LLM.langchain_chat()
    assert str(client.base_url) == "http://127.0.0.1:9/v1/" and client.api_key == "tok"
    assert str(aclient.base_url) == "http://127.0.0.1:9/v1/"
    assert chat.model_name == "m" and chat.openai_api_base == "http://127.0.0.1:9/v1"
    assert LLM.litellm_kwargs() == {"model": "openai/m", "api_base": "http://127.0.0.1:9/v1", "api_key": "tok"}
    env = LLM.env()
    assert env["OPENAI_BASE_URL"] == env["OPENAI_API_BASE"] == env["LITELLM_PROXY_API_BASE"] == "http://127.0.0.1:9/v1"
    assert env["OPENAI_API_KEY"] == env["LITELLM_PROXY_API_KEY"] == "tok" and env["OPENAI_MODEL"] == "m"
