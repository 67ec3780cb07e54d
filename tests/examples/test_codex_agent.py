"""The Codex CLI example (examples/codex_agent): its tasks, its reward and its warm-start chats, checked fast with
SmolLM2's real tokenizer and the hermes template the example configures (the CLI's own runs are in the
``real_cli`` stage)."""

from __future__ import annotations

import base64
import json
from types import ModuleType

from lightning_sdk.agent.loader import import_path
from tests.trainer.tiny import ROOT

EXAMPLE = ROOT / "examples" / "codex_agent"


def _tasks() -> ModuleType:
    return import_path(EXAMPLE / "tasks.py")


def _stdout(content: str | None) -> str:
    last = "LSDK_FILE -" if content is None else f"LSDK_FILE {base64.b64encode(content.encode()).decode()}"
    return f"codex says things\nLSDK_FILE {base64.b64encode(b'decoy').decode()}\ncodex exit code 0\n{last}\n"


def test_the_reward_reads_the_file_codex_left() -> None:
    tasks = _tasks()
    task = tasks.train_tasks()[0]
    assert tasks.score(task, _stdout(task["word"] + "\n"), 0) == 1.0
    assert tasks.score(task, _stdout(f"  {task['word']}  "), 1) == 1.0  # the file decides, not Codex's exit code
    for wrong in (None, "", task["word"] + "s", f"{task['word']} {task['word']}", "decoy"):
        assert tasks.score(task, _stdout(wrong), 0) == 0.0, wrong
    assert tasks.score(task, "no marker at all", 0) == 0.0


def test_heldout_words_are_never_trained_on() -> None:
    tasks = _tasks()
    train, heldout = tasks.train_tasks(), tasks.heldout_tasks()
    assert not {t["word"] for t in train} & {t["word"] for t in heldout}
    assert all(t["word"] in t["question"] and t["file"] in t["question"] for t in train + heldout)
    demo_words = {json.loads(d["messages"][3]["tool_calls"][0]["function"]["arguments"])["cmd"].split()[1]
                  for d in tasks.demonstrations()}  # fmt: skip
    assert not {w.strip("'\\n") for w in demo_words} & {t["word"] for t in heldout}


def test_the_demonstrations_render_the_tool_and_its_call_with_the_hermes_template() -> None:
    from transformers import AutoTokenizer

    from lightning_sdk.policy.smollm2 import prepare_smollm2
    from lightning_sdk.policy.warm_start import render_demonstration
    from lightning_sdk.tokens import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_smollm2(weights=False)))
    renderer = ChatRenderer.for_policy(tokenizer, "hermes", name="smollm2-135m")
    tokenizer.chat_template = renderer.chat_template
    demo = _tasks().demonstrations()[0]
    ids, mask = render_demonstration(tokenizer, demo["messages"], demo["tools"])
    text = tokenizer.decode(ids)
    assert "<tools>" in text and '"name": "exec_command"' in text
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained.startswith("<tool_call>\n") and "printf 'apple\\\\n' > out.txt" in trained
    assert trained.count("<|im_end|>") == 2 and "Created out.txt" in trained
