"""A save that stands still says where it stands: every engine thread's stack, logged once.

A save in flight whose writer has placed nothing for `STUCK_S` seconds would otherwise show only
as a training job that does not move or does not end. The cause may be a disk or a network
filesystem that stopped answering, a GPU call that does not return, or a deadlock. A save hung
that way in one GPU test, and said nothing. The watch thread wakes every `WATCH_S`
seconds. The first time it finds saves in flight and no progress for `STUCK_S`, it logs a
warning with the Python stack of the main thread and of every `tiered-*` thread. After that it
stays quiet until progress resumes and stops again. It only reads: it never interrupts a save.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Callable

from tiered import threads

log = logging.getLogger("tiered")

WATCH_S = 30.0
"""Seconds between looks."""
STUCK_S = 300.0
"""Seconds without progress, with saves in flight, before the stacks are logged."""


def stacks(depth: int = 10) -> str:
    """The innermost `depth` frames of the main thread and of every thread named tiered-*."""
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        if t.ident in frames and t is not threading.current_thread() and (
                t is threading.main_thread() or t.name.startswith("tiered")):
            lines = traceback.format_stack(frames[t.ident])[-depth:]
            out.append(f"  {t.name}:\n" + "".join("  " + line for line in lines))
    return "\n".join(out)


class Watch:
    """Watches saves in flight (`inflight()`: their steps) by a counter that moves with their
    progress (`progress()`), on a thread of its own until `stop()`."""

    def __init__(self, inflight: Callable[[], list[int]], progress: Callable[[], int]):
        self._inflight, self._progress = inflight, progress
        self._stop = threading.Event()
        self._thread = threads.start(self._run, name="tiered-watch")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last, since, told = self._progress(), time.monotonic(), False
        while not self._stop.wait(WATCH_S):
            now, seen, steps = time.monotonic(), self._progress(), self._inflight()
            if seen != last or not steps:
                last, since, told = seen, now, False
                continue
            if not told and now - since >= STUCK_S:
                told = True
                log.warning("tiered: saves in flight (step %s) have made no progress for %.0f s (nothing staged "
                            "or written); they go on waiting. The engine's threads stand at:\n%s",
                            ", ".join(map(str, steps)), now - since, stacks())
