"""What one engine computes with, shared by its save and restore pipelines: the codec thread pool,
the pinned host staging pool, and one `GpuDevice` (streams, slab, pack buffer) per GPU, each
created on first use and reused. `import tiered` needs no CUDA: `tiered.gpu.device` is imported only
when a GPU device is first asked for.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any, Callable

import torch

from tiered import threads
from tiered.config import Config
from tiered.stage.budgets import auto_host_buffer, host_available, local_ranks
from tiered.stage.pools import PIN_BLOCK, HostPool
from tiered.units import format_size

log = logging.getLogger("tiered")

CHECKSUM_THREADS = 2
"""Threads of `Workers.checksums`: at ~2-3 GB/s each, ahead of a disk's writes per GPU."""


def gpu_stack_available() -> bool:
    """CUDA, nvCOMP and KvikIO are all present: GPU tensors can be compressed on the GPU."""
    if not torch.cuda.is_available():
        return False
    try:
        import kvikio  # noqa: F401
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


class Workers:
    """The codec pool, the host staging pool and the GPU devices of one engine."""

    def __init__(self, config: Config):
        self.config = config
        self.gpu_ready = gpu_stack_available()
        """GPU tensors are compressed on the GPU and written through KvikIO."""
        if torch.cuda.is_available() and not self.gpu_ready:
            log.warning("tiered: CUDA is available but nvCOMP or KvikIO is not installed: GPU tensors are copied "
                        "to host memory and compressed with zstd on the CPU. Install tiered[cu13] or tiered[cu12].")
        workers = config.zstd.threads or os.cpu_count() or 1
        self.pool = threads.pool(workers, "tiered-codec")
        """CPU codec work (zstd encode and decode release the GIL)."""
        self.checksums = threads.pool(CHECKSUM_THREADS, "tiered-checksum", initializer=threads.lower_priority)
        """Checksums of GPU tensors copied to the host as they are (tiered.stage.host_copy): few threads,
        at a lower priority, so that they never take the CPU from the training loop (the
        codec pool's 16 threads summing beside training slowed the step after each save by 0.7-1.4 s)."""
        self.host = host_pool(config.budgets.host_buffer)
        """Host staging memory: pinned in the background, as saves need it, where CUDA exists."""
        self._devices: dict[int, Any] = {}
        self._lock = threading.Lock()
        if self.gpu_ready:
            # The GPUs this process already holds memory on are readied now, so that their save
            # kernels load (or compile) on a thread of their own beside the first steps, not inside
            # the first save, which waited 0.46-1.43 s for them (docs/architecture.md, "Why an
            # engine readies its GPU when it is made"). No other GPU is touched: a context made
            # before the process has chosen its GPU would land on the wrong one under torchrun.
            for index in range(torch.cuda.device_count()):
                if torch.cuda.memory_allocated(index):
                    self.device(index)

    def device(self, index: int) -> Any:
        """The `tiered.gpu.device.GpuDevice` of GPU `index`, created on first use."""
        with self._lock:
            dev = self._devices.get(index)
            if dev is None:
                from tiered.gpu.device import GpuDevice

                dev = self._devices[index] = GpuDevice(index, self.config.chunk_size, self.config.budgets,
                                                      self.config.zstd, self.host)
        return dev

    def devices(self) -> list[int]:
        """The GPUs readied so far (each with its `GpuDevice`), in order."""
        with self._lock:
            return sorted(self._devices)

    def prepare(self, tensors: Any) -> None:
        """Set up now, not in the first save, the GPU devices that `tensors` live on."""
        if self.gpu_ready:
            for index in sorted({t.device.index for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}):
                self.device(index)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until every GPU device made so far has compiled its save kernels; True once all have."""
        with self._lock:
            devices = list(self._devices.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        return all([d.wait_warm(None if deadline is None else max(0.0, deadline - time.monotonic()))
                    for d in devices])

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait, at most `timeout` seconds in all, until the host staging memory wanted so far is
        pinned and every GPU device made so far has compiled its save kernels; True once both are."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pinned = self.host.wait_pinned(timeout)
        return self.wait_warm(None if deadline is None else max(0.0, deadline - time.monotonic())) and pinned

    def close(self) -> None:
        """Stop the codec pool and let the GPU and host staging memory go (nothing may be staged)."""
        self.pool.shutdown()
        self.checksums.shutdown()
        self._devices.clear()
        self.host.close()


def host_pool(host_buffer: int | None) -> HostPool:
    """The engine's host staging pool: at most `host_buffer` bytes, or ``auto`` (tiered.stage.budgets),
    logged; where CUDA is in use, pinned on a background thread as saves need it."""
    cuda = torch.cuda.is_available()
    if host_buffer is None:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else None
        choice = auto_host_buffer(host_available(), local_ranks(), total, PIN_BLOCK)
        host_buffer = choice.nbytes
        log.info("tiered: budgets.host_buffer auto: %s (%s)%s; set budgets.host_buffer to change it",
                 format_size(host_buffer), choice.why, ", pinned in the background as saves need it" if cuda else "")
    if not cuda:
        return HostPool(host_buffer)
    pin, unpin = host_registration()
    return HostPool(host_buffer, pin=pin, unpin=unpin)


def host_registration() -> tuple[Callable[[int, int], bool], Callable[[int], None]]:
    """(pin(address, nbytes) -> ok, unpin(address)) for host staging memory, portable (pinned for
    every GPU of this process, not only the pinning thread's; the pinner runs on the engine's GPU:
    tiered.threads). Through the driver (`cuMemHostRegister` by ctypes, which lets the GIL go while
    the driver works): torch's `cudart().cudaHostRegister` holds the GIL for the whole call, and
    on an H200 host a training thread launching beside the pinner stood still up to 1.4 s
    (docs/architecture.md, "Why the pinner touches pages first"). Where the driver library
    or the calling thread's context is missing, torch's binding does it."""
    cudart = torch.cuda.cudart()

    def by_torch(addr: int, n: int) -> bool:
        return int(cudart.cudaHostRegister(addr, n, 1)) == 0

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        register, unregister = lib.cuMemHostRegister_v2, lib.cuMemHostUnregister
    except (OSError, AttributeError):
        return by_torch, lambda addr: cudart.cudaHostUnregister(addr)
    register.argtypes, register.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint], ctypes.c_int
    unregister.argtypes, unregister.restype = [ctypes.c_void_p], ctypes.c_int
    by_driver: set[int] = set()

    def pin(addr: int, n: int) -> bool:
        rc = register(addr, n, 1)  # CU_MEMHOSTREGISTER_PORTABLE
        if rc in _NO_CONTEXT:  # (a thread no runtime call has bound to a GPU yet)
            return by_torch(addr, n)
        if rc == 0:
            by_driver.add(addr)
        return rc == 0

    def unpin(addr: int) -> None:
        if addr in by_driver:
            by_driver.discard(addr)
            unregister(addr)
        else:
            cudart.cudaHostUnregister(addr)

    return pin, unpin


_NO_CONTEXT = (3, 201)
"""CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_INVALID_CONTEXT."""
