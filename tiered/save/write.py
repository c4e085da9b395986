"""The writer's half of a save: a save in flight (`Job`), handed from the call (or the stager
thread) to the pipeline's writer thread through its queue of staged segments, and one rank's
files written from those segments (`write_rank`): the data file, chunk by chunk at aligned
offsets, then the rank's index. tiered.save.pipeline runs it on its writer thread; a failure empties
the job's segments (`drain`), so the staging side never waits for pages forever. And how a
save's `staged` future is settled (`settle`, `complete_after`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tiered.config import Config
from tiered.errors import TieredError
from tiered.format import checksum
from tiered.format.manifest import (ALIGNMENT, ChunkTable, Manifest, RankEntry, data_file_name, dtype_name,
                                    index_file_name, index_json)
from tiered.gpu.runtime import Workers
from tiered.gpu.write import RowsWriter
from tiered.observe.records import save_record
from tiered.save.handle import RankFiles, SaveHandle
from tiered.stage import cpu, host_copy
from tiered.stage.plan import SavePlan
from tiered.units import format_size, round_up
from tiered.version import __version__

log = logging.getLogger("tiered")
END = object()
JOINED_WRITE_BYTES = 16 << 20
"""The CPU-encoded chunks of a wave are joined into writes of up to this many bytes."""


class Abort:
    def __init__(self, exc: BaseException):
        self.exc = exc


@dataclass
class Job:
    step: int
    skeleton: Any
    plan: SavePlan | None
    """None until the stager has planned a deferred save (`state`)."""
    handle: SaveHandle
    device_io: bool
    segments: "queue.Queue[Any]" = field(default_factory=queue.Queue)
    staging_over: bool = False
    """The writer has taken the last segment (the end marker or an abort)."""
    aborted: bool = False
    """save() failed while staging and raised that error itself."""
    go: threading.Event = field(default_factory=threading.Event)
    """Set when save() has staged everything, or must wait for the writer to free memory.
    Until then the writer leaves the job alone, so it does not contend with save() for the GIL."""
    started: float = field(default_factory=time.perf_counter)
    tier: Any = None
    """Where the step is written: the fast tier, or the next one where the fast tier could not take it."""
    rank_only: bool = False
    """Write this rank's files only; the step is committed by the distributed save (tiered.dcp)."""
    after: dict[int, Any] | None = None
    """Overlapped saves: per GPU, the event the training stream recorded in save(); the stager
    thread stages after it."""
    reads: list[tuple[int, Any]] = field(default_factory=list)
    """Per GPU, the event after which the state may change (set once staged)."""
    enqueued: threading.Event = field(default_factory=threading.Event)
    """The stager thread has issued (or given up) all of this save's reads."""
    overlapped: bool = False
    """Read beside the next forward and backward (`guard`), not strictly: it may wait `stage_after_ms`."""
    hurry: threading.Event = field(default_factory=threading.Event)
    """Something waits for this save's reads: the stager thread starts it now (tiered.stage.stage_after.StageAfter)."""
    state: Any = None
    """A deferred save's state, until the stager thread has walked it (tiered.stage.overlap: `Learned`)."""
    clones: dict[Any, Any] = field(default_factory=dict)
    """A deferred save's clones of the last save's unguarded tensors, made in save()."""
    held: list[Any] = field(default_factory=list)
    """Tensors the stager thread cloned on a side stream: alive until the save has read the clones
    (freed sooner, their memory could be taken and written by training's stream first)."""

    def abort(self, exc: BaseException, reported: bool) -> None:
        """Hand the writer this save's failure instead of (the rest of) its segments; `reported`:
        the caller raises it, so the writer does not record it again."""
        self.aborted = reported
        self.segments.put(Abort(exc))
        self.go.set()

    def drop_tensors(self) -> None:
        """Forget the saved tensors once the GPU has read them (or the save has failed): the engine
        must not keep a state alive that the caller has let go, nor let it go while still reading."""
        self.state, self.clones, self.held = None, {}, []
        if self.plan is not None:
            self.plan = dataclasses.replace(self.plan, tensors=())


def write_rank(job: Job, rank: int, config: Config, workers: Workers, on_place: Callable[[], None]) -> RankFiles:
    """Write `job`'s rank files from its staged segments, in the order they come: its data file
    (each chunk at the next aligned offset; CPU segments encoded on the codec pool, GPU rows and
    host copies as they lie), closed (fsync), then its index. `on_place()` is called per wave of
    chunks placed (the pipeline's progress). Raises a staging failure the segments bring."""
    job.go.wait()
    if job.plan is None:  # (a deferred save the stager could not plan: its failure is the next segment)
        seg, job.staging_over = job.segments.get(), True
        raise TieredError(f"staging failed: {type(seg.exc).__name__}: {seg.exc}")
    data_name = data_file_name(rank)
    writer = job.tier.open_data_writer(job.step, data_name, device=job.device_io)
    # Each tensor's chunks as packed rows (one byte string, not an object per chunk or per
    # tensor, while the file is written: see ChunkTable).
    chunks: dict[int, bytearray] = {p.index: bytearray() for p in job.plan.all}
    row = ChunkTable.ROW.pack
    order: list[int] = []
    end = 0

    def place(refs: Sequence[Any], sizes: Sequence[int], sums: Sequence[int]) -> int:
        """Place chunks `refs` (stored sizes, checksums) end to end at the next aligned offsets
        of the data file and record them; the first one's offset."""
        nonlocal end
        first = end
        on_place()
        for ref, size, crc in zip(refs, sizes, sums):
            placed = chunks[ref.plan.index]
            if not placed:
                order.append(ref.plan.index)
            placed += row(end, size, ref.raw_size, crc)
            end += round_up(size, ALIGNMENT)
        return first

    rows = RowsWriter(writer, place, job.handle.timings)
    try:
        while True:
            seg = rows.take(job.segments)
            if seg is END or isinstance(seg, Abort):
                job.staging_over = True
                if isinstance(seg, Abort):
                    raise TieredError(f"staging failed: {seg.exc!r}")
                rows.flush()
                break
            if isinstance(seg, cpu.RawSegment):
                rows.flush()
                try:
                    encoded = cpu.encode_segment(seg, workers.pool, config.zstd)
                finally:
                    seg.release()
                offset = place(seg.chunks, [e[1] for e in encoded], [e[2] for e in encoded])
                for at, extents in cpu.joined_extents([e[0] for e in encoded], JOINED_WRITE_BYTES):
                    writer.write_host(offset + at, extents)
            elif isinstance(seg, host_copy.HostSegment):
                rows.flush()
                host_copy.write_segment(seg, writer, place, workers.checksums, job.handle.timings)
            else:
                rows.add(seg)
        data_bytes = writer.close()
    except BaseException:
        rows.abort()
        writer.abort()
        raise
    plans = {p.index: p for p in job.plan.all}
    ordered = [i for i in plans if not chunks[i]] + order
    # (the index is made from the plans and packed rows directly: `index_json`)
    raw_index = index_json(rank=rank, data_file=data_name, data_bytes=data_bytes,
                           chunk_size=config.chunk_size, skeleton=job.skeleton, io=writer.io_mode,
                           tensors=((i, p.name, dtype_name(p.dtype), p.shape, p.device, p.is_numpy, p.spec,
                                     ChunkTable.packed_json(chunks[i])) for i in ordered for p in (plans[i],)))
    stored = {i: ChunkTable.packed_stored_bytes(raw) for i, raw in chunks.items()}
    index_name = index_file_name(rank)
    job.tier.write_file(job.step, index_name, raw_index)
    return RankFiles(entry=RankEntry(rank, index_name, len(raw_index), checksum.wsum64(raw_index), data_name,
                                     data_bytes),
                     io=writer.io_mode, codecs=sorted({p.spec.name for p in plans.values()}),
                     tensor_stored=stored, raw_bytes=job.handle.raw_bytes, stored_bytes=sum(stored.values()))


def drain(job: Job) -> None:
    """After a failure: release every staged segment still coming, so save() never deadlocks."""
    job.go.wait()
    while not job.staging_over:
        seg = job.segments.get()
        if seg is END or isinstance(seg, Abort):
            job.staging_over = True
        else:
            seg.release()


def settle(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Resolve `fut` unless already resolved (save() and the writer race to settle `staged`)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def complete_after(events: Sequence[Any], fut: Future, then: Callable[[], None]) -> None:
    """Resolve `fut` once every event has completed, then call `then` (which lets the state go)."""
    try:
        for ev in events:
            ev.synchronize()
        settle(fut, True)
    except BaseException as exc:  # noqa: BLE001
        settle(fut, exc=exc)
    finally:
        then()


def commit_step(job: Job, files: RankFiles, world_size: int, records: Any, fast_tier: Any) -> Manifest:
    """Commit a one-process save whose rank files are durable: the manifest, written last (the
    commit), then its record and its log line."""
    manifest = Manifest(
        step=job.step, world_size=world_size, ranks=(files.entry,), raw_bytes=files.raw_bytes,
        stored_bytes=files.stored_bytes, created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        writer=f"tiered {__version__}")
    job.tier.commit(job.step, manifest.to_json())
    durable = time.perf_counter() - job.started + job.handle.timings.get("plan_ms", 0.0) / 1e3
    records.append(save_record(manifest, job.tier.name, job.handle, durable, files.codecs, files.io))
    ram = getattr(job.tier, "filesystem", None)  # (a memory tier: durable in RAM, not on a disk)
    log.info("tiered: step %d committed%s: %s -> %s (%.1f%% saved), save() blocked %.1f ms, %s after %.2f s "
             "[%s]", job.step, "" if job.tier is fast_tier else f" on tier {job.tier.name!r}",
             format_size(job.handle.raw_bytes), format_size(files.stored_bytes), 100 * manifest.saved_fraction,
             1e3 * job.handle.stall_s, f"in host memory ({ram})" if ram else "durable", time.perf_counter() - job.started,
             files.io)
    return manifest
