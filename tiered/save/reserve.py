"""`Engine.reserve`'s work, off the training thread.

`reserve(state)` walks the state on the caller's thread (the structure must not change under the
walk: a few ms to a few tens of ms) and hands the rest to a thread of its own: the GPU devices
made, `codec: auto` decided from a sample of the state, the plan, the layout of the waves and a
first run of the save's kernels. Done on the training thread, that held it for 0.86-2.95 s at
24 GB on an H200 (the kernels' first run waits for the GPU, and the codec's sample is encoded and
timed). Beside training, its Python costs the loop only what another thread's Python costs it.
Whatever needs the work done waits for it first: a save, `guard`, a restore, `wait_pinned`,
`close`. A `TieredError` there (a budget that does not fit, named) is raised by the next of them
that waits, as a background save's failure is; anything else is logged, and the first save does
the work itself (it plans and lays out a state that was never reserved anyway).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from tiered import threads
from tiered.errors import TieredError

log = logging.getLogger("tiered")


class Reservation:
    """The background part of the last `reserve` call: `start(work)`, then `wait()` before using
    what it makes."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: TieredError | None = None
        self._lock = threading.Lock()

    def start(self, work: Callable[[], None]) -> None:
        """Run `work()` on a thread of its own (after any earlier reservation is done)."""
        self.wait()

        def run() -> None:
            try:
                work()
            except TieredError as exc:
                log.error("tiered: reserve(): %s", exc)
                self._error = exc
            except Exception as exc:  # noqa: BLE001 - the first save does the work itself
                log.warning("tiered: reserve() could not ready saves of this state in the background (%s: %s); the "
                            "first save plans and lays it out itself", type(exc).__name__, exc)

        with self._lock:
            self._thread = threads.start(run, name="tiered-reserve")

    def wait(self, timeout: float | None = None, *, raise_errors: bool = True) -> bool:
        """Wait until the background work is done (True), or `timeout` seconds have passed; raise
        its `TieredError`, once (`raise_errors`)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
            with self._lock:
                if self._thread is thread:
                    self._thread = None
        err, self._error = (self._error, None) if raise_errors else (None, self._error)
        if err is not None:
            raise err
        return True
