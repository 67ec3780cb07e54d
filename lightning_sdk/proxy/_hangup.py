"""The agent hanging up mid-call: a watch per call that cancels its serving task, armed by one sweeper timer.

See ``HangUpWatch``; ``ProxyConfig.cancel_on_disconnect`` and ``hang_up_watch_after_s`` set it up.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from starlette.types import Receive

__all__ = ["HangUpSweeper", "HangUpWatch"]


class HangUpWatch:
    """Cancel the task serving a request when the agent hangs up (which closes the upstream request too).

    After the request body is read, the server's ``receive()`` only returns once the client disconnects (or the
    response is complete); a done-callback on it cancels the serving task. The watch is armed ``after_s`` seconds
    into the call by a ``HangUpSweeper`` (one timer for all calls, not a task or a timer per call: a task per
    request was a tenth of the proxy's CPU per call on a small machine, a timer per request ~2 us); most fast calls
    end before that. A hang-up before that is seen when the watch is armed (the server remembers the disconnect),
    so an LLM generation is never left running for much more than ``after_s``. Without a sweeper it is armed at once.
    """

    __slots__ = ("_active", "_fut", "_receive", "_task", "gone")

    def __init__(
        self, receive: Receive, task: asyncio.Task[Any] | None = None, sweeper: HangUpSweeper | None = None
    ) -> None:
        self.gone = False
        self._active = True
        self._task = task if task is not None else asyncio.current_task()  # the task serving the request
        self._fut: asyncio.Future[Any] | None = None
        self._receive: Receive | None = receive
        if sweeper is not None:
            sweeper.add(self)
        else:
            self.arm()

    def arm(self) -> None:
        receive, self._receive = self._receive, None
        if self._active and receive is not None:
            self._fut = asyncio.ensure_future(receive())
            self._fut.add_done_callback(self._on_message)

    def _on_message(self, fut: asyncio.Future[Any]) -> None:
        if not self._active or fut.cancelled() or fut.exception() is not None:
            return
        if fut.result().get("type") == "http.disconnect" and self._task is not None:
            self.gone = True
            self._task.cancel()

    def close(self) -> None:
        self._active = False
        self._receive = self._task = None  # the sweeper may hold this watch a while longer: not the request's objects
        if self._fut is not None:
            self._fut.cancel()


class HangUpSweeper:
    """Arms each ``HangUpWatch`` once its call has run ``after_s`` seconds, with one timer for all of them.

    Watches are queued in the order they start (so by deadline); the timer fires at the first deadline, arms every
    watch that is due (a closed one is dropped) and is set again no sooner than ``after_s / 4`` later, so a busy
    proxy runs it a few times per ``after_s`` instead of once per call. A watch is armed between ``after_s`` and
    ``1.25 * after_s`` into its call. One sweeper serves one event loop at a time (a new loop starts afresh).
    """

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.tick_s = after_s / 4
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due: collections.deque[tuple[float, HangUpWatch]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, watch: HangUpWatch) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._due, self._timer = loop, collections.deque(), None
        deadline = loop.time() + self.after_s
        self._due.append((deadline, watch))
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._sweep)

    def _sweep(self) -> None:
        loop = self._loop
        if loop is None or asyncio.get_running_loop() is not loop:
            return  # a timer of a loop this sweeper has left
        self._timer = None
        t = loop.time()
        due = self._due
        while due and due[0][0] <= t:
            due.popleft()[1].arm()
        if due:
            self._timer = loop.call_at(max(due[0][0], t + self.tick_s), self._sweep)
