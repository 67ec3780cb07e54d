"""A loopback OpenAI-compatible upstream that also speaks vLLM's ``return_token_ids``, for tests and benchmarks.

Not a model: replies are scripted (``MockOpenAI.reply``) and "tokenized" with a tiny byte-level tokenizer
(``encode(text) = [b + 3 for b in text.encode()]``, ids 0..2 reserved, ``EOS_ID = 2`` appended on ``stop``), so a
test can compute exactly which ids and logprobs must land in the store.

Wire format (what a vLLM >= 0.10.2 OpenAI server sends; read from vllm-project/vllm
``vllm/entrypoints/openai/protocol.py`` — ``ChatCompletionRequest.return_token_ids``, ``ChatCompletionResponse.
prompt_token_ids``, ``ChatCompletionResponseChoice.token_ids``, ``ChatCompletionStreamResponse.prompt_token_ids``,
``ChatCompletionResponseStreamChoice.token_ids``, and the completion equivalents — and ``serving_chat.py``):

* request ``"return_token_ids": true`` → non-stream: top-level ``prompt_token_ids`` and per-choice ``token_ids``;
  stream: the first (role) chunk carries ``prompt_token_ids``, each later chunk's choice the ``token_ids`` it adds.
  ``/v1/completions`` puts both on the choice (``choices[i].prompt_token_ids``, ``choices[i].token_ids``).
* request ``"logprobs": true`` → chat: ``choices[].logprobs.content[] = {token, logprob, bytes, top_logprobs}``;
  completions (``"logprobs": N``): ``choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}``.
* ``stream_options.include_usage`` → a last chunk with ``usage`` and no choices; then ``data: [DONE]``.

Use::

    mock = MockOpenAI()                       # or MockOpenAI(fail_first=2, fail_status=429), MockOpenAI(delay_s=5)
    with run_server(mock.app) as upstream:    # tests.support.servers
        ... f"{upstream.url}/v1" ...
    mock.requests                             # every JSON body received, in order
    mock.expected_ids(messages, reply)        # what the ids of a call must be

Knobs (attributes, change them between calls):

* ``reply``: text, or a function ``body -> MockReply`` (default: call the first tool, then echo the tool result);
* ``fail_first`` / ``fail_status``: answer the next k requests with an OpenAI error (counts down);
* ``drop_first``: cut the connection mid-response on the next k requests after those (counts down);
* ``delay_s``: sleep before answering; ``chunk_delay_s``: sleep between stream chunks;
* ``supports_token_ids``: False = a plain OpenAI server that ignores ``return_token_ids``;
* ``include_usage``: False = never report usage (as some providers do);
* ``api_key``: the bearer the mock requires (None = any); ``chunk_tokens``: tokens per stream chunk.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = [
    "EOS_ID",
    "MockOpenAI",
    "MockReply",
    "decode",
    "encode",
    "logprob_of",
    "render_prompt",
]

EOS_ID = 2
_OFFSET = 3


def encode(text: str) -> list[int]:
    """The mock's tokenizer: one id per UTF-8 byte (byte + 3)."""
    return [b + _OFFSET for b in text.encode("utf-8")]


def decode(ids: list[int]) -> str:
    return bytes(i - _OFFSET for i in ids if i >= _OFFSET).decode("utf-8", errors="replace")


def logprob_of(position: int) -> float:
    """The log-prob the mock reports for the completion token at ``position`` (deterministic, exact in JSON)."""
    return -0.125 * ((position % 7) + 1)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def render_prompt(messages: list[dict[str, Any]]) -> str:
    """The mock's chat template: ``<|role|>content\\n`` per message (tool calls as JSON), then ``<|assistant|>``."""
    out = []
    for m in messages:
        text = _content_text(m.get("content"))
        if m.get("tool_calls"):
            text += json.dumps(m["tool_calls"], sort_keys=True)
        out.append(f"<|{m.get('role', 'user')}|>{text}\n")
    out.append("<|assistant|>")
    return "".join(out)


@dataclass
class MockReply:
    """What the mock answers: text, or tool calls (``[{"name": ..., "arguments": "<json>"}]``)."""

    text: str = ""
    tool_calls: list[dict[str, str]] = field(default_factory=list)

    def completion_text(self) -> str:
        """The text the completion token ids encode (tool calls are rendered the way the template would)."""
        if self.tool_calls:
            return "".join(f"<tool_call>{json.dumps(tc, sort_keys=True)}</tool_call>" for tc in self.tool_calls)
        return self.text


def default_reply(body: dict[str, Any]) -> MockReply:
    """Call the first tool when tools are offered and the last message is the user's; otherwise say hello."""
    messages = body.get("messages") or []
    tools = body.get("tools") or []
    last = messages[-1] if messages else {}
    if tools and body.get("tool_choice") != "none" and last.get("role") == "user":
        name = tools[0]["function"]["name"]
        return MockReply(
            tool_calls=[{"name": name, "arguments": json.dumps({"query": _content_text(last["content"])})}]
        )
    if last.get("role") == "tool":
        return MockReply(text=f"The tool said: {_content_text(last.get('content'))}")
    return MockReply(text="Hello from the mock upstream.")


class MockOpenAI:
    """The mock upstream. ``app`` is the starlette app; every knob is a plain attribute (see module docstring)."""

    def __init__(
        self,
        *,
        reply: str | Callable[[dict[str, Any]], MockReply] | None = None,
        fail_first: int = 0,
        fail_status: int = 500,
        drop_first: int = 0,
        delay_s: float = 0.0,
        chunk_delay_s: float = 0.0,
        supports_token_ids: bool = True,
        include_usage: bool = True,
        api_key: str | None = None,
        chunk_tokens: int = 4,
        models: list[str] | None = None,
        record_requests: bool = True,
    ) -> None:
        self.reply = reply
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.drop_first = drop_first
        self.delay_s = delay_s
        self.chunk_delay_s = chunk_delay_s
        self.supports_token_ids = supports_token_ids
        self.include_usage = include_usage
        self.api_key = api_key
        self.chunk_tokens = chunk_tokens
        self.models = models or ["policy"]
        self.record_requests = record_requests
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.n_requests = 0
        self.cancelled = 0  # requests whose client went away before the end (slow replies and streams)
        self._ids = itertools.count()
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )

    # -- helpers a test uses to compute expectations -------------------------------------------------------------
    def reply_for(self, body: dict[str, Any]) -> MockReply:
        if self.reply is None:
            return default_reply(body)
        if isinstance(self.reply, str):
            return MockReply(text=self.reply)
        return self.reply(body)

    @staticmethod
    def expected_ids(
        messages: list[dict[str, Any]], reply: MockReply | str, *, max_tokens: int | None = None
    ) -> tuple[list[int], list[int], list[float], str]:
        """``(prompt_ids, completion_ids, logprobs, finish_reason)`` the mock produces for these messages."""
        r = MockReply(text=reply) if isinstance(reply, str) else reply
        return _generate(encode(render_prompt(messages)), r, max_tokens)

    # -- routes --------------------------------------------------------------------------------------------------
    async def _gate(self, request: Request) -> tuple[dict[str, Any] | None, Response | None, bool]:
        """Common request handling: record, auth, scripted failures, delay. Returns (body, error, drop)."""
        self.n_requests += 1
        n = self.n_requests
        body = json.loads(await request.body())
        if self.record_requests:
            self.requests.append(body)
            self.headers.append(dict(request.headers))
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return None, _error(401, "invalid api key", "authentication_error"), False
        if self.fail_first > 0:
            self.fail_first -= 1
            return None, _error(self.fail_status, f"scripted failure (request {n})", "server_error"), False
        drop = self.drop_first > 0
        if drop:
            self.drop_first -= 1
        if self.delay_s:
            deadline = time.monotonic() + self.delay_s
            while time.monotonic() < deadline:  # a slow engine that notices when the client goes away
                if await request.is_disconnected():
                    self.cancelled += 1
                    return None, _error(499, "client went away", "cancelled"), False
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return body, None, drop

    async def _models(self, request: Request) -> Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "mock"} for m in self.models]
        return JSONResponse({"object": "list", "data": data})

    async def _chat(self, request: Request) -> Response:
        body, err, drop = await self._gate(request)
        if err is not None or body is None:
            return err or _error(500, "no body", "server_error")
        reply = self.reply_for(body)
        prompt_ids = encode(render_prompt(body.get("messages") or []))
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        _, ids, lps, finish = _generate(prompt_ids, reply, max_tokens)
        want_ids = bool(body.get("return_token_ids")) and self.supports_token_ids
        want_lps = bool(body.get("logprobs"))
        cid = f"chatcmpl-mock{next(self._ids)}"
        model = body.get("model", "policy")
        if reply.tool_calls and finish == "stop":
            finish = "tool_calls"
        if body.get("stream"):
            usage_opt = (body.get("stream_options") or {}).get("include_usage", False)
            gen = self._chat_stream(
                cid, model, prompt_ids, reply, ids, lps, finish, want_ids, want_lps, usage_opt, drop
            )
            return StreamingResponse(gen, media_type="text/event-stream")
        message: dict[str, Any] = {"role": "assistant", "content": None if reply.tool_calls else decode(ids)}
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", "function": dict(tc)} for i, tc in enumerate(reply.tool_calls)
            ]
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if want_lps:
            choice["logprobs"] = {"content": _chat_logprobs(ids, lps)}
        if want_ids:
            choice["token_ids"] = ids
        resp: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }
        if self.include_usage:
            resp["usage"] = _usage(prompt_ids, ids)
        if want_ids:
            resp["prompt_token_ids"] = prompt_ids
        if drop:
            return _dropped(resp)
        return JSONResponse(resp)

    async def _chat_stream(
        self,
        cid: str,
        model: str,
        prompt_ids: list[int],
        reply: MockReply,
        ids: list[int],
        lps: list[float],
        finish: str,
        want_ids: bool,
        want_lps: bool,
        usage_opt: bool,
        drop: bool,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunk(delta: dict[str, Any], extra: dict[str, Any], finish_reason: str | None = None) -> bytes:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            choice.update(extra)
            obj: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [choice],
            }
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        try:
            first: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
            first["choices"] = [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ]
            if want_ids:
                first["prompt_token_ids"] = prompt_ids
            yield b"data: " + json.dumps(first).encode() + b"\n\n"
            if drop:
                raise ConnectionAbortedError("mock: scripted connection drop mid-stream")
            step = max(1, self.chunk_tokens)
            pieces = [(ids[i : i + step], lps[i : i + step]) for i in range(0, len(ids), step)]
            for k, (part, part_lps) in enumerate(pieces):
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                extra: dict[str, Any] = {}
                if want_ids:
                    extra["token_ids"] = part
                if want_lps:
                    extra["logprobs"] = {"content": _chat_logprobs(part, part_lps)}
                if reply.tool_calls:
                    # the whole tool call rides on the first piece; later pieces carry only their token ids
                    delta: dict[str, Any] = {}
                    if k == 0:
                        delta["tool_calls"] = [
                            {"index": i, "id": f"call_{i}", "type": "function", "function": dict(tc)}
                            for i, tc in enumerate(reply.tool_calls)
                        ]
                else:
                    delta = {"content": decode(part)}
                yield chunk(delta, extra)
            yield chunk({}, {}, finish)
            if usage_opt and self.include_usage:
                tail = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
                tail.update({"choices": [], "usage": _usage(prompt_ids, ids)})
                yield b"data: " + json.dumps(tail).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _completions(self, request: Request) -> Response:
        body, err, drop = await self._gate(request)
        if err is not None or body is None:
            return err or _error(500, "no body", "server_error")
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            prompt_ids = list(prompt)
        else:
            prompt_ids = encode(prompt if isinstance(prompt, str) else "".join(prompt))
        reply = self.reply_for({"prompt": prompt})
        _, ids, lps, finish = _generate(prompt_ids, reply, body.get("max_tokens"))
        want_ids = bool(body.get("return_token_ids")) and self.supports_token_ids
        choice: dict[str, Any] = {"index": 0, "text": decode(ids), "finish_reason": finish, "logprobs": None}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "tokens": [decode([i]) for i in ids],
                "token_logprobs": lps,
                "top_logprobs": None,
                "text_offset": list(range(len(ids))),
            }
        if want_ids:
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = ids
        resp: dict[str, Any] = {
            "id": f"cmpl-mock{next(self._ids)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "policy"),
            "choices": [choice],
        }
        if self.include_usage:
            resp["usage"] = _usage(prompt_ids, ids)
        if body.get("stream"):
            return StreamingResponse(_completion_stream(resp), media_type="text/event-stream")
        if drop:
            return _dropped(resp)
        return JSONResponse(resp)


# -- pure helpers ------------------------------------------------------------------------------------------------
def _generate(
    prompt_ids: list[int], reply: MockReply, max_tokens: int | None
) -> tuple[list[int], list[int], list[float], str]:
    ids = [*encode(reply.completion_text()), EOS_ID]
    finish = "stop"
    if max_tokens is not None and len(ids) > max_tokens:
        ids, finish = ids[:max_tokens], "length"
    return prompt_ids, ids, [logprob_of(i) for i in range(len(ids))], finish


def _chat_logprobs(ids: list[int], lps: list[float]) -> list[dict[str, Any]]:
    out = []
    for i, lp in zip(ids, lps, strict=True):
        tok = decode([i])
        out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []})
    return out


def _usage(prompt_ids: list[int], ids: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": len(prompt_ids) + len(ids)}


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)


async def _completion_stream(resp: dict[str, Any]) -> AsyncIterator[bytes]:
    choice = resp["choices"][0]
    first = dict(resp, choices=[dict(choice, text="", token_ids=[], logprobs=None, finish_reason=None)])
    if "token_ids" not in choice:
        first["choices"][0].pop("token_ids")
    yield b"data: " + json.dumps(first).encode() + b"\n\n"
    rest = {k: v for k, v in choice.items() if k != "prompt_token_ids"}
    yield b"data: " + json.dumps(dict(resp, choices=[rest])).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


class _DroppedResponse(Response):
    """Sends headers and half the body, then fails: uvicorn closes the connection mid-response."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body[: len(self.body) // 2], "more_body": True})
        raise ConnectionAbortedError("mock: scripted connection drop")


def _dropped(resp: dict[str, Any]) -> Response:
    return _DroppedResponse(json.dumps(resp).encode(), media_type="application/json")
