"""``POST /v1/messages/count_tokens``: the prompt's length in the policy's own tokens.

The request is translated like a Messages call and rendered with the policy's chat template (token mode, or a
passthrough proxy given the policy tokenizer with ``--tokenizer``). Nothing is generated or recorded. Without the
policy's tokenizer the proxy cannot count exactly and says so (400) rather than guess.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import orjson
from starlette.types import Receive, Scope, Send

from lightning_sdk.errors import LightningSDKError, TemplateFeatureError, TokenizationError
from lightning_sdk.proxy._call import attempt_token, read_json, refusal, send_error
from lightning_sdk.proxy._errors import ProxyHTTPError
from lightning_sdk.proxy._external import ExternalBackend
from lightning_sdk.proxy.surfaces._chat import PriorReplies
from lightning_sdk.proxy.surfaces.messages import MessagesSurface

if TYPE_CHECKING:
    from lightning_sdk.proxy._service import Proxy

__all__ = ["count_tokens"]

_SURFACE = MessagesSurface()


async def count_tokens(proxy: Proxy, scope: Scope, receive: Receive, send: Send, path_token: str | None) -> None:
    """Answer ``{"input_tokens": N}`` for a Messages request body (see the module docstring)."""
    surface = _SURFACE
    try:
        raw = await read_json(scope, receive, proxy.config.max_body_bytes, proxy.config.read_timeout_s)
        if isinstance(raw, dict):
            raw = {"max_tokens": 1, **raw}  # count_tokens takes no max_tokens
        body = surface.parse(raw)
        await proxy.attempts.resolve(attempt_token(scope, path_token, api_key_header=True))
        backend = proxy.backend_for(body["model"])
        renderer = None if isinstance(backend, ExternalBackend) else backend.prompt_renderer()
        if renderer is None:
            raise ProxyHTTPError(
                400,
                "count_tokens needs the policy's tokenizer: run the proxy in token mode or with --tokenizer",
                param="model",
            )
        chat = surface.translate(body, PriorReplies(()), "call-count").chat
        try:
            ids = await asyncio.to_thread(renderer.render, chat["messages"], chat.get("tools"))
        except TemplateFeatureError as exc:  # the template would drop part of it (tools, ...): refused, as a call is
            raise ProxyHTTPError(400, str(exc), param=exc.param) from exc
        except TokenizationError as exc:
            raise ProxyHTTPError(400, f"messages: {exc}", param="messages") from exc
    except LightningSDKError as exc:  # a ProxyHTTPError answers as it is
        await send_error(send, surface, refusal(exc))
        return
    payload = orjson.dumps({"input_tokens": len(ids)})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
