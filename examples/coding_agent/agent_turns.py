"""``agent.py`` with per-turn rewards: the same harness, sandbox and final reward (1.0 / 0.0), plus a per-call
reward for each call whose ``bash`` commands made more FAIL_TO_PASS tests pass (``verify.reward_turns``; the replay
costs one more sandbox per submitted episode). The per-turn advantage estimators pick these up by themselves
(``records/build.py``: per-turn credit is on for groups with per-call rewards).

``lightning-sdk train examples/coding_agent --set agent=agent_turns.py:agent --output RUN`` (README: per-turn rewards).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from agent import COMMAND, SANDBOX  # noqa: E402
from verify import reward_turns  # noqa: E402

import lightning_sdk as ls  # noqa: E402

agent = ls.CommandAgent(COMMAND, reward=reward_turns, timeout=90, max_attempts=3, sandbox=SANDBOX, name="coder")
