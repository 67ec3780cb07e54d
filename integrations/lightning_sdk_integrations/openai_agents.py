"""The OpenAI Agents SDK (``openai-agents``): run an ``agents.Agent`` on the attempt's endpoint.

The SDK calls the Responses API by default; our proxy serves Chat Completions, so ``model_provider(llm)`` hands
the runner ``OpenAIChatCompletionsModel`` objects built on an ``AsyncOpenAI`` client for ``llm`` (whatever model
name an ``Agent`` asks for, the call goes to ``llm.model`` unless ``keep_names=True``). ``run_config(llm)`` wraps it
in a ``RunConfig`` with the SDK's tracing export turned off (it would post traces to OpenAI)::

    result = await Runner.run(agent, task["question"], run_config=run_config(llm))
"""

from __future__ import annotations

from typing import Any

from agents import Model, ModelProvider, OpenAIChatCompletionsModel, RunConfig
from openai import AsyncOpenAI

from lightning_sdk.agent import LLM

__all__ = ["LightningModelProvider", "model_provider", "run_config"]


class LightningModelProvider(ModelProvider):
    """Chat Completions models on one ``AsyncOpenAI`` client pointed at ``llm``."""

    def __init__(self, llm: LLM, *, keep_names: bool = False, client: AsyncOpenAI | None = None) -> None:
        self.llm = llm
        self.keep_names = keep_names
        self.client = client or llm.async_openai_client()

    def get_model(self, model_name: str | None) -> Model:
        name = model_name if (self.keep_names and model_name) else self.llm.model
        return OpenAIChatCompletionsModel(model=name, openai_client=self.client)


def model_provider(llm: LLM, **kwargs: Any) -> LightningModelProvider:
    """A ``ModelProvider`` for ``RunConfig(model_provider=...)``."""
    return LightningModelProvider(llm, **kwargs)


def run_config(llm: LLM, **kwargs: Any) -> RunConfig:
    """A ``RunConfig`` that runs every agent on ``llm`` with tracing export disabled (more ``RunConfig`` fields
    may be passed)."""
    kwargs.setdefault("tracing_disabled", True)
    return RunConfig(model_provider=model_provider(llm), **kwargs)
