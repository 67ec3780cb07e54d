#!/usr/bin/env python
"""A minimal coding-agent CLI: chat completions with a ``bash`` tool and a ``submit`` tool, nothing else.

It knows only ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``OPENAI_MODEL`` (standard library only, so it starts in
~30 ms), works in its current directory (the repository), and is run by ``agent.py`` inside a sandbox. Each
``bash`` call runs ``bash -c CMD`` in a network namespace of its own when ``unshare -n`` (or, unprivileged,
``unshare -rn``) is permitted, killed after
``--cmd-timeout`` seconds, its output truncated to ``--output-chars``. ``submit`` ends the episode; the last line
printed is ``{"submitted": true|false, "turns": N}``. Run by hand against any OpenAI-compatible server::

    cd some/repo && OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=x OPENAI_MODEL=Qwen/Qwen3-8B \\
        python coder.py --issue "tests/test_core.py::test_clamp fails: assert clamp(9, 0, 5) == 5"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

SYSTEM = "Fix the bug. Use bash to find and edit the code, then submit."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the repository",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the fix",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


def chat(messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    base = os.environ.get("OPENAI_BASE_URL", "https://api.openai.com/v1").rstrip("/")
    body = {
        "model": os.environ.get("OPENAI_MODEL", "policy"),
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": max_tokens,
    }
    request = urllib.request.Request(
        f"{base}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', '')}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            message: dict[str, Any] = json.loads(response.read())["choices"][0]["message"]
            return message
    except urllib.error.HTTPError as exc:
        sys.exit(f"the model endpoint answered {exc.code}: {exc.read()[:500].decode(errors='replace')}")
    except urllib.error.URLError as exc:
        sys.exit(f"cannot reach the model endpoint {base}: {exc.reason}")


def _isolation() -> list[str]:
    """``unshare -n`` (root), else ``unshare -rn`` (a user namespace: an unprivileged sandbox user), else none."""
    for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            pass
    return []


def run_bash(cmd: str, timeout: float, budget: int, prefix: list[str]) -> str:
    proc = subprocess.Popen(
        [*prefix, "bash", "-c", cmd],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        note = f"\n(exit {proc.returncode})" if proc.returncode else ""
    except subprocess.TimeoutExpired as exc:
        with contextlib.suppress(ProcessLookupError):  # the group may be gone, its escapees not
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, _ = proc.communicate(timeout=1)
        except subprocess.TimeoutExpired:  # a process that left the group (setsid) holds the output open
            out = exc.output or b""
            if proc.stdout is not None:
                proc.stdout.close()
            proc.wait()
        note = f"\n(killed after {timeout:g} s)"
    text = out.decode(errors="replace").rstrip("\n")
    if len(text) > budget:
        text = text[:budget] + f"\n... ({len(text) - budget} more characters)"
    return (text or "(no output)") + note


def main() -> None:
    parser = argparse.ArgumentParser(description="Fix a bug described by an issue, in the current directory.")
    parser.add_argument("--issue", required=True)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--cmd-timeout", type=float, default=10.0)
    parser.add_argument("--output-chars", type=int, default=600)
    args = parser.parse_args()
    prefix = _isolation()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": args.issue}]
    submitted = False
    turns = 0
    while turns < args.max_turns and not submitted:
        turns += 1
        message = chat(messages, args.max_tokens)
        calls = message.get("tool_calls") or []
        messages.append({k: v for k, v in message.items() if v is not None})
        if not calls:
            break
        for call in calls:
            name = call["function"]["name"]
            try:
                arguments = json.loads(call["function"].get("arguments") or "{}")
            except json.JSONDecodeError:
                arguments = None
            if name == "submit":
                submitted = True
                break
            if name == "bash" and isinstance(arguments, dict) and isinstance(arguments.get("cmd"), str):
                result = run_bash(arguments["cmd"], args.cmd_timeout, args.output_chars, prefix)
            else:
                result = f"error: unknown tool or bad arguments for {name!r}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    print(json.dumps({"submitted": submitted, "turns": turns}))


if __name__ == "__main__":
    main()
