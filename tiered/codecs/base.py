"""The codec protocol. One module per codec; the registry maps names to classes.

A codec compresses one chunk at a time; each chunk is independent, so any byte range of a tensor
maps to a chunk range that decodes alone. The index stores a `CodecSpec` (name +
configuration) per tensor, which is everything needed to decode it later, whatever the defaults
are by then.

Call order, CPU (any codec with ``cpu_capable``):
    spec = Codec.spec_for(dtype, settings)        # once per tensor, at planning
    codec = get_codec(spec, settings)
    stored = codec.encode_chunk(raw_bytes)        # per chunk, thread-safe
    codec.decode_chunk(stored, raw_size, out)     # per chunk, thread-safe; fills `out`

Call order, GPU (any codec with ``gpu_capable``), all on one CUDA stream:
    codec.pack(dst, src)                          # raw tensor bytes -> pack buffer (a layout
                                                  #   transform such as a byte shuffle may happen here)
    pending = codec.encode_batch(stream, chunk_size, pack, offsets, sizes, slab, row_offsets, row_capacity)
                                                  # (``reads_in_place``: `pack` may be any buffer
                                                  #   nvCOMP takes, such as a gpu_layout.Span over
                                                  #   the tensors themselves, and nothing is packed)
    sizes = pending.sizes()                       # waits; compressed size of each chunk
    codec.decode_batch(stream, chunk_size, slab, row_offsets, stored_sizes, pack, offsets, raw_sizes)
    codec.unpack(dst, src)                        # pack buffer -> tensor bytes (inverse of pack)
    codec.max_stored_size(chunk_size)             # slab row capacity needed per chunk
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, Sequence

import torch

from tiered.config import ZstdSettings
from tiered.errors import CodecUnavailableError
from tiered.format.manifest import CODEC_PARAMETERS, CodecSpec, check_codec_spec


class PendingSizes(Protocol):
    """A batch's compressed sizes, once its encode has run. A batch whose sizes stay on the GPU
    (`tiered.codecs._nvcomp_batched.DeviceSizes`) also has `device_sizes` (int64) and `statuses`
    (int32, nvcompStatus_t) there, for a save to hand to the host itself."""

    def sizes(self) -> list[int]: ...


def checked_sizes(sizes: Any, statuses: Any) -> list[int]:
    """`sizes` (int64 array) as a list, where every chunk's nvCOMP status (int array) is success
    (0); else a RuntimeError naming the first chunk that failed."""
    bad = [i for i, s in enumerate(statuses.tolist()) if s]
    if bad:
        raise RuntimeError(f"nvCOMP compression failed for chunk {bad[0]} of the batch (status "
                           f"{int(statuses[bad[0]])}; {len(bad)} of {len(statuses)} chunks failed)")
    return [int(n) for n in sizes.tolist()]


class Codec:
    name: ClassVar[str]
    cpu_capable: ClassVar[bool]
    gpu_capable: ClassVar[bool]
    reads_in_place: ClassVar[bool] = False
    """`encode_batch` reads chunks from any buffer nvCOMP takes (its `src` need not be a tensor),
    and `pack` is a plain copy: a save encodes a contiguous tensor from its own memory."""
    stores_raw: ClassVar[bool] = False
    """A chunk's stored bytes are its raw bytes (`none`): a CPU reader that only reads them (a
    migration re-encoding them) takes them as they are, with no decode and no copy."""

    def __init__(self, spec: CodecSpec, settings: ZstdSettings):
        check_codec_spec(spec)  # the values the format allows (tiered.format.manifest.CODEC_PARAMETERS)
        self.spec = spec
        self.settings = settings

    @classmethod
    def spec_for(cls, dtype: torch.dtype) -> CodecSpec:
        raise NotImplementedError

    # --- CPU -----------------------------------------------------------------------------
    def encode_chunk(self, raw: memoryview) -> bytes:
        raise CodecUnavailableError(f"codec {self.name!r} has no CPU encoder")

    def decode_chunk(self, stored: memoryview, raw_size: int, out: memoryview) -> None:
        raise CodecUnavailableError(
            f"codec {self.name!r} needs an NVIDIA GPU with nvCOMP to decode; restore this step on a GPU "
            "machine, or from a tier that stores a CPU-decodable codec (zstd or none)")

    # --- GPU -----------------------------------------------------------------------------
    def pack(self, dst: torch.Tensor, src: torch.Tensor, chunk_size: int) -> None:
        dst.copy_(src)

    def unpack(self, dst: torch.Tensor, src: torch.Tensor, chunk_size: int) -> None:
        dst.copy_(src)

    def max_stored_size(self, chunk_size: int) -> int:
        raise NotImplementedError

    def encode_batch(self, stream: torch.cuda.Stream, chunk_size: int, src: torch.Tensor, offsets: Sequence[int],
                     sizes: Sequence[int], slab: torch.Tensor, row_offsets: Sequence[int],
                     row_capacity: int) -> PendingSizes:
        raise NotImplementedError

    def decode_batch(self, stream: torch.cuda.Stream, chunk_size: int, slab: torch.Tensor, row_offsets: Sequence[int],
                     stored_sizes: Sequence[int], dst: torch.Tensor, offsets: Sequence[int],
                     raw_sizes: Sequence[int]) -> None:
        raise NotImplementedError


_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    if cls.name not in CODEC_PARAMETERS:
        raise TypeError(f"codec {cls.name!r} is not in tiered.format.manifest.CODEC_PARAMETERS: the format could not read it")
    _REGISTRY[cls.name] = cls
    return cls


def get_codec_class(name: str) -> type[Codec]:
    return _REGISTRY[name]


def codec_names() -> list[str]:
    return sorted(_REGISTRY)


_instances: dict[tuple[CodecSpec, ZstdSettings], Codec] = {}


def get_codec(spec: CodecSpec, settings: ZstdSettings = ZstdSettings()) -> Codec:
    key = (spec, settings)
    codec = _instances.get(key)
    if codec is None:
        try:
            cls = _REGISTRY[spec.name]
        except KeyError:
            raise CodecUnavailableError(f"unknown codec {spec.name!r} (known: {', '.join(codec_names())})") from None
        codec = _instances[key] = cls(spec, settings)
    return codec


def ordered(values: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(values.items()))
