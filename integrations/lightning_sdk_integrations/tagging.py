"""Tag LLM calls with the (sub-)agent that made them.

A tag is a small ``{str: str}`` mapping (e.g. ``{"lightning_agent": "researcher", "lightning_node": "agent"}``)
held in a ``ContextVar``, so it follows asyncio tasks and copied contexts. ``TaggingTransport`` /
``AsyncTaggingTransport`` wrap httpx transports: on every ``POST .../chat/completions`` or ``.../completions`` made
while a tag is set they merge it into the request body's ``metadata`` (the OpenAI API's own field for request
labels, which the proxy records with the call) and send it as ``X-Lightning-Agent`` too. Calls made with no tag
set go out unchanged.

    with tagged(lightning_agent="planner"):
        client.chat.completions.create(...)      # client built with http_client=tagging_http_client()
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import Iterator
from typing import Any

import httpx

__all__ = [
    "AsyncTaggingTransport",
    "TaggingTransport",
    "async_tagging_http_client",
    "current_tags",
    "reset_tags",
    "set_tags",
    "tagged",
    "tagging_http_client",
]

_TAGS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("lightning_tags", default=None)
_LLM_PATHS = ("/chat/completions", "/completions")


def current_tags() -> dict[str, str] | None:
    """The tags calls made here would carry (None: untagged)."""
    return _TAGS.get()


def set_tags(tags: dict[str, str] | None) -> contextvars.Token[dict[str, str] | None]:
    """Set the tags of the current context; returns a token for ``reset_tags``."""
    return _TAGS.set(dict(tags) if tags else None)


def reset_tags(token: contextvars.Token[dict[str, str] | None]) -> None:
    _TAGS.reset(token)


@contextlib.contextmanager
def tagged(**tags: str) -> Iterator[None]:
    """Tag every LLM call made inside the block (merged over any outer tags)."""
    token = set_tags({**(current_tags() or {}), **{k: str(v) for k, v in tags.items()}})
    try:
        yield
    finally:
        _TAGS.reset(token)


def _tag_request(request: httpx.Request) -> httpx.Request:
    tags = current_tags()
    if not tags or request.method != "POST" or not request.url.path.endswith(_LLM_PATHS):
        return request
    try:
        body = json.loads(request.read() or b"{}")
    except ValueError:
        return request
    if not isinstance(body, dict):
        return request
    metadata = body.get("metadata")
    body["metadata"] = {**(metadata if isinstance(metadata, dict) else {}), **tags}
    headers = httpx.Headers(request.headers)
    headers.pop("content-length", None)
    headers["X-Lightning-Agent"] = tags.get("lightning_agent", "")
    return httpx.Request(
        request.method, request.url, headers=headers, content=json.dumps(body).encode(), extensions=request.extensions
    )


class TaggingTransport(httpx.BaseTransport):
    """Adds the current tags to LLM requests, then sends them with ``inner`` (default ``httpx.HTTPTransport``)."""

    def __init__(self, inner: httpx.BaseTransport | None = None) -> None:
        self.inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(_tag_request(request))

    def close(self) -> None:
        self.inner.close()


class AsyncTaggingTransport(httpx.AsyncBaseTransport):
    """The async twin of ``TaggingTransport``."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(_tag_request(request))

    async def aclose(self) -> None:
        await self.inner.aclose()


def tagging_http_client(**kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` that tags LLM requests (pass it as ``http_client=`` to ``openai.OpenAI``)."""
    kwargs.setdefault("timeout", httpx.Timeout(600.0, connect=10.0))
    return httpx.Client(transport=TaggingTransport(), **kwargs)


def async_tagging_http_client(**kwargs: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` that tags LLM requests (``http_client=`` of ``openai.AsyncOpenAI``)."""
    kwargs.setdefault("timeout", httpx.Timeout(600.0, connect=10.0))
    return httpx.AsyncClient(transport=AsyncTaggingTransport(), **kwargs)
