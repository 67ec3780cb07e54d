"""Per-turn rewards of the coding example (``agent_turns.py`` / ``verify.reward_turns``), end to end.

``coder.py`` (a real subprocess in a real sandbox) talks to the real proxy (loopback, token-in/token-out mode) with
the real Qwen3 tokenizer and chat template; the calls reach ``ScriptedEngine`` (tests/tokens/test_token_mode.py), a
fake engine that samples the template's own rendering of scripted tool calls, because no real engine that would
play a given episode runs here. The verifier reads the attempt's calls from the proxy (``GET /lightning/v1/calls``),
replays their ``bash`` commands in a fresh sandbox and emits a per-call reward for the call that made the
FAIL_TO_PASS tests pass; the records built with per-turn credit give that call's tokens the extra return.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np

import lightning_sdk.agent as la
from lightning_sdk.proxy.token_mode import TokenModeBackend
from lightning_sdk.records import AdvantageConfig, RecordsConfig, build_records
from lightning_sdk.sandbox import SandboxLimits, SandboxSpec
from lightning_sdk.store.loader import load_groups
from lightning_sdk.types import Call
from tests.support.proxy import serve_proxy
from tests.tokens.conversations import assistant, renderer_for, tool_call
from tests.tokens.test_token_mode import Plan, ScriptedEngine

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "coding_agent"
sys.path.insert(0, str(EXAMPLE))

import tasks as T  # noqa: E402
import verify  # noqa: E402


def _agent(tmp_path: Path) -> la.CommandAgent:
    """``agent_turns.py:agent`` with its sandboxes under the test's directory."""
    example = la.load_agent(f"{EXAMPLE / 'agent_turns.py'}:agent")
    assert isinstance(example, la.CommandAgent) and example.reward is not None
    assert example.reward.__name__ == "reward_turns"
    spec = SandboxSpec(limits=SandboxLimits(wall_s=60), backend_options={"root": str(tmp_path / "boxes")})
    return la.CommandAgent(example.command, reward=example.reward, timeout=60, sandbox=spec, name="coder")


def _episode(task: dict[str, Any], sed: str, n: int) -> list[Plan]:
    """The engine's replies for one episode: grep the function, run ``sed``, submit."""
    return [
        assistant(None, calls=[tool_call("bash", {"cmd": T.locate_command(task)}, f"call{n}0001")]),
        assistant(None, calls=[tool_call("bash", {"cmd": sed}, f"call{n}0002")]),
        assistant(None, calls=[tool_call("submit", {}, f"call{n}0003")]),
    ]


def _cmd(call: Call) -> str:
    commands, submits = verify.bash_commands(call)
    return "submit" if submits else commands[0]


async def test_the_fixing_call_gets_the_per_turn_reward_and_its_tokens_the_extra_return(tmp_path: Path) -> None:
    """Two rollouts of one task: grep, the right sed, submit (reward 1, a per-call reward of 1.0 on exactly the sed
    call) and grep, sed on the wrong file, submit (reward 0, no per-call reward). Records with per-turn credit
    (dr_grpo, gamma 1): returns 2, 2, 1 for the first rollout's calls and 0, 0, 0 for the second's; the sed call's
    tokens carry advantage 2 - 5/6."""
    (task, fix), *_ = T.make_tasks_with_fixes("heldout", 1, seed=31)
    good, wrong = T.fix_command(task, fix), T.fix_command(task, fix, T.stale_copy(task))
    renderer = renderer_for("qwen3")
    engine = ScriptedEngine(renderer, [*_episode(task, good, 1), *_episode(task, wrong, 2)])
    agent = _agent(tmp_path)
    backend = TokenModeBackend(engine, renderer)  # type: ignore[arg-type]
    async with serve_proxy(policy_backend=backend, store_path=tmp_path / "s.db") as px:
        summary = await la.run_tasks(agent, px.store, px.url, [task], n=2, n_workers=1)
        assert [r.status for r in summary.rollouts] == ["succeeded", "succeeded"]
        attempts = {}
        for r in summary.rollouts:
            detail = await px.store.get_rollout(r.rollout_id)
            (att,) = detail.attempts
            calls = sorted(att.calls, key=lambda c: c.seq)
            cmds = [_cmd(c) for c in calls]
            attempts[cmds[1]] = (r.reward, calls, att.rewards)
        assert set(attempts) == {good, wrong}
        reward, calls, rewards = attempts[good]
        assert reward == 1.0 and [_cmd(c) for c in calls] == [T.locate_command(task), good, "submit"]
        per_call = {(w.name, w.call_id, w.value) for w in rewards if w.call_id is not None}
        assert per_call == {(verify.TURN_REWARD, calls[1].call_id, 1.0)}  # the sed call; not the grep call
        assert [(w.call_id, w.value) for w in rewards if w.call_id is None] == [(None, 1.0)]
        assert (rewards[-1].call_id, rewards[-1].value) == (None, 1.0)  # the final one is last (app/loop.py reads it)
        reward, wrong_calls, rewards = attempts[wrong]
        assert reward == 0.0 and [(w.call_id, w.value) for w in rewards] == [(None, 0.0)]

        built = build_records(
            await load_groups(px.store, split=summary.split),
            RecordsConfig(advantage=AdvantageConfig(estimator="dr_grpo", per_turn=True)),
        )
        assert all(rep.per_turn and rep.trained for rep in built.reports)
        by_call: dict[str, set[float]] = {}
        for rec in built.records:
            for span in rec.segment.spans:
                by_call.setdefault(span.call_id, set()).update(rec.advantages[span.start : span.end].tolist())
        mean = (2 + 2 + 1 + 0 + 0 + 0) / 6  # the group's items: every trained call of both rollouts
        expected = {c.call_id: g - mean for c, g in zip([*calls, *wrong_calls], [2, 2, 1, 0, 0, 0], strict=True)}
        assert set(by_call) == set(expected)
        for call_id, values in by_call.items():
            assert len(values) == 1 and np.isclose(values.pop(), expected[call_id]), call_id
    assert agent.sandbox is not None and agent.sandbox.get_backend().active() == 0
    assert not any((tmp_path / "boxes").iterdir())


async def test_the_calls_endpoint_answers_the_attempts_calls_in_order_with_its_token(tmp_path: Path) -> None:
    """``GET /lightning/v1/calls`` with the attempt token: the answered calls in ``seq`` order (also under
    ``/t/<token>``); an unknown token answers 401, a finished attempt's token 409 (OpenAI error shape)."""
    renderer = renderer_for("qwen3")
    engine = ScriptedEngine(renderer, [assistant("one"), assistant("two")])
    backend = TokenModeBackend(engine, renderer)  # type: ignore[arg-type]
    async with (
        serve_proxy(policy_backend=backend, store_path=tmp_path / "s.db") as px,
        httpx.AsyncClient(base_url=px.url) as http,
    ):
        admin = {"Authorization": "Bearer test-admin-key"}
        s = (await http.post("/lightning/v1/sessions", json={}, headers=admin)).json()
        auth = {"Authorization": f"Bearer {s['token']}"}
        ids = []
        for text in ("hi", "again"):
            r = await http.post(
                "/v1/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": text}]},
                headers=auth,
            )
            assert r.status_code == 200
            ids.append(r.headers["x-lightning-call-id"])
        r = await http.get("/lightning/v1/calls", headers=auth)
        assert r.status_code == 200
        body = r.json()
        assert (body["attempt_id"], body["inflight"]) == (s["attempt_id"], 0)
        assert [(c["call_id"], c["seq"]) for c in body["calls"]] == [(ids[0], 0), (ids[1], 1)]
        assert [c["response"]["choices"][0]["message"]["content"] for c in body["calls"]] == ["one", "two"]
        assert body["calls"][0]["completion_ids"] == engine.sampled[0]
        r = await http.get(f"/t/{s['token']}/lightning/v1/calls")
        assert [c["call_id"] for c in r.json()["calls"]] == ids
        r = await http.get("/lightning/v1/calls", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and "error" in r.json()
        # a command agent whose reward asks for the calls: given them in order, and it runs as the attempt
        seen: list[list[str]] = []

        def reward(task: Any, stdout: str, exit_code: int, *, calls: list[Call]) -> float:
            seen.append([c.call_id for c in calls])
            la.emit_reward(0.5, "first", call_id=calls[0].call_id)
            return 1.0

        agent = la.CommandAgent([sys.executable, "-c", "print('done')"], reward=reward)
        llm = la.LLM(base_url=f"{px.url}/v1", api_key=s["token"])
        ctx = la.AttemptContext(s["attempt_id"], s["rollout_id"], {}, llm, server_url=px.url)
        outcome = await agent.run_attempt(ctx, timeout=30)
        assert (outcome.status, outcome.reward, seen) == ("succeeded", 1.0, [ids])
        assert [(w.name, w.value, w.call_id) for w in ctx.close()] == [("first", 0.5, ids[0])]
        # reading them fails (an unknown token): the attempt fails, the reward is not called
        bad = la.AttemptContext("a", "r", {}, la.LLM(base_url=f"{px.url}/v1", api_key="nope"), server_url=px.url)
        outcome = await agent.run_attempt(bad, timeout=30)
        assert outcome.status == "failed" and "reading the attempt's calls" in (outcome.error or "")
        assert len(seen) == 1

        await http.post("/lightning/v1/finish", json={"status": "succeeded"}, headers=auth)
        r = await http.get("/lightning/v1/calls", headers=auth)
        assert r.status_code == 409 and r.json()["error"]["message"]


def test_a_reward_with_a_calls_parameter_is_told_apart_from_the_sandbox_one() -> None:
    """``calls`` is passed by keyword: it never counts as the sandbox argument, and ``**kwargs`` alone asks for
    nothing; a reward that takes ``calls`` run as plain code (no proxy) gets none."""
    from lightning_sdk.agent._command import _n_positional, _takes_calls

    def three(task: Any, stdout: str, exit_code: int, calls: list[Call]) -> float:
        return float(len(calls))

    def kw(task: Any, stdout: str, exit_code: int, **kwargs: Any) -> float:
        return 0.0

    assert (_n_positional(three), _takes_calls(three)) == (3, True)
    assert (_n_positional(kw), _takes_calls(kw)) == (3, False)
    assert (_n_positional(verify.reward_turns), _takes_calls(verify.reward_turns)) == (4, True)
    agent = la.CommandAgent([sys.executable, "-c", "print('x')"], reward=three)
    assert agent(task={}, llm=la.LLM(base_url="http://127.0.0.1:9/v1", api_key="k")) == 0.0


def test_the_readme_command_selects_the_per_turn_agent() -> None:
    """``--set agent=agent_turns.py:agent`` on the example's train.toml: the same harness and sandbox as
    ``agent.py``, the per-turn reward."""
    from lightning_sdk.cli.train_cmd import _parse_set
    from lightning_sdk.trainer.config import load_train_config

    config = load_train_config(EXAMPLE / "train.toml", _parse_set(["agent=agent_turns.py:agent"]))
    assert config.agent == f"{EXAMPLE / 'agent_turns.py'}:agent"  # resolved against the config's directory
    turns = la.load_agent(config.agent)
    plain = la.load_agent(f"{EXAMPLE / 'agent.py'}:agent")
    assert isinstance(turns, la.CommandAgent) and isinstance(plain, la.CommandAgent)
    assert (turns.command, turns.sandbox, turns.timeout, turns.max_attempts) == (
        plain.command,
        plain.sandbox,
        plain.timeout,
        plain.max_attempts,
    )
    assert turns.reward is verify.reward_turns or turns.reward.__name__ == "reward_turns"  # type: ignore[union-attr]
    assert plain.reward is not None and plain.reward.__name__ == "reward"


def _call(n: int, cmd: str) -> Call:
    """A call as the proxy records it: its response carries one ``bash`` tool call."""
    tc = {"id": f"c{n}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"cmd": cmd})}}
    message = {"role": "assistant", "content": None, "tool_calls": [tc]}
    return Call(
        call_id=f"call-{n}", attempt_id="a", rollout_id="r", seq=n, model="policy",
        response={"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]},
    )  # fmt: skip


async def test_a_fix_that_breaks_other_tests_is_no_progress_until_they_pass_again(tmp_path: Path) -> None:
    """Call 0 fixes the bug and breaks a neighbour (its PASS_TO_PASS tests fail): no reward. Call 1 edits
    nothing that matters (a comment) while the neighbour is still broken: none. Call 2 repairs the neighbour: the
    whole 1.0 goes to it."""
    from lightning_sdk.sandbox import LocalBackend

    (task, fix), *_ = T.make_tasks_with_fixes("heldout", 1, seed=33)
    neighbour, path = task["neighbours"][0], task["path"]
    broken = f"{T.fix_command(task, fix)} && printf '\\ndef {neighbour}(*a, **k):\\n    return \"broken\"\\n' >> {path}"
    repair = f"sed -i '/^def {neighbour}(\\*a/,$d' {path}"
    calls = [_call(0, broken), _call(1, f"echo '# note' >> {path}"), _call(2, repair)]
    backend = LocalBackend(root=str(tmp_path / "boxes"), max_sandboxes=2)
    async with await backend.create(task["repo"], SandboxLimits(wall_s=60)) as box:
        rewards = await verify.turn_rewards(task, calls, box)
        results = []
        for call in calls:  # the states themselves: after call 0 the bug is fixed and a neighbour broken
            await box.exec([*verify.REPLAY_SHELL, verify.bash_commands(call)[0][0]], timeout=10)
            results.append(await verify.run_tests(task, box))
        final = results[-1]
    assert set(task["FAIL_TO_PASS"]) <= set(results[0]["passed"])
    assert any(t.endswith(tuple(f"test_{neighbour}_{i}" for i in range(9))) for t in results[0]["failed"])
    assert rewards == {"call-2": 1.0}
    assert verify.progress(task, final) == len(task["FAIL_TO_PASS"]) and not final["failed"]


async def test_the_replay_runs_each_command_under_a_parent_of_its_own(tmp_path: Path) -> None:
    """A replayed command's ``$PPID`` is a throwaway shell, as coder.py is in the episode, never this process (a
    ``kill $PPID`` replayed would otherwise hit the trainer): the fix below applies only when that holds, and only
    then does its call get the per-call reward. Calls as the proxy records them (``Call`` with its response)."""
    import os

    from lightning_sdk.sandbox import LocalBackend

    (task, fix), *_ = T.make_tasks_with_fixes("heldout", 1, seed=32)
    guarded = f"test $PPID != {os.getpid()} && {T.fix_command(task, fix)}"

    backend = LocalBackend(root=str(tmp_path / "boxes"), max_sandboxes=2)
    async with await backend.create(task["repo"], SandboxLimits(wall_s=60)) as box:
        rewards = await verify.turn_rewards(task, [_call(0, "echo $PPID"), _call(1, guarded)], box)
    assert rewards == {"call-1": 1.0}
