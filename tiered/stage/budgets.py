"""Memory budgets: an explicit size from the config, or ``auto``, sized from what is free.

Pure decisions (numbers in, a size and the reason out) plus two small probes of the machine.
The engine logs each choice once, with the field that overrides it:

- ``host_buffer: auto`` (where CUDA is in use): at most half of the host's available memory
  shared by the ranks of this node (``LOCAL_WORLD_SIZE``), at most the GPU's memory (no per-GPU
  state is larger), at least one pinned block. Only what saves need of it is pinned, on a
  background thread (tiered.stage.pools): as a save first needs it, or at start-up through
  `Engine.reserve(state)`. Without CUDA: plain memory, used as needed, at most 8 GiB.
- ``gpu_buffer: auto``: decided at a device's first save, when training has already reserved
  what its steps need: the rows of the whole compressed state if half of the free GPU memory
  (less the engine's other buffers) holds them, otherwise what that half holds, and never less
  than two waves. A state larger than the slab is drained through pinned host memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tiered.units import format_size

HOST_FRACTION = 0.5
"""Of the host's available memory, shared by the node's ranks."""
GPU_FRACTION = 0.5
"""Of the GPU memory free at the first save: training keeps the other half for what it
allocates later (fragmentation, a longer sequence)."""
CPU_HOST_BUFFER = 8 << 30
"""`host_buffer: auto` without CUDA: plain memory, touched only as used."""


@dataclass(frozen=True)
class Choice:
    nbytes: int
    why: str


def host_available() -> int:
    """MemAvailable of this machine (bytes), or total physical memory where /proc is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_ranks() -> int:
    """Ranks of this job on this node (torchrun's LOCAL_WORLD_SIZE), at least 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def auto_host_buffer(available: int, ranks: int, gpu_total: int | None, block: int) -> Choice:
    """`host_buffer: auto`: see the module docstring. `gpu_total` None: no CUDA."""
    share = int(available * HOST_FRACTION) // max(1, ranks)
    split = f"half of {format_size(available)} available" + (f" / {ranks} local ranks" if ranks > 1 else "")
    if gpu_total is None:
        n = min(share, CPU_HOST_BUFFER)
        return Choice(max(n, block), f"{split}, at most {format_size(CPU_HOST_BUFFER)} without a GPU")
    if share >= gpu_total:
        return Choice(max(gpu_total - gpu_total % block, block), f"the GPU's {format_size(gpu_total)} ({split} is more)")
    return Choice(max(share - share % block, block), split)


def auto_gpu_buffer(need: int, free: int, others: int, minimum: int) -> Choice:
    """`gpu_buffer: auto`: slab bytes for a state whose compressed rows take `need` bytes, with
    `free` bytes of GPU memory free and `others` bytes of the engine's other GPU buffers still
    to allocate; at least `minimum` (two waves of rows)."""
    room = int(free * GPU_FRACTION) - others
    if need <= room:
        return Choice(max(need, minimum), f"the whole compressed state ({format_size(need)}) fits half of the "
                                          f"{format_size(free)} free")
    if room >= minimum:
        return Choice(room, f"half of the {format_size(free)} free, less {format_size(others)} of other buffers; "
                            f"the state's {format_size(need)} drains through pinned host memory")
    return Choice(minimum, f"only {format_size(free)} free: the minimum of two waves; the state's "
                           f"{format_size(need)} drains through pinned host memory")
