"""The tier protocol: where a checkpoint's files live.

Call order for writing one step (the commit rule: the manifest is the last thing written, and a
step without one does not exist for any reader):

    tier.begin_step(step)                         # refuses a committed step; files go somewhere of this writer's own
    w = tier.open_data_writer(step, name, device, size_hint)  # per rank: chunk data, append-only, aligned extents
    w.write_host(offset, buf) / w.write_device(offset, tensor)
    w.close()                                     # waits for pending writes, fsyncs
    tier.write_file(step, index_name, bytes)      # per rank: index, durable before the manifest
    tier.commit(step, manifest_bytes)             # atomic, and never over another writer's commit
    tier.discard(step)                            # instead of commit, after a failure: this writer's files only
    tier.delete(step)                             # retention: uncommit (readers stop seeing it), then remove
    tier.reclaim_debris()                         # what writers that stopped left (gc, start-up)

One writer per step: of two processes writing one step, the second to commit fails and says so;
no reader sees a mix of their files (`tiered.tiers.local`, `tiered.tiers.s3` say how). A damaged
step is replaced only by a copy built aside: ``begin_step(step, replacing=True)`` ... ``commit(step,
manifest, replace=True)``.

Several ranks writing one step into one place (torch.distributed): each calls
``tier.begin_rank(step, rank)`` instead of begin_step and ``discard_rank`` instead of discard, so
that no rank removes another's files; one rank commits once every rank's files are durable
(``file_size`` tells which are there).

Reading: ``tier.steps()`` lists committed steps only; ``read_manifest``, ``read_file`` and
``open_data_reader`` take names validated by tiered.format.manifest (plain names inside the step).
``device_reader(tier, step, name)`` reads into GPU memory: KvikIO where the tier ``reads_into_gpu``,
else a host read and a copy (`HostStagedReader`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tiered.errors import TieredError


def committed_error(tier: str, step: int, where: str) -> TieredError:
    """Why a step cannot be (re)written: steps are immutable once committed."""
    return TieredError(f"step {step} is already committed in tier {tier!r} ({where}); "
                       "steps are immutable: save under a new step number")


class DataWriter(Protocol):
    io_mode: str

    def write_host(self, offset: int, buf: memoryview) -> None: ...

    def write_device(self, offset: int, buf: torch.Tensor) -> None: ...

    def wait(self) -> None:
        """Wait for every pending write (device writes are asynchronous)."""

    def close(self) -> int: ...

    def abort(self) -> None: ...


class DataReader(Protocol):
    """One rank's data file, read. A reader may also say how many windows a migration or a
    restore should read from it at once, `parallel_reads` (`tiered.stage.cpu.chunk_windows`; 8 where
    it does not say: S3's GETs)."""

    path: str
    io_mode: str
    size: int

    def read_host(self, offset: int, size: int) -> memoryview:
        """Bytes [offset, offset + size), in a new writable buffer."""

    def read_into(self, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset + len(out)) into the caller's buffer."""

    def prefetch(self, offset: int, out: memoryview) -> bool:
        """A hint from a caller that will read bytes [offset, offset + len(out)) soon: a tier
        whose reads are slow to start (S3) begins fetching them into `out` now, serves later reads
        of that range from it, and returns True; `out` is then the reader's until `close()`.
        Others return False and leave `out` alone."""

    def read_device_async(self, offset: int, size: int, out: torch.Tensor) -> Any:
        """Start a read into GPU memory; returns a future with done() and get()."""

    def read_device(self, offset: int, size: int, out: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class Tier(Protocol):
    name: str
    supports_rename: bool
    """Commit by atomic rename (filesystems); otherwise the manifest is the last object written."""
    reads_into_gpu: bool
    """Data can be read straight into GPU memory (KvikIO)."""

    def steps(self) -> list[int]: ...

    def has_step(self, step: int) -> bool: ...

    def begin_step(self, step: int, replacing: bool = False) -> None: ...

    def discard(self, step: int) -> None:
        """Remove an uncommitted step's files after a failed save; never touches a committed step."""

    def begin_rank(self, step: int, rank: int) -> None:
        """As begin_step for one rank of a step that several ranks (processes, nodes) write into
        one place: refuses a committed step and clears only this rank's leftovers."""

    def discard_rank(self, step: int, rank: int) -> None:
        """As discard, for one rank's files only."""

    def file_size(self, step: int, name: str) -> int | None:
        """Bytes of a file of the step, None where it is missing."""

    def delete(self, step: int) -> None:
        """Delete a committed step (retention): the manifest first, then the files."""

    def probe_bandwidth(self, nbytes: int) -> float:
        """Bytes/s of writing `nbytes` as a data file is written, to a scratch file removed after."""

    def open_data_writer(self, step: int, name: str, device: bool, size_hint: int | None = None) -> DataWriter:
        """`size_hint`: about how many bytes will be written, where the caller knows (a migration
        does); a tier may size its requests by it (S3's part size). Never a limit."""
        ...

    def write_file(self, step: int, name: str, data: bytes) -> None: ...

    def commit(self, step: int, manifest: bytes, replace: bool = False) -> None: ...

    def reclaim_debris(self, dry_run: bool = False) -> list[str]:
        """Remove what writers that stopped left; one line per removal."""

    def read_manifest(self, step: int) -> bytes: ...

    def read_file(self, step: int, name: str, max_bytes: int) -> bytes: ...

    def open_data_reader(self, step: int, name: str, device: bool) -> DataReader: ...

    def describe(self, step: int, name: str) -> str: ...


class _FinishedRead:
    """An already finished read, shaped like a KvikIO future."""

    def __init__(self, n: int):
        self._n = n

    def done(self) -> bool:
        return True

    def get(self) -> int:
        return self._n


class HostStagedReader:
    """GPU reads from a tier that reads into host memory only (shared FS, S3): ranged host read,
    then a copy into the GPU buffer."""

    def __init__(self, reader: Any):
        self._reader = reader
        self.path, self.size, self.io_mode = reader.path, reader.size, reader.io_mode + "+h2d"

    def read_device_async(self, offset: int, size: int, out: torch.Tensor) -> _FinishedRead:
        data = self._reader.read_host(offset, size)
        if size:
            out[:size].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return _FinishedRead(size)

    def read_host(self, offset: int, size: int) -> memoryview:
        return self._reader.read_host(offset, size)

    def read_into(self, offset: int, out: memoryview) -> None:
        self._reader.read_into(offset, out)

    def prefetch(self, offset: int, out: memoryview) -> bool:
        return self._reader.prefetch(offset, out)

    def close(self) -> None:
        self._reader.close()


def device_reader(tier: Any, step: int, data_file: str) -> Any:
    """A reader whose read_device_async fills GPU buffers: KvikIO where the tier supports it."""
    if tier.reads_into_gpu:
        return tier.open_data_reader(step, data_file, device=True)
    return HostStagedReader(tier.open_data_reader(step, data_file, device=False))
