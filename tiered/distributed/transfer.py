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
uint8 tensor (gloo sends CPU tensors). Memory on each side: one piece.
"""

from __future__ import annotations

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
from tiered.restore.pipeline import verify_step

log = logging.getLogger("tiered")

MAGIC = 0x7469657265640001
"""'tiered' and the version of this exchange."""
HEADER = 8
PIECE = 16 << 20
"""Bytes of a data file sent at a time."""


@dataclass(frozen=True)
class Received:
    """A rank's files of a step, received and committed on a tier."""

    step: int
    rank: int
    stored_bytes: int
    seconds: float
    manifest: Manifest


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
        buf = np.empty(min(PIECE, max(entry.data_bytes, 1)), dtype=np.uint8)
        sent = 0
        while sent < entry.data_bytes:
            n = min(len(buf), entry.data_bytes - sent)
            try:
                reader.read_into(sent, memoryview(buf[:n]))
            except (TieredError, OSError) as exc:  # the stream goes on (zeros), the receiver's check fails it
                log.error("tiered: step %d: cannot read rank %d's data to send it to rank %d: %s", step, rank, dst, exc)
                buf[:n] = 0
            dist.send(torch.from_numpy(buf[:n]), dst, group=group)
            sent += n
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


def receive_rank(src: int, group: Any, tier: Any, settings: Any, *, into_step: bool,
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
    tier.begin_step(got_step, replacing=True)
    try:
        if dcp_raw:
            tier.write_file(got_step, manifest.dcp.name, dcp_raw)
        tier.write_file(got_step, entry.index_file, index_raw)
        _receive_file(tier.file_path(got_step, entry.data_file), n_data, src, group)
        with ThreadPoolExecutor(2, thread_name_prefix="tiered-verify") as pool:
            verify_step(tier, got_step, [index], pool, settings, quick=True, progress=lambda n: None)
        if into_step:
            tier.commit_rank(got_step, (entry.data_file, entry.index_file), manifest_raw)
        else:
            tier.commit(got_step, manifest_raw)
    except BaseException:
        tier.discard(got_step)
        raise
    return Received(got_step, rank, n_data + n_index, time.perf_counter() - t0, manifest)


def _receive_file(path: Any, n: int, src: int, group: Any) -> None:
    """Receive `n` bytes from `src` into a new file at `path`, durable on return. A failure to
    write still receives every piece, so the stream stays in step, and then raises."""
    import torch.distributed as dist

    buf = torch.empty(min(PIECE, max(n, 1)), dtype=torch.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    failed: OSError | None = None
    try:
        done = 0
        while done < n:
            k = min(len(buf), n - done)
            dist.recv(buf[:k], src, group=group)
            if failed is None:
                try:
                    view = memoryview(buf[:k].numpy())
                    while len(view):
                        view = view[os.write(fd, view):]
                except OSError as exc:
                    failed = exc
            done += k
        if failed is None:
            os.fsync(fd)
    finally:
        os.close(fd)
    if failed is not None:
        raise TieredError(f"{path}: cannot write what rank {src} sent: {failed.strerror}")


def _drain(n: int, src: int, group: Any) -> None:
    import torch.distributed as dist

    buf = torch.empty(min(PIECE, max(n, 1)), dtype=torch.uint8)
    done = 0
    while done < n:
        k = min(len(buf), n - done)
        dist.recv(buf[:k], src, group=group)
        done += k
