"""How a save's tensors are laid out in the GPU pack buffer and slab rows, and how a restore's
chunks are grouped into reads: precomputed, cached per structure of state, no device work.

Used by tiered.gpu. Waves are consecutive runs of chunks that fit the pack buffer and the slab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from tiered.chunks import greedy_runs
from tiered.codecs import get_codec
from tiered.codecs.base import Codec
from tiered.config import ZstdSettings
from tiered.plan import ChunkRef, Runs, TensorPlan, chunk_refs
from tiered.units import round_up

PACK_ALIGN = 256
"""Alignment of each tensor run in the pack buffer: a multiple of every dtype's size, so a whole
tensor there is a typed view of the buffer (`Layout.build`)."""


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@dataclass
class Wave:
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
                src = contiguous[i] = bytes_of(t if t.is_contiguous() else t.contiguous())
            if codec is None:
                dst.copy_(src[lo:hi])
            else:
                codec.pack(dst, src[lo:hi], chunk_size)


@dataclass
class Layout:
    """A save's waves for one structure of state (`plans`, cached by the engine's PlanCache) and
    one set of buffers; reused by every save of that structure."""

    plans: Sequence[TensorPlan]
    pack_ptr: int
    rows: int
    stride: int
    nchunks: int
    waves: list[Wave]
    capped: bool
    """Some wave was cut at `rows` chunks (a slab of more rows would take longer waves)."""

    def fits(self, plans: Sequence[TensorPlan], pack: torch.Tensor, rows: int, stride: int) -> bool:
        """Built for these plans and this pack buffer, with the waves a slab of `rows` rows of
        `stride` bytes takes: the same rows, or more where no wave was cut at `self.rows` (a
        layout built at start-up, before the slab is sized: `GpuDevice.prepare`)."""
        return (self.plans is plans and self.pack_ptr == pack.data_ptr() and self.stride == stride
                and (self.rows == rows or (self.rows < rows and not self.capped)))

    @classmethod
    def build(cls, plans: Sequence[TensorPlan], pack: torch.Tensor, rows: int, stride: int, chunk_size: int,
              zstd: ZstdSettings) -> "Layout":
        """Built once per structure of state, in the first save, on the stager thread: its Python
        comes out of a training loop that shares the GIL. So the work is per run of a tensor's
        chunks, not per chunk, and whole tensors are views of one typed view of the pack buffer
        per dtype. The 24 GB bench state (5,910 GPU tensors, 27,030 chunks) built in ~0.24 s on
        the 2-core CI machine when this went chunk by chunk, ~0.1 s now."""
        chunks = chunk_refs(plans)
        raw = [c.raw_size for c in chunks]
        typed: dict[torch.dtype, torch.Tensor] = {}
        codecs: dict[Any, tuple[Codec, bool]] = {}
        waves = []
        runs = Runs(plans)
        bounds = wave_bounds(raw, pack.numel(), rows)
        for i, k in bounds:
            wave = chunks[i:k]
            offsets: list[int] = []
            whole: list[int] = []
            whole_dsts: list[torch.Tensor] = []
            parts: list[tuple[int, int, int, torch.Tensor, Codec | None]] = []
            groups: list[tuple[Codec, int, int]] = []
            pos = at = 0
            for plan, j0, n in runs.within(i, k):
                got = codecs.get(plan.spec)
                if got is None:
                    codec = get_codec(plan.spec, zstd)
                    got = codecs[plan.spec] = (codec, type(codec).pack is Codec.pack)
                codec, plain = got
                lo, hi = j0 * chunk_size, min(plan.nbytes, (j0 + n) * chunk_size)
                if plain and lo == 0 and hi == plan.nbytes:
                    whole.append(plan.index)
                    view = typed.get(plan.dtype)
                    if view is None:
                        view = typed[plan.dtype] = pack[:pack.numel() // plan.dtype.itemsize * plan.dtype.itemsize] \
                            .view(plan.dtype)
                    size = plan.dtype.itemsize
                    whole_dsts.append(view[pos // size:(pos + hi) // size].view(plan.shape))
                else:
                    parts.append((plan.index, lo, hi, pack[pos:pos + hi - lo], None if plain else codec))
                offsets.extend(range(pos, pos + n * chunk_size, chunk_size))
                pos = round_up(pos + hi - lo, PACK_ALIGN)
                # (one batched codec call per run of chunks of one spec)
                if groups and groups[-1][0].spec == plan.spec:
                    groups[-1] = (groups[-1][0], groups[-1][1], at + n)
                else:
                    groups.append((codec, at, at + n))
                at += n
            waves.append(Wave(wave, offsets, raw[i:k], groups, whole, whole_dsts, parts))
        return cls(plans, pack.data_ptr(), rows, stride, len(chunks), waves, any(k - i >= rows for i, k in bounds))


def file_runs(chunks: Sequence[Any]) -> list[tuple[int, int, list[int]]]:
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


def wave_bounds(raw_sizes: Sequence[int], pack_bytes: int, max_rows: int) -> list[tuple[int, int]]:
    """[(i, k)]: consecutive runs of chunks whose raw bytes fit the pack buffer (each chunk
    aligned to PACK_ALIGN there) and whose count fits `max_rows` slab rows; at least one chunk each."""
    need = (np.asarray(raw_sizes, dtype=np.int64) + (PACK_ALIGN - 1)) // PACK_ALIGN * PACK_ALIGN
    return greedy_runs(np.cumsum(need), pack_bytes, max_rows)
