"""How long a thread that wants the GIL waits for it during a span of the benchmark, and where
the engine's threads were each time it waited long.

On a slow host a guarded 24 GB save stalled two to three times as long as on a fast one, with the
same code and GPU (docs/benchmarks.md): the training thread's kernel
launches must keep pace with its GPU, and the engine's threads (~600 ms of Python per 24 GB save
there) contend with it for the GIL. A thread holding the GIL in Python gives it up within the
switch interval (5 ms) when another asks; one inside a C call that does not release it (a wait in
a library's binding, a long copy) keeps it until the call returns. This watcher asks for the GIL
every `period` (a thread that sleeps and wakes) and records each wake-up `long_ms` or more late:
the GIL was held by another thread, or no core was free. At each, it notes where every engine
thread (named ``tiered-*``) was that is not parked in a wait that releases the GIL: the one that
just let go of it is among them, at or just after the call that held it. So are threads inside a
C call that releases the GIL but is not a wait by name: on a GPU host most places noted
were `tiered-write_N` threads in `_pwrite_all`, writing to the disk; read the places as where
to look, not as the holder.

It also samples, at every wake-up in the span's first `main_ms`, where the thread that entered
it (the training thread) was, late or not: a thread inside a C call that lets the GIL go (a
torch operator launching a kernel) shows at the Python line that made the call, so many
samples on one line while the watcher was on time mean that thread stood in that call, waiting
for something other than the GIL (a lock of the CUDA driver or of an allocator, a full launch
queue). A save's overlapped step began its first kernel 44-58 ms after the call in a trace (under the profiler, which costs time of its own): these samples, taken without it, say
where the training thread was meanwhile.

scripts/scale.py records it per save with ``bench.py --scale ... --gil-watch``, and the training
thread's places in the window without a save just before it as well (sampling the save's
windows alone left nothing to read them against): it costs a wake-up and a few microseconds of the GIL per `period`, so it is
off by default.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any

PARKED = frozenset({"wait", "get", "acquire", "result", "sleep", "_wait_for_tstate_lock", "join", "select",
                    "poll", "_worker", "wait_for"})
"""Innermost functions of a thread that waits without the GIL (a queue, an event, a future, a lock)."""


def _place(frame: Any) -> str:
    path = frame.f_code.co_filename.replace("\\", "/").rsplit("/", 2)
    return f"{'/'.join(path[-2:])}:{frame.f_lineno} {frame.f_code.co_name}"


def _where(frame: Any) -> str | None:
    """`file:line function` of a thread's innermost frame, and of the innermost one in the tiered
    package or the benchmark's scripts below it (``inner <- ours``); None where the thread is
    parked (`PARKED`)."""
    if frame.f_code.co_name in PARKED:
        return None
    ours = frame
    while ours is not None and not any(part in ours.f_code.co_filename.replace("\\", "/")
                                       for part in ("/tiered/", "/scripts/")):
        ours = ours.f_back
    if ours is None or ours is frame:
        return _place(frame)
    return f"{_place(frame)} <- {_place(ours)}"


def _inside(frame: Any, codes: frozenset) -> bool:
    """Whether `frame` or a caller of it runs one of `codes`."""
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


class GilWaits:
    """`with GilWaits() as gil: ...`; then `gil.ms` (the sum of the late wake-ups), `gil.max_ms`,
    `gil.count`, and `gil.where` (a Counter of ``thread: place`` over those wake-ups)."""

    def __init__(self, period: float = 1e-3, long_ms: float = 5.0, main_ms: float = 100.0):
        self.period, self.long_ms, self.main_ms = period, long_ms, main_ms
        self.late: list[float] = []
        self.where: Counter = Counter()
        self.main_where: Counter = Counter()
        """Where the thread that entered the span was at each wake-up of its first `main_ms` (with
        ``(late)`` where that wake-up was `long_ms` or more late)."""
        self._main: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-watch", daemon=True)

    def _run(self) -> None:
        period, long_ms = self.period, self.long_ms
        until = time.perf_counter() + self.main_ms / 1e3
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(period)
            late = 1e3 * (time.perf_counter() - t - period)
            if t < until:
                frame = sys._current_frames().get(self._main)
                if frame is not None and not _inside(frame, _OWN):  # (not this span's own start or end)
                    self.main_where[_place(frame) + (" (late)" if late >= long_ms else "")] += 1
            if late < long_ms:
                continue
            self.late.append(late)
            frames = sys._current_frames()
            for th in threading.enumerate():
                frame = frames.get(th.ident)
                if th.name.startswith("tiered") and frame is not None:
                    place = _where(frame)
                    if place is not None:
                        self.where[f"{th.name}: {place}"] += 1

    def __enter__(self) -> "GilWaits":
        self._main = threading.get_ident()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def ms(self) -> float:
        return round(sum(self.late), 1)

    @property
    def max_ms(self) -> float:
        return round(max(self.late, default=0.0), 1)

    @property
    def count(self) -> int:
        return len(self.late)

    def summary(self, top: int = 5) -> dict:
        """What a save's record keeps: the sums, and the `top` places engine threads were."""
        return {"gil_late_ms": self.ms, "gil_late_max_ms": self.max_ms, "gil_late_count": self.count,
                "gil_where": [f"{n}x {place}" for place, n in self.where.most_common(top)],
                "main_first_ms": self.main_ms,
                "main_where": [f"{n}x {place}" for place, n in self.main_where.most_common(top)]}


_OWN = frozenset({GilWaits.__enter__.__code__, GilWaits.__exit__.__code__})
"""The span's own start and end: no place of the span's thread is noted inside them."""
