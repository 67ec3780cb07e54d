"""The integration tests import ``lightning_sdk_integrations`` from ``integrations/`` (installed with the package
in a real install) and keep every framework off the network: no Agents SDK trace export, LiteLLM's bundled model
price map instead of a download."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_INTEGRATIONS = str(Path(__file__).resolve().parents[2] / "integrations")
if _INTEGRATIONS not in sys.path:
    sys.path.insert(0, _INTEGRATIONS)

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
