"""Tiny shell tasks for Codex CLI: write one word into one file. Tasks, the reward and the warm start's chats.

A task asks for ``file`` to contain ``word``; the reward (``score``) reads the file ``run_codex.sh`` printed after
Codex exited: 1.0 when its content, stripped, is the word and Codex ended by itself, 0.5 when the word is right but
Codex had to be stopped, else 0. ``demonstrations()`` are the warm start's chats under Codex's own first request
(captured from ``codex exec`` by ``codex_request``): its instructions, tools and environment turns, the task, an
``exec_command`` call that solves it, Codex's result and a short answer. They teach SmolLM2 the hermes tool-call
format, which it never emits on its own, in the context it will meet it in. ``python tasks.py OUT_DIR`` writes the
tasks as JSONL."""

from __future__ import annotations

import base64
import json
import random
import string
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
    """1.0 when the file ``run_codex.sh`` printed holds the word and Codex ended by itself (exit code 0); 0.5 when the
    file is right but Codex did not end (it went on calling tools until ``run_codex.sh``'s time limit stopped it, or
    failed); 0 otherwise."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("LSDK_FILE ")]
    if not lines or lines[-1] == "LSDK_FILE -":
        return 0.0
    content = base64.b64decode(lines[-1].split(" ", 1)[1]).decode("utf-8", "replace")
    if content.strip() != task["word"]:
        return 0.0
    codes = [ln.rsplit(" ", 1)[-1] for ln in stdout.splitlines() if ln.startswith("codex exit code ")]
    return 1.0 if codes and codes[-1] == "0" else 0.5


def codex_request(question: str = "{question}") -> dict[str, Any]:
    """Codex's real first request (a Responses API body) for ``question``: ``codex exec`` by its own entry point
    (``run_codex.sh``, the same flags as the attempts) against a loopback server that keeps the body and answers 400,
    so Codex stops after one request. Its instructions, tools and environment turns are Codex's own, word for word."""
    import http.server
    import os
    import subprocess
    import tempfile
    import threading

    bodies: list[dict[str, Any]] = []

    class Capture(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers.get("content-length", 0)))))
            err = json.dumps({"error": {"message": "captured", "type": "invalid_request_error"}}).encode()
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(err)))
            self.end_headers()
            self.wfile.write(err)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            task_file = Path(tmp) / "task.json"
            task_file.write_text(json.dumps({"question": question, "file": "out.txt"}))
            env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{server.server_port}/v1", "OPENAI_API_KEY": "x"}
            script = Path(__file__).with_name("run_codex.sh")
            subprocess.run(
                ["bash", str(script), str(task_file)], env=env, capture_output=True, timeout=120, check=False
            )
    finally:
        server.shutdown()
        server.server_close()
    if not bodies:
        raise RuntimeError("Codex sent no request: is `codex` (npm @openai/codex) on PATH?")
    return bodies[0]


#: what Codex 0.169's exec_command answers for a command that printed nothing (its own layout, read from a recorded
#: call's prompt)
RESULT = (
    "Chunk ID: {chunk:06x}\nWall time: 0.0000 seconds\nProcess exited with code 0\nOriginal token count: 0\nOutput:\n"
)


#: the question of the captured request, replaced by each task's own
QUESTION = "LSDK_QUESTION_PLACEHOLDER"


def demonstrations() -> list[dict[str, Any]]:
    """The warm start's chats under Codex's real prompt (``demonstrations_from`` Codex's captured first request)."""
    return demonstrations_from(codex_request(QUESTION))


def demonstrations_from(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The warm start's chats under Codex's real prompt: its first request (``request``, asked with ``QUESTION``) for
    each train task (translated to chat form by the proxy's own Responses surface, so the rendered prompt is the one
    RL calls see, 5.7k tokens), then an ``exec_command`` call that solves the task (``echo WORD > FILE``), Codex's
    result layout and a one-line answer. The chats share one scratch directory (an attempt's own differs; what the
    policy must write does not depend on it), so with ``warm_start.share_prefix`` the 5.7k-token head they share
    (instructions, tools, environment) runs once per step, and each row's own ~80 tokens (the task, the call, its
    result, the answer) are what attend to it with gradients: a step of 4 rows took 21 s on 2 cores with a scratch
    directory per chat (240 tokens of each row's own), mostly the attention's backward over the 5.8k-token context."""
    from lightning_sdk.proxy.surfaces import ResponsesSurface

    raw = json.dumps(request)
    if QUESTION not in raw or "<cwd>" not in raw:
        raise ValueError("the request holds no placeholder question or no <cwd>: not Codex's first request")
    scratch = raw.split("<cwd>", 1)[1].split("</cwd>", 1)[0].rsplit("/", 1)[0]  # run_codex.sh's mktemp -d
    surface = ResponsesSurface()
    rng = random.Random(0)
    chats = []
    fresh = "/tmp/tmp." + "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(10))
    for i, word in enumerate(WORDS[:24]):
        for j in range(2):
            task = _task(i + j, word)
            body = json.loads(raw.replace(scratch, fresh).replace(QUESTION, task["question"]))
            chat = surface.first_request_chat(body)
            cmd = f"echo {word} > {task['file']}"
            call_id = f"call_{rng.getrandbits(48):012x}"
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": "exec_command", "arguments": json.dumps({"cmd": cmd})},
            }
            result = RESULT.format(chunk=rng.getrandbits(24))
            chats.append(
                {
                    "tools": chat["tools"],
                    "messages": [
                        *chat["messages"],
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call_id, "content": result},
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
