"""The OpenAI Responses API and the Anthropic Messages API on the proxy, over the chat-completions backends.

Each surface is one adapter of the call pipeline (``proxy/_call.py``'s ``Adapter``, through ``SurfaceAdapter`` in
``_base.py``): it translates to the internal chat-completions form and back (``_chat.py``), so one policy backend
serves all three APIs in both modes and every call is recorded alike: token mode renders through the bridge with
the policy's template and parses with the family parsers; passthrough forwards to the engine's chat completions
with token ids. ``SURFACES`` maps each route path to its adapter (the routing table, ``proxy/_app.py``, reads it);
``count_tokens`` serves ``/v1/messages/count_tokens``. See docs/integrations.md.

A new surface: a module here with a ``SurfaceAdapter`` subclass, a line in ``SURFACES``, its tests in
``tests/surfaces/``.
"""

from lightning_sdk.proxy._call import Adapter
from lightning_sdk.proxy.surfaces._base import SurfaceAdapter
from lightning_sdk.proxy.surfaces._count import count_tokens
from lightning_sdk.proxy.surfaces.messages import MessagesSurface, anthropic_error
from lightning_sdk.proxy.surfaces.responses import ResponsesSurface

__all__ = [
    "COUNT_TOKENS_PATH",
    "SURFACES",
    "MessagesSurface",
    "ResponsesSurface",
    "SurfaceAdapter",
    "anthropic_error",
    "count_tokens",
]

SURFACES: dict[str, Adapter] = {"/v1/responses": ResponsesSurface(), "/v1/messages": MessagesSurface()}
"""Route path (query strings are not part of it) -> the adapter serving it."""

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
