"""LiteLLM: route ``litellm.completion`` through the attempt's endpoint.

LiteLLM picks the provider from the model name; ``openai/<model>`` with ``api_base`` and ``api_key`` sends an
OpenAI-compatible request to our proxy. (A program run as a ``CommandAgent`` gets ``OPENAI_API_BASE`` /
``OPENAI_API_KEY``, which LiteLLM's ``openai/`` models read, and ``LITELLM_PROXY_API_BASE`` /
``LITELLM_PROXY_API_KEY`` for ``litellm_proxy/`` models.)
"""

from __future__ import annotations

from typing import Any

from lightning_sdk.agent import LLM

__all__ = ["acompletion", "completion", "completion_kwargs"]


def completion_kwargs(llm: LLM) -> dict[str, Any]:
    """``model``, ``api_base`` and ``api_key`` for ``litellm.completion(**completion_kwargs(llm), messages=...)``."""
    return {"model": f"openai/{llm.model}", "api_base": llm.base_url, "api_key": llm.api_key}


def completion(llm: LLM, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """``litellm.completion`` through ``llm`` (extra keyword arguments pass through: tools, temperature, ...)."""
    import litellm

    return litellm.completion(messages=messages, **{**completion_kwargs(llm), **kwargs})


async def acompletion(llm: LLM, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    """``litellm.acompletion`` through ``llm``."""
    import litellm

    return await litellm.acompletion(messages=messages, **{**completion_kwargs(llm), **kwargs})
