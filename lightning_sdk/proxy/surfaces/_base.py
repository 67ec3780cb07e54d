"""What the translating surfaces (Responses, Messages) share: ``SurfaceAdapter``, the pipeline's ``Adapter`` over a
translation to and from the chat form.

A surface subclasses ``SurfaceAdapter`` and writes only its API: ``parse`` (validate, 400 naming the field),
``translate`` (request -> chat form, given the attempt's earlier replies), ``reply_body`` (the chat reply -> its
answer), ``refs`` (the ids the answer hands out, to recognise them when the agent sends them back), ``stream``
(chat chunks -> its server-sent events) and ``error_body``. The base does the rest the pipeline asks
(``proxy/_call.py``): the earlier replies, the chat checks on the translation (names in errors are the chat
form's), the session headers and stream flags, the answer's JSON and the recorded request. The recorded
``Call.request`` is the chat form the backend served (so the bridge and the records treat every surface alike)
plus ``request["surface"]``: which API, the original request (for inspection), the session headers, the tools the
policy was not shown, the ids the proxy handed out and what the agent was shown.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from starlette.types import Scope

from lightning_sdk.proxy._backend import CallContext, ChatResult
from lightning_sdk.proxy._call import EventStream, Translation
from lightning_sdk.proxy._errors import ProxyHTTPError, _bad, validate_chat
from lightning_sdk.proxy.surfaces._chat import PriorReplies, Reply
from lightning_sdk.types import Call

__all__ = [
    "SESSION_HEADERS",
    "SurfaceAdapter",
    "SurfaceStream",
    "Translation",
    "chat_form",
    "check_common",
    "original_request",
    "sse",
]

SESSION_HEADERS = (b"x-claude-code-session-id", b"session-id", b"thread-id")
"""Request headers kept on the recorded call (``request["surface"]["headers"]``)."""


class SurfaceStream(Protocol):
    """Turns a backend's chat chunks into the surface's server-sent events."""

    def start(self) -> list[bytes]: ...

    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def finish(self, reply: Reply) -> list[bytes]: ...

    def error(self, err: ProxyHTTPError) -> bytes: ...


class _Events:
    """A ``SurfaceStream`` as the pipeline's ``EventStream`` (chunks read as dicts, the reply cut at the stops)."""

    __slots__ = ("_inner", "_stop")

    def __init__(self, inner: SurfaceStream, stop: list[str]) -> None:
        self._inner = inner
        self._stop = stop

    def start(self) -> bytes:
        return b"".join(self._inner.start())

    def feed(self, item: dict[str, Any] | bytes) -> bytes:
        chunk: dict[str, Any] = orjson.loads(item) if isinstance(item, bytes) else item
        return b"".join(self._inner.feed(chunk))

    def finish(self, result: ChatResult) -> bytes:
        return b"".join(self._inner.finish(Reply.from_chat(result.response, self._stop)))

    def error(self, err: ProxyHTTPError) -> bytes:
        return self._inner.error(err)


class SurfaceAdapter:
    """The pipeline's ``Adapter`` for a surface that translates to the chat form (see the module docstring)."""

    api: str = ""
    chat = True
    api_key_header = True  # the token may come as x-api-key (Anthropic clients send it)
    reads_earlier_calls = True  # to recognise the proxy's own earlier replies

    # -- what a surface writes -------------------------------------------------------------------------------------
    def parse(self, raw: Any) -> dict[str, Any]:
        raise NotImplementedError

    def translate(self, body: dict[str, Any], prior: PriorReplies, call_id: str) -> Translation:
        raise NotImplementedError

    def reply_body(self, t: Translation, reply: Reply) -> dict[str, Any]:
        raise NotImplementedError

    def refs(self, t: Translation, reply: Reply) -> list[str]:
        raise NotImplementedError

    def stream(self, t: Translation, ctx: CallContext) -> SurfaceStream:
        raise NotImplementedError

    def error_body(self, err: ProxyHTTPError) -> bytes:
        raise NotImplementedError

    # -- the Adapter interface -------------------------------------------------------------------------------------
    def to_chat(self, body: dict[str, Any], ctx: CallContext, scope: Scope, earlier: list[Call]) -> Translation:
        t = self.translate(body, PriorReplies(earlier), ctx.call_id)
        validate_chat(t.chat)  # the checks chat completions get (names in errors are the chat form's)
        t.record["headers"] = {
            name.decode(): value.decode("latin-1") for name, value in scope["headers"] if name in SESSION_HEADERS
        }
        if body.get("stream"):
            t.chat = dict(t.chat, stream=True, stream_options={"include_usage": True})
        return t

    def answer(self, t: Translation, result: ChatResult) -> bytes:
        return orjson.dumps(self.reply_body(t, Reply.from_chat(result.response, t.stop)))

    def stream_events(self, t: Translation, ctx: CallContext) -> EventStream:
        return _Events(self.stream(t, ctx), t.stop)

    def recorded(self, t: Translation | None, body: dict[str, Any], result: ChatResult | None) -> dict[str, Any]:
        if t is None:
            return {"model": body["model"], "surface": {"api": self.api, "request": original_request(body)}}
        if result is not None:
            reply = Reply.from_chat(result.response, t.stop)
            t.record["shown"] = reply.shown()
            t.record["refs"] = self.refs(t, reply)
        return {**t.chat, "surface": t.record}


def check_common(raw: Any) -> dict[str, Any]:
    """The checks every surface's request passes first (400 naming the field): a JSON object with a non-empty
    ``model``; ``stream`` a boolean; ``temperature`` and ``top_p`` numbers; ``tools`` a list."""
    if not isinstance(raw, dict):
        raise _bad("body", "the request body must be a JSON object")
    if not isinstance(raw.get("model"), str) or not raw["model"]:
        raise _bad("model", "required, a non-empty string")
    if "stream" in raw and not isinstance(raw["stream"], bool | None):
        raise _bad("stream", "must be a boolean")
    for key in _SAMPLING:
        value = raw.get(key)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise _bad(key, "must be a number")
    if raw.get("tools") is not None and not isinstance(raw["tools"], list):
        raise _bad("tools", "must be a list")
    return raw


def chat_form(body: dict[str, Any], messages: list[Any], tools: list[Any]) -> dict[str, Any]:
    """The start of the chat form of a surface request: model, messages, the tools shown, the sampling settings."""
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    if tools:
        chat["tools"] = tools
    chat.update({key: body[key] for key in _SAMPLING if body.get(key) is not None})
    return chat


def original_request(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the agent sent it, for the record (``stream`` is a transport detail)."""
    return {k: v for k, v in body.items() if k != "stream"}


_SAMPLING = ("temperature", "top_p")


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with a name (both surfaces name their events)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
