"""SGLangEngine against a loopback server that speaks SGLang's native wire format.

SGLang needs a GPU, so it cannot run here; ``FakeSGLang`` stands in for it. Its request and answer shapes are taken
from sgl-project/sglang:

* ``python/sglang/srt/entrypoints/http_server.py``: ``POST /generate`` (``GenerateReqInput``; streaming answers are
  ``data: {...}\\n\\n`` events ending with ``data: [DONE]``), ``POST /update_weights_from_disk`` answering
  ``{"success", "message", "num_paused_requests"}``, ``POST /pause_generation``, ``POST /continue_generation``,
  ``GET /health``; request validation errors answer 400.
* ``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput`` (``input_ids``, ``sampling_params``,
  ``return_logprob``, ``stream``), ``UpdateWeightFromDiskReqInput`` (``model_path``, ``weight_version``, ...),
  ``PauseGenerationReqInput.mode`` in ``abort | retract | in_place``.
* ``python/sglang/srt/managers/tokenizer_manager.py`` / ``output_processor.py``: the answer
  ``{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": ...} | null, "prompt_tokens",
  "completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs": [[logprob, id, text|null], ...]}}``;
  streaming events carry the cumulative ``output_ids`` unless ``--incremental-streaming-output`` is on.

The fake "model" is a deterministic function of the context and the loaded weights (a seed read from
``<model_path>/seed.txt``), so tests can see which weights sampled which token. This file also runs as a script
(``python test_sglang.py --port N``) for the launch test.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lightning_sdk.engines.base import Engine, Sampling
from lightning_sdk.engines.launch import ManagedServer, free_port, launch_many, launch_server, launch_sglang, running
from lightning_sdk.engines.sglang import SGLangEngine
from lightning_sdk.errors import EngineError
from tests.support.servers import serve_async
from tests.support.waiting import until_async

VOCAB = 500


def next_token(context: list[int], seed: int) -> int:
    """The fake model: a deterministic next token (never 0, which tests use as EOS)."""
    return 1 + (sum(context[-3:]) * 31 + seed * 97 + len(context)) % (VOCAB - 1)


def token_logprob(token: int, seed: int) -> float:
    return -0.1 * (1 + (token + seed) % 13)


class FakeSGLang:
    """An in-process SGLang look-alike (see the module docstring for the sources of the wire format)."""

    def __init__(self, token_delay: float = 0.0) -> None:
        self.seed = 0
        self.weight_version = "0"
        self.token_delay = token_delay
        self.paused = False
        self.pause_mode = "abort"
        self.abort_epoch = 0
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.requests: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.running = 0
        self.sampled: list[int] = []  # tokens sampled so far, per request (the tests wait for calls to be under way)
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/generate", self.generate, methods=["POST", "PUT"]),
                Route("/update_weights_from_disk", self.update_from_disk, methods=["POST"]),
                Route("/pause_generation", self.pause, methods=["POST"]),
                Route("/continue_generation", self.resume, methods=["POST"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    @staticmethod
    def _error(message: str) -> JSONResponse:
        return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "code": 400}, 400)

    async def _tokens(self, body: dict[str, Any]) -> Any:
        """Yield (ids, logprobs, finish_reason|None) after each sampled token."""
        params = body["sampling_params"]
        ctx = list(body["input_ids"])
        stops = set(params.get("stop_token_ids") or []) | {0}
        ids: list[int] = []
        lps: list[float] = []
        epoch = self.abort_epoch
        self.running += 1
        call = len(self.sampled)
        self.sampled.append(0)
        try:
            for _ in range(int(params["max_new_tokens"])):
                if self.abort_epoch != epoch:  # pause(mode=abort) ends every running request
                    yield ids, lps, {"type": "abort", "message": "Abort before weight update."}
                    return
                if self.paused:  # retract / in_place: wait for continue_generation
                    await self.resumed.wait()
                tok = next_token(ctx + ids, self.seed)
                ids.append(tok)
                lps.append(token_logprob(tok, self.seed))
                self.sampled[call] += 1
                if tok in stops:
                    yield ids, lps, {"type": "stop", "matched": tok}
                    return
                yield ids, lps, None
                await asyncio.sleep(self.token_delay)
            yield ids, lps, {"type": "length", "length": len(ids)}
        finally:
            self.running -= 1

    def _out(self, rid: str, body: dict[str, Any], ids: list[int], lps: list[float], reason: Any) -> dict[str, Any]:
        return {
            "text": None if reason is None else "",
            "output_ids": list(ids),
            "meta_info": {
                "id": rid,
                "finish_reason": reason,
                "prompt_tokens": len(body["input_ids"]),
                "weight_version": self.weight_version,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
                "completion_tokens": len(ids),
                "cached_tokens": 0,
            },
        }

    async def generate(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        ids_ok = isinstance(body.get("input_ids"), list) and all(isinstance(t, int) for t in body["input_ids"])
        max_new = body.get("sampling_params", {}).get("max_new_tokens")
        if not ids_ok or not isinstance(max_new, int) or max_new < 0:
            return self._error("input_ids (list[int]) and sampling_params.max_new_tokens are required")
        if body.get("return_logprob") is not True:
            return self._error("this test server expects return_logprob=true")
        self.requests.append(body)
        rid = uuid.uuid4().hex
        if body.get("stream"):

            async def events() -> Any:
                async for ids, lps, reason in self._tokens(body):
                    yield b"data: " + orjson.dumps(self._out(rid, body, ids, lps, reason)) + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        last: Any = None
        async for step in self._tokens(body):
            last = step
        return JSONResponse(self._out(rid, body, *last))

    async def update_from_disk(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        seed_file = Path(body["model_path"]) / "seed.txt"
        if not seed_file.exists():
            msg = f"Failed to update weights: {seed_file} not found. Rolled back to the original weights."
            return JSONResponse({"success": False, "message": msg, "num_paused_requests": 0}, 400)
        self.seed = int(seed_file.read_text())
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        self.events.append(f"update:{self.seed}")
        msg = "Succeeded to update model weights."
        return JSONResponse({"success": True, "message": msg, "num_paused_requests": self.running})

    async def pause(self, request: Request) -> Response:
        raw = await request.body()
        self.pause_mode = (orjson.loads(raw) if raw else {}).get("mode", "abort")
        self.paused = True
        self.resumed.clear()
        if self.pause_mode == "abort":
            self.abort_epoch += 1
        self.events.append(f"pause:{self.pause_mode}")
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: Request) -> Response:
        self.paused = False
        self.resumed.set()
        self.events.append("continue")
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


# ---------------------------------------------------------------------------------------------------------- tests


def expected(prompt: list[int], n: int, seed: int = 0) -> tuple[list[int], list[float]]:
    ids: list[int] = []
    for _ in range(n):
        ids.append(next_token(prompt + ids, seed))
    return ids, [token_logprob(t, seed) for t in ids]


def _under_way(fake: FakeSGLang, calls: int, tokens: int = 3) -> bool:
    """``calls`` requests are running and each has sampled ``tokens`` tokens."""
    return fake.running == calls and len(fake.sampled) >= calls and min(fake.sampled[-calls:]) >= tokens


def weights_dir(tmp_path: Path, seed: int) -> Path:
    d = tmp_path / f"v{seed}"
    d.mkdir()
    (d / "seed.txt").write_text(str(seed))
    return d


async def test_generate_parses_ids_logprobs_and_version() -> None:
    fake = FakeSGLang()
    async with serve_async(fake.app) as srv:
        engine = SGLangEngine(srv.url)
        assert isinstance(engine, Engine)
        gen = await engine.generate([5, 6, 7], Sampling(max_tokens=6, temperature=0.7, seed=3))
        await engine.close()
    want_ids, want_lps = expected([5, 6, 7], 6)
    assert gen.completion_ids == want_ids
    assert gen.logprobs == pytest.approx(want_lps)
    assert gen.finish_reason == "length"
    assert gen.policy_version == 0
    body = fake.requests[0]
    assert body["input_ids"] == [5, 6, 7] and body["return_logprob"] is True and body["stream"] is False
    assert body["sampling_params"] == {
        "max_new_tokens": 6,
        "temperature": 0.7,
        "top_p": 1.0,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 3,
    }


async def test_stop_token_and_stream_match_non_stream() -> None:
    fake = FakeSGLang()
    prompt = [11, 12]
    ids, _ = expected(prompt, 8)
    stop = ids[4]
    async with serve_async(fake.app) as srv:
        engine = SGLangEngine(srv.url)
        gen = await engine.generate(prompt, Sampling(max_tokens=8, stop_token_ids=[stop]))
        deltas = [d async for d in engine.stream(prompt, Sampling(max_tokens=8, stop_token_ids=[stop]))]
        await engine.close()
    assert gen.completion_ids == ids[:5] and gen.finish_reason == "stop"
    assert [t for d in deltas for t in d.ids] == gen.completion_ids
    assert [x for d in deltas for x in d.logprobs] == pytest.approx(gen.logprobs)
    assert [d.finish_reason for d in deltas] == [None, None, None, None, "stop"]
    assert all(len(d.ids) == 1 for d in deltas)  # cumulative events turned into one-token deltas
    assert fake.requests[1]["stream"] is True


async def test_update_weights_keeps_in_flight_call_retract_mode(tmp_path: Path) -> None:
    """An update during a call: pause(retract) -> load -> continue; the call finishes on the new weights."""
    fake = FakeSGLang(token_delay=0.02)
    prompt = [3, 4]
    async with serve_async(fake.app) as srv:
        engine = SGLangEngine(srv.url, pause_mode="retract")
        call = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=30)))
        await until_async(lambda: _under_way(fake, 1), what="the call a few tokens in")
        await engine.update_weights(weights_dir(tmp_path, 5), version=1)
        gen = await call
        after = await engine.generate(prompt, Sampling(max_tokens=4))
        await engine.close()
    assert fake.events == ["pause:retract", "update:5", "continue"]
    assert len(gen.completion_ids) == 30 and gen.finish_reason == "length"
    assert gen.policy_version == 1 and engine.policy_version == 1
    assert len(fake.requests) == 2  # not re-sent: the server kept it
    old_ids, _ = expected(prompt, 30, seed=0)
    assert gen.completion_ids[:2] == old_ids[:2]  # sampled before the pause
    assert gen.completion_ids != old_ids  # ... and the rest after the swap
    assert after.completion_ids == expected(prompt, 4, seed=5)[0]


async def test_update_weights_resumes_calls_the_server_aborted(tmp_path: Path) -> None:
    """With pause mode ``abort`` the server ends the call; the client resumes it from the sampled ids."""
    fake = FakeSGLang(token_delay=0.02)
    prompt = [9, 9, 9]
    async with serve_async(fake.app) as srv:
        engine = SGLangEngine(srv.url, pause_mode="abort")
        call = asyncio.create_task(engine.generate(prompt, Sampling(max_tokens=20)))
        stream_call = asyncio.create_task(_collect(engine.stream(prompt, Sampling(max_tokens=20))))
        await until_async(lambda: _under_way(fake, 2), what="two calls a few tokens in")
        await engine.update_weights(weights_dir(tmp_path, 7), version=3)
        gen, deltas = await call, await stream_call
        await engine.close()
    assert len(gen.completion_ids) == 20 and gen.finish_reason == "length"
    assert gen.meta["policy_versions"] == [0, 3] and gen.policy_version == 3
    _, second = [r for r in fake.requests if not r["stream"]]
    n_before = len(second["input_ids"]) - len(prompt)
    assert second["input_ids"] == prompt + gen.completion_ids[:n_before]
    assert second["sampling_params"]["max_new_tokens"] == 20 - n_before
    assert gen.completion_ids[n_before:] == expected(second["input_ids"], 20 - n_before, seed=7)[0]
    ids = [t for d in deltas for t in d.ids]
    assert len(ids) == 20 and deltas[-1].finish_reason == "length"
    assert {d.policy_version for d in deltas} == {0, 3}
    assert all(d.finish_reason is None for d in deltas[:-1])


async def _collect(stream: Any) -> list[Any]:
    return [d async for d in stream]


async def test_sticky_sessions_and_least_loaded_across_servers() -> None:
    fakes = [FakeSGLang(token_delay=0.01), FakeSGLang(token_delay=0.01)]
    async with serve_async(fakes[0].app) as a, serve_async(fakes[1].app) as b:
        engine = SGLangEngine([a.url, b.url])
        s = Sampling(max_tokens=5)
        first = await asyncio.gather(
            engine.generate([1], s, session_id="att-1"), engine.generate([2], s, session_id="att-2")
        )
        await asyncio.gather(*(engine.generate([1, 2, 3], s, session_id="att-1") for _ in range(3)))
        await engine.close()
    assert {g.meta["server"] for g in first} == {a.url, b.url}
    server_of_1 = first[0].meta["server"]
    fake_of_1 = fakes[0] if server_of_1 == a.url else fakes[1]
    other = fakes[1] if fake_of_1 is fakes[0] else fakes[0]
    assert [r["input_ids"] for r in fake_of_1.requests] == [[1], [1, 2, 3], [1, 2, 3], [1, 2, 3]]
    assert [r["input_ids"] for r in other.requests] == [[2]]


async def test_update_on_every_server_and_errors(tmp_path: Path) -> None:
    fakes = [FakeSGLang(), FakeSGLang()]
    async with serve_async(fakes[0].app) as a, serve_async(fakes[1].app) as b:
        engine = SGLangEngine([a.url, b.url])
        await engine.update_weights(weights_dir(tmp_path, 2), version=4)
        assert [f.events for f in fakes] == [["pause:retract", "update:2", "continue"]] * 2
        with pytest.raises(EngineError, match=r"seed\.txt not found"):
            await engine.update_weights(tmp_path / "missing", version=5)
        assert engine.policy_version == 4  # a failed update keeps the old version ...
        assert all(f.events[-1] == "continue" for f in fakes)  # ... and resumes the servers
        bad = SGLangEngine(a.url)
        with pytest.raises(EngineError, match="answered 400"):
            await bad.generate([1], Sampling(max_tokens=-1))
        await bad.close()
        await engine.close()
    gone = SGLangEngine(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(EngineError, match="unreachable"):
        await gone.generate([1], Sampling(max_tokens=2))
    await gone.close()


async def test_a_stream_cut_short_is_an_error() -> None:
    """A server that closes the event stream before a finish reason (a crash mid-generation) raises EngineError."""

    async def cut(request: Request) -> Response:
        async def events() -> Any:
            event = {
                "text": None,
                "output_ids": [7],
                "meta_info": {
                    "id": "x",
                    "finish_reason": None,
                    "weight_version": "0",
                    "output_token_logprobs": [[-0.5, 7, None]],
                },
            }
            yield b"data: " + orjson.dumps(event) + b"\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/generate", cut, methods=["POST"])])
    async with serve_async(app) as srv:
        engine = SGLangEngine(srv.url)
        got: list[Any] = []
        with pytest.raises(EngineError, match="ended without a finish reason"):
            async for delta in engine.stream([1, 2], Sampling(max_tokens=4)):
                got.append(delta)
        await engine.close()
    assert [d.ids for d in got] == [[7]]


def test_launch_many_health_waits_routes_and_stops(tmp_path: Path) -> None:
    """Two real child processes (this file as a script) started by ``launch_many``; the client spreads attempts
    over them; ``running`` stops both."""
    root = Path(__file__).resolve().parents[2]

    def launcher(model_path: Path, *, gpus: list[int]) -> ManagedServer:
        port = free_port()
        return launch_server(
            [sys.executable, __file__, "--port", str(port)],
            port=port,
            env={"PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))},
            log_path=tmp_path / f"fake-{gpus[0]}.log",
            timeout=60,
        )

    servers = launch_many(launcher, tmp_path, gpus=[[0], [1]])
    assert all(s.running() for s in servers)
    with running(servers) as urls:

        async def call() -> list[Any]:
            engine = SGLangEngine(urls)
            try:
                return list(
                    await asyncio.gather(
                        engine.generate([4, 5], Sampling(max_tokens=3), session_id="a"),
                        engine.generate([4, 5], Sampling(max_tokens=3), session_id="b"),
                    )
                )
            finally:
                await engine.close()

        gens = asyncio.run(call())
    assert [g.completion_ids for g in gens] == [expected([4, 5], 3)[0]] * 2
    assert {g.meta["server"] for g in gens} == set(urls)
    assert not any(s.running() for s in servers)


def test_launch_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="exited with code 3 during start-up"):
        launch_server(
            [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
            port=free_port(),
            log_path=tmp_path / "x.log",
            timeout=30,
        )
    with pytest.raises(EngineError, match="cannot start"):
        launch_server(["/nonexistent/sglang-binary"], port=free_port(), timeout=5)
    with pytest.raises(EngineError, match="SGLang is not installed"):
        launch_sglang(tmp_path)


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    uvicorn.run(FakeSGLang().app, host=args.host, port=args.port, log_level="warning")
