"""The vLLM worker extension that loads published weights from disk: runs inside vLLM's process, with vLLM alone.

This module imports nothing of ``lightning_sdk`` and none of its dependencies (only the standard library at import
time; torch and vLLM inside the method, from vLLM's own environment), because vLLM runs in its own virtual
environment (its transformers pin conflicts with verl's). ``launch.launch_vllm`` puts a copy of this file on the
vLLM process's ``PYTHONPATH`` as the top-level module ``lightning_vllm_extension`` and starts the server with
``--worker-extension-cls lightning_vllm_extension.DiskReloadExtension``; a server started by hand can do the same
(``PYTHONPATH=DIR`` where ``DIR/lightning_vllm_extension.py`` is this file).

vLLM mixes the class into each worker; ``POST /collective_rpc {"method": "lightning_load_weights", "args": [dir]}``
(dev mode) then runs ``lightning_load_weights(dir)`` on every worker:

1. vLLM's own in-place reload (``Worker.reload_weights(weights_path=dir)``, i.e.
   ``vllm/model_executor/model_loader/reload/inplace.py``): it loads the checkpoint format through the model's
   ``load_weights`` with layer-wise re-processing, so backends that repack weights after loading (vLLM's CPU
   backend empties the linear parameters into packed copies) get their packed copies rebuilt. Calling
   ``model.load_weights`` directly instead fails on CPU (``Attempted to load weight ... into parameter
   (torch.Size([0]))``).
2. A tied ``lm_head`` shares its parameter with ``embed_tokens``, so the reload updates the parameter but not the
   head's processed copy (on CPU, a packed GEMM weight): the head keeps serving the old weights (measured: largest
   log-prob difference 1.09 against a fresh server). Re-running the head's ``process_weights_after_loading``
   rebuilds it, after which the reloaded server is bit-identical to a fresh one on the new weights.

The method returns a small summary (seconds taken, whether the head was re-processed) that the HTTP answer carries.
"""

from __future__ import annotations

import json
import os
import struct
import time
import traceback
from typing import Any

__all__ = ["DiskReloadExtension"]


def _tied_lm_head(model: Any) -> Any | None:
    """The model's ``lm_head`` when it shares its weight with the input embedding, else None."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return None
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    head_weight = getattr(head, "weight", None)
    if embed is not None and head_weight is not None and head_weight is getattr(embed, "weight", None):
        return head
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
        return head
    return None


def _checkpoint_layout(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) of every ``*.safetensors`` file in ``path``, read from the file headers only
    (an 8-byte little-endian length, then JSON: the safetensors format)."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for name in files:
        with open(os.path.join(path, name), "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ValueError(f"{name} in {path} is not a safetensors file (truncated header)")
            size = struct.unpack("<Q", head)[0]
            if size > 100_000_000:
                raise ValueError(f"{name} in {path} is not a safetensors file (header of {size} bytes)")
            try:
                header = json.loads(fh.read(size))
            except ValueError as exc:
                raise ValueError(f"{name} in {path} is not a safetensors file ({exc})") from None
        for tensor, info in header.items():
            if tensor != "__metadata__":
                layout[tensor] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]))
    return layout


def _layout_mismatch(
    new: dict[str, tuple[str, tuple[int, ...]]], old: dict[str, tuple[str, tuple[int, ...]]], limit: int = 5
) -> str | None:
    # Names only in the new checkpoint are left to the model's loader (e.g. a tied ``lm_head.weight`` written
    # beside ``embed_tokens``, which it skips); missing names and different dtypes or shapes are refused.
    problems: list[str] = []
    for name in sorted(old.keys() - new.keys())[:limit]:
        problems.append(f"missing {name}")
    for name in sorted(new.keys() & old.keys()):
        if new[name] != old[name] and len(problems) < 3 * limit:
            problems.append(
                f"{name} is {new[name][0]}{list(new[name][1])}, the served model has {old[name][0]}{list(old[name][1])}"
            )
    return "; ".join(problems) or None


class DiskReloadExtension:
    """vLLM worker extension: ``lightning_load_weights(dir)`` swaps in the HF checkpoint in ``dir`` (see module).

    It never raises (an exception in a worker stops vLLM's engine core for good, and vLLM's HTTP answer then hides
    the cause): it answers ``{"ok": false, "error": ...}`` with the error instead. A checkpoint that lacks tensors
    of the checkpoint being served, or has them with other dtypes or shapes, is refused before the model is
    touched; an error during the reload itself (vLLM's own, e.g. a corrupt file) is answered after the last good
    weights were loaded back, so the server keeps serving them.
    """

    # vLLM refuses an extension that defines a name its worker has, so the worker's ``model_runner``,
    # ``vllm_config`` and ``reload_weights`` are only looked up at run time.

    def lightning_load_weights(self, path: str) -> dict[str, Any]:
        worker: Any = self
        t0 = time.perf_counter()
        state: dict[str, Any] = worker.__dict__.setdefault("_lightning_reload_state", {})
        current = str(state.get("path") or worker.vllm_config.model_config.model)
        try:
            if not os.path.isdir(path):
                raise FileNotFoundError(f"weights directory {path} does not exist")
            new = _checkpoint_layout(path)
            if "layout" not in state:
                state["layout"] = _checkpoint_layout(current)
            mismatch = _layout_mismatch(new, state["layout"])
            if mismatch:
                raise ValueError(f"the checkpoint in {path} does not fit the served model: {mismatch}")
        except Exception as exc:  # refused before the model was touched
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "path": path, "serving": current}
        try:
            reprocessed = self._lightning_reload(worker, path)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc)[-6:])}"
            try:
                self._lightning_reload(worker, current)
                restored = current
            except Exception as again:
                restored = f"nothing: reloading {current} failed too ({type(again).__name__}: {again})"
            return {"ok": False, "error": error, "path": path, "serving": restored}
        state["path"] = path
        return {"ok": True, "path": path, "seconds": time.perf_counter() - t0, "tied_head_reprocessed": reprocessed}

    @staticmethod
    def _lightning_reload(worker: Any, path: str) -> bool:
        worker.reload_weights(weights_path=path, is_checkpoint_format=True)
        head = _tied_lm_head(worker.model_runner.get_model())
        method = getattr(head, "quant_method", None) if head is not None else None
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
            return True
        return False
