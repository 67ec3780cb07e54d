"""Route model names that are not the policy to external providers through LiteLLM; trace them, never train them.

A judge, a teacher or a hosted model being traced for data: the agent asks the proxy for ``model="judge"`` and the
proxy calls ``litellm.acompletion(model=route.target, api_base=..., api_key=...)``. The call is recorded with
its text and usage, ``is_policy=False`` and ``token_source="external"`` and no token ids (they would be another
model's tokens). When the provider reports no usage, prompt and completion tokens are counted with tiktoken
(``route.encoding``, cl100k_base by default) and ``checks["usage_source"]`` says ``"tiktoken"``.

LiteLLM is imported on first use (it is an optional dependency, the ``providers`` extra, and slow to import).
For offline machines set ``LITELLM_LOCAL_MODEL_COST_MAP=True``; tiktoken encodings load from ``TIKTOKEN_CACHE_DIR``
(LiteLLM ships cl100k_base and o200k_base; this module points tiktoken at them when nothing else is set).
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lightning_sdk.errors import ConfigError, UpstreamError
from lightning_sdk.proxy._backend import CallContext, ChatResult, StreamItem, UpstreamHTTPError
from lightning_sdk.proxy._shapes import ChatStreamAssembler

__all__ = ["ExternalBackend", "ExternalRoute", "count_tokens"]

_PARAMS = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "n",
    "tools",
    "tool_choice",
    "response_format",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "user",
    "parallel_tool_calls",
)


@dataclass
class ExternalRoute:
    """One external model: ``name`` is what agents ask for, ``target`` the LiteLLM model string."""

    name: str
    target: str  # e.g. "openai/gpt-4o-mini", "anthropic/claude-...", "openai/<name>" for any OpenAI-compatible server
    api_base: str | None = None
    api_key: str | None = None
    encoding: str = "cl100k_base"  # tiktoken encoding for usage counts when the provider sends none
    timeout_s: float = 600.0
    num_retries: int = 2


def _litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "routing to external models needs litellm: pip install 'lightning-rl-sdk[providers]'"
        ) from exc
    return litellm


@functools.lru_cache(maxsize=8)
def _encoding(name: str) -> Any:
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        litellm = _litellm()
        path = os.path.join(os.path.dirname(litellm.__file__), "litellm_core_utils", "tokenizers")
        if os.path.isdir(path):
            os.environ["TIKTOKEN_CACHE_DIR"] = path
    import tiktoken

    return tiktoken.get_encoding(name)


def count_tokens(text: str, encoding: str = "cl100k_base") -> int:
    """Tokens in ``text`` by a tiktoken encoding (works offline with LiteLLM's bundled encodings)."""
    return len(_encoding(encoding).encode(text, disallowed_special=()))


def _messages_text(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '')}: {content or ''}")
        for tc in m.get("tool_calls") or ():
            fn = tc.get("function") or {}
            parts.append(f"{fn.get('name', '')}({fn.get('arguments', '')})")
    return "\n".join(parts)


class ExternalBackend:
    """Serves the chat calls of external routes through LiteLLM (text and usage only)."""

    def __init__(self, routes: list[ExternalRoute]) -> None:
        self.routes = {r.name: r for r in routes}

    def serves(self, model: str) -> bool:
        return model in self.routes

    def _kwargs(self, body: dict[str, Any], route: ExternalRoute, stream: bool) -> dict[str, Any]:
        kwargs: dict[str, Any] = {k: body[k] for k in _PARAMS if body.get(k) is not None}
        kwargs.update(
            model=route.target,
            messages=body["messages"],
            stream=stream,
            timeout=route.timeout_s,
            num_retries=route.num_retries,
        )
        if stream:
            kwargs["stream_options"] = {"include_usage": True}
        if route.api_base:
            kwargs["api_base"] = route.api_base
        if route.api_key:
            kwargs["api_key"] = route.api_key
        return kwargs

    async def chat(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        route = self.routes[body["model"]]
        litellm = _litellm()
        try:
            resp = await litellm.acompletion(**self._kwargs(body, route, stream=False))
        except Exception as exc:
            raise _translate(exc, route) from exc
        data: dict[str, Any] = resp.model_dump(exclude_none=False)
        data["model"] = body["model"]
        return self._result(body, data, route)

    async def chat_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        route = self.routes[body["model"]]
        litellm = _litellm()
        keep_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        asm = ChatStreamAssembler()
        try:
            stream = await litellm.acompletion(**self._kwargs(body, route, stream=True))
            async for chunk in stream:
                data: dict[str, Any] = chunk.model_dump(exclude_none=True)
                data["model"] = body["model"]
                data["object"] = "chat.completion.chunk"
                asm.feed(data)
                if not data.get("choices") and not keep_usage:
                    continue
                if not keep_usage:
                    data.pop("usage", None)
                yield data
        except Exception as exc:
            raise _translate(exc, route) from exc
        yield self._result(body, asm.response(), route)

    def _result(self, body: dict[str, Any], data: dict[str, Any], route: ExternalRoute) -> ChatResult:
        usage = {k: v for k, v in (data.get("usage") or {}).items() if isinstance(v, int) and not isinstance(v, bool)}
        checks: dict[str, Any] = {"usage_source": "provider"}
        if not usage.get("prompt_tokens") or not usage.get("completion_tokens"):
            choice = (data.get("choices") or [{}])[0]
            msg = choice.get("message") or {}
            reply = (msg.get("content") or "") + "".join(
                f"{(tc.get('function') or {}).get('name', '')}({(tc.get('function') or {}).get('arguments', '')})"
                for tc in msg.get("tool_calls") or ()
            )
            prompt_n = count_tokens(_messages_text(body["messages"]), route.encoding)
            completion_n = count_tokens(reply, route.encoding)
            usage = {
                "prompt_tokens": prompt_n,
                "completion_tokens": completion_n,
                "total_tokens": prompt_n + completion_n,
            }
            data["usage"] = dict(usage)
            checks = {"usage_source": "tiktoken", "encoding": route.encoding}
        finish = ((data.get("choices") or [{}])[0]).get("finish_reason")
        return ChatResult(
            response=data,
            finish_reason=finish,
            token_source="external",
            usage=usage,
            checks=checks,
            is_policy=False,
        )


def _translate(exc: Exception, route: ExternalRoute) -> UpstreamError:
    status = getattr(exc, "status_code", None)
    message = f"external model {route.name!r} ({route.target}) failed: {type(exc).__name__}: {exc}"
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return UpstreamHTTPError(message, status_code=status)
    if "Timeout" in type(exc).__name__:
        return UpstreamError(message, status_code=504)
    return UpstreamError(message, status_code=502)
