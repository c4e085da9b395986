"""Background threads that may call CUDA keep the GPU of the thread that started them.

CUDA's current device belongs to a thread, and a new thread's is GPU 0, whatever the thread that
started it chose with `torch.cuda.set_device`. Its first CUDA call outside a device scope (an
event's synchronize, a host-memory registration, a library that asks for the current device)
then opens a context on GPU 0. Under torchrun on a node of several GPUs, every rank but the
first so took about 0.5 GB of rank 0's GPU, which training had nearly filled (a
restore at 2 ranks ran out of memory beside a 522 MiB context of the other rank). Every thread
and thread pool of the engine that may touch CUDA is made here.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch


def current_gpu() -> int | None:
    """The calling thread's CUDA device, or None where this process uses no CUDA (yet)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def on_gpu(index: int | None, then: Callable[[], Any] | None = None) -> Callable[[], None]:
    """A thread's first call: make GPU `index` current (nothing for None), then `then()`."""

    def init() -> None:
        if index is not None:
            torch.cuda.set_device(index)
        if then is not None:
            then()

    return init


def start(target: Callable[..., Any], *args: Any, name: str, gpu: int | None = None) -> threading.Thread:
    """A started daemon thread running `target(*args)` on GPU `gpu`, or (None) the calling
    thread's GPU."""
    init = on_gpu(current_gpu() if gpu is None else gpu)

    def run() -> None:
        init()
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def pool(workers: int | None, prefix: str, initializer: Callable[[], Any] | None = None,
         gpu: int | None = None) -> ThreadPoolExecutor:
    """A thread pool whose threads run on GPU `gpu`, or (None) the calling thread's GPU (then
    call `initializer`)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix,
                              initializer=on_gpu(current_gpu() if gpu is None else gpu, initializer))


def lower_priority(niceness: int = 10, *, to: int | None = None) -> None:
    """Make the calling thread yield the CPU to the process's other threads (Linux: its own nice
    value, raised by `niceness`, or set `to` a value; elsewhere, or where the OS refuses, nothing).
    For CPU-heavy engine work beside training."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, to if to is not None else
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except (AttributeError, OSError):
        pass
