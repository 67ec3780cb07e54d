"""What per-turn rewards cost the coding example: scripted episodes with ``agent.py`` vs ``agent_turns.py``.

    python benchmarks/coding_turns.py [--episodes 16] [--workers 4]

Each episode is the real thing but for the model: ``coder.py`` in a fresh sandbox, talking to the real proxy
(loopback, a real SQLite store) in front of the mock OpenAI server, which plays the demonstration (grep, sed,
submit; half the episodes edit the wrong file, as the demonstrations do), then the verifier. ``agent_turns.py``
also reads the attempt's calls from the proxy and replays their commands in one more sandbox. Prints, for each
agent, the wall time of the whole run per episode and the mean attempt time (harness + reward), then the ratio;
the runs alternate (plain, turns, plain, turns) and the ``uptime`` load is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "coding_agent"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(EXAMPLE))

import tasks as T  # noqa: E402

import lightning_sdk.agent as la  # noqa: E402
from lightning_sdk.sandbox import SandboxLimits, SandboxSpec  # noqa: E402
from tests.agent.stack import proxy_stack  # noqa: E402
from tests.support.mock_openai import MockOpenAI, MockReply  # noqa: E402


def _script(fixes: dict[str, str]) -> Any:
    def reply(body: dict[str, Any]) -> MockReply:
        messages = body["messages"]
        function = messages[1]["content"].split("\n", 1)[0].split("::test_", 1)[1].rsplit("_", 1)[0]
        turns = sum(m["role"] == "tool" for m in messages)
        if turns == 0:
            cmd = f"grep -r -A5 'def {function}' mathkit"
            return MockReply(tool_calls=[{"name": "bash", "arguments": json.dumps({"cmd": cmd})}])
        if turns == 1:
            return MockReply(tool_calls=[{"name": "bash", "arguments": json.dumps({"cmd": fixes[function]})}])
        return MockReply(tool_calls=[{"name": "submit", "arguments": "{}"}])

    return reply


def _cpu() -> float:
    """CPU seconds of this process and its waited-for children (harnesses, tool commands, verifiers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


async def _run(name: str, episodes: int, workers: int, root: Path) -> tuple[float, float, float, float]:
    example = la.load_agent(f"{EXAMPLE / name}:agent")
    assert isinstance(example, la.CommandAgent)
    spec = SandboxSpec(limits=SandboxLimits(wall_s=120), backend_options={"root": str(root / "boxes")})
    agent = la.CommandAgent(example.command, reward=example.reward, timeout=90, sandbox=spec, name="coder")
    pairs = T.make_tasks_with_fixes("heldout", episodes, seed=41)
    fixes = {t["function"]: T.fix_command(t, f, T.WRONG_FILE if i % 2 else None) for i, (t, f) in enumerate(pairs)}
    async with proxy_stack(root, MockOpenAI(reply=_script(fixes))) as st:
        t0, c0 = time.perf_counter(), _cpu()
        summary = await la.run_tasks(agent, st.store, st.url, [t for t, _ in pairs], n_workers=workers)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    assert summary.n == episodes and summary.succeeded == episodes, summary.to_dict()
    mean_attempt = statistics.mean(a.duration_s for a in summary.attempts)
    return wall / episodes, mean_attempt, cpu / episodes, summary.mean_reward


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float, float]]] = {"agent.py": [], "agent_turns.py": []}
    for r in range(args.rounds):
        for name in results:
            with tempfile.TemporaryDirectory() as tmp:
                load = _load()
                per_episode, attempt, cpu, reward = await _run(name, args.episodes, args.workers, Path(tmp))
            results[name].append((per_episode, attempt, cpu))
            print(
                f"round {r} {name:15s} load {load}: {per_episode:.3f} s wall per episode, "
                f"{attempt:.3f} s per attempt, {cpu:.3f} CPU s per episode (mean reward {reward:.2f})"
            )
    plain = statistics.median(x[1] for x in results["agent.py"])
    turns = statistics.median(x[1] for x in results["agent_turns.py"])
    plain_w = statistics.median(x[0] for x in results["agent.py"])
    turns_w = statistics.median(x[0] for x in results["agent_turns.py"])
    plain_c = statistics.median(x[2] for x in results["agent.py"])
    turns_c = statistics.median(x[2] for x in results["agent_turns.py"])
    print(
        f"median per attempt: agent.py {plain:.3f} s, agent_turns.py {turns:.3f} s ({turns / plain:.2f}x); "
        f"wall per episode {plain_w:.3f} s vs {turns_w:.3f} s ({turns_w / plain_w:.2f}x); "
        f"CPU per episode {plain_c:.3f} s vs {turns_c:.3f} s ({turns_c / plain_c:.2f}x); load now {_load()}"
    )


if __name__ == "__main__":
    asyncio.run(main())
