"""The writer thread's side of a save's GPU waves: checksum the compressed rows, write each run.

Each wave of compressed rows (a `tiered.gpu.device.RowsSegment`) goes one of two ways:

- **the state fits the GPU slab**: runs of rows are gathered end to end on the GPU into one of
  two staging buffers and written from there by KvikIO (GPUDirect Storage, or its compat mode);
- **the state outgrows the slab** (``seg.drain``): the save needs these rows back for its next
  waves, so they drain into pinned host pages (compacted: only compressed bytes cross PCIe) and
  are written from there in large O_DIRECT requests on several threads. The drain is pipelined:
  wave k+1's zeroing, checksums and copies are issued before wave k's chunks are placed and its
  writes handed out. A wave's sizes reach pinned memory as soon as it is encoded
  (`tiered.gpu.waves.WaveSizes`, through nvCOMP's C API), so wave k+1 is issued while wave k's
  copies run. Where nvCOMP's Python API encoded the wave instead, its sizes are read only once
  wave k's copies are done (its read would queue behind them holding the GIL), and the copy
  engine idles while this thread reads them and issues the wave; so once a wave's sizes are read
  with the copy engine idle, the sizes of the waves queued behind it whose compression is done
  are read too (`READ_AHEAD`), and their drains follow each other with no wait between them.
  How fast the slab's rows come back bounds how long a save of a large state holds training.

Call order (one `RowsWriter` per data file, on the writer thread):

    RowsWriter(writer, place, timings)
      -> take(queue)        the next staged segment; while none is ready, finish issued waves
      -> add(seg)           one GPU wave, in save order (drained waves are only issued here)
      -> flush()            before anything else is placed in the file, and at the end
      -> abort()            on a failure: waits for the GPU work in flight, gives memory back
"""

from __future__ import annotations

import queue
import time
from collections import deque
from typing import Any, Callable, Sequence

from tiered.format.manifest import ALIGNMENT
from tiered.units import round_up

DRAIN_DEPTH = 4
"""Drained waves issued and not yet finished (placed, writes handed out). With two, the writer
began a wave's drain ~7 ms (median) before the copies ahead of it ended, and a longer hold of the
writer (the GIL, beside a training thread) left the link idle; with four, ~14 ms. In the short-step
loop on two H200 machines the stall moved within the machines' spread (docs/benchmarks.md, "Short
training steps"). A wave's slab rows go back as soon as its copies are seen done (`RowsWriter`
looks before each wave it issues), not when it is finished, so issuing further ahead does not
keep the stager waiting for rows."""
READ_AHEAD = 4
"""Queued waves whose sizes are read while the copy engine is idle (the stager encodes at most
`tiered.gpu.waves.ENCODE_STREAMS` waves whose sizes are unread)."""


class RowsWriter:
    """Writes the GPU waves of one rank's data file. `place(chunk refs, stored sizes, checksums)`
    places chunks end to end in the file and returns the first one's offset; chunks are placed
    in save order. `timings`: the save's handle timings, which get the writer's phases
    (milliseconds, ``write.*``)."""

    def __init__(self, writer: Any, place: Callable[[Sequence[Any], Sequence[int], Sequence[int]], int],
                 timings: dict[str, float]):
        self.writer, self.place, self.timings = writer, place, timings
        self._issued: deque[tuple[Any, Any]] = deque()
        self._released = 0
        """How many of the oldest issued waves have given their slab rows back already."""
        self._first: float | None = None
        self._queue: "queue.Queue[Any] | None" = None

    def _waits(self) -> float:
        return self.timings.get("write.host_wait_ms", 0.0) + self.timings.get("write.copy_wait_ms", 0.0)

    def _add_time(self, key: str, since: float) -> float:
        now = time.perf_counter()
        self.timings[key] = self.timings.get(key, 0.0) + 1e3 * (now - since)
        return now

    def take(self, segments: "queue.Queue[Any]") -> Any:
        """The next segment staged for this file. While none is ready, the oldest issued wave is
        finished instead: the stager may be waiting for exactly those slab rows."""
        self._queue = segments
        while True:
            try:
                return segments.get_nowait()
            except queue.Empty:
                if not self._finish_oldest():
                    return segments.get()

    def add(self, seg: Any) -> None:
        """Write one wave of compressed rows (its slab rows are released once they are copied out)."""
        t0 = time.perf_counter()
        if self._first is None:
            self._first = t0
        try:
            self._release_copied()
            sizes = seg.sizes()  # (waits for the wave's compression)
            t1 = self._add_time("write.sizes_ms", t0)
            if not seg.drain:
                self.flush()
                _write_from_gpu(seg, sizes, self.writer, self.place)
                seg.release()
                return
            waits = self._waits()
            self._read_ahead(seg.device)
            drained = seg.device.issue_drain(seg, sizes, self._host_pages)
        except BaseException:
            seg.release()
            raise
        self._issued.append((seg, drained))
        # Issuing may wait for host pages and finish older waves: those waits are timed as
        # write.host_wait_ms and write.copy_wait_ms, not again here.
        self.timings["write.issue_ms"] = (self.timings.get("write.issue_ms", 0.0)
                                          + 1e3 * (time.perf_counter() - t1) - (self._waits() - waits))
        while len(self._issued) > DRAIN_DEPTH:
            self._finish_oldest()

    def _read_ahead(self, device: Any) -> None:
        """Where the device's copies to the host are all done, read the sizes of the queued waves
        whose compression is done (nvCOMP's read finds the copy engine free, as `WaveSizes`
        needs), so that their drains are issued without waiting for the copies of this one.
        The waves stay queued; only their sizes are read."""
        q = self._queue
        if q is None or not device.copies_idle():
            return
        with q.mutex:  # (a look at the queue: nothing is taken from it)
            ahead = [item for _, item in zip(range(READ_AHEAD), q.queue)]
        for item in ahead:
            wave = getattr(item, "wave", None)  # (CPU segments and the end of staging have none)
            if wave is None or not item.drain or item.device is not device:
                continue
            if not wave.ready.query():
                return
            wave.settle()

    def _release_copied(self) -> None:
        """Give back the slab rows of the issued waves whose copies are done, oldest first,
        without waiting for any (their chunks are placed and written later, in order)."""
        for n in range(self._released, len(self._issued)):
            seg, drained = self._issued[n]
            if not drained.copied():
                return
            seg.release()
            self._released = n + 1

    def flush(self) -> None:
        """Finish every issued wave: their chunks are placed and their writes started."""
        while self._finish_oldest():
            pass

    def abort(self) -> None:
        """After a failure: wait until no issued copy still reads slab rows or fills host pages,
        then give both back (nothing of them is placed)."""
        while self._issued:
            seg, drained = self._issued.popleft()
            released, self._released = self._released > 0, max(0, self._released - 1)
            try:
                drained.release_hosts()
            finally:
                if not released:
                    seg.release()

    def _host_pages(self, ring: Any, pages: int) -> int:
        """`pages` host pages of `ring` for a drained run; where none are free, the waves issued
        before are finished first (their writes give pages back), then this waits for the disk."""
        t0 = time.perf_counter()
        start = ring.try_acquire(pages)
        while start is None:
            if not self._finish_oldest():
                start = ring.acquire(pages)
                break
            start = ring.try_acquire(pages)
        self._add_time("write.host_wait_ms", t0)
        return start

    def _finish_oldest(self) -> bool:
        """Wait for the oldest issued wave, place its chunks, start its writes, release its rows."""
        if not self._issued:
            return False
        seg, drained = self._issued.popleft()
        t0 = time.perf_counter()
        try:
            sums = drained.wait()
        except BaseException:
            self._issued.appendleft((seg, drained))
            raise
        now = self._add_time("write.copy_wait_ms", t0)
        if self._released:  # (its rows went back when its copies were seen done)
            self._released -= 1
        else:
            seg.release()  # every copy out of the slab is done
        self.timings["write.drained_ms"] = round(1e3 * (now - self._first), 1)  # (first wave to the last copied)
        write = getattr(self.writer, "write_host_async", None)
        for n, (i, k, host, release) in enumerate(drained.runs):
            offset = _place_run(seg, drained.sizes, sums, i, k, self.place)
            view = memoryview(host.numpy())
            if write is not None:
                write(offset, view, release)
                continue
            try:
                self.writer.write_host(offset, view)
            except BaseException:
                for _, _, _, rest in drained.runs[n:]:
                    rest()
                raise
            release()
        return True


def _place_run(seg: Any, sizes: list[int], sums: list[int], i: int, k: int, place: Any) -> int:
    """Place rows i..k-1 end to end; the offset of the first (the run is one extent of the file)."""
    return place(seg.chunks[i:k], sizes[i:k], sums[i:k])


def _write_from_gpu(seg: Any, sizes: list[int], writer: Any, place: Any) -> None:
    """Checksum a wave's rows on the GPU and write each run of rows from the GPU through KvikIO,
    gathered end to end into staging buffers (one large write per buffer, not one per chunk)."""
    sums = seg.device.finish_rows(seg, sizes)
    extents = [round_up(n, ALIGNMENT) for n in sizes]
    for i, k, buf, slot in seg.device.coalesce(seg, extents, writer):
        seg.device.hold(slot, writer, writer.write_device(_place_run(seg, sizes, sums, i, k, place), buf))
        if slot < 0:
            writer.wait()  # written straight from the row, which goes back to the slab after this
