"""The save pipeline: plan -> stage -> write extents -> fsync -> index -> commit.

`SavePipeline.save(step, state_dict)` checks, begins the step on the tier that takes it
(tiered.save.placement), plans (tiered.stage.plan, cached across saves) and stages in the caller's
thread: GPU tensors compressed on a side stream (tiered.gpu.device: the compressed copy is the
snapshot), CPU tensors copied into host staging (tiered.stage.cpu); then it returns a `SaveHandle`.
With `guard(optimizer)` the stage runs on the stager thread instead and the optimizer's next step
waits for the reads (tiered.stage.overlap); once a guarded save has learned the state's structure,
that thread also walks and plans the next ones (`save_later` for a distributed save). One writer
thread, in save order, encodes, checksums, places and writes each staged segment, closes the data
file (fsync), writes the rank's index and commits the manifest last (tiered.save.write; not with
``rank_only``, whose step is committed once every rank's files are durable: `Engine.save`'s
distributed path and DCP's StorageWriter), then tells the hooks (the migrator queues the step).
The whole path: docs/architecture.md, "Save".

A failed save never becomes visible (its manifest is never written) and its files are
discarded; it is logged, recorded, and raised by its handle's own `wait()`. Whether the next
`save()` or `wait()` raises it is `on_save_failure`'s to say (`tiered.save.failures`). After each
save, committed or failed, retention runs where no migrator runs it (`tiered.tiers.retention`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

import torch

from tiered import threads
from tiered.config import CPU_DECODABLE_CODECS, Config
from tiered.errors import BackgroundSaveError, TieredError
from tiered.format import tree
from tiered.format.manifest import MAX_STEP, Manifest
from tiered.gpu.runtime import Workers
from tiered.observe.records import RecordLog, failure_record, records_root
from tiered.observe.watch import Watch
from tiered.save.failures import SaveFailures
from tiered.save.fast_codec import FastTierCodec
from tiered.save.handle import RankFiles, SaveHandle
from tiered.save.placement import StepTier
from tiered.save.reserve import Reservation
from tiered.save.write import END, Job, commit_step, complete_after, drain, settle, write_rank
from tiered.stage import cpu, host_copy
from tiered.stage.overlap import (Guard, Guarded, Learned, clone_after, deferred_plan, overlap_plan, recorded, say_new,
                                  to_clone)
from tiered.stage.plan import PlanCache, SavePlan, make_plan
from tiered.stage.stage_after import StageAfter, stage_after_seconds
from tiered.tiers.catalog import TierCatalog
from tiered.tiers.retention import retain_without_migrator

log = logging.getLogger("tiered")

DEFER_AFTER_MS = 6.0
"""A guarded save whose call walked and planned its state for this long makes the next saves
walk on the stager thread (`guard` without `defer_walk`; in one process: under torchrun only
`defer_walk=True` does). On one H200 a 24 GB state's walk cost training more in the call than on
that thread, at 7,880 tensors (22-49 ms in the call) and at 1,940 (7.1 ms, steps of 0.37 s); a
2.4 GB state's (788 tensors, 4.9 ms) less (docs/benchmarks.md; at 2 ranks)."""


class SavePipeline:
    """The save side of one Engine: staging in the caller's thread, one writer thread behind it.

    Public calls: `save`, `wait`, `pending`, `close`; for the distributed save and DCP storage:
    `bind_rank`, `check`, `record_failure`, `track`, `notify_committed`, `save_later`, `defers`,
    `wait_planned`; for the engine: `on_commit`.
    """

    def __init__(self, config: Config, catalog: TierCatalog, workers: Workers):
        self.config, self.catalog, self.workers = config, catalog, workers
        self.tier = catalog.fast
        self.rank, self.world_size = 0, 1
        self.codec = FastTierCodec(config, self.tier, workers)
        """The fast tier's codec (``codec: auto`` decides it from the first save)."""
        self._cpu_copies = host_copy.HostCopier(None, workers.host, config.chunk_size)
        """CPU tensors stored as they are: copied into host pages laid out as the data file and
        written in place (tiered.stage.host_copy), not encoded chunk by chunk (tiered.stage.cpu)."""
        self.closed = False
        self._plans = PlanCache()
        self._jobs: "queue.Queue[Job | None]" = queue.Queue()
        self._inflight: dict[int, SaveHandle] = {}
        self.failures = SaveFailures(config)
        """What a failed save does to training (`on_save_failure`)."""
        self._lock = threading.Lock()
        self._hooks: list[Callable[[int], None]] = []
        self._tiers = StepTier(config, catalog)
        """Which tier a step begins on (`on_fast_tier_error`)."""
        self._adopting: list[threading.Thread] = []
        """Threads committing dcp.save's steps on this node's tier once rank 0 has (tiered.distributed.storage)."""
        self._guards: list[Any] = []
        """Optimizers whose step waits for overlapped saves (`guard`)."""
        self._unordered: list[Job] = []
        """Overlapped saves that no guarded optimizer step has waited for yet."""
        self._logged_strict = False
        self._walk_in_call: list[Any] = []
        """Guarded optimizers whose saves walk their state in save() (`guard(defer_walk=False)`)."""
        self._walk_auto: list[Any] = []
        """Guarded optimizers that leave it to the walk's cost (`guard` without `defer_walk`: `DEFER_AFTER_MS`)."""
        self._learned: Learned | None = None
        """What the last guarded save learned of its state: the next one's call walks nothing."""
        self._logged_new = self._logged_defer = False
        self._stage_after = StageAfter()
        """How long after a call the stager thread starts an overlapped save (`guard`'s `stage_after_ms`)."""
        self._reservation = Reservation()
        """`reserve`'s work on a thread of its own."""
        self._stager: threading.Thread | None = None
        self._stage_queue: "queue.Queue[Job | None]" = queue.Queue()
        self.records = RecordLog(records_root(config))
        self.progress = 0
        """Waves of chunks placed in a data file so far (it moves while saves make progress)."""
        self._writer = threads.start(self._writer_loop, name="tiered-writer")
        self._watch = Watch(self._steps_in_flight, lambda: self.progress)

    # --- overlapping saves with the next forward and backward ------------------------------------
    def guard(self, optimizer: Any, defer_walk: bool | None = None, stage_after_ms: float | str = "auto") -> Guard:
        """From now on `save()` returns before the state has been read, and `optimizer.step()`
        waits until it has (tiered.stage.overlap says what is guarded and what is cloned instead).
        `defer_walk`: the stager thread walks the state, not the call, once a save has seen it:
        True, always; None, once a walk (a save's call's, or `reserve`'s) took `DEFER_AFTER_MS`.
        A guard standing with False keeps the walk in the call; one with None keeps the rule.
        `stage_after_ms`: the stager thread starts each save no sooner than this after its call
        (the longest of the standing guards'; "auto": tiered.stage.stage_after), unless something waits
        for it first. The GPUs of its parameters are readied now: their save kernels load beside training."""
        after = stage_after_seconds(stage_after_ms)  # (ValueError before anything is guarded)
        self.workers.prepare([p for g in getattr(optimizer, "param_groups", ()) for p in g.get("params", ())])
        self._reservation.wait()  # (what it learns depends on the guards)
        self._guards.append(optimizer)
        self._stage_after.set(optimizer, after)
        if defer_walk is None:
            self._walk_auto.append(optimizer)
        elif not defer_walk:
            self._walk_in_call.append(optimizer)
        if self._stager is None:
            self._stager = threads.start(self._stager_loop, name="tiered-stager")
        return Guard(optimizer, optimizer.register_step_pre_hook(lambda *_: self._stepped(optimizer)),
                     self.order_updates, self._unguard)

    def _unguard(self, optimizer: Any) -> None:
        self._stage_after.drop(optimizer)
        for kept in (self._guards, self._walk_in_call, self._walk_auto):
            if optimizer in kept:
                kept.remove(optimizer)

    def _stepped(self, optimizer: Any) -> None:
        self._stage_after.stepped(optimizer)
        self.order_updates()

    def _hurry_all(self) -> None:
        """Every overlapped save not yet ordered: something waits for it, its stager starts now."""
        with self._lock:
            for job in self._unordered:
                job.hurry.set()

    def _walk_defers(self, walked_ms: float) -> bool:
        """The guards let a walk of this long make later calls walk nothing (`guard`'s `defer_walk`)."""
        return not self._walk_in_call and (not self._walk_auto or walked_ms >= DEFER_AFTER_MS)

    def _say_defers(self, who: str, which: str, tensors: int, walked_ms: float) -> None:
        """Log once that a walk by `who` made the stager thread walk from `which` save on (under `defer_walk=None`)."""
        if self._walk_auto and self._learned is not None and not self._logged_defer:
            self._logged_defer = True
            log.info("tiered: %s walked and planned the state (%d tensors) in %.1f ms: from %s save on, the stager "
                     "thread does, before the optimizer step (guard(optimizer, defer_walk=False) keeps it in save())",
                     who, tensors, walked_ms, which)

    def order_updates(self) -> None:
        """Make the current streams wait until every overlapped save has read the state (a guarded
        optimizer calls this before each step; a loop that updates the state otherwise calls it
        itself). Waits on the CPU only while the stager thread is still issuing reads."""
        with self._lock:
            jobs, self._unordered = self._unordered, []
        now = time.perf_counter()
        for job in jobs:
            if job.overlapped:  # (from the call, as staged_ms)
                job.handle.timings.setdefault("step_after_ms",
                                              1e3 * (now - job.started) + job.handle.timings.get("plan_ms", 0.0))
            job.hurry.set()
            job.enqueued.wait()
            for index, ev in job.reads:
                torch.cuda.current_stream(index).wait_event(ev)

    def _stager_loop(self) -> None:
        while True:
            job = self._stage_queue.get()
            if job is None:
                return
            try:
                if job.overlapped:
                    self._stage_after.wait(job.started, job.hurry, job.step, job.handle.timings)
                with tree.collector_paused():  # (a save's views and records die young: none are promoted)
                    if job.plan is None:
                        self._plan_deferred(job)
                    self._stage(job)
            except BaseException:  # noqa: BLE001 - the writer records it (BackgroundSaveError)
                for index in job.plan.gpu if job.plan is not None else ():  # nothing of it may still read the state
                    self.workers.device(index).stream.synchronize()
            finally:
                job.enqueued.set()

    # --- for the engine, the distributed save and DCP storage ----------------------------------
    def reserve(self, state_dict: Any, *, rank_only: bool = False) -> int:
        """For `Engine.reserve` (`rank_only`: this rank's items of DCP's plan): walk `state_dict`
        here, as `save` does, and ready saves of it on another thread (`_ready`). Its tensors' bytes."""
        self.wait_planned()
        t0 = time.perf_counter()
        leaves = tree.flatten(state_dict, share=not rank_only)[1]
        walked_s = time.perf_counter() - t0
        structure = tree.structure_of(state_dict)
        self._reservation.start(lambda: self._ready(leaves, structure, walked_s, rank_only))
        return sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in leaves)

    def _ready(self, leaves: list[tree.Leaf], structure: Any, walked_s: float, rank_only: bool) -> None:
        """On the reservation's thread: the GPUs readied, `codec: auto` decided from a sample, the
        state planned as `save` plans it, laid out and its kernels run once (`GpuDevice.prepare`):
        the first save of its structure reuses all of it and loads no kernel."""
        with tree.collector_paused():
            tensors = [leaf.tensor for leaf in leaves]
            self.workers.prepare(tensors)
            if self.codec.pending:  # codec: auto decides now, not beside training after the first save
                self.codec.at_reserve(make_plan(leaves, self.codec.codec, self.config.chunk_size,
                                                self.workers.gpu_ready))
            t1 = time.perf_counter()
            made = self._plans.plan(leaves, self.codec.codec, self.config.chunk_size, self.workers.gpu_ready,
                                    structure)
            walked_ms = 1e3 * (walked_s + time.perf_counter() - t1)  # (a guarded save's call learns by the same rule)
            if self._guards and not (rank_only and self._walk_auto) and self._walk_defers(walked_ms):
                self._learn(made)
                self._say_defers("reserve()", "the first", len(made.tensors), walked_ms)
            for index, plans in made.gpu.items():
                self.workers.device(index).prepare(plans, tensors)
            copied, rest = self._cpu_copies.split(made.cpu)
            if copied:
                self._cpu_copies.layout(copied)
            cpu.prepare(rest)
        tree.age_kept()  # (last: what the caller made for the saves, under torchrun too, is made by now)

    def wait_reserved(self, timeout: float | None = None) -> bool:
        """Wait until the last `reserve`'s background work is done (True), at most `timeout` s."""
        return self._reservation.wait(timeout)

    def on_commit(self, hook: Callable[[int], None]) -> None:
        """Call `hook(step)` once each step is committed (on this node), before anyone waiting
        on it sees it persisted: the migrator queues it so."""
        self._hooks.append(hook)

    def notify_committed(self, step: int) -> None:
        """`step` is committed on this node's fast tier (a distributed save commits it itself)."""
        self.failures.committed()
        for hook in self._hooks:
            hook(step)
        retain_without_migrator(self.config, self.catalog.get)

    def bind_rank(self, rank: int, world_size: int) -> None:
        """This pipeline writes rank `rank`'s files of a world of `world_size` (torch.distributed)."""
        if (rank, world_size) != (self.rank, self.world_size):
            with self._lock:
                if self._inflight:
                    raise TieredError(f"cannot become rank {rank} of {world_size} with saves in flight")
            self.rank, self.world_size = rank, world_size

    def check(self, step: int) -> None:
        """Before any save: the pipeline is open, earlier background failures are raised, the step is valid."""
        if self.closed:
            raise TieredError("this Engine is closed")
        self.raise_failure()
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be an integer from 0 to {MAX_STEP} (the format names steps with 12 "
                             f"digits), got {step!r}")

    def record_failure(self, err: BackgroundSaveError, tier: Any = None) -> str:
        """A save failed in the background: record it; `on_save_failure` decides whether the next
        `save()` or `wait()` raises. Returns what happens next, for the log."""
        self.records.append(failure_record(err.step, (tier or self.tier).name, err))
        return self.failures.record(err)

    def raise_failure(self) -> None:
        """Raise the failure `on_save_failure` keeps for the next call, if any, once."""
        err = self.failures.take()
        if err is not None:
            raise err

    def track(self, thread: threading.Thread) -> None:
        """A background thread of a save (DCP's commit on another node) that `wait`/`close` join."""
        self._adopting.append(thread)

    def pending(self) -> list[int]:
        """Steps staged and not yet persisted (or failed)."""
        with self._lock:
            return sorted(self._inflight)

    # --- staging, in the caller's thread ---------------------------------------------------------
    def save(self, step: int, state_dict: Any, *, rank_only: bool = False, deferrable: bool = False) -> SaveHandle:
        """Stage `state_dict` and queue its writing. With `rank_only`, the writer stops after this
        rank's data file and index (``persisted`` resolves to a RankFiles), for a distributed
        save that commits the step once every rank's files are durable. `deferrable`: a
        distributed save (rank_only), whose later saves may defer their walk and DCP's plan
        (`save_later`) where every guard says `defer_walk=True`; under the default guard they
        stay in the call (docs/benchmarks.md)."""
        t0 = time.perf_counter()
        self._check_new(step)
        learned = self._learned
        if learned is not None and not rank_only and not self._walk_in_call and learned.fits(self._guards):
            return self._save_deferred(step, state_dict, learned, t0)
        self.wait_planned()
        skeleton, leaves = tree.flatten(state_dict, share=not rank_only)  # (DCP's items are its own)
        t1 = time.perf_counter()
        try:
            tier = self._tiers.begin(step, leaves, self.rank if rank_only else None)
        except (TieredError, OSError) as exc:
            return self._refused(step, exc, rank_only)
        t2 = time.perf_counter()
        try:
            plan = self._plan(tier, leaves, tree.structure_of(state_dict))
        except BaseException:  # (a leaf the format cannot store: nothing of the step is left behind)
            tier.discard_rank(step, self.rank) if rank_only else tier.discard(step)
            raise
        handle = SaveHandle(step, raw_bytes=plan.raw_bytes, tier=tier.name,
                            _reported=self._reported)
        t3 = time.perf_counter()  # (planning in all, and of it: the walk of the state, the tier's step made)
        handle.timings.update(plan_ms=1e3 * (t3 - t0), flatten_ms=1e3 * (t1 - t0), begin_ms=1e3 * (t2 - t1))
        handle.staged.add_done_callback(
            lambda _, t=handle.timings: t.setdefault("staged_ms", 1e3 * (time.perf_counter() - t0)))
        walked_ms = 1e3 * (t1 - t0 + t3 - t2)  # (the walk and the plan, not the tier's step made between them)
        # (for deferred saves only; a distributed one's with `defer_walk=True` on every guard alone)
        learn = (not rank_only or deferrable and not self._walk_auto) and tier is self.tier and \
            self._walk_defers(walked_ms)
        overlapped = self._overlapped(plan, learn) if self._guards else None
        if learn:
            self._say_defers("save()", "the next", len(plan.tensors), walked_ms)
        job = Job(step, skeleton, overlapped or plan, handle, device_io=bool(plan.gpu), tier=tier,
                   rank_only=rank_only)
        handle.on_wait = job.hurry.set
        with self._lock:
            self._inflight[step] = handle
        self._jobs.put(job)
        if tier is self.tier:
            try:
                self.codec.after_save(job.plan, handle)  # (the first save: samples the state for codec: auto)
            except BaseException as exc:  # the job is queued: the writer must hear of it, or waits for ever
                job.abort(exc, reported=True)
                raise
        if self._guards:  # one thread stages, in save order: a strict save too, then waited for here
            job.after = {index: recorded(index) for index in plan.gpu}
            job.overlapped = overlapped is not None
            with self._lock:
                self._unordered.append(job)
            self._stage_queue.put(job)
            if overlapped is None:
                self.order_updates()
        else:
            self._stage(job, strict=True)
        handle.stall_s = time.perf_counter() - t0
        return handle

    def _plan(self, tier: Any, leaves: list[tree.Leaf], structure: Any) -> SavePlan:
        """The plan of a save to `tier` (`structure`: tiered.format.tree.Flat's)."""
        if tier is self.tier:
            return self._plans.plan(leaves, self.codec.codec, self.config.chunk_size, self.workers.gpu_ready, structure)
        codec = self.config.tiers[1].codec  # (through host memory, in a codec every machine decodes)
        return make_plan(leaves, codec if codec in CPU_DECODABLE_CODECS else "zstd", self.config.chunk_size,
                         gpu_codecs=False)

    def _overlapped(self, plan: SavePlan, learn: bool) -> SavePlan | None:
        """The plan an overlapped save stages (unguarded tensors cloned), or None: stage it strictly.
        `learn`: what it found is what the next save's call clones (`_learn`)."""
        got, why, unguarded = overlap_plan(plan, Guarded(self._guards), _free_gpu)
        if got is None:
            self._learned = None
            if not self._logged_strict:
                self._logged_strict = True
                log.warning("tiered: saves are staged strictly (save() waits for the GPU to read the state), not "
                            "overlapped with the next forward and backward: %s. Guard the optimizer that updates it, "
                            "or save it separately", why)
        elif learn:
            self._learn(plan, unguarded)
        return got

    def _learn(self, plan: SavePlan, unguarded: list[int] | None = None) -> None:
        """Keep what the next save's call needs to walk nothing (`tiered.stage.overlap.Learned`); a state
        that would be staged strictly teaches nothing."""
        if unguarded is None:
            unguarded = to_clone(plan.tensors, Guarded(self._guards), _free_gpu)[0]
        self._learned = None if unguarded is None else \
            Learned(self._guards, plan.tensors, unguarded, plan.gpu, plan.raw_bytes)

    def save_later(self, step: int, prepare: Callable[[dict[str, float]], Any]) -> SaveHandle | None:
        """A distributed save's call (`rank_only`) once an earlier one learned its state
        (`save(deferrable=True)`, with `guard(optimizer, defer_walk=True)` on every guard): as a
        deferred guarded save, whose stager thread first calls `prepare(timings)` for this rank's
        flat state (DCP's plan and items: tiered.distributed.saver; `timings`: the handle's, for its
        parts). None where the call must walk and plan (nothing learned, or a guard without
        `defer_walk=True`)."""
        t0 = time.perf_counter()
        learned = self._learned
        if learned is None or not self.defers(learned):
            return None
        self._check_new(step)
        return self._save_deferred(step, prepare, learned, t0, rank_only=True)

    def defers(self, learned: Learned | None = None) -> bool:
        """A distributed save's call would plan nothing now (`save_later`)."""
        learned = learned or self._learned
        return learned is not None and not self._walk_in_call and not self._walk_auto and learned.fits(self._guards)

    def _refused(self, step: int, exc: BaseException, rank_only: bool) -> SaveHandle:
        """The tier refused the step outright (permission denied, a filesystem gone). With
        `on_save_failure: warn` that is a failed save like one that fails in the background: its
        handle holds the failure, and training goes on. A committed step is the caller's error."""
        if rank_only or self.failures.policy == "raise" or self.tier.has_step(step):
            raise exc
        err = BackgroundSaveError(step, exc)
        log.error("tiered: %s. The step is not committed; %s", err, self.record_failure(err))
        handle = SaveHandle(step, raw_bytes=0, tier=self.tier.name, _reported=self._reported)
        handle.staged.set_exception(err)
        handle.persisted.set_exception(err)
        return handle

    def _check_new(self, step: int) -> None:
        self.check(step)
        with self._lock:
            if step in self._inflight:
                raise TieredError(f"step {step} is already being saved")

    def _save_deferred(self, step: int, state_dict: Any, learned: Learned, t0: float,
                       rank_only: bool = False) -> SaveHandle:
        """A guarded save whose state's structure the last one learned: clone what that one found
        unguarded, record where training's streams are, and return; the stager thread walks and
        plans the state (`_plan_deferred`; with `rank_only`, `state_dict` is the callable that
        makes it) before it reads it, and the guarded optimizer step waits for both."""
        if not rank_only and self.tier.has_step(step):
            self.tier.begin_step(step)  # (refuses a committed step, here and now)
        handle = SaveHandle(step, raw_bytes=learned.raw_bytes, tier=self.tier.name, _reported=self._reported)
        handle.staged.add_done_callback(
            lambda _, t=handle.timings: t.setdefault("staged_ms", 1e3 * (time.perf_counter() - t0)))
        job = Job(step, None, None, handle, device_io=bool(learned.devices), state=state_dict,
                   clones=learned.clone_now(), rank_only=rank_only, overlapped=True)
        handle.on_wait = job.hurry.set
        job.after = {index: recorded(index) for index in learned.devices}  # (after the clones)
        with self._lock:
            self._inflight[step] = handle
            self._unordered.append(job)
        self._jobs.put(job)
        self._stage_queue.put(job)
        handle.stall_s = time.perf_counter() - t0
        handle.timings["call_ms"] = 1e3 * handle.stall_s
        return handle

    def _plan_deferred(self, job: Job) -> None:
        """On the stager thread (the collector paused), for a deferred save: walk and plan its state as
        `save` would, and replace its unguarded tensors with the clones save() made
        (tiered.stage.overlap.deferred_plan). A failure is handed to the writer, as `_stage`'s."""
        t0 = time.perf_counter()
        handle = job.handle
        try:
            state = job.state(handle.timings) if job.rank_only else job.state  # (distributed: DCP's items)
            skeleton, leaves = tree.flatten(state, share=not job.rank_only)
            job.state = None
            t1 = time.perf_counter()
            tier = job.tier = self._tiers.begin(job.step, leaves, self.rank if job.rank_only else None)
            t2 = time.perf_counter()
            plan = self._plan(tier, leaves, tree.structure_of(state))
            del state
            for index in plan.gpu:
                if index not in job.after:  # (a GPU the last save had no tensor on: read once it is idle)
                    torch.cuda.synchronize(index)
                    job.after[index] = None
            got = deferred_plan(plan, Guarded(self._guards), _free_gpu, job.clones,
                                lambda t: clone_after(t, job.after, lambda i: self.workers.device(i).stream))
            job.clones, job.held = {}, [plan.tensors[i] for i in got.new]
            if got.why:  # (too large to clone: the next save is planned in its call, and staged strictly)
                self._learned = None
            elif tier is self.tier:
                self._learn(plan, got.unguarded)
            if got.new and (got.why or not self._logged_new):
                self._logged_new = True
                say_new(job.step, got, tree.path_str(leaves[got.new[0]].path))
        except BaseException as exc:
            job.abort(exc, reported=False)
            raise
        job.skeleton, job.plan, job.device_io = skeleton, got.plan, bool(plan.gpu)
        handle.raw_bytes, handle.tier = plan.raw_bytes, tier.name
        handle.timings.update(stager_plan_ms=1e3 * (time.perf_counter() - t0), flatten_ms=1e3 * (t1 - t0),
                              begin_ms=1e3 * (t2 - t1))
        if tier is self.tier:
            self.codec.after_save(plan, handle)

    def wait_planned(self) -> None:
        """Before a save plans on the caller's thread: every deferred save is planned (one plan
        cache, and a distributed save's collectives, on one thread at a time), and so is `reserve`."""
        self._reservation.wait()
        with self._lock:
            jobs = [job for job in self._unordered if job.plan is None]
        for job in jobs:
            job.hurry.set()
            job.enqueued.wait()

    def _stage(self, job: Job, strict: bool = False) -> None:
        """Stage the job's tensors (the caller's thread, or the stager's once an optimizer is
        guarded), then hand the writer the end of its segments. A failure is handed to the writer
        too; `strict`: the caller raises it, so the writer does not record it again."""
        plan, handle, events = job.plan, job.handle, []
        try:
            for index, plans in plan.gpu.items():
                device = self.workers.device(index)
                ev = device.stage(plans, plan.tensors, job.segments.put, job.go.set,
                                  after=job.after[index] if job.after else None)
                events.append(ev)
                job.reads.append((index, ev))
                handle.timings.update({f"cuda:{index}.{k}": v for k, v in device.timings.items()})
            t1 = time.perf_counter()
            copied, rest = self._cpu_copies.split(plan.cpu)
            if copied:
                copies: dict[str, float] = {}
                self._cpu_copies.stage(copied, plan.tensors, job.segments.put, job.go.set, None, copies)
                handle.timings.update({f"cpu.{k}": v for k, v in copies.items()})
            cpu.snapshot(rest, plan.tensors, self.workers.host, self.config.chunk_size, job.segments.put, job.go.set)
            handle.timings["cpu_snapshot_ms"] = 1e3 * (time.perf_counter() - t1)
        except BaseException as exc:
            job.abort(exc, reported=strict)
            raise
        job.segments.put(END)
        job.go.set()
        if events:  # the GPU reads the tensors until these events: hold them until then
            threads.start(complete_after, events, handle.staged, job.drop_tensors, name="tiered-staged")
        else:
            job.drop_tensors()  # copied: the state may go
            settle(handle.staged, job.step)

    def wait(self) -> None:
        """Wait for every in-flight save to be persisted or failed; raise what `on_save_failure` keeps."""
        while self._adopting:  # dcp.save's steps, committed on this node once rank 0 has
            self._adopting.pop().join()
        self.settle()
        self.raise_failure()

    def settle(self) -> None:
        """Wait until every in-flight save is persisted or has failed; raise nothing."""
        while True:
            self._hurry_all()
            with self._lock:
                pending = list(self._inflight.values())
            if not pending:
                return
            for h in pending:
                h.persisted.exception()

    def close(self) -> None:
        """Stop the writer once its queue is done, and join the pipeline's other threads."""
        self.closed = True
        self._reservation.wait(raise_errors=False)
        self._hurry_all()
        if self._stager is not None:
            self._stage_queue.put(None)
            self._stager.join()
        self._jobs.put(None)
        self._writer.join()
        self._watch.stop()
        while self._adopting:
            self._adopting.pop().join()
        self.codec.join()

    def _placed(self) -> None:
        self.progress += 1

    def _steps_in_flight(self) -> list[int]:
        with self._lock:
            return sorted(self._inflight)

    def _reported(self, exc: BaseException) -> None:
        """A handle raised `exc` itself: the next save() or wait() does not raise it again."""
        self.failures.forget(exc)

    # --- the writer thread ----------------------------------------------------------------------
    def _writer_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run_job(job)
            del job

    def _run_job(self, job: Job) -> None:
        try:
            manifest = self._write(job)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the next save()/wait()
            drain(job)
            for _, ev in job.reads:  # the GPU may still read what was staged: wait before letting it go
                ev.synchronize()
            job.drop_tensors()
            if job.tier is not None:  # Uncommitted: invisible anyway; frees the space.
                job.tier.discard_rank(job.step, self.rank) if job.rank_only else job.tier.discard(job.step)
            err = BackgroundSaveError(job.step, exc)
            if not job.aborted:  # an aborted save() already raised its own error
                then = self.record_failure(err, job.tier)
                log.error("tiered: %s. The step is not committed and its partial files are removed; %s", err, then)
            with self._lock:
                self._inflight.pop(job.step, None)
            settle(job.handle.staged, exc=err)
            job.handle.persisted.set_exception(err)
            if not job.rank_only:
                retain_without_migrator(self.config, self.catalog.get)  # room for the next save
            return
        job.drop_tensors()
        if not job.rank_only:  # the migrator queues it before anyone can see the step persisted, so
            self.notify_committed(job.step)  # wait_migrated() after wait() always covers it
        with self._lock:
            self._inflight.pop(job.step, None)
        job.handle.persisted.set_result(manifest)

    def _write(self, job: Job) -> "Manifest | RankFiles":
        """Write the job's rank files; then, unless it is rank_only, commit the step."""
        files = write_rank(job, self.rank, self.config, self.workers, self._placed)
        return files if job.rank_only else commit_step(job, files, self.world_size, self.records, self.tier)


def _free_gpu(index: int) -> int:
    return torch.cuda.mem_get_info(index)[0]
