"""nvCOMP's low-level batched ANS compression, through its C API (ctypes), for a save's waves.

nvCOMP's Python API (`tiered.codecs._nvcomp`) builds an object per chunk for every batch
(`as_arrays`) and reads a batch's compressed sizes with a wait that holds the GIL, through a
device-to-host copy that the copy engine runs only after every copy to the host queued before it:
while a save drains a state larger than its GPU slab, the next wave's sizes arrived only once the
copy engine had gone idle, and the drain stood still while the writer read them and issued the
next wave (about 1 ms a wave, 0.1 s of a 24 GB save). The C API takes a batch as device arrays of
pointers and sizes, filled here from one pinned table, and writes the compressed sizes and
statuses into device arrays that tiered owns (`DeviceSizes`): a save hands them to the host
with a kernel, not the copy engine (`tiered.gpu.pack.deliver`), while the drain's copies run.
ctypes lets the GIL go for each call.

The bitstreams are nvCOMP's RAW ANS streams, as the Python API writes them with the same data
type; decoding stays with the Python API. Where the library or its symbols are missing (another
nvCOMP major version), `available()` is False and the Python API encodes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from typing import Any, Sequence

import numpy as np
import torch

from tiered.codecs.base import checked_sizes

log = logging.getLogger("tiered")

_DATA_TYPES = {"|u1": 1, "|i1": 0, "<f2": 10, "<f4": 11}
"""`tiered.codecs.ans` data types (the Python API's array-protocol strings) as nvcompType_t:
NVCOMP_TYPE_UCHAR, NVCOMP_TYPE_CHAR, NVCOMP_TYPE_FLOAT16, NVCOMP_TYPE_FLOAT32 (nvcomp/shared_types.h)."""


class _Opts(ctypes.Structure):
    """nvcompBatchedANSCompressOpts_t (nvcomp/ans.h, nvCOMP 6): 64 bytes, passed by value."""

    _fields_ = [("type", ctypes.c_int), ("data_type", ctypes.c_int), ("max_sub_chunk_count", ctypes.c_uint8),
                ("states_per_lane", ctypes.c_uint8), ("histogram_reduction_log2", ctypes.c_uint8),
                ("reserved", ctypes.c_char * 53)]


_P, _N = ctypes.c_void_p, ctypes.c_size_t


class _Library:
    def __init__(self, lib: ctypes.CDLL):
        self.temp_size = lib.nvcompBatchedANSCompressGetTempSize
        self.temp_size.argtypes = [_N, _N, _Opts, ctypes.POINTER(_N), _N, _P]
        self.max_output = lib.nvcompBatchedANSCompressGetMaxOutputChunkSize
        self.max_output.argtypes = [_N, _Opts, ctypes.POINTER(_N)]
        self.compress = lib.nvcompBatchedANSCompressAsync
        self.compress.argtypes = [_P, _P, _N, _N, _P, _N, _P, _P, _Opts, _P, _P]
        for fn in (self.temp_size, self.max_output, self.compress):
            fn.restype = ctypes.c_int


_lock = threading.Lock()
_loaded: list[_Library | None] = []
_temps: dict[tuple[int, int, str, int], torch.Tensor] = {}
_temp_bytes: dict[tuple[str, int, int], int] = {}
"""Scratch bytes nvCOMP asks for a batch of (data type, chunk size, chunks)."""


def _find() -> ctypes.CDLL:
    """libnvcomp.so.6: the one nvCOMP's Python package loaded, or the wheel's copy beside it."""
    try:
        return ctypes.CDLL("libnvcomp.so.6")
    except OSError:
        import nvidia  # (the namespace package of NVIDIA's wheels)
        for root in getattr(nvidia, "__path__", []):
            path = os.path.join(root, "libnvcomp", "lib64", "libnvcomp.so.6")
            if os.path.exists(path):
                return ctypes.CDLL(path)
        raise


def library() -> _Library | None:
    """The C API's batched ANS functions, or None where they cannot be loaded (logged once)."""
    with _lock:
        if not _loaded:
            try:
                _loaded.append(_Library(_find()))
            except (OSError, AttributeError, ImportError) as exc:
                log.info("tiered: nvCOMP's C API is not usable here (%s): ANS batches go through its Python API", exc)
                _loaded.append(None)
        return _loaded[0]


def available() -> bool:
    return os.environ.get("TIERED_NVCOMP_PYTHON_ENCODE") != "1" and library() is not None


@functools.lru_cache(maxsize=None)
def _opts(data_type: str) -> _Opts:
    """The options of `data_type`'s batches (made once: a save passes them twice a wave)."""
    if data_type not in _DATA_TYPES:
        raise ValueError(f"ANS data type {data_type!r}: expected one of {', '.join(_DATA_TYPES)}")
    return _Opts(type=0, data_type=_DATA_TYPES[data_type])


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"nvCOMP {what} returned status {status} (nvcompStatus_t)")


@functools.lru_cache(maxsize=None)
def max_output(chunk_size: int, data_type: str) -> int:
    """The C API's bound on one compressed chunk (asked once: every save sizes its slab rows by it)."""
    out = _N()
    _check(library().max_output(chunk_size, _opts(data_type), ctypes.byref(out)),
           "nvcompBatchedANSCompressGetMaxOutputChunkSize")
    return int(out.value)


def _temp(lib: _Library, stream: torch.cuda.Stream, chunk_size: int, n: int, data_type: str) -> torch.Tensor:
    """The scratch memory of a batch of `n` chunks on `stream` (kept per stream, grown as needed;
    allocated on `stream`, the current one). Its size is asked of nvCOMP once per batch shape, not
    once a wave."""
    key = (stream.device.index, stream.cuda_stream, data_type, chunk_size)
    temp = _temps.get(key)
    need = _temp_bytes.get((data_type, chunk_size, n))
    if need is None:
        asked = _N()
        _check(lib.temp_size(n, chunk_size, _opts(data_type), ctypes.byref(asked), n * chunk_size,
                             stream.cuda_stream), "nvcompBatchedANSCompressGetTempSize")
        need = _temp_bytes[(data_type, chunk_size, n)] = int(asked.value)
    if temp is None or temp.numel() < need:
        temp = _temps[key] = torch.empty(max(need, 1), dtype=torch.uint8, device=stream.device)
    return temp


def _address(src: Any) -> int:
    if isinstance(src, torch.Tensor):
        return src.data_ptr()
    return int(src.__cuda_array_interface__["data"][0])  # (a gpu.layout.Span)


class DeviceSizes:
    """A batch's compressed sizes (int64) and nvcompStatus_t (int32) in device memory, one per
    chunk, written once the stream reaches the batch's end; `sizes()` reads them (waiting, with
    the GIL let go). A save reads them through `tiered.gpu.pack.deliver` instead."""

    def __init__(self, device_sizes: torch.Tensor, statuses: torch.Tensor, keep: tuple[Any, ...],
                 stream: torch.cuda.Stream):
        self.device_sizes, self.statuses, self._keep, self._stream = device_sizes, statuses, keep, stream
        self._done = torch.cuda.Event()
        self._done.record(stream)

    def sizes(self) -> list[int]:
        self._done.synchronize()
        # (copied on the batch's own stream: on the caller's default stream the copy would queue
        # behind whatever training has queued there)
        with torch.cuda.device(self._stream.device), torch.cuda.stream(self._stream):
            return checked_sizes(self.device_sizes.cpu().numpy(), self.statuses.cpu().numpy())


def encode(data_type: str, stream: torch.cuda.Stream, chunk_size: int, src: Any, offsets: Sequence[int],
           sizes: Sequence[int], slab: torch.Tensor, row_offsets: Sequence[int]) -> DeviceSizes:
    """Compress chunks `src[offsets[i]:offsets[i] + sizes[i]]` into `slab[row_offsets[i]:]` (rows of
    at least `max_output` bytes) on `stream`, without waiting."""
    lib = library()
    n = len(offsets)
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        table = torch.empty((3, n), dtype=torch.int64, pin_memory=True)
        t = table.numpy()
        t[0] = np.asarray(offsets, dtype=np.int64) + _address(src)
        t[1] = sizes
        t[2] = np.asarray(row_offsets, dtype=np.int64) + slab.data_ptr()
        dev = torch.empty((4, n), dtype=torch.int64, device=stream.device)
        dev[:3].copy_(table, non_blocking=True)  # (the pinned table goes back to torch's cache once copied)
        statuses = torch.empty(n, dtype=torch.int32, device=stream.device)
        temp = _temp(lib, stream, chunk_size, n, data_type)
        _check(lib.compress(dev[0].data_ptr(), dev[1].data_ptr(), chunk_size, n, temp.data_ptr(), temp.numel(),
                            dev[2].data_ptr(), dev[3].data_ptr(), _opts(data_type), statuses.data_ptr(),
                            stream.cuda_stream), "nvcompBatchedANSCompressAsync")
        return DeviceSizes(dev[3], statuses, (src, slab, temp), stream)
