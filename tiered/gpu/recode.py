"""The GPU side of migration and of codec measurement: `GpuRecoder`, over a `tiered.gpu.device.GpuDevice`.

It decodes stored chunks on the GPU (reading through KvikIO where the tier reads into GPU
memory), encodes chunks with GPU codecs a batch at a time, and times a codec's encode for the
codec policy. Migration makes one on a device of its own (`make_gpu_recoder`), so that its work
never queues behind a save's, and hands it to `tiered.migrate.copy_rank`; the codec policy
(`tiered.observe.probe`) wraps the saving engine's device. This module imports without CUDA, and the
GPU modules only where a device is made or used.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch

from tiered.codecs import get_codec
from tiered.format.manifest import ALIGNMENT, CodecSpec, RankIndex, TensorRecord
from tiered.gpu.runtime import gpu_stack_available
from tiered.tiers import device_reader
from tiered.units import round_up

log = logging.getLogger("tiered")
SLEEP_CYCLES = 50_000_000
"""GPU clock cycles (~25 ms on an H200) the GPU waits before a timed encode, while the host queues it."""
TIMING_TRIES = 6
"""Timed encodes at most, each waiting twice as long as the last (up to ~0.8 s), until the host
queued one before the GPU reached it."""


class GpuRecoder:
    """The GPU side of migration and of codec measurement, over `device` (a GpuDevice): decodes
    stored chunks (reading through KvikIO where the tier reads into GPU memory) and encodes
    chunks with GPU codecs, a window of `batch_chunks` at a time, in buffers of its own (never a
    save's slab)."""

    def __init__(self, device: Any):
        self.device = device

    def reader(self, src: Any, step: int, index: RankIndex) -> Any:
        """A reader of the rank's data file into GPU memory (KvikIO, or staged through the host)."""
        return device_reader(src, step, index.data_file)

    def decode_window(self, reader: Any, rec: TensorRecord, lo: int, hi: int, chunk_size: int) -> torch.Tensor:
        """Chunks lo..hi-1 of `rec`, decoded on the GPU into one 1-D uint8 GPU tensor (chunk k of
        the window at k * chunk_size)."""
        part = rec.chunks[lo:hi]
        elem = torch.empty((), dtype=rec.torch_dtype).element_size()
        one = replace(rec, shape=(sum(c.raw_size for c in part) // elem,), chunks=part)
        out = torch.empty(one.shape, dtype=rec.torch_dtype, device=self.device.device)
        self.device.restore([(one, out)], reader, chunk_size)
        return out.view(torch.uint8)

    def host_window(self, chunk_size: int) -> torch.Tensor:
        """A pinned host buffer for the windows `decode_refs` decodes: `batch_chunks` chunks of
        `chunk_size` bytes. That holds any window, each tensor's run of chunks 16-byte aligned: a
        run of n chunks has at most n * chunk_size bytes, a multiple of 16. From torch's caching
        host allocator, which rounds sizes up to a power of two (so not a few bytes more) and keeps
        them: one step's copy reuses the last one's."""
        return torch.empty(self.batch_chunks * chunk_size, dtype=torch.uint8, pin_memory=True)

    def decode_refs(self, reader: Any, refs: list[tuple[TensorRecord, int]], chunk_size: int,
                    host: torch.Tensor) -> tuple[np.ndarray, list[int]]:
        """Chunks `refs` (tensor record, chunk number; each tensor's in order, of any tensors; at
        most `batch_chunks`), decoded on the GPU in one batched call and copied into `host` (a
        `host_window`): (the bytes, a view of `host`; each chunk's offset in them)."""
        runs: list[list[Any]] = []  # [record, first chunk, end]
        for rec, j in refs:
            if runs and runs[-1][0] is rec and runs[-1][2] == j:
                runs[-1][2] = j + 1
            else:
                runs.append([rec, j, j + 1])
        starts, at = [], 0
        for rec, lo, hi in runs:
            at = -(-at // 16) * 16  # each run's start aligned for a typed view of its dtype
            starts.append(at)
            at += sum(c.raw_size for c in rec.chunks[lo:hi])
        buf = torch.empty(at, dtype=torch.uint8, device=self.device.device)
        items, offsets = [], []
        for (rec, lo, hi), start in zip(runs, starts):
            part = rec.chunks[lo:hi]
            n = sum(c.raw_size for c in part)
            items.append((replace(rec, shape=(n // rec.torch_dtype.itemsize,), chunks=part),
                          buf[start:start + n].view(rec.torch_dtype)))
            for c in part:
                offsets.append(start)
                start += c.raw_size
        self.device.restore(items, reader, chunk_size)
        host[:at].copy_(buf)
        return host[:at].numpy(), offsets

    def decode_chunks(self, src: Any, step: int, index: RankIndex,
                      picks: list[tuple[TensorRecord, int]]) -> list[torch.Tensor]:
        """Single chunks (tensor record, chunk number), decoded on the GPU, as uint8 GPU tensors."""
        items = []
        for rec, j in picks:
            c = rec.chunks[j]
            one = replace(rec, shape=(c.raw_size // torch.empty((), dtype=rec.torch_dtype).element_size(),),
                          chunks=(c,))
            items.append((one, torch.empty(one.shape, dtype=rec.torch_dtype, device=self.device.device)))
        reader = self.reader(src, step, index)
        try:
            self.device.restore(items, reader, index.chunk_size)
        finally:
            reader.close()
        return [t.reshape(-1).view(torch.uint8) for _, t in items]

    @property
    def batch_chunks(self) -> int:
        """Chunks per batched codec call (`GpuDevice.batch_chunks`)."""
        return self.device.batch_chunks

    def encode_chunks(self, chunks: Sequence[torch.Tensor], spec: CodecSpec) -> list[bytes]:
        """Encode `chunks` (1-D uint8 tensors of at most chunk_size bytes, on the host or this
        GPU) with `spec` on the GPU, each chunk independently as a save would; return each chunk's
        stored bytes in host memory. Uses buffers of its own (`batch_chunks` chunks at a time),
        never a save's slab, so it can run beside saves."""
        from tiered.gpu.waves import encode_slots

        dev = self.device
        codec = get_codec(spec, dev.zstd)
        cs = dev.chunk_size
        stride = round_up(codec.max_stored_size(cs), ALIGNMENT)
        per = max(1, min(len(chunks), self.batch_chunks))
        out: list[bytes] = []
        with torch.cuda.device(dev.index), torch.cuda.stream(dev.stream):
            pack = torch.empty(per * cs, dtype=torch.uint8, device=dev.device)
            slab = torch.empty(per * stride, dtype=torch.uint8, device=dev.device)
            for w in range(0, len(chunks), per):
                part = [c.to(dev.device, non_blocking=True) for c in chunks[w:w + per]]
                sizes = encode_slots(codec, part, pack, slab, stride, dev.stream, cs).sizes()
                host = slab[:len(part) * stride].cpu().numpy()
                out.extend(host[k * stride:k * stride + n].tobytes() for k, n in enumerate(sizes))
        return out

    def measure_encode(self, chunks: Sequence[torch.Tensor], spec: CodecSpec, *, slots: int | None = None,
                       stream: Any = None) -> tuple[float, int]:
        """(seconds, stored bytes) to encode `chunks` (1-D uint8, at most chunk_size bytes each;
        moved to this GPU and packed first, untimed) on the GPU: one batched call, timed with CUDA
        events after a warm-up call, on `stream` (default the device's stream).

        The sample is repeated to `slots` chunks (default `batch_chunks`, a full batch; never
        fewer than the sample) and the time is scaled back to the sample's bytes: nvCOMP's
        throughput grows with the batch (zstd: 0.4 GB/s for 16 chunks, several GB/s for
        hundreds), so a batch smaller than a save's measures a lower bound. The buffers take
        `slots` × (chunk_size + the codec's bound) of new GPU memory. The timed call encodes what
        the warm-up call packed: the encode alone, after the device's kernels are compiled (its
        warm-up thread, compiling beside the timed call, held the host up for longer than the GPU
        was kept busy: ANS timed at 9-17 GB/s, against ~260 GB/s in a save's own waves). The timed
        call is queued behind a wait on the GPU, and timed again with a longer wait until the host
        had queued it before the GPU reached it (`TIMING_TRIES`): measured at `Engine.reserve`
        while the pinner registered host memory, ANS once timed at 6.3 GB/s against ~1 TB/s, and
        the policy stored that run's saves uncompressed."""
        from tiered.gpu.waves import encode_slots

        dev = self.device
        codec = get_codec(spec, dev.zstd)
        cs, n = dev.chunk_size, len(chunks)
        slots = max(n, self.batch_chunks if slots is None else slots)
        stride = round_up(codec.max_stored_size(cs), ALIGNMENT)
        stream = stream or dev.stream
        dev.wait_warm()
        with torch.cuda.device(dev.index), torch.cuda.stream(stream):
            src = [c.to(dev.device) for c in chunks]
            srcs = [src[k % n] for k in range(slots)]
            pack = torch.empty(slots * cs, dtype=torch.uint8, device=dev.device)
            slab = torch.empty(slots * stride, dtype=torch.uint8, device=dev.device)
            encode_slots(codec, srcs, pack, slab, stride, stream, cs).sizes()  # warm-up
            # Keep the GPU busy while the host enqueues the timed work (nvCOMP builds its batch
            # descriptors on the host), so the events time GPU work, not host latency. Where the
            # GPU reached the window before the host had queued all of it (launches held behind a
            # host memory registration: `Engine.reserve` measures while its memory is pinned), the
            # window holds idle time: timed again with twice the wait, the shortest kept.
            sleep = getattr(torch.cuda, "_sleep", None)
            best, cycles, clean, pending = None, SLEEP_CYCLES, False, None
            for _ in range(TIMING_TRIES if sleep is not None else 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if sleep is not None:
                    sleep(cycles)
                start.record(stream)
                pending = encode_slots(codec, srcs, pack, slab, stride, stream, cs, packed=True)
                end.record(stream)
                clean = sleep is not None and not start.query()
                end.synchronize()
                ms = start.elapsed_time(end)
                best = ms if best is None else min(best, ms)
                if clean:
                    break
                cycles *= 2
            sizes = pending.sizes()
        if sleep is not None and not clean:
            log.info("tiered: cuda:%d: %s's encode timed with the host late to queue it (%d tries): its rate is "
                     "a lower bound", dev.index, spec.name, TIMING_TRIES)
        seconds = best / 1e3 * sum(s.numel() for s in src) / sum(s.numel() for s in srcs)
        return seconds, sum(sizes[:n])


def make_gpu_recoder(config: Any, index: int | None = None) -> GpuRecoder | None:
    """A GpuRecoder on CUDA device `index` (made the calling thread's current one; None: the
    current one) with migration-sized buffers (at most 512 MiB of slab and 128 MiB of pack
    buffer, beside whatever training holds), or None without GPU codecs."""
    if not gpu_stack_available():
        return None
    if index is not None:
        torch.cuda.set_device(index)
    from tiered.config import Budgets
    from tiered.gpu.device import GpuDevice
    from tiered.stage.pools import HostPool

    b = config.budgets
    budgets = Budgets(gpu_buffer=min(b.gpu_buffer or 512 << 20, 512 << 20), pack_buffer=min(b.pack_buffer, 128 << 20),
                      host_buffer=64 << 20)
    return GpuRecoder(GpuDevice(torch.cuda.current_device(), config.chunk_size, budgets, config.zstd,
                                HostPool(64 << 20, page=4096), priority=0))
