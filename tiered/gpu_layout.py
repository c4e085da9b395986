"""How a save's tensors are laid out in the GPU pack buffer and slab rows, and how a restore's
chunks are grouped into reads: precomputed, cached per structure of state, no device work.

Used by tiered.gpu. Waves are consecutive runs of chunks that fit the pack buffer and the slab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tiered.codecs import get_codec
from tiered.codecs.base import Codec
from tiered.config import ZstdSettings
from tiered.plan import ChunkRef, TensorPlan, chunk_refs, pieces
from tiered.units import round_up

PACK_ALIGN = 256
"""Alignment of each tensor run in the pack buffer."""


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

    def fits(self, plans: Sequence[TensorPlan], pack: torch.Tensor, rows: int, stride: int) -> bool:
        return self.plans is plans and self.pack_ptr == pack.data_ptr() and self.rows == rows and self.stride == stride

    @classmethod
    def build(cls, plans: Sequence[TensorPlan], pack: torch.Tensor, rows: int, stride: int, chunk_size: int,
              zstd: ZstdSettings) -> "Layout":
        chunks = chunk_refs(plans)
        waves = []
        for i, k in wave_bounds([c.raw_size for c in chunks], pack.numel(), rows):
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
                pos = round_up(pos + hi - lo, PACK_ALIGN)
            groups: list[tuple[Codec, int, int]] = []
            for a, c in enumerate(wave):
                if groups and groups[-1][0].spec == c.plan.spec:
                    groups[-1] = (groups[-1][0], groups[-1][1], a + 1)
                else:
                    groups.append((get_codec(c.plan.spec, zstd), a, a + 1))
            waves.append(Wave(wave, offsets, [c.raw_size for c in wave], groups, whole, whole_dsts, parts))
        return cls(plans, pack.data_ptr(), rows, stride, len(chunks), waves)


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
    bounds: list[tuple[int, int]] = []
    i, used = 0, 0
    for k, size in enumerate(raw_sizes):
        need = round_up(size, PACK_ALIGN)
        if k > i and (used + need > pack_bytes or k - i >= max_rows):
            bounds.append((i, k))
            i, used = k, 0
        used += need
    if i < len(raw_sizes):
        bounds.append((i, len(raw_sizes)))
    return bounds
