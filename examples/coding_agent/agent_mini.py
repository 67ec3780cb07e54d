"""mini-swe-agent (``pip install mini-swe-agent``) in place of ``coder.py``: the same sandboxes and verifier.

mini reads the model from ``-m`` and talks to it through LiteLLM; the ``openai/`` prefix makes LiteLLM use
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, which ``CommandAgent`` points at the proxy with the attempt's token. It
has no ``submit`` tool, so ``verify.reward_any`` scores the final repository whatever the exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from verify import reward_any  # noqa: E402

import lightning_sdk as ls  # noqa: E402
from lightning_sdk.sandbox import SandboxLimits, SandboxSpec  # noqa: E402

MODEL = "openai/policy"  # the proxy serves the policy under any name; OPENAI_MODEL holds it too
COMMAND = ["mini", "-y", "-m", MODEL, "-t", "Fix this failing test in the repository:\n{task[issue]}"]
SANDBOX = SandboxSpec(
    files_field="repo",
    limits=SandboxLimits(wall_s=1800, cpu_s=600, memory_mb=8192, file_size_mb=64, max_processes=256),
    backend_options={"max_sandboxes": 128},
)

agent = ls.CommandAgent(
    COMMAND,
    reward=reward_any,
    timeout=1500,
    max_attempts=2,
    sandbox=SANDBOX,
    fail_on_error=False,
    env={"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors"},
    name="mini-swe-agent",
)
