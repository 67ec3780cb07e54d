"""VLLMEngine against a loopback server that speaks vLLM's OpenAI completions wire format and its RL endpoints.

vLLM's official wheels are CUDA-only, so ``FakeVLLM`` stands in for it. Shapes are taken from vllm-project/vllm:

* ``vllm/entrypoints/openai/completion/protocol.py``: ``CompletionRequest`` (``prompt`` may be a list of token ids;
  ``return_token_ids``, ``logprobs: int``, ``skip_special_tokens``, ``stop_token_ids``, ``seed``) and the answers
  ``CompletionResponse`` / ``CompletionResponseChoice`` (``index``, ``text``, ``logprobs`` =
  ``CompletionLogProbs{text_offset, token_logprobs, tokens, top_logprobs}``, ``finish_reason``, ``stop_reason``,
  ``token_ids``, ``prompt_logprobs``, ``prompt_token_ids``), ``CompletionStreamResponse`` whose
  ``CompletionResponseStreamChoice`` carries the ``token_ids`` it adds (``prompt_token_ids`` on the first chunk);
  streams end with ``data: [DONE]``.
* ``vllm/entrypoints/serve/dev/rlhf/api_router.py`` (``VLLM_SERVER_DEV_MODE=1``): ``POST /pause`` with query
  ``mode`` in ``abort | wait | keep`` answering ``{"status": "paused"}``, ``POST /resume`` answering
  ``{"status": "resumed"}``; ``vllm/entrypoints/serve/dev/rpc/api_router.py``: ``POST /collective_rpc``
  ``{"method", "args", "kwargs", "timeout"}`` answering ``{"results": [...]}``; ``POST /reset_prefix_cache``.

``collective_rpc("lightning_load_weights", [dir])`` reads ``<dir>/seed.txt`` here, standing in for our
``DiskReloadExtension`` inside vLLM's workers (which is tested on its own below with a stand-in model runner).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lightning_sdk.engines.base import Engine, Sampling
from lightning_sdk.engines.launch import launch_vllm
from lightning_sdk.engines.vllm import DiskReloadExtension, VLLMEngine
from lightning_sdk.errors import EngineError
from tests.support.servers import serve_async

VOCAB = 500


def next_token(context: list[int], seed: int) -> int:
    return 1 + (sum(context[-2:]) * 17 + seed * 131 + len(context)) % (VOCAB - 1)


def token_logprob(token: int, seed: int) -> float:
    return -0.05 * (1 + (token * 3 + seed) % 11)


class FakeVLLM:
    """An in-process vLLM look-alike (see the module docstring for the sources of the wire format)."""

    def __init__(self, token_delay: float = 0.0) -> None:
        self.seed = 0
        self.token_delay = token_delay
        self.paused = False
        self.abort_epoch = 0
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.requests: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.running = 0
        self.app = Starlette(
            routes=[
                Route("/health", lambda r: Response(status_code=200), methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/pause", self.pause, methods=["POST"]),
                Route("/resume", self.resume, methods=["POST"]),
                Route("/collective_rpc", self.collective_rpc, methods=["POST"]),
                Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            ]
        )

    async def _tokens(self, body: dict[str, Any]) -> Any:
        ctx = list(body["prompt"])
        stops = set(body.get("stop_token_ids") or []) | {0}
        epoch = self.abort_epoch
        ids: list[int] = []
        self.running += 1
        try:
            for _ in range(int(body.get("max_tokens") or 16)):
                if self.abort_epoch != epoch:
                    yield ids, "abort"
                    return
                if self.paused:
                    await self.resumed.wait()
                tok = next_token(ctx + ids, self.seed)
                ids.append(tok)
                if tok in stops:
                    yield ids, "stop"
                    return
                yield ids, None
                await asyncio.sleep(self.token_delay)
            yield ids, "length"
        finally:
            self.running -= 1

    def _logprobs(self, ids: list[int]) -> dict[str, Any]:
        lps = [token_logprob(t, self.seed) for t in ids]
        return {
            "text_offset": list(range(len(ids))),
            "token_logprobs": lps,
            "tokens": [f"token_id:{t}" for t in ids],
            "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, lps, strict=True)],
        }

    async def completions(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return JSONResponse(
                {
                    "object": "error",
                    "message": "prompt must be token ids here",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
                400,
            )
        if body.get("return_token_ids") is not True or not isinstance(body.get("logprobs"), int):
            return JSONResponse(
                {
                    "object": "error",
                    "message": "expected return_token_ids and logprobs",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
                400,
            )
        self.requests.append(body)
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.get("model", "policy")
        if body.get("stream"):

            async def chunks() -> Any:
                sent = 0
                async for ids, reason in self._tokens(body):
                    new = ids[sent:]
                    choice = {
                        "index": 0,
                        "text": "",
                        "logprobs": self._logprobs(new),
                        "finish_reason": reason,
                        "stop_reason": None,
                        "prompt_token_ids": prompt if sent == 0 else None,
                        "token_ids": new,
                    }
                    sent = len(ids)
                    chunk = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")
        last: Any = None
        async for step in self._tokens(body):
            last = step
        ids, reason = last
        choice = {
            "index": 0,
            "text": "",
            "logprobs": self._logprobs(ids),
            "finish_reason": reason,
            "stop_reason": None,
            "token_ids": ids,
            "prompt_logprobs": None,
            "prompt_token_ids": prompt,
        }
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids), "completion_tokens": len(ids)}
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def pause(self, request: Request) -> Response:
        mode = request.query_params.get("mode", "abort")
        self.paused = True
        self.resumed.clear()
        if mode == "abort":
            self.abort_epoch += 1
        self.events.append(f"pause:{mode}")
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        self.paused = False
        self.resumed.set()
        self.events.append("resume")
        return JSONResponse({"status": "resumed"})

    async def collective_rpc(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        if body.get("method") != "lightning_load_weights":
            return JSONResponse({"error": f"unknown method {body.get('method')}"}, 400)
        seed_file = Path(body["args"][0]) / "seed.txt"
        if not seed_file.exists():
            return JSONResponse({"object": "error", "message": f"FileNotFoundError: {seed_file}", "code": 500}, 500)
        self.seed = int(seed_file.read_text())
        self.events.append(f"load:{self.seed}")
        return JSONResponse({"results": [1]})

    async def reset_prefix_cache(self, request: Request) -> Response:
        self.events.append("reset_prefix_cache")
        return Response(status_code=200)


def expected(prompt: list[int], n: int, seed: int = 0) -> tuple[list[int], list[float]]:
    ids: list[int] = []
    for _ in range(n):
        ids.append(next_token(prompt + ids, seed))
    return ids, [token_logprob(t, seed) for t in ids]


def weights_dir(tmp_path: Path, seed: int) -> Path:
    d = tmp_path / f"v{seed}"
    d.mkdir()
    (d / "seed.txt").write_text(str(seed))
    return d


async def _collect(stream: Any) -> list[Any]:
    return [d async for d in stream]


async def test_completions_with_token_prompt_and_stream() -> None:
    fake = FakeVLLM()
    prompt = [21, 22, 23]
    ids, lps = expected(prompt, 10)
    async with serve_async(fake.app) as srv:
        engine = VLLMEngine(srv.url)
        assert isinstance(engine, Engine)
        gen = await engine.generate(prompt, Sampling(max_tokens=10, temperature=0.9, seed=1, stop=["\n"]))
        stopped = await engine.generate(prompt, Sampling(max_tokens=10, stop_token_ids=[ids[3]]))
        deltas = await _collect(engine.stream(prompt, Sampling(max_tokens=10)))
        await engine.close()
    assert gen.completion_ids == ids and gen.logprobs == pytest.approx(lps) and gen.finish_reason == "length"
    assert gen.policy_version == 0
    assert stopped.completion_ids == ids[:4] and stopped.finish_reason == "stop"
    assert [t for d in deltas for t in d.ids] == ids
    assert [x for d in deltas for x in d.logprobs] == pytest.approx(lps)
    assert deltas[-1].finish_reason == "length"
    body = fake.requests[0]
    assert body["prompt"] == prompt and body["model"] == "policy"
    assert body["return_token_ids"] is True and body["logprobs"] == 1 and body["skip_special_tokens"] is False
    assert (body["max_tokens"], body["temperature"], body["seed"], body["stop"]) == (10, 0.9, 1, ["\n"])


async def test_weight_reload_keeps_in_flight_calls(tmp_path: Path) -> None:
    """pause(mode=keep) freezes the call; load; reset prefix cache; resume; the call ends on the new weights."""
    fake = FakeVLLM(token_delay=0.02)
    prompt = [1, 2, 3]
    async with serve_async(fake.app) as srv:
        engine = VLLMEngine(srv.url)
        call = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=25)))
        streamed = asyncio.create_task(_collect(engine.stream(prompt, Sampling(max_tokens=25))))
        while fake.running < 2:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        await engine.update_weights(weights_dir(tmp_path, 4), version=2)
        gen, deltas = await call, await streamed
        after = await engine.generate(prompt, Sampling(max_tokens=3))
        await engine.close()
    assert fake.events == ["pause:keep", "load:4", "reset_prefix_cache", "resume"]
    assert len(gen.completion_ids) == 25 and gen.finish_reason == "length"
    assert len([t for d in deltas for t in d.ids]) == 25 and deltas[-1].finish_reason == "length"
    assert len(fake.requests) == 3  # nothing re-sent
    assert gen.completion_ids != expected(prompt, 25, seed=0)[0]  # the tail came from the new weights
    assert after.completion_ids == expected(prompt, 3, seed=4)[0] and after.policy_version == 2


async def test_errors_are_engine_errors(tmp_path: Path) -> None:
    fake = FakeVLLM()
    async with serve_async(fake.app) as srv:
        engine = VLLMEngine(srv.url)
        with pytest.raises(EngineError, match="FileNotFoundError"):
            await engine.update_weights(tmp_path / "nowhere", version=1)
        assert engine.policy_version == 0 and fake.events[-1] == "resume"
        await engine.close()

    async def no_token_ids(request: Request) -> Response:
        return JSONResponse(
            {"id": "x", "choices": [{"index": 0, "text": "hi", "finish_reason": "stop", "logprobs": None}]}
        )

    old = Starlette(routes=[Route("/v1/completions", no_token_ids, methods=["POST"])])
    async with serve_async(old) as srv:
        engine = VLLMEngine(srv.url)
        with pytest.raises(EngineError, match=r"vLLM >= 0\.10\.2"):
            await engine.generate([1], Sampling(max_tokens=2))
        await engine.close()


async def test_stream_failures_are_engine_errors() -> None:
    """A stream that answers 5xx, or carries an ``{"error": ...}`` event mid-way (vLLM's ``ErrorResponse`` in a
    ``data:`` line), raises ``EngineError`` naming the engine, after the deltas that came before it."""

    answer_500 = False

    async def failing(request: Request) -> Response:
        if answer_500:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def events() -> Any:
            first = {"choices": [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": None,
                                  "logprobs": {"token_logprobs": [-0.5], "tokens": ["a"]}}]}  # fmt: skip
            yield b"data: " + orjson.dumps(first) + b"\n\n"
            yield b"data: " + orjson.dumps({"error": {"message": "engine died", "code": 500}}) + b"\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", failing, methods=["POST"])])
    async with serve_async(app) as srv:
        engine = VLLMEngine(srv.url)
        got: list[int] = []
        with pytest.raises(EngineError, match=r"vLLM completions stream error: .*engine died"):
            async for delta in engine.stream([1, 2], Sampling(max_tokens=4)):
                got.extend(delta.ids)
        assert got == [7]
        await engine.close()
        answer_500 = True
        engine = VLLMEngine(srv.url)
        with pytest.raises(EngineError, match=r"vLLM completions: .* answered 500: .*boom"):
            async for _ in engine.stream([1], Sampling(max_tokens=2)):
                pass
        await engine.close()


def test_disk_reload_extension_feeds_model_load_weights(tmp_path: Path) -> None:
    """The worker extension reads every safetensors file and hands (name, tensor) pairs to ``load_weights``."""
    from safetensors.torch import save_file

    save_file({"a.weight": torch.ones(2, 2)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"b.bias": torch.zeros(3)}, str(tmp_path / "model-00002.safetensors"))
    got: dict[str, torch.Tensor] = {}

    class Model:
        def load_weights(self, weights: Any) -> set[str]:
            for name, t in weights:
                got[name] = t
            return set(got)

    class Runner:
        model = Model()

    ext = DiskReloadExtension()
    ext.model_runner = Runner()
    assert ext.lightning_load_weights(str(tmp_path)) == 2
    assert torch.equal(got["a.weight"], torch.ones(2, 2)) and torch.equal(got["b.bias"], torch.zeros(3))
    with pytest.raises(FileNotFoundError):
        ext.lightning_load_weights(str(tmp_path / "empty"))


def test_launch_vllm_without_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EngineError, match="vLLM is not installed"):
        launch_vllm(tmp_path)
