"""The GPU half of restore: read chunks into GPU memory, verify, decode, unpack.

Each wave of chunks (what the pack buffer holds) is read with KvikIO (GPUDirect Storage or its
compat mode) in runs of file-adjacent chunks into one of two staging buffers, the next wave's
reads queued before this one's are waited for; the chunks are copied into slab rows, their
checksums verified on the GPU, decoded in one batch per codec, and unpacked into the destination
tensors. `tiered.gpu.device.GpuDevice.restore` is the entry; imported only when CUDA is in use.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from tiered.codecs import get_codec
from tiered.format.checksum import unsigned, wsum64_rows_torch
from tiered.format.manifest import ALIGNMENT, TensorRecord, chunk_corruption
from tiered.gpu.layout import PACK_ALIGN, bytes_of, file_runs, wave_bounds
from tiered.tiers.local import drain_quietly, wait_futures
from tiered.units import format_rate, format_size, round_up

log = logging.getLogger("tiered")

CHECKSUM_ROWS = 64
"""Rows checksummed per torch call (bounds the int64 temporaries)."""


def restore_on(device: Any, items: Sequence[tuple[TensorRecord, torch.Tensor]], reader: Any, chunk_size: int,
               repair: Callable[[TensorRecord, int, str], Any] | None = None) -> None:
    """Decode `items` (record, destination tensor) from `reader` into the destinations, on
    `device` (a tiered.gpu.device.GpuDevice: its stream and its GPU budget), whose GPU is current.

    `repair(rec, j, why)`, when given, supplies the raw bytes (host array) of a chunk whose
    checksum fails here; else that raises."""
    work: list[tuple[TensorRecord, torch.Tensor, torch.Tensor]] = []
    for rec, dst in items:
        direct = dst.is_cuda and dst.device.index == device.index and dst.is_contiguous()
        work.append((rec, dst, dst if direct else torch.empty(rec.shape, dtype=rec.torch_dtype, device=device.device)))
    refs = [(rec, tmp, j) for rec, _, tmp in work for j in range(len(rec.chunks))]
    if refs:
        stride = round_up(max(rec.chunks[j].extent for rec, _, j in refs), ALIGNMENT)
        # The slab and the read buffers (up to two more of a wave's size) share the budget.
        budget = device.budget(len(refs) * stride, device.budgets.pack_buffer, 3 * (device.budgets.pack_buffer // chunk_size + 1) * stride,
                             "restores")
        waves = wave_bounds([rec.chunks[j].raw_size for rec, _, j in refs], device.budgets.pack_buffer,
                             max(1, budget // stride // (1 if device.budgets.gpu_buffer is not None else 3)))
        rows_cap = max(k - i for i, k in waves)
        # The buffers are made on this device's stream, the only stream that uses them, and
        # synchronized before KvikIO reads into them. Under torch.use_deterministic_algorithms
        # (Lightning's deterministic=True) new memory is filled with NaN by a kernel on the stream
        # that allocates it; made on the caller's stream, those fills ran beside the decode.
        runs = [file_runs([rec.chunks[j] for rec, _, j in refs[i:k]]) for i, k in waves]
        need = max(sum(n for _, n, _ in r) for r in runs)
        with torch.cuda.stream(device.stream):
            slab = torch.empty(rows_cap * stride, dtype=torch.uint8, device=device.device)
            pack = torch.empty(min(device.budgets.pack_buffer, sum(
                round_up(rec.chunks[j].raw_size, PACK_ALIGN) for rec, _, j in refs)) + chunk_size,
                dtype=torch.uint8, device=device.device)
            # Two read buffers. The next wave's reads are queued before this wave's are waited
            # for, so KvikIO's threads never idle at a wave boundary, and they run while this wave
            # is verified and decoded. The next wave's buffer was last used by the previous wave,
            # which is finished (decoded and synchronized).
            staging = [torch.empty(need, dtype=torch.uint8, device=device.device) for _ in range(min(2, len(waves)))]
        device.stream.synchronize()  # (their fills are done before the reads)
        # The destinations, and the buffers made above on the caller's stream, are written on
        # this device's stream after what the caller has queued (zeros_like, fills, older users
        # of reused memory).
        device.stream.wait_stream(torch.cuda.current_stream(device.device))
        t0 = time.perf_counter()
        waited = 0.0
        current = _read_runs(reader, runs[0], staging[0])
        for w, (i, k) in enumerate(waves):
            pending = _read_runs(reader, runs[w + 1], staging[(w + 1) % 2]) if w + 1 < len(waves) else []
            try:
                t1 = time.perf_counter()
                wait_futures(current)
                waited += time.perf_counter() - t1
                _restore_wave(device, refs[i:k], runs[w], staging[w % 2], reader, slab, stride, pack, chunk_size,
                                   repair)
            except BaseException:
                drain_quietly(current + pending)  # nothing may still write into buffers about to be freed
                raise
            current = pending
        took = time.perf_counter() - t0
        read = sum(n for r in runs for _, n, _ in r)
        # Where a restore's time went: a disk-bound one waits on its reads nearly all of it.
        log.info("tiered: cuda:%d: read %s in %d waves of up to %s in %.2f s (%s), of which waiting on the reads "
                 "%.2f s, verifying and decoding beside them %.2f s", device.index, format_size(read), len(waves),
                 format_size(need), took, format_rate(read / took) if took > 0 else "-", waited, took - waited)
    for rec, dst, tmp in work:
        if tmp is not dst:
            dst.copy_(tmp)
    torch.cuda.current_stream(device.device).wait_stream(device.stream)


def _read_runs(reader: Any, runs: list[tuple[int, int, list[int]]], buf: torch.Tensor) -> list[Any]:
    """Start one read per run of file-adjacent chunks, end to end into `buf`."""
    futures, pos = [], 0
    for offset, nbytes, _ in runs:
        futures.append(reader.read_device_async(offset, nbytes, buf[pos:pos + nbytes]))
        pos += nbytes
    return futures


def _restore_wave(device: Any, refs, runs, staged, reader, slab, stride, pack, chunk_size, repair) -> None:
    n = len(refs)
    rows = slab[:n * stride].view(n, stride)
    dsts, srcs, pos = [], [], 0
    for _, _, members in runs:
        for r in members:
            extent = refs[r][0].chunks[refs[r][2]].extent
            dsts.append(rows[r, :extent])
            srcs.append(staged[pos:pos + extent])
            pos += extent
    with torch.cuda.stream(device.stream):
        rows.zero_()  # checksums read whole words of the row: zero past each extent
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        sums = []
        for r in range(0, n, CHECKSUM_ROWS):
            part = refs[r:r + CHECKSUM_ROWS]
            words = round_up(max(rec.chunks[j].extent for rec, _, j in part), 4) // 4
            sums.append(wsum64_rows_torch(rows[r:r + CHECKSUM_ROWS], words))
        got = unsigned(torch.cat(sums).cpu())
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
            pos = round_up(pos, PACK_ALIGN)
        offsets.append(pos)
        pos += rec.chunks[j].raw_size
    with torch.cuda.stream(device.stream):
        i = 0
        while i < len(good):
            spec = refs[good[i]][0].codec
            k = i
            while k < len(good) and refs[good[k]][0].codec == spec:
                k += 1
            batch = good[i:k]
            codec = get_codec(spec, device.zstd)
            try:
                codec.decode_batch(device.stream, chunk_size, slab, [r * stride for r in batch],
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
            get_codec(rec.codec, device.zstd).unpack(bytes_of(tmp)[lo:hi], pack[offsets[r]:offsets[r] + hi - lo],
                                                   chunk_size)
            x = y + 1
        for r, why in bad.items():
            rec, tmp, j = refs[r]
            raw = torch.from_numpy(repair(rec, j, why))
            bytes_of(tmp)[j * chunk_size:j * chunk_size + raw.numel()].copy_(raw)
    device.stream.synchronize()
