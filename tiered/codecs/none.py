"""`none`: chunks stored as they are. For data that does not compress, and as a baseline."""

from __future__ import annotations

from typing import Sequence

import torch

from tiered.codecs.base import Codec, register
from tiered.format.manifest import CodecSpec


@register
class NoneCodec(Codec):
    name = "none"
    cpu_capable = True
    gpu_capable = True
    stores_raw = True

    @classmethod
    def spec_for(cls, dtype: torch.dtype) -> CodecSpec:
        return CodecSpec.of("none")

    def encode_chunk(self, raw: memoryview) -> bytes:
        return bytes(raw)

    def decode_chunk(self, stored: memoryview, raw_size: int, out: memoryview) -> None:
        if len(stored) != raw_size:
            raise ValueError(f"stored chunk has {len(stored)} bytes, expected {raw_size}")
        out[:raw_size] = stored

    def max_stored_size(self, chunk_size: int) -> int:
        return chunk_size

    def encode_batch(self, stream, chunk_size, src, offsets, sizes, slab, row_offsets, row_capacity):
        with torch.cuda.stream(stream):
            for off, n, row in zip(offsets, sizes, row_offsets):
                slab[row:row + n].copy_(src[off:off + n])
        return _Known(list(sizes))

    def decode_batch(self, stream, chunk_size, slab, row_offsets, stored_sizes, dst, offsets, raw_sizes):
        with torch.cuda.stream(stream):
            for row, n, off, raw in zip(row_offsets, stored_sizes, offsets, raw_sizes):
                if n != raw:
                    raise ValueError(f"stored chunk has {n} bytes, expected {raw}")
                dst[off:off + n].copy_(slab[row:row + n])


class _Known:
    def __init__(self, sizes: Sequence[int]):
        self._sizes = list(sizes)

    def sizes(self) -> list[int]:
        return self._sizes
