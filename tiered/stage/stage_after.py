"""When the stager thread starts reading an overlapped save: `Engine.guard`'s `stage_after_ms`.

Right after a save's call the training thread has queued little GPU work (a loop that reads its
loss each step has queued none), and while another thread runs Python it launches little; the
GPU then stands idle. Beside a 24 GB loop on an H200, 40 and 100 ms of another thread's Python at
a step's start cost that step 41 and 98 ms, with Python's switch interval at 5 ms and at 0.1 ms
alike, while 200 ms of it in 0.5 ms bursts over half a second cost nothing measurable. The cost
of a wait: where the optimizer step comes before the read is done, its GPU work waits for the rest
of it, so a wait pays only where the loop's forward and backward outlast the wait and the read.

`stage_after_ms="auto"` (the default) sizes the wait from the loop itself: the time between a
guarded optimizer's steps (the median of its last `PERIODS` intervals, as its `step()` is
called) less `READ_MARGIN` times how long the stager took to walk, plan and read the last
overlapped save, at most `AUTO_MAX_MS` (the one measured; longer waits are untried); before a
save has been read, a quarter of that time; with no two steps seen yet, none. A number of ms waits
that long; 0 never waits. Any wait ends as soon as anything waits for the save's reads: a guarded
optimizer step, the next save's call, the engine's or the handle's `wait`, `close`. Since a loop's
host thread launches the optimizer step ahead of the GPU, that often comes first where steps are
short; the reads then start there, still beside the forward and backward the GPU has queued.

Measured on an H200 against `stage_after_ms=0` in the same run (docs/benchmarks.md):
a 24 GB state (1.74 s steps, 0.5 s reads): auto waited 250 ms, stall 40.4 ms (27.0-41.4) against
89.4 (66.8-107.9), durable 14.17 s against 14.78; a 2.4 GB state (170 ms steps): auto chose 43-92
ms, the optimizer step came first at ~36 ms, stall 30.3 ms (9.2-32.5) against 44.4 (28.2-48.7).
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
import threading
import time
from typing import Any, Callable

log = logging.getLogger("tiered")

AUTO = "auto"
AUTO_MAX_MS = 250.0
"""The longest wait `auto` chooses."""
READ_MARGIN = 1.5
"""`auto` leaves this many times the last save's read between the wait's end and the next step."""
PERIODS = 4
"""`auto` takes the median of a guarded optimizer's last this many step intervals."""


def stage_after_seconds(stage_after_ms: Any) -> float | None:
    """`Engine.guard`'s `stage_after_ms` in seconds, None for "auto"; ValueError naming it where
    it is neither "auto" nor a non-negative number of milliseconds."""
    if stage_after_ms == AUTO and isinstance(stage_after_ms, str):
        return None
    if isinstance(stage_after_ms, bool) or not isinstance(stage_after_ms, (int, float)) or \
            not math.isfinite(stage_after_ms) or stage_after_ms < 0:
        raise ValueError(f"stage_after_ms must be 'auto' or a non-negative number of milliseconds, "
                         f"got {stage_after_ms!r}")
    return stage_after_ms / 1e3


class StageAfter:
    """How long after `save()`'s call the stager thread waits before it walks, plans and reads an
    overlapped save: the longest wait among the standing guards (`set`; "auto" as the module
    says), cut short once anything waits for the save's reads (`hurry`)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 wait: Callable[[threading.Event, float], bool] = threading.Event.wait) -> None:
        """`clock` (seconds) and `wait(event, timeout)` (True where the event was set): the real
        ones, but for a test that plays a loop's time out without spending it."""
        self._clock, self._wait = clock, wait
        self._by: dict[int, float | None] = {}
        """Per guarded optimizer (by id): its wait in seconds, None for auto."""
        self._steps: dict[int, collections.deque[float]] = {}
        """Per guarded optimizer: when its last steps began (perf_counter)."""
        self._last: tuple[dict[str, float], float] | None = None
        """The last waited-for save's timings, and when its stager began (ms after its call)."""
        self._logged_cut = False
        self._logged_auto: set[str] = set()
        """Which of auto's two choices (before a read was timed, after) the log has said."""

    def set(self, optimizer: Any, seconds: float | None) -> None:
        """A guard of `optimizer` asks for `seconds` (0: nothing; None: auto); the log says when
        the longest fixed wait grows."""
        before = self._fixed()
        self._by[id(optimizer)] = seconds
        if seconds is not None and seconds > before:
            log.info("tiered: overlapped saves are read from %.0f ms after save() on (sooner where the optimizer "
                     "step or a wait for the save comes first)", 1e3 * seconds)

    def drop(self, optimizer: Any) -> None:
        self._by.pop(id(optimizer), None)
        self._steps.pop(id(optimizer), None)

    def stepped(self, optimizer: Any) -> None:
        """A guarded optimizer's step begins (its pre-hook): what `auto` measures the loop by."""
        times = self._steps.get(id(optimizer))
        if times is None:
            times = self._steps[id(optimizer)] = collections.deque(maxlen=PERIODS + 1)
        times.append(self._clock())

    def auto_seconds(self) -> tuple[float, float, float | None]:
        """(the wait `auto` chooses now, the step interval it measured, the last save's read time
        or None), in seconds; (0, 0, None) before any guarded optimizer has stepped twice."""
        steps = [list(t) for t in list(self._steps.values())]  # (copies: the training thread appends)
        periods = [statistics.median(b - a for a, b in zip(t, t[1:])) for t in steps if len(t) > 1]
        if not periods:
            return 0.0, 0.0, None
        period = min(periods)
        read = None
        if self._last is not None and "staged_ms" in self._last[0]:
            read = max(0.0, self._last[0]["staged_ms"] - self._last[1]) / 1e3
        room = period / 4 if read is None else period - READ_MARGIN * read
        return min(AUTO_MAX_MS / 1e3, max(0.0, room)), period, read

    def _fixed(self) -> float:
        """The longest fixed wait among the standing guards (0 where none asks for one)."""
        return max((s for s in self._by.values() if s is not None), default=0.0)

    def _delay(self) -> float:
        fixed = self._fixed()
        if None not in self._by.values():
            return fixed
        chosen, period, read = self.auto_seconds()
        said = "read" if read is not None else "interval"
        if chosen > fixed and said not in self._logged_auto:
            self._logged_auto.add(said)
            if read is None:
                log.info("tiered: stage_after_ms='auto': overlapped saves are read %.0f ms after save() (a quarter "
                         "of the %.0f ms between the guarded optimizer's steps, until a save's read has been timed; "
                         "at most %.0f ms)", 1e3 * chosen, 1e3 * period, AUTO_MAX_MS)
            else:
                log.info("tiered: stage_after_ms='auto': overlapped saves are read %.0f ms after save() (the "
                         "optimizer steps every %.0f ms, less %.1f x the %.0f ms the last save's walk, plan and "
                         "read took; at most %.0f ms)", 1e3 * chosen, 1e3 * period, READ_MARGIN, 1e3 * read,
                         AUTO_MAX_MS)
        return max(fixed, chosen)

    def wait(self, started: float, hurry: threading.Event, step: int, timings: dict[str, float]) -> None:
        """On the stager thread, before a save that `save()` started at `started` (perf_counter;
        `timings`: its handle's, where `plan_ms` is what the call spent before `started`): wait
        until the longest wait has passed since, or until `hurry` is set."""
        delay = self._delay()
        t0 = self._clock()
        if delay > 0 and t0 < started + delay:
            cut = self._wait(hurry, started + delay - t0)  # (set already: the optimizer step came before this thread did)
            timings["stage_after_ms"] = 1e3 * (self._clock() - t0)
            auto = None in self._by.values()
            if cut and auto:
                log.debug("tiered: step %d: the reads start %.0f ms after save(), before the %.0f ms that "
                          "stage_after_ms='auto' chose: something waits for them", step,
                          1e3 * (self._clock() - started), 1e3 * delay)
            elif cut and not self._logged_cut:
                self._logged_cut = True
                log.warning("tiered: step %d: something waited for the save's reads (the optimizer step, or a wait) "
                            "%.0f ms after save(), before %s had passed: it waited for the whole read of the "
                            "state; a lower stage_after_ms (or 0) overlaps it with more of the step", step,
                            1e3 * (self._clock() - started), f"guard(stage_after_ms={1e3 * delay:.0f})")
        self._last = timings, 1e3 * (self._clock() - started) + timings.get("plan_ms", 0.0)
