"""How a save's tensors are laid out in the GPU pack buffer and slab rows, and how a restore's
chunks are grouped into reads: precomputed, cached per structure of state, no device work.

Used by tiered.gpu.device. Waves are consecutive runs of chunks that fit the pack buffer and the slab.
Where a codec reads its input as it lies (`Codec.reads_in_place`: ANS), a contiguous tensor's
chunks are encoded straight from the tensor's own memory and the pack buffer is not used for them;
the pack buffer takes what cannot be read so (a byte shuffle first, a strided view, an address or
size nvCOMP cannot take), and every chunk keeps a place there for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from tiered.codecs import get_codec
from tiered.codecs.base import Codec
from tiered.config import ZstdSettings
from tiered.format.chunks import greedy_runs
from tiered.stage.plan import ChunkRef, Runs, TensorPlan, chunk_refs
from tiered.units import round_up

PACK_ALIGN = 256
"""Alignment of each tensor run in the pack buffer: a multiple of every dtype's size, so a whole
tensor there is a typed view of the buffer (`Layout.build`)."""
IN_PLACE_ALIGN = 16
"""A chunk is read in place where its address and size are multiples of this: nvCOMP's ANS asks
16 bytes of its input (`get_required_compression_alignment`), and 16 is its advice where unsure.
Whole multiples also keep every read inside the tensor's own bytes."""


class Span:
    """GPU memory from `ptr`, `nbytes` long, as nvCOMP takes a buffer (`__cuda_array_interface__`):
    one wave's chunks are carved from one span that covers the pack buffer and every tensor the
    wave reads in place. It holds no memory: the save holds the tensors until they are read."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3, "stream": None}


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@dataclass
class Wave:
    """One wave of a save, precomputed: which bytes go where in the pack buffer, which chunks are
    read in place, and the codec groups. Whole tensors that are packed are copied by one fused
    multi-tensor copy into typed views of the pack buffer shaped like them, so a warm save passes
    the caller's tensors as they are (no per-tensor views or slices built per save: that was most
    of save()'s host time on states of many tensors)."""

    chunks: list[ChunkRef]
    offsets: list[int]
    """Each chunk's place in the pack buffer (where it is packed, or would be)."""
    raw_sizes: list[int]
    groups: list[tuple[Codec, int, int]]
    """(codec, first, end) runs of chunks of one codec spec: one batched call each."""
    whole: list[int]
    whole_dsts: list[torch.Tensor]
    pieces: list[tuple[int, int, int, torch.Tensor, Codec | None]]
    """(leaf index, byte lo, byte hi, uint8 pack view, codec to pack with or None for a plain copy)."""
    direct: list[tuple[int, int, int, int, torch.Tensor, bool]] = field(default_factory=list)
    """Runs read in place where the tensor allows it at the save: (leaf index, byte lo, first
    chunk, chunk count, the pack view to copy them into where it does not, whole tensor: that
    view is typed and shaped like it)."""
    addresses: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Each chunk's address in the pack buffer; a save puts the in-place chunks' in (`sources`)."""
    in_place: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """For `direct`: the positions of its chunks, the chunks per run, each chunk's byte offset in its run's tensor."""

    def sources(self, tensors: Sequence[torch.Tensor], contiguous: dict[int, torch.Tensor],
                chunk_size: int) -> np.ndarray:
        """Pack what this save cannot read in place, on the current stream, and return every
        chunk's address: in the pack buffer, or in its tensor. A run is read in place where its
        tensor is contiguous and its address a multiple of IN_PLACE_ALIGN; otherwise it is packed
        into its place, as every chunk of a codec that does not read in place is."""
        addresses = self.addresses
        dsts, srcs = self.whole_dsts, [tensors[i] for i in self.whole]
        if self.in_place is not None:
            at, counts, within = self.in_place
            starts = np.empty(len(self.direct), np.int64)
            packed = []
            for e, entry in enumerate(self.direct):
                t = tensors[entry[0]]
                starts[e] = ptr = t.data_ptr()
                if ptr % IN_PLACE_ALIGN or not t.is_contiguous():
                    packed.append(entry)
            addresses = addresses.copy()
            addresses[at] = np.repeat(starts, counts) + within
            if packed:  # (rare: a strided view, or a view at an address nvCOMP cannot read)
                dsts, srcs = list(dsts), list(srcs)
                for i, lo, k, n, dst, whole in packed:
                    addresses[k:k + n] = self.addresses[k:k + n]
                    dsts.append(dst)
                    srcs.append(tensors[i] if whole else _contiguous_bytes(tensors, contiguous, i)[lo:lo + dst.numel()])
        if srcs:
            torch._foreach_copy_(dsts, srcs)
        for i, lo, hi, dst, codec in self.pieces:
            src = _contiguous_bytes(tensors, contiguous, i)
            if codec is None:
                dst.copy_(src[lo:hi])
            else:
                codec.pack(dst, src[lo:hi], chunk_size)
        return addresses


def _contiguous_bytes(tensors: Sequence[torch.Tensor], contiguous: dict[int, torch.Tensor], i: int) -> torch.Tensor:
    """Tensor i's bytes, contiguous: made once per save (`contiguous`) for a tensor packed in pieces."""
    src = contiguous.get(i)
    if src is None:
        t = tensors[i]
        src = contiguous[i] = bytes_of(t if t.is_contiguous() else t.contiguous())
    return src


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
        in_place_ok = chunk_size % IN_PLACE_ALIGN == 0
        for i, k in bounds:
            wave = chunks[i:k]
            offsets: list[int] = []
            whole: list[int] = []
            whole_dsts: list[torch.Tensor] = []
            parts: list[tuple[int, int, int, torch.Tensor, Codec | None]] = []
            direct: list[tuple[int, int, int, int, torch.Tensor, bool]] = []
            groups: list[tuple[Codec, int, int]] = []
            pos = at = 0
            for plan, j0, n in runs.within(i, k):
                got = codecs.get(plan.spec)
                if got is None:
                    codec = get_codec(plan.spec, zstd)
                    got = codecs[plan.spec] = (codec, type(codec).pack is Codec.pack)
                codec, plain = got
                lo, hi = j0 * chunk_size, min(plan.nbytes, (j0 + n) * chunk_size)
                is_whole = plain and lo == 0 and hi == plan.nbytes
                if is_whole:
                    view = typed.get(plan.dtype)
                    if view is None:
                        view = typed[plan.dtype] = pack[:pack.numel() // plan.dtype.itemsize * plan.dtype.itemsize] \
                            .view(plan.dtype)
                    size = plan.dtype.itemsize
                    dst = view[pos // size:(pos + hi) // size].view(plan.shape)
                else:
                    dst = pack[pos:pos + hi - lo]
                if plain and codec.reads_in_place and in_place_ok and plan.nbytes % IN_PLACE_ALIGN == 0:
                    direct.append((plan.index, lo, at, n, dst, is_whole))
                elif is_whole:
                    whole.append(plan.index)
                    whole_dsts.append(dst)
                else:
                    parts.append((plan.index, lo, hi, dst, None if plain else codec))
                offsets.extend(range(pos, pos + n * chunk_size, chunk_size))
                pos = round_up(pos + hi - lo, PACK_ALIGN)
                # (one batched codec call per run of chunks of one spec)
                if groups and groups[-1][0].spec == plan.spec:
                    groups[-1] = (groups[-1][0], groups[-1][1], at + n)
                else:
                    groups.append((codec, at, at + n))
                at += n
            in_place = None
            if direct:
                in_place = (np.concatenate([np.arange(a, a + n) for _, _, a, n, _, _ in direct]),
                            np.array([n for _, _, _, n, _, _ in direct], np.int64),
                            np.concatenate([lo + chunk_size * np.arange(n, dtype=np.int64)
                                            for _, lo, _, n, _, _ in direct]))
            waves.append(Wave(wave, offsets, raw[i:k], groups, whole, whole_dsts, parts, direct,
                              pack.data_ptr() + np.array(offsets, np.int64), in_place))
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
