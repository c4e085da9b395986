"""Memory tier: host RAM on the node that outlives the training process, a tmpfs (default
/dev/shm/tiered). It is a local tier in every other way (the same layout, commit and readers;
GPU buffers through KvikIO), bounded by retention and by a size budget: a save that would not
fit first deletes the oldest steps a slower tier holds committed (`retention.make_room`), and
fails, or goes to the next tier (`on_fast_tier_error: next_tier`), where none can go. A path
that is not memory-backed is refused unless `memory_only: false` says otherwise: a "memory"
tier on a disk would be neither as fast nor as volatile as its name says.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tiered.errors import ConfigError
from tiered.tiers.local import LocalTier

log = logging.getLogger("tiered")
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")
REPLICAS_DIR = ".replicas"
"""Under a memory tier's root: the replicas it keeps of ranks on other nodes."""


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

    # --- replicas of other nodes' ranks (tiered.distributed.replicas) ----------------------------
    def replica_tier(self, source: int) -> LocalTier:
        """The tier under this one holding rank `source`'s replicas, one committed step each:
        ``<root>/.replicas/rank_00002/step_.../``. Its bytes count in this tier's size budget."""
        return LocalTier(f"{self.name}-replicas-of-rank-{source}", self.root / REPLICAS_DIR / f"rank_{source:05d}",
                         direct_io="off")

    def replica_sources(self) -> list[int]:
        """The ranks whose replicas this tier holds a directory for."""
        try:
            names = sorted(e.name for e in os.scandir(self.root / REPLICAS_DIR) if e.is_dir(follow_symlinks=False))
        except OSError:
            return []
        return [int(n[5:]) for n in names if n.startswith("rank_") and n[5:].isdigit()]

    def reclaim_debris(self, dry_run: bool = False) -> list[str]:
        """`LocalTier.reclaim_debris` here and in each replica tier (a replica half received)."""
        done = super().reclaim_debris(dry_run)
        for source in self.replica_sources():
            done += self.replica_tier(source).reclaim_debris(dry_run)
        return done

    def shed_replicas(self, need: int) -> int:
        """Delete the oldest replicas held here (never a source's newest) until `need` bytes are
        freed or none is left to go; returns the bytes freed."""
        tiers = [self.replica_tier(s) for s in self.replica_sources()]
        freed = 0
        for step, i in sorted((step, i) for i, t in enumerate(tiers) for step in t.steps()[:-1]):
            if freed >= need:
                break
            size = _allocated(tiers[i].step_dir(step))
            tiers[i].delete(step)
            freed += size
            log.info("tiered: deleted rank %s's replica of step %d from tier %r to make room", tiers[i].root.name[5:],
                     step, self.name)
        return freed


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
