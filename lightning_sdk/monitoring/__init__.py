"""Operators' metrics: Prometheus ``GET /metrics`` on the proxy and the daemon (docs/proxy.md, "Metrics").

``OpsMetrics`` owns one ``CollectorRegistry`` per app (never the process-global one: a test process runs several
proxies) and the metric families; the proxy, its recorder and the training loop report into it, and
``metrics_route`` serves it in Prometheus' text format without a key.
"""

from lightning_sdk.monitoring.prometheus import (
    CALL_LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    OpsMetrics,
    metrics_route,
)

__all__ = ["CALL_LATENCY_BUCKETS", "TOKEN_BUCKETS", "OpsMetrics", "metrics_route"]
