"""``[telemetry]``: where spans go. Off unless an OTLP endpoint is given (here or in the standard variables)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lightning_sdk.errors import ConfigError

__all__ = ["ENDPOINT_ENV", "PROTOCOL_ENV", "Protocol", "TelemetryConfig"]

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_PROTOCOL"
_TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_SERVICE_ENV = "OTEL_SERVICE_NAME"

Protocol = Literal["http/protobuf", "grpc"]


class TelemetryConfig(BaseModel):
    """OpenTelemetry span export (OTLP). ``otlp`` None and no ``OTEL_EXPORTER_OTLP_ENDPOINT``: off, at no cost."""

    model_config = ConfigDict(extra="forbid")

    otlp: str | None = Field(
        None, description="OTLP endpoint, e.g. http://127.0.0.1:4318 (default: $OTEL_EXPORTER_OTLP_ENDPOINT)"
    )
    protocol: Protocol | None = Field(
        None, description='"http/protobuf" or "grpc" (default: $OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf)'
    )
    service_name: str | None = Field(
        None, description="the service.name resource attribute (default: $OTEL_SERVICE_NAME, else lightning-sdk)"
    )

    def resolved(self, env: Mapping[str, str] | None = None) -> TelemetryConfig | None:
        """This config with the standard variables filled in where it leaves a field unset; None when off."""
        env = os.environ if env is None else env
        endpoint = self.otlp or env.get(_TRACES_ENDPOINT_ENV) or env.get(ENDPOINT_ENV)
        if not endpoint:
            return None
        protocol = self.protocol or env.get(PROTOCOL_ENV) or "http/protobuf"
        if protocol not in ("http/protobuf", "grpc"):
            raise ConfigError(f"{PROTOCOL_ENV}={protocol!r}: valid: http/protobuf, grpc (http/json is not supported)")
        if not endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"telemetry endpoint {endpoint!r} must start with http:// or https://")
        service = self.service_name or env.get(_SERVICE_ENV) or "lightning-sdk"
        return TelemetryConfig(otlp=endpoint, protocol=protocol, service_name=service)
