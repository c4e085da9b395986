"""The GPU half of save: pack, batched compression into a reused slab, and the writer's GPU steps.

Save, per device, in waves that fit the pack buffer and the slab (packing on a side stream that
first waits for the training stream; each wave's compression on one of `ENCODE_STREAMS` streams
in turn, ordered after its packing and before the next wave's: see `WaveSizes`):

    pack tensors (chunk-aligned pieces) -> codec.encode_batch into slab rows

After the last pack the training stream waits on an event (or, with `Engine.guard`, the next
optimizer step does): from then on training may overwrite its tensors, because the compressed
copy *is* the snapshot. `save()` returns without waiting for the GPU at all. The background
writer (tiered.gpu.write) later reads the compressed sizes; then, on its own stream, each row's
padding is zeroed and its checksum computed on the GPU (tiered.gpu.pack), and runs of rows
go out end to end: from GPU staging buffers through KvikIO (the state fits the slab), or, for a
state larger than the slab, copied into pinned host memory (tiered.gpu.drain: only compressed
bytes cross PCIe) to be written from there in large requests on several threads, so the slab is
free again at the speed of PCIe, not of the disk.

Restore (`GpuDevice.restore`) is in tiered.gpu.decode. Imported only when CUDA is in use.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from tiered.codecs import get_codec
from tiered.config import Budgets, ZstdSettings
from tiered.errors import TieredError
from tiered.format.checksum import unsigned, wsum64_rows_torch
from tiered.format.chunks import ALIGNMENT
from tiered.format.manifest import TensorRecord
from tiered.gpu import batch_copy
from tiered.gpu import pack as gpu_checksum
from tiered.gpu.decode import CHECKSUM_ROWS, restore_on
from tiered.gpu.drain import WRITE_STAGING, Drainer, gather_rows, wave_io, write_staging_bytes
from tiered.gpu.layout import Layout, Span
from tiered.gpu.waves import (ENCODE_STREAMS, DrainedRows, EncodeClock, RowsSegment, WaveSizes, deliver_sizes,
                              encode_slots)
from tiered.stage.budgets import auto_gpu_buffer
from tiered.stage.host_copy import HostCopier
from tiered.stage.plan import TensorPlan
from tiered.stage.pools import HostPool, RowRing
from tiered.units import format_size, round_up

log = logging.getLogger("tiered")

@dataclass
class GpuDevice:
    """Per-GPU streams and staging memory, allocated on first use and reused across saves."""

    index: int
    chunk_size: int
    budgets: Budgets
    zstd: ZstdSettings
    host: HostPool
    priority: int = -5
    """CUDA stream priority (lower is higher; clamped to the device's range). A save's streams run
    at the highest: with `Engine.guard` its compression and packing run while training computes,
    and the optimizer step waits for exactly this work, so it is scheduled before training's
    kernels rather than in the gaps between them. Migration and codec sampling use 0, as training
    does."""
    stream: torch.cuda.Stream = field(init=False)
    writer_stream: torch.cuda.Stream = field(init=False)
    pack_stream: torch.cuda.Stream = field(init=False)
    """A drain packs runs of rows on it, beside the writer stream's copies (`issue_drain`)."""
    io_stream: torch.cuda.Stream = field(init=False)
    """A drained wave's sizes, offsets and checksums cross on it (`issue_drain`)."""
    encode_streams: list[torch.cuda.Stream] = field(init=False)
    """A save's waves are encoded on these in turn (`WaveSizes`)."""
    _last_waves: list[WaveSizes | None] = field(default_factory=lambda: [None] * ENCODE_STREAMS, init=False)
    _next_encoder: int = field(default=0, init=False)
    _slab: torch.Tensor | None = field(default=None, init=False)
    _ring: RowRing | None = field(default=None, init=False)
    _stride: int = field(default=0, init=False)
    _pack: torch.Tensor | None = field(default=None, init=False)
    _layout: "Layout | None" = field(default=None, init=False)
    _staging: list[torch.Tensor] | None = field(default=None, init=False)
    _busy: list[Any] = field(default_factory=lambda: [None, None], init=False)
    _next_slot: int = field(default=0, init=False)
    _drainer: Drainer | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _warned: set = field(default_factory=set, init=False)
    _clock: EncodeClock | None = field(default=None, init=False)
    _copies: torch.cuda.Event | None = field(default=None, init=False)
    """Recorded after the last copies to the host that a drain issued (`note_copies`)."""
    _copier: HostCopier | None = field(default=None, init=False)
    timings: dict[str, float] = field(default_factory=dict, init=False)
    """Milliseconds spent in the phases of the last stage() call (diagnostics)."""

    def __post_init__(self) -> None:
        dev = torch.device("cuda", self.index)
        self.stream = torch.cuda.Stream(dev, priority=self.priority)
        self.writer_stream = torch.cuda.Stream(dev, priority=self.priority)
        self.pack_stream = torch.cuda.Stream(dev, priority=self.priority)
        self.io_stream = torch.cuda.Stream(dev, priority=self.priority)
        self.encode_streams = [torch.cuda.Stream(dev, priority=self.priority) for _ in range(ENCODE_STREAMS)]
        # The checksum kernel compiles (~1-2 s, once; Triton caches it on disk) now, beside
        # training, rather than inside the first save's drain; a batched copy is tried once.
        self._warm_up = threading.Thread(target=_warm_up, args=(self.index,), name="tiered-warm-up", daemon=True)
        self._warm_up.start()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until the checksum kernel is compiled (a first run on a machine compiles it for
        seconds; later runs load it from Triton's cache); True once it is."""
        self._warm_up.join(timeout)
        return not self._warm_up.is_alive()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    @property
    def slab_bytes(self) -> int:
        """Bytes of the save slab: what a save's compressed chunks may hold on the GPU before the
        rest drains through pinned host memory (0 before the first save sizes it)."""
        slab = self._slab
        return 0 if slab is None else slab.numel()

    def clock_next_stage(self) -> EncodeClock:
        """Time the encodes of the next `stage` call on the GPU (`EncodeClock`)."""
        self._clock = EncodeClock()
        return self._clock

    def budget(self, need: int, others: int, minimum: int, what: str) -> int:
        """GPU bytes for `what`: budgets.gpu_buffer, or (auto) sized from the memory free now for a
        need of `need` bytes, `others` bytes of other buffers and at least `minimum` (logged once)."""
        if self.budgets.gpu_buffer is not None:
            return self.budgets.gpu_buffer
        free = torch.cuda.mem_get_info(self.index)[0]
        choice = auto_gpu_buffer(need, free, others, minimum)
        if what not in self._warned:
            self._warned.add(what)
            log.info("tiered: cuda:%d: budgets.gpu_buffer auto: %s for %s (%s); set budgets.gpu_buffer to change it",
                     self.index, format_size(choice.nbytes), what, choice.why)
        return choice.nbytes

    @property
    def _wave_rows(self) -> int:
        """Rows a wave of full chunks takes: what the pack buffer holds, and one more."""
        return self.budgets.pack_buffer // self.chunk_size + 1

    def _stride_for(self, specs: Any) -> int:
        """Bytes of a slab row: the largest a chunk of these codec specs may take, aligned."""
        return round_up(max(get_codec(s, self.zstd).max_stored_size(self.chunk_size) for s in specs), ALIGNMENT)

    def _pack_buffer(self) -> torch.Tensor:
        """The pack buffer (budgets.pack_buffer), allocated on first use on the stream that
        packs into it (see `_ensure`); where it does not fit, the error names the budget."""
        if self._pack is None:
            size = self.budgets.pack_buffer
            try:
                with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
                    self._pack = torch.empty(size, dtype=torch.uint8, device=self.device)
            except torch.cuda.OutOfMemoryError as exc:
                free = torch.cuda.mem_get_info(self.index)[0]
                raise TieredError(f"cuda:{self.index}: the {format_size(size)} pack buffer (budgets.pack_buffer) does "
                                  f"not fit the {format_size(free)} of GPU memory free: lower budgets.pack_buffer "
                                  "(saves then go in more, smaller waves)") from exc
            log.info("tiered: cuda:%d: %s pack buffer allocated (budgets.pack_buffer)", self.index, format_size(size))
        return self._pack

    def prepare(self, plans: Sequence[TensorPlan], tensors: Sequence[torch.Tensor]) -> None:
        """At start-up (`Engine.reserve`): allocate the pack buffer, lay out saves of `plans` (their
        tensors: `tensors[plan.index]`) and, before this GPU's first save, run their kernels once
        (`_first_run`), so that the first save of that structure does none of it (the layout's
        Python took ~0.1 s of a 24 GB state's first save, beside the training loop). The slab is
        not allocated here: it is sized from the GPU memory free at the first save, once training
        holds its own. The layout is built for the fewest rows the slab can have, and kept where
        no wave was cut at that count (`Layout.fits`). Plans copied to the host as they are
        (tiered.stage.host_copy) only get their layout: they need no GPU buffer and run no kernel."""
        copied, plans = self._host_copier().split(plans)
        if copied:
            self._host_copier().layout(copied)
        if not any(p.nbytes for p in plans):
            return
        stride = self._stride_for({p.spec for p in plans})
        explicit = self.budgets.gpu_buffer
        rows = max(4, explicit // stride) if explicit is not None else 2 * self._wave_rows  # (`_ensure`'s least)
        with self._lock:
            pack = self._pack_buffer()
            if self._layout is None or not self._layout.fits(plans, pack, rows, stride):
                self._layout = Layout.build(plans, pack, rows, stride, self.chunk_size, self.zstd)
                log.info("tiered: cuda:%d: saves of this state laid out in %d waves of the pack buffer", self.index,
                         len(self._layout.waves))
            if self._slab is None:  # (no save yet: nothing else uses the pack buffer; a save's _ensure waits)
                self._first_run(self._layout, tensors)

    def _host_copier(self) -> HostCopier:
        if self._copier is None:
            self._copier = HostCopier(self.index, self.host, self.chunk_size, self.priority)
        return self._copier

    def _first_run(self, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """Run a save's kernels once now, not in the first save: pack what the first wave packs (its
        copy kernels load on first use: 17 ms of a first save's pack on an H100), and encode one
        chunk of the pack buffer with each codec of the layout on each encode stream (nvCOMP makes
        its objects per stream, and loads its kernels, on first use: a first save's encode calls
        took 98 ms against 68 in a warm one). The output is dropped; this waits for it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            layout.waves[0].sources(tensors, {}, self.chunk_size)
        pack, n = self._pack, min(self.chunk_size, self.budgets.pack_buffer)
        codecs = {id(codec): codec for wave in layout.waves for codec, _, _ in wave.groups}
        for codec in codecs.values():
            stride = self._stride_for([codec.spec])
            for enc in self.encode_streams:
                enc.wait_stream(self.stream)
                with torch.cuda.device(self.index), torch.cuda.stream(enc):
                    out = torch.empty(stride, dtype=torch.uint8, device=self.device)
                    encode_slots(codec, [pack[:n]], pack, out, stride, enc, self.chunk_size, packed=True).sizes()

    def _ensure(self, specs: Sequence[Any], nchunks: int) -> None:
        stride = self._stride_for(specs)
        with self._lock:
            if self._slab is not None and stride <= self._stride:
                return
            if self._ring is not None:
                # A codec with a larger bound appeared: wait until nothing is in flight, then regrow.
                self._ring.acquire(self._ring.rows)
            # (a wave released unread, after a failure, still holds the old slab through nvCOMP)
            self._last_waves = [None] * ENCODE_STREAMS
            self._slab, self._ring = None, None
            # The pack buffer first: where it does not fit, this save fails naming its budget and
            # the next one tries again, rather than finding a slab and no pack buffer.
            self._pack_buffer()
            rows = max(4, self.budget(nchunks * stride, 2 * WRITE_STAGING, 2 * self._wave_rows * stride,
                                      "the save slab") // stride)
            # Allocated on the stream that first writes them: with torch.use_deterministic_algorithms
            # (Lightning's deterministic=True), new memory is filled with NaN by a kernel on the
            # stream it is allocated on, which must run before, not beside, the save's work.
            with torch.cuda.stream(self.stream):
                self._slab = torch.empty(rows * stride, dtype=torch.uint8, device=self.device)
                self._stride, self._ring = stride, RowRing(rows)

    # --- save --------------------------------------------------------------------------
    def stage(self, plans: Sequence[TensorPlan], tensors: Sequence[torch.Tensor],
              emit: Callable[[RowsSegment], None], on_block: Callable[[], None],
              after: torch.cuda.Event | None = None) -> torch.cuda.Event:
        """Pack and compress `plans` (all on this device; their tensors are `tensors[plan.index]`)
        into slab rows, emitting segments; plans stored as they are (`codec: none`) are copied
        into host pages by the copy engines instead (tiered.stage.host_copy: HostSegments).

        Returns the event after which the tensors may change. Without `after`, the work follows
        the current stream, and the current stream waits on that event. With `after` (an event
        recorded by the training stream when save() was called, for a save staged on another
        thread), the work follows `after` and nothing waits: the caller orders its updates
        after the returned event itself. `on_block` is called before waiting for rows that the
        background writer must free.

        The caller must hold every tensor until the returned event has completed: this stream
        reads them without marking their memory for it (`record_stream`), so memory freed earlier
        could be handed out and overwritten while still being read. If staging fails, this waits
        for the reads already issued before raising, so the caller may let the tensors go at once.
        """
        self.timings = {}
        copier = self._host_copier()
        copied, plans = copier.split(plans)
        with torch.cuda.device(self.index), torch.no_grad():
            copies = None
            if copied:  # (`codec: none`: by the copy engines, straight from the tensors: tiered.stage.host_copy)
                try:
                    copies = copier.stage(copied, tensors, emit, on_block, after, self.timings)
                except BaseException:
                    copier.stream.synchronize()
                    raise
                if not plans:
                    return copies
            try:
                done = self._stage(plans, tensors, emit, on_block, after)
            except BaseException:
                self.stream.synchronize()
                for enc in self.encode_streams:  # (a batch issued before the failure may still
                    enc.synchronize()            # write rows the next save is handed)
                raise
            if copies is None:
                return done
            self.stream.wait_event(copies)
            return self.stream.record_event()

    def _stage(self, plans, tensors, emit, on_block, after) -> torch.cuda.Event:
        clock = time.perf_counter
        t = self.timings
        t.update({"layout_ms": 0.0, "pack_ms": 0.0, "wait_encoder_ms": 0.0, "encode_ms": 0.0, "wait_rows_ms": 0.0,
                  "emit_ms": 0.0})
        t0 = clock()
        if not any(p.nbytes for p in plans):
            return after if after is not None else torch.cuda.current_stream(self.device).record_event()
        nchunks = sum(p.nchunks for p in plans)
        self._ensure({p.spec for p in plans}, nchunks)
        ring, stride, pack = self._ring, self._stride, self._pack
        assert ring is not None and pack is not None
        drain = nchunks > ring.rows
        if drain:  # (first: a first save's pinning starts before its layout is built; raw bytes bound
            # what drains: many small tensors fill a fraction of their rows)
            self._plan_drain(min((nchunks - ring.rows) * self.chunk_size, sum(p.nbytes for p in plans)),
                             ring.rows * stride)
        layout = self._layout
        if layout is None or not layout.fits(plans, pack, ring.rows, stride):
            layout = self._layout = Layout.build(plans, pack, ring.rows, stride, self.chunk_size, self.zstd)
        if after is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.stream.wait_event(after)
        # No record_stream per tensor (90-121 ms of this thread for 7,880 tensors on an H100;
        # 2.7 ms without): the caller holds the tensors until the returned event (`stage`).
        t["layout_ms"] = 1e3 * (clock() - t0)
        remaining = layout.nchunks
        encode_clock, self._clock = self._clock, None
        contiguous: dict[int, torch.Tensor] = {}
        for wave in layout.waves:
            n = len(wave.chunks)
            t1 = clock()
            start = ring.acquire(n, on_block)
            rows = self._slab[start * stride:(start + n) * stride].view(n, stride)
            t2 = clock()
            with torch.cuda.stream(self.stream):
                sources = _Sources(wave, wave.sources(tensors, contiguous, self.chunk_size), pack, self.chunk_size)
            t3 = clock()
            k = self._next_encoder
            self._next_encoder = (k + 1) % ENCODE_STREAMS
            last = self._last_waves[k]
            if last is not None and not last.delivers:  # (nothing may be queued behind a batch nvCOMP reads)
                last.settle()
            t3e = clock()
            enc = self.encode_streams[k]
            enc.wait_stream(self.stream)  # (the pack)
            with torch.cuda.stream(enc):
                timed = encode_clock.start(enc) if encode_clock is not None else None
                pendings = [(codec.encode_batch(enc, self.chunk_size, *sources.of(codec, a, b), wave.raw_sizes[a:b],
                                                self._slab, [(start + r) * stride for r in range(a, b)], stride), b - a)
                            for codec, a, b in wave.groups]
                if timed is not None:
                    encode_clock.stop(enc, timed, {c.name for c, _, _ in wave.groups}, sum(wave.raw_sizes))
                delivered = deliver_sizes(pendings)
                sizes = self._last_waves[k] = WaveSizes(pendings, enc.record_event(), self.index,
                                                        None if delivered else self.quiet_copies, delivered)
            # (the next wave's pack reuses the pack buffer; the last wave's: the tensors are read)
            self.stream.wait_event(sizes.ready)
            t4 = clock()
            remaining -= n
            emit(RowsSegment(wave.chunks, sizes, rows, lambda s=start: ring.release(s), device=self, drain=drain))
            t["wait_rows_ms"] += 1e3 * (t2 - t1)
            t["pack_ms"] += 1e3 * (t3 - t2)
            t["wait_encoder_ms"] += 1e3 * (t3e - t3)
            t["encode_ms"] += 1e3 * (t4 - t3e)
            t["emit_ms"] += 1e3 * (clock() - t4)
        reads_done = self.stream.record_event()  # (after every wave's encode: some read the tensors in place)
        if after is None:
            torch.cuda.current_stream(self.device).wait_event(reads_done)
        return reads_done

    def _plan_drain(self, overflow: int, slab: int) -> None:
        """Up to `overflow` bytes of this save drain through pinned host memory: have them pinned,
        and say once where the save will wait (for pinning, or for the disk)."""
        self.host.want_for_save(overflow, self._warned, f"cuda:{self.index}",
                                f"drains up to {format_size(overflow)} of compressed chunks that do not fit the GPU "
                                f"slab ({format_size(slab)})",
                                "Raise budgets.host_buffer (or gpu_buffer, where GPU memory is free)")

    def pad_and_sum(self, seg: RowsSegment, sizes: Sequence[int], dev: torch.Tensor) -> None:
        """On the writer stream (current), after the wave's compression: zero each row past its
        chunk up to its aligned extent, in place, and checksum it (wsum64) into `dev[1]` (`dev`:
        the wave's int64 (3, rows) on this GPU, sizes in dev[0])."""
        if gpu_checksum.available():
            gpu_checksum.pad_and_checksum(seg.rows, dev[0], dev[1])
            return
        cols = torch.arange(seg.rows.shape[1], device=self.device)
        parts = []
        for r in range(0, len(sizes), CHECKSUM_ROWS):
            rows = seg.rows[r:r + CHECKSUM_ROWS]
            rows.masked_fill_(cols[None, :] >= dev[0, r:r + CHECKSUM_ROWS, None], 0)
            parts.append(wsum64_rows_torch(rows, round_up(max(sizes[r:r + CHECKSUM_ROWS]), 4) // 4))
        dev[1].copy_(torch.cat(parts))

    def finish_rows(self, seg: RowsSegment, sizes: Sequence[int]) -> list[int]:
        """Zero each GPU row past its chunk and return the rows' wsum64 checksums (waits for them)."""
        with torch.cuda.device(self.index), torch.cuda.stream(self.writer_stream):
            self.writer_stream.wait_event(seg.ready)  # (the wave's compression)
            io, dev = wave_io(self.device, sizes)
            self.pad_and_sum(seg, sizes, dev)
            io[1].copy_(dev[1], non_blocking=True)
            self.writer_stream.synchronize()
        return unsigned(io[1])

    def staging_buffers(self, at_least: int = 0) -> list[torch.Tensor]:
        """The two GPU staging buffers of `write_staging_bytes` each (at least `at_least` bytes:
        a drained run holds at least one row), allocated on first use."""
        size = write_staging_bytes(self._slab.numel() if self._slab is not None else self.budgets.gpu_buffer or 0)
        if self._staging is None or self._staging[0].numel() < at_least:
            self.pack_stream.synchronize()  # (a drain's packing into the old ones is done)
            self._staging = None  # (the smaller ones go before the larger are allocated)
            with torch.cuda.stream(self.writer_stream):  # (the stream that writes them: see _ensure)
                self._staging = [torch.empty(max(size, at_least), dtype=torch.uint8, device=self.device)
                                 for _ in range(2)]
        return self._staging

    def coalesce(self, seg: RowsSegment, extents: Sequence[int], writer: Any,
                 limit: int | None = None) -> Iterator[tuple[int, int, torch.Tensor, int]]:
        """Copy the rows' extents, in order, end to end into one of two GPU staging buffers of
        `write_staging_bytes` bytes, yielding (first row, end row, the filled buffer, its slot) so that
        the caller issues one large write per buffer instead of one per chunk. Before refilling a
        slot it waits for the write that `hold(slot, writer, future)` registered on it (a write of
        an earlier, closed writer is complete). Rows larger than a buffer are yielded as they are
        (slot -1). `limit` caps the bytes yielded at once (a row itself may exceed it)."""
        size = self.staging_buffers()[0].numel()
        size = min(size, limit or size)
        with torch.cuda.device(self.index):
            i, n = 0, len(extents)
            while i < n:
                if extents[i] > size:
                    yield i, i + 1, seg.rows[i, :extents[i]], -1
                    i += 1
                    continue
                k, total = i, 0
                while k < n and extents[k] <= size - total:
                    total += extents[k]
                    k += 1
                slot = self._next_slot
                self._next_slot ^= 1
                busy = self._busy[slot]
                if busy is not None and busy[0] is writer:
                    writer.wait_for(busy[1])
                buf = self._staging[slot][:total]
                with torch.cuda.stream(self.writer_stream):
                    gather_rows(seg, i, k, extents, buf)
                self.writer_stream.synchronize()
                yield i, k, buf, slot
                i = k

    def issue_drain(self, seg: RowsSegment, sizes: Sequence[int],
                    acquire: Callable[[RowRing, int], int]) -> "DrainedRows":
        """Issue, without waiting, all the GPU work of draining a wave into pinned host pages
        (tiered.gpu.drain); `acquire(ring, pages)` hands out pages of the host pool's ring."""
        if self._drainer is None:
            self._drainer = Drainer(self)
        return self._drainer.issue(seg, sizes, acquire)

    def note_copies(self, done: torch.cuda.Event) -> None:
        """`done` is recorded after copies to the host: a read of compressed sizes waits for it
        first (`quiet_copies`)."""
        self._copies = done

    def copies_idle(self) -> bool:
        """The copies to the host issued so far are done (`quiet_copies` would not wait)."""
        done = self._copies
        return done is None or done.query()

    def quiet_copies(self) -> None:
        """Wait, with the GIL let go, for the copies to the host issued so far (`WaveSizes`)."""
        done = self._copies
        if done is not None:
            done.synchronize()

    def hold(self, slot: int, writer: Any, future: Any) -> None:
        """The staging slot is in use until `future` (a write from it by `writer`) is done."""
        if slot >= 0:
            self._busy[slot] = (writer, future)

    @property
    def batch_chunks(self) -> int:
        """Chunks per batched codec call outside saves (migration, measurement: tiered.gpu.recode):
        what the pack buffer holds, at most 256. nvCOMP's throughput grows with the batch (GPU zstd most)."""
        return max(1, min(self.budgets.pack_buffer // self.chunk_size, 256))

    # --- restore -----------------------------------------------------------------------
    def restore(self, items: Sequence[tuple[TensorRecord, torch.Tensor]], reader: Any, chunk_size: int,
                repair: Callable[[TensorRecord, int, str], Any] | None = None) -> None:
        """Decode `items` (record, destination tensor) from `reader` into the destinations
        (tiered.gpu.decode). `repair(rec, j, why)`, when given, supplies the raw bytes (host
        array) of a chunk whose checksum fails here; else that raises."""
        with torch.cuda.device(self.index):
            restore_on(self, items, reader, chunk_size, repair)


class _Sources:
    """Where a wave's encode calls read their chunks: the pack buffer, or (codecs that read in
    place) one span over it and the tensors the wave reads in place (gpu_layout.Wave.sources)."""

    def __init__(self, wave: Any, addresses: Any, pack: torch.Tensor, chunk_size: int):
        self.wave, self.pack = wave, pack
        self.span: Span | None = None
        if wave.in_place is not None:
            base = int(addresses.min())
            self.span = Span(base, int(addresses.max()) + chunk_size - base)
            self.offsets = (addresses - base).tolist()

    def of(self, codec: Any, a: int, b: int) -> tuple[Any, list[int]]:
        """(source buffer, offsets) of chunks a..b-1, all of `codec`."""
        if self.span is not None and codec.reads_in_place:
            return self.span, self.offsets[a:b]
        return self.pack, self.wave.offsets[a:b]


def _warm_up(index: int) -> None:
    gpu_checksum.warm_up(index)
    batch_copy.warm_up(index)
