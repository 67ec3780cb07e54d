"""The policy-backend interface: what the proxy app dispatches an OpenAI request to, and what it gets back.

The app owns HTTP, auth, validation and recording; a backend owns talking to the model. Two implementations:

* ``PassthroughBackend`` (``proxy/passthrough.py``): forwards to an OpenAI-compatible engine and records the ids the
  engine returns (vLLM ``return_token_ids``).
* the token-in/token-out backend (``proxy/token_mode.py``): renders messages with the policy's tokenizer and sends
  ids to an ``Engine``; it reads ``ctx.earlier_calls()`` to reuse the ids of earlier calls of the same attempt.

Every method gets the agent's request body (parsed JSON, already validated: ``model`` is a string, ``messages`` a
list of objects with a ``role``) and a ``CallContext``. Non-streaming methods return a ``ChatResult``; streaming
methods are async generators that yield OpenAI chunk objects (dicts, or ``bytes`` holding one chunk's JSON that is
forwarded as is) and yield the call's ``ChatResult`` as their **last** item. A streamed call's ``ChatResult`` must be
exactly what the same call would return unstreamed (apart from response ``id``/``created``).

A backend subclasses ``PolicyBackend`` and overrides the optional members whose defaults do not fit it:
``mode`` (``"token"`` or ``"passthrough"``: what observers are told); ``reads_earlier_calls`` (False for a backend
that never calls ``ctx.earlier_calls()``: the proxy then keeps an attempt's finished calls in memory only once
something else asks for them, ``proxy/_attempts.py``); ``prompt_renderer()`` (the policy's chat renderer when the
backend has one: ``/v1/messages/count_tokens`` counts with it); ``start()`` (called once when the app starts) and
``upstream_state()`` (what ``GET /lightning/v1/health`` says about the upstream). A streaming method that knows the
prompt's length before its first chunk (token mode renders it; a passthrough engine's first chunk carries the
prompt's ids) sets ``ctx.prompt_tokens`` before yielding it: the Messages stream's ``message_start`` reports it.

Failures are raised as ``UpstreamError`` (``status_code`` 502 or 504) or ``UpstreamHTTPError`` (the engine refused
the request, e.g. 400 context too long: its status and OpenAI error body are passed to the agent).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lightning_sdk.errors import UpstreamError
from lightning_sdk.proxy.observe import Mode
from lightning_sdk.tokens import ChatRenderer
from lightning_sdk.types import Attempt, Call, TokenSource

__all__ = [
    "CallContext",
    "ChatResult",
    "PolicyBackend",
    "StreamItem",
    "UpstreamHTTPError",
    "relay_items",
]


class UpstreamHTTPError(UpstreamError):
    """The engine answered with an HTTP error that is the request's fault (4xx, or 429 with its ``Retry-After``):
    passed on to the agent with its status (``proxy._call.upstream_refusal``)."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        payload: dict[str, Any] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, status_code=status_code, retry_after_s=retry_after_s)
        self.payload = payload


@dataclass
class ChatResult:
    """One finished call: the OpenAI response for the agent plus everything the proxy records.

    ``response`` is the ``chat.completion`` / ``text_completion`` object as the agent receives it (for a stream:
    the object the chunks add up to). ``prompt_ids`` is the exact context the engine consumed, ``completion_ids``
    exactly what it sampled, ``logprobs`` their log-probs (same length). ``token_source`` says where the ids come
    from (see ``lightning_sdk.types.TokenSource``); ``checks`` records any fidelity checks made.
    """

    response: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    token_source: TokenSource = "engine"
    policy_version: int | None = None
    usage: dict[str, int] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    is_policy: bool = True
    error: str | None = None
    checked: bool = False
    """True when every field already has its type in ``Call`` (ids ints in [0, 2^31), log-probs finite floats,
    usage ints, ...): the proxy then records them without validating again (``Call.from_checked``)."""


@dataclass
class CallContext:
    """What a backend knows about the call it serves.

    ``attempt`` is the running attempt that owns the bearer token; ``call_id``/``seq`` the id and order the call
    will be recorded under; ``model`` the model name the agent asked for; ``policy_version`` the latest published
    policy version when the call started (a backend that knows better, e.g. an engine that reports the version
    of the weights that served it, sets ``ChatResult.policy_version`` instead); ``split`` the split of the
    attempt's rollout (token mode samples by it: ``proxy/sampling.py``).
    """

    attempt: Attempt
    call_id: str
    seq: int
    model: str
    policy_version: int | None = None
    split: str | None = None  # the attempt's rollout split (None: not known yet); chooses per-split sampling
    prompt_tokens: int | None = None  # set by a streaming backend that knows the prompt's length before its 1st chunk
    idempotency_key: str | None = None  # the agent's Idempotency-Key (Call.idempotency_key)
    _earlier: Callable[[], Awaitable[list[Call]]] | None = None

    async def earlier_calls(self) -> list[Call]:
        """The calls of this attempt that finished before this one started, in ``seq`` order (recorded or not)."""
        if self._earlier is None:
            return []
        return await self._earlier()


StreamItem = dict[str, Any] | bytes | ChatResult


async def relay_items(
    first: StreamItem, rest: AsyncIterator[StreamItem], send: Callable[[dict[str, Any] | bytes], Awaitable[None]]
) -> ChatResult | None:
    """Pass a backend stream's chunks (``first``, then ``rest``) to ``send``; returns the stream's ``ChatResult``
    (None when it ended without one). Errors of the stream propagate."""
    result: ChatResult | None = None
    item: StreamItem | None = first
    while item is not None:
        if isinstance(item, ChatResult):
            result = item
        else:
            await send(item)
        item = await anext(rest, None)
    return result


"""One item of a streaming backend method: an OpenAI chunk (dict or its JSON bytes); the last item a ChatResult."""


@runtime_checkable
class PolicyBackend(Protocol):
    """Serves the policy model's OpenAI requests (see the module docstring for the contract).

    Backends subclass it: the optional members below have their defaults here.
    """

    mode: Mode = "passthrough"
    reads_earlier_calls: bool = True

    async def chat(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        """``POST /v1/chat/completions`` without streaming."""
        ...

    def chat_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        """``POST /v1/chat/completions`` with ``"stream": true``: chunks, then the ``ChatResult``."""
        ...

    async def completions(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        """``POST /v1/completions`` without streaming."""
        ...

    def completions_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        """``POST /v1/completions`` with ``"stream": true``: chunks, then the ``ChatResult``."""
        ...

    async def models(self) -> list[str]:
        """The model names this backend serves (for ``GET /v1/models``)."""
        ...

    async def aclose(self) -> None:
        """Release connections; called once when the app shuts down."""
        ...

    async def start(self) -> None:
        """Called once when the app starts (e.g. the passthrough's watch for an upstream that is not up yet)."""
        return None

    def upstream_state(self) -> dict[str, Any] | None:
        """What the health route says about the upstream (None: nothing)."""
        return None

    def prompt_renderer(self) -> ChatRenderer | None:
        """The policy's chat renderer, when this backend has it (``/v1/messages/count_tokens`` counts with it)."""
        return None
