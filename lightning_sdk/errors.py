"""The exceptions of lightning_sdk.

Every error the library raises on purpose derives from one root::

    LightningSDKError
     ├── ConfigError              a config file, flag or argument is wrong
     ├── StoreError               the store failed or refused an operation
     │    ├── NotFoundError        no task, rollout, attempt or resource with that id
     │    ├── InvalidTransitionError  a lifecycle move the state table does not allow
     │    └── StoreUnavailableError   the store (file or HTTP server) cannot be reached
     ├── AuthError                missing or unknown attempt token or admin key (HTTP 401)
     ├── AttemptNotRunningError   the attempt is no longer running (HTTP 409)
     ├── UpstreamError            the engine or provider behind the proxy failed (HTTP 502/503/504)
     │    └── Http1Error          the proxy's upstream connection failed (http1.py: connect, read timeout,
     │                            protocol); UpstreamHTTPError: the upstream answered an error (proxy/backend.py)
     ├── TokenizationError        rendering, parsing or a token-fidelity check failed
     │    └── TemplateFeatureError  the policy's chat template cannot render a request feature (tools, ...)
     ├── RecordError              a record or segment is malformed (unequal lengths, ...)
     ├── EngineError              an inference engine failed (launch, generate, weight update)
     ├── TrainerError             the learner or the trainer daemon failed
     ├── SandboxError             a sandbox could not be created, run or cleaned up (lightning_sdk.sandbox)
     └── ProxyHTTPError           an HTTP error answer the proxy gives, with its status and the field at fault
                                  (proxy/errors.py; the table lightning_sdk.http_errors maps the others to HTTP)

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
    """The engine or provider behind the proxy failed."""

    def __init__(self, message: str, *, status_code: int = 502) -> None:
        super().__init__(message)
        self.status_code = status_code


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


class SandboxError(LightningSDKError):
    """A sandbox could not be created, run or cleaned up (an infrastructure failure, never the agent's fault)."""
