"""Memory tier: host RAM on the node that outlives the training process, a tmpfs (default
/dev/shm/tiered). It is a local tier in every other way (the same layout, commit and readers;
GPU buffers through KvikIO), bounded by retention and by a size budget: a save that would not
fit first deletes the oldest steps a slower tier holds committed (`retention.make_room`), and
fails, or goes to the next tier (`on_fast_tier_error: next_tier`), where none can go. A path
that is not memory-backed is refused unless `memory_only: false` says otherwise: a "memory"
tier on a disk would be neither as fast nor as volatile as its name says.
"""

from __future__ import annotations

import os
from pathlib import Path

from tiered.errors import ConfigError
from tiered.tiers.local import LocalTier

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


def filesystem_of(path: Path) -> tuple[str, int]:
    """(filesystem type, size in bytes: 0 where it has none) of the mount `path` is or would be
    on (its nearest existing ancestor), from /proc/self/mountinfo; ("", 0) where unknown."""
    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    real = os.path.realpath(here)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                point = fields[4].replace("\\040", " ") if len(fields) > 4 else ""
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best) and right:
                    best, fstype = point, right.split()[0]
    except OSError:
        return "", 0
    st = os.statvfs(real)
    return fstype, st.f_blocks * st.f_frsize


class MemoryTier(LocalTier):
    def __init__(self, name: str, root: Path, direct_io: str = "auto", size: int | None = None,
                 memory_only: bool = True):
        super().__init__(name, root, direct_io)
        fstype, total = filesystem_of(self.root)
        if memory_only and fstype not in MEMORY_FILESYSTEMS:
            raise ConfigError(f"tier {name!r}: {self.root} is on {fstype or 'a filesystem that cannot be told'}, not "
                              f"host memory ({', '.join(MEMORY_FILESYSTEMS[:2])}): mount a tmpfs there (or use the "
                              "default /dev/shm/tiered), or set memory_only: false to keep it there anyway")
        if size is None and not total:
            raise ConfigError(f"tier {name!r}: {self.root} is on {fstype}, which has no size of its own: give the "
                              "tier a size")
        self.size = size if size is not None else total // 2
        """Bytes of steps the tier may hold."""
        self.filesystem = fstype

    def __repr__(self) -> str:
        return f"MemoryTier({self.name!r}, {str(self.root)!r}, size={self.size})"

    def used_bytes(self) -> int:
        """Bytes the tier's files take now (committed steps, steps being written, debris)."""
        return _allocated(self.root)

    def step_bytes(self, step: int) -> int:
        return _allocated(self.step_dir(step))


def _allocated(path: Path) -> int:
    total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                total += _allocated(Path(e.path))
            else:
                total += e.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            continue
    return total
