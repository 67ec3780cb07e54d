"""The OpenAI Responses API and the Anthropic Messages API on the proxy, over the chat-completions backends.

Both surfaces translate to the internal chat-completions form and back (``_chat.py``), so one policy backend serves
all three APIs in both modes and every call is recorded alike (``_handler.py``): token mode renders through the
bridge with the policy's template and parses with the family parsers; passthrough forwards to the engine's chat
completions with token ids. ``SURFACES`` maps each route path to its surface; ``count_tokens`` serves
``/v1/messages/count_tokens``. See docs/integrations.md.
"""

from lightning_sdk.proxy.surfaces._count import count_tokens
from lightning_sdk.proxy.surfaces._handler import Surface, attempt_token, handle_surface
from lightning_sdk.proxy.surfaces.messages import MessagesSurface, anthropic_error
from lightning_sdk.proxy.surfaces.responses import ResponsesSurface

__all__ = [
    "COUNT_TOKENS_PATH",
    "SURFACES",
    "MessagesSurface",
    "ResponsesSurface",
    "Surface",
    "anthropic_error",
    "attempt_token",
    "count_tokens",
    "handle_surface",
]

SURFACES: dict[str, Surface] = {"/v1/responses": ResponsesSurface(), "/v1/messages": MessagesSurface()}
"""Route path (query strings are not part of it) -> the surface serving it."""

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
