"""Thin, lazily imported binding to nvCOMP's Python API for batched chunk codecs.

Chunks are carved out of one contiguous buffer with ``nvcomp.as_arrays(buffer, offsets, sizes)``
and compressed by one ``Codec.encode`` call per batch: per-tensor calls cost ~10x more (design
brief). Output goes straight into caller-owned slab rows (``out=``), so nothing is allocated per
save. All calls are asynchronous on the caller's stream; ``sizes()`` waits.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections import deque
from typing import Any, Callable, Sequence

import torch

from tiered.errors import CodecUnavailableError

log = logging.getLogger("tiered")

_lock = threading.Lock()
_codecs: dict[tuple[Any, ...], Any] = {}


def nvcomp() -> Any:
    try:
        from nvidia import nvcomp as mod
    except ImportError as exc:
        raise CodecUnavailableError(
            "nvCOMP's Python package is not installed: pip install 'tiered[cu13]' (CUDA 13) or "
            f"'tiered[cu12]' (CUDA 12) ({exc})") from None
    if not _pinned_set:
        with _install_lock:  # (not `_lock`: codec() holds it when it calls this)
            if not _pinned_set:
                mod.set_pinned_allocator(_PinnedBuffer)
                _pinned_set.append(True)
    return mod


_install_lock = threading.Lock()
_pinned_set: list[bool] = []
_retired: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()


class _PinnedBuffer:
    """nvCOMP's pinned host buffers (the tables of a batch's pointers and sizes), from torch's
    caching host allocator. nvCOMP's own allocator pins and unpins per call (cudaMallocHost,
    cudaFreeHost), which waits for the whole device: a save's compression issued beside training
    waited for every kernel training had queued on the default stream (300 ms
    behind a 300 ms kernel), so a guarded save's drain stood still while the forward and backward
    ran. A buffer goes back to the cache only once the work nvCOMP queued on its stream has run.
    (The allocator is nvCOMP's, process-wide: set once, when tiered first uses nvCOMP.)"""

    __slots__ = ("_tensor", "ptr", "_stream")

    def __init__(self, nbytes: int, stream: Any):
        # (`stream` is not read: for a pinned allocation it has no device, and reading it crashed.)
        _reap()
        self._tensor = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, pin_memory=True)
        self.ptr = self._tensor.data_ptr()
        # tiered calls nvCOMP only under the stream it hands it (torch.cuda.stream), so the
        # current stream now is the one whose work may read this buffer. (Not the current stream
        # where the buffer is collected: any thread may collect it, and a thread that never chose
        # a GPU would record on GPU 0, opening a context there.)
        self._stream = torch.cuda.current_stream()

    def __del__(self) -> None:
        try:
            event = torch.cuda.Event()
            event.record(self._stream)
            _retired.append((event, self._tensor))
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing runs any more
            pass


_reap_lock = threading.Lock()


def _reap() -> None:
    """Let the retired buffers whose streams have passed them go back to torch's cache."""
    with _reap_lock:
        while _retired and _retired[0][0].query():
            _retired.popleft()


def codec(algorithm: str, stream: torch.cuda.Stream, chunk_size: int, data_type: str | None = None) -> Any:
    key = (algorithm, data_type, stream.device.index, stream.cuda_stream, chunk_size)  # (a default stream is 0 on every GPU)
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
_told: list[bool] = []


def max_compressed(algorithm: str, chunk_size: int, data_type: str | None = None) -> int:
    """nvCOMP's bound on one compressed chunk (it is computed from an array of that size). Where
    the first one opens a CUDA context on GPU 0 in a process working on another GPU, as nvCOMP
    6.0 does, the log says so once."""
    key = (algorithm, chunk_size, data_type)
    if key not in _bounds:
        stream = torch.cuda.current_stream()

        def bound() -> int:
            probe = torch.empty(chunk_size, dtype=torch.uint8, device=stream.device)
            c = codec(algorithm, stream, chunk_size, data_type)
            return int(c.get_max_comp_buffer_size(nvcomp().as_array(probe, cuda_stream=stream.cuda_stream)))

        _bounds[key] = noting_gpu0(stream.device.index, bound)
    return _bounds[key]


def noting_gpu0(index: int, call: Callable[[], Any]) -> Any:
    """`call()`, made on GPU `index`; where it opened GPU 0's primary context in this process
    (and `index` is another GPU), a warning says so, once a process."""
    watch = not _told and index != 0 and primary_context_active(0) is False
    out = call()
    if watch and primary_context_active(0):
        _told.append(True)
        log.warning("tiered: nvCOMP %s opened a CUDA context on GPU 0 in this process, which works on cuda:%d: "
                    "that context's memory is taken from GPU 0's own rank. Start each rank with "
                    "CUDA_VISIBLE_DEVICES set to its own GPU to avoid it (the engine's migrator process is "
                    "started that way)", getattr(sys.modules.get("nvidia.nvcomp"), "__version__", "?"), index)
    return out


def primary_context_active(index: int) -> bool | None:
    """Whether this process holds GPU `index`'s primary context (None: the driver cannot say)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    flags, active = ctypes.c_uint(), ctypes.c_int()
    if lib.cuDevicePrimaryCtxGetState(index, ctypes.byref(flags), ctypes.byref(active)) != 0:
        return None
    return bool(active.value)


def _wait(stream: torch.cuda.Stream) -> None:
    """Wait for `stream`'s work so far through torch, which lets the GIL go. nvCOMP's own wait
    (reading a batch's sizes) holds it: every Python thread, training's included, would stand
    still until the batch is done."""
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()


class _Pending:
    def __init__(self, batch: Any, keep: tuple[Any, ...], stream: torch.cuda.Stream):
        self._batch, self._keep = batch, keep
        self._done = torch.cuda.Event()
        self._done.record(stream)

    def sizes(self) -> list[int]:
        self._done.synchronize()  # (`_wait`)
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
    return _Pending(result, (inp, out, src, slab), stream)


def decode(algorithm: str, data_type: str | None, stream: torch.cuda.Stream, chunk_size: int, slab: torch.Tensor,
           row_offsets: Sequence[int], stored_sizes: Sequence[int], dst: torch.Tensor, offsets: Sequence[int],
           raw_sizes: Sequence[int]) -> None:
    mod = nvcomp()
    c = codec(algorithm, stream, chunk_size, data_type)
    s = stream.cuda_stream
    inp = mod.as_arrays(slab, list(row_offsets), list(stored_sizes), cuda_stream=s)
    out = mod.as_arrays(dst, list(offsets), list(raw_sizes), cuda_stream=s)
    result = c.decode(inp, out=out)
    _wait(stream)
    got = [int(x) for x in result.buffer_sizes]
    if got != [int(x) for x in raw_sizes]:
        bad = next(i for i, (a, b) in enumerate(zip(got, raw_sizes)) if a != b)
        raise ValueError(f"nvCOMP {algorithm} decoded {got[bad]} bytes for batch entry {bad}, expected {raw_sizes[bad]}")
