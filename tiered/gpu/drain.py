"""A wave's drain: its compressed rows out of the GPU slab into pinned host pages, issued by the
background writer (tiered.gpu.write) without waiting for the GPU.

Every row of a drained wave goes out as its 4 KiB-aligned extent (the bytes past its chunk zero)
with its wsum64 checksum, end to end with the rows before it in one run of host pages per large
write. Two ways, the first where it can:

- **straight from the rows** (`DIRECT_COPIES`): the copy engines copy each row's compressed bytes
  where it lies in the slab into its place in the run, a run's rows in one driver call
  (tiered.gpu.batch_copy); the host zeroes the pinned page each extent's padding lies in just
  before the copies (`zero_tails`), and a kernel computes the checksums beside the copies,
  reading the rows and writing nothing. No copy waits for a kernel, so none waits for SMs that
  training's kernels hold: beside a matmul loop on an H200, a wave's rows crossed at 54.3-55.1
  GB/s this way, as one contiguous copy does (55.1), and at 50.6 GB/s packed first
  (docs/benchmarks.md, "Short training steps");
- **packed first**: a kernel packs each run's extents, padding zeroed and checksums computed in
  the same pass, into one of two GPU staging buffers, and one copy takes the run across (where
  the driver has no batched copies, 12.8 being the first with them, or Triton is missing).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from tiered.format.chunks import ALIGNMENT, extent_runs
from tiered.gpu import batch_copy
from tiered.gpu import pack as gpu_checksum
from tiered.gpu.waves import DrainedRows, RowsSegment
from tiered.stage.pools import RowRing, WavePages

WRITE_STAGING = 64 << 20
"""Bytes per coalesced write (two such GPU buffers per device, for rows written from the GPU
through KvikIO and for drains that pack rows first): 4 KvikIO tasks of 16 MiB; less where the
gpu_buffer budget is small (`write_staging_bytes`). A drained run is at most as large either way."""

MAPPED_IO = True
"""A drain's kernels read a wave's sizes and offsets from pinned memory and store its checksums
there (as `tiered.gpu.pack.deliver` does): no small copy waits behind the drain's copies, and a
wave's first packing waits for its compression only. Off, or where a kernel cannot reach pinned
memory, they cross on the device's `io_stream`."""

DIRECT_COPIES = True
"""Copy a drained wave's rows straight from the slab (module docstring); off, or where the driver
cannot batch copies or Triton is missing, rows are packed into staging buffers first."""


def write_staging_bytes(gpu_buffer: int) -> int:
    """Bytes of each of the two write staging buffers, and of a drained run at most:
    `WRITE_STAGING`, or a sixteenth of the gpu_buffer budget where that is smaller (at least 1 MiB),
    so that small budgets stay small."""
    return min(WRITE_STAGING, max(1 << 20, gpu_buffer // 16 // ALIGNMENT * ALIGNMENT))


def wave_io(device: torch.device, sizes: Sequence[int], offsets: Any = 0,
            send: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(pinned, on `device`): a wave's int64 (3, rows): sizes, checksums (filled on the GPU), and
    each row's word offset in its packed run; sent on the current stream without waiting (a plain
    copy from pageable memory would synchronize the stream, and so the drain's pipeline); not
    `send`: the pinned tensor twice (`MAPPED_IO`)."""
    io = torch.empty((3, len(sizes)), dtype=torch.int64, pin_memory=True)
    io[0].numpy()[:] = sizes
    io[2].numpy()[:] = offsets
    return io, io.to(device, non_blocking=True) if send else io


def zero_tails(run: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, extents: Sequence[int]) -> None:
    """Zero, in a run of host memory, the last 4 KiB page of each extent that has padding (bytes
    past its row's compressed size): before the run's copies are issued, which then write the
    row's bytes over the page's first part. One vectorized store a run (a loop over the rows,
    zeroing each padding alone, held the writer thread, and the GIL, ~1 ms a wave)."""
    ext = np.asarray(extents, dtype=np.int64)
    padded = ext > sizes
    if padded.any():
        run.reshape(-1, ALIGNMENT)[(offsets[padded] + ext[padded]) // ALIGNMENT - 1] = 0


class Drainer:
    """One GPU device's drains (`issue`), with the state the packed way keeps between waves: which
    staging buffer packs next, and when each was last copied out of. `device` is the
    `tiered.gpu.device.GpuDevice` whose streams, host pool and staging buffers it uses."""

    def __init__(self, device: Any):
        self.device = device
        self._slot = 0
        self._drained_from: list[torch.cuda.Event | None] = [None, None]

    def direct(self) -> bool:
        """Whether the next wave goes straight from its rows (`DIRECT_COPIES`)."""
        return DIRECT_COPIES and gpu_checksum.available() and batch_copy.available()

    def issue(self, seg: RowsSegment, sizes: Sequence[int], acquire: Callable[[RowRing, int], int]) -> DrainedRows:
        """Issue, without waiting, all the GPU work of draining a wave (`seg`, its compressed
        `sizes`) into pinned host pages: `acquire(ring, pages)` hands out pages of the host
        pool's ring (it may wait for writes to free some). The copies are noted on the device
        (`note_copies`); the returned rows say when they and the checksums are done."""
        dev = self.device
        mapped = MAPPED_IO and gpu_checksum.available() and gpu_checksum.can_deliver()
        issue = self._direct if self.direct() else self._packed
        done, sums, io, runs = issue(seg, sizes, acquire, mapped)
        dev.note_copies(done)
        return DrainedRows(list(sizes), io, runs, done, sums)

    def _direct(self, seg: RowsSegment, sizes: Sequence[int], acquire: Callable[[RowRing, int], int],
                mapped: bool) -> tuple[torch.cuda.Event, torch.cuda.Event, torch.Tensor, list]:
        """Each run's rows copied where they lie, in one batched call; the checksums on the packing
        stream beside them (module docstring)."""
        dev, host = self.device, self.device.host
        rows = seg.rows
        limit = min(write_staging_bytes(dev.slab_bytes), host.max_run_bytes)
        extents, bounds, offsets = extent_runs(sizes, limit)
        nbytes = np.asarray(sizes, dtype=np.int64)
        sources = rows.data_ptr() + np.arange(len(sizes), dtype=np.int64) * rows.stride(0)
        checking, copying = dev.pack_stream, dev.writer_stream
        runs: list[tuple[int, int, torch.Tensor, Callable[[], None]]] = []
        pages: WavePages | None = None
        with torch.cuda.device(dev.index):
            try:
                # The copies first, so that the copy engine has them as soon as it can, each run's
                # padded pages zeroed just before its copy (host stores, no GPU work); then the
                # checksums, which no copy waits for.
                copying.wait_event(seg.ready)  # (the wave's compression)
                pages = WavePages(host.ring, [host.pages(total) for _, _, total in bounds], acquire, host.page)
                for i, k, total in bounds:
                    page, release = pages.take(host.pages(total))
                    dst = host.view(page, total)
                    runs.append((i, k, dst, release))
                    zero_tails(dst.numpy(), offsets[i:k], nbytes[i:k], extents[i:k])
                    batch_copy.copy_batch(dst.data_ptr() + offsets[i:k], sources[i:k], nbytes[i:k], copying)
                checking.wait_event(seg.ready)
                with torch.cuda.stream(checking):
                    io, on_gpu = wave_io(dev.device, sizes, offsets // 4, send=not mapped)
                    gpu_checksum.checksum_rows(rows, on_gpu[0], on_gpu[1])  # (mapped: into io[1] itself)
                    if not mapped:
                        io[1].copy_(on_gpu[1], non_blocking=True)
            except BaseException:
                _undo((checking, copying), pages)
                raise
            return copying.record_event(), checking.record_event(), io, runs

    def _packed(self, seg: RowsSegment, sizes: Sequence[int], acquire: Callable[[RowRing, int], int],
                mapped: bool) -> tuple[torch.cuda.Event, torch.cuda.Event, torch.Tensor, list]:
        """Each run of rows (at most a staging buffer, or one pinned block) packed end to end on
        the GPU into one of the two staging buffers, padding zeroed and checksums computed in the
        same pass (tiered.gpu.pack), and copied from there into pinned host pages as one copy. The
        packing runs on a stream of its own and the copies on the writer stream, each waiting for
        the other through events: run k+1 is packed into one buffer while run k crosses PCIe from
        the other, so the copy engine does not stand idle while a run is packed (with both on one
        stream it did, ~30 ms of a 24 GB drain). Without `mapped`, the wave's sizes, offsets and
        checksums cross on a third (`io_stream`): the copy stream holds only the runs' copies, and
        no small copy waits there between two large ones. Without Triton, rows are padded and
        checksummed by torch operations and gathered by torch copies on the copy stream."""
        dev, host = self.device, self.device.host
        stride = seg.rows.shape[1]
        with torch.cuda.device(dev.index):
            buffers = dev.staging_buffers(stride)
        limit = min(buffers[0].numel(), host.max_run_bytes)  # (a run holds one row at least)
        runs: list[tuple[int, int, torch.Tensor, Callable[[], None]]] = []
        extents, bounds, offsets = extent_runs(sizes, limit)
        fused = gpu_checksum.available()
        pages: WavePages | None = None
        packing, copying = dev.pack_stream, dev.writer_stream
        side = packing if mapped else dev.io_stream if fused else copying
        with torch.cuda.device(dev.index):
            try:
                side.wait_event(seg.ready)  # (the wave's compression)
                with torch.cuda.stream(side):
                    io, on_gpu = wave_io(dev.device, sizes, offsets // 4, send=not mapped)
                    if not fused:
                        dev.pad_and_sum(seg, sizes, on_gpu)  # (in place, then gathered with torch copies)
                if fused and not mapped:
                    packing.wait_event(side.record_event())
                if fused:
                    with torch.cuda.stream(packing):
                        parts = gpu_checksum.partials(len(sizes), dev.device)
                pages = WavePages(host.ring, [host.pages(total) for _, _, total in bounds], acquire, host.page)
                for i, k, total in bounds:
                    slot = self._slot if fused else 0  # (the torch path packs and copies on one stream)
                    self._slot ^= fused
                    buf = buffers[slot][:total]
                    if fused:
                        with torch.cuda.stream(packing):
                            if self._drained_from[slot] is not None:  # (its last copy out is done)
                                packing.wait_event(self._drained_from[slot])
                            gpu_checksum.pack_and_checksum(seg.rows, on_gpu[0], parts, buffers[slot], on_gpu[2], i, k)
                            copying.wait_event(packing.record_event())
                    else:
                        with torch.cuda.stream(copying):
                            gather_rows(seg, i, k, extents, buf)
                    page, release = pages.take(host.pages(total))
                    dst = host.view(page, total)
                    runs.append((i, k, dst, release))
                    with torch.cuda.stream(copying):
                        dst.copy_(buf, non_blocking=True)
                    if fused:  # (the next packing into this buffer waits for it)
                        self._drained_from[slot] = copying.record_event()
                if fused:
                    with torch.cuda.stream(packing):
                        gpu_checksum.sum_partials(parts, on_gpu[1])  # (mapped: into io[1] itself)
                    if not mapped:
                        side.wait_event(packing.record_event())
                if not mapped:
                    with torch.cuda.stream(side):
                        io[1].copy_(on_gpu[1], non_blocking=True)
            except BaseException:
                _undo((packing, side, copying), pages)
                raise
            return copying.record_event(), side.record_event(), io, runs


def _undo(streams: Sequence[torch.cuda.Stream], pages: WavePages | None) -> None:
    """After a drain failed while issuing: wait until nothing issued on `streams` still uses the
    wave's pages or rows, then give the pages taken so far back."""
    for stream in streams:
        stream.synchronize()
    if pages is not None:
        pages.give_back()


def gather_rows(seg: RowsSegment, i: int, k: int, extents: Sequence[int], buf: torch.Tensor) -> None:
    """On the current stream: rows i..k-1's aligned extents end to end into `buf` (one fused copy)."""
    torch._foreach_copy_(list(buf.split(extents[i:k])), [seg.rows[r, :extents[r]] for r in range(i, k)])
