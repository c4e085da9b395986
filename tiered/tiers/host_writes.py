"""Host extents written at their offsets in a file, in large pieces on a few threads.

One queued item per extent, whose pieces the threads take in turn: no future or pool task per
piece. A save of a large state drains thousands of 16 MiB pieces faster than the disk takes
them, and as objects (a future, its condition, lock and work item each) they lived in the queue
long enough to set off the collector's full passes over the training process, which hold every
Python thread (about 1,300 futures, with their conditions, locks and
waiter queues, were alive at the end of a 24 GB save's staging).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable


class HostWrites:
    """`write(view, offset)` runs for each piece of at most `task` bytes of every submitted
    extent, on up to `threads` threads started on first use. `wait()` returns once every piece
    is written and raises the first failure; `close()` then stops the threads."""

    def __init__(self, write: Callable[[memoryview, int], None], threads: int, task: int, name: str):
        self._write, self._threads, self._task, self._name = write, threads, task, name
        self._queue: deque[list[Any]] = deque()
        self._cv = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._workers: list[threading.Thread] = []
        self._closed = False

    def submit(self, offset: int, buf: memoryview, on_done: Callable[[], None] | None = None) -> None:
        """Queue `buf` for writing at `offset`; `on_done()` runs once all of it is written or has
        failed (on a writing thread)."""
        pieces = -(-len(buf) // self._task)
        if not pieces:
            if on_done is not None:
                on_done()
            return
        with self._cv:
            if self._closed:
                raise RuntimeError("write after close")
            self._pending += pieces
            self._queue.append([offset, buf, 0, pieces, on_done])  # (next piece's start, pieces left)
            while len(self._workers) < self._threads:
                t = threading.Thread(target=self._run, name=f"{self._name}_{len(self._workers)}", daemon=True)
                t.start()
                self._workers.append(t)
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                item = self._queue[0]
                start = item[2]
                item[2] += self._task
                if item[2] >= len(item[1]):
                    self._queue.popleft()
            failed = None
            try:
                self._write(item[1][start:start + self._task], item[0] + start)
            except BaseException as exc:  # noqa: BLE001 - raised by wait()
                failed = exc
            with self._cv:
                if failed is not None and self._error is None:
                    self._error = failed
                item[3] -= 1
                last = item[3] == 0
            if last and item[4] is not None:
                try:
                    item[4]()
                except BaseException as exc:  # noqa: BLE001 - raised by wait()
                    with self._cv:
                        self._error = self._error or exc
            with self._cv:
                self._pending -= 1
                if not self._pending:
                    self._cv.notify_all()

    def wait(self) -> None:
        with self._cv:
            while self._pending:
                self._cv.wait()
            failed, self._error = self._error, None
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Stop the threads once the queue is empty (call wait() first to see failures)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._workers:
            t.join()
