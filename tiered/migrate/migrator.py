"""Copying committed steps down the tiers, recompressing where the target tier takes another codec.

Call order for one step (`migrate_step`):

    src.read_manifest(step) -> per rank: read + validate the index (pinned by the manifest), while
    dst.begin_step(step)       refuses a committed step and clears debris of an interrupted attempt
    per rank, per tensor, in windows of chunks:
        src ranged read -> verify each chunk's checksum -> keep the chunk, or decode and re-encode it
        -> dst.open_data_writer(...).write_host(...) in file order
    dst.write_file(index) per rank -> dst.commit(manifest)   # manifest last: the commit

Idempotent: a step already committed on `dst` is skipped. Resumable: a migration killed at any
point leaves `dst` without that step's manifest, and the next attempt starts the step over.
Deterministic: the target manifest keeps the source's `created` and `writer`, and the encoders
are deterministic, so a restarted migration produces byte-identical files.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from tiered import threads
from tiered.codecs import get_codec_class
from tiered.config import AUTO, CODEC_NAMES, CPU_DECODABLE_CODECS, TierConfig, ZstdSettings
from tiered.errors import TieredError
from tiered.format import checksum
from tiered.format.manifest import (MAX_INDEX_BYTES, Manifest, RankEntry, RankIndex, index_file_name, present_ranks,
                                    read_manifest, read_pinned, read_rank_index)
from tiered.gpu.recode import GpuRecoder, make_gpu_recoder
from tiered.migrate.copy_rank import Prefetched, copy_rank, target_spec
from tiered.observe.probe import SAMPLE_CHUNKS, Sample, describe_samples, measure, sample_positions, tier_bandwidth
from tiered.observe.records import RecordLog, migrate_record, records_root
from tiered.policy import choose_codec
from tiered.stage.cpu import WindowBuffers, read_chunk
from tiered.stage.repair import ChunkRepair
from tiered.tiers.leases import hold
from tiered.tiers.retention import apply_retention
from tiered.units import format_rate, format_size

__all__ = ["BackgroundMigrator", "GpuRecoder", "MigrationLedger", "MigrationLock", "background_threads",
           "choose_tier_codec", "lower_priority", "lower_process_priority", "make_gpu_recoder", "migrate_down",
           "migrate_step", "pending_steps", "retry_delay", "target_spec"]

log = logging.getLogger("tiered")


def migrate_step(step: int, src: Any, dst: Any, *, codec: str | None, settings: ZstdSettings = ZstdSettings(),
                 pool: ThreadPoolExecutor | None = None, gpu: "GpuRecoder | None" = None,
                 progress: Callable[[int], None] | None = None, buffers: WindowBuffers | None = None,
                 repair_from: Sequence[Any] = (), replace: bool = False) -> Manifest | None:
    """Copy committed `step` from tier `src` to tier `dst`, storing chunks with `codec` there
    (None: every tensor keeps its codec; the chunks are copied as they are). The copy is built
    aside and committed whole (`dst` never shows part of it).

    `repair_from`: other tiers holding the step; a chunk of `src` failing its checksum is taken
    from the first of them that holds it intact (`tiered.stage.repair.ChunkRepair`), instead of
    failing the copy. `replace`: `dst` holds the step already (damaged): the new copy takes its
    place once committed, and the old one goes then, not before.

    Returns the new manifest, or None when `dst` already has the step.
    `gpu` (a GpuRecoder) decodes codecs without a CPU decoder (ans) and encodes codecs without a
    CPU encoder; everything else runs on the CPU pool. Without it, recompressing from or to such
    a codec is an error.
    `progress(n)` is called with the raw bytes of each window of chunks done.
    `buffers`: the read windows' memory, kept from one step to the next by a caller that migrates
    many (fresh memory costs a page fault per 4 KiB); None: this step's own.
    """
    if dst.has_step(step) and not replace:
        return None
    with hold([src, *repair_from], step):  # retention leaves the step where it is read while it is copied
        return _migrate_step(step, src, dst, codec=codec, settings=settings, pool=pool, gpu=gpu, progress=progress,
                             buffers=buffers, repair_from=repair_from, replace=replace)


def _migrate_step(step: int, src: Any, dst: Any, *, codec: str | None, settings: ZstdSettings,
                  pool: ThreadPoolExecutor | None, gpu: "GpuRecoder | None", progress: Callable[[int], None] | None,
                  buffers: WindowBuffers | None, repair_from: Sequence[Any], replace: bool) -> Manifest | None:
    t0 = time.perf_counter()
    manifest = read_manifest(src, step)
    if manifest.dcp is not None and replace:
        raise TieredError(f"step {step} was saved through DCP: its copy on tier {dst.name!r} is not replaced in "
                          "place (Engine.restore and DCP's load read it chunk by chunk from every tier)")
    if manifest.dcp is not None:
        _, indexes = present_ranks(src, step)  # this node's ranks
        return _migrate_ranks(step, src, dst, manifest, indexes, codec=codec, settings=settings, pool=pool, gpu=gpu,
                              progress=progress, buffers=buffers)
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(thread_name_prefix="tiered-migrate")
    buffers = buffers if buffers is not None else WindowBuffers()
    # The target's start (on S3 a HEAD and two listings: round trips) runs on the pool, idle until
    # the copy, and a remote source starts fetching the first rank's data, while the indexes are
    # read and validated; a step saved by one process has every rank's files here.
    begun = pool.submit(dst.begin_step, step, replacing=replace)
    first = None
    try:
        if manifest.ranks:
            first = Prefetched(src, step, manifest.ranks[0].data_file, manifest.ranks[0].data_bytes, buffers)
        indexes = [read_rank_index(src, step, entry) for entry in manifest.ranks]
        begun.result()
        ranks, stored = [], 0
        for i, (entry, index) in enumerate(zip(manifest.ranks, indexes)):
            repair = ChunkRepair(step, entry.rank, src.name, repair_from, settings, index.chunk_size) \
                if repair_from else None
            try:
                new_index, raw_index = copy_rank(step, src, dst, index, codec, settings, pool, gpu, progress, buffers,
                                                 first if i == 0 else None, repair)
            finally:
                if repair is not None:
                    repair.close()
            dst.write_file(step, entry.index_file, raw_index)
            stored += sum(t.stored_bytes for t in new_index.tensors)
            ranks.append(RankEntry(entry.rank, entry.index_file, len(raw_index), checksum.wsum64(raw_index),
                                   new_index.data_file, new_index.data_bytes))
        new_manifest = Manifest(step=step, world_size=manifest.world_size, ranks=tuple(ranks),
                                raw_bytes=manifest.raw_bytes, stored_bytes=stored, created=manifest.created,
                                writer=manifest.writer)
        dst.commit(step, new_manifest.to_json(), replace=replace)
    except BaseException:
        wait_futures([begun])  # then nothing of this attempt is left running on `dst`
        dst.discard(step)
        raise
    finally:
        if first is not None:
            first.close()
        if own_pool:
            pool.shutdown()
    log.info("tiered: step %d migrated %s -> %s: %s stored (%.1f%% saved) in %.2f s", step, src.name, dst.name,
             format_size(stored), 100 * new_manifest.saved_fraction, time.perf_counter() - t0)
    return new_manifest


def _migrate_ranks(step: int, src: Any, dst: Any, manifest: Manifest, indexes: list[RankIndex], *, codec, settings,
                   pool, gpu, progress, buffers) -> Manifest | None:
    """Migrate a step saved through DCP: copy the ranks whose files `src` holds (`indexes`: this
    node's), then commit on `dst` if every rank's files are there by now. Nodes do this
    independently; whichever finishes last commits (the same bytes, whoever writes them)."""
    t0 = time.perf_counter()
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(thread_name_prefix="tiered-migrate")
    begun = []
    try:
        for index in indexes:
            if dst.file_size(step, index_file_name(index.rank)) is not None:
                continue  # copied by an earlier attempt: an index is written after its data file
            dst.begin_rank(step, index.rank)
            begun.append(index.rank)
            dst.write_file(step, index_file_name(index.rank),
                           copy_rank(step, src, dst, index, codec, settings, pool, gpu, progress, buffers).raw)
        if dst.file_size(step, manifest.dcp.name) != manifest.dcp.size:
            dst.write_file(step, manifest.dcp.name, read_pinned(src, step, manifest.dcp))
    except BaseException:
        for rank in begun:
            dst.discard_rank(step, rank)
        raise
    finally:
        if own_pool:
            pool.shutdown()
    missing = [e.rank for e in manifest.ranks if dst.file_size(step, e.index_file) is None]
    if missing:
        log.info("tiered: step %d: ranks %s copied to %s in %.2f s; the step commits there once ranks %s (other "
                 "nodes) have copied theirs", step, [i.rank for i in indexes], dst.name, time.perf_counter() - t0,
                 _summary(missing))
        return None
    ranks, stored = [], 0
    for e in manifest.ranks:
        raw = dst.read_file(step, e.index_file, MAX_INDEX_BYTES)
        index = RankIndex.from_json(raw, dst.describe(step, e.index_file))
        stored += sum(t.stored_bytes for t in index.tensors)
        ranks.append(RankEntry(e.rank, e.index_file, len(raw), checksum.wsum64(raw), index.data_file, index.data_bytes))
    new_manifest = replace(manifest, ranks=tuple(ranks), stored_bytes=stored)
    if not dst.has_step(step):
        dst.commit(step, new_manifest.to_json())
    log.info("tiered: step %d migrated %s -> %s (%d ranks here, all %d there): %s stored (%.1f%% saved) in %.2f s",
             step, src.name, dst.name, len(indexes), len(ranks), format_size(stored), 100 * new_manifest.saved_fraction,
             time.perf_counter() - t0)
    return new_manifest


def _summary(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"{ranks[:8]}... ({len(ranks)} ranks)"


def choose_tier_codec(step: int, src: Any, dst_config: TierConfig, dst: Any, *, settings: ZstdSettings,
                      pool: ThreadPoolExecutor, gpu: GpuRecoder | None) -> str:
    """The codec `step` gets on tier `dst`: the configured one, or (codec: auto) the policy's
    choice from the tier's bandwidth and the candidate codecs measured on a sample of this
    step's own chunks (kept chunks cost no encode time)."""
    if dst_config.codec != AUTO:
        return dst_config.codec
    manifest, indexes = present_ranks(src, step)
    sample = Sample()
    for index in indexes:
        recs = [r for r in index.tensors if r.chunks]
        picks = [(recs[t], j) for t, j in sample_positions([r.nbytes for r in recs], index.chunk_size,
                                                            max(1, SAMPLE_CHUNKS // len(indexes)))]
        if not picks:
            continue
        cpu_picks = [p for p in picks if get_codec_class(p[0].codec.name).cpu_capable]
        gpu_picks = [p for p in picks if p not in cpu_picks]
        if gpu_picks and gpu is None:
            gpu_picks = []  # cannot decode them here; the sample is what the CPU can read
        reader = src.open_data_reader(step, index.data_file, device=False)
        try:
            for rec, j in cpu_picks:
                sample.add(rec.torch_dtype, read_chunk(rec, j, reader, settings), (rec.codec.name, rec.chunks[j].size))
        finally:
            reader.close()
        if gpu_picks:
            for (rec, j), raw in zip(gpu_picks, gpu.decode_chunks(src, step, index, gpu_picks)):
                sample.add(rec.torch_dtype, raw, (rec.codec.name, rec.chunks[j].size))
    if not sample.chunks:
        return "none" if not manifest.raw_bytes else next(iter(CPU_DECODABLE_CODECS))
    names = [n for n in CODEC_NAMES if (get_codec_class(n).cpu_capable or gpu is not None
                                        or any(s and s[0] == n for s in sample.stored))]
    samples = measure(sample, names, pool=pool, settings=settings, gpu=gpu, cpu_first=True)
    bandwidth = tier_bandwidth(dst_config, dst)
    choice = choose_codec(bandwidth=bandwidth, samples=samples, portable=dst_config.portable, overlap=True)
    log.info("tiered: step %d on tier %r: codec %s (policy; tier writes %s; %s)", step, dst_config.name, choice,
             format_rate(bandwidth), describe_samples(samples))
    return choice


def pending_steps(config: Any, get_tier: Callable[[str], Any]) -> list[int]:
    """Committed steps that some tier below the fastest tier holding them still lacks."""
    held = [set(get_tier(t.name).steps()) for t in config.tiers]
    out = []
    for step in sorted(set().union(*held)):
        first = next(i for i, steps in enumerate(held) if step in steps)
        if any(step not in steps for steps in held[first + 1:]):
            out.append(step)
    return out


def migrate_down(step: int, config: Any, get_tier: Callable[[str], Any], *, pool: ThreadPoolExecutor,
                 gpu: GpuRecoder | None, progress: Callable[[int], None] | None = None,
                 buffers: WindowBuffers | None = None) -> int:
    """Copy `step` down every hop it is missing from (each tier from the one above it, so it is
    recompressed once, where the codec changes); a chunk damaged on the source is taken from a
    tier above it that still holds the step. Returns the number of copies made. `buffers`: as for
    `migrate_step`."""
    made, records = 0, RecordLog(records_root(config))
    by_name = {t.name: t for t in config.tiers}
    names = [t.name for t in config.tiers]
    for upper, lower in zip(names, names[1:]):
        src, dst = get_tier(upper), get_tier(lower)
        if dst.has_step(step) or not src.has_step(step):
            continue
        codec = choose_tier_codec(step, src, by_name[lower], dst, settings=config.zstd, pool=pool, gpu=gpu)
        t0 = time.perf_counter()
        above = [get_tier(n) for n in names[:names.index(upper)]]
        manifest = migrate_step(step, src, dst, codec=codec, settings=config.zstd, pool=pool, gpu=gpu,
                                progress=progress, buffers=buffers, repair_from=[t for t in above if t.has_step(step)])
        if manifest is not None:
            made += 1
            records.append(migrate_record(manifest, upper, lower, time.perf_counter() - t0, [codec] if codec else []))
    return made


def background_threads() -> int:
    """CPU threads for in-process migration: a quarter of the cores (at least one)."""
    return max(1, (os.cpu_count() or 1) // 4)


def lower_process_priority() -> None:
    """For a migrator in a process of its own (`migration: process`'s child, `tiered migrate`):
    nice +10 for every thread it has and, by inheritance, every thread it starts later. (On Linux
    the nice value is a thread's: set on the main thread alone, it missed a thread that the
    child's imports had started.) A no-op where the OS does not allow it.

    SCHED_IDLE was measured as well, and did not help: four threads of zstd beside a training
    loop on an H100 machine cost a step -0.9 to +4.3% at nice +10 and +1.5 to +4.1% under
    SCHED_IDLE, within the measure's spread."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # (no /proc: this thread, and those it starts)
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 10)
        except (AttributeError, OSError):  # (a thread that has ended; an OS without it)
            pass


def lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: nice 10 for this thread only), so that
    background work yields the cores to training; a no-op where the OS does not allow it."""
    threads.lower_priority(to=10)


class MigrationLock:
    """One migrator per fast tier at a time (the in-process thread or a `tiered migrate` daemon):
    an flock on ``<fast tier>/.tiered-migrate.lock``, released when its holder exits, even by SIGKILL."""

    def __init__(self, root: Path):
        self.path = Path(root) / ".tiered-migrate.lock"
        self._fd = -1

    def acquire(self) -> bool:
        """Take the lock if it is free; False when another migrator holds it."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


RETRY_FIRST_S = 5.0
"""Seconds before a failed step's first retry by the in-process migrator; doubled after each
failure of that step, up to RETRY_MAX_S. (The S3 client has already retried each request itself.)"""
RETRY_MAX_S = 300.0


def retry_delay(failures: int) -> float:
    """Seconds to wait before the next attempt at a step that has failed `failures` times."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** max(0, failures - 1))


class MigrationLedger:
    """What a migrator owes the engine: the steps submitted and not yet on every tier, and the
    first failure since `wait` last raised one. The migrator thread (BackgroundMigrator) and the
    migrator process (tiered.migrate.process) keep it the same way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[int] = set()
        self._error: BaseException | None = None
        self._scanned = threading.Event()
        """Set once start-up is over: the lock taken (or not: `active`) and unfinished steps queued."""
        self.active = True
        """False when another migrator (a `tiered migrate` daemon) migrates this fast tier."""

    def _track(self, step: int) -> bool:
        """Count `step` as owed; False if it already is, or this migrator is not `active`."""
        with self._lock:
            if step in self._pending or not self.active:
                return False
            self._pending.add(step)
            return True

    def _settle(self, step: int) -> None:
        with self._lock:
            self._pending.discard(step)

    def _deactivate(self) -> None:
        with self._lock:
            self.active = False
            self._pending.clear()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._error = self._error or exc

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted step is on every tier (failed steps count as pending while
        they wait for a retry); raise the first failure since the last call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._scanned.wait(timeout)
        while True:
            with self._lock:
                busy = sorted(self._pending)
                err, self._error = self._error, None
            if err is not None:
                raise TieredError(f"migration failed: {err}") from err
            if not busy:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"steps {busy} are still migrating")
            time.sleep(0.05)


class BackgroundMigrator(MigrationLedger):
    """Copies each committed step down the tiers on a thread of its own, one hop at a time (each
    tier from the one above it, so a step is recompressed once, where the codec changes), then
    applies the tiers' retention rules.

    Call order: ``submit(step)`` after each commit; ``wait(timeout)`` to block until queued steps
    are everywhere (raises the first failure since the last call); ``stop()`` finishes the queue
    and ends the thread. On start it takes the fast tier's migration lock (when a `tiered migrate`
    daemon holds it, this thread leaves migration to the daemon) and queues committed steps that
    an earlier run left unmigrated. A failed migration leaves the step on the faster tiers, where
    nothing committed is ever lost, and is retried after `retry_delay` (5 s, doubling to 5 min)
    until it succeeds; ``stop()`` does not wait for retries that are not due (the next run, or
    `tiered migrate`, resumes them).
    """

    def __init__(self, config: Any, get_tier: Callable[[str], Any], make_gpu: Callable[[], "GpuRecoder | None"],
                 on_event: Callable[[str, int, str], None] = lambda kind, step, detail: None,
                 gpu: int | None = None):
        """`gpu`: the CUDA device its threads run on (`make_gpu`'s); None: the creating thread's.
        A process that has not used CUDA yet (the migrator process) must name it: otherwise its
        threads' current device is GPU 0, and their first CUDA call opens a context there."""
        super().__init__()
        self._config, self._get_tier = config, get_tier
        self._on_event = on_event
        """Told ("resumed" | "done" | "failed", step, detail) as they happen (tiered.migrate.process)."""
        # Training owns the machine: a quarter of the cores, at lower CPU priority (measured:
        # migrating with every core slowed a training step by half; docs/benchmarks.md).
        self._pool = threads.pool(background_threads(), "tiered-migrate", lower_priority, gpu=gpu)
        self._buffers = WindowBuffers()  # read windows kept between steps (at most WindowBuffers.KEEP)
        self._make_gpu = make_gpu
        self._queue: "queue.Queue[int | None]" = queue.Queue()
        self._failures: dict[int, int] = {}
        """Failed attempts per step still to be migrated (the migrator thread's own)."""
        self._retry_at: dict[int, float] = {}
        """Steps waiting for a retry, with the monotonic time it is due (the migrator thread's own)."""
        self._migration_lock = MigrationLock(config.fast_tier.path)
        self._thread = threads.start(self._run, name="tiered-migrator", gpu=gpu)

    def submit(self, step: int) -> None:
        if self._track(step):
            self._queue.put(step)

    def holder(self) -> str:
        """Who holds the fast tier's migration lock (a pid), when this migrator is not `active`."""
        return self._migration_lock.holder()

    def scanned(self, timeout: float | None = None) -> bool:
        """The start-up is over: the lock taken (or not: `active`) and unfinished steps queued."""
        return self._scanned.wait(timeout)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._pool.shutdown()
        self._migration_lock.release()

    def _next(self) -> "int | None":
        """The next step to migrate: a queued one, else the first retry that falls due; None to stop."""
        due = min(self._retry_at, key=self._retry_at.__getitem__, default=None)
        try:
            return self._queue.get(timeout=None if due is None else max(0.0, self._retry_at[due] - time.monotonic()))
        except queue.Empty:
            del self._retry_at[due]
            return due

    def _run(self) -> None:
        lower_priority()
        try:
            if not self._migration_lock.acquire():
                log.warning("tiered: another migrator (pid %s) holds %s: this process leaves migration to it",
                            self._migration_lock.holder(), self._migration_lock.path)
                self._deactivate()
                return
            for step in pending_steps(self._config, self._get_tier):  # an earlier run's unfinished work
                log.info("tiered: resuming migration of step %d", step)
                self._on_event("resumed", step, "")
                self.submit(step)
        except Exception as exc:  # noqa: BLE001 - e.g. S3 unreachable now; new steps still queue
            log.error("tiered: cannot list the tiers to resume migrations: %r", exc)
            self._fail(exc)
        finally:
            self._scanned.set()
        gpu: Any = False
        while (step := self._next()) is not None:
            try:
                if gpu is False:
                    gpu = self._make_gpu()
                migrate_down(step, self._config, self._get_tier, pool=self._pool, gpu=gpu, buffers=self._buffers)
            except BaseException as exc:  # noqa: BLE001 - the step stays on the faster tiers
                n = self._failures[step] = self._failures.get(step, 0) + 1
                delay = retry_delay(n)
                self._retry_at[step] = time.monotonic() + delay
                log.error("tiered: migration of step %d failed (attempt %d; it stays on the faster tiers, "
                          "retried in %g s): %s", step, n, delay, exc)
                self._fail(exc)
                self._on_event("failed", step, str(exc))
                continue
            if self._failures.pop(step, 0):
                log.info("tiered: step %d migrated after earlier failures", step)
            try:  # (before the step is settled: `wait` returns with the tiers as their rules leave them)
                apply_retention(self._config, self._get_tier)
            except BaseException as exc:  # noqa: BLE001 - nothing is deleted that a slower tier lacks
                log.error("tiered: retention failed (retried after the next migration): %s", exc)
                self._fail(exc)
            self._settle(step)
            self._on_event("done", step, "")
        left = sorted(self._retry_at)
        if left:
            log.warning("tiered: steps %s are not migrated yet (their retries were not due): the next run, or "
                        "`tiered migrate`, resumes them", left)
