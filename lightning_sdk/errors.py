"""The exceptions of lightning_sdk.

Every error the library raises on purpose derives from one root; every public exception class of the package is
drawn here, under its base (``tests/test_errors_tree.py`` walks the package and fails on one that is missing, or
drawn under another base)::

    LightningSDKError
     ├── ConfigError              a config file, flag or argument is wrong
     ├── StoreError               the store failed or refused an operation
     │    ├── NotFoundError        no task, rollout, attempt or resource with that id
     │    ├── InvalidTransitionError  a lifecycle move the state table does not allow
     │    └── StoreUnavailableError   the store (file or HTTP server) cannot be reached
     ├── AuthError                missing or unknown attempt token or admin key (HTTP 401)
     ├── AttemptNotRunningError   the attempt is no longer running (HTTP 409)
     ├── UpstreamError            the engine or provider behind the proxy failed (HTTP 502/503/504)
     │    ├── Http1Error          the HTTP/1.1 client's upstream connection failed (lightning_sdk/http1.py)
     │    │    ├── Http1ConnectError     could not connect (502)
     │    │    ├── Http1ReadTimeout      no answer in time (504)
     │    │    └── Http1ProtocolError    the answer broke HTTP/1.1
     │    ├── UpstreamHTTPError   the upstream answered an error status (proxy/_backend.py)
     │    ├── UpstreamNotReady    the passthrough's upstream is not up yet (proxy/passthrough.py, 503)
     │    └── MalformedAnswer     the upstream's answer is not the API's shape (proxy/_shapes.py)
     ├── TokenizationError        rendering, parsing or a token-fidelity check failed
     │    └── TemplateFeatureError  the policy's chat template cannot render a request feature (tools, ...)
     ├── RecordError              a record or segment is malformed (unequal lengths, ...)
     ├── EngineError              an inference engine failed (launch, generate, weight update)
     ├── TrainerError             the learner or the trainer daemon failed
     │    └── RunStopped          a job was asked to stop before it finished (``step``: the last checkpointed)
     ├── SandboxError             a sandbox could not be created, run or cleaned up (never the agent's fault)
     ├── ProxyHTTPError           an HTTP error answer the proxy gives, with its status and the field at fault
     │                            (proxy/_errors.py; the table lightning_sdk.http_errors maps the others to HTTP)
     └── TransientAnswer          a try whose answer arrived but is to be retried (_retry.py; carries the answer)

The classes without a module here are defined in this file; the others live beside the code that raises them.
Foreign errors (sqlite3, httpx, torch, Ray) are translated at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "AttemptNotRunningError",
    "AuthError",
    "ConfigError",
    "EngineError",
    "InvalidTransitionError",
    "LightningSDKError",
    "NotFoundError",
    "RecordError",
    "RunStopped",
    "SandboxError",
    "StoreError",
    "StoreUnavailableError",
    "TemplateFeatureError",
    "TokenizationError",
    "TrainerError",
    "UpstreamError",
]


class LightningSDKError(Exception):
    """Root of every error raised by lightning_sdk."""


class ConfigError(LightningSDKError):
    """A config file, CLI flag or argument is invalid."""


class StoreError(LightningSDKError):
    """The store failed or refused an operation."""


class NotFoundError(StoreError):
    """No object with that id exists."""


class InvalidTransitionError(StoreError):
    """A rollout or attempt lifecycle move that the state table does not allow."""


class StoreUnavailableError(StoreError):
    """The store cannot be reached (file locked/corrupt, HTTP server down after retries)."""


class AuthError(LightningSDKError):
    """Missing or unknown attempt token or admin key."""


class AttemptNotRunningError(LightningSDKError):
    """The attempt behind a token is no longer running."""


class UpstreamError(LightningSDKError):
    """The engine or provider behind the proxy failed. ``retry_after_s``: how long the caller should wait before
    it tries again, where the upstream said so (a 429's or 503's ``Retry-After``), else None."""

    def __init__(self, message: str, *, status_code: int = 502, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retry_after_s = retry_after_s


class TokenizationError(LightningSDKError):
    """Rendering, parsing or a token-fidelity check failed."""


class TemplateFeatureError(TokenizationError):
    """The policy's chat template cannot render a feature the request uses (tool definitions, assistant tool calls,
    tool results, reasoning, a system prompt): refused rather than dropped from the prompt. ``param`` is the request
    field at fault (``tools`` or ``messages``), ``feature`` the capability that is missing."""

    def __init__(self, message: str, *, feature: str, param: str) -> None:
        super().__init__(message)
        self.feature = feature
        self.param = param


class RecordError(LightningSDKError):
    """A segment or record is malformed."""


class EngineError(LightningSDKError):
    """An inference engine failed."""


class TrainerError(LightningSDKError):
    """The learner or the trainer daemon failed."""


class RunStopped(TrainerError):
    """The run was asked to stop (``stop()`` turned true) before it finished; ``step`` is the last checkpointed one."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped at step {step}")
        self.step = step


class SandboxError(LightningSDKError):
    """A sandbox could not be created, run or cleaned up (an infrastructure failure, never the agent's fault)."""
