"""One rank's files of one step, sent to another rank over torch.distributed (point to point).

Both the replicas kept on other nodes (tiered.distributed.replicas) and the restore after a node
loss (tiered.distributed.peers) move a rank's committed files this way: its data file, its index,
the step's manifest and DCP metadata. The sender reads them from a tier of its own node; the
receiver writes them aside on a tier of its node, checks the index against the manifest, the DCP
metadata against the manifest's pin and every chunk of the data against the index's checksums,
and only then commits them (manifest last): a copy half received, or damaged on the way, is
never used.

On the wire, in order: a header of `HEADER` int64s (`MAGIC`, step, rank, the byte counts of the
manifest, DCP metadata, index and data file, and 1, or 0 where the sender has nothing to send),
then each of the small files, then the data file in pieces of at most `PIECE` bytes, each a
uint8 tensor (gloo sends CPU tensors). Memory on each side: two pieces.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from tiered.errors import FormatError, TieredError
from tiered.format import checksum
from tiered.format.manifest import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, Manifest, RankIndex, read_pinned
from tiered.stage.cpu import verified

log = logging.getLogger("tiered")

MAGIC = 0x7469657265640001
"""'tiered' and the version of this exchange."""
HEADER = 8
VERIFY_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
"""Threads checking a received data file's chunks (half the cores, at most 8)."""
PIECE = 32 << 20
"""Bytes of a data file sent at a time (two in flight on each side)."""


@dataclass(frozen=True)
class Received:
    """A rank's files of a step, received and committed on a tier."""

    step: int
    rank: int
    stored_bytes: int
    seconds: float
    manifest: Manifest
    checking_s: float = 0.0
    """Of `seconds`: after the last byte came, until every chunk was checked and committed."""


def send_rank(tier: Any, step: int, rank: int, dst: int, group: Any) -> int:
    """Send `rank`'s files of `step` on `tier` to rank `dst`; return the bytes sent. Where they
    cannot be read here, an empty header says so (the receiver then looks elsewhere) and the
    error is raised."""
    import torch.distributed as dist

    try:
        manifest_raw = tier.read_manifest(step)
        manifest = Manifest.from_json(manifest_raw, tier.describe(step, "MANIFEST.json"))
        entry = manifest.entry(rank)
        if entry is None:
            raise FormatError(f"{tier.describe(step, 'MANIFEST.json')}: rank {rank} stored nothing in step {step}")
        dcp_raw = read_pinned(tier, step, manifest.dcp) if manifest.dcp is not None else b""
        index_raw = tier.read_file(step, entry.index_file, MAX_INDEX_BYTES)
        if len(index_raw) != entry.index_bytes or checksum.wsum64(index_raw) != entry.index_checksum:
            raise FormatError(f"{tier.describe(step, entry.index_file)}: does not match the manifest (corrupted)")
        reader = tier.open_data_reader(step, entry.data_file, device=False)
    except BaseException:
        dist.send(_header(step, rank, 0, 0, 0, 0, ok=False), dst, group=group)
        raise
    try:
        dist.send(_header(step, rank, len(manifest_raw), len(dcp_raw), len(index_raw), entry.data_bytes), dst,
                  group=group)
        for raw in (manifest_raw, dcp_raw, index_raw):
            if raw:
                dist.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), dst, group=group)
        # Two buffers: the next piece is read while the last one is on its way.
        bufs = [np.empty(min(PIECE, max(entry.data_bytes, 1)), dtype=np.uint8) for _ in range(2)]
        pending: list[Any] = [None, None]
        sent, i = 0, 0
        while sent < entry.data_bytes:
            n = min(len(bufs[i]), entry.data_bytes - sent)
            if pending[i] is not None:
                pending[i].wait()
            try:
                reader.read_into(sent, memoryview(bufs[i][:n]))
            except (TieredError, OSError) as exc:  # the stream goes on (zeros), the receiver's check fails it
                log.error("tiered: step %d: cannot read rank %d's data to send it to rank %d: %s", step, rank, dst, exc)
                bufs[i][:n] = 0
            pending[i] = dist.isend(torch.from_numpy(bufs[i][:n]), dst, group=group)
            sent += n
            i = 1 - i
        for work in pending:
            if work is not None:
                work.wait()
    finally:
        reader.close()
    return len(manifest_raw) + len(dcp_raw) + len(index_raw) + entry.data_bytes


def _header(step: int, rank: int, manifest: int, dcp: int, index: int, data: int, ok: bool = True) -> torch.Tensor:
    return torch.tensor([MAGIC, step, rank, manifest, dcp, index, data, int(ok)], dtype=torch.int64)


def _recv_bytes(n: int, src: int, group: Any) -> bytes:
    import torch.distributed as dist

    if not n:
        return b""
    t = torch.empty(n, dtype=torch.uint8)
    dist.recv(t, src, group=group)
    return t.numpy().tobytes()


def receive_rank(src: int, group: Any, tier: Any, *, into_step: bool,
                 room: Callable[[int], bool] | None = None, step: int | None = None) -> Received | None:
    """Receive one rank's files of a step from rank `src` and commit them on `tier`: as a step
    of their own (`into_step` False: a replica tier of one source rank), or into the node's copy
    of the step (`LocalTier.commit_rank`). `room(bytes)`: False to drop them (received and
    discarded: the stream goes on). `step`: the step expected. Returns None where the sender had
    nothing or they were dropped; raises where they fail a check (nothing is committed)."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    header = torch.empty(HEADER, dtype=torch.int64)
    dist.recv(header, src, group=group)
    magic, got_step, rank, n_manifest, n_dcp, n_index, n_data, ok = (int(v) for v in header.tolist())
    if magic != MAGIC or min(n_manifest, n_dcp, n_index, n_data) < 0 or n_manifest > MAX_MANIFEST_BYTES \
            or n_dcp > MAX_MANIFEST_BYTES or n_index > MAX_INDEX_BYTES:
        raise TieredError(f"rank {src} sent a header this version cannot read ({header.tolist()}): the stream is lost")
    if not ok:
        return None
    manifest_raw, dcp_raw, index_raw = (_recv_bytes(n, src, group) for n in (n_manifest, n_dcp, n_index))
    keep = room is None or room(n_data + n_index + n_dcp + n_manifest)
    problem: str | None = None
    if step is not None and got_step != step:
        problem = f"rank {src} sent step {got_step}, not {step}"
    try:
        manifest = Manifest.from_json(manifest_raw, f"step {got_step}'s manifest from rank {src}")
        entry = manifest.entry(rank)
        if manifest.step != got_step or entry is None or entry.index_bytes != n_index or entry.data_bytes != n_data:
            raise FormatError(f"step {got_step}: what rank {src} sent of rank {rank} does not match its manifest")
        if checksum.wsum64(index_raw) != entry.index_checksum:
            raise FormatError(f"step {got_step}: rank {rank}'s index from rank {src} fails its checksum")
        if (manifest.dcp is None) != (not dcp_raw) or (manifest.dcp is not None and (
                len(dcp_raw) != manifest.dcp.size or checksum.wsum64(dcp_raw) != manifest.dcp.checksum)):
            raise FormatError(f"step {got_step}: the DCP metadata from rank {src} does not match its manifest's pin")
        index = RankIndex.from_json(index_raw, f"step {got_step}: rank {rank}'s index from rank {src}")
    except FormatError as exc:
        problem = problem or str(exc)
    if problem is not None or not keep:
        _drain(n_data, src, group)
        if problem is not None:
            raise TieredError(problem)
        return None
    receiving = False
    try:
        tier.begin_step(got_step, replacing=True)
        if dcp_raw:
            tier.write_file(got_step, manifest.dcp.name, dcp_raw)
        tier.write_file(got_step, entry.index_file, index_raw)
        receiving = True  # (from here on, _receive_file takes every byte, whatever fails)
        t1 = _receive_file(tier.file_path(got_step, entry.data_file), n_data, src, group, index)
        if into_step:
            tier.commit_rank(got_step, (entry.data_file, entry.index_file), manifest_raw)
        else:
            tier.commit(got_step, manifest_raw)
    except BaseException:
        if not receiving:  # (the data still comes: taken and dropped, so that the stream stays in step)
            with contextlib.suppress(Exception):
                _drain(n_data, src, group)
        tier.discard(got_step)
        raise
    t2 = time.perf_counter()
    return Received(got_step, rank, n_data + n_index, t2 - t0, manifest, checking_s=t2 - t1)


def _receive_file(path: Any, n: int, src: int, group: Any, index: RankIndex) -> float:
    """Receive `n` bytes from `src` into a new file at `path`, durable on return, every chunk of
    `index` checked against its checksum as soon as its bytes are in (on `VERIFY_THREADS`
    threads, beside the receiving). Returns when the receiving ended (time.perf_counter()); the
    checks may end after it. A failure to write still receives every piece, so the stream stays
    in step, and then raises; so does a chunk failing its check."""
    import torch.distributed as dist

    # Two buffers: the next piece is received while the last one is written.
    bufs = [torch.empty(min(PIECE, max(n, 1)), dtype=torch.uint8) for _ in range(2)]
    fd = -1
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        checks = _Checks(index, path, n)
    except (OSError, FormatError) as exc:  # (every byte is still taken, then this is raised)
        if fd >= 0:
            os.close(fd)
        _drain(n, src, group)
        if isinstance(exc, FormatError):
            raise
        raise TieredError(f"{path}: cannot write what rank {src} sent: {exc.strerror}") from None
    failed: OSError | None = None
    try:
        sizes = [min(PIECE, n - off) for off in range(0, n, PIECE)]
        work = dist.irecv(bufs[0][:sizes[0]], src, group=group) if sizes else None
        done = 0
        for j, k in enumerate(sizes):
            work.wait()
            if j + 1 < len(sizes):
                work = dist.irecv(bufs[(j + 1) % 2][:sizes[j + 1]], src, group=group)
            if failed is None:
                try:
                    view = memoryview(bufs[j % 2][:k].numpy())
                    while len(view):
                        view = view[os.write(fd, view):]
                except OSError as exc:
                    failed = exc
            done += k
            if failed is None:
                checks.upto(done)
        received = time.perf_counter()
        if failed is None:
            os.fsync(fd)
    finally:
        os.close(fd)
        if failed is not None:
            checks.close()
    if failed is not None:
        raise TieredError(f"{path}: cannot write what rank {src} sent: {failed.strerror}")
    checks.finish()
    return received


class _Checks:
    """The chunks of an index checked as a file of them is received (`upto`: its first bytes are
    in), on a pool of threads reading them back from the file."""

    def __init__(self, index: RankIndex, path: Any, n: int):
        self.path = str(path)
        self.chunks = sorted((c.offset, c.offset + c.size, rec, j) for rec in index.tensors
                             for j, c in enumerate(rec.chunks))
        if self.chunks and (self.chunks[0][0] < 0 or max(end for _, end, _, _ in self.chunks) > n):
            raise FormatError(f"{path}: the index places chunks outside the {n} bytes of the data file")
        self.next = 0
        self.fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        self.pool = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="tiered-verify")
        self.futures: list[Any] = []

    def upto(self, done: int) -> None:
        """Check the chunks that end within the first `done` bytes, in groups of about 8 MiB."""
        i = self.next
        while i < len(self.chunks):
            group = [i]
            while i + 1 < len(self.chunks) and self.chunks[i + 1][1] <= done and \
                    self.chunks[i + 1][1] - self.chunks[group[0]][0] <= 8 << 20:
                i += 1
                group.append(i)
            if self.chunks[group[-1]][1] > done:
                break
            self.futures.append(self.pool.submit(self._check, group[0], group[-1] + 1))
            i += 1
        self.next = i

    def _check(self, a: int, b: int) -> None:
        start, end = self.chunks[a][0], self.chunks[b - 1][1]
        data = memoryview(os.pread(self.fd, end - start, start))
        for _, _, rec, j in self.chunks[a:b]:
            verified(rec, j, data, start, self.path)

    def finish(self) -> None:
        try:
            for f in self.futures:
                f.result()
            if self.next != len(self.chunks):
                raise FormatError(f"{self.path}: {len(self.chunks) - self.next} chunks were never received")
        finally:
            self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        os.close(self.fd)


def _drain(n: int, src: int, group: Any) -> None:
    import torch.distributed as dist

    buf = torch.empty(min(PIECE, max(n, 1)), dtype=torch.uint8)
    done = 0
    while done < n:
        k = min(len(buf), n - done)
        dist.recv(buf[:k], src, group=group)
        done += k
