"""The streams an engine serves now, so that a logically removed instance leaves no zombie
stream (P/D-Serve §3.4: the faulty instance is logically removed first, and its in-flight requests
end cleanly).

Each streaming exchange (``/v1/generate``, ``/v1/decode``) runs in its handler's task, inside
:meth:`OpenStreams.track`. :meth:`OpenStreams.end_all` cancels every such task, marking why: the
cancellation unwinds the exchange wherever it waits (prefill compute, a decode's answer, a KV
pull, the decode batch), so each hold (slot, place, KV) is given back by the ``with`` blocks that
already give it back on every other way out, and the HTTP layer, seeing the mark, ends the stream
with its error event instead of dropping the connection. Nothing is added per token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from matrixserve.api.engine_protocol import Event


class OpenStreams:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()
        self._ending: dict[asyncio.Task[object], Event] = {}  # cancelled by end_all, and why
        self._taken: set[asyncio.Task[object]] = set()  # those that took their cancel back
        self.on_empty: Callable[[], None] = lambda: None  # the last stream ended

    def __len__(self) -> int:
        return len(self._tasks)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """The current task serves a stream for the duration of the block."""
        task = asyncio.current_task()
        assert task is not None, "a stream is served in a task"
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)
            self._ending.pop(task, None)
            self._taken.discard(task)
            if not self._tasks:
                self.on_empty()

    def end_all(self, event: Event) -> int:
        """End every stream with ``event`` (each once); returns how many are ending. Called from
        the event loop, so every tracked task is waiting somewhere inside its block."""
        for task in self._tasks - set(self._ending):
            self._ending[task] = event
            task.cancel()
        return len(self._ending)

    def ended(self) -> Event | None:
        """The event that ends the current task's stream, the first time it is asked after
        :meth:`end_all` cancelled it (the cancellation is then taken back: the task goes on to
        write the event)."""
        task = asyncio.current_task()
        if task is None or task not in self._ending or task in self._taken:
            return None
        self._taken.add(task)
        task.uncancel()
        return self._ending[task]
