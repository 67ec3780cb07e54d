"""SGLang servers as the policy engine, through SGLang's native API (token ids in, token ids and log-probs out).

Wire format (sgl-project/sglang ``python/sglang/srt/entrypoints/http_server.py`` and
``python/sglang/srt/managers/io_struct.py``):

* ``POST /generate`` with ``GenerateReqInput`` fields ``input_ids`` (list[int]), ``sampling_params``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``stop``, ``stop_token_ids``, ``sampling_seed``,
  ``skip_special_tokens``, ``no_stop_trim``), ``return_logprob: true``, ``stream``. The answer is
  ``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...} | null,
  "prompt_tokens", "completion_tokens", "weight_version", "output_token_logprobs": [[logprob, token_id, text|null],
  ...], ...}}``. Streaming sends ``data: {...}`` server-sent events ending with ``data: [DONE]``; by default each
  event carries the *cumulative* ``output_ids`` and ``output_token_logprobs`` (the server flag
  ``--incremental-streaming-output`` makes them deltas: pass ``incremental_streaming=True`` then).
* Weight updates: ``POST /pause_generation`` ``{"mode": "retract"}`` (running requests go back to the queue and are
  recomputed on the new weights; ``in_place`` keeps their KV cache; ``abort`` ends them — we then resume them, see
  ``pool.py``), ``POST /update_weights_from_disk`` ``{"model_path", "weight_version", "flush_cache"}`` answering
  ``{"success", "message", "num_paused_requests"}``, ``POST /continue_generation``.
  ``update_weights_from_tensor`` / ``init_weights_update_group`` + ``update_weights_from_distributed`` are exposed as
  ``update_weights_from_tensor`` and ``update_weights_from_distributed`` for trainers that push weights over
  NCCL instead of a shared disk.

SGLang's returned log-probs are those of the distribution it sampled from (temperature applied), which is what the
trainer's importance ratio needs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import httpx
import orjson

from lightning_sdk.engines.base import Generation, GenerationDelta, Sampling
from lightning_sdk.engines.pool import RemoteEngine
from lightning_sdk.errors import EngineError

__all__ = ["SGLangEngine"]

logger = logging.getLogger(__name__)

PauseMode = Literal["retract", "in_place", "abort"]


def _finish(meta: dict[str, Any]) -> Literal["stop", "length", "abort"] | None:
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind in ("stop", "length", "abort"):
        return kind  # type: ignore[return-value]
    raise EngineError(f"SGLang answered an unknown finish_reason {reason!r}")


def _version(meta: dict[str, Any]) -> int | None:
    try:
        return int(meta["weight_version"])
    except (KeyError, TypeError, ValueError):
        return None


def _logprobs(meta: dict[str, Any], ids: list[int]) -> list[float]:
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineError("SGLang answered without output_token_logprobs (was return_logprob sent?)")
    if len(entries) != len(ids):
        raise EngineError(f"SGLang answered {len(ids)} output ids but {len(entries)} log-probs")
    for (_, tok, *_rest), want in zip(entries, ids, strict=True):
        if int(tok) != want:
            raise EngineError(f"SGLang log-prob entry is for token {tok}, output id is {want}")
    return [float(e[0]) for e in entries]


class SGLangEngine(RemoteEngine):
    """One or more SGLang servers (``http://host:port``) serving the policy (implements ``Engine``)."""

    supports_response_format = True  # guided decoding: the proxy passes response_format on

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        policy_version: int = 0,
        pause_mode: PauseMode = "retract",
        incremental_streaming: bool = False,
        timeout: float = 600.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_urls, policy_version=policy_version, timeout=timeout, client=client)
        self.pause_mode = pause_mode
        self.incremental_streaming = incremental_streaming

    # ------------------------------------------------------------------------------------------------ requests
    @staticmethod
    def _body(input_ids: list[int], sampling: Sampling, *, stream: bool) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        fmt = sampling.response_format
        if fmt is not None:  # guided decoding: sampling_params.json_schema (a JSON string)
            schema = (fmt.get("json_schema") or {}).get("schema") if fmt.get("type") == "json_schema" else None
            params["json_schema"] = json.dumps(schema if isinstance(schema, dict) else {"type": "object"})
        return {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "stream": stream}

    async def _generate_once(self, idx: int, input_ids: list[int], sampling: Sampling) -> Generation:
        resp = await self._post(
            idx, "/generate", what="SGLang generate", json=self._body(input_ids, sampling, stream=False)
        )
        out = orjson.loads(resp.content)
        if isinstance(out, list):  # a batch answer to a single prompt
            out = out[0]
        meta = out.get("meta_info", {})
        ids = [int(t) for t in out.get("output_ids", [])]
        reason = _finish(meta) or "abort"
        return Generation(
            completion_ids=ids,
            logprobs=_logprobs(meta, ids),
            finish_reason=reason,
            policy_version=_version(meta),
            meta={"request_id": meta.get("id"), "cached_tokens": meta.get("cached_tokens")},
        )

    async def _stream_once(self, idx: int, input_ids: list[int], sampling: Sampling) -> AsyncIterator[GenerationDelta]:
        url = f"{self.base_urls[idx]}/generate"
        seen = 0
        async for event in self._sse_events(url, self._body(input_ids, sampling, stream=True), what="SGLang generate"):
            meta = event.get("meta_info", {})
            ids = [int(t) for t in event.get("output_ids", [])]
            lps = _logprobs(meta, ids)
            if not self.incremental_streaming:
                ids, lps = ids[seen:], lps[seen:]
            seen += len(ids)
            reason = _finish(meta)
            if ids or reason is not None:
                yield GenerationDelta(ids=ids, logprobs=lps, finish_reason=reason, policy_version=_version(meta))

    # ------------------------------------------------------------------------------------------------ weights
    async def _pause_server(self, idx: int) -> None:
        await self._post(idx, "/pause_generation", what="SGLang pause", json={"mode": self.pause_mode})

    async def _resume_server(self, idx: int) -> None:
        await self._post(idx, "/continue_generation", what="SGLang continue", json={})

    async def _reload_server(self, idx: int, source: Any, version: int) -> None:
        body = {"model_path": str(source), "weight_version": str(version), "flush_cache": True}
        resp = await self._post(idx, "/update_weights_from_disk", what="SGLang update_weights_from_disk", json=body)
        out = orjson.loads(resp.content)
        if not out.get("success", False):
            raise EngineError(f"SGLang update_weights_from_disk on {self.base_urls[idx]}: {out.get('message')}")

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], version: int) -> None:
        """Push weights serialized by SGLang's ``MultiprocessingSerializer`` (same host as the server)."""

        async def one(idx: int) -> None:
            body = {"serialized_named_tensors": serialized_named_tensors, "weight_version": str(version)}
            resp = await self._post(
                idx, "/update_weights_from_tensor", what="SGLang update_weights_from_tensor", json=body
            )
            if not orjson.loads(resp.content).get("success", False):
                raise EngineError(f"SGLang update_weights_from_tensor failed on {self.base_urls[idx]}")

        await self._swap(one, version)

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join each server to the trainer's NCCL group (server ``i`` takes ranks from ``rank_offset``)."""
        for idx in range(len(self.base_urls)):
            body = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            await self._post(idx, "/init_weights_update_group", what="SGLang init_weights_update_group", json=body)

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], version: int, group_name: str
    ) -> None:
        """Announce a broadcast the trainer is about to send over the update group; returns once loaded."""

        async def one(idx: int) -> None:
            body = {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "flush_cache": True,
                "weight_version": str(version),
            }
            await self._post(
                idx, "/update_weights_from_distributed", what="SGLang update_weights_from_distributed", json=body
            )

        await self._swap(one, version)
