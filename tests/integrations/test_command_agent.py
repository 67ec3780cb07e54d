"""A command agent end to end: a small Python program using the openai SDK configured only by the environment
(``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL``) that also posts its own reward to
``LIGHTNING_SDK_REWARD_URL``, run by a WorkerPool as a subprocess against the real proxy and the mock upstream."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning_sdk.agent as la
from tests.agent.stack import assert_calls_traced, proxy_stack


async def test_command_agent_through_the_pool(tmp_path: Path) -> None:
    script = tmp_path / "cli_agent.py"
    script.write_text(
        "import os, sys, openai, httpx\n"
        "c = openai.OpenAI()\n"
        "r = c.chat.completions.create(model=os.environ['OPENAI_MODEL'],"
        " messages=[{'role': 'user', 'content': sys.argv[1]}])\n"
        "print(r.choices[0].message.content)\n"
        "httpx.post(os.environ['LIGHTNING_SDK_REWARD_URL'], json={'value': 0.5, 'name': 'self'},"
        " headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']}).raise_for_status()\n"
    )
    agent = la.CommandAgent(
        [sys.executable, str(script), "{task[q]}"], reward=lambda task, out, code: float("mock" in out), timeout=60
    )
    async with proxy_stack(tmp_path) as st:
        summary = await la.run_tasks(agent, st.store, st.url, [{"q": "hi"}, {"q": "there"}], n_workers=2)
        assert (summary.n, summary.succeeded, summary.mean_reward) == (2, 2, 1.5)
        for r in summary.rollouts:
            detail = await st.store.get_rollout(r.rollout_id)
            assert_calls_traced(detail)
            ok = detail.succeeded_attempt()
            assert ok is not None and ok.calls[0].request["messages"][0]["content"] == r.task["q"]
            assert sorted((w.name, w.value) for w in ok.rewards) == [("reward", 1.0), ("self", 0.5)]
