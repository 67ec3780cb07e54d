"""Forward policy calls to an OpenAI-compatible engine and record the token ids the engine returns.

The engine is asked for ``return_token_ids`` and ``logprobs`` (vLLM >= 0.10.2 answers with ``prompt_token_ids``
and per-choice ``token_ids``; see ``proxy/_shapes.py``); fields the agent did not ask for are removed from what it
receives. An engine that returns text only still works: its calls are recorded without ids and flagged in
``checks`` (``missing_token_ids``) so they are never trained silently.

Connections are kept alive in an ``Http1Pool`` (``lightning_sdk/http1.py``; measured here: half of aiohttp's CPU per
request, a fifth of httpx's).
Failures before the first byte reaches the agent are retried, one level, by ``lightning_sdk._retry`` (connection
errors, 429, 5xx, a reply cut off mid-body: at most ``max_retries + 1`` POSTs per call); then the agent gets an
OpenAI-shaped 502, or 504 when the engine did not answer within ``timeout_s``. A 4xx from the engine is the
request's fault and is passed on. When the agent disconnects, the upstream response is closed, which makes
vLLM/SGLang abort the generation.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import orjson

from lightning_sdk._retry import RetryPolicy, TransientAnswer, retry
from lightning_sdk.errors import UpstreamError
from lightning_sdk.http1 import Http1Error, Http1Pool, Http1ReadTimeout, Http1Response
from lightning_sdk.proxy._backend import CallContext, ChatResult, PolicyBackend, StreamItem, UpstreamHTTPError
from lightning_sdk.proxy._shapes import (
    ChatStreamAssembler,
    CompletionStreamAssembler,
    EngineTokens,
    MalformedAnswer,
    chat_tokens,
    completion_tokens,
    strip_engine_fields,
)

__all__ = ["PassthroughBackend", "PassthroughConfig", "UpstreamNotReady", "split_credentials"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


@dataclass
class PassthroughConfig:
    """How to reach the engine. ``upstream`` is its base URL ending in ``/v1``."""

    upstream: str
    api_key: str | None = None  # sent upstream as the bearer (the agent's attempt token never is)
    model: str | None = None  # rename the model in forwarded requests (agents say "policy", vLLM serves "Qwen/...")
    request_token_ids: bool = True  # ask for vLLM's return_token_ids
    request_logprobs: bool = True
    max_retries: int = 3
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0
    connect_timeout_s: float = 10.0
    timeout_s: float = 600.0  # longest wait for the engine's next bytes
    max_connections: int = 1024  # idle keep-alive connections kept open


class UpstreamNotReady(UpstreamError):
    """The upstream has not answered yet since the proxy started (503 with ``Retry-After``)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, status_code=503, retry_after_s=retry_after_s)


def split_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its ``user:password@`` part, and the ``Authorization: Basic`` value it carried (or None)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    return clean, "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


class PassthroughBackend(PolicyBackend):
    """A ``PolicyBackend`` that forwards to one OpenAI-compatible engine (see the module docstring).

    Credentials in the upstream URL (``http://user:pass@host/v1``) are sent as basic auth and never appear in
    messages, logs or recorded errors (``base`` is the URL without them). ``start()`` (called by the proxy app
    when it starts) watches for an upstream that is not up yet: until it answers, calls get 503 with
    ``Retry-After`` and ``upstream_state()`` (in ``/lightning/v1/health``) says ``waiting``.
    """

    reads_earlier_calls = False
    """The proxy need not keep each attempt's finished calls in memory for this backend (``proxy/_attempts.py``)."""

    def __init__(self, config: PassthroughConfig | str, **overrides: Any) -> None:
        if isinstance(config, str):
            config = PassthroughConfig(upstream=config, **overrides)
        self.config = config
        clean, basic = split_credentials(config.upstream)
        self.base = clean.rstrip("/")
        self._pool = Http1Pool(
            self.base,
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.timeout_s,
            max_idle=config.max_connections,
        )
        headers = {"Content-Type": "application/json"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        elif basic is not None:
            headers["Authorization"] = basic
        self._headers = headers
        self._retry = RetryPolicy(config.max_retries, config.backoff_s, config.backoff_max_s)
        self._state = "ready"  # not watched (no start()): assume it is up and let each call find out
        self._last_error: str | None = None
        self._since = time.time()
        self._watch: asyncio.Task[None] | None = None
        self._next_probe_s = 0.0
        self._probed_at = 0.0
        self._probing: asyncio.Task[bool] | None = None  # the probe a call started, shared by the calls meanwhile

    # -- the upstream's state ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Watch the upstream until it answers ``GET /models`` (backoff 0.2 s doubling to 5 s)."""
        if self._watch is None and not await self._probe():
            self._state = "waiting"
            self._watch = asyncio.get_running_loop().create_task(self._wait_for_upstream())

    def upstream_state(self) -> dict[str, Any]:
        """``{"url", "state": "waiting"|"ready", "since", "last_error"}`` (no credentials)."""
        return {"url": self.base, "state": self._state, "since": self._since, "last_error": self._last_error}

    async def _probe(self) -> bool:
        """One ``GET /models``: True (and state ``ready``) when the upstream answers below 500."""
        try:
            status, _ = await self._pool.request("GET", "/models", b"", self._headers)
        except Http1Error as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            if status < 500:
                self._state, self._since, self._last_error = "ready", time.time(), None
                logger.info("upstream %s is up (GET /models answered %d)", self.base, status)
                return True
            error = f"GET /models answered {status}"
        if self._last_error is None:
            logger.warning("upstream %s is not reachable yet (%s); waiting for it", self.base, error)
        self._last_error = error
        return False

    def _probe_done(self, task: asyncio.Task[bool]) -> None:
        self._probing = None
        if not task.cancelled():
            task.exception()  # retrieved here: the callers that awaited it saw it already

    async def _wait_for_upstream(self) -> None:
        delay = 0.2
        while True:
            self._next_probe_s = delay
            await asyncio.sleep(delay)
            if await self._probe():
                return
            delay = min(delay * 2, 5.0)

    async def _check_ready(self) -> None:
        """Raise ``UpstreamNotReady`` while the upstream has never answered (a call probes it once itself; calls
        that arrive while that probe runs wait for its answer instead of being refused on the previous one)."""
        if self._state == "ready":
            return
        probe = self._probing
        if probe is None and time.monotonic() - self._probed_at > 0.1:  # do not wait for the watch's backoff
            self._probed_at = time.monotonic()
            probe = self._probing = asyncio.get_running_loop().create_task(self._probe())
            probe.add_done_callback(self._probe_done)
        if probe is not None:
            await asyncio.shield(probe)  # a caller that goes away does not cancel the others' probe
        if self._state != "ready":
            raise UpstreamNotReady(
                f"upstream {self.base} is not reachable yet ({self._last_error or 'starting'}): retry later",
                retry_after_s=max(1.0, self._next_probe_s),
            )

    # -- the PolicyBackend interface -----------------------------------------------------------------------------
    async def chat(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        if self._state != "ready":  # checked here: no coroutine per call once the upstream is up
            await self._check_ready()
        data = await self._post_json("/chat/completions", self._upstream_body(body, stream=False))
        return self._result(body, data, _read(chat_tokens, data), ctx)

    async def completions(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        if self._state != "ready":  # checked here: no coroutine per call once the upstream is up
            await self._check_ready()
        data = await self._post_json("/completions", self._upstream_body(body, stream=False))
        return self._result(body, data, _read(completion_tokens, data), ctx)

    async def chat_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        if self._state != "ready":  # checked here: no coroutine per call once the upstream is up
            await self._check_ready()
        asm = ChatStreamAssembler()
        async for item in self._stream("/chat/completions", body, asm, ctx):
            yield item
        full = asm.response()
        yield self._result(body, full, _read(chat_tokens, full), ctx)

    async def completions_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        if self._state != "ready":  # checked here: no coroutine per call once the upstream is up
            await self._check_ready()
        asm = CompletionStreamAssembler()
        async for item in self._stream("/completions", body, asm, ctx):
            yield item
        full = asm.response()
        yield self._result(body, full, _read(completion_tokens, full), ctx)

    async def models(self) -> list[str]:
        if self.config.model:
            return [self.config.model]
        try:
            status, raw = await self._pool.request("GET", "/models", b"", self._headers)
        except Http1Error as exc:
            raise UpstreamError(f"upstream {self.base} unreachable: {exc}", status_code=502) from exc
        if status != 200:
            raise UpstreamError(f"upstream GET /models answered {status}", status_code=502)
        data = orjson.loads(raw)
        return [str(m["id"]) for m in data.get("data") or ()]

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._pool.aclose()

    # -- internals -----------------------------------------------------------------------------------------------
    def _upstream_body(self, body: dict[str, Any], *, stream: bool) -> bytes:
        out = dict(body)
        if self.config.model:
            out["model"] = self.config.model
        if self.config.request_token_ids:
            out["return_token_ids"] = True
        if self.config.request_logprobs and not out.get("logprobs"):
            out["logprobs"] = True if "messages" in out else 0
        if stream:
            out["stream_options"] = dict(out.get("stream_options") or {}, include_usage=True)
        return orjson.dumps(out)

    def _timeout(self) -> UpstreamError:
        return UpstreamError(f"upstream {self.base} did not answer within {self.config.timeout_s}s", status_code=504)

    async def _open(self, path: str, payload: bytes) -> Http1Response:
        """POST with retries until the engine answers 200; the caller reads the body and releases the response."""
        return await self._retrying(path, lambda: self._open_once(path, payload))

    async def _post_json(self, path: str, payload: bytes) -> dict[str, Any]:
        """POST and read the whole reply; a reply cut off mid-body is retried like a failed POST (one level)."""

        async def once() -> bytes:
            resp = await self._open_once(path, payload)
            try:
                return await resp.read()
            except Http1ReadTimeout as exc:
                resp.close()
                raise self._timeout() from exc
            except Http1Error:  # cut off mid-body: nothing reached the agent yet, so it is retried
                resp.close()
                raise

        raw = await self._retrying(path, once)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise UpstreamError(f"upstream sent invalid JSON: {raw[:200]!r}", status_code=502) from exc
        if not isinstance(data, dict):
            raise UpstreamError(
                f"upstream answer is malformed: expected a JSON object, got {type(data).__name__}", status_code=502
            )
        return data

    async def _retrying(self, path: str, once: Callable[[], Awaitable[T]]) -> T:
        """``once`` under the project's retry policy; when the tries are spent, an ``UpstreamError`` (502)."""
        url = self.base + path
        try:
            return await retry(once, policy=self._retry, retry_if=_retryable, what=f"upstream POST {url}")
        except TransientAnswer as exc:
            if isinstance(exc.answer, UpstreamHTTPError):  # a rate limit: relayed as it is (429, Retry-After)
                raise exc.answer from exc
            raise UpstreamError(
                f"upstream {url} failed after {self._retry.retries + 1} attempts; "
                f"last error: {type(exc).__name__}: {exc}",
                status_code=502,
            ) from exc
        except Http1Error as exc:
            raise UpstreamError(
                f"upstream {url} failed after {self._retry.retries + 1} attempts; "
                f"last error: {type(exc).__name__}: {exc}",
                status_code=502,
            ) from exc

    async def _open_once(self, path: str, payload: bytes) -> Http1Response:
        """One POST: the 200 response (body unread), or the error that says whether to retry."""
        try:
            resp = await self._pool.send("POST", path, payload, self._headers)
        except Http1ReadTimeout as exc:
            raise self._timeout() from exc
        # other Http1Errors (connection refused/reset, cut off before the status line) propagate and are retried
        if resp.status == 200:
            return resp
        try:
            raw = await resp.read()
        except Http1Error:
            resp.close()
            raise
        if resp.status == 429:  # retried; when the tries are spent the agent gets this 429 with its Retry-After
            limited = UpstreamHTTPError(
                f"upstream answered 429: {raw[:300].decode(errors='replace')}",
                status_code=429,
                payload=_error_payload(raw),
                retry_after_s=_retry_after(resp.headers),
            )
            raise TransientAnswer(limited, f"HTTP 429: {raw[:300].decode(errors='replace')}")
        if resp.status in _RETRY_STATUS:
            raise TransientAnswer(raw, f"HTTP {resp.status}: {raw[:300].decode(errors='replace')}")
        raise UpstreamHTTPError(
            f"upstream answered {resp.status}", status_code=resp.status, payload=_error_payload(raw)
        )

    async def _stream(
        self,
        path: str,
        body: dict[str, Any],
        asm: ChatStreamAssembler | CompletionStreamAssembler,
        ctx: CallContext,
    ) -> AsyncIterator[StreamItem]:
        keep_ids = bool(body.get("return_token_ids"))
        keep_lps = bool(body.get("logprobs")) or body.get("logprobs") == 0
        keep_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = await self._open(path, self._upstream_body(body, stream=True))
        done = False
        events = 0
        try:
            ctype = next((v for k, v in resp.headers if k == b"content-type"), b"")
            if ctype and not ctype.lower().startswith(b"text/event-stream"):
                raise UpstreamError(
                    f"upstream answered a stream request with {ctype.decode(errors='replace')!r}, "
                    "not a server-sent-event stream",
                    status_code=502,
                )
            async for payload in _sse_payloads(resp.iter_bytes()):
                if done or payload == b"[DONE]":  # read on to the end of the reply: the connection is reused
                    done = True
                    continue
                events += 1
                chunk = orjson.loads(payload)
                if not isinstance(chunk, dict):
                    raise UpstreamError(
                        f"upstream stream chunk is malformed: expected a JSON object, got {type(chunk).__name__}",
                        status_code=502,
                    )
                if "error" in chunk and not chunk.get("choices"):
                    raise UpstreamError(f"upstream stream error: {chunk['error']}", status_code=502)
                try:
                    asm.feed(chunk)
                except (AttributeError, TypeError, KeyError, ValueError) as exc:
                    raise UpstreamError(
                        f"upstream stream chunk is malformed: {type(exc).__name__}: {exc}", status_code=502
                    ) from exc
                if ctx.prompt_tokens is None:  # the engine's first chunk carries the prompt's ids (or its usage)
                    ctx.prompt_tokens = _prompt_length(chunk)
                if not chunk.get("choices") and chunk.get("usage") is not None and not keep_usage:
                    continue
                if strip_engine_fields(chunk, keep_ids=keep_ids, keep_logprobs=keep_lps):
                    yield chunk
                else:
                    yield payload
            if events == 0:
                raise UpstreamError("upstream answered 200 without a single server-sent event", status_code=502)
        except Http1ReadTimeout as exc:
            raise UpstreamError(f"upstream stalled for {self.config.timeout_s}s mid-stream", status_code=504) from exc
        except (Http1Error, orjson.JSONDecodeError) as exc:
            raise UpstreamError(f"upstream stream broke: {type(exc).__name__}: {exc}", status_code=502) from exc
        finally:
            # read to the end: the connection goes back to the pool; otherwise (agent gone, upstream broken)
            # it is closed, so the engine stops generating
            resp.close()

    def _result(self, body: dict[str, Any], data: dict[str, Any], tok: EngineTokens, ctx: CallContext) -> ChatResult:
        keep_lps = bool(body.get("logprobs")) or body.get("logprobs") == 0
        strip_engine_fields(data, keep_ids=bool(body.get("return_token_ids")), keep_logprobs=keep_lps)
        checks: dict[str, Any] = {}
        if tok.n_choices > 1:
            checks["n_choices"] = tok.n_choices  # only choice 0 is recorded
        prompt_ids = tok.prompt_ids or []
        completion_ids = tok.completion_ids or []
        logprobs = tok.logprobs or []
        if tok.prompt_ids is None or tok.completion_ids is None:
            checks["missing_token_ids"] = True
        elif tok.logprobs is None:
            checks["missing_logprobs"] = True
        elif len(logprobs) != len(completion_ids):
            checks["logprob_count_mismatch"] = [len(logprobs), len(completion_ids)]
        usage = data.get("usage") or {}
        if not isinstance(usage, dict):
            raise UpstreamError(
                f"upstream answer is malformed: usage: expected an object, got {usage!r:.80}", status_code=502
            )
        return ChatResult(
            response=data,
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=logprobs,
            finish_reason=tok.finish_reason,
            token_source="engine" if "missing_token_ids" not in checks else "text_only",
            policy_version=ctx.policy_version,
            usage={k: v for k, v in usage.items() if type(v) is int},
            checks=checks,
            checked=True,  # ids and log-probs checked by shapes.py, the rest built here
        )


def _read(read: Callable[[dict[str, Any]], EngineTokens], data: dict[str, Any]) -> EngineTokens:
    """The engine's ids and log-probs; a malformed answer is a 502 (the call is recorded with this error)."""
    try:
        return read(data)
    except MalformedAnswer as exc:
        raise UpstreamError(f"upstream answer is malformed: {exc}", status_code=502) from exc


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, TransientAnswer) or (isinstance(exc, Http1Error) and not isinstance(exc, Http1ReadTimeout))


async def _sse_payloads(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent-event stream, one per event line."""
    buf = bytearray()
    async for data in chunks:
        buf += data
        start = 0
        while True:
            end = buf.find(b"\n", start)
            if end < 0:
                break
            line = bytes(buf[start:end]).rstrip(b"\r")
            start = end + 1
            if line.startswith(b"data:"):
                yield line[5:].lstrip()
        del buf[:start]
    tail = bytes(buf).strip()
    if tail.startswith(b"data:"):
        yield tail[5:].lstrip()


def _prompt_length(chunk: dict[str, Any]) -> int | None:
    """The prompt's length from a stream chunk: its ``prompt_token_ids`` (vLLM's first chunk, top level or in the
    first choice for text completions) or its usage's ``prompt_tokens``."""
    ids = chunk.get("prompt_token_ids")
    if ids is None:
        choices = chunk.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        ids = first.get("prompt_token_ids") if isinstance(first, dict) else None
    if isinstance(ids, list):
        return len(ids)
    usage = chunk.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


def _retry_after(headers: list[tuple[bytes, bytes]]) -> float | None:
    """An answer's ``Retry-After`` in seconds (the delta-seconds form; an HTTP date or nonsense: None)."""
    for name, value in headers:
        if name.lower() == b"retry-after":
            try:
                seconds = float(value)
            except ValueError:
                return None
            return seconds if 0 <= seconds < 1e9 else None
    return None


def _error_payload(raw: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None
