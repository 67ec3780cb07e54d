"""The engine interface: token ids in, token ids and log-probs out.

Every policy engine (embedded HF, SGLang ``/generate``, vLLM ``/v1/completions`` with a token-id prompt) implements
``Engine``. The proxy's token-in/token-out mode renders messages to ids, calls ``generate`` and parses the sampled
ids back into an OpenAI message; the trainer publishes new weights through ``update_weights``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DelegatingEngine", "Engine", "Generation", "GenerationDelta", "Sampling"]


class Sampling(BaseModel):
    """Sampling settings of one generation (OpenAI names)."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)  # stop strings (the matched text is not part of the reply)
    stop_token_ids: list[int] = Field(default_factory=list)  # besides the tokenizer's EOS ids
    # OpenAI's response_format (json_object / json_schema): guided decoding, for engines that declare
    # ``supports_response_format`` (vLLM, SGLang); the proxy refuses it (400) for the others
    response_format: dict[str, Any] | None = None

    def overridden(self, override: dict[str, Any] | None) -> Sampling:
        """A per-split sampling rule applied (``proxy/sampling.py``): its values replace the request's, except
        ``max_tokens``, which caps it (one rule for every engine)."""
        if not override:
            return self
        update = dict(override)
        if "max_tokens" in update:
            update["max_tokens"] = min(int(update["max_tokens"]), self.max_tokens)
        return self.model_copy(update=update)


class Generation(BaseModel):
    """What the engine sampled: exact ids, their log-probs, why it stopped and the policy version that served it."""

    model_config = ConfigDict(extra="forbid")

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort"]
    policy_version: int | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class GenerationDelta(BaseModel):
    """A streamed piece of a generation: new ids and their log-probs (``finish_reason`` set on the last one)."""

    model_config = ConfigDict(extra="forbid")

    ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort"] | None = None
    policy_version: int | None = None


@runtime_checkable
class Engine(Protocol):
    """A token-in/token-out inference engine serving the policy.

    Every engine subclasses it: the three capabilities below have defaults here (an engine that knows better
    overrides them), so the proxy and the loop read them as typed members, never by probing."""

    @property
    def policy_version(self) -> int: ...

    @property
    def max_model_len(self) -> int | None:
        """The context length in tokens (prompt + completion), None where the engine does not tell it: the proxy
        fits ``max_tokens`` into it and refuses longer prompts, the loop cuts longer rows."""
        return None

    @property
    def supports_response_format(self) -> bool:
        """Whether ``Sampling.response_format`` is honoured (guided decoding); the proxy refuses it (400) if not."""
        return False

    @property
    def supports_top_logprobs(self) -> bool:
        """Whether the engine returns each token's top alternatives; the proxy refuses ``top_logprobs`` if not."""
        return False

    async def generate(self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None) -> Generation:
        """Sample a completion for ``input_ids``. ``session_id`` (the attempt) lets multi-server engines keep an
        attempt on one server (prefix cache)."""
        ...

    def stream(
        self, input_ids: list[int], sampling: Sampling, *, session_id: str | None = None
    ) -> AsyncIterator[GenerationDelta]:
        """The same generation, delivered as it is sampled."""
        ...

    async def update_weights(self, source: Any, version: int) -> None:
        """Swap in new weights atomically and serve them as ``version`` from the next generation on.
        ``source`` is engine-specific (a state dict for the embedded engine, a directory for SGLang/vLLM)."""
        ...

    async def close(self) -> None: ...

    # -- what a job reports of an engine spread over processes (the Ray engine actors override them) -----------------
    @property
    def events(self) -> Sequence[dict[str, Any]]:
        """What happened to the engine's servers or actors (a restart); none for one in this process."""
        return ()

    async def check(self) -> None:
        """Raise unless every part of the engine is up and serving the newest version; nothing to check here."""
        return None

    async def where(self) -> list[dict[str, Any]]:
        """Where the engine's parts run (node, process), for ``cluster.json``; nothing to say for one in process."""
        return []


class DelegatingEngine(Engine):
    """An engine wrapped around ``inner`` (the served engine, a test's spy): its version and capabilities are the
    inner engine's, so a wrapper never hides what the engine it wraps can do."""

    inner: Engine

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @property
    def max_model_len(self) -> int | None:
        return self.inner.max_model_len

    @property
    def supports_response_format(self) -> bool:
        return self.inner.supports_response_format

    @property
    def supports_top_logprobs(self) -> bool:
        return self.inner.supports_top_logprobs
