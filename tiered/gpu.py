"""The GPU half of save and restore: pack, batched compression into a reused slab, restore reads.

Save, per device, in waves that fit the pack buffer and the slab (all on a side stream that
first waits for the training stream):

    pack tensors (chunk-aligned pieces) -> codec.encode_batch into slab rows -> [spill to pinned]

After the last pack the training stream waits on an event: from then on training may overwrite
its tensors, because the compressed copy in the slab *is* the snapshot. `save()` returns without
waiting for the GPU at all. The background writer later reads the compressed sizes, zeroes each
row past its chunk, checksums the rows on the GPU, and hands row prefixes to KvikIO.

Restore reads each chunk's aligned extent with KvikIO straight into slab rows, verifies the
checksums on the GPU, decodes one batch per codec, and unpacks into the destination tensors.

Imported only when CUDA is in use.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from tiered.checksum import to_u64, wsum64_rows_torch
from tiered.codecs import get_codec
from tiered.codecs.base import Codec, PendingSizes
from tiered.config import Budgets, ZstdSettings
from tiered.format import ALIGNMENT, TensorRecord, chunk_corruption
from tiered.plan import ChunkRef, TensorPlan, chunk_refs, pieces
from tiered.staging import HostPool, RowRing
from tiered.tiers.local import drain_quietly, wait_futures
from tiered.units import round_up

_PACK_ALIGN = 256
_CHECKSUM_ROWS = 64
_WRITE_STAGING = 64 << 20
"""Bytes per coalesced write (two such GPU buffers per device): 4 KvikIO tasks of 16 MiB; less
where the gpu_buffer budget is small (`write_staging_bytes`)."""


def write_staging_bytes(gpu_buffer: int) -> int:
    """Bytes of each of the two write staging buffers: _WRITE_STAGING, or a sixteenth of the
    gpu_buffer budget where that is smaller (at least 1 MiB), so that small budgets stay small."""
    return min(_WRITE_STAGING, max(1 << 20, gpu_buffer // 16 // ALIGNMENT * ALIGNMENT))


@dataclass
class RowsSegment:
    """A wave of compressed chunks, one per row, in GPU slab rows or (spilled) pinned host rows."""

    chunks: list[ChunkRef]
    pendings: list[tuple[PendingSizes, int]]
    rows: torch.Tensor
    ready: torch.cuda.Event
    release: Callable[[], None]
    on_gpu: bool
    device: "GpuDevice"

    def sizes(self) -> list[int]:
        # Wait through torch (it releases the GIL) before asking nvCOMP, whose wait may not.
        self.ready.synchronize()
        out: list[int] = []
        for pending, n in self.pendings:
            # On the writer thread, whose current device is cuda:0 whatever GPU this rank uses:
            # nvCOMP's batch must be read on its own device.
            with torch.cuda.device(self.device.index):
                got = pending.sizes()
            if len(got) != n:
                raise RuntimeError(f"codec returned {len(got)} sizes for {n} chunks")
            out.extend(got)
        return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@dataclass
class GpuDevice:
    """Per-GPU streams and staging memory, allocated on first use and reused across saves."""

    index: int
    chunk_size: int
    budgets: Budgets
    zstd: ZstdSettings
    host: HostPool
    stream: torch.cuda.Stream = field(init=False)
    writer_stream: torch.cuda.Stream = field(init=False)
    _slab: torch.Tensor | None = field(default=None, init=False)
    _ring: RowRing | None = field(default=None, init=False)
    _stride: int = field(default=0, init=False)
    _pack: torch.Tensor | None = field(default=None, init=False)
    _layout: "_Layout | None" = field(default=None, init=False)
    _staging: list[torch.Tensor] | None = field(default=None, init=False)
    _busy: list[Any] = field(default_factory=lambda: [None, None], init=False)
    _next_slot: int = field(default=0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    timings: dict[str, float] = field(default_factory=dict, init=False)
    """Milliseconds spent in the phases of the last stage() call (diagnostics)."""

    def __post_init__(self) -> None:
        dev = torch.device("cuda", self.index)
        self.stream = torch.cuda.Stream(dev)
        self.writer_stream = torch.cuda.Stream(dev)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def _ensure(self, specs: Sequence[Any]) -> None:
        stride = round_up(max(get_codec(s, self.zstd).max_stored_size(self.chunk_size) for s in specs), ALIGNMENT)
        with self._lock:
            if self._slab is not None and stride <= self._stride:
                return
            if self._ring is not None:
                # A codec with a larger bound appeared: wait until nothing is in flight, then regrow.
                self._ring.acquire(self._ring.rows)
            rows = max(4, self.budgets.gpu_buffer // stride)
            self._slab = None
            self._slab = torch.empty(rows * stride, dtype=torch.uint8, device=self.device)
            self._stride, self._ring = stride, RowRing(rows)
            if self._pack is None:
                self._pack = torch.empty(self.budgets.pack_buffer, dtype=torch.uint8, device=self.device)

    # --- save --------------------------------------------------------------------------
    def stage(self, plans: Sequence[TensorPlan], tensors: Sequence[torch.Tensor],
              emit: Callable[[RowsSegment], None], on_block: Callable[[], None]) -> torch.cuda.Event:
        """Pack and compress `plans` (all on this device; their tensors are `tensors[plan.index]`)
        into slab rows, emitting segments.

        Returns the event after which the tensors may change; the current stream waits on it.
        `on_block` is called before waiting for rows that the background writer must free.
        """
        with torch.cuda.device(self.index), torch.no_grad():
            return self._stage(plans, tensors, emit, on_block)

    def _stage(self, plans, tensors, emit, on_block) -> torch.cuda.Event:
        clock = time.perf_counter
        t = {"layout_ms": 0.0, "pack_ms": 0.0, "encode_ms": 0.0, "wait_rows_ms": 0.0, "spill_ms": 0.0}
        self.timings = t
        t0 = clock()
        if not any(p.nbytes for p in plans):
            return _recorded(torch.cuda.current_stream(self.device))
        self._ensure({p.spec for p in plans})
        ring, stride, pack = self._ring, self._stride, self._pack
        assert ring is not None and pack is not None
        layout = self._layout
        if layout is None or not layout.fits(plans, pack, ring.rows, stride):
            layout = self._layout = _Layout.build(plans, pack, ring.rows, stride, self.chunk_size, self.zstd)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for p in plans:
            tensors[p.index].record_stream(self.stream)
        t["layout_ms"] = 1e3 * (clock() - t0)
        if layout.nchunks > ring.rows:
            self.host.reserve((layout.nchunks - ring.rows + len(layout.waves[0].chunks)) * stride)
        remaining = layout.nchunks
        reads_done = None
        contiguous: dict[int, torch.Tensor] = {}
        for wi, wave in enumerate(layout.waves):
            n = len(wave.chunks)
            t1 = clock()
            start = ring.acquire(n, on_block)
            rows = self._slab[start * stride:(start + n) * stride].view(n, stride)
            t2 = clock()
            with torch.cuda.stream(self.stream):
                wave.pack(tensors, contiguous, self.chunk_size)
                if wi == len(layout.waves) - 1:
                    reads_done = _recorded(self.stream)
                t3 = clock()
                pendings = [(codec.encode_batch(self.stream, self.chunk_size, pack, wave.offsets[a:b], wave.raw_sizes[a:b],
                                                self._slab, [(start + r) * stride for r in range(a, b)], stride), b - a)
                            for codec, a, b in wave.groups]
            t4 = clock()
            remaining -= n
            seg = RowsSegment(wave.chunks, pendings, rows, _recorded(self.stream), lambda s=start: ring.release(s),
                              on_gpu=True, device=self)
            if remaining and ring.free_rows() < min(remaining, ring.rows):
                seg = self._maybe_spill(seg, ring, start)
            emit(seg)
            t["wait_rows_ms"] += 1e3 * (t2 - t1)
            t["pack_ms"] += 1e3 * (t3 - t2)
            t["encode_ms"] += 1e3 * (t4 - t3)
            t["spill_ms"] += 1e3 * (clock() - t4)
        assert reads_done is not None
        torch.cuda.current_stream(self.device).wait_event(reads_done)
        return reads_done

    def _maybe_spill(self, seg: RowsSegment, ring: RowRing, start: int) -> RowsSegment:
        """Copy a wave to pinned host rows so the slab rows can be reused by this same save."""
        nbytes = seg.rows.numel()
        host = self.host
        if host.ring is None or host.pages(nbytes) > host.ring.rows:
            return seg
        page = host.ring.try_acquire(host.pages(nbytes))
        if page is None:
            return seg
        dst = host.view(page, nbytes).view(seg.rows.shape)
        with torch.cuda.stream(self.stream):
            dst.copy_(seg.rows, non_blocking=True)
            ready = _recorded(self.stream)
        ring.release(start)  # later writes into these rows are ordered after the copy on this stream
        return RowsSegment(seg.chunks, seg.pendings, dst, ready, lambda: host.ring.release(page),
                           on_gpu=False, device=self)

    def finish_rows(self, seg: RowsSegment, sizes: Sequence[int]) -> list[int]:
        """Zero each GPU row past its chunk and return the rows' wsum64 checksums."""
        with torch.cuda.device(self.index), torch.cuda.stream(self.writer_stream):
            self.writer_stream.wait_event(seg.ready)
            sizes_t = torch.tensor(sizes, dtype=torch.int64, device=self.device)
            cols = torch.arange(seg.rows.shape[1], device=self.device)
            sums = []
            for r in range(0, len(sizes), _CHECKSUM_ROWS):
                rows = seg.rows[r:r + _CHECKSUM_ROWS]
                rows.masked_fill_(cols[None, :] >= sizes_t[r:r + _CHECKSUM_ROWS, None], 0)
                words = round_up(max(sizes[r:r + _CHECKSUM_ROWS]), 4) // 4
                sums.append(wsum64_rows_torch(rows, words))
            out = torch.cat(sums).cpu().tolist()
        return [to_u64(x) for x in out]

    def coalesce(self, seg: RowsSegment, extents: Sequence[int], writer: Any) -> Iterator[tuple[int, int, torch.Tensor, int]]:
        """Copy the rows' extents, in order, end to end into one of two GPU staging buffers of
        `write_staging_bytes` bytes, yielding (first row, end row, the filled buffer, its slot) so that
        the caller issues one large write per buffer instead of one per chunk. Before refilling a
        slot it waits for the write that `hold(slot, writer, future)` registered on it (a write of
        an earlier, closed writer is complete). Rows larger than a buffer are yielded as they are
        (slot -1)."""
        size = write_staging_bytes(self.budgets.gpu_buffer)
        with torch.cuda.device(self.index):
            if self._staging is None:
                self._staging = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
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
                dsts, srcs, pos = [], [], 0
                for r in range(i, k):
                    dsts.append(buf[pos:pos + extents[r]])
                    srcs.append(seg.rows[r, :extents[r]])
                    pos += extents[r]
                with torch.cuda.stream(self.writer_stream):
                    torch._foreach_copy_(dsts, srcs)
                self.writer_stream.synchronize()
                yield i, k, buf, slot
                i = k

    def hold(self, slot: int, writer: Any, future: Any) -> None:
        """The staging slot is in use until `future` (a write from it by `writer`) is done."""
        if slot >= 0:
            self._busy[slot] = (writer, future)

    # --- migration and measurement -----------------------------------------------------
    @property
    def batch_chunks(self) -> int:
        """Chunks per batched codec call outside saves (migration, measurement): what the pack
        buffer holds, at most 256. nvCOMP's throughput grows with the batch (GPU zstd most)."""
        return max(1, min(self.budgets.pack_buffer // self.chunk_size, 256))

    def _encode_slots(self, codec: Any, srcs: Sequence[torch.Tensor], pack: torch.Tensor, slab: torch.Tensor,
                      stride: int) -> PendingSizes:
        """Pack `srcs` (1-D uint8 on this GPU, at most chunk_size bytes each) one per chunk slot of
        `pack` and encode them in one batched call into rows of `stride` bytes of `slab`; on the
        current stream (self.stream), as a save's wave does."""
        cs = self.chunk_size
        for src in srcs:
            if src.numel() > cs:
                raise ValueError(f"chunk of {src.numel()} bytes exceeds chunk_size {cs}")
        if type(codec).pack is Codec.pack:
            torch._foreach_copy_([pack[k * cs:k * cs + src.numel()] for k, src in enumerate(srcs)], list(srcs))
        else:
            for k, src in enumerate(srcs):
                codec.pack(pack[k * cs:k * cs + src.numel()], src, cs)
        return codec.encode_batch(self.stream, cs, pack, [k * cs for k in range(len(srcs))],
                                  [src.numel() for src in srcs], slab, [k * stride for k in range(len(srcs))], stride)

    def encode_chunks(self, chunks: Sequence[torch.Tensor], spec: Any) -> list[bytes]:
        """Encode `chunks` (1-D uint8 tensors of at most chunk_size bytes, on the host or this
        GPU) with `spec` on the GPU, each chunk independently as a save would; return each chunk's
        stored bytes in host memory. Uses buffers of its own (`batch_chunks` chunks at a time),
        never the save slab, so it can run beside saves."""
        codec = get_codec(spec, self.zstd)
        cs = self.chunk_size
        stride = round_up(codec.max_stored_size(cs), ALIGNMENT)
        per = max(1, min(len(chunks), self.batch_chunks))
        out: list[bytes] = []
        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            pack = torch.empty(per * cs, dtype=torch.uint8, device=self.device)
            slab = torch.empty(per * stride, dtype=torch.uint8, device=self.device)
            for w in range(0, len(chunks), per):
                part = [c.to(self.device, non_blocking=True) for c in chunks[w:w + per]]
                sizes = self._encode_slots(codec, part, pack, slab, stride).sizes()
                host = slab[:len(part) * stride].cpu().numpy()
                out.extend(host[k * stride:k * stride + n].tobytes() for k, n in enumerate(sizes))
        return out

    def measure_encode(self, chunks: Sequence[torch.Tensor], spec: Any) -> tuple[float, int]:
        """(seconds, stored bytes) to pack and encode `chunks` (1-D uint8, at most chunk_size
        bytes each; moved to this GPU first, untimed) on the GPU, at the throughput of a full
        batch: the sample is repeated to `batch_chunks` slots and one batched call is timed with
        CUDA events after a warm-up call; the time is scaled back to the sample's bytes. A small
        batch would measure launch latency rather than throughput (nvCOMP zstd: 0.4 GB/s for 16
        chunks, several GB/s for hundreds)."""
        codec = get_codec(spec, self.zstd)
        cs, n = self.chunk_size, len(chunks)
        slots = max(n, self.batch_chunks)
        stride = round_up(codec.max_stored_size(cs), ALIGNMENT)
        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            src = [c.to(self.device) for c in chunks]
            srcs = [src[k % n] for k in range(slots)]
            pack = torch.empty(slots * cs, dtype=torch.uint8, device=self.device)
            slab = torch.empty(slots * stride, dtype=torch.uint8, device=self.device)
            self._encode_slots(codec, srcs, pack, slab, stride).sizes()  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Keep the GPU busy while the host enqueues the timed work (nvCOMP builds its batch
            # descriptors on the host), so the events time GPU work, not host latency.
            sleep = getattr(torch.cuda, "_sleep", None)
            if sleep is not None:
                sleep(50_000_000)
            start.record(self.stream)
            pending = self._encode_slots(codec, srcs, pack, slab, stride)
            end.record(self.stream)
            sizes = pending.sizes()
            end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 * sum(s.numel() for s in src) / sum(s.numel() for s in srcs)
        return seconds, sum(sizes[:n])

    # --- restore -----------------------------------------------------------------------
    def restore(self, items: Sequence[tuple[TensorRecord, torch.Tensor]], reader: Any, chunk_size: int,
                repair: Callable[[TensorRecord, int, str], Any] | None = None) -> None:
        """Decode `items` (record, destination tensor) from `reader` into the destinations.

        `repair(rec, j, why)`, when given, supplies the raw bytes (host array) of a chunk whose
        checksum fails here; else that raises."""
        with torch.cuda.device(self.index):
            self._restore(items, reader, chunk_size, repair)

    def _restore(self, items, reader, chunk_size, repair) -> None:
        work: list[tuple[TensorRecord, torch.Tensor, torch.Tensor]] = []
        for rec, dst in items:
            direct = dst.is_cuda and dst.device.index == self.index and dst.is_contiguous()
            work.append((rec, dst, dst if direct else torch.empty(rec.shape, dtype=rec.torch_dtype, device=self.device)))
        refs = [(rec, tmp, j) for rec, _, tmp in work for j in range(len(rec.chunks))]
        if refs:
            stride = round_up(max(rec.chunks[j].extent for rec, _, j in refs), ALIGNMENT)
            waves = _wave_bounds([rec.chunks[j].raw_size for rec, _, j in refs], self.budgets.pack_buffer,
                                 max(1, self.budgets.gpu_buffer // stride))
            rows_cap = max(k - i for i, k in waves)
            slab = torch.empty(rows_cap * stride, dtype=torch.uint8, device=self.device)
            pack = torch.empty(min(self.budgets.pack_buffer, sum(
                round_up(rec.chunks[j].raw_size, _PACK_ALIGN) for rec, _, j in refs)) + chunk_size,
                dtype=torch.uint8, device=self.device)
            runs = [_file_runs([rec.chunks[j] for rec, _, j in refs[i:k]]) for i, k in waves]
            need = max(sum(n for _, n, _ in r) for r in runs)
            # Two read buffers. The next wave's reads are queued before this wave's are waited for,
            # so KvikIO's threads never idle at a wave boundary, and they run while this wave is
            # verified and decoded. The next wave's buffer was last used by the previous wave,
            # which is finished (decoded and synchronized).
            staging = [torch.empty(need, dtype=torch.uint8, device=self.device) for _ in range(min(2, len(waves)))]
            current = self._read_runs(reader, runs[0], staging[0])
            for w, (i, k) in enumerate(waves):
                pending = self._read_runs(reader, runs[w + 1], staging[(w + 1) % 2]) if w + 1 < len(waves) else []
                try:
                    wait_futures(current)
                    self._restore_wave(refs[i:k], runs[w], staging[w % 2], reader, slab, stride, pack, chunk_size,
                                       repair)
                except BaseException:
                    drain_quietly(current + pending)  # nothing may still write into buffers about to be freed
                    raise
                current = pending
        for rec, dst, tmp in work:
            if tmp is not dst:
                dst.copy_(tmp)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    @staticmethod
    def _read_runs(reader: Any, runs: list[tuple[int, int, list[int]]], buf: torch.Tensor) -> list[Any]:
        """Start one read per run of file-adjacent chunks, end to end into `buf`."""
        futures, pos = [], 0
        for offset, nbytes, _ in runs:
            futures.append(reader.read_device_async(offset, nbytes, buf[pos:pos + nbytes]))
            pos += nbytes
        return futures

    def _restore_wave(self, refs, runs, staged, reader, slab, stride, pack, chunk_size, repair) -> None:
        n = len(refs)
        rows = slab[:n * stride].view(n, stride)
        dsts, srcs, pos = [], [], 0
        for _, _, members in runs:
            for r in members:
                extent = refs[r][0].chunks[refs[r][2]].extent
                dsts.append(rows[r, :extent])
                srcs.append(staged[pos:pos + extent])
                pos += extent
        with torch.cuda.stream(self.stream):
            rows.zero_()  # checksums read whole words of the row: zero past each extent
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            sums = []
            for r in range(0, n, _CHECKSUM_ROWS):
                part = refs[r:r + _CHECKSUM_ROWS]
                words = round_up(max(rec.chunks[j].extent for rec, _, j in part), 4) // 4
                sums.append(wsum64_rows_torch(rows[r:r + _CHECKSUM_ROWS], words))
            got = [to_u64(x) for x in torch.cat(sums).cpu().tolist()]
        bad: dict[int, str] = {}
        for r, (rec, _, j) in enumerate(refs):
            c = rec.chunks[j]
            if got[r] != c.checksum:
                err = chunk_corruption(reader.path, rec, j, f"stored {c.checksum:016x}, computed {got[r]:016x}")
                if repair is None:
                    raise err
                bad[r] = str(err)
        good = [r for r in range(n) if r not in bad]
        # One decode per codec spec, into chunk slots of the pack buffer; then unpack per tensor run.
        offsets, pos = [], 0
        for r, (rec, _, j) in enumerate(refs):
            if r and not (refs[r - 1][0] is rec and refs[r - 1][2] + 1 == j):
                pos = round_up(pos, _PACK_ALIGN)
            offsets.append(pos)
            pos += rec.chunks[j].raw_size
        with torch.cuda.stream(self.stream):
            i = 0
            while i < len(good):
                spec = refs[good[i]][0].codec
                k = i
                while k < len(good) and refs[good[k]][0].codec == spec:
                    k += 1
                batch = good[i:k]
                codec = get_codec(spec, self.zstd)
                try:
                    codec.decode_batch(self.stream, chunk_size, slab, [r * stride for r in batch],
                                       [refs[r][0].chunks[refs[r][2]].size for r in batch], pack,
                                       [offsets[r] for r in batch], [refs[r][0].chunks[refs[r][2]].raw_size for r in batch])
                except (ValueError, RuntimeError) as exc:
                    rec, _, j = refs[batch[0]]
                    raise chunk_corruption(reader.path, rec, j, f"{spec.name} decode failed: {exc}") from None
                i = k
            x = 0
            while x < len(good):
                r = good[x]
                rec, tmp, j0 = refs[r]
                y = x
                while y + 1 < len(good) and good[y + 1] == good[y] + 1 and refs[good[y + 1]][0] is rec \
                        and refs[good[y + 1]][2] == refs[good[y]][2] + 1:
                    y += 1
                lo = j0 * chunk_size
                hi = lo + sum(rec.chunks[refs[good[z]][2]].raw_size for z in range(x, y + 1))
                get_codec(rec.codec, self.zstd).unpack(_bytes_of(tmp)[lo:hi], pack[offsets[r]:offsets[r] + hi - lo],
                                                       chunk_size)
                x = y + 1
            for r, why in bad.items():
                rec, tmp, j = refs[r]
                raw = torch.from_numpy(repair(rec, j, why))
                _bytes_of(tmp)[j * chunk_size:j * chunk_size + raw.numel()].copy_(raw)
        self.stream.synchronize()


@dataclass
class _Wave:
    """One wave of a save, precomputed: which bytes go where in the pack buffer, and the codec
    groups. Whole tensors are copied by one fused multi-tensor copy into typed views of the pack
    buffer shaped like them, so a warm save passes the caller's tensors as they are (no per-tensor
    views or slices built per save: that was most of save()'s host time on states of many tensors)."""

    chunks: list[ChunkRef]
    offsets: list[int]
    raw_sizes: list[int]
    groups: list[tuple[Codec, int, int]]
    """(codec, first, end) runs of chunks of one codec spec: one batched call each."""
    whole: list[int]
    whole_dsts: list[torch.Tensor]
    pieces: list[tuple[int, int, int, torch.Tensor, Codec | None]]
    """(leaf index, byte lo, byte hi, uint8 pack view, codec to pack with or None for a plain copy)."""

    def pack(self, tensors: Sequence[torch.Tensor], contiguous: dict[int, torch.Tensor], chunk_size: int) -> None:
        if self.whole:
            torch._foreach_copy_(self.whole_dsts, [tensors[i] for i in self.whole])
        for i, lo, hi, dst, codec in self.pieces:
            src = contiguous.get(i)
            if src is None:
                t = tensors[i]
                src = contiguous[i] = _bytes_of(t if t.is_contiguous() else t.contiguous())
            if codec is None:
                dst.copy_(src[lo:hi])
            else:
                codec.pack(dst, src[lo:hi], chunk_size)


@dataclass
class _Layout:
    """A save's waves for one structure of state (`plans`, cached by the engine's PlanCache) and
    one set of buffers; reused by every save of that structure."""

    plans: Sequence[TensorPlan]
    pack_ptr: int
    rows: int
    stride: int
    nchunks: int
    waves: list[_Wave]

    def fits(self, plans: Sequence[TensorPlan], pack: torch.Tensor, rows: int, stride: int) -> bool:
        return self.plans is plans and self.pack_ptr == pack.data_ptr() and self.rows == rows and self.stride == stride

    @classmethod
    def build(cls, plans: Sequence[TensorPlan], pack: torch.Tensor, rows: int, stride: int, chunk_size: int,
              zstd: ZstdSettings) -> "_Layout":
        chunks = chunk_refs(plans)
        waves = []
        for i, k in _wave_bounds([c.raw_size for c in chunks], pack.numel(), rows):
            wave = chunks[i:k]
            offsets: list[int] = []
            whole: list[int] = []
            whole_dsts: list[torch.Tensor] = []
            parts: list[tuple[int, int, int, torch.Tensor, Codec | None]] = []
            pos = 0
            for plan, j0, n in pieces(wave):
                codec = get_codec(plan.spec, zstd)
                plain = type(codec).pack is Codec.pack
                lo, hi = j0 * chunk_size, min(plan.nbytes, (j0 + n) * chunk_size)
                if plain and lo == 0 and hi == plan.nbytes:
                    whole.append(plan.index)
                    whole_dsts.append(pack[pos:pos + hi].view(plan.dtype).view(plan.shape))
                else:
                    parts.append((plan.index, lo, hi, pack[pos:pos + hi - lo], None if plain else codec))
                offsets.extend(pos + m * chunk_size for m in range(n))
                pos = round_up(pos + hi - lo, _PACK_ALIGN)
            groups: list[tuple[Codec, int, int]] = []
            for a, c in enumerate(wave):
                if groups and groups[-1][0].spec == c.plan.spec:
                    groups[-1] = (groups[-1][0], groups[-1][1], a + 1)
                else:
                    groups.append((get_codec(c.plan.spec, zstd), a, a + 1))
            waves.append(_Wave(wave, offsets, [c.raw_size for c in wave], groups, whole, whole_dsts, parts))
        return cls(plans, pack.data_ptr(), rows, stride, len(chunks), waves)


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _file_runs(chunks: Sequence[Any]) -> list[tuple[int, int, list[int]]]:
    """[(file offset, bytes, member positions)]: the chunks (ChunkRecords, in restore order)
    grouped into runs that lie end to end in the data file, so each run is one read."""
    runs: list[tuple[int, int, list[int]]] = []
    for r, c in enumerate(chunks):
        if runs and runs[-1][0] + runs[-1][1] == c.offset:
            runs[-1][2].append(r)
            runs[-1] = (runs[-1][0], runs[-1][1] + c.extent, runs[-1][2])
        else:
            runs.append((c.offset, c.extent, [r]))
    return runs


def _wave_bounds(raw_sizes: Sequence[int], pack_bytes: int, max_rows: int) -> list[tuple[int, int]]:
    """[(i, k)]: consecutive runs of chunks whose raw bytes fit the pack buffer (each chunk
    aligned to _PACK_ALIGN there) and whose count fits `max_rows` slab rows; at least one chunk each."""
    bounds: list[tuple[int, int]] = []
    i, used = 0, 0
    for k, size in enumerate(raw_sizes):
        need = round_up(size, _PACK_ALIGN)
        if k > i and (used + need > pack_bytes or k - i >= max_rows):
            bounds.append((i, k))
            i, used = k, 0
        used += need
    if i < len(raw_sizes):
        bounds.append((i, len(raw_sizes)))
    return bounds
