"""Token-in/token-out policy backends: the proxy renders, the engine sees ids, the store records exactly those ids.

``TokenModeBackend`` serves OpenAI chat and completion requests with an ``Engine`` (embedded HF, SGLang
``/generate``, vLLM with token-id prompts): it renders the messages with the policy's tokenizer and chat template,
bridging over the attempt's earlier calls (``lightning_sdk.tokens.render_prompt``: earlier prompt + sampled ids
reused verbatim under the ``exact`` history policy), sends the ids to ``engine.generate`` / ``engine.stream``,
parses the sampled ids into the OpenAI message (content, reasoning, tool calls; streamed as deltas when asked) and
returns the exact prompt ids, completion ids and log-probs with ``token_source="engine"``. ``checks["render"]``
says whether the call extended an earlier one and, if not, why (the merge's split reason).

``RetokenizingBackend`` wraps a backend whose engine returns text only (e.g. ``PassthroughBackend`` in front of an
OpenAI-compatible server without ``return_token_ids``): calls that come back without ids get the prompt rendered
with the policy template and the reply encoded, ``token_source="retokenized"``, and the checks of
``lightning_sdk.tokens._retokenize`` in ``checks`` — never silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lightning_sdk.engines.base import Engine, Generation, GenerationDelta, Sampling
from lightning_sdk.errors import EngineError, LightningSDKError, TemplateFeatureError, TokenizationError, UpstreamError
from lightning_sdk.proxy._backend import CallContext, ChatResult, PolicyBackend, StreamItem
from lightning_sdk.proxy._errors import ProxyHTTPError, tool_choice_of
from lightning_sdk.proxy.observe import Mode
from lightning_sdk.proxy.sampling import SplitSampling
from lightning_sdk.tokens import (
    ChatRenderer,
    HistoryPolicy,
    OutputParser,
    ParsedReply,
    PriorCall,
    RenderedPrompt,
    get_parser,
    new_tool_call_id,
    render_prompt,
    retokenize_reply,
    retokenize_text,
)

__all__ = [
    "RetokenizingBackend",
    "TokenModeBackend",
    "TokenModeConfig",
    "check_token_mode_request",
    "context_length_error",
    "fit_max_tokens",
    "forced_tool_prefix",
]

logger = logging.getLogger(__name__)


@dataclass
class TokenModeConfig:
    """Knobs of the token-mode backend."""

    history: HistoryPolicy = "exact"  # "exact" (training default) or "template" (the official rendering)
    model_name: str = "policy"  # what GET /v1/models lists
    default_max_tokens: int = 1024  # when the request gives neither max_tokens nor max_completion_tokens
    max_model_len: int | None = None  # the policy's context (None: the engine's ``max_model_len``)
    # per-split sampling the proxy imposes (the trainer: train at [rl] settings, evaluations at [eval] settings)
    sampling: SplitSampling | None = None


# -- what token mode does with each OpenAI parameter (docs/proxy.md lists them all) ---------------------------------
# Parameters whose non-default value changes what is sampled in a way the engine here does not do: refused with a 400
# naming them (a harness that sends the default value, e.g. presence_penalty: 0 or logit_bias: {}, is served).
_REFUSED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
}


def check_token_mode_request(body: dict[str, Any], *, response_format: bool, top_logprobs: bool) -> None:
    """Refuse (400 naming the parameter) what token mode cannot honour; ``response_format`` / ``top_logprobs``:
    whether the engine supports guided decoding / returns the top alternatives. Shared by every API surface."""
    if body.get("n") not in (None, 1):
        raise ProxyHTTPError(400, "n: token mode samples one choice per call: n must be 1", param="n")
    for key, allowed in _REFUSED.items():
        if body.get(key) is not None and body[key] not in allowed:
            raise ProxyHTTPError(400, f"{key}: not supported in token mode (the engine cannot honour it)", param=key)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ProxyHTTPError(400, "modalities: token mode generates text only", param="modalities")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text") and not response_format:
        raise ProxyHTTPError(
            400,
            "response_format: this engine has no guided decoding (use an SGLang or vLLM engine, or drop it)",
            param="response_format",
        )
    if body.get("top_logprobs") and not top_logprobs:
        raise ProxyHTTPError(
            400, "top_logprobs: this engine returns the sampled token's log-prob only (set 0)", param="top_logprobs"
        )
    n_alternatives = body.get("logprobs")
    if "prompt" in body and type(n_alternatives) is int and n_alternatives > 1 and not top_logprobs:
        raise ProxyHTTPError(
            400, "logprobs: this engine returns the sampled token's log-prob only (use 0 or 1)", param="logprobs"
        )


def context_length_error(n_prompt: int, max_model_len: int, max_tokens: int | None = None) -> ProxyHTTPError:
    """The 400 ``context_length_exceeded`` of a prompt that leaves no room to generate (vLLM's answer), quoting
    the real numbers: the prompt's length and the completion budget the request asked for (``max_tokens``; None:
    it asked for none, and the message says the prompt leaves no room rather than quote a default)."""
    asked = f", and {max_tokens} in the completion" if max_tokens else ", which leaves no room for a completion"
    return ProxyHTTPError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your messages resulted in "
        f"{n_prompt} tokens{asked}. Please reduce the length of the messages.",
        param="messages",
        code="context_length_exceeded",
    )


def fit_max_tokens(n_prompt: int, requested: int, max_model_len: int | None, asked: int | None = None) -> int:
    """``requested`` clipped to what the context leaves after ``n_prompt`` (400 when nothing is left; ``asked``:
    what the request itself asked for, quoted in that error)."""
    if max_model_len is None:
        return requested
    room = max_model_len - n_prompt
    if room < 1:
        raise context_length_error(n_prompt, max_model_len, asked)
    return min(requested, room)


# Text the template writes to open a tool call (and name the function): forced as a prompt suffix for
# tool_choice "required" / a named function (recorded in the prompt: never sampled, never trained).
_TOOL_OPENINGS: dict[str, tuple[str, str]] = {
    # parser name: (opening for "required", opening for a named function with {name})
    "hermes": ("<tool_call>\n", '<tool_call>\n{{"name": "{name}", "arguments": '),
    "hermes-nothink": ("<tool_call>\n", '<tool_call>\n{{"name": "{name}", "arguments": '),
    "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{{"name": "{name}", "arguments": '),
    "llama3-json": ('{"name": "', '{{"name": "{name}", "parameters": '),
}


def forced_tool_prefix(parser_name: str, choice: str | None) -> str | None:
    """The text to force for ``choice`` (``tool_choice_of``), None when nothing is forced; 400 when the family's
    tool-call opening is not known here."""
    if choice in (None, "none", "auto"):
        return None
    openings = _TOOL_OPENINGS.get(parser_name)
    if openings is None:
        raise ProxyHTTPError(
            400,
            f"tool_choice: {choice!r} cannot be enforced for the {parser_name} format; use 'auto'",
            param="tool_choice",
        )
    return openings[0] if choice == "required" else openings[1].format(name=choice)


class _ContentOnly(OutputParser):
    """A parser that never makes tool calls: tool-call text stays content (no tools offered, or tool_choice none)."""

    def __init__(self, inner: OutputParser) -> None:
        super().__init__(inner.renderer)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.markers = inner.markers  # type: ignore[misc]
        self.thinks = inner.thinks  # type: ignore[misc]

    def parse_text(self, text: str, *, in_reasoning: bool = False) -> ParsedReply:
        parsed = self.inner.parse_text(text, in_reasoning=in_reasoning)
        if not parsed.tool_calls:
            return parsed
        rest = text
        if parsed.reasoning:  # keep the reasoning split; everything after it is content, tool-call text included
            end = text.find("</think>")
            rest = text[end + len("</think>") :].lstrip("\n") if end != -1 else text
        return ParsedReply(content=rest, reasoning=parsed.reasoning)

    def settled(self, text: str, *, in_reasoning: bool = False) -> int:
        return self.inner.settled(text, in_reasoning=in_reasoning)


async def _prior_calls(ctx: CallContext) -> list[PriorCall]:
    calls = await ctx.earlier_calls()
    prior = (PriorCall.from_call(c) for c in calls if c.is_policy and c.error is None)
    return [p for p in prior if p is not None]


def _openai_finish(engine_reason: str, has_tool_calls: bool) -> str:
    if engine_reason == "length":
        return "length"
    return "tool_calls" if has_tool_calls else "stop"


class _Received:
    """What an engine stream delivered so far: the ids, their log-probs, why it stopped, the version that served it."""

    __slots__ = ("finish", "ids", "logprobs", "version")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str = "stop"
        self.version: int | None = None

    def add(self, piece: GenerationDelta) -> None:
        self.ids += piece.ids
        self.logprobs += piece.logprobs
        if piece.finish_reason is not None:
            self.finish = piece.finish_reason
        if piece.policy_version is not None:
            self.version = piece.policy_version


class TokenModeBackend(PolicyBackend):
    """A ``PolicyBackend`` over a token-in/token-out ``Engine`` (see the module docstring).

    The engine is not closed by ``aclose``: whoever built it (the trainer, the daemon) owns it.
    """

    mode: Mode = "token"

    def prompt_renderer(self) -> ChatRenderer | None:
        return self.renderer

    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        parser: OutputParser | None = None,
        *,
        config: TokenModeConfig | None = None,
    ) -> None:
        self.engine = engine
        self.renderer = renderer
        self.parser = parser or get_parser(renderer)
        self.content_parser = _ContentOnly(self.parser)
        self.config = config or TokenModeConfig()
        self.max_model_len: int | None = self.config.max_model_len or engine.max_model_len
        self.response_format = engine.supports_response_format
        self.top_logprobs = engine.supports_top_logprobs
        logger.info(
            "token mode: family %s, parser %s, history %s, context %s",
            renderer.family.name,
            self.parser.name,
            self.config.history,
            self.max_model_len,
        )

    # -- request -> prompt ids and sampling --------------------------------------------------------------------------
    async def _render(self, body: dict[str, Any], ctx: CallContext) -> tuple[RenderedPrompt, list[int]]:
        """The prompt (bridged over earlier calls) and the forced tool-call opening ids (``tool_choice``)."""
        self._check(body)
        forced_text = forced_tool_prefix(self.parser.name, tool_choice_of(body))
        prior = await _prior_calls(ctx)
        try:
            prompt = await asyncio.to_thread(
                render_prompt, self.renderer, body["messages"], body.get("tools"), prior, policy=self.config.history
            )
        except TemplateFeatureError as exc:  # the template would drop part of the request: refused, never dropped
            raise ProxyHTTPError(400, str(exc), param=exc.param) from exc
        except TokenizationError as exc:  # the template refused these messages: the request's fault
            raise ProxyHTTPError(400, f"messages: {exc}", param="messages") from exc
        forced = self.renderer.encode(forced_text) if forced_text else []
        if forced:  # forced tokens sit in the prompt: the engine reads them, they are never sampled nor trained
            prompt.prompt_ids = [*prompt.prompt_ids, *forced]
            prompt.notes.append(f"tool_choice: {len(forced)} forced tokens")
        return prompt, forced

    def _check(self, body: dict[str, Any]) -> None:
        check_token_mode_request(body, response_format=self.response_format, top_logprobs=self.top_logprobs)

    def _parser_for(self, body: dict[str, Any]) -> OutputParser:
        """Tool calls are parsed only when tools are offered and tool_choice is not "none"."""
        return self.parser if tool_choice_of(body) not in (None, "none") else self.content_parser

    def _sampling(self, body: dict[str, Any], n_prompt: int, ctx: CallContext) -> Sampling:
        """The request's sampling, with the rule of the call's split applied (``TokenModeConfig.sampling``)."""
        stop = body.get("stop")
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        fields: dict[str, Any] = {
            "max_tokens": fit_max_tokens(n_prompt, asked or self.config.default_max_tokens, self.max_model_len, asked),
            "stop": [stop] if isinstance(stop, str) else list(stop or []),
            "stop_token_ids": sorted(self.renderer.stop_token_ids),
        }
        for key in ("temperature", "top_p", "seed"):
            if body.get(key) is not None:
                fields[key] = body[key]
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
            fields["response_format"] = fmt  # only reaches engines that support it (check_token_mode_request)
        try:
            sampling = Sampling(**fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = str(err["loc"][0]) if err.get("loc") else None
            raise ProxyHTTPError(400, f"invalid sampling parameter: {err['msg']}", param=param) from exc
        rules = self.config.sampling
        return rules.apply(sampling, ctx.split) if rules is not None else sampling

    async def _generate(self, ids: list[int], sampling: Sampling, ctx: CallContext) -> Generation:
        try:
            return await self.engine.generate(ids, sampling, session_id=ctx.attempt.attempt_id)
        except EngineError as exc:
            raise UpstreamError(f"engine failed: {exc}") from exc

    async def _engine_stream(
        self, ids: list[int], sampling: Sampling, ctx: CallContext, got: _Received
    ) -> AsyncIterator[GenerationDelta]:
        """``engine.stream``, each piece added to ``got``; an engine failure is an ``UpstreamError``."""
        try:
            async for piece in self.engine.stream(ids, sampling, session_id=ctx.attempt.attempt_id):
                got.add(piece)
                yield piece
        except EngineError as exc:
            raise UpstreamError(f"engine failed mid-stream: {exc}") from exc

    # -- responses ---------------------------------------------------------------------------------------------------
    def _logprob_entries(self, ids: Sequence[int], logprobs: Sequence[float]) -> list[dict[str, Any]]:
        entries = []
        for tid, lp in zip(ids, logprobs, strict=False):
            token = self.renderer.decode([tid])
            entries.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
        return entries

    def _chat_response(
        self,
        body: dict[str, Any],
        rid: str,
        created: int,
        message: dict[str, Any],
        finish: str,
        prompt: RenderedPrompt,
        completion_ids: list[int],
        logprobs: list[float],
    ) -> dict[str, Any]:
        usage = _usage(len(prompt.prompt_ids), len(completion_ids))
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": self._logprob_entries(completion_ids, logprobs)}
        response: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": body["model"],
            "choices": [choice],
            "usage": usage,
        }
        if body.get("return_token_ids"):
            response["prompt_token_ids"] = prompt.prompt_ids
            choice["token_ids"] = completion_ids
        return response

    def _result(
        self,
        response: dict[str, Any],
        prompt: RenderedPrompt,
        completion_ids: list[int],
        logprobs: list[float],
        finish: str,
        engine_finish: str,
        version: int | None,
        ctx: CallContext,
    ) -> ChatResult:
        checks: dict[str, Any] = {"render": prompt.as_check()}
        if engine_finish == "abort":
            checks["engine_finish_reason"] = "abort"
        if len(logprobs) != len(completion_ids):
            checks["logprob_count_mismatch"] = [len(logprobs), len(completion_ids)]
        return ChatResult(
            response=response,
            prompt_ids=prompt.prompt_ids,
            completion_ids=completion_ids,
            logprobs=logprobs,
            finish_reason=finish,
            token_source="engine",
            policy_version=version if version is not None else ctx.policy_version,
            usage=_usage(len(prompt.prompt_ids), len(completion_ids)),
            checks=checks,
        )

    def _with_ids(self, message: dict[str, Any]) -> dict[str, Any]:
        for call in message.get("tool_calls") or ():
            if not call.get("id"):
                call["id"] = new_tool_call_id(self.renderer.family)
        return message

    # -- the PolicyBackend interface ----------------------------------------------------------------------------------
    async def chat(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        prompt, forced = await self._render(body, ctx)
        gen = await self._generate(prompt.prompt_ids, self._sampling(body, len(prompt.prompt_ids), ctx), ctx)
        n_base = len(prompt.prompt_ids) - len(forced)
        parsed = self._parser_for(body).parse([*forced, *gen.completion_ids], prompt_ids=prompt.prompt_ids[:n_base])
        message = self._with_ids(parsed.to_message())
        finish = _openai_finish(gen.finish_reason, bool(parsed.tool_calls))
        ids, lps = list(gen.completion_ids), list(gen.logprobs)
        response = self._chat_response(body, _chat_id(), int(time.time()), message, finish, prompt, ids, lps)
        return self._result(response, prompt, ids, lps, finish, gen.finish_reason, gen.policy_version, ctx)

    async def chat_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        prompt, forced = await self._render(body, ctx)
        sampling = self._sampling(body, len(prompt.prompt_ids), ctx)
        ctx.prompt_tokens = len(prompt.prompt_ids)  # known before the first token (Messages' message_start)
        rid, created, model = _chat_id(), int(time.time()), body["model"]
        want_lps = bool(body.get("logprobs"))
        parser = self._parser_for(body)
        stream_parser = parser.stream(prompt_ids=prompt.prompt_ids[: len(prompt.prompt_ids) - len(forced)])
        opening = stream_parser.feed(forced) if forced else []  # the forced opening is parsed with the reply

        def chunk(delta: dict[str, Any], finish: str | None = None, lps: list[dict[str, Any]] | None = None) -> Any:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            if lps is not None:
                choice["logprobs"] = {"content": lps}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [choice],
            }

        yield chunk({"role": "assistant", "content": ""})
        for delta in opening:
            yield chunk(delta)
        got = _Received()
        async for piece in self._engine_stream(prompt.prompt_ids, sampling, ctx, got):
            lp_entries = self._logprob_entries(piece.ids, piece.logprobs) if want_lps else None
            deltas = stream_parser.feed(piece.ids)
            if not deltas and lp_entries:
                yield chunk({}, lps=lp_entries)
            for i, delta in enumerate(deltas):
                yield chunk(delta, lps=lp_entries if i == 0 else None)
        ids, lps = got.ids, got.logprobs
        for delta in stream_parser.finish():
            yield chunk(delta)
        message = stream_parser.message or {"role": "assistant", "content": ""}
        finish = _openai_finish(got.finish, bool(message.get("tool_calls")))
        yield chunk({}, finish)
        usage = _usage(len(prompt.prompt_ids), len(ids))
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
        response = self._chat_response(body, rid, created, message, finish, prompt, ids, lps)
        yield self._result(response, prompt, ids, lps, finish, got.finish, got.version, ctx)

    def _completion_prompt(self, body: dict[str, Any]) -> RenderedPrompt:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
            raw = raw[0]
        if isinstance(raw, str):
            return RenderedPrompt(self.renderer.encode(raw))
        if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            return RenderedPrompt(list(raw))
        raise ProxyHTTPError(400, "prompt must be one string or one list of token ids", param="prompt")

    def _completion_text(self, ids: Sequence[int]) -> str:
        text = self.renderer.decode(ids)
        return self.parser.strip_stop(text)

    def _completion_response(
        self,
        body: dict[str, Any],
        rid: str,
        created: int,
        text: str,
        finish: str,
        prompt: RenderedPrompt,
        ids: list[int],
        lps: list[float],
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs") is not None and body.get("logprobs") is not False:
            tokens = [self.renderer.decode([t]) for t in ids]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": []}
        response = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": body["model"],
            "choices": [choice],
            "usage": _usage(len(prompt.prompt_ids), len(ids)),
        }
        if body.get("return_token_ids"):
            choice["prompt_token_ids"] = prompt.prompt_ids
            choice["token_ids"] = ids
        return response

    async def completions(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        self._check(body)
        prompt = self._completion_prompt(body)
        gen = await self._generate(prompt.prompt_ids, self._sampling(body, len(prompt.prompt_ids), ctx), ctx)
        ids, lps = list(gen.completion_ids), list(gen.logprobs)
        finish = _openai_finish(gen.finish_reason, False)
        text = self._completion_text(ids)
        response = self._completion_response(body, _completion_id(), int(time.time()), text, finish, prompt, ids, lps)
        return self._result(response, prompt, ids, lps, finish, gen.finish_reason, gen.policy_version, ctx)

    async def completions_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        self._check(body)
        prompt = self._completion_prompt(body)
        sampling = self._sampling(body, len(prompt.prompt_ids), ctx)
        ctx.prompt_tokens = len(prompt.prompt_ids)
        rid, created, model = _completion_id(), int(time.time()), body["model"]
        sent = ""
        got = _Received()
        async for piece in self._engine_stream(prompt.prompt_ids, sampling, ctx, got):
            text = self.renderer.decode(got.ids).rstrip("\ufffd")
            if len(text) > len(sent) and text.startswith(sent) and piece.finish_reason is None:
                yield {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "text": text[len(sent) :], "finish_reason": None, "logprobs": None}],
                }
                sent = text
        ids, lps = got.ids, got.logprobs
        final = self._completion_text(ids)
        finish = _openai_finish(got.finish, False)
        tail = final[len(sent) :] if final.startswith(sent) else ""
        yield {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": tail, "finish_reason": finish, "logprobs": None}],
        }
        response = self._completion_response(body, rid, created, final, finish, prompt, ids, lps)
        yield self._result(response, prompt, ids, lps, finish, got.finish, got.version, ctx)

    async def models(self) -> list[str]:
        return [self.config.model_name]

    async def aclose(self) -> None:
        return None


class RetokenizingBackend(PolicyBackend):
    """Wraps a ``PolicyBackend`` whose engine may answer without token ids (see the module docstring)."""

    def __init__(
        self,
        inner: PolicyBackend,
        renderer: ChatRenderer,
        parser: OutputParser | None = None,
        *,
        history: HistoryPolicy = "exact",
    ) -> None:
        self.inner = inner
        self.renderer = renderer
        self.parser = parser or get_parser(renderer)
        self.history = history

    def _needs_ids(self, result: ChatResult) -> bool:
        return result.is_policy and result.error is None and not result.completion_ids

    async def _fill_chat(self, body: dict[str, Any], ctx: CallContext, result: ChatResult) -> ChatResult:
        if not self._needs_ids(result):
            return result
        choices = result.response.get("choices") or []
        reply = choices[0].get("message") if choices else None
        if not isinstance(reply, dict):
            return result
        try:
            prior = await _prior_calls(ctx)
            prompt = render_prompt(self.renderer, body["messages"], body.get("tools"), prior, policy=self.history)
            engine_lps = result.logprobs if result.logprobs else _chat_logprobs(choices[0])
            redo = retokenize_reply(self.renderer, self.parser, reply, engine_lps, prompt_ids=prompt.prompt_ids)
        except LightningSDKError as exc:
            logger.warning("call %s: retokenization failed: %s", ctx.call_id, exc)
            result.checks["retokenization_failed"] = str(exc)
            return result
        result.prompt_ids, result.completion_ids, result.logprobs = (
            prompt.prompt_ids,
            redo.completion_ids,
            redo.logprobs,
        )
        result.token_source = "retokenized"
        result.checks.update(redo.checks, render=prompt.as_check())
        return result

    async def _fill_completion(self, body: dict[str, Any], result: ChatResult) -> ChatResult:
        if not self._needs_ids(result):
            return result
        choices = result.response.get("choices") or []
        raw = body.get("prompt")
        if not choices or not isinstance(raw, str):
            return result
        lp = choices[0].get("logprobs") or {}
        engine_lps = result.logprobs or (lp.get("token_logprobs") if isinstance(lp, dict) else None)
        redo = retokenize_text(self.renderer, str(choices[0].get("text") or ""), engine_lps)
        result.prompt_ids, result.completion_ids = self.renderer.encode(raw), redo.completion_ids
        result.logprobs, result.token_source = redo.logprobs, "retokenized"
        result.checks.update(redo.checks)
        return result

    async def chat(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        return await self._fill_chat(body, ctx, await self.inner.chat(body, ctx))

    async def chat_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        async for item in self.inner.chat_stream(body, ctx):
            yield await self._fill_chat(body, ctx, item) if isinstance(item, ChatResult) else item

    async def completions(self, body: dict[str, Any], ctx: CallContext) -> ChatResult:
        return await self._fill_completion(body, await self.inner.completions(body, ctx))

    async def completions_stream(self, body: dict[str, Any], ctx: CallContext) -> AsyncIterator[StreamItem]:
        async for item in self.inner.completions_stream(body, ctx):
            yield await self._fill_completion(body, item) if isinstance(item, ChatResult) else item

    async def models(self) -> list[str]:
        return await self.inner.models()

    async def start(self) -> None:
        await self.inner.start()

    def prompt_renderer(self) -> ChatRenderer | None:
        return self.renderer

    def upstream_state(self) -> dict[str, Any] | None:
        return self.inner.upstream_state()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _chat_logprobs(choice: dict[str, Any]) -> list[float] | None:
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    return [float(t["logprob"]) for t in content] if isinstance(content, list) else None


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def _completion_id() -> str:
    return "cmpl-" + uuid.uuid4().hex[:24]
