"""Shared POSIX filesystem tier (Lustre, GPFS, NFS; a directory in tests).

Same layout and commit protocol as the local tier (atomic rename of the manifest), but only
host buffers: data reaches a shared filesystem through host memory, never GPUDirect.
"""

from __future__ import annotations

from pathlib import Path

from tiered.errors import TieredError
from tiered.tiers.local import LocalDataReader, LocalDataWriter, LocalTier


class PosixTier(LocalTier):
    reads_into_gpu = False

    def __init__(self, name: str, root: Path, direct_io: str = "auto"):
        super().__init__(name, root, direct_io)

    def __repr__(self) -> str:
        return f"PosixTier({self.name!r}, {str(self.root)!r})"

    def open_data_writer(self, step: int, name: str, device: bool, size_hint: int | None = None) -> LocalDataWriter:
        if device:
            raise TieredError(f"tier {self.name!r} (shared filesystem) writes from host memory only")
        return super().open_data_writer(step, name, False)

    def open_data_reader(self, step: int, name: str, device: bool) -> LocalDataReader:
        if device:
            raise TieredError(f"tier {self.name!r} (shared filesystem) reads into host memory only")
        reader = super().open_data_reader(step, name, False)
        reader.parallel_reads = SHARED_PARALLEL_READS
        return reader


SHARED_PARALLEL_READS = 8
"""Windows read at once from a shared filesystem: a network filesystem's reads take round trips
(and a parallel one's spread over servers), as S3's do, so more of them overlap than on a local
disk (`LocalDataReader.parallel_reads`)."""
