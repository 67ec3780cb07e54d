"""The coding agent as a command agent: ``coder.py`` (a black-box CLI) runs in a fresh sandbox per attempt, created
from the task's repository; ``verify.reward`` runs the hidden tests on a fresh copy after it submits.

``lightning-sdk run examples/coding_agent/agent.py:agent --server URL ...`` or ``lightning-sdk train
examples/coding_agent`` (``train.toml``). Swap ``COMMAND`` for any coding-agent CLI that reads the OpenAI variables
(see the README).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from verify import reward  # noqa: E402

import lightning_sdk as ls  # noqa: E402
from lightning_sdk.sandbox import SandboxLimits, SandboxSpec  # noqa: E402

COMMAND = [sys.executable, "-S", "-B", str(HERE / "coder.py"), "--issue", "{task[issue]}", "--max-turns", "4"]
SANDBOX = SandboxSpec(
    files_field="repo",
    limits=SandboxLimits(wall_s=120, cpu_s=30, memory_mb=1024, file_size_mb=8, max_processes=32),
    backend_options={"max_sandboxes": 24},
)

agent = ls.CommandAgent(COMMAND, reward=reward, timeout=90, max_attempts=3, sandbox=SANDBOX, name="coder")
