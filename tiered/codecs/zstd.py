"""`zstd`: byte-plane shuffle by element size, then one standard zstd frame per chunk.

The shuffle groups byte 0 of every element, then byte 1, ... within each chunk, so the
sign/exponent bytes of floats sit together and compress well; the mantissa bytes are left
near-random. Each chunk is a standard zstd frame: written by nvCOMP on the GPU
(``bitstream_kind=RAW``) or by the ``zstandard`` package on the CPU, read by either. This is the
portable format for shared and archival tiers: restorable on machines without a GPU.

Configuration stored per tensor: ``{"shuffle": element_size}``. The compression level is an
encoder choice (CPU: ``codecs.zstd.level``; nvCOMP: its own) and is not needed to decode.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import zstandard

from tiered.codecs import _nvcomp
from tiered.codecs.base import Codec, register
from tiered.format.manifest import CodecSpec


def shuffle_np(raw: memoryview, elem: int) -> np.ndarray:
    a = np.frombuffer(raw, dtype=np.uint8)
    if elem == 1 or len(a) <= elem:  # (one element, a `step` scalar: its planes are its bytes)
        return a
    return np.ascontiguousarray(a.reshape(-1, elem).T).reshape(-1)


def unshuffle_np(shuffled: memoryview, elem: int, out: np.ndarray) -> None:
    a = np.frombuffer(shuffled, dtype=np.uint8)
    if elem == 1:
        out[:] = a
    else:
        out.reshape(-1, elem)[:] = a.reshape(elem, -1).T


def _chunks_2d(t: torch.Tensor, chunk_size: int):
    """(full chunks as a (n, chunk) view, tail view) of a 1-D byte tensor."""
    n_full = t.numel() // chunk_size
    return t[: n_full * chunk_size].view(n_full, chunk_size), t[n_full * chunk_size:]


@register
class ZstdCodec(Codec):
    name = "zstd"
    cpu_capable = True
    gpu_capable = True

    def __init__(self, spec, settings):
        super().__init__(spec, settings)
        self.elem = int(spec.params.get("shuffle", 1))
        self._local = threading.local()

    @classmethod
    def spec_for(cls, dtype: torch.dtype) -> CodecSpec:
        return CodecSpec.of("zstd", shuffle=dtype.itemsize)  # (no tensor made: this runs per tensor planned)

    # --- CPU: zstandard; compressor objects are per thread (they are not thread-safe) ----
    def _cctx(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(level=self.settings.level, write_content_size=True)
        return c

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def encode_chunk(self, raw: memoryview) -> bytes:
        if len(raw) % self.elem:
            raise ValueError(f"chunk of {len(raw)} bytes is not a whole number of {self.elem}-byte elements")
        return self._cctx().compress(shuffle_np(raw, self.elem))

    def decode_chunk(self, stored: memoryview, raw_size: int, out: memoryview) -> None:
        plain = self._dctx().decompress(stored, max_output_size=raw_size)
        if len(plain) != raw_size:
            raise ValueError(f"zstd frame decoded to {len(plain)} bytes, expected {raw_size}")
        unshuffle_np(memoryview(plain), self.elem, np.frombuffer(out, dtype=np.uint8)[:raw_size])

    # --- GPU: shuffle fused into the pack copy, nvCOMP Zstd RAW frames -------------------
    def pack(self, dst: torch.Tensor, src: torch.Tensor, chunk_size: int) -> None:
        if self.elem == 1:
            dst.copy_(src)
            return
        k = self.elem
        (sf, st), (df, dt) = _chunks_2d(src, chunk_size), _chunks_2d(dst, chunk_size)
        if sf.numel():
            df.view(-1, k, chunk_size // k).copy_(sf.view(-1, chunk_size // k, k).transpose(1, 2))
        if st.numel():
            dt.view(k, -1).copy_(st.view(-1, k).t())

    def unpack(self, dst: torch.Tensor, src: torch.Tensor, chunk_size: int) -> None:
        if self.elem == 1:
            dst.copy_(src)
            return
        k = self.elem
        (sf, st), (df, dt) = _chunks_2d(src, chunk_size), _chunks_2d(dst, chunk_size)
        if sf.numel():
            df.view(-1, chunk_size // k, k).copy_(sf.view(-1, k, chunk_size // k).transpose(1, 2))
        if st.numel():
            dt.view(-1, k).copy_(st.view(k, -1).t())

    def max_stored_size(self, chunk_size: int) -> int:
        return _nvcomp.max_compressed("Zstd", chunk_size)

    def encode_batch(self, stream, chunk_size, src, offsets, sizes, slab, row_offsets, row_capacity):
        return _nvcomp.encode("Zstd", None, stream, chunk_size, src, offsets, sizes, slab, row_offsets, row_capacity)

    def decode_batch(self, stream, chunk_size, slab, row_offsets, stored_sizes, dst, offsets, raw_sizes):
        _nvcomp.decode("Zstd", None, stream, chunk_size, slab, row_offsets, stored_sizes, dst, offsets, raw_sizes)
