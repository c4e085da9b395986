"""Python's full collections during a span of the benchmark, by thread.

A full collection walks every object of the process holding the GIL (~0.2 s for the scale bench's
~320,000 objects), so one that lands inside a save's window of training steps shows as stall,
whichever thread set it off. A save that keeps many objects alive until its step is written sets
one off every few saves (180 ms on `tiered-writer`, 0.59 s after the fourth save's
call); scripts/scale.py records, per save, the full collections that ran inside its window, and
those the engine's threads (named ``tiered-*``) ran.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


class FullCollections:
    """`with FullCollections() as full: ...`; then `full.ms` (all threads) and `full.engine_ms`
    (threads named ``tiered-*``): the milliseconds of full collections that ran inside the block."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.runs.append((threading.current_thread().name, 1e3 * (time.perf_counter() - self._start)))

    def __enter__(self) -> "FullCollections":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)

    @property
    def ms(self) -> float:
        return round(sum(ms for _, ms in self.runs), 1)

    @property
    def engine_ms(self) -> float:
        return round(sum(ms for name, ms in self.runs if name.startswith("tiered")), 1)
