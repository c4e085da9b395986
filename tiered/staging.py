"""Bounded, reused staging memory: the GPU chunk slab and the host (pinned) pool.

Both are rings of fixed-size rows handed out in FIFO order: `save()` acquires rows for a wave
(blocking while the background writer still holds them: backpressure), the writer releases them
once the bytes are on disk. Memory is allocated once, on first use, and reused across saves.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import torch


class RowRing:
    """Contiguous runs of rows out of `rows`, allocated and (usually) released in FIFO order."""

    def __init__(self, rows: int):
        if rows <= 0:
            raise ValueError("a ring needs at least one row")
        self.rows = rows
        self._live: deque[tuple[int, int]] = deque()
        self._head = 0
        self._cv = threading.Condition()

    def _fits(self, start: int, n: int) -> bool:
        return all(start + n <= s or s + c <= start for s, c in self._live)

    def try_acquire(self, n: int) -> int | None:
        if n > self.rows:
            raise ValueError(f"{n} rows requested from a ring of {self.rows}")
        with self._cv:
            return self._try(n)

    def _try(self, n: int) -> int | None:
        if not self._live:
            self._head = 0
        for start in (self._head, 0):
            if start + n <= self.rows and self._fits(start, n):
                self._live.append((start, n))
                self._head = start + n
                return start
        return None

    def acquire(self, n: int, on_block: Callable[[], None] | None = None) -> int:
        """Rows [start, start + n); waits while they are held. `on_block` runs (once, outside the
        lock) before the first wait: save() uses it to let the writer start freeing rows."""
        if n > self.rows:
            raise ValueError(f"{n} rows requested from a ring of {self.rows}")
        if on_block is not None:
            start = self.try_acquire(n)
            if start is not None:
                return start
            on_block()
        with self._cv:
            while (start := self._try(n)) is None:
                self._cv.wait()
            return start

    def release(self, start: int) -> None:
        with self._cv:
            for i, (s, _) in enumerate(self._live):
                if s == start:
                    del self._live[i]
                    break
            else:
                raise ValueError(f"row {start} is not allocated")
            self._cv.notify_all()

    def free_rows(self) -> int:
        with self._cv:
            return self.rows - sum(c for _, c in self._live)

    def idle(self) -> bool:
        with self._cv:
            return not self._live


class HostPool:
    """Host staging memory in pages of `page` bytes: pinned where CUDA exists (fast D2H).

    Allocated on first use, sized to what that save needs (up to the budget), and reused; it
    grows only while idle. Pinned allocation is slow (~0.5 s per GB), so it is never freed
    between saves.
    """

    def __init__(self, capacity: int, page: int):
        self.capacity = capacity - capacity % page
        self.page = page
        self.buffer: torch.Tensor | None = None
        self.ring: RowRing | None = None
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> None:
        """Make sure the pool holds min(nbytes, capacity), if it can grow now."""
        want = min(self.capacity, -(-nbytes // self.page) * self.page)
        with self._lock:
            if self.buffer is not None and (self.buffer.numel() >= want or not self.ring.idle()):
                return
            self.buffer = None
            pin = torch.cuda.is_available()
            self.buffer = torch.empty(want, dtype=torch.uint8, pin_memory=pin)
            self.ring = RowRing(want // self.page)

    def pages(self, nbytes: int) -> int:
        return -(-nbytes // self.page)

    def view(self, start_page: int, nbytes: int) -> torch.Tensor:
        off = start_page * self.page
        return self.buffer[off:off + nbytes]
