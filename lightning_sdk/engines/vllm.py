"""vLLM servers as the policy engine, through the OpenAI completions API with a token-id prompt.

Wire format (vllm-project/vllm ``vllm/entrypoints/openai/completion/protocol.py``, ``.../completion/serving.py``):

* ``POST /v1/completions`` with ``prompt`` as a list of token ids, ``return_token_ids: true`` (vLLM >= 0.10.2),
  ``logprobs: 1``, ``skip_special_tokens: false``, plus ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
  ``stop``, ``stop_token_ids``. Each choice carries ``token_ids`` (the sampled ids), ``prompt_token_ids``,
  ``logprobs.token_logprobs`` (one per sampled token) and ``finish_reason`` (``stop``, ``length``, ``abort``).
  Streaming: ``data: {...}`` chunks whose choice carries the ``token_ids`` and ``token_logprobs`` it adds, then
  ``data: [DONE]``.
* Weight updates use the RL endpoints that vLLM serves with ``VLLM_SERVER_DEV_MODE=1`` (vLLM 0.32:
  ``vllm/entrypoints/rl/online/api_router.py``, ``vllm/entrypoints/serve/dev/rpc/api_router.py``):
  ``POST /pause?mode=wait|keep|abort``, ``POST /collective_rpc`` ``{"method": "lightning_load_weights", "args":
  [dir]}`` (a method of ``vllm_extension.DiskReloadExtension``, which ``launch.launch_vllm`` installs with
  ``--worker-extension-cls lightning_vllm_extension.DiskReloadExtension``; it answers ``{"ok": false, "error"}``
  instead of raising, so a failed reload leaves the server up and its cause reaches the caller),
  ``POST /reset_prefix_cache``, ``POST /resume``.

Which version sampled which token: the default pause mode is ``wait`` (vLLM lets the requests in flight finish
before it pauses; new calls are held by the client meanwhile), so no call spans an update and every sampled token
carries the version recorded for its call. ``pause_mode="keep"`` (freeze in-flight requests, continue them on the
new weights: no waiting, but a call then mixes two versions, and its later tokens are sampled on top of a KV cache
the old weights computed) records the call under the version it started with, the older one, so the staleness
bound still holds for all its tokens; the per-token log-probs are what vLLM sampled either way, which is what the
learner's importance weight ``exp(logp_learner - logp_rollout)`` needs. ``abort`` cuts the calls off and
``RemoteEngine`` continues them on the new weights as separate pieces (``meta["policy_versions"]``).

LoRA adapters (``--enable-lora``, runtime loading with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; vLLM 0.32:
``vllm/entrypoints/serve/lora/api_router.py``, ``vllm/entrypoints/openai/models/serving.py``): a published PEFT
adapter directory (one holding ``adapter_config.json``) is loaded with ``POST /v1/load_lora_adapter {"lora_name":
"<model>-v<version>", "lora_path": dir}``, a new name for every policy version, so vLLM gives it a new adapter id
(its prefix cache is keyed by that id: nothing cached for an older version is reused). Calls name the served
version's adapter as their ``model``, so no pause is needed: a call in flight finishes on the adapter it started
with, and it records that version (``Generation.policy_version`` is the version whose adapter the request named);
calls made after the load name the new one. The previous version's name is then unloaded (vLLM keeps the adapter in
its cache until it is evicted, so calls still running on it are not disturbed). Version 0 is the base model under
``model`` (a fresh LoRA adapter is zero). A full-weight reload serves the base model again, without an adapter.

Log-probs: launch vLLM with ``--logprobs-mode processed_logprobs`` so they are those of the distribution it sampled
from (temperature applied), as the trainer's importance ratio needs; the default (``raw_logprobs``) ignores the
temperature.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Literal

import httpx
import orjson

from lightning_sdk.engines.base import Generation, GenerationDelta, Sampling
from lightning_sdk.engines.pool import RemoteEngine
from lightning_sdk.engines.vllm_extension import DiskReloadExtension
from lightning_sdk.errors import EngineError

__all__ = ["DiskReloadExtension", "VLLMEngine", "is_adapter_dir"]

logger = logging.getLogger(__name__)

#: the worker extension as ``launch.launch_vllm`` installs it (``vllm_extension.py`` as a top-level module)
VLLM_EXTENSION_CLS = "lightning_vllm_extension.DiskReloadExtension"

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def is_adapter_dir(source: Any) -> bool:
    """Whether ``source`` is a PEFT adapter directory (it holds ``adapter_config.json``), not a full checkpoint."""
    return isinstance(source, (str, os.PathLike)) and os.path.isfile(os.path.join(source, "adapter_config.json"))


def _finish(choice: dict[str, Any]) -> Literal["stop", "length", "abort"] | None:
    reason = choice.get("finish_reason")
    if reason is None:
        return None
    if reason not in _FINISH:
        raise EngineError(f"vLLM answered an unknown finish_reason {reason!r}")
    return _FINISH[reason]  # type: ignore[return-value]


def _ids_and_logprobs(choice: dict[str, Any]) -> tuple[list[int], list[float]]:
    ids = choice.get("token_ids")
    if ids is None:
        raise EngineError("vLLM answered without token_ids: the server must be vLLM >= 0.10.2 (return_token_ids)")
    lp = (choice.get("logprobs") or {}).get("token_logprobs")
    if lp is None:
        raise EngineError("vLLM answered without logprobs.token_logprobs")
    if len(lp) != len(ids):
        raise EngineError(f"vLLM answered {len(ids)} token ids but {len(lp)} log-probs")
    return [int(t) for t in ids], [float(x) if x is not None else 0.0 for x in lp]


class VLLMEngine(RemoteEngine):
    """One or more vLLM OpenAI servers (``http://host:port``, no ``/v1``) serving the policy (``Engine``)."""

    supports_response_format = True  # guided decoding: the proxy passes response_format on

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        model: str = "policy",
        policy_version: int = 0,
        timeout: float = 600.0,
        client: httpx.AsyncClient | None = None,
        pause_mode: Literal["wait", "keep", "abort"] = "wait",
    ) -> None:
        super().__init__(base_urls, policy_version=policy_version, timeout=timeout, client=client)
        self.model = model
        if pause_mode not in ("wait", "keep", "abort"):
            raise EngineError(f"pause_mode {pause_mode!r} is not one of wait, keep, abort")
        self.pause_mode = pause_mode
        # (adapter name, policy version) of the LoRA adapter calls name; None: the base model (``model``)
        self.adapter: tuple[str, int] | None = None

    def _served(self) -> tuple[str, int | None]:
        """The model name a call sends now and the version it stands for (None: the version the pool recorded)."""
        adapter = self.adapter
        return (self.model, None) if adapter is None else adapter

    def _body(self, input_ids: list[int], sampling: Sampling, *, stream: bool, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": input_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": stream,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.response_format is not None:  # guided decoding (CompletionRequest.response_format)
            body["response_format"] = sampling.response_format
        return body

    async def _generate_once(self, idx: int, input_ids: list[int], sampling: Sampling) -> Generation:
        model, version = self._served()
        resp = await self._post(
            idx,
            "/v1/completions",
            what="vLLM completions",
            json=self._body(input_ids, sampling, stream=False, model=model),
        )
        out = orjson.loads(resp.content)
        choice = out["choices"][0]
        ids, lps = _ids_and_logprobs(choice)
        return Generation(
            completion_ids=ids,
            logprobs=lps,
            finish_reason=_finish(choice) or "abort",
            policy_version=version,
            meta={"request_id": out.get("id"), "stop_reason": choice.get("stop_reason")},
        )

    async def _stream_once(self, idx: int, input_ids: list[int], sampling: Sampling) -> AsyncIterator[GenerationDelta]:
        url = f"{self.base_urls[idx]}/v1/completions"
        model, version = self._served()
        body = self._body(input_ids, sampling, stream=True, model=model)
        async for chunk in self._sse_events(url, body, what="vLLM completions"):
            for choice in chunk.get("choices", []):
                ids, lps = _ids_and_logprobs(choice) if choice.get("token_ids") else ([], [])
                reason = _finish(choice)
                if ids or reason is not None:
                    yield GenerationDelta(ids=ids, logprobs=lps, finish_reason=reason, policy_version=version)

    # ------------------------------------------------------------------------------------------------ weights
    async def update_weights(self, source: Any, version: int) -> None:
        """A PEFT adapter directory is loaded as a LoRA adapter of its own name (``load_adapter``); anything else
        is a full checkpoint, reloaded in place (pause, reload, resume: ``RemoteEngine``)."""
        if is_adapter_dir(source):
            await self.load_adapter(str(source), version)
            return
        await super().update_weights(source, version)
        self.adapter = None  # the new base weights, served under ``model``

    async def load_adapter(self, path: str, version: int) -> None:
        """Load the adapter in ``path`` on every server as ``<model>-v<version>``, then serve it as ``version``.

        No server is paused: calls in flight keep the adapter they named. If any server refuses, the adapter is
        unloaded from the others and the server's own error is raised; the previous version stays served."""
        name = f"{self.model}-v{version}"
        n = len(self.base_urls)
        async with self._update_lock:
            body = {"lora_name": name, "lora_path": path}
            results = await asyncio.gather(
                *(self._post(i, "/v1/load_lora_adapter", what="vLLM load_lora_adapter", json=body) for i in range(n)),
                return_exceptions=True,
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                loaded = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
                await self._unload(loaded, name)
                error = errors[0]
                if isinstance(error, EngineError) and "404" in str(error):
                    error.add_note(
                        "the server serves no runtime LoRA loading: start it with --enable-lora and "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (launch_vllm(lora_rank=...) does)"
                    )
                raise error
            previous = self.adapter
            self.adapter = (name, version)
            self._version = version
        if previous is not None:
            await self._unload(range(n), previous[0])
        logger.info("policy version %d served by %d server(s) as LoRA adapter %s", version, n, name)

    async def _unload(self, servers: Iterable[int], name: str) -> None:
        """Unload adapter ``name`` (best effort: a failure is logged; vLLM's cache evicts it anyway)."""
        body = {"lora_name": name}
        for i in servers:
            try:
                await self._post(i, "/v1/unload_lora_adapter", what="vLLM unload_lora_adapter", json=body)
            except EngineError as exc:
                logger.warning("LoRA adapter %s kept loaded: %s", name, exc)

    async def _pause_server(self, idx: int) -> None:
        await self._post(idx, "/pause", what="vLLM pause", params={"mode": self.pause_mode})

    async def _resume_server(self, idx: int) -> None:
        await self._post(idx, "/resume", what="vLLM resume")

    async def _reload_server(self, idx: int, source: Any, version: int) -> None:
        body = {"method": "lightning_load_weights", "args": [str(source)]}
        resp = await self._post(idx, "/collective_rpc", what="vLLM collective_rpc(lightning_load_weights)", json=body)
        results = orjson.loads(resp.content).get("results") if resp.content else None
        if not isinstance(results, list) or not results:
            raise EngineError(
                f"vLLM at {self.base_urls[idx]} answered the weight reload without results ({resp.text[:300]}): "
                f"is it started with --worker-extension-cls {VLLM_EXTENSION_CLS}?"
            )
        failed = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
        if failed:
            first = failed[0]
            error = first.get("error") if isinstance(first, dict) else first
            serving = first.get("serving") if isinstance(first, dict) else None
            raise EngineError(
                f"vLLM at {self.base_urls[idx]} did not load {source}: {error}"
                + (f" (still serving {serving})" if serving else "")
            )
        try:  # cached prefixes were computed by the old weights; vLLM refuses while frozen requests hold blocks
            await self._post(idx, "/reset_prefix_cache", what="vLLM reset_prefix_cache")
        except EngineError as exc:
            logger.warning("prefix cache kept after the weight update: %s", exc)
