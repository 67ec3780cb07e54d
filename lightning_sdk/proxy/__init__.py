"""The tracing proxy: an OpenAI-compatible ASGI app that records every LLM call of an attempt into the store.

``create_app(store, policy_backend=..., admin_key=...)`` builds it; ``PassthroughBackend`` forwards to an
OpenAI-compatible engine; ``ExternalRoute`` routes other model names to providers through LiteLLM; ``serve``
runs it with uvicorn. See docs/proxy.md.

The modules whose names start with ``_`` are the proxy's own (docs/development.md, "Private modules"); other
packages import the names re-exported here, or the public modules (``observe``, ``passthrough``, ``token_mode``,
``sampling``, ``serve``).
"""

from lightning_sdk.proxy._app import Proxy, ProxyApp, ProxyConfig, create_app
from lightning_sdk.proxy._backend import CallContext, ChatResult, PolicyBackend, StreamItem, UpstreamHTTPError
from lightning_sdk.proxy._errors import ProxyHTTPError
from lightning_sdk.proxy._external import ExternalBackend, ExternalRoute
from lightning_sdk.proxy._recorder import Recorder
from lightning_sdk.proxy._shapes import MalformedAnswer
from lightning_sdk.proxy.passthrough import PassthroughBackend, PassthroughConfig
from lightning_sdk.proxy.serve import serve

__all__ = [
    "CallContext",
    "ChatResult",
    "ExternalBackend",
    "ExternalRoute",
    "MalformedAnswer",
    "PassthroughBackend",
    "PassthroughConfig",
    "PolicyBackend",
    "Proxy",
    "ProxyApp",
    "ProxyConfig",
    "ProxyHTTPError",
    "Recorder",
    "StreamItem",
    "UpstreamHTTPError",
    "create_app",
    "serve",
]
