"""The embedded learner in a process of its own (``[learner] process = true``): ``ProcessLearner``.

In one process the learner's thread shares Python's interpreter lock with the embedded engine's thread and the event
loop (proxy, store, in-process agents). On the calc example's RL phase (2 cores, 2026-12-06) the process used ~1.3
of its 2 cores while the learner's step took 7.9-9.9 s of wall time for 4.3-6.0 s of its thread's CPU: the rest it
waited for the lock, which the engine's and the loop's Python held. A learner in its own process has its own
interpreter: its step runs at the speed it runs alone while the engine generates in the main process.

The child loads the policy from the run's model directory and builds the same ``Learner`` (same config, same seed),
so its first step starts from the weights the parent's model has; a warm start trains the parent's copy and
``reset_optimizer`` hands its weights to the child with a fresh optimizer, as the Ray learner actor does
(``lightning_sdk/cluster/placement.py``). Requests and answers travel as pickles over a pipe (records one way, a state
dict or the step's metrics the other: ~13 MB of weights for the tiny policy, a few ms). A request the child fails
answers the child's exception (its type where it can be rebuilt, else a ``TrainerError`` with its traceback); a child
that dies makes the call raise ``TrainerError`` naming its exit code, never a hang.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from lightning_sdk.errors import TrainerError
from lightning_sdk.records.record import Record
from lightning_sdk.trainer.learner import LearnerConfig
from lightning_sdk.trainer.parts import LearnerLike

__all__ = ["ProcessLearner"]

logger = logging.getLogger(__name__)


def _send(conn: Connection, obj: Any) -> None:
    # plain pickle (torch's multiprocessing reducers would move every tensor into shared memory and pass file
    # descriptors): the payloads are small and copied once
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _serve(conn: Connection, model_dir: str, config: dict[str, Any], pad_id: int) -> None:
    """The child: build the learner, then answer requests until ``close`` or the parent's end of the pipe closes."""
    from lightning_sdk.memory import limit_malloc

    limit_malloc()
    import torch

    from lightning_sdk.policy.model import load_policy
    from lightning_sdk.trainer.learner import Learner

    try:
        model, _ = load_policy(model_dir)
        learner = Learner(model, LearnerConfig.model_validate(config), pad_id=pad_id)
    except BaseException as exc:  # the parent's start-up call hears why
        _send(conn, (False, _portable(exc)))
        return
    _send(conn, (True, os.getpid()))
    while True:
        try:
            op, args = _recv(conn)
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            if op == "close":
                _send(conn, (True, None))
                return
            if op == "step":
                records, threads = args
                if threads != learner.config.threads:
                    learner.config = learner.config.model_copy(update={"threads": threads})
                    if threads:
                        torch.set_num_threads(threads)
                out: Any = learner.step(records)
            elif op == "weights":
                out = learner.weights()
            elif op == "state_dict":
                out = learner.state_dict()
            elif op == "load_state_dict":
                learner.load_state_dict(args[0])
                out = None
            elif op == "load_weights":
                model.load_state_dict(args[0])
                learner.reset_optimizer()
                out = None
            else:
                raise TrainerError(f"the learner process got an unknown request {op!r}")
            _send(conn, (True, out))
        except BaseException as exc:
            _send(conn, (False, _portable(exc)))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles (the parent re-raises its type), else a ``TrainerError`` carrying its traceback."""
    text = "".join(traceback.format_exception(exc)).rstrip()
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return TrainerError(f"the learner process failed:\n{text}")
    exc.add_note(f"(in the learner process)\n{text}")
    return exc


class ProcessLearner(LearnerLike):
    """The training loop's learner (``LearnerLike``) in a spawned child process (see the module's docstring).

    ``config`` is the parent's view of the learner's config: ``threads`` (which ``BalancedThreads`` sets between
    steps) goes with each step; ``model`` is the parent's copy of the policy (what the warm start trains, whose
    weights ``reset_optimizer`` hands over)."""

    def __init__(
        self, model_dir: Path, config: LearnerConfig, model: Any, *, pad_id: int, start_timeout_s: float = 300.0
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # fork after torch's threads started is unsafe
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve,
            args=(child, str(model_dir), config.model_dump(mode="json"), pad_id),
            name="lightning-sdk-learner",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self.config = config
        self._model = model
        self.steps = 0
        self.pid: int = int(self._answer("start", start_timeout_s))

    # -- the pipe ----------------------------------------------------------------------------------------------------
    def _answer(self, what: str, timeout_s: float | None = None) -> Any:
        waited = 0.0
        while not self._conn.poll(1.0):
            waited += 1.0
            if not self._proc.is_alive():
                raise TrainerError(f"the learner process died during {what} (exit code {self._proc.exitcode})")
            if timeout_s is not None and waited >= timeout_s:
                self._proc.kill()
                raise TrainerError(f"the learner process did not answer {what} within {timeout_s:.0f} s")
        try:
            ok, value = _recv(self._conn)
        except (EOFError, OSError) as exc:
            self._proc.join(5.0)
            raise TrainerError(f"the learner process died during {what} (exit code {self._proc.exitcode})") from exc
        if not ok:
            raise value
        return value

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            if not self._proc.is_alive():
                raise TrainerError(f"the learner process is not running (exit code {self._proc.exitcode}): {op}")
            try:
                _send(self._conn, (op, args))
            except (BrokenPipeError, OSError) as exc:
                raise TrainerError(f"the learner process died before {op} (exit code {self._proc.exitcode})") from exc
            return self._answer(op)

    # -- LearnerLike -------------------------------------------------------------------------------------------------
    def step(self, records: Sequence[Record]) -> dict[str, float]:
        metrics: dict[str, float] = self._call("step", list(records), self.config.threads)
        self.steps += 1
        return metrics

    def weights(self) -> dict[str, Any]:
        out: dict[str, Any] = self._call("weights")
        return out

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = self._call("state_dict")
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)
        self.steps = int(state["steps"])

    def reset_optimizer(self) -> None:
        """The parent's weights (a warm start trained them) to the child, with a fresh optimizer."""
        self._call("load_weights", self._model.state_dict())
        self.steps = 0

    def where(self) -> dict[str, Any]:
        return {"part": "learner", "pid": self.pid, "process": "child", "steps": self.steps}

    def save(self, out: Path, tokenizer: Any) -> None:
        """The trained model into ``out``: the child's weights, written with the parent's model config."""
        self._model.save_pretrained(str(out), state_dict=self.weights())
        tokenizer.save_pretrained(str(out))

    def close(self) -> None:
        """Ask the child to stop; kill it if it does not within 10 s."""
        if self._proc.is_alive():
            try:
                with self._lock:
                    _send(self._conn, ("close", ()))
                    if self._conn.poll(10.0):
                        _recv(self._conn)
            except (BrokenPipeError, EOFError, OSError):
                pass
            self._proc.join(10.0)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5.0)
        self._conn.close()
