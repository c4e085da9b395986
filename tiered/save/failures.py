"""What a failed save does to training (``on_save_failure``).

A save that fails in the background is not committed: its partial files are removed, the
failure is logged at ERROR with its cause and recorded (``engine.stats()``, ``tiered stats``).
With ``warn`` (the default) training goes on and the next save proceeds; the next ``save()`` or
``wait()`` raises only once ``max_failed_saves`` saves in a row have failed, or when a save fails
and none has committed for ``max_time_without_commit``: a run cannot go on for hours
unprotected. With ``raise`` the next ``save()`` or ``wait()`` raises every failure. A save's own
``handle.wait()`` always raises its failure.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from tiered.errors import BackgroundSaveError, SaveFailuresExceeded


class SaveFailures:
    """Counts failed and committed saves and decides which failure the next call raises."""

    def __init__(self, config: Any, clock: Callable[[], float] = time.monotonic):
        self.policy = config.on_save_failure
        self.max_failed = config.max_failed_saves
        self.max_unprotected = config.max_time_without_commit
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: BaseException | None = None
        self.in_a_row = 0
        """Failed saves since the last commit."""
        self._since = clock()
        """When the last save committed (or the engine started)."""

    def committed(self) -> None:
        with self._lock:
            self.in_a_row = 0
            self._since = self._clock()

    def record(self, err: BackgroundSaveError) -> str:
        """A save failed: keep what the next call must raise, if anything. Returns what happens
        next, for the log line."""
        with self._lock:
            self.in_a_row += 1
            if self.policy == "raise":
                self._pending = self._pending or err
                return "the next save() or wait() raises it (on_save_failure: raise)"
            unprotected = self._clock() - self._since
            if self.in_a_row >= self.max_failed:
                why = f"{self.in_a_row} saves in a row failed (max_failed_saves: {self.max_failed})"
            elif self.max_unprotected is not None and unprotected > self.max_unprotected:
                why = (f"no save has committed for {unprotected:.0f} s (max_time_without_commit: "
                       f"{self.max_unprotected:.0f} s)")
            else:
                left = self.max_failed - self.in_a_row
                return (f"training goes on (on_save_failure: warn; {self.in_a_row} failed in a row, {left} more "
                        "stop it)")
            self._pending = self._pending or SaveFailuresExceeded(why, err)
            return f"the next save() or wait() raises: {why}"

    def take(self) -> BaseException | None:
        """The failure the next call raises (once), if any."""
        with self._lock:
            err, self._pending = self._pending, None
        return err

    def forget(self, exc: BaseException) -> None:
        """A handle raised `exc` itself: the next call does not raise it again. (A run stopped
        by the policy stays stopped: `SaveFailuresExceeded` is not the handle's error.)"""
        with self._lock:
            if self._pending is exc:
                self._pending = None
