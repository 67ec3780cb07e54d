"""Tiny shell tasks for Codex CLI: write one word into one file. Tasks, the reward and the warm start's chats.

A task asks for ``file`` to contain ``word``; the reward (``score``) reads the file ``run_codex.sh`` printed after
Codex exited: 1.0 when its content, stripped, is the word, else 0. ``demonstrations()`` are the warm start's chats,
in the layout of Codex's own requests as the proxy receives them (a system turn, an environment turn, the task,
an ``exec_command`` call, its result, a short answer) but without Codex's 4.6k-token instructions, so a supervised
step stays short: they teach SmolLM2 the hermes tool-call format, which it never emits on its own. ``python
tasks.py OUT_DIR`` writes the tasks as JSONL.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

WORDS = [
    *("apple", "banana", "cherry", "grape", "lemon", "mango", "olive", "peach", "pear", "plum", "river", "stone"),
    *("cloud", "storm", "maple", "cedar", "tiger", "zebra", "otter", "eagle", "robin", "amber", "coral", "ivory"),
    *("lilac", "navy", "ruby", "pearl", "opal", "jade"),
]
FILES = ("out.txt", "word.txt", "note.txt", "answer.txt", "result.txt")
PHRASES = (
    "Create a file named {file} that contains the word {word}.",
    "Write the word {word} into a new file called {file}.",
)


def _task(i: int, word: str) -> dict[str, Any]:
    file = FILES[i % len(FILES)]
    question = PHRASES[i % len(PHRASES)].format(file=file, word=word) + " Use the shell."
    return {"id": f"codex-{i}", "question": question, "file": file, "word": word}


def train_tasks() -> list[dict[str, Any]]:
    return [_task(i, w) for i, w in enumerate(WORDS[:24])]


def heldout_tasks() -> list[dict[str, Any]]:
    return [_task(100 + i, w) for i, w in enumerate(WORDS[24:])]


def validation_tasks() -> list[dict[str, Any]]:
    return train_tasks()[:2]


def score(task: dict[str, Any], stdout: str, exit_code: int) -> float:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("LSDK_FILE ")]
    if not lines or lines[-1] == "LSDK_FILE -":
        return 0.0
    content = base64.b64decode(lines[-1].split(" ", 1)[1]).decode("utf-8", "replace")
    return 1.0 if content.strip() == task["word"] else 0.0


ENVIRONMENT = "<environment_context>\n  <cwd>/tmp/work</cwd>\n  <shell>bash</shell>\n</environment_context>"
EXEC_COMMAND = {
    "type": "function",
    "function": {
        "name": "exec_command",
        "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "description": "Shell command to execute."}},
            "required": ["cmd"],
        },
    },
}


def demonstrations() -> list[dict[str, Any]]:
    """One chat per train task (and a second phrasing): the call, its result in Codex's layout, a one-line answer."""
    chats = []
    for i, word in enumerate(WORDS[:24]):
        for j in range(2):
            task = _task(i + j, word)
            cmd = f"printf '{word}\\n' > {task['file']}" if j == 0 else f"echo {word} > {task['file']}"
            call = {
                "id": f"call_{i}_{j}",
                "type": "function",
                "function": {"name": "exec_command", "arguments": json.dumps({"cmd": cmd})},
            }
            result = "Chunk ID: 1\nWall time: 0.0 seconds\nProcess exited with code 0\nOutput:\n"
            chats.append(
                {
                    "tools": [EXEC_COMMAND],
                    "messages": [
                        {"role": "system", "content": "You are a coding agent running in the Codex CLI."},
                        {"role": "user", "content": ENVIRONMENT},
                        {"role": "user", "content": task["question"]},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": result},
                        {"role": "assistant", "content": f"Created {task['file']} with the word {word}."},
                    ],
                }
            )
    return chats


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_tasks()), ("heldout", heldout_tasks())):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
