"""A scripted vLLM-style chat-completions upstream whose "template" only ever appends, for passthrough tests.

Not a model: it answers a script of replies (text, or tool calls) in order, over the vLLM wire format of
``tests/support/mock_openai.py`` (``return_token_ids`` → ``prompt_token_ids`` and per-choice ``token_ids``;
``logprobs``; streams with the ids on each chunk and tool-call arguments sent in two fragments, as vLLM's tool
parsers do; a stop string cuts the text and is named in the choice's ``stop_reason``, as vLLM does). Its tokenizer
is the mock's byte tokenizer; its template renders ``<|role|>text<|end|>\\n`` per message (tool calls as JSON after
the text) and the generation prompt ``<|assistant|>``, and a reply samples exactly its own rendering + ``<|end|>``:
so a conversation that only appends renders every earlier prompt + reply as a prefix, the property a real
template-faithful model has and the one-segment merge depends on.
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

from tests.support.mock_openai import decode, encode, logprob_of

__all__ = ["ScriptedReply", "ScriptedUpstream", "render"]

END = "<|end|>"


@dataclass
class ScriptedReply:
    """One scripted answer: text, then tool calls ``(name, arguments_json)``."""

    text: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    error: tuple[int, dict[str, Any]] | None = None  # answer this status and body instead (a vLLM refusal)


def _content(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _assistant_text(text: str, calls: list[tuple[str, str]]) -> str:
    if not calls:
        return text
    return text + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def render(messages: list[dict[str, Any]]) -> str:
    """The upstream's prompt text for ``messages`` (see the module docstring)."""
    out = []
    for m in messages:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
        out.append(f"<|{m.get('role')}|>{_assistant_text(_content(m.get('content')), calls)}{END}\n")
    return "".join(out) + "<|assistant|>"


class ScriptedUpstream:
    """``POST /v1/chat/completions`` answering ``script`` in order (a callable gets the body and returns a reply)."""

    def __init__(
        self, script: list[ScriptedReply | Callable[[dict[str, Any]], ScriptedReply]], *, delay_s: float = 0.0
    ) -> None:
        self.script = list(script)
        self.delay_s = delay_s  # wait before answering (a slow engine)
        self.requests: list[dict[str, Any]] = []
        self.sampled: list[tuple[list[int], list[int], list[float]]] = []  # (prompt ids, completion ids, logprobs)
        self._ids = itertools.count(1)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "policy", "object": "model"}]})

    async def _chat(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if not self.script:
            return JSONResponse({"error": {"message": "script exhausted", "type": "server_error"}}, status_code=500)
        step = self.script.pop(0)
        reply = step(body) if callable(step) else step
        if reply.error is not None:
            return JSONResponse(reply.error[1], status_code=reply.error[0])
        n = next(self._ids)
        prompt_ids = encode(render(body["messages"]))
        text, finish, stop_reason = reply.text, "stop", None
        for s in body.get("stop") or ():
            if s in text:
                text, stop_reason = text[: text.index(s)], s
        sampled = _assistant_text(reply.text if stop_reason is None else text + str(stop_reason), reply.tool_calls)
        ids = encode(sampled + ("" if stop_reason else END))
        if body.get("max_tokens") and len(ids) > body["max_tokens"]:
            ids, finish = ids[: body["max_tokens"]], "length"
            text = decode(ids)
        lps = [logprob_of(i) for i in range(len(ids))]
        self.sampled.append((prompt_ids, ids, lps))
        calls = [
            {"id": f"chatcmpl-tool-{n}{i}", "type": "function", "function": {"name": name, "arguments": args}}
            for i, (name, args) in enumerate(reply.tool_calls)
        ]
        if calls and finish == "stop":
            finish = "tool_calls"
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt_ids) + len(ids),
        }
        cid = f"chatcmpl-up{n}"
        if body.get("stream"):
            return StreamingResponse(
                self._stream(cid, body, prompt_ids, text, calls, ids, lps, finish, stop_reason, usage),
                media_type="text/event-stream",
            )
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop_reason}
        choice["logprobs"] = {"content": _lp_entries(ids, lps)} if body.get("logprobs") else None
        resp: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [choice],
            "usage": usage,
        }
        if body.get("return_token_ids"):
            resp["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = ids
        return JSONResponse(resp)

    async def _stream(
        self,
        cid: str,
        body: dict[str, Any],
        prompt_ids: list[int],
        text: str,
        calls: list[dict[str, Any]],
        ids: list[int],
        lps: list[float],
        finish: str,
        stop_reason: str | None,
        usage: dict[str, int],
    ) -> AsyncIterator[bytes]:
        want_ids, want_lps = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
        head = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": body["model"]}

        def chunk(delta: dict[str, Any], part: list[int], part_lps: list[float], **extra: Any) -> bytes:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}
            if want_ids:
                choice["token_ids"] = part
            if want_lps and part:
                choice["logprobs"] = {"content": _lp_entries(part, part_lps)}
            return b"data: " + json.dumps({**head, "choices": [choice]}).encode() + b"\n\n"

        first = {
            **head,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
        if want_ids:
            first["prompt_token_ids"] = prompt_ids
        yield b"data: " + json.dumps(first).encode() + b"\n\n"
        # the text in pieces of 5 tokens; then each tool call (id and name, then its arguments in two fragments);
        # the ids not yet sent (the tool-call JSON, the end marker) ride on one more chunk
        n_text = len(encode(text)) if calls or stop_reason else min(len(encode(text)), len(ids))
        for i in range(0, n_text, 5):
            part = ids[i : min(i + 5, n_text)]
            yield chunk({"content": decode(part)}, part, lps[i : i + len(part)])
            await asyncio.sleep(0)
        for k, call in enumerate(calls):
            args = call["function"]["arguments"]
            opening = {"index": k, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"]}}
            yield chunk({"tool_calls": [opening]}, [], [])
            for frag in (args[: len(args) // 2], args[len(args) // 2 :]):
                yield chunk({"tool_calls": [{"index": k, "function": {"arguments": frag}}]}, [], [])
        if n_text < len(ids):
            yield chunk({}, ids[n_text:], lps[n_text:])
        yield chunk({}, [], [], finish_reason=finish, stop_reason=stop_reason)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


def _lp_entries(ids: list[int], lps: list[float]) -> list[dict[str, Any]]:
    return [
        {"token": decode([i]), "logprob": lp, "bytes": list(decode([i]).encode()), "top_logprobs": []}
        for i, lp in zip(ids, lps, strict=True)
    ]
