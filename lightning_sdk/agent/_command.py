"""``CommandAgent``: any program is an agent — a CLI coding agent, a script, a binary in another language.

Each attempt runs the command as a subprocess in a session of its own (its own process group) with the attempt's
endpoint in the environment, so a harness that reads the usual variables needs no change:

* ``OPENAI_BASE_URL`` and ``OPENAI_API_BASE`` (the proxy's ``/v1``), ``OPENAI_API_KEY`` (the attempt token),
  ``OPENAI_MODEL`` (the policy's name) — the OpenAI SDKs, LangChain and LiteLLM's ``openai/`` models read these;
* ``LITELLM_PROXY_API_BASE`` / ``LITELLM_PROXY_API_KEY`` — LiteLLM's ``litellm_proxy/`` models;
* ``LIGHTNING_SDK_TASK`` (the task as JSON), ``LIGHTNING_SDK_ATTEMPT_ID``, ``LIGHTNING_SDK_ROLLOUT_ID`` and
  ``LIGHTNING_SDK_REWARD_URL`` (``POST`` ``{"value": ...}`` there with the bearer token to report a reward).

Arguments may hold placeholders: ``{task}`` (the task as JSON), ``{task[field]}`` (one field; a nested object or
list as JSON), ``{task_file}`` (the path of a file holding the task as JSON) and ``{python}`` (the interpreter running
the worker, for Python programs that need the same environment). Any other braces are left as they are, so a
``python -c`` argument with a dict literal needs no escaping.

The reward comes from ``reward(task, stdout, exit_code)`` when given, or from the program itself through the reward
endpoint. A non-zero exit fails the attempt (with the stderr tail) unless ``fail_on_error=False``, in which case the
reward function scores it. The reward function runs as the attempt, so ``emit_reward`` inside it records on the
attempt. Per-call (per-turn) rewards: a reward function with a keyword parameter ``calls``
(``reward(task, stdout, exit_code, sandbox, *, calls)``) is also given the attempt's answered calls in order
(``lightning_sdk.types.Call``: ``call_id``, ``seq``, the ``request`` and the ``response`` with its tool calls),
read from the proxy (``GET /lightning/v1/calls``) after the program exited; ``emit_reward(v, call_id=c.call_id)``
gives one of them a reward, which the per-turn advantage estimators use (``records/build.py``). Reading them
costs one request per attempt, only for a reward that asks for them; a failure to read them fails the attempt
(retried), never scores it. On timeout, cancellation or exit the whole process group is killed (SIGTERM, then
SIGKILL after ``kill_grace_s``), so grandchildren cannot outlive their attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_sdk.agent._base import AttemptOutcome, format_exception, reward_value, tail
from lightning_sdk.agent._context import AttemptContext, context_for
from lightning_sdk.agent._llm import LLM
from lightning_sdk.agent._server_client import ServerClient
from lightning_sdk.errors import ConfigError, LightningSDKError
from lightning_sdk.sandbox import Sandbox, SandboxError, SandboxSpec
from lightning_sdk.types import Call, Task

__all__ = ["CommandAgent", "CommandResult", "RewardFn", "attempt_calls"]

RewardFn = Callable[..., Any]
"""``reward(task, stdout, exit_code) -> float | None`` or, with a sandbox, ``reward(task, stdout, exit_code,
sandbox)`` (may be async); either may add a keyword parameter ``calls`` to be given the attempt's calls."""


class CommandResult:
    """What one run of the command produced."""

    __slots__ = ("exit_code", "stderr", "stdout", "timed_out")

    def __init__(self, exit_code: int, stdout: str, stderr: str, timed_out: bool) -> None:
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        self.timed_out = timed_out


_PLACEHOLDER = re.compile(r"\{task((?:\[[^\[\]{}]+\])*)\}|\{task_file\}|\{python\}")


def _fill(arg: str, task: Task, task_file: str) -> str:
    """Replace ``{task}``, ``{task[a][b]}``, ``{task_file}`` and ``{python}`` in one argument; other braces stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "{task_file}":
            return task_file
        if m.group(0) == "{python}":
            return sys.executable
        value: Any = task
        for key in re.findall(r"\[([^\]]+)\]", m.group(1) or ""):
            if isinstance(value, list) and key.lstrip("-").isdigit() and -len(value) <= int(key) < len(value):
                value = value[int(key)]
            elif isinstance(value, dict) and key in value:
                value = value[key]
            else:
                raise ConfigError(f"command placeholder {m.group(0)} asks for {key!r}, which the task does not have")
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return _PLACEHOLDER.sub(sub, arg)


def _load_callable(spec: str, base_dir: Path | None = None) -> Callable[..., Any]:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` (relative to ``base_dir``) → the function."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"expected 'module:function' or 'file.py:function', got {spec!r}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            obj: Any = _import_path(path)
        else:
            obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, FileNotFoundError) as exc:
        raise ConfigError(f"cannot load {spec!r}: {exc}") from exc
    if not callable(obj):
        raise ConfigError(f"{spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


def _claim_neighbours(directory: Path) -> None:
    """Let a user file import its neighbours by bare name (``from tasks import ...``): its folder goes first on
    ``sys.path``, and a same-named neighbour of another user folder imported earlier in this process (two examples
    that each have a ``tasks.py``) is dropped from ``sys.modules`` so the import finds this folder's file. Modules
    of the interpreter and of installed packages are never dropped."""
    folder = str(directory)
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for neighbour in directory.glob("*.py"):
        earlier = sys.modules.get(neighbour.stem)
        where = getattr(earlier, "__file__", None)
        if earlier is None or where is None:
            continue
        origin = Path(where).resolve()
        if origin.parent != directory and not any(origin.is_relative_to(p) for p in installed):
            del sys.modules[neighbour.stem]


def _import_path(path: Path) -> Any:
    """Import a Python file as a module (once per resolved path); its directory goes on ``sys.path``."""
    resolved = path.resolve()
    name = f"_lightning_user_{resolved.stem}_{abs(hash(str(resolved)))}"
    if name in sys.modules:
        return sys.modules[name]
    if not resolved.exists():
        raise FileNotFoundError(f"no file {path}")
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    _claim_neighbours(resolved.parent)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class CommandAgent:
    """Run ``command`` (a list of arguments, or a string split like a shell would) once per attempt."""

    def __init__(
        self,
        command: Sequence[str] | str,
        *,
        reward: RewardFn | str | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        max_attempts: int = 1,
        fail_on_error: bool = True,
        kill_grace_s: float = 2.0,
        name: str | None = None,
        sandbox: SandboxSpec | Mapping[str, Any] | None = None,
    ) -> None:
        args = shlex.split(command) if isinstance(command, str) else list(command)
        if not args:
            raise ConfigError("CommandAgent needs a non-empty command")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"CommandAgent timeout must be > 0 seconds, got {timeout}")
        if max_attempts < 1:
            raise ConfigError(f"CommandAgent max_attempts must be >= 1, got {max_attempts}")
        self.command = args
        self.reward: RewardFn | None = _load_callable(reward) if isinstance(reward, str) else reward
        self.timeout = timeout
        self.env = dict(env or {})
        self.cwd = str(cwd) if cwd is not None else None
        self.max_attempts = max_attempts
        self.fail_on_error = fail_on_error
        self.kill_grace_s = kill_grace_s
        self.name = name or Path(args[0]).name
        self.sandbox = SandboxSpec.from_config(sandbox) if isinstance(sandbox, Mapping) else sandbox
        self._reward_takes_calls = self.reward is not None and _takes_calls(self.reward)
        self._reward_takes_sandbox = self.reward is not None and _n_positional(self.reward) >= 4
        if self._reward_takes_sandbox and self.sandbox is None:
            raise ConfigError("a reward(task, stdout, exit_code, sandbox) needs the command agent's sandbox")

    @classmethod
    def from_config(cls, section: Mapping[str, Any], base_dir: str | os.PathLike[str] | None = None) -> CommandAgent:
        """Build from a config section (a dict, e.g. the ``agent:`` section of a YAML file)::

        command: ["python", "solve.py", "--question", "{task[question]}"]   # or one string
        reward: my_pkg.rewards:exact_match      # optional: reward(task, stdout, exit_code)
        timeout: 120
        env: {MY_FLAG: "1"}
        cwd: path/to/dir
        max_attempts: 2
        fail_on_error: true
        sandbox: {files_field: repo, max_sandboxes: 16, limits: {wall_s: 120, cpu_s: 60, memory_mb: 1024}}
        """
        known = {
            "command",
            "reward",
            "timeout",
            "env",
            "cwd",
            "max_attempts",
            "fail_on_error",
            "kill_grace_s",
            "name",
            "sandbox",
        }
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(f"unknown command agent keys {unknown}; known: {sorted(known)}")
        if "command" not in section:
            raise ConfigError("a command agent config needs 'command'")
        env = {str(k): str(v) for k, v in (section.get("env") or {}).items()}
        base = Path(base_dir) if base_dir is not None else None
        cwd = section.get("cwd")
        if base is not None:
            cwd = str(base / cwd) if cwd is not None else str(base)
        reward = section.get("reward")
        return cls(
            section["command"],
            reward=_load_callable(reward, base) if isinstance(reward, str) else reward,
            timeout=section.get("timeout"),
            env=env,
            cwd=cwd,
            max_attempts=int(section.get("max_attempts", 1)),
            fail_on_error=bool(section.get("fail_on_error", True)),
            kill_grace_s=float(section.get("kill_grace_s", 2.0)),
            name=section.get("name"),
            sandbox=section.get("sandbox"),
        )

    def __repr__(self) -> str:
        return f"<CommandAgent {shlex.join(self.command)!r} timeout={self.timeout}>"

    # -- running -------------------------------------------------------------------------------------------------
    def render_args(self, task: Task, task_file: str = "") -> list[str]:
        """The command with its placeholders filled in for ``task``."""
        return [_fill(a, task, task_file) for a in self.command]

    def process_env(self, task: Task, llm: LLM, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The subprocess environment: ours, then the agent's ``env``, then the endpoint (which wins)."""
        env = dict(os.environ)
        env.update(self.env)
        env.update(llm.env())
        env["LIGHTNING_SDK_TASK"] = json.dumps(task, ensure_ascii=False)
        env.update(extra or {})
        return env

    async def execute(
        self,
        task: Task,
        llm: LLM,
        *,
        timeout: float | None,
        extra_env: Mapping[str, str] | None = None,
        sandbox: Sandbox | None = None,
    ) -> CommandResult:
        """Run the command once (in ``sandbox`` when given: its directory, its limits); the process group is killed
        on timeout, cancellation and exit."""
        with tempfile.TemporaryDirectory(prefix="lightning-task-") as tmp:
            text = json.dumps(task, ensure_ascii=False)
            if sandbox is not None:  # where the sandboxed program can read it (and no other sandbox can)
                task_file = sandbox.write_private("task.json", text)
            else:
                task_file = os.path.join(tmp, "task.json")
                Path(task_file).write_text(text, encoding="utf-8")
            args = self.render_args(task, task_file)
            env = self.process_env(task, llm, extra_env)
            if sandbox is not None:
                proc = await sandbox.start(args, env=env)
            else:
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *args,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE,
                        env=env,
                        cwd=self.cwd,
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise ConfigError(f"cannot start {args[0]!r}: {exc}") from exc
            assert proc.stdout is not None and proc.stderr is not None
            readers = [asyncio.ensure_future(_read_all(proc.stdout)), asyncio.ensure_future(_read_all(proc.stderr))]
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                timed_out = True
                await self._kill_group(proc)
            except asyncio.CancelledError:
                await self._kill_group(proc)
                for r in readers:
                    r.cancel()
                raise
            finally:
                _signal_group(proc.pid, signal.SIGKILL)  # leftovers of a program that exited before its children
            out, err = await asyncio.gather(*readers)
            code = sandbox.exit_code(proc) if sandbox is not None else proc.returncode
            code = code if code is not None else -1
            return CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"), timed_out)

    async def _kill_group(self, proc: asyncio.subprocess.Process) -> None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.kill_grace_s)
        except TimeoutError:
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def run_attempt(self, ctx: AttemptContext, *, timeout: float | None) -> AttemptOutcome:
        """Run the command for this attempt and score it (see the module docstring)."""
        if self.sandbox is None:
            return await self._run_attempt(ctx, timeout, None)
        spec = self.sandbox
        try:
            box = await spec.get_backend().create(spec.files_of(ctx.task), spec.limits)
        except (SandboxError, ConfigError) as exc:
            return AttemptOutcome("failed", error=f"sandbox: {exc}")
        try:
            return await self._run_attempt(ctx, timeout, box)
        except SandboxError as exc:  # an infrastructure failure: the attempt fails (and is retried), never reward 0
            return AttemptOutcome("failed", error=f"sandbox: {exc}")
        finally:
            closing = asyncio.ensure_future(box.close())
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:  # cancelled (a released attempt): finish cleaning up, then propagate
                await closing
                raise

    async def _run_attempt(self, ctx: AttemptContext, timeout: float | None, box: Sandbox | None) -> AttemptOutcome:
        extra = {"LIGHTNING_SDK_ATTEMPT_ID": ctx.attempt_id, "LIGHTNING_SDK_ROLLOUT_ID": ctx.rollout_id}
        # the attempt's trace context for an instrumented program (the OpenTelemetry environment-variable carrier)
        extra["TRACEPARENT"] = ctx.traceparent
        if ctx.server_url:
            extra["LIGHTNING_SDK_REWARD_URL"] = f"{ctx.server_url}/lightning/v1/reward"
        try:
            result = await self.execute(ctx.task, ctx.llm, timeout=timeout, extra_env=extra, sandbox=box)
        except ConfigError as exc:
            return AttemptOutcome("failed", error=str(exc))
        if box is not None:  # the verifier runs once nothing of the agent runs any more (a fork it left, a setsid)
            await box.kill_processes()
        if result.timed_out:
            return AttemptOutcome(
                "timed_out", error=f"{self.name} timed out after {timeout} s\n{tail(result.stderr)}".rstrip()
            )
        if result.exit_code != 0 and self.fail_on_error:
            return AttemptOutcome(
                "failed",
                error=f"{self.name} exited with code {result.exit_code}\n{tail(result.stderr)}".rstrip(),
                output=tail(result.stdout),
            )
        if self.reward is None:
            return AttemptOutcome("succeeded", output=tail(result.stdout))
        args: list[Any] = [ctx.task, result.stdout, result.exit_code]
        if self._reward_takes_sandbox:
            args.append(box)
        kwargs: dict[str, Any] = {}
        if self._reward_takes_calls:
            try:
                kwargs["calls"] = await attempt_calls(ctx)
            except LightningSDKError as exc:  # the proxy could not say: fail (retried), never score without them
                return AttemptOutcome("failed", error=f"reading the attempt's calls: {exc}", output=tail(result.stdout))
        context = context_for(ctx)  # the reward runs as the attempt: its emit_reward calls record on it
        try:
            value = context.run(self.reward, *args, **kwargs)
            if inspect.isawaitable(value):
                value = await asyncio.get_running_loop().create_task(_awaited(value), context=context)
            reward = reward_value(value, f"reward function of {self.name}")
        except SandboxError:
            raise
        except Exception as exc:
            return AttemptOutcome("failed", error=format_exception(exc), output=tail(result.stdout))
        return AttemptOutcome("succeeded", reward=reward, output=tail(result.stdout))

    def __call__(self, task: Task, llm: LLM) -> float | None:
        """Run once as plain code (outside training): returns the reward function's value (None without one; a
        reward that takes ``calls`` gets none, there being no proxy)."""
        if self.sandbox is not None:
            raise ConfigError("a command agent with a sandbox runs through a worker (run_attempt), not as plain code")
        result = asyncio.run(self.execute(task, llm, timeout=self.timeout))
        if result.timed_out:
            raise TimeoutError(f"{self.name} timed out after {self.timeout} s")
        if result.exit_code != 0 and self.fail_on_error:
            raise ConfigError(f"{self.name} exited with code {result.exit_code}: {tail(result.stderr, 2000)}")
        if self.reward is None:
            return None
        extra: dict[str, Any] = {"calls": []} if self._reward_takes_calls else {}  # no proxy here: no calls
        value = self.reward(task, result.stdout, result.exit_code, **extra)
        if inspect.isawaitable(value):
            raise ConfigError("an async reward function needs the async API (CommandAgent.execute)")
        return reward_value(value, "reward function")


def _n_positional(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` accepts (a ``*args`` counts as many; a ``calls`` parameter does not:
    it is passed by keyword)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 3
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 99
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "calls" for p in params)


def _takes_calls(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` names a ``calls`` parameter that can be passed by keyword (``**kwargs`` alone does not)."""
    try:
        param = inspect.signature(fn).parameters.get("calls")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)


async def attempt_calls(ctx: AttemptContext) -> list[Call]:
    """The attempt's answered calls in ``seq`` order, from the proxy that serves it (``GET /lightning/v1/calls``
    with the attempt token, which waits for the attempt's requests in flight): what a per-call reward needs."""
    if not ctx.server_url:
        raise LightningSDKError(f"attempt {ctx.attempt_id} has no proxy URL to read its calls from")
    client = ServerClient(ctx.server_url)
    try:
        return await client.calls(ctx.llm.api_key)
    finally:
        await client.close()


async def _awaited(value: Any) -> Any:
    return await value


async def _read_all(stream: asyncio.StreamReader) -> bytes:
    chunks = []
    while chunk := await stream.read(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # the child leads its own session, so its pid is the group id
