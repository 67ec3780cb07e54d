"""Several policy servers behind one ``Engine``: an attempt sticks to one server, new attempts go to the least loaded.

Why sticky: an attempt's calls share their prefix (each call extends the last), so sending them to the server that
already holds that prefix in its KV/radix cache saves the prefill. ``Router`` is the routing policy alone (pure, no
I/O); ``RemoteEngine`` is the HTTP client base that SGLang and vLLM share (routing, in-flight accounting, weight
updates that pause and resume every server, and continuation of calls that a server cut off during an update);
``EnginePool`` routes over any ``Engine`` instances (e.g. several embedded engines, or mixed pools).

Weight updates never drop a call: while an update runs, new calls wait for it to finish; a call that a server
aborts during the update (a server whose pause mode aborts) is resumed afterwards from where it stopped, by sending
its prompt plus the ids it already sampled, and the pieces are joined (ids and log-probs are exact either way, only
their policy version differs; ``Generation.meta["policy_versions"]`` lists every version that sampled part of it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
import orjson

from lightning_sdk._retry import RetryPolicy, retry
from lightning_sdk.engines.base import Engine, Generation, GenerationDelta, Sampling
from lightning_sdk.errors import EngineError

__all__ = ["EnginePool", "RemoteEngine", "Router"]

logger = logging.getLogger(__name__)


class Router:
    """Pick a server index: sticky per session (LRU-bounded), least in-flight otherwise (ties: lowest index)."""

    def __init__(self, n: int, *, max_sessions: int = 100_000) -> None:
        if n < 1:
            raise EngineError("a pool needs at least one server")
        self.inflight = [0] * n
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._max_sessions = max_sessions

    def pick(self, session_id: str | None) -> int:
        if session_id is not None and session_id in self._sessions:
            self._sessions.move_to_end(session_id)
            return self._sessions[session_id]
        idx = min(range(len(self.inflight)), key=lambda i: (self.inflight[i], i))
        if session_id is not None:
            self._sessions[session_id] = idx
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return idx

    def forget(self, session_id: str) -> None:
        """Drop a finished attempt's binding."""
        self._sessions.pop(session_id, None)


class RemoteEngine(Engine):
    """Shared client logic for HTTP policy servers (subclasses implement the wire format).

    Subclasses implement ``_generate_once``, ``_stream_once`` and ``_reload_server``; optionally ``_pause_server``
    and ``_resume_server`` (no-ops here).
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        policy_version: int = 0,
        timeout: float = 600.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        self.base_urls = [u.rstrip("/") for u in urls]
        self.router = Router(len(self.base_urls))
        self._version = policy_version
        self._ready = asyncio.Event()
        self._ready.set()
        self._update_lock = asyncio.Lock()
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))

    # ------------------------------------------------------------------------------------------- Engine protocol
    @property
    def policy_version(self) -> int:
        return self._version

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        idx = self.router.pick(session_id)
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        meta: dict[str, Any] = {}
        self.router.inflight[idx] += 1
        try:
            while True:
                await self._ready.wait()
                start_version = self._version
                remaining = sampling.max_tokens - len(ids)
                part = await self._generate_once(
                    idx, input_ids + ids, sampling.model_copy(update={"max_tokens": remaining})
                )
                ids += part.completion_ids
                logprobs += part.logprobs
                meta.update(part.meta)
                cut = part.finish_reason == "abort" and self._resumable(start_version)
                # a part cut off by an update was sampled before it, whatever version the server reports at the cut
                version = start_version if cut or part.policy_version is None else part.policy_version
                if part.completion_ids and (not versions or versions[-1] != version):
                    versions.append(version)
                if cut and len(ids) < sampling.max_tokens:
                    logger.info("call cut off by a weight update after %d tokens; resuming on %s", len(ids), idx)
                    continue
                versions = versions or [version]
                meta["policy_versions"] = versions
                meta["server"] = self.base_urls[idx]
                return Generation(
                    completion_ids=ids,
                    logprobs=logprobs,
                    finish_reason=part.finish_reason,
                    policy_version=versions[-1],
                    meta=meta,
                )
        finally:
            self.router.inflight[idx] -= 1

    async def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        idx = self.router.pick(session_id)
        sent: list[int] = []
        self.router.inflight[idx] += 1
        try:
            while True:
                await self._ready.wait()
                start_version = self._version
                remaining = sampling.max_tokens - len(sent)
                resume = False
                finished = False
                async for delta in self._stream_once(
                    idx, input_ids + sent, sampling.model_copy(update={"max_tokens": remaining})
                ):
                    cut = delta.finish_reason == "abort" and self._resumable(start_version)
                    if delta.policy_version is None or cut:
                        delta = delta.model_copy(update={"policy_version": start_version})
                    sent += delta.ids
                    if cut and len(sent) < sampling.max_tokens:
                        if delta.ids:
                            yield delta.model_copy(update={"finish_reason": None})
                        resume = True
                        break
                    finished = delta.finish_reason is not None
                    yield delta
                if not resume:
                    if not finished:
                        raise EngineError(f"the stream from {self.base_urls[idx]} ended without a finish reason")
                    return
                logger.info("stream cut off by a weight update after %d tokens; resuming on %s", len(sent), idx)
        finally:
            self.router.inflight[idx] -= 1

    async def update_weights(self, source: Any, version: int) -> None:
        """Pause every server, load ``source`` (a checkpoint directory) on each, resume; serve ``version``."""

        async def load(idx: int) -> None:
            await self._reload_server(idx, source, version)

        await self._swap(load, version)

    async def _swap(self, load: Callable[[int], Awaitable[None]], version: int) -> None:
        """Hold new calls, pause every server, run ``load(idx)`` on each, resume them, release the calls.

        A failing load raises the server's own error (``version`` is not adopted) after every server was resumed:
        the servers keep serving the weights they had. Resuming is retried (a server may close the connection that
        carried a failed request); a resume that still fails is added to the load error, never raised in its place.
        """
        n = len(self.base_urls)
        async with self._update_lock:
            self._ready.clear()
            try:
                load_error: BaseException | None = None
                try:
                    await asyncio.gather(*(self._pause_server(i) for i in range(n)))
                    results = await asyncio.gather(*(load(i) for i in range(n)), return_exceptions=True)
                    errors = [r for r in results if isinstance(r, BaseException)]
                    if errors:
                        load_error = errors[0]
                        for extra in errors[1:]:
                            load_error.add_note(f"another server failed too: {extra}")
                except BaseException as exc:  # a pause that failed, or a cancellation
                    load_error = exc
                resumed = await asyncio.gather(*(self._resume_retrying(i) for i in range(n)), return_exceptions=True)
                resume_errors = [r for r in resumed if isinstance(r, BaseException)]
                if load_error is not None:
                    for err in resume_errors:
                        load_error.add_note(f"and resuming failed: {err}")
                    raise load_error
                if resume_errors:
                    raise resume_errors[0]
                self._version = version
            finally:
                self._ready.set()
        logger.info("policy version %d served by %d server(s)", version, n)

    async def _resume_retrying(self, idx: int) -> None:
        """``_resume_server`` with retries of transport errors (a connection the server closed after a failed
        request); the last error is raised."""

        def transient(exc: BaseException) -> bool:
            return isinstance(exc, EngineError) and isinstance(exc.__cause__, httpx.TransportError)

        await retry(
            lambda: self._resume_server(idx),
            policy=RetryPolicy(retries=4, backoff_s=0.2),
            retry_if=transient,
            what=f"resume {self.base_urls[idx]}",
        )

    async def close(self) -> None:
        if self._own_client:
            await self._client.aclose()

    # ------------------------------------------------------------------------------------------- for subclasses
    def _resumable(self, start_version: int) -> bool:
        """An abort is ours to resume when a weight update started or finished since the call began."""
        return (not self._ready.is_set()) or self._version != start_version

    async def _post(self, idx: int, path: str, *, what: str, **kwargs: Any) -> httpx.Response:
        url = f"{self.base_urls[idx]}{path}"
        try:
            resp = await self._client.post(url, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineError(f"{what}: {url} unreachable: {exc}") from exc
        if resp.status_code >= 400:
            raise EngineError(f"{what}: {url} answered {resp.status_code}: {resp.text[:500]}")
        return resp

    async def _sse_events(self, url: str, body: dict[str, Any], *, what: str) -> AsyncIterator[dict[str, Any]]:
        """POST ``body`` and yield the JSON events of the server-sent-event stream until ``[DONE]``; HTTP errors,
        transport failures and ``{"error": ...}`` events become ``EngineError`` naming ``what``."""
        try:
            async with self._client.stream("POST", url, json=body) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")
                    raise EngineError(f"{what}: {url} answered {resp.status_code}: {text[:500]}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    event = orjson.loads(payload)
                    if "error" in event:
                        raise EngineError(f"{what} stream error: {event['error']}")
                    yield event
        except httpx.HTTPError as exc:
            raise EngineError(f"{what}: {url} failed while streaming: {exc}") from exc

    async def _generate_once(self, idx: int, input_ids: list[int], sampling: Sampling) -> Generation:
        raise NotImplementedError

    def _stream_once(self, idx: int, input_ids: list[int], sampling: Sampling) -> AsyncIterator[GenerationDelta]:
        raise NotImplementedError

    async def _reload_server(self, idx: int, source: Any, version: int) -> None:
        raise NotImplementedError

    async def _pause_server(self, idx: int) -> None:
        return None

    async def _resume_server(self, idx: int) -> None:
        return None


class EnginePool(Engine):
    """Route over several ``Engine`` objects: sticky per session, least in-flight otherwise (implements ``Engine``)."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.engines = list(engines)
        self.router = Router(len(self.engines))
        self._version = min(e.policy_version for e in self.engines)

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int | None:
        """The shortest context of the engines that tell theirs (any engine may serve a call)."""
        known = [n for n in (e.max_model_len for e in self.engines) if n is not None]
        return min(known) if known else None

    @property
    def supports_response_format(self) -> bool:
        return all(e.supports_response_format for e in self.engines)

    @property
    def supports_top_logprobs(self) -> bool:
        return all(e.supports_top_logprobs for e in self.engines)

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        idx = self.router.pick(session_id)
        self.router.inflight[idx] += 1
        try:
            gen = await self.engines[idx].generate(input_ids, sampling, session_id=session_id)
        finally:
            self.router.inflight[idx] -= 1
        return gen.model_copy(update={"meta": {**gen.meta, "engine_index": idx}})

    async def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        idx = self.router.pick(session_id)
        self.router.inflight[idx] += 1
        try:
            async for delta in self.engines[idx].stream(input_ids, sampling, session_id=session_id):
                yield delta
        finally:
            self.router.inflight[idx] -= 1

    async def update_weights(self, source: Any, version: int) -> None:
        """Update every engine (concurrently); the pool serves ``version`` once all have it."""
        await asyncio.gather(*(e.update_weights(source, version) for e in self.engines))
        self._version = version

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))
