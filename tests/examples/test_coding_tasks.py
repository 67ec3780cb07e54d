"""The coding example's task generator: every bug kind is produced and caught by the hidden tests, the reference fix
(the demonstration's sed command, run for real in a sandbox) resolves it, splits are disjoint by function, and the
hidden tests never reach the agent's sandbox."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "coding_agent"
sys.path.insert(0, str(EXAMPLE))

import tasks as T  # noqa: E402
import verify as V  # noqa: E402

from lightning_sdk.sandbox import LocalBackend  # noqa: E402


@pytest.fixture(scope="module")
def train() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return T.make_tasks_with_fixes("train", 120, seed=11)


@pytest.fixture(scope="module")
def heldout() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return T.make_tasks_with_fixes("heldout", 60, seed=12)


def test_all_bug_kinds_are_generated_and_balanced(train: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    kinds = collections.Counter(t["bug_kind"] for t, _ in train)
    assert set(kinds) == set(T.BUG_KINDS) and len(T.BUG_KINDS) >= 5
    assert max(kinds.values()) - min(kinds.values()) <= 1
    shapes = {t["function"].rsplit("_", 1)[1] for t, _ in train}
    assert len(shapes) >= 10


def test_a_task_is_a_repository_an_issue_and_test_lists(train: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    task, fix = train[0]
    assert set(task["repo"]) == {"mathkit/__init__.py", task["path"], f"build/lib/{task['path']}"}
    assert task["repo"][f"build/lib/{task['path']}"] == task["repo"][task["path"]]  # the stale copy, bug included
    assert not any(p.startswith("tests/") for p in task["repo"])
    f2p = task["FAIL_TO_PASS"][0]
    assert task["issue"].startswith(f"FAILED {f2p}\n>       assert {task['function']}(")
    assert "\nE       " in task["issue"]
    assert task["FAIL_TO_PASS"] and task["PASS_TO_PASS"]
    assert not set(task["FAIL_TO_PASS"]) & set(task["PASS_TO_PASS"])
    assert "fix" not in task and fix["new"] not in json.dumps(task["issue"])  # the answer is not handed over
    # the bug is in the named function's file, at the reference fix's line
    line = task["repo"][task["path"]].splitlines()[fix["line"] - 1]
    assert fix["old"] in line


def test_splits_are_disjoint_by_function(
    train: list[tuple[dict[str, Any], dict[str, Any]]], heldout: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    def functions(rows: list[tuple[dict[str, Any], dict[str, Any]]]) -> set[str]:
        return {n for t, _ in rows for n in [t["function"], *t["neighbours"]]}

    assert not functions(train) & functions(heldout)
    sources_train = {f.source for f in T.corpus() if T._split_of(f.name) == "train"}
    sources_held = {f.source for f in T.corpus() if T._split_of(f.name) == "heldout"}
    assert not sources_train & sources_held
    assert len(T.corpus()) >= 1000 and 0.1 < len(sources_held) / len(T.corpus()) < 0.3
    demo_text = json.dumps(T.demonstrations()[:300])
    assert not any(t["function"] in demo_text for t, _ in heldout)


def test_hidden_tests_fail_on_the_bug_and_pass_on_the_fix(train: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    for task, fix in train[:60]:
        scope: dict[str, Any] = {}
        tests = T.hidden_tests(task)
        assert list(tests) == [f"tests/test_{task['module']}.py"]
        body = task["repo"][task["path"]]
        fixed_lines = body.splitlines()
        k = fix["line"] - 1
        fixed_lines[k] = fixed_lines[k].replace(fix["old"], fix["new"], 1)
        for source, expect_fail in ((body, True), ("\n".join(fixed_lines) + "\n", False)):
            exec(source, scope)
            failing = set()
            test_src = next(iter(tests.values())).split("\n", 1)[1]  # without the import line
            exec(test_src, scope)
            for test_id in task["FAIL_TO_PASS"] + task["PASS_TO_PASS"]:
                try:
                    scope[test_id.split("::")[1]]()
                except Exception:
                    failing.add(test_id)
            if expect_fail:
                assert failing == set(task["FAIL_TO_PASS"]), task["instance_id"]
            else:
                assert not failing, task["instance_id"]


async def test_reference_episode_in_a_sandbox_is_rewarded_and_a_wrong_one_is_not(
    tmp_path: Path, train: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    """The demonstration's commands, run for real in a sandbox, then the verifier on a fresh copy."""
    backend = LocalBackend(root=tmp_path / "boxes")
    submitted = json.dumps({"submitted": True, "turns": 3})
    for task, fix in train[:6]:
        async with await backend.create(task["repo"]) as box:
            grep = await box.exec(T.locate_command(task))
            assert grep.stdout.rstrip("\n") == T.grep_output(task)
            assert not any(p.startswith("tests/") for p in box.snapshot())  # hidden tests absent
            before = await V.run_tests(task, box)
            assert set(before["failed"]) == set(task["FAIL_TO_PASS"])
            assert await V.reward(task, submitted, 0, box) == 0.0
            edit = await box.exec(T.fix_command(task, fix))
            assert edit.exit_code == 0
            assert await V.reward(task, submitted, 0, box) == 1.0
            assert await V.reward(task, json.dumps({"submitted": False}), 0, box) == 0.0  # never submitted
    assert backend.active() == 0 and not any((tmp_path / "boxes").iterdir())


def test_episode_fits_the_tiny_context() -> None:
    from lightning_sdk.policy.tokenizer import build_tokenizer

    demos = T.demonstrations()[:400]
    boot = build_tokenizer(["x"], vocab_size=300)
    corpus = [str(boot.apply_chat_template(d["messages"], tools=d["tools"], tokenize=False)) for d in demos]
    tok = build_tokenizer(corpus, vocab_size=1024)
    lengths = [len(tok.apply_chat_template(d["messages"], tools=d["tools"], tokenize=True)) for d in demos[:100]]
    assert max(lengths) < 400  # the tiny policy's context is 1024


async def test_demonstrations_point_the_fix_at_the_wrong_file_in_the_stated_share(tmp_path: Path) -> None:
    """``demonstrations()``: every one carries the reference substitution; ``WRONG_FILE_SHARE`` of them (within
    sampling error) point sed at the module's stale build copy (``stale_copy``), which, played for real in a
    sandbox, leaves the bug (reward 0) where the same substitution on the file grep showed resolves it (1.0)."""
    demos = T.demonstrations()
    pairs = T.make_tasks_with_fixes("train", len(demos), seed=3)
    commands = [json.loads(d["messages"][4]["tool_calls"][0]["function"]["arguments"])["cmd"] for d in demos]
    wrong = [cmd == T.fix_command(t, fix, T.stale_copy(t)) for cmd, (t, fix) in zip(commands, pairs, strict=True)]
    right = [cmd == T.fix_command(t, fix) for cmd, (t, fix) in zip(commands, pairs, strict=True)]
    assert all(w != r for w, r in zip(wrong, right, strict=True))  # one or the other, always the reference OLD/NEW
    assert abs(sum(wrong) / len(demos) - T.WRONG_FILE_SHARE) < 0.04
    backend = LocalBackend(root=tmp_path / "boxes")
    submitted = json.dumps({"submitted": True, "turns": 3})
    task, fix = pairs[0]
    for path, expected in ((T.stale_copy(task), 0.0), (None, 1.0)):
        async with await backend.create(task["repo"]) as box:
            assert (await box.exec(T.fix_command(task, fix, path))).exit_code == 0
            assert await V.reward(task, submitted, 0, box) == expected
