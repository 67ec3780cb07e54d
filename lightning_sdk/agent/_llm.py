"""``LLM``: where an agent sends its model calls — a base URL, a key (the attempt token) and a model name.

During training a worker builds one per attempt (``base_url`` = the proxy's ``/v1``, ``api_key`` = the attempt's
bearer token, ``model`` = the policy's name), so every call the agent makes is traced under that attempt. Outside
training the user builds one pointing anywhere (``LLM(base_url="https://api.openai.com/v1", api_key=..., model=...)``)
and the agent runs as plain code.

The helpers build the common clients already pointed at it; each framework is imported only when its helper is
called, so none of them is a dependency of the package.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # pragma: no cover - typing only
    import openai

__all__ = ["LLM"]


class LLM(BaseModel):
    """An OpenAI-compatible endpoint: ``base_url`` (ends in ``/v1``), ``api_key`` and ``model``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str
    api_key: str
    model: str = "policy"
    fallback_urls: tuple[str, ...] = ()
    """More base URLs of the same service (proxies that share one store): ``async_openai_client`` fails over to
    them when ``base_url`` cannot be reached or dies mid-call."""

    @classmethod
    def from_env(cls, *, model: str | None = None) -> LLM:
        """The endpoint named by ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``OPENAI_MODEL`` (what a command agent
        is given), for running a decorated agent by hand."""
        base = os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE") or "https://api.openai.com/v1"
        return cls(
            base_url=base,
            api_key=os.environ.get("OPENAI_API_KEY", ""),
            model=model or os.environ.get("OPENAI_MODEL", "policy"),
        )

    def env(self) -> dict[str, str]:
        """The environment variables that point common harnesses at this endpoint (OpenAI SDK, LiteLLM, ...)."""
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_BASE": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "OPENAI_MODEL": self.model,
            "LITELLM_PROXY_API_BASE": self.base_url,
            "LITELLM_PROXY_API_KEY": self.api_key,
        }

    def async_openai_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client for this endpoint (extra keyword arguments go to the client).

        Unless ``http_client`` is given, its requests go through ``Http1Transport`` (the proxy's pooled HTTP/1.1
        client under httpx's API): ~10x less client CPU a request than httpx's own transport on plain HTTP, which
        is what many agents in one process on a small machine pay for (``agent/_transport.py``)."""
        import openai

        if "http_client" not in kwargs:
            from lightning_sdk.agent._transport import openai_http_client

            kwargs["http_client"] = openai_http_client((self.base_url, *self.fallback_urls))
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)
        return _with_idempotency_keys(client)

    def openai_client(self, **kwargs: Any) -> openai.OpenAI:
        """A sync ``openai.OpenAI`` client for this endpoint (extra keyword arguments go to the client)."""
        import openai

        return _with_idempotency_keys(openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs))

    def langchain_chat(self, **kwargs: Any) -> Any:
        """A LangChain ``ChatOpenAI`` for this endpoint (needs ``langchain-openai``)."""
        try:
            from langchain_openai import ChatOpenAI
        except ImportError as exc:  # pragma: no cover - depends on the environment
            from lightning_sdk.errors import ConfigError

            raise ConfigError("LLM.langchain_chat() needs langchain-openai: pip install langchain-openai") from exc
        return ChatOpenAI(base_url=self.base_url, api_key=self.api_key, model=self.model, **kwargs)

    def litellm_kwargs(self) -> dict[str, str]:
        """Keyword arguments for ``litellm.completion`` that route through this endpoint (``openai/<model>``)."""
        return {"model": f"openai/{self.model}", "api_base": self.base_url, "api_key": self.api_key}


IDEMPOTENCY_HEADER = "Idempotency-Key"

_C = TypeVar("_C")


def _with_idempotency_keys(client: _C) -> _C:
    """``client`` sending an ``Idempotency-Key`` with every call: one key per logical call, the same on the SDK's
    own retries. The OpenAI (and Anthropic) SDKs make that key already (``stainless-python-retry-<uuid>``, kept
    across their retries) but send it only when the client names a header, which theirs do not
    (``_idempotency_header = None``): naming ours makes a call the SDK retries (a timeout, a 5xx, a proxy killed
    after it committed the call) one record in the store, not two (``Call.idempotency_key``)."""
    if hasattr(client, "_idempotency_header"):
        client._idempotency_header = IDEMPOTENCY_HEADER
    return client
