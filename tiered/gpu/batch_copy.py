"""Many copies in one call to the CUDA driver: `cuMemcpyBatchAsync` (CUDA 12.8 and later).

A drain copies a wave's compressed rows, each from its own row of the slab, end to end into
pinned host pages. One `copy_()` per row costs ~6 us of the host a row (torch's dispatch, then a
driver call), hundreds of rows a wave; one call here issues a wave's runs of rows at once, from
the rows where they lie, so no kernel has to pack them into a staging buffer first and no copy
waits for one (`tiered.gpu.drain.Drainer`).

The driver is reached through ctypes (`libcuda.so.1`, which every CUDA process has loaded): the
call lets the GIL go while the driver queues the copies. CUDA 13 names the call
`cuMemcpyBatchAsync_v2`; 12.8-12.9's `cuMemcpyBatchAsync` takes one more argument (the index of
a failed copy). Where neither is found, `available()` is False and the caller packs rows as before.
Imported only when CUDA is in use.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Sequence

import numpy as np
import torch

log = logging.getLogger("tiered")

_SRC_ACCESS_ORDER_STREAM = 0x1
"""CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the sources are read in stream order (after what the
stream waits for), as any copy on a stream."""

_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1
"""CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE: copy engines, not the SMs, which training uses."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


_state: dict = {"loaded": False, "call": None, "fail_index": False, "why": "not looked up yet"}
_lock = threading.Lock()


def _load() -> None:
    with _lock:
        if _state["loaded"]:
            return
        _state["loaded"] = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            _state["why"] = f"libcuda.so.1 not loadable ({exc})"
            return
        for name, fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            fn = getattr(lib, name, None)
            if fn is None:
                continue
            size_p = ctypes.POINTER(ctypes.c_size_t)
            args = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), size_p, ctypes.c_size_t,
                    ctypes.POINTER(_Attributes), size_p, ctypes.c_size_t]
            fn.argtypes = args + ([size_p] if fail_index else []) + [ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _state.update(call=fn, fail_index=fail_index, why="")
            return
        _state["why"] = "the CUDA driver has no cuMemcpyBatchAsync (it came with CUDA 12.8)"


def available() -> bool:
    """The driver here copies in batches."""
    _load()
    return _state["call"] is not None


def why_not() -> str:
    """Why `available()` is False ("" where it is True)."""
    _load()
    return _state["why"]


def copy_batch(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: torch.cuda.Stream) -> None:
    """Queue on `stream` a copy of `sizes[i]` bytes from address `srcs[i]` to `dsts[i]` for each i
    (device or pinned host addresses, as `data_ptr()` gives them), in stream order: after what
    `stream` waits for, before what is queued after. The copies of one call may run in any order
    among themselves, so none may overlap another's destination. Raises RuntimeError where the
    driver refuses the batch (the CUDA error code in the message)."""
    dst, src, size = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
    n = len(size)
    if not (len(dst) == len(src) == n):
        raise ValueError(f"copy_batch: {len(dst)} destinations, {len(src)} sources and {n} sizes")
    if n == 0:
        return
    if not available():
        raise RuntimeError(f"batched copies are not available here: {why_not()}")
    u64 = ctypes.POINTER(ctypes.c_uint64)
    attrs = _Attributes(_SRC_ACCESS_ORDER_STREAM, _Location(0, 0), _Location(0, 0), _FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    first = ctypes.c_size_t(0)
    args = [dst.ctypes.data_as(u64), src.ctypes.data_as(u64), size.ctypes.data_as(ctypes.POINTER(ctypes.c_size_t)), n,
            ctypes.byref(attrs), ctypes.byref(first), 1]
    if _state["fail_index"]:
        args.append(ctypes.byref(ctypes.c_size_t(0)))
    rc = _state["call"](*args, ctypes.c_void_p(stream.cuda_stream))
    if rc != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync of {n} copies ({int(size.sum())} bytes) failed with CUDA error {rc}")


def warm_up(device: int) -> None:
    """Copy a few rows from `device` into pinned memory in one batch, now, and check them; where
    that fails, `available()` turns False (logged once) and drains pack rows first instead."""
    if not available():
        log.info("tiered: cuda:%d: drains pack rows before copying them: %s", device, why_not())
        return
    try:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                src = torch.arange(3 * 4096, dtype=torch.int32, device=f"cuda:{device}").view(torch.uint8).view(3, -1)
                out = torch.zeros(3 * 1000, dtype=torch.uint8, pin_memory=True)
                copy_batch([out.data_ptr() + 1000 * r for r in range(3)], [src[r].data_ptr() for r in range(3)],
                           [1000] * 3, stream)
                stream.synchronize()
            if not torch.equal(out.view(3, 1000), src[:, :1000].cpu()):
                raise RuntimeError("the rows copied differ from the rows")
    except Exception as exc:  # noqa: BLE001 - the packed drain serves
        with _lock:
            _state.update(call=None, why=f"a batched copy failed here ({exc})")
        log.warning("tiered: cuda:%d: batched copies do not work here (%s); drains pack rows before copying them, "
                    "which is slower beside training", device, exc)
