"""Bounded, reused staging memory: row rings and the host (pinned) pool.

Both are rings of fixed-size rows handed out in FIFO order: a save acquires rows (blocking while
the background writer still holds them: backpressure), the writer releases them once the bytes
are on disk. Memory is reserved once and reused across saves.

The host pool is one page-aligned anonymous mapping (what O_DIRECT needs). Where CUDA is in use
it is pinned on a background thread, block by block, as saves need it (`HostPool.want`; or at
start-up through `Engine.reserve`). Pinning fresh pages one 4 KiB fault at a time ran at ~1.9 GB/s
on an H200 host; so the mapping asks for transparent huge pages, and a few threads touch each
block's pages (the kernel backs them, a block ahead of the pinner) before it is registered: 4 GiB
then took 0.13 s to touch and 0.10 s to pin (docs/architecture.md, "Why the pinner touches pages
first"). Runs of rows never straddle a block, so every copy lands in one pinned registration (a
copy across two registrations is refused by CUDA); rows past what is pinned so far are not
handed out until they are.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from tiered import threads
from tiered.errors import TieredError
from tiered.stage.budgets import local_ranks
from tiered.units import format_size

log = logging.getLogger("tiered")

PIN_BLOCK = 512 << 20
"""Bytes pinned per call (a touched block registered in ~14 ms on an H200 host)."""
TOUCH_THREADS = 16
"""Most threads that touch a block's pages before it is pinned (this rank's share of the cores at
most: `touch_workers`). On an H200 host 16 touched ~22 GB at 57-61 GB/s, 8 at 31-34, while the
registration ran at 40-49 GB/s whatever the threads beside it: with 8 the touching held the pinner."""
_TOUCH_ALIGN = 2 << 20
"""Each touching thread's share starts on a huge page."""


class RowRing:
    """Contiguous runs of rows out of `rows`, allocated and (usually) released in FIFO order.

    `limit` (default: all) is how many leading rows may be handed out now; `grow` raises it.
    With `boundary`, a run never crosses a multiple of `boundary` rows."""

    def __init__(self, rows: int, *, limit: int | None = None, boundary: int | None = None):
        if rows <= 0:
            raise ValueError("a ring needs at least one row")
        self.rows = rows
        self.limit = rows if limit is None else limit
        self.boundary = boundary
        self._live: deque[tuple[int, int]] = deque()
        self._head = 0
        self._cv = threading.Condition()

    @property
    def max_run(self) -> int:
        """The longest run one acquire may ask for."""
        return min(self.rows, self.boundary or self.rows)

    def _fits(self, start: int, n: int) -> bool:
        return all(start + n <= s or s + c <= start for s, c in self._live)

    def _check(self, n: int) -> None:
        if n > self.max_run:
            raise ValueError(f"{n} rows requested from a ring of {self.rows}"
                             + (f" in runs of at most {self.boundary}" if self.boundary else ""))

    def try_acquire(self, n: int) -> int | None:
        self._check(n)
        with self._cv:
            return self._try(n)

    def _try(self, n: int) -> int | None:
        if not self._live:
            self._head = 0
        for start in (self._head, 0):
            b = self.boundary
            if b and start // b != (start + n - 1) // b:
                start = (start // b + 1) * b  # the next block: a run never straddles one
            if start + n <= self.limit and self._fits(start, n):
                self._live.append((start, n))
                self._head = start + n
                return start
        return None

    def acquire(self, n: int, on_block: Callable[[], None] | None = None) -> int:
        """Rows [start, start + n); waits while they are held (or not yet usable). `on_block` runs
        (once, outside the lock) before the first wait: save() uses it to let the writer start
        freeing rows."""
        self._check(n)
        if on_block is not None:
            start = self.try_acquire(n)
            if start is not None:
                return start
            on_block()
        with self._cv:
            while (start := self._try(n)) is None:
                self._cv.wait()
            return start

    def grow(self, limit: int) -> None:
        """Let the first `limit` rows be handed out."""
        with self._cv:
            self.limit = max(self.limit, min(limit, self.rows))
            self._cv.notify_all()

    def release_after(self, start: int, calls: int) -> Callable[[], None]:
        """A release of the run at `start` that takes effect at its `calls`-th call: one run
        shared by `calls` users, each giving it back once, on any thread."""
        left = [calls]
        lock = threading.Lock()

        def release() -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            self.release(start)
        return release

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
            return self.limit - sum(c for _, c in self._live)


class WavePages:
    """Host pages for the runs of one drained wave (`GpuDevice.issue_drain`), taken in order with
    `take(pages)` -> (first page, its release). All of them are taken as one range first where
    the ring gives runs that long: a run that waited for pages while the wave's earlier runs held
    some could wait forever, where those held the middle of the ring and no gap left was long
    enough (small host budgets: a hang seen in GPU tests). `acquire(ring,
    pages)` takes pages (it may wait for writes to give some back); `give_back()` after a
    failure, once nothing copies into them any more. A wave the whole pool cannot hold at once
    is refused, naming the budgets: its last run would wait forever for pages its first holds."""

    def __init__(self, ring: RowRing, pages: list[int], acquire: Callable[[RowRing, int], int], page: int = 4096):
        if sum(pages) > ring.rows:
            raise TieredError(
                f"a wave of this save drains {format_size(sum(pages) * page)} through pinned host memory, more than "
                f"budgets.host_buffer holds ({format_size(ring.rows * page)}): raise budgets.host_buffer, or lower "
                f"budgets.pack_buffer (a wave is what it holds)")
        self.ring, self._acquire = ring, acquire
        self._taken: list[Callable[[], None]] = []
        self.whole = acquire(ring, sum(pages)) if len(pages) > 1 and sum(pages) <= ring.max_run else None
        if self.whole is not None:
            self._at, self._shared = self.whole, ring.release_after(self.whole, len(pages))

    def take(self, pages: int) -> tuple[int, Callable[[], None]]:
        if self.whole is None:
            start = self._acquire(self.ring, pages)
            self._taken.append(release := lambda: self.ring.release(start))
            return start, release
        start, self._at = self._at, self._at + pages
        return start, self._shared

    def give_back(self) -> None:
        if self.whole is not None:
            self.ring.release(self.whole)
        for release in self._taken:
            release()


class HostPool:
    """Host staging memory of at most `capacity` bytes in pages of `page` bytes, handed out by `ring`.

    The mapping is reserved at once; the kernel backs pages as they are first used. Without
    `pin`, every page is usable at once. With `pin(address, nbytes) -> bool` (cudaHostRegister),
    pages are pinned on demand on a background thread, block by block: `want(nbytes)` raises the
    target (a save that needs more, or `Engine.reserve` at start-up), the ring hands pages out as
    their block is pinned, and what is pinned stays pinned for later saves. A registration that
    fails leaves the rest usable unpinned (copies into it are slower) and is logged.
    """

    def __init__(self, capacity: int, page: int = 4096, *, pin: Callable[[int, int], bool] | None = None,
                 unpin: Callable[[int], None] | None = None, block: int = PIN_BLOCK):
        self.capacity = max(page, capacity - capacity % page)
        self.page = page
        self._mm = self._map()
        block = min(max(page, block - block % page), self.capacity)
        self.buffer: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        rows = self.capacity // page
        self._pin, self._unpin, self._block = pin, unpin, block
        self.ring = RowRing(rows, limit=0 if pin is not None else rows,
                            boundary=block // page if pin is not None else None)
        self._pinned: list[int] = []
        self.pinned_bytes = 0
        """Bytes pinned so far (all usable pages, without `pin`)."""
        self.pinning_seconds = 0.0
        self.closed = False
        self._target = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._failed = pin is None
        if pin is None:
            self.pinned_bytes = self.capacity
        else:
            _ask_huge_pages(self._mm)
        self._toucher: ThreadPoolExecutor | None = None
        self._touchers = 1

    def _map(self) -> mmap.mmap:
        """The mapping: the whole capacity, or, where the kernel refuses that much address space
        (strict overcommit accounting), the most it grants, halving down to one page (logged)."""
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        asked = self.capacity
        while True:
            try:
                mm = mmap.mmap(-1, self.capacity, flags=flags)
            except OSError as exc:
                if self.capacity <= self.page:
                    raise
                self.capacity = max(self.page, self.capacity // 2 // self.page * self.page)
                last = exc
                continue
            if self.capacity < asked:
                log.warning("tiered: host staging memory: %s could not be mapped (%s); using %s. Set "
                            "budgets.host_buffer to a size this machine grants", format_size(asked), last,
                            format_size(self.capacity))
            return mm

    @property
    def max_run_bytes(self) -> int:
        """The most bytes one acquire may ask for (one pinned block, or the whole pool)."""
        return self.ring.max_run * self.page

    def want(self, nbytes: int) -> None:
        """Have at least min(nbytes, capacity) usable: pin the rest in the background (no-op
        without `pin`, or where that much is pinned or being pinned already)."""
        if self._failed:
            return
        with self._cv:
            target = min(self.capacity, -(-nbytes // self._block) * self._block)
            if target <= self._target or self.closed:
                return
            self._target = target
            if self._thread is None:
                self._thread = threads.start(self._pin_loop, name="tiered-pinner")

    def _pin_loop(self) -> None:
        assert self._pin is not None and self.buffer is not None
        base = self.buffer.data_ptr()
        ahead: tuple[int, list[Future]] | None = None  # (the block being touched ahead of the pinner)
        while True:
            with self._cv:
                off = self.pinned_bytes
                if self.closed or off >= self._target:
                    if ahead is not None:  # (closed: the mapping goes once this thread is done)
                        _wait_all(ahead[1])
                    self._thread = None
                    self._cv.notify_all()
                    if off and not self.closed:
                        log.info("tiered: %s of host staging memory pinned (%.1f s so far)", format_size(off),
                                 self.pinning_seconds)
                    return
                end = self._target
            n = min(self._block, self.capacity - off)
            t0 = time.perf_counter()
            touched = ahead[1] if ahead is not None and ahead[0] == off else self._touch(off, n)
            ahead = None
            if off + n < end:  # the next block's pages are backed while this one is registered
                ahead = (off + n, self._touch(off + n, min(self._block, self.capacity - off - n)))
            try:
                _wait_all(touched)
                ok = self._pin(base + off, n)
            except Exception as exc:  # noqa: BLE001 - the pages stay usable, unpinned
                log.warning("tiered: pinning host staging memory: %s", exc)
                ok = False
            self.pinning_seconds += time.perf_counter() - t0
            if not ok:
                if ahead is not None:  # nothing may write the pages once saves may use them
                    _wait_all(ahead[1])
                with self._cv:
                    log.warning("tiered: pinning host staging memory failed after %s of %s: the rest is used "
                                "unpinned (slower copies from the GPU); lower budgets.host_buffer to pin less",
                                format_size(off), format_size(self.capacity))
                    self._failed = True
                    self.pinned_bytes = self.capacity
                    self.ring.grow(self.ring.rows)
                    self._thread = None
                    self._cv.notify_all()
                return
            with self._cv:
                self._pinned.append(base + off)
                self.pinned_bytes = off + n
            self.ring.grow((off + n) // self.page)

    def _touch(self, off: int, nbytes: int) -> list[Future]:
        """Have the kernel back pages [off, off + nbytes) of the mapping now, on a few threads, by
        writing a zero into each page (pages not yet handed out: nothing is overwritten).
        Registering backed pages is ~15x faster than letting the registration fault them in one
        at a time, and the threads let the GIL go while they write."""
        if self._toucher is None:  # (its threads counted once: every block is split among them)
            self._touchers = touch_workers()
            self._toucher = ThreadPoolExecutor(self._touchers, thread_name_prefix="tiered-touch",
                                               initializer=threads.lower_priority)
        assert self.buffer is not None
        pages = self.buffer.numpy()
        share = max(_TOUCH_ALIGN, -(-nbytes // self._touchers // _TOUCH_ALIGN) * _TOUCH_ALIGN)
        return [self._toucher.submit(_touch_pages, pages, lo, min(off + nbytes, lo + share), self.page)
                for lo in range(off, off + nbytes, share)]

    def want_for_save(self, nbytes: int, warned: set[str], where: str, what: str, raise_hint: str) -> None:
        """`want(nbytes)` for a save that passes `nbytes` through these pages, and say once per kind
        (kept in `warned`) where saves will wait: for the disk (the pool is smaller than that), or
        for pinning (less is pinned yet). `where` names the device ("cuda:0"), `what` the bytes
        ("drains up to 3 GiB", "copies 24 GiB"), `raise_hint` the budget to raise."""
        if self.capacity < nbytes and "host" not in warned:
            warned.add("host")
            log.warning("tiered: %s: this save %s through pinned host memory, which holds at most %s: save() waits "
                        "for the disk for the rest. %s", where, what, format_size(self.capacity), raise_hint)
        elif self.pinned_bytes < min(nbytes, self.capacity) and "pin" not in warned:
            warned.add("pin")
            log.warning("tiered: %s: this save %s through pinned host memory and %s is pinned: the rest is pinned "
                        "now, in the background, and this save waits for it (once: seconds for tens of GB). "
                        "engine.reserve(state) at start-up does this before the first save", where, what,
                        format_size(self.pinned_bytes))
        self.want(nbytes)

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Wait until what was wanted is pinned (or pinning failed or stopped); True if it is."""
        with self._cv:
            return self._cv.wait_for(lambda: self._thread is None, timeout)

    def pages(self, nbytes: int) -> int:
        return -(-nbytes // self.page)

    def view(self, start_page: int, nbytes: int) -> torch.Tensor:
        assert self.buffer is not None
        off = start_page * self.page
        return self.buffer[off:off + nbytes]

    def close(self) -> None:
        """Stop pinning, unregister what was pinned and unmap (once nothing is staged)."""
        with self._cv:
            self.closed = True
            self._cv.wait_for(lambda: self._thread is None)
        if self._toucher is not None:
            self._toucher.shutdown()
        if self._unpin is not None:
            for addr in self._pinned:
                self._unpin(addr)
        self._pinned.clear()
        self.buffer = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a staged view is still referenced: the mapping goes with it


def touch_workers() -> int:
    """Threads that touch pages ahead of the pinner: this rank's share of the cores, at most
    TOUCH_THREADS: the cores it is bound to where a launcher bound it to fewer than the machine's
    (its share already), else the machine's over the node's local ranks. They run only while
    memory is pinned (once, at start-up or in the first save), at a lower CPU priority than
    training."""
    cores = os.cpu_count() or 1
    try:
        bound = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        bound = cores
    share = bound if bound < cores else cores // local_ranks()
    return max(1, min(TOUCH_THREADS, share))


def _ask_huge_pages(mm: mmap.mmap) -> None:
    """Ask the kernel to back the mapping with transparent huge pages (Linux, where
    /sys/kernel/mm/transparent_hugepage/enabled allows `madvise`; elsewhere nothing): a 2 MiB
    page is faulted in, and pinned, at a fraction of the cost of 512 small ones."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:
            pass


def _touch_pages(pages, lo: int, hi: int, page: int) -> None:
    """Write a zero into every page of pages[lo:hi] (numpy lets the GIL go while it writes)."""
    pages[lo:hi:page] = 0


def _wait_all(futures: list[Future]) -> None:
    for f in futures:
        f.result()
