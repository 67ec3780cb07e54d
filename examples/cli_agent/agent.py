"""The same command agent in Python: ``lightning-sdk run examples/cli_agent/agent.py:agent --server URL ...``."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from grading import score  # noqa: E402

import lightning_sdk as ls  # noqa: E402

agent = ls.CommandAgent(
    [sys.executable, str(HERE / "solve.py"), "--question", "{task[question]}"],
    reward=score,
    timeout=120,
    max_attempts=2,
)
