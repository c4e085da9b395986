"""`ans`: nvCOMP's GPU rANS entropy coder, typed by the tensor dtype.

`data_type` follows the dtype (``<f4`` for fp32, ``<f2`` for fp16 and bf16, ``|u1`` otherwise):
typed ANS models the sign/exponent byte separately from the near-random mantissa bytes, which
is where lossless float compression gets its ~17% (fp32) and ~35% (bf16). Bitstreams are RAW
(no nvCOMP container), one per chunk, so the index alone describes them. Decoding needs a GPU.
"""

from __future__ import annotations

import torch

from tiered.codecs import _nvcomp, _nvcomp_batched
from tiered.codecs.base import Codec, register
from tiered.format.manifest import CodecSpec

_DATA_TYPES = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<f2"}


@register
class AnsCodec(Codec):
    name = "ans"
    cpu_capable = False
    gpu_capable = True
    reads_in_place = True

    @classmethod
    def spec_for(cls, dtype: torch.dtype) -> CodecSpec:
        return CodecSpec.of("ans", data_type=_DATA_TYPES.get(dtype, "|u1"))

    def __init__(self, spec, settings):
        super().__init__(spec, settings)
        self.data_type = spec.params.get("data_type", "|u1")

    def max_stored_size(self, chunk_size: int) -> int:
        bound = _nvcomp.max_compressed("ANS", chunk_size, self.data_type)
        if _nvcomp_batched.available():  # (the row must hold what either API may write)
            bound = max(bound, _nvcomp_batched.max_output(chunk_size, self.data_type))
        return bound

    def encode_batch(self, stream, chunk_size, src, offsets, sizes, slab, row_offsets, row_capacity):
        """Through nvCOMP's C API where it loads (`tiered.codecs._nvcomp_batched`: its sizes stay
        on the GPU until read), else its Python API."""
        if _nvcomp_batched.available():
            return _nvcomp_batched.encode(self.data_type, stream, chunk_size, src, offsets, sizes, slab, row_offsets)
        return _nvcomp.encode("ANS", self.data_type, stream, chunk_size, src, offsets, sizes, slab,
                              row_offsets, row_capacity)

    def decode_batch(self, stream, chunk_size, slab, row_offsets, stored_sizes, dst, offsets, raw_sizes):
        _nvcomp.decode("ANS", self.data_type, stream, chunk_size, slab, row_offsets, stored_sizes, dst,
                       offsets, raw_sizes)
