"""Thin, lazily imported binding to nvCOMP's Python API for batched chunk codecs.

Chunks are carved out of one contiguous buffer with ``nvcomp.as_arrays(buffer, offsets, sizes)``
and compressed by one ``Codec.encode`` call per batch: per-tensor calls cost ~10x more (design
brief). Output goes straight into caller-owned slab rows (``out=``), so nothing is allocated per
save. All calls are asynchronous on the caller's stream; ``sizes()`` waits.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from tiered.errors import CodecUnavailableError

_lock = threading.Lock()
_codecs: dict[tuple[Any, ...], Any] = {}


def nvcomp() -> Any:
    try:
        from nvidia import nvcomp as mod
    except ImportError as exc:
        raise CodecUnavailableError(
            "nvCOMP's Python package is not installed: pip install 'tiered[cu13]' (CUDA 13) or "
            f"'tiered[cu12]' (CUDA 12) ({exc})") from None
    return mod


def codec(algorithm: str, stream: torch.cuda.Stream, chunk_size: int, data_type: str | None = None) -> Any:
    key = (algorithm, data_type, stream.cuda_stream, chunk_size)
    with _lock:
        c = _codecs.get(key)
        if c is None:
            mod = nvcomp()
            kw: dict[str, Any] = {}
            if data_type is not None:
                kw["data_type"] = data_type
            c = _codecs[key] = mod.Codec(algorithm=algorithm, device_id=stream.device.index,
                                         cuda_stream=stream.cuda_stream, uncomp_chunk_size=chunk_size,
                                         bitstream_kind=mod.BitstreamKind.RAW, **kw)
        return c


_bounds: dict[tuple[Any, ...], int] = {}


def max_compressed(algorithm: str, chunk_size: int, data_type: str | None = None) -> int:
    """nvCOMP's bound on one compressed chunk (it is computed from an array of that size)."""
    key = (algorithm, chunk_size, data_type)
    if key not in _bounds:
        stream = torch.cuda.current_stream()
        probe = torch.empty(chunk_size, dtype=torch.uint8, device=stream.device)
        c = codec(algorithm, stream, chunk_size, data_type)
        _bounds[key] = int(c.get_max_comp_buffer_size(nvcomp().as_array(probe, cuda_stream=stream.cuda_stream)))
    return _bounds[key]


class _Pending:
    def __init__(self, batch: Any, keep: tuple[Any, ...]):
        self._batch, self._keep = batch, keep

    def sizes(self) -> list[int]:
        return [int(s) for s in self._batch.buffer_sizes]


def encode(algorithm: str, data_type: str | None, stream: torch.cuda.Stream, chunk_size: int, src: torch.Tensor,
           offsets: Sequence[int], sizes: Sequence[int], slab: torch.Tensor, row_offsets: Sequence[int],
           row_capacity: int) -> _Pending:
    mod = nvcomp()
    c = codec(algorithm, stream, chunk_size, data_type)
    s = stream.cuda_stream
    inp = mod.as_arrays(src, list(offsets), list(sizes), cuda_stream=s)
    out = mod.as_arrays(slab, list(row_offsets), [row_capacity] * len(row_offsets), cuda_stream=s)
    result = c.encode(inp, out=out)
    return _Pending(result, (inp, out, src, slab))


def decode(algorithm: str, data_type: str | None, stream: torch.cuda.Stream, chunk_size: int, slab: torch.Tensor,
           row_offsets: Sequence[int], stored_sizes: Sequence[int], dst: torch.Tensor, offsets: Sequence[int],
           raw_sizes: Sequence[int]) -> None:
    mod = nvcomp()
    c = codec(algorithm, stream, chunk_size, data_type)
    s = stream.cuda_stream
    inp = mod.as_arrays(slab, list(row_offsets), list(stored_sizes), cuda_stream=s)
    out = mod.as_arrays(dst, list(offsets), list(raw_sizes), cuda_stream=s)
    result = c.decode(inp, out=out)
    got = [int(x) for x in result.buffer_sizes]
    if got != [int(x) for x in raw_sizes]:
        bad = next(i for i, (a, b) in enumerate(zip(got, raw_sizes)) if a != b)
        raise ValueError(f"nvCOMP {algorithm} decoded {got[bad]} bytes for batch entry {bad}, expected {raw_sizes[bad]}")
