"""Engine: save / restore / latest_step / steps / wait / close.

`save()` plans the state, stages it (GPU: packed and compressed on a side stream, the compressed
copy being the snapshot; CPU: copied into host staging) and returns. A single background writer
thread then turns each staged segment into aligned extents of the rank's data file, fsyncs it,
writes the index, and commits the manifest. Its failures are kept and re-raised by the next
`save()` or `wait()`; the failed step never becomes visible because its manifest is never written.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import logging
import os
import queue
import shutil
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from tiered import checksum, cpu, tree
from tiered.config import CPU_DECODABLE_CODECS, Config, ConfigInput, load_config
from tiered.errors import (BackgroundSaveError, CheckpointNotFoundError, FormatError,
                           StateDictError, TieredError)
from tiered.format import (ALIGNMENT, ChunkRecord, Manifest, RankEntry, RankIndex, TensorRecord, data_file_name,
                           dtype_name, index_file_name, read_manifest, read_step)
from tiered.plan import PlanCache, SavePlan, make_plan
from tiered.staging import HostPool
from tiered.tiers.local import LocalTier
from tiered.units import format_size, round_up

log = logging.getLogger("tiered")
_END = object()


class _Abort:
    def __init__(self, exc: BaseException):
        self.exc = exc


@dataclass
class SaveHandle:
    """What `save()` returns. Two moments, two futures:

    - ``staged``: the state may change again (GPU: compression has read the tensors).
    - ``persisted``: the step is durable and committed on the fast tier, or on the next tier where
      ``on_fast_tier_error: next_tier`` sent it there (result: its Manifest; ``tier``: where).
    """

    step: int
    staged: Future = field(default_factory=Future)
    persisted: Future = field(default_factory=Future)
    stall_s: float = 0.0
    """Time `save()` blocked the caller."""
    raw_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    """Milliseconds spent in each phase of `save()` (plan, per-GPU stage phases, CPU snapshot)."""
    tier: str = ""
    """The name of the tier the step is written to."""
    _reported: Any = None
    """Called with the failure this handle raised: the engine then does not raise it again."""

    def wait(self, timeout: float | None = None) -> Manifest:
        """Block until persisted; return the committed manifest or raise the failure (once raised
        here, the next `save()` or `Engine.wait()` does not raise it again)."""
        try:
            return self.persisted.result(timeout)
        except BackgroundSaveError as exc:
            if self._reported is not None:
                self._reported(exc)
            raise

    def done(self) -> bool:
        return self.persisted.done()

    @property
    def manifest(self) -> Manifest:
        return self.persisted.result()


@dataclass
class _Job:
    step: int
    skeleton: Any
    plan: SavePlan
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

    def drop_tensors(self) -> None:
        """Forget the saved tensors once the step is written (or has failed): the engine must not
        keep a state alive that the caller has let go."""
        self.plan = SavePlan(gpu=self.plan.gpu, cpu=self.plan.cpu)


class Engine:
    """Checkpoint engine, one per process. Under torch.distributed (more than one rank), save and
    restore go through DCP's planner and tiered.dcp's storage (see tiered.distributed).

    Use as a context manager, or call `close()`: it waits for in-flight saves.
    """

    def __init__(self, config: Config):
        self.config = config
        fast = config.fast_tier
        self.tier = LocalTier(fast.name, fast.path, fast.direct_io)
        self._tiers: dict[str, Any] = {fast.name: self.tier}
        self.rank, self.world_size = 0, 1
        self._gpu_ready = gpu_stack_available()
        if torch.cuda.is_available() and not self._gpu_ready:
            log.warning("tiered: CUDA is available but nvCOMP or KvikIO is not installed: GPU tensors are copied "
                        "to host memory and compressed with zstd on the CPU. Install tiered[cu13] or tiered[cu12].")
        threads = config.zstd.threads or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiered-codec")
        self._host = HostPool(config.budgets.host_buffer, page=4096)
        self._devices: dict[int, Any] = {}
        self._plans = PlanCache()
        self._jobs: "queue.Queue[_Job | None]" = queue.Queue()
        self._inflight: dict[int, SaveHandle] = {}
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._api_lock = threading.RLock()  # save/restore/load from several threads run one at a time
        self._writer = threading.Thread(target=self._writer_loop, name="tiered-writer", daemon=True)
        self._writer.start()
        from tiered.probe import FastTierCodec

        self._codec = FastTierCodec(config, self.tier, self._pool, self._host, self._gpu_ready)
        self._migrator: Any = None
        self._dist: Any = None
        self._falling_back = False
        """The last save went to the next tier (on_fast_tier_error: next_tier)."""
        self._adopting: list[threading.Thread] = []
        """Threads committing dcp.save's steps on this node's tier once rank 0 has (tiered.dcp)."""
        if len(config.tiers) > 1 and config.migration == "in_process":
            from tiered.migrator import BackgroundMigrator, make_gpu_recoder

            self._migrator = BackgroundMigrator(config, self.get_tier, lambda: make_gpu_recoder(config))
        # A script that ends right after save() must not lose that checkpoint with the daemon writer.
        # threading's exit hooks run before concurrent.futures shuts its pools down (which would
        # refuse the codec work) and before atexit; fall back to atexit where they are missing.
        hook = getattr(threading, "_register_atexit", atexit.register)
        hook(_finish_at_exit, weakref.ref(self))

    @classmethod
    def from_config(cls, source: ConfigInput = None) -> "Engine":
        """An engine from a YAML path, a dict, or None for the embedded default (configs/local.yaml)."""
        return cls(load_config(source))

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_errors=exc_type is None)

    # --- queries -------------------------------------------------------------------------
    @property
    def gpu_codecs(self) -> bool:
        """GPU tensors are compressed on the GPU and written through KvikIO (CUDA, nvCOMP and KvikIO present)."""
        return self._gpu_ready

    @property
    def fast_codec(self) -> str:
        """The codec the next save uses for GPU tensors on the fast tier (CPU tensors get zstd
        where this is ans)."""
        return self._codec.codec

    def describe(self) -> str:
        """One line: where checkpoints go and how they are encoded on this machine."""
        codec = self._codec.codec
        auto = " (codec: auto; measured on the first save)" if self._codec.pending else ""
        how = (f"GPU tensors: {codec} on the GPU via KvikIO; CPU tensors: {'zstd' if codec == 'ans' else codec}"
               if self._gpu_ready else
               f"no GPU codecs here: every tensor is stored with {'zstd' if codec == 'ans' else codec} on the CPU")
        down = "".join(f" -> {t.name} ({t.kind})" for t in self.config.tiers[1:])
        return f"tier {self.tier.name!r} at {self.tier.root} ({how}{auto}){down}"

    def get_tier(self, name: str | None = None) -> Any:
        """A configured tier by name (default: the fast tier); created on first use."""
        if name is None:
            return self.tier
        with self._lock:  # the migrator thread and the caller may both ask first
            tier = self._tiers.get(name)
            if tier is None:
                cfg = next((t for t in self.config.tiers if t.name == name), None)
                if cfg is None:
                    raise KeyError(f"no tier named {name!r} in {self.config.source} "
                                   f"(tiers: {', '.join(t.name for t in self.config.tiers)})")
                from tiered.tiers import make_tier

                tier = self._tiers[name] = make_tier(cfg)
        return tier

    def committed(self, names: Sequence[str] | None = None) -> dict[str, list[int]]:
        """Committed steps on each tier (or on the tiers `names`), by tier name. A tier that
        cannot be listed now (S3 unreachable, say) is logged and left out."""
        out = {}
        for name in names or [t.name for t in self.config.tiers]:
            try:
                out[name] = self.get_tier(name).steps()
            except (TieredError, OSError) as exc:
                log.warning("tiered: cannot list tier %r: %s", name, exc)
        return out

    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps on a tier, ascending; default: on any tier (every restorable step)."""
        if tier is not None:
            return self.get_tier(tier).steps()
        if len(self.config.tiers) == 1:
            return self.tier.steps()
        return sorted(set().union(*self.committed().values()))

    def latest_step(self, tier: str | None = None) -> int | None:
        """The newest committed step on a tier; default: on any tier (what `restore()` picks)."""
        steps = self.steps(tier)
        return steps[-1] if steps else None

    # --- save ----------------------------------------------------------------------------
    def save(self, step: int, state_dict: Any) -> SaveHandle:
        """Snapshot `state_dict` as `step` and return once it may change again.

        GPU tensors: the current CUDA stream is made to wait until compression has read them, so
        later work on that stream (the training loop's) cannot change what is saved. Work on
        other streams must wait for ``handle.staged`` first. CPU tensors are copied before return.
        Raises the failure of an earlier save's background work, if any, before starting.
        """
        with self._api_lock:
            if self._distributed():
                self._check_save(step)
                return self._dist.save(step, state_dict)
            return self._save(step, state_dict)

    def _check_save(self, step: int) -> None:
        """Before any save: the engine is open, earlier background failures are raised, the step is valid."""
        self._check_open()
        self._raise_background_error()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")

    def _distributed(self) -> bool:
        """torch.distributed runs with several ranks: saves and restores go through DCP (tiered.distributed)."""
        if self._dist is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                return False
            from tiered.distributed import DistributedSaver

            self._dist = DistributedSaver(self)
        return True

    def _begin(self, step: int, leaves: Sequence[Any]) -> Any:
        """Start `step` on the tier that takes it and return that tier: the fast tier; with
        ``on_fast_tier_error: next_tier``, the next tier where the fast one cannot take the step
        (its step directory cannot be made: permission denied, read-only or missing filesystem;
        or it has less free space than the step may need)."""
        fast = self.tier
        if self.config.on_fast_tier_error == "fail" or fast.has_step(step):
            fast.begin_step(step)  # (a committed step is refused here, whatever the setting)
            return fast
        try:
            fast.begin_step(step)
            need = sum(-(-n // self.config.chunk_size) * ALIGNMENT + n
                       for n in (leaf.tensor.numel() * leaf.tensor.element_size() for leaf in leaves)) + (1 << 20)
            free = shutil.disk_usage(fast.root).free
            if free < need:
                fast.discard(step)
                raise TieredError(f"{fast.root}: {format_size(free)} free, and the step may need up to "
                                  f"{format_size(need)}")
        except (TieredError, OSError) as exc:
            other = self.get_tier(self.config.tiers[1].name)
            try:
                other.begin_step(step)
            except (TieredError, OSError) as exc2:
                raise TieredError(f"step {step}: the fast tier {fast.name!r} cannot take it ({exc}), and neither can "
                                  f"tier {other.name!r} ({exc2})") from None
            if not self._falling_back:
                log.warning("tiered: the fast tier %r cannot take step %d (%s): on_fast_tier_error is next_tier, so "
                            "it and the next saves go to tier %r, through host memory, until the fast tier takes "
                            "them again", fast.name, step, exc, other.name)
            self._falling_back = True
            return other
        if self._falling_back:
            log.warning("tiered: the fast tier %r takes saves again (from step %d)", fast.name, step)
            self._falling_back = False
        return fast

    def _save(self, step: int, state_dict: Any, *, rank_only: bool = False) -> SaveHandle:
        """Stage `state_dict` and queue its writing. With `rank_only`, the writer stops after this
        rank's data file and index (``persisted`` resolves to a RankFiles), for a distributed
        save that commits the step once every rank's files are durable."""
        t0 = time.perf_counter()
        self._check_save(step)
        with self._lock:
            if step in self._inflight:
                raise TieredError(f"step {step} is already being saved")
        skeleton, leaves = tree.flatten(state_dict)
        if rank_only:
            self.tier.begin_rank(step, self.rank)
            tier = self.tier
        else:
            tier = self._begin(step, leaves)
        if tier is self.tier:
            plan = self._plans.plan(leaves, self._codec.codec, self.config.chunk_size, self._gpu_ready)
        else:  # through host memory, in a codec every machine decodes (the slower tiers are portable)
            codec = self.config.tiers[1].codec
            plan = make_plan(leaves, codec if codec in CPU_DECODABLE_CODECS else "zstd", self.config.chunk_size,
                             gpu_codecs=False)
        handle = SaveHandle(step, raw_bytes=sum(p.nbytes for p in plan.all), tier=tier.name,
                            _reported=self._reported)
        handle.timings["plan_ms"] = 1e3 * (time.perf_counter() - t0)
        job = _Job(step, skeleton, plan, handle, device_io=bool(plan.gpu), tier=tier, rank_only=rank_only)
        with self._lock:
            self._inflight[step] = handle
        self._jobs.put(job)
        events = []
        try:
            for index, plans in plan.gpu.items():
                device = self._device(index)
                events.append(device.stage(plans, plan.tensors, job.segments.put, job.go.set))
                handle.timings.update({f"cuda:{index}.{k}": v for k, v in device.timings.items()})
            t1 = time.perf_counter()
            cpu.snapshot(plan.cpu, plan.tensors, self._host, self.config.chunk_size, job.segments.put, job.go.set)
            handle.timings["cpu_snapshot_ms"] = 1e3 * (time.perf_counter() - t1)
        except BaseException as exc:
            job.aborted = True
            job.segments.put(_Abort(exc))
            job.go.set()
            raise
        job.segments.put(_END)
        job.go.set()
        if tier is self.tier:
            self._codec.after_save(plan, handle)
        if events:
            threading.Thread(target=_complete_after, args=(events, handle.staged), daemon=True).start()
        else:
            _settle(handle.staged, step)
        handle.stall_s = time.perf_counter() - t0
        return handle

    def wait(self) -> None:
        """Wait for every in-flight save to be persisted; raise the first background failure."""
        while self._adopting:  # dcp.save's steps, committed on this node once rank 0 has
            self._adopting.pop().join()
        if self._dist is not None:  # distributed saves: committed by rank 0, in the background
            self._dist.wait()
        while True:
            with self._lock:
                pending = list(self._inflight.values())
            if not pending:
                break
            for h in pending:
                try:
                    h.persisted.result()
                except BaseException:  # noqa: BLE001 - recorded in self._error, raised below
                    pass
        self._raise_background_error()

    def close(self, raise_errors: bool = True) -> None:
        """Wait for in-flight saves and queued migrations, stop the threads, free staging memory."""
        if self._closed:
            return
        try:
            if raise_errors:
                self.wait()
            else:
                with self._lock:
                    pending = list(self._inflight.values())
                for h in pending:
                    h.persisted.exception()
        finally:
            self._closed = True
            self._jobs.put(None)
            self._writer.join()
            if self._dist is not None:
                self._dist.close()
            while self._adopting:
                self._adopting.pop().join()
            self._codec.join()
            if self._migrator is not None:
                self._migrator.stop()  # queued migrations finish first; a crash resumes next run
            self._pool.shutdown()
            self._devices.clear()

    # --- restore -------------------------------------------------------------------------
    def restore(self, state_dict: Any, step: int | None = None, *, strict: bool = True,
                tier: str | None = None) -> int:
        """Load `step` (default: the newest committed on any tier) into `state_dict` in place;
        return the step.

        Tensors present in `state_dict` receive the stored bytes where they are (GPU tensors are
        decoded on their GPU); entries missing from it (a fresh optimizer's state, say) are
        created on the device they were saved from, or the CPU. With `strict`, a tensor in
        `state_dict` that the checkpoint lacks is an error.

        Reads from `tier`, default the fastest tier holding the step. A chunk that fails its
        checksum there, or a missing file, is read from the next slower tier holding the step
        instead (logged); a tier whose copy cannot be opened at all is skipped the same way.
        """
        self._check_open()
        self._raise_background_error()
        t0 = time.perf_counter()
        with self._api_lock:
            if self._distributed():
                from tiered.distributed import agree_on_step

                step = agree_on_step(step, lambda: self._sources(None, tier)[0])
            step, order = self._sources(step, tier)
            if _saved_through_dcp(order, step):
                from tiered.distributed import restore_dcp

                restore_dcp(self, state_dict, step, order, strict=strict)
                source = order[0].name
            else:
                loaded, source = self._load(step, state_dict, strict=strict, device=None, order=order)
                tree.merge_into(state_dict, loaded)
        log.info("tiered: restored step %d from tier %r in %.2f s", step, source, time.perf_counter() - t0)
        return step

    def load(self, step: int | None = None, *, device: str | torch.device | None = None,
             tier: str | None = None) -> Any:
        """A fresh copy of a step's state (default: the newest on any tier), tensors on `device`
        or where they were saved. Reads and falls back as `restore` does."""
        self._check_open()
        with self._api_lock:
            step, order = self._sources(step, tier)
            return self._load(step, {}, strict=False, device=torch.device(device) if device is not None else None,
                              order=order)[0]

    def _sources(self, step: int | None, tier: str | None) -> tuple[int, list[Any]]:
        """The step to read and the tiers holding it committed, fastest first (from `tier` on,
        when one is named)."""
        from tiered.policy import latest_restorable

        names = [t.name for t in self.config.tiers]
        if tier is not None:
            self.get_tier(tier)  # names the known tiers when `tier` is not one
            names = names[names.index(tier):]
        # A single named tier is listed directly, so that a failure to list it is the error raised.
        committed = {tier: self.get_tier(tier).steps()} if tier is not None and len(names) == 1 else \
            self.committed(names)
        held = {n: set(steps) for n, steps in committed.items()}
        where = (f"tier {names[0]!r} ({self.get_tier(names[0]).root})" if len(names) == 1 else
                 "any tier (" + ", ".join(f"{n}: {self.get_tier(n).root}" for n in names) + ")")
        if step is None:
            step = latest_restorable(held) if tier is None else latest_restorable({tier: held.get(tier, set())})
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {where}")
        order = [self.get_tier(n) for n in names if step in held.get(n, ())]
        if not order or (tier is not None and order[0].name != tier):
            summary = _summarize(committed.get(names[0], [])) if len(names) == 1 else \
                "; ".join(f"{n}: {_summarize(committed.get(n, []))}" for n in names)
            raise CheckpointNotFoundError(f"step {step} is not committed in "
                                          f"{where if tier is None else f'tier {tier!r}'}; committed steps: {summary}")
        return step, order

    def read_index(self, step: int, tier: str | None = None) -> tuple[Manifest, RankIndex]:
        """A committed step's manifest and this rank's index, validated and cross-checked."""
        manifest, indexes = read_step(self.get_tier(tier), step)
        if manifest.world_size == 1:
            return manifest, indexes[0]
        found = [i for i in indexes if i.rank == self.rank]
        if not found:
            raise CheckpointNotFoundError(f"step {step} has no files of rank {self.rank}")
        return manifest, found[0]

    def _load(self, step: int, target: Any, *, strict: bool, device: torch.device | None,
              order: list[Any]) -> tuple[Any, str]:
        """Decode `step` from the first tier of `order` that opens; the rest stand in for its
        damaged chunks. Returns (state, name of the tier read)."""
        for i, tier in enumerate(order):
            try:
                manifest, indexes = read_step(tier, step)
                if manifest.dcp is not None:
                    raise FormatError(f"{tier.describe(step, 'MANIFEST.json')}: step {step} was saved through "
                                      "torch.distributed.checkpoint: load it into a state_dict with Engine.restore "
                                      "or dcp.load(..., storage_reader=tiered.dcp.TieredStorageReader(...))")
                index = indexes[0]  # saved by one process; every rank restores the same state
                break
            except (TieredError, OSError) as exc:
                if i + 1 == len(order):
                    raise
                log.warning("tiered: step %d: cannot open it on tier %r (%s); reading tier %r instead", step,
                            tier.name, exc, order[i + 1].name)
        from tiered.restore import ChunkRepair, decode_rank

        repair = ChunkRepair(step, 0, tier.name, order[i + 1:], self.config.zstd, index.chunk_size)
        _, leaves = tree.flatten(target)
        targets = {tree.path_str(leaf.path): leaf for leaf in leaves}
        dests: dict[int, torch.Tensor] = {}
        for rec in index.tensors:
            leaf = targets.pop(rec.name, None)
            if leaf is not None:
                t = leaf.tensor
                if t.dtype != rec.torch_dtype or tuple(t.shape) != rec.shape:
                    raise StateDictError(f"{rec.name}: step {step} stores {rec.dtype}{list(rec.shape)}, but the "
                                         f"state_dict has {dtype_name(t.dtype)}{list(t.shape)}")
                if not leaf.is_numpy:
                    dests[rec.index] = t
                    continue
            where = device or (leaf.tensor.device if leaf is not None else _saved_device(rec.device))
            dests[rec.index] = torch.empty(rec.shape, dtype=rec.torch_dtype, device=where)
        if strict and targets:
            raise StateDictError(f"step {step} has no entry for {_summarize(sorted(targets))} of the given state_dict "
                                 "(pass strict=False to leave them as they are)")
        try:
            decode_rank(step, index, dests, tier, repair if repair else None, gpu_ready=self._gpu_ready,
                        device=self._device, pool=self._pool, settings=self.config.zstd)
        finally:
            repair.close()
        numpy_leaves = {rec.index for rec in index.tensors if rec.is_numpy}
        try:
            return tree.decode(index.skeleton,
                               lambda i: dests[i].numpy() if i in numpy_leaves else dests[i]), tier.name
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise FormatError(f"{tier.describe(step, index_file_name(0))}: skeleton: {exc}") from None

    # --- internals -----------------------------------------------------------------------
    def _bind_rank(self, rank: int, world_size: int) -> None:
        """This engine writes rank `rank`'s files of a world of `world_size` (torch.distributed)."""
        if (rank, world_size) != (self.rank, self.world_size):
            with self._lock:
                if self._inflight:
                    raise TieredError(f"cannot become rank {rank} of {world_size} with saves in flight")
            self.rank, self.world_size = rank, world_size

    def _device(self, index: int):
        dev = self._devices.get(index)
        if dev is None:
            from tiered.gpu import GpuDevice

            dev = self._devices[index] = GpuDevice(index, self.config.chunk_size, self.config.budgets,
                                                  self.config.zstd, self._host)
        return dev

    def _check_open(self) -> None:
        if self._closed:
            raise TieredError("this Engine is closed")

    def _reported(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is exc:
                self._error = None

    def _raise_background_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def _writer_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run_job(job)
            del job

    def _run_job(self, job: _Job) -> None:
        try:
            manifest = self._write(job)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the next save()/wait()
            _drain(job)
            job.drop_tensors()
            # Uncommitted: invisible anyway; frees the space.
            job.tier.discard_rank(job.step, self.rank) if job.rank_only else job.tier.discard(job.step)
            err = BackgroundSaveError(job.step, exc)
            if not job.aborted:
                log.error("tiered: %s", err)
            with self._lock:
                if not job.aborted:  # an aborted save() already raised its own error
                    self._error = self._error or err
                self._inflight.pop(job.step, None)
            _settle(job.handle.staged, exc=err)
            job.handle.persisted.set_exception(err)
            return
        job.drop_tensors()
        if self._migrator is not None and not job.rank_only:  # queued before anyone can see the step persisted, so
            self._migrator.submit(job.step)  # wait_migrated() after wait() always covers it
        with self._lock:
            self._inflight.pop(job.step, None)
        job.handle.persisted.set_result(manifest)

    def wait_migrated(self, timeout: float | None = None) -> None:
        """Wait until every committed step queued for migration is on every tier; raise the
        first migration failure since the last call. A failed step stays queued and is retried
        (5 s, doubling to 5 min): after its failure is raised, a later call waits for the retry."""
        self.wait()
        if self._migrator is not None:
            self._migrator.wait(timeout)

    def _write(self, job: _Job) -> "Manifest | RankFiles":
        """Write the job's rank files; then, unless it is rank_only, commit the step."""
        files = self._write_rank(job)
        if job.rank_only:
            return files
        manifest = Manifest(
            step=job.step, world_size=self.world_size, ranks=(files.entry,), raw_bytes=files.raw_bytes,
            stored_bytes=files.stored_bytes, created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            writer=f"tiered {_version()}")
        job.tier.commit(job.step, manifest.to_json())
        log.info("tiered: step %d committed%s: %s -> %s (%.1f%% saved), save() blocked %.1f ms, durable after %.2f s "
                 "[%s]", job.step, "" if job.tier is self.tier else f" on tier {job.tier.name!r}",
                 format_size(job.handle.raw_bytes), format_size(files.stored_bytes), 100 * manifest.saved_fraction,
                 1e3 * job.handle.stall_s, time.perf_counter() - job.started, files.index.io)
        return manifest

    def _write_rank(self, job: _Job) -> "RankFiles":
        job.go.wait()
        data_name = data_file_name(self.rank)
        writer = job.tier.open_data_writer(job.step, data_name, device=job.device_io)
        chunks: dict[int, list[ChunkRecord]] = {p.index: [] for p in job.plan.all}
        order: list[int] = []
        end = 0

        def place(ref: Any, size: int, crc: int) -> int:
            """Next aligned offset in the data file for chunk `ref`; records it."""
            nonlocal end
            offset = end
            if not chunks[ref.plan.index]:
                order.append(ref.plan.index)
            chunks[ref.plan.index].append(ChunkRecord(offset, size, ref.raw_size, crc))
            end += round_up(size, ALIGNMENT)
            return offset

        try:
            while True:
                seg = job.segments.get()
                if seg is _END:
                    job.staging_over = True
                    break
                if isinstance(seg, _Abort):
                    job.staging_over = True
                    raise TieredError(f"staging failed: {seg.exc!r}")
                if isinstance(seg, cpu.RawSegment):
                    try:
                        encoded = cpu.encode_segment(seg, self._pool, self.config.zstd)
                    finally:
                        seg.release()
                    for ref, (padded, size, crc) in zip(seg.chunks, encoded):
                        writer.write_host(place(ref, size, crc), padded)
                else:
                    try:
                        _write_rows(seg, writer, place)
                    finally:
                        seg.release()
            data_bytes = writer.close()
        except BaseException:
            writer.abort()
            raise
        plans = {p.index: p for p in job.plan.all}
        ordered = [i for i in plans if not chunks[i]] + order
        index = RankIndex(
            rank=self.rank, data_file=data_name, data_bytes=data_bytes, chunk_size=self.config.chunk_size,
            skeleton=job.skeleton, io=writer.io_mode,
            tensors=tuple(TensorRecord(index=i, name=plans[i].name, dtype=dtype_name(plans[i].dtype),
                                       shape=plans[i].shape, device=plans[i].device,
                                       is_numpy=plans[i].is_numpy, codec=plans[i].spec, chunks=tuple(chunks[i]))
                          for i in ordered))
        raw_index = index.to_json()
        index_name = index_file_name(self.rank)
        job.tier.write_file(job.step, index_name, raw_index)
        return RankFiles(entry=RankEntry(self.rank, index_name, len(raw_index), checksum.wsum64(raw_index), data_name,
                                         data_bytes),
                         index=index, raw_bytes=job.handle.raw_bytes,
                         stored_bytes=sum(c.size for cs in chunks.values() for c in cs))


def _saved_through_dcp(order: Sequence[Any], step: int) -> bool:
    """Whether `step` was saved through DCP, from the first of `order` whose manifest reads (a
    damaged one is left to the restore's own fallback to report)."""
    for tier in order:
        try:
            return read_manifest(tier, step).dcp is not None
        except (TieredError, OSError):
            continue
    return False


@dataclass(frozen=True)
class RankFiles:
    """One rank's durable files of a step, before the step is committed."""

    entry: RankEntry
    index: RankIndex
    raw_bytes: int
    stored_bytes: int


def _write_rows(seg: Any, writer: Any, place: Any) -> None:
    """Checksum a wave of compressed rows and write each row's aligned extent."""
    sizes = seg.sizes()
    if seg.on_gpu:
        sums = seg.device.finish_rows(seg, sizes)
        extents = [round_up(n, ALIGNMENT) for n in sizes]
        # Chunks are placed end to end, so a run of rows is one extent of the file: gathered into
        # a staging buffer on the GPU, it goes out as one large write (KvikIO splits it into tasks
        # for its threads) instead of one write per chunk.
        for i, k, buf, slot in seg.device.coalesce(seg, extents, writer):
            offset = place(seg.chunks[i], sizes[i], sums[i])
            for r in range(i + 1, k):
                place(seg.chunks[r], sizes[r], sums[r])
            seg.device.hold(slot, writer, writer.write_device(offset, buf))
            if slot < 0:
                writer.wait()  # written straight from the row, which goes back to the slab after this
        return
    seg.ready.synchronize()
    rows = seg.rows.numpy()
    for i, ref in enumerate(seg.chunks):
        row, n = rows[i], sizes[i]
        row[n:round_up(n, ALIGNMENT)] = 0
        writer.write_host(place(ref, n, checksum.wsum64(row[:n])), memoryview(row[:round_up(n, ALIGNMENT)]))


def _finish_at_exit(ref: "weakref.ref[Engine]") -> None:
    engine = ref()
    if engine is None or engine._closed:
        return
    with engine._lock:
        pending = sorted(engine._inflight)
    if pending:
        log.warning("tiered: waiting for in-flight saves of steps %s before exit", pending)
    engine.close(raise_errors=False)


def _drain(job: _Job) -> None:
    """After a failure: release every staged segment still coming, so save() never deadlocks."""
    job.go.wait()
    while not job.staging_over:
        seg = job.segments.get()
        if seg is _END or isinstance(seg, _Abort):
            job.staging_over = True
        else:
            seg.release()


def _settle(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Resolve `fut` unless already resolved (save() and the writer race to settle `staged`)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def _complete_after(events: Sequence[Any], fut: Future) -> None:
    try:
        for ev in events:
            ev.synchronize()
        _settle(fut, True)
    except BaseException as exc:  # noqa: BLE001
        _settle(fut, exc=exc)


def gpu_stack_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import kvikio  # noqa: F401
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


def _saved_device(device: str) -> torch.device:
    try:
        d = torch.device(device)
    except RuntimeError:
        return torch.device("cpu")
    if d.type == "cuda" and torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count():
        return d
    return torch.device("cpu")


def _summarize(items: Sequence[Any], n: int = 8) -> str:
    if not items:
        return "none"
    shown = ", ".join(str(x) for x in items[:n])
    return shown + (f", ... ({len(items)} in all)" if len(items) > n else "")


def _version() -> str:
    from tiered import __version__

    return __version__
