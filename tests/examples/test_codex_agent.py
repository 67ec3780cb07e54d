"""The Codex CLI example (examples/codex_agent): its tasks, its reward and its warm-start chats, checked fast with
SmolLM2's real tokenizer and the hermes template the example configures (the CLI's own runs are in the
``real_cli`` stage)."""

from __future__ import annotations

import base64
import json
from types import ModuleType
from typing import Any

import pytest

from lightning_sdk.agent.loader import import_path
from tests.trainer.tiny import ROOT

EXAMPLE = ROOT / "examples" / "codex_agent"


def _tasks() -> ModuleType:
    return import_path(EXAMPLE / "tasks.py")


def _stdout(content: str | None, codex_exit: int = 0) -> str:
    last = "LSDK_FILE -" if content is None else f"LSDK_FILE {base64.b64encode(content.encode()).decode()}"
    decoy = f"LSDK_FILE {base64.b64encode(b'decoy').decode()}"
    return f"codex says things\n{decoy}\ncodex exit code 7\ncodex exit code {codex_exit}\n{last}\n"


def test_the_reward_reads_the_file_codex_left_and_whether_codex_ended() -> None:
    tasks = _tasks()
    task = tasks.train_tasks()[0]
    assert tasks.score(task, _stdout(task["word"] + "\n"), 0) == 1.0
    assert tasks.score(task, _stdout(f"  {task['word']}  "), 1) == 1.0  # the file and Codex's exit decide
    assert tasks.score(task, _stdout(task["word"], codex_exit=124), 0) == 0.5  # stopped at run_codex.sh's limit
    assert tasks.score(task, _stdout(task["word"]).replace("codex exit code 0\n", ""), 0) == 0.5  # no exit line
    for wrong in (None, "", task["word"] + "s", f"{task['word']} {task['word']}", "decoy"):
        assert tasks.score(task, _stdout(wrong), 0) == 0.0, wrong
        assert tasks.score(task, _stdout(wrong, codex_exit=124), 0) == 0.0, wrong
    assert tasks.score(task, "no marker at all", 0) == 0.0


def test_heldout_words_are_never_trained_on() -> None:
    tasks = _tasks()
    train, heldout = tasks.train_tasks(), tasks.heldout_tasks()
    assert not {t["word"] for t in train} & {t["word"] for t in heldout}
    assert all(t["word"] in t["question"] and t["file"] in t["question"] for t in train + heldout)
    demo_words = {json.loads(d["messages"][-3]["tool_calls"][0]["function"]["arguments"])["cmd"].split()[1]
                  for d in tasks.demonstrations_from(_codex_like_request())}  # fmt: skip
    assert demo_words == {t["word"] for t in train}


def _codex_like_request() -> dict[str, Any]:
    """A Responses body in the shape of Codex 0.169's first request (developer instructions, a second developer turn
    naming its home, the environment turn with the scratch directory, the task, its function tools and a hosted
    tool), asked with the example's placeholder question: the real one is captured in the real_cli stage."""
    scratch = "/tmp/tmp.AbCdEfGh12"
    env = f"<environment_context>\n  <cwd>{scratch}/work</cwd>\n  <shell>bash</shell>\n</environment_context>"
    tool = {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
        "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    }
    return {
        "model": "policy",
        "stream": True,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "- r0 = /tmp/h/x"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": env}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": _tasks().QUESTION}]},
        ],
        "tools": [tool, {"type": "web_search", "external_web_access": True}],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
    }


def test_the_demonstrations_put_a_solving_call_under_codexs_own_prompt() -> None:
    """Each train task's chat is Codex's request with the task's question, then the ``exec_command`` call that solves
    it: rendered with the hermes template, the tools are in the prompt and only the call and the answer are trained;
    the chats share one scratch directory (not the capture's), so their prompts agree up to the question."""
    from transformers import AutoTokenizer

    from lightning_sdk.policy.smollm2 import prepare_smollm2
    from lightning_sdk.policy.warm_start import render_demonstration
    from lightning_sdk.tokens import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_smollm2(weights=False)))
    renderer = ChatRenderer.for_policy(tokenizer, "hermes", name="smollm2-135m")
    tokenizer.chat_template = renderer.chat_template
    tasks = _tasks()
    demos = tasks.demonstrations_from(_codex_like_request())
    assert len(demos) == 2 * len(tasks.train_tasks())
    rendered = [render_demonstration(tokenizer, d["messages"], d["tools"]) for d in demos[:2]]
    texts = [tokenizer.decode(ids) for ids, _ in rendered]
    for (ids, mask), text, task in zip(
        rendered, texts, [tasks._task(0, "apple"), tasks._task(1, "apple")], strict=True
    ):
        assert "<tools>" in text and '"name": "exec_command"' in text and "You are Codex." in text
        assert task["question"] in text and tasks.QUESTION not in text
        trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert trained.startswith("<tool_call>\n") and f"echo apple > {task['file']}" in trained
        assert trained.count("<|im_end|>") == 2 and f"Created {task['file']}" in trained
    assert all("/tmp/tmp.AbCdEfGh12" not in text for text in texts)  # the capture's own scratch directory
    cwd = texts[0].split("<cwd>")[1].split("</cwd>")[0]
    assert cwd.startswith("/tmp/tmp.") and f"<cwd>{cwd}</cwd>" in texts[1]  # one for every chat: a longer shared head
    head = texts[0].split(tasks._task(0, "apple")["question"])[0]
    assert texts[1].startswith(head) and "<tools>" in head  # instructions, tools, environment: shared
    with pytest.raises(ValueError, match="placeholder"):
        tasks.demonstrations_from({**_codex_like_request(), "input": "Create a file."})
