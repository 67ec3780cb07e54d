"""Pure functions over OpenAI-shaped JSON: read engine token ids, assemble streams, canonicalise what is recorded.

A streamed call must record exactly what the same call records unstreamed, so both paths go through the same
functions: a stream is first assembled (``ChatStreamAssembler`` / ``CompletionStreamAssembler``) into the response
the unstreamed call would have returned, then ``chat_tokens`` / ``completion_tokens`` read the ids and log-probs
from it and ``canonical_chat`` / ``canonical_completion`` keep the fields worth recording.

Engine fields (vLLM >= 0.10.2 with ``return_token_ids``): chat responses carry top-level ``prompt_token_ids`` and
per-choice ``token_ids``; streams carry ``prompt_token_ids`` on the first chunk and ``token_ids`` per chunk; text
completions carry both on the choice. Log-probs: ``choices[].logprobs.content[].logprob`` (chat) and
``choices[].logprobs.token_logprobs`` (completions).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import orjson

from lightning_sdk.errors import UpstreamError

__all__ = [
    "ENGINE_KEYS",
    "MAX_TOKEN_ID",
    "ChatStreamAssembler",
    "CompletionStreamAssembler",
    "EngineTokens",
    "MalformedAnswer",
    "canonical_chat",
    "canonical_completion",
    "chat_tokens",
    "completion_tokens",
    "strip_engine_fields",
]

ENGINE_KEYS = ("prompt_token_ids", "token_ids")


@dataclass
class EngineTokens:
    """What an engine response says about tokens. ``None`` = the engine did not send it."""

    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    logprobs: list[float] | None
    finish_reason: str | None
    n_choices: int


MAX_TOKEN_ID = 2**31 - 1
"""The largest token id accepted from an engine (vocabularies are far smaller; ids beyond are a broken answer)."""


class MalformedAnswer(UpstreamError, ValueError):
    """An engine answer of the wrong shape (the proxy answers 502 and records the call with this message); in the
    one exception tree as an ``UpstreamError``, and still a ``ValueError`` for the parsers that catch those."""


_ID_CHARS = b"0123456789,"


def _token_ids(value: list[Any]) -> bool:
    try:
        return not orjson.dumps(value)[1:-1].translate(None, _ID_CHARS) and max(value) <= MAX_TOKEN_ID
    except TypeError:  # an integer beyond 64 bits
        return False


def _ids(value: Any, where: str) -> list[int] | None:
    """``value`` checked as a list of token ids (C-level passes: this runs on every call's ids, thousands each for
    a long prompt).

    The list's JSON (``orjson.dumps``, ~3 ns an id) holds only digits and commas exactly when every item is a
    non-negative ``int`` (a negative number has ``-``, a float ``.`` or ``e``, ``true``/``false``/``null``, a
    string or a nested list their own characters); then ``max`` checks the range. ~15 ns an id, a third of the
    type-set-min-max check it replaces. A list that fails is searched for the bad item, for the message.
    """
    if value is None:
        return None
    if not isinstance(value, list):
        raise MalformedAnswer(f"{where}: expected a list of token ids, got {type(value).__name__}")
    if value and not _token_ids(value):
        bad = next((i, t) for i, t in enumerate(value) if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID)
        raise MalformedAnswer(f"{where}[{bad[0]}]: {bad[1]!r} is not a token id (an integer in [0, 2^31))")
    return value


def _logprobs(values: list[Any], where: str) -> list[float]:
    """``values`` checked as log-probabilities (finite numbers <= 0), as floats (the list itself when it holds
    floats only)."""
    types = set(map(type, values))
    if values and (not types <= {float, int} or not all(map(math.isfinite, values)) or max(values) > 0):
        i, v = next(
            (i, v) for i, v in enumerate(values) if type(v) not in (float, int) or not math.isfinite(v) or v > 0
        )
        raise MalformedAnswer(f"{where}[{i}]: {v!r} is not a log-probability (a finite number <= 0)")
    return values if int not in types else [float(v) for v in values]


_LOGPROB = operator.itemgetter("logprob")


def _first_choice(resp: Any) -> tuple[dict[str, Any], int]:
    if not isinstance(resp, dict):
        raise MalformedAnswer(f"expected a JSON object, got {type(resp).__name__}")
    choices = resp.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise MalformedAnswer("choices: expected a list of objects")
    return (choices[0] if choices else {}), len(choices)


def chat_tokens(resp: dict[str, Any]) -> EngineTokens:
    """Token ids and log-probs of choice 0 of a ``chat.completion`` (as sent by the engine, before stripping).

    Raises ``MalformedAnswer`` when the answer has the wrong shape (choices, message, ids, log-probs).
    """
    first, n = _first_choice(resp)
    message = first.get("message")
    if message is not None and not isinstance(message, dict):
        raise MalformedAnswer("choices[0].message: expected an object")
    lp = first.get("logprobs") or {}
    if not isinstance(lp, dict):
        raise MalformedAnswer("choices[0].logprobs: expected an object")
    content = lp.get("content")
    logprobs = None
    if content is not None:
        try:
            values = list(map(_LOGPROB, content))
        except (KeyError, TypeError):
            try:  # the slow form: a missing "logprob" is None (refused below, with its index)
                values = [t.get("logprob") for t in content]
            except (AttributeError, TypeError):
                raise MalformedAnswer("choices[0].logprobs.content: expected a list of objects") from None
        logprobs = _logprobs(values, "choices[0].logprobs.content[].logprob")
    return EngineTokens(
        prompt_ids=_ids(resp.get("prompt_token_ids"), "prompt_token_ids"),
        completion_ids=_ids(first.get("token_ids"), "choices[0].token_ids"),
        logprobs=logprobs,
        finish_reason=_finish(first),
        n_choices=n,
    )


def completion_tokens(resp: dict[str, Any]) -> EngineTokens:
    """Token ids and log-probs of choice 0 of a ``text_completion`` (``MalformedAnswer`` on a wrong shape)."""
    first, n = _first_choice(resp)
    lp = first.get("logprobs") or {}
    if not isinstance(lp, dict):
        raise MalformedAnswer("choices[0].logprobs: expected an object")
    token_lps = lp.get("token_logprobs")
    if token_lps is not None and not isinstance(token_lps, list):
        raise MalformedAnswer("choices[0].logprobs.token_logprobs: expected a list")
    where = "choices[0].logprobs.token_logprobs"
    prompt = first.get("prompt_token_ids", resp.get("prompt_token_ids"))
    return EngineTokens(
        prompt_ids=_ids(prompt, "choices[0].prompt_token_ids"),
        completion_ids=_ids(first.get("token_ids"), "choices[0].token_ids"),
        logprobs=_logprobs(token_lps, where) if token_lps is not None else None,
        finish_reason=_finish(first),
        n_choices=n,
    )


def _finish(choice: dict[str, Any]) -> str | None:
    reason = choice.get("finish_reason")
    if reason is not None and not isinstance(reason, str):
        raise MalformedAnswer("choices[0].finish_reason: expected a string or null")
    return reason


def strip_engine_fields(obj: dict[str, Any], *, keep_ids: bool, keep_logprobs: bool) -> bool:
    """Remove what the proxy asked the engine for but the agent did not (in place). True if anything changed.

    Works on responses and stream chunks alike (top-level ``prompt_token_ids``, per-choice ``token_ids``,
    ``prompt_token_ids`` and ``logprobs``).
    """
    changed = False
    if not keep_ids and obj.pop("prompt_token_ids", None) is not None:
        changed = True
    for choice in obj.get("choices") or ():
        if not keep_ids:
            for key in ENGINE_KEYS:
                if key in choice:
                    del choice[key]
                    changed = True
        if not keep_logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
            changed = True
    return changed


def _tool_call(tc: dict[str, Any]) -> dict[str, Any]:
    fn = tc.get("function") or {}
    return {
        "id": tc.get("id"),
        "type": tc.get("type", "function"),
        "function": {"name": fn.get("name"), "arguments": fn.get("arguments", "")},
    }


def canonical_chat(resp: dict[str, Any]) -> dict[str, Any]:
    """The recorded form of a chat response: the fields every engine agrees on, in one order."""
    choices = []
    for c in resp.get("choices") or ():
        msg = c.get("message") or {}
        out_msg: dict[str, Any] = {"role": msg.get("role", "assistant"), "content": msg.get("content")}
        tool_calls = msg.get("tool_calls")
        if tool_calls:
            out_msg["tool_calls"] = [_tool_call(tc) for tc in tool_calls]
            if out_msg["content"] == "":
                out_msg["content"] = None
        for key in ("reasoning_content", "reasoning"):
            if msg.get(key):
                out_msg[key] = msg[key]
        choices.append(
            {
                "index": c.get("index", 0),
                "message": out_msg,
                "finish_reason": c.get("finish_reason"),
                "logprobs": c.get("logprobs"),
            }
        )
    return {
        "id": resp.get("id"),
        "object": "chat.completion",
        "created": resp.get("created"),
        "model": resp.get("model"),
        "choices": choices,
        "usage": resp.get("usage"),
    }


def canonical_completion(resp: dict[str, Any]) -> dict[str, Any]:
    """The recorded form of a text completion."""
    choices = []
    for c in resp.get("choices") or ():
        lp = c.get("logprobs")
        if isinstance(lp, dict):
            lp = {"tokens": lp.get("tokens"), "token_logprobs": lp.get("token_logprobs")}
        choices.append(
            {
                "index": c.get("index", 0),
                "text": c.get("text", ""),
                "finish_reason": c.get("finish_reason"),
                "logprobs": lp,
            }
        )
    return {
        "id": resp.get("id"),
        "object": "text_completion",
        "created": resp.get("created"),
        "model": resp.get("model"),
        "choices": choices,
        "usage": resp.get("usage"),
    }


class _Choice:
    __slots__ = ("content", "finish_reason", "lp_content", "reasoning", "role", "text", "token_ids", "tool_calls")

    def __init__(self) -> None:
        self.role = "assistant"
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.token_ids: list[int] | None = None
        self.lp_content: list[dict[str, Any]] | None = None
        self.finish_reason: str | None = None


class ChatStreamAssembler:
    """Feed ``chat.completion.chunk`` objects in order; ``response()`` is the equivalent ``chat.completion``."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.prompt_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, _Choice] = {}

    def feed(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or ():
            ch = self.choices.get(c.get("index", 0))
            if ch is None:
                ch = self.choices[c.get("index", 0)] = _Choice()
            delta = c.get("delta") or {}
            if delta.get("role"):
                ch.role = delta["role"]
            if delta.get("content"):
                ch.content.append(delta["content"])
            for key in ("reasoning_content", "reasoning"):
                if delta.get(key):
                    ch.reasoning.append(delta[key])
            for tc in delta.get("tool_calls") or ():
                slot = ch.tool_calls.setdefault(
                    tc.get("index", 0), {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
                )
                if tc.get("id"):
                    slot["id"] = tc["id"]
                if tc.get("type"):
                    slot["type"] = tc["type"]
                fn = tc.get("function") or {}
                if fn.get("name"):
                    slot["function"]["name"] = fn["name"]
                if fn.get("arguments"):
                    slot["function"]["arguments"] += fn["arguments"]
            if c.get("token_ids") is not None:
                ch.token_ids = (ch.token_ids or []) + list(c["token_ids"])
            lp = c.get("logprobs")
            if isinstance(lp, dict) and lp.get("content") is not None:
                ch.lp_content = (ch.lp_content or []) + list(lp["content"])
            if c.get("finish_reason") is not None:
                ch.finish_reason = c["finish_reason"]

    def response(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            ch = self.choices[index]
            content = "".join(ch.content)
            msg: dict[str, Any] = {"role": ch.role, "content": content if (content or not ch.tool_calls) else None}
            if ch.tool_calls:
                msg["tool_calls"] = [ch.tool_calls[i] for i in sorted(ch.tool_calls)]
            if ch.reasoning:
                msg["reasoning_content"] = "".join(ch.reasoning)
            choice: dict[str, Any] = {
                "index": index,
                "message": msg,
                "finish_reason": ch.finish_reason,
                "logprobs": {"content": ch.lp_content} if ch.lp_content is not None else None,
            }
            if ch.token_ids is not None:
                choice["token_ids"] = ch.token_ids
            choices.append(choice)
        resp: dict[str, Any] = dict(self.head, object="chat.completion", choices=choices, usage=self.usage)
        if self.prompt_ids is not None:
            resp["prompt_token_ids"] = self.prompt_ids
        return resp


class CompletionStreamAssembler:
    """Feed ``text_completion`` stream chunks in order; ``response()`` is the equivalent ``text_completion``."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, dict[str, Any]] = {}

    def feed(self, chunk: dict[str, Any]) -> None:
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or ():
            slot = self.choices.setdefault(c.get("index", 0), {"text": [], "finish_reason": None})
            slot["text"].append(c.get("text") or "")
            for key in ENGINE_KEYS:
                if c.get(key) is not None:
                    slot[key] = slot.get(key, []) + list(c[key]) if key == "token_ids" else list(c[key])
            lp = c.get("logprobs")
            if isinstance(lp, dict):
                acc = slot.setdefault("logprobs", {"tokens": [], "token_logprobs": [], "top_logprobs": None})
                acc["tokens"] += lp.get("tokens") or []
                acc["token_logprobs"] += lp.get("token_logprobs") or []
            if c.get("finish_reason") is not None:
                slot["finish_reason"] = c["finish_reason"]

    def response(self) -> dict[str, Any]:
        choices = []
        for index in sorted(self.choices):
            slot = self.choices[index]
            choice = {
                "index": index,
                "text": "".join(slot["text"]),
                "finish_reason": slot["finish_reason"],
                "logprobs": slot.get("logprobs"),
            }
            for key in ENGINE_KEYS:
                if key in slot:
                    choice[key] = slot[key]
            choices.append(choice)
        return dict(self.head, object="text_completion", choices=choices, usage=self.usage)
