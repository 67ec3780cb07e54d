"""The tracing proxy: an OpenAI-compatible ASGI app that records every LLM call of an attempt into the store.

``create_app(store, policy_backend=..., admin_key=...)`` builds it; ``PassthroughBackend`` forwards to an
OpenAI-compatible engine; ``ExternalRoute`` routes other model names to providers through LiteLLM; ``serve``
runs it with uvicorn. See docs/proxy.md.
"""

from lightning_sdk.proxy.app import Proxy, ProxyApp, ProxyConfig, create_app
from lightning_sdk.proxy.backend import CallContext, ChatResult, PolicyBackend, StreamItem, UpstreamHTTPError
from lightning_sdk.proxy.external import ExternalBackend, ExternalRoute
from lightning_sdk.proxy.passthrough import PassthroughBackend, PassthroughConfig
from lightning_sdk.proxy.recorder import Recorder
from lightning_sdk.proxy.serve import serve

__all__ = [
    "CallContext",
    "ChatResult",
    "ExternalBackend",
    "ExternalRoute",
    "PassthroughBackend",
    "PassthroughConfig",
    "PolicyBackend",
    "Proxy",
    "ProxyApp",
    "ProxyConfig",
    "Recorder",
    "StreamItem",
    "UpstreamHTTPError",
    "create_app",
    "serve",
]
