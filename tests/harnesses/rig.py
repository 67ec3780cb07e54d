"""The two stacks every harness test runs against, and the checks each makes.

* ``passthrough``: the real proxy (``create_app`` + ``PassthroughBackend``, uvicorn on loopback, SQLite file) in
  front of a *scripted* vLLM-style upstream: ``tests.support.mock_openai.MockOpenAI`` (real HTTP, vLLM's
  ``return_token_ids`` wire format) whose replies come from ``script`` below. The upstream is a fake because no
  model that follows tool-call instructions runs on the CI machine; the script plays a competent model: it calls the
  task's tool once, then answers (or calls the framework's own "final answer" tool), so each framework must finish
  its task. Every reply the upstream serves is logged with its exact ids (``Rig.served``).
* ``token``: the real proxy in token mode (``TokenModeBackend``) over the real ``EmbeddedEngine`` serving a small,
  randomly initialised Qwen3 whose tokenizer and chat template are the project's own (tool calls included). Its
  output is random text, so a framework may not finish its task; the test then only checks the records. The engine is
  wrapped in ``SpyEngine`` (it delegates every call and logs the ids it was given and sampled).

``Rig.verify`` finishes the attempt and checks that every call the engine/upstream served is recorded, in order,
under the session's attempt, with exactly the served prompt ids, completion ids and log-probs.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sdk.engines.base import DelegatingEngine, Generation, GenerationDelta, Sampling
from lightning_sdk.engines.embedded import EmbeddedEngine
from lightning_sdk.proxy.sampling import SplitSampling
from lightning_sdk.proxy.token_mode import TokenModeBackend, TokenModeConfig
from lightning_sdk.tokens import ChatRenderer
from tests.support.mock_openai import MockOpenAI, MockReply
from tests.support.proxy import ProxyHandle, run_proxy
from tests.support.servers import run_server

SECRET = "SECRET-4242"
TASK = "What is the secret code? Use the lookup tool to find it, then answer with the code."
DONE = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's end-of-task marker

Served = tuple[list[int], list[int], list[float], bool]  # prompt ids, completion ids, logprobs, streamed


def lookup_secret(query: str) -> str:
    """The task's tool (each framework wraps it its own way)."""
    return f"The secret code is {SECRET}."


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _dspy_fields(reply: dict[str, str]) -> str:
    return "".join(f"[[ ## {k} ## ]]\n{v}\n\n" for k, v in reply.items()) + "[[ ## completed ## ]]"


def script(body: dict[str, Any]) -> MockReply:
    """The scripted model: look the secret up with the task's tool, then give it as the answer."""
    messages = body.get("messages") or []
    tools = [t["function"]["name"] for t in body.get("tools") or [] if isinstance(t, dict) and "function" in t]
    system = " ".join(_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer"))
    seen = any(SECRET in _text(m.get("content")) for m in messages if m.get("role") not in ("system", "developer"))
    if "[[ ## next_tool_name ## ]]" in system:  # DSPy ReAct (its text adapter)
        if not seen:
            args = '{"query": "code"}'
            step = {"next_thought": "Look it up.", "next_tool_name": "lookup_secret", "next_tool_args": args}
        else:
            step = {"next_thought": "I have it.", "next_tool_name": "finish", "next_tool_args": "{}"}
        return MockReply(text=_dspy_fields(step))
    if "[[ ## answer ## ]]" in system:  # DSPy's extraction step
        return MockReply(text=_dspy_fields({"reasoning": "The tool returned it.", "answer": SECRET}))
    if "bash" in tools:  # mini-swe-agent
        command = f"echo {DONE}; echo {SECRET}" if seen else "echo 'The secret code is' SECRET-$((4000+242))"
        return MockReply(tool_calls=[{"name": "bash", "arguments": json.dumps({"command": command})}])
    if not seen and "lookup_secret" in tools and body.get("tool_choice") != "none":
        return MockReply(tool_calls=[{"name": "lookup_secret", "arguments": json.dumps({"query": "code"})}])
    if seen and "final_answer" in tools:  # smolagents' ToolCallingAgent ends with this tool
        return MockReply(tool_calls=[{"name": "final_answer", "arguments": json.dumps({"answer": SECRET})}])
    return MockReply(text=f"The secret code is {SECRET}." if seen else "I do not know the code yet.")


class ScriptedUpstream(MockOpenAI):
    """``MockOpenAI`` replying with ``script`` and logging what it served (exact ids) in ``served``."""

    def __init__(self) -> None:
        super().__init__(reply=self._reply)
        self.served: list[Served] = []

    def _reply(self, body: dict[str, Any]) -> MockReply:
        reply = script(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        prompt, completion, lps, _ = MockOpenAI.expected_ids(body.get("messages") or [], reply, max_tokens=max_tokens)
        self.served.append((prompt, completion, lps, bool(body.get("stream"))))
        return reply


class SpyEngine(DelegatingEngine):
    """Delegates to a real engine; logs ``(input_ids, completion_ids, logprobs)`` of every generation."""

    inner: EmbeddedEngine

    def __init__(self, inner: EmbeddedEngine) -> None:
        self.inner = inner
        self.served: list[Served] = []

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        gen = await self.inner.generate(input_ids, sampling, session_id=session_id)
        self.served.append((list(input_ids), list(gen.completion_ids), list(gen.logprobs), False))
        return gen

    async def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        ids: list[int] = []
        lps: list[float] = []
        try:
            async for delta in self.inner.stream(input_ids, sampling, session_id=session_id):
                ids += delta.ids
                lps += delta.logprobs
                yield delta
        finally:
            self.served.append((list(input_ids), ids, lps, True))

    async def update_weights(self, source: Any, version: int) -> None:
        await self.inner.update_weights(source, version)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Session:
    token: str
    rollout_id: str
    attempt_id: str
    base_url: str  # the proxy's OpenAI base (…/v1): what the framework is given instead of api.openai.com


@dataclass
class Rig:
    mode: str  # "passthrough" | "token"
    px: ProxyHandle
    log: ScriptedUpstream | SpyEngine
    sessions: list[Session] = field(default_factory=list)

    @property
    def scripted(self) -> bool:
        return self.mode == "passthrough"

    def session(self) -> Session:
        self.log.served.clear()
        data = self.px.session({"task": TASK})
        s = Session(data["token"], data["rollout_id"], data["attempt_id"], self.px.url + "/v1")
        self.sessions.append(s)
        return s

    def verify(self, s: Session, *, streamed: bool = False, tool_calls: bool | None = None) -> list[dict[str, Any]]:
        """Finish ``s``; every served generation is recorded under its attempt with exact ids (see module doc)."""
        r = self.px.finish(s.token)
        assert r.status_code == 200, r.text
        finished = r.json()
        served = list(self.log.served)
        assert served, "the framework made no LLM call"
        rollout = self.px.rollout(s.rollout_id)
        assert [a["attempt_id"] for a in rollout["attempts"]] == [s.attempt_id]
        calls = sorted(rollout["attempts"][0]["calls"], key=lambda c: c["seq"])
        assert finished["status"] == "succeeded" and finished["calls"] == len(calls), (finished, len(calls))
        assert all(c["attempt_id"] == s.attempt_id and c["rollout_id"] == s.rollout_id for c in calls)
        refused = [c for c in calls if c["error"] is not None]
        if self.scripted:  # the scripted upstream answers everything: nothing may fail
            assert not refused, [c["error"] for c in refused]
        calls = [c for c in calls if c["error"] is None]  # token mode: calls the proxy refused (4xx) are recorded
        streamed_n = sum(1 for *_, streaming in served if streaming)
        errors = [c["error"] for c in refused]
        print(f"[{self.mode}] {len(calls)} calls recorded ({streamed_n} streamed), refused: {errors}")
        assert len(calls) == len(served), f"{len(calls)} calls recorded, {len(served)} served"
        for i, (call, (prompt, completion, lps, _)) in enumerate(zip(calls, served, strict=True)):
            assert call["prompt_ids"] == prompt, f"call {i}: prompt ids differ from what the {self.mode} engine saw"
            assert call["completion_ids"] == completion, f"call {i}: completion ids differ"
            assert call["logprobs"] == lps, f"call {i}: logprobs differ"
        if not self.scripted:  # the first call's prompt is the policy's own chat template over what was sent
            first = calls[0]["request"]
            if all(isinstance(m.get("content"), str) for m in first["messages"]):
                tokenizer = self.log.tokenizer  # type: ignore[union-attr]
                rendered = tokenizer.apply_chat_template(
                    first["messages"],
                    tools=first.get("tools"),
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
                assert calls[0]["prompt_ids"] == [int(i) for i in rendered], "first prompt is not the template's"
        if streamed:
            assert any(streaming for *_, streaming in served), "the framework streamed no call"
        if tool_calls if tool_calls is not None else self.scripted:
            assert any((c["response"].get("choices") or [{}])[0].get("message", {}).get("tool_calls") for c in calls), (
                "no call answered with a tool call"
            )
        return calls


@contextlib.contextmanager
def passthrough_rig(tmp_path: Path) -> Iterator[Rig]:
    upstream = ScriptedUpstream()
    with run_server(upstream.app) as srv, run_proxy(srv.url + "/v1", store_path=tmp_path / "store.db") as px:
        yield Rig("passthrough", px, upstream)


@contextlib.contextmanager
def token_rig(tmp_path: Path, engine: EmbeddedEngine) -> Iterator[Rig]:
    spy = SpyEngine(engine)
    # random text: keep replies short whatever a framework asks (the proxy caps max_tokens for every split)
    short = TokenModeConfig(default_max_tokens=24, sampling=SplitSampling({"*": {"max_tokens": 24}}))
    backend = TokenModeBackend(spy, ChatRenderer(engine.tokenizer), config=short)
    with run_proxy(policy_backend=backend, store_path=tmp_path / "store.db") as px:
        yield Rig("token", px, spy)
