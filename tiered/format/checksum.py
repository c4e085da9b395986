"""wsum64: the per-chunk checksum, computable identically on the CPU and on the GPU.

Definition: pad the chunk's stored bytes with zeros to a multiple of 4, read them as
little-endian uint32 words w_0..w_{n-1}, and take

    wsum64 = sum_i (2*i + 1) * w_i   (mod 2**64)

Every term is below 2**51, so a GPU computes it exactly with int64 elementwise products and a
sum (wrapping mod 2**64 as uint64 does), with no custom kernel: it runs on the chunk slab right
after compression, before the bytes leave the GPU. Odd weights make every single-bit and
every single-word error change the sum, and a swap of two different words changes it too;
truncation is caught separately by the stored size. It is an integrity check against
corruption, not a cryptographic hash. Zero padding adds nothing, so the checksum of a chunk
equals that of its 4 KiB-aligned stored extent.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

NAME = "wsum64"
_MASK64 = (1 << 64) - 1
_SLICE = 1 << 18
"""Words summed at a time (1 MiB): their uint64 products stay in cache."""
_WEIGHTS = np.arange(1, 2 * _SLICE, 2, dtype=np.uint64)
"""The weights 1, 3, 5, ... of one slice; a shorter slice uses their prefix (one array of 2 MiB,
not an array per distinct chunk size: compressed chunks come in every size)."""


def wsum64(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """Checksum of a buffer on the CPU, a slice of 1 MiB at a time: a slice starting at word k
    adds sum_i (2i + 1) * w_i + 2k * sum_i w_i. Each slice's weighted sum is one `np.einsum` in
    uint64 (wrapping mod 2**64, as the definition does), which widens the words a buffer of
    them at a time, in cache, without the GIL. On this repository's CPU machine: 1.17-1.26x the
    rate of a uint64 copy of each slice and a dot product on chunks fresh from memory, as a copy
    reads them (3.8-4.0 GB/s a thread), 1.66x on a chunk in cache (docs/benchmarks.md). Slices, not the whole buffer: a uint64 copy of a whole 64 MiB buffer (an index of a
    large state) fell out of cache and ran at 0.13 GB/s."""
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n = len(buf) >> 2
    words = buf[:n * 4].view("<u4")
    # (Array arithmetic wraps without a warning: no np.errstate, whose enter and exit, with the GIL
    # held, were a fifth of a 134 KB chunk's call. One slice: no loop.)
    if n <= _SLICE:
        total = int(np.einsum("i,i->", words, _WEIGHTS[:n], dtype=np.uint64, casting="unsafe"))
    else:
        total = 0
        for k in range(0, n, _SLICE):
            w = words[k:k + _SLICE]
            total += int(np.einsum("i,i->", w, _WEIGHTS[:len(w)], dtype=np.uint64, casting="unsafe"))
            if k:
                total += 2 * k * int(w.sum(dtype=np.uint64))
    if len(buf) > n * 4:  # the last word, zero-padded
        total += (2 * n + 1) * int.from_bytes(bytes(buf[n * 4:]), "little")
    return total & _MASK64


def wsum64_each(buffers: Sequence[bytes | bytearray | memoryview]) -> list[int]:
    """`wsum64` of each of many small buffers, in one numpy pass: they are laid end to end at
    word-aligned offsets, zeros between, and summed by `wsum64_extents`. For the thousands of
    chunks of a few bytes each that an optimizer's `step` scalars make a save: one `wsum64` call
    each was about half of the writer's time on them (docs/benchmarks.md)."""
    sizes = [len(memoryview(b).cast("B")) for b in buffers]
    if not sizes:
        return []
    if not all(sizes):  # (`wsum64_extents` sums a segment from each start to the next one's)
        return [wsum64(b) for b in buffers]
    offsets = [0] * len(sizes)
    at = 0
    for i, n in enumerate(sizes):
        offsets[i] = at
        at += -(-n // 4) * 4
    flat = bytearray(at)
    for b, o, n in zip(buffers, offsets, sizes):
        flat[o:o + n] = b
    return wsum64_extents(flat, offsets, sizes)


def wsum64_rows_torch(rows, valid_words: int | None = None):
    """wsum64 of each row of a (k, stride) uint8 CUDA tensor whose bytes past each chunk are zero.

    Returns an int64 tensor of k checksums (reinterpret as uint64). Runs on the current stream.
    """
    import torch

    k, stride = rows.shape
    n = stride // 4 if valid_words is None else valid_words
    words = rows.view(torch.int32)[:, :n].to(torch.int64) & 0xFFFFFFFF
    weights = torch.arange(1, 2 * n, 2, dtype=torch.int64, device=rows.device)
    return (words * weights).sum(dim=1)


def to_u64(value: int) -> int:
    return value & _MASK64


def unsigned(sums) -> list[int]:
    """Checksums computed on a GPU as int64 (a CPU tensor of them), as the uint64 they are."""
    return sums.numpy().view(np.uint64).tolist()


BLOCK_WORDS = 1 << 20
"""Words summed per numpy call by `wsum64_extents` (4 MiB of data, 8 MiB of uint64 temporaries)."""


def wsum64_extents(data: bytes | bytearray | memoryview | np.ndarray, offsets: Sequence[int], sizes: Sequence[int],
                   block_words: int = BLOCK_WORDS) -> list[int]:
    """wsum64 of each chunk of a buffer laid out as a data file is: chunk c at byte `offsets[c]`
    (a multiple of 4, in increasing order), `sizes[c]` bytes long, and every byte between one
    chunk's end and the next one's start (and after the last) zero. `data`'s length is a multiple of 4.

    The same sums as `wsum64` chunk by chunk, in a few numpy calls per `block_words` words,
    whatever the chunks' sizes: one call per chunk held the GIL thousands of times a save (each
    tensor's last chunk is its own size), and the chunks of a block are summed together. In a block
    starting at word B, a chunk's segment from word B + r, at word k of its chunk, adds
    sum_i (2(i + k) + 1) w_i = [sum_p (2(p - B) + 1) w_p] - 2r [sum w] + 2k [sum w] (mod 2**64), both
    sums taken with `np.add.reduceat` from each segment's start to the next one's: padding is zero."""
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if len(buf) % 4:
        raise ValueError(f"a buffer of {len(buf)} bytes is not whole words")
    words = buf.view("<u4")
    starts = np.asarray(offsets, dtype=np.int64)
    if len(starts) == 0:
        return []
    if (starts % 4).any():
        raise ValueError("chunk offsets must be multiples of 4")
    starts = starts // 4  # (a new array: the caller's offsets stay as they are)
    out = np.zeros(len(starts), dtype=np.uint64)
    end = int(starts[-1]) + -(-int(sizes[-1]) // 4)
    weights = np.arange(1, 2 * min(block_words, end - int(starts[0])) + 1, 2, dtype=np.uint64)
    tmp = np.empty(len(weights), dtype=np.uint64)
    for b in range(int(starts[0]), end, block_words):
        e = min(b + block_words, end)
        i0 = int(np.searchsorted(starts, b, side="right")) - 1
        i1 = int(np.searchsorted(starts, e, side="left"))
        seg = np.maximum(starts[i0:i1], b)
        r = seg - b
        t = tmp[:e - b]
        np.copyto(t, words[b:e])
        plain = np.add.reduceat(t, r)
        np.multiply(t, weights[:e - b], out=t)
        weighted = np.add.reduceat(t, r)
        out[i0:i1] += weighted + 2 * (seg - starts[i0:i1] - r).astype(np.uint64) * plain
    return out.tolist()
