"""The coding agent for a real model (``train_gpu.toml``): the same ``coder.py`` harness and verifier, with a real
model's budgets (longer turns, more of them, more tool output) and more sandboxes at once."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from verify import reward  # noqa: E402

import lightning_sdk as ls  # noqa: E402
from lightning_sdk.sandbox import SandboxLimits, SandboxSpec  # noqa: E402

COMMAND = [
    sys.executable, "-S", "-B", str(HERE / "coder.py"), "--issue", "{task[issue]}",
    "--max-turns", "20", "--max-tokens", "2048", "--output-chars", "4000", "--cmd-timeout", "30",
]  # fmt: skip
SANDBOX = SandboxSpec(
    files_field="repo",
    limits=SandboxLimits(wall_s=900, cpu_s=300, memory_mb=4096, file_size_mb=64, max_processes=128),
    backend_options={"max_sandboxes": 256},
)

agent = ls.CommandAgent(COMMAND, reward=reward, timeout=600, max_attempts=3, sandbox=SANDBOX, name="coder")
