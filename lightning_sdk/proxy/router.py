"""Several policies behind one proxy: each request goes to the backend of the policy its ``model`` names.

``PolicyRouter({"planner": backend_a, "coder": backend_b})`` is a ``PolicyBackend`` whose every call is served by
the backend registered under ``ctx.model`` (the request's ``model``). The proxy app refuses any other name before a
backend is asked (``ProxyConfig.policy_models`` = the router's names: 404 ``model_not_found``, ``param: "model"``,
recorded as a failed call), so a call's recorded ``model`` is the policy that served it and its ``policy_version``
that policy's version.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from lightning_sdk.proxy._backend import CallContext, ChatResult, PolicyBackend, StreamItem
from lightning_sdk.proxy._errors import ProxyHTTPError
from lightning_sdk.proxy.observe import Mode

__all__ = ["PolicyRouter"]


class PolicyRouter(PolicyBackend):
    """Dispatches each call to ``backends[ctx.model]`` (see the module docstring); the backends share the mode."""

    def __init__(self, backends: Mapping[str, PolicyBackend]) -> None:
        if not backends:
            raise ValueError("PolicyRouter needs at least one policy")
        self.backends = dict(backends)
        first = next(iter(self.backends.values()))
        self.mode: Mode = first.mode
        self.reads_earlier_calls = any(b.reads_earlier_calls for b in self.backends.values())

    @property
    def names(self) -> list[str]:
        return list(self.backends)

    def _pick(self, ctx: CallContext) -> PolicyBackend:
        backend = self.backends.get(ctx.model)
        if backend is None:  # the app refuses unknown names first (policy_models); this is the backstop
            raise ProxyHTTPError(
                404,
                f"model {ctx.model!r} is not served here; known models: {', '.join(self.backends)}",
                param="model",
                code="model_not_found",
            )
        return backend

    async def chat(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        return await self._pick(ctx).chat(body, ctx)

    def chat_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        return self._pick(ctx).chat_stream(body, ctx)

    async def completions(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        return await self._pick(ctx).completions(body, ctx)

    def completions_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        return self._pick(ctx).completions_stream(body, ctx)

    async def models(self) -> list[str]:
        return self.names

    async def start(self) -> None:
        for backend in self.backends.values():
            await backend.start()

    async def aclose(self) -> None:
        for backend in self.backends.values():
            await backend.aclose()

    def prompt_renderer(self) -> Any:
        """The first policy's renderer (the policies of a run share one base model and its template)."""
        return next(iter(self.backends.values())).prompt_renderer()
