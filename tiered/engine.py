"""Engine: save / restore / latest_step / steps / wait / close: the face over the pipelines.

    Engine
      catalog   tiered.tiers.catalog.TierCatalog    which committed steps each tier holds; restore order
      workers   tiered.gpu.runtime.Workers          codec pool, pinned host pool, one GpuDevice per GPU
      saves     tiered.save.pipeline.SavePipeline   plan -> stage -> write -> fsync -> index -> commit
      restorer  tiered.restore.pipeline.Restorer    read plan -> fetch (+ fallback) -> verify -> decode -> place
      migrator  tiered.migrate                      copies committed steps down the tiers

`save()` returns once the state may change again (GPU: the compressed copy is the snapshot); the writer
thread does the rest. Under torch.distributed, save and restore go through DCP's planner (distributed.saver).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any, Sequence

import torch

from tiered.config import Config, ConfigInput, load_config
from tiered.errors import TieredError
from tiered.format import tree
from tiered.format.manifest import Manifest, RankIndex
from tiered.gpu.runtime import Workers
from tiered.observe.records import read_records, records_root
from tiered.restore.pipeline import Restorer
from tiered.save.handle import SaveHandle
from tiered.save.pipeline import SavePipeline
from tiered.tiers.catalog import TierCatalog, saved_through_dcp
from tiered.tiers.retention import reclaim_debris_in_background

__all__ = ["Engine", "SaveHandle"]

log = logging.getLogger("tiered")


class Engine:
    """Checkpoint engine, one per process: a context manager, or call `close()` (it waits for saves in flight)."""

    def __init__(self, config: Config):
        self.config = config
        self.catalog = TierCatalog(config)
        self.tier = self.catalog.fast
        """The node-local tier every save is written to first."""
        self.reclaimed = reclaim_debris_in_background(self.tier)  # what stopped writers left there
        self.workers = Workers(config)
        self.saves = SavePipeline(config, self.catalog, self.workers)
        self.restorer = Restorer(config, self.catalog, self.workers)
        self._closed = False
        self._api_lock = threading.RLock()  # save/restore/load from several threads run one at a time
        self._dist: Any = None
        self._migrator: Any = None
        if len(config.tiers) > 1 and config.migration == "process" and config.document is not None:
            if os.environ.get("LOCAL_RANK", "0") == "0":  # one migrator process per node: the first local rank's
                from tiered.migrate.process import MigratorProcess

                self._migrator = MigratorProcess(config)
                self.saves.on_commit(self._migrator.submit)
        elif len(config.tiers) > 1 and config.migration in ("in_process", "process"):  # (a Config built in code
            # has no document for a child process to read: its migrator runs in this process)
            from tiered.migrate.migrator import BackgroundMigrator, make_gpu_recoder

            self._migrator = BackgroundMigrator(config, self.catalog.get, lambda: make_gpu_recoder(config))
            self.saves.on_commit(self._migrator.submit)
        # A script ending right after save() keeps that checkpoint: threading's exit hooks run before
        # concurrent.futures shuts its pools (atexit where they are missing).
        getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit, weakref.ref(self))

    @classmethod
    def from_config(cls, source: ConfigInput = None) -> "Engine":
        """An engine from a YAML path, a dict, or None for the embedded default (configs/local.yaml)."""
        return cls(load_config(source))

    __enter__ = lambda self: self  # noqa: E731
    __exit__ = lambda self, exc_type, exc, tb: self.close(raise_errors=exc_type is None)  # noqa: E731

    # --- queries -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """The rank whose files this engine writes and reads (0 without torch.distributed)."""
        return self.saves.rank

    world_size = property(lambda self: self.saves.world_size)

    @property
    def gpu_codecs(self) -> bool:
        """GPU tensors are compressed on the GPU and written through KvikIO (CUDA, nvCOMP and KvikIO present)."""
        return self.workers.gpu_ready

    @property
    def fast_codec(self) -> str:
        """The codec the next save uses for GPU tensors on the fast tier (CPU ones: zstd for ans)."""
        return self.saves.codec.codec

    def describe(self) -> str:
        """One line: where checkpoints go and how they are encoded on this machine."""
        codec = self.saves.codec.codec
        auto = " (codec: auto; measured at reserve() or on the first save)" if self.saves.codec.pending else ""
        how = (f"GPU tensors: {codec} on the GPU via KvikIO; CPU tensors: {'zstd' if codec == 'ans' else codec}"
               if self.gpu_codecs else
               f"no GPU codecs here: every tensor is stored with {'zstd' if codec == 'ans' else codec} on the CPU")
        down = "".join(f" -> {t.name} ({t.kind})" for t in self.config.tiers[1:])
        return f"tier {self.tier.name!r} at {self.tier.root} ({how}{auto}){down}"

    def get_tier(self, name: str | None = None) -> Any:
        """A configured tier by name (default: the fast tier); created on first use."""
        return self.catalog.get(name)

    def committed(self, names: Sequence[str] | None = None) -> dict[str, list[int]]:
        """Committed steps on each tier (or on `names`); a tier that cannot be listed now is logged, left out."""
        return {n: s for n, s in self.catalog.committed(names).items() if s is not None}

    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps on a tier, ascending; default: on any tier (every restorable step)."""
        return self.catalog.steps(tier)

    def latest_step(self, tier: str | None = None) -> int | None:
        """The newest committed step on a tier; default: on any tier (what `restore()` picks)."""
        return self.catalog.latest_step(tier)

    def stats(self) -> list[dict[str, Any]]:
        """The records every save and migration of these checkpoints left (tiered.observe.records), oldest first."""
        return read_records(records_root(self.config))

    def read_index(self, step: int, tier: str | None = None) -> tuple[Manifest, RankIndex]:
        """A committed step's manifest and this rank's index, validated and cross-checked."""
        return self.restorer.read_index(step, tier, self.rank)

    # --- save ----------------------------------------------------------------------------
    def save(self, step: int, state_dict: Any, *, local: bool = False) -> SaveHandle:
        """Snapshot `state_dict` as `step` and return once it may change again.

        GPU tensors: the current CUDA stream is made to wait until compression has read them, so
        later work on that stream (the training loop's) cannot change what is saved. Work on
        other streams must wait for ``handle.staged`` first. CPU tensors are copied before return
        (after `guard(optimizer)`: it returns before the state is read; see there). Raises the
        failure of an earlier save's background work, if any. `local`: this rank alone saves its
        whole state, also under torch.distributed (replicated state saved from rank 0 only)."""
        with self._api_lock, tree.collector_paused():  # thousands of small objects: no full collections inside
            if not local and self._distributed():
                self.saves.check(step)
                return self._dist.save(step, state_dict)
            return self.saves.save(step, state_dict)

    def guard(self, optimizer: Any, *, defer_walk: bool | None = None, stage_after_ms: float | str = "auto") -> Any:
        """Overlap saves with the next forward and backward, in one line for the common loop.

        From now on `save()` returns at once: the state is read on a side stream (another thread
        issues the work) while training runs on, and `optimizer.step()` (what changes parameters and
        optimizer state) first makes its stream wait until that is done. The rest of the state
        (buffers, an EMA copy) is cloned in `save()` (tiered.stage.overlap; beyond a limit the save is
        strict, logged once). Once a walk took 6 ms (a call's, or `reserve`'s after this; one
        process), later calls leave it to that thread, before the optimizer step: until then the
        state's dicts and non-tensor values must not change (`defer_walk=True`: from the first save
        or `reserve` after this, under torchrun DCP's plan too; False: never). `stage_after_ms`:
        that thread starts a save no sooner, unless the step or a wait comes first ("auto": sized
        from the loop's step time, tiered.stage.stage_after; 0: at once). Guarded tensors changed other
        than by `optimizer.step()` need `order_updates()` first. `remove()` makes saves strict."""
        return self.saves.guard(optimizer, defer_walk, stage_after_ms)

    def reserve(self, state: Any, *, local: bool = False) -> None:
        """Start pinning host staging memory for saves of `state` (a state dict, or its size in
        bytes) now, in the background, rather than during the first save that needs it.

        Call it once the state exists (after the first step: the optimizer makes its state), after
        `guard`. Given the state dict it also decides `codec: auto` from a sample, plans, lays out its
        saves and runs their kernels once, on another thread (the call walks it); under torch.distributed
        it plans with DCP first, so every rank calls it, as `save` (`local`: as `save(..., local=True)`)."""
        if not isinstance(state, int):
            with self._api_lock, tree.collector_paused():
                state = (self._dist.reserve(state) if not local and self._distributed()
                         else self.saves.reserve(state))
        self.workers.host.want(state)

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Wait until `reserve`'s work is done, its host memory pinned and the save kernels compiled (True); `timeout`: s."""
        t0 = time.monotonic()
        return self.saves.wait_reserved(timeout) and self.workers.wait_ready(timeout and max(0.0, timeout + t0 - time.monotonic()))

    def order_updates(self) -> None:
        """Order the current CUDA streams after every guarded save's reads (what a guarded optimizer step does)."""
        self.saves.order_updates()

    def _distributed(self) -> bool:
        """torch.distributed runs with several ranks: saves and restores go through DCP (tiered.distributed.saver)."""
        if self._dist is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                return False
            from tiered.distributed.saver import DistributedSaver

            self._dist = DistributedSaver(self.saves)
        return True

    def wait(self) -> None:
        """Wait for every in-flight save to be persisted or failed; raise what `on_save_failure` keeps."""
        if self._dist is not None:  # distributed saves: committed by rank 0, in the background
            self._dist.wait()
        self.saves.wait()

    def wait_migrated(self, timeout: float | None = None) -> None:
        """Wait until every queued committed step is on every tier and retention has run after it;
        raise the first migration failure since the last call. A failed step stays queued, retried
        (5 s, doubling to 5 min): after its failure is raised, a later call waits for the retry."""
        self.wait()
        if self._migrator is not None:
            self._migrator.wait(timeout)

    def wait_replicated(self, timeout: float | None = None) -> None:
        """Wait until this rank's newest step is kept by the ranks keeping its replicas (memory tier `replicas`)."""
        if self._distributed():
            self._dist.wait_replicated(timeout)

    def close(self, raise_errors: bool = True) -> None:
        """Wait for in-flight saves and queued migrations, stop the threads, free staging memory."""
        if self._closed:
            return
        try:
            if raise_errors:
                self.wait()
            else:
                self.saves.settle()
        finally:
            self._closed = True
            self.saves.close()
            if self._dist is not None:
                self._dist.close()
            if self._migrator is not None:
                self._migrator.stop()  # queued migrations finish first; a crash resumes next run
            self.workers.close()

    # --- restore -------------------------------------------------------------------------
    def restore(self, state_dict: Any, step: int | None = None, *, strict: bool = True,
                tier: str | None = None) -> int:
        """Load `step` (default: the newest committed on any tier) into `state_dict` in place;
        return the step.

        Tensors present in `state_dict` receive the stored bytes where they are (GPU tensors are
        decoded on their GPU); entries missing from it (a fresh optimizer's state, say) are
        created on the device they were saved from, or the CPU. With `strict`, a tensor in
        `state_dict` that the checkpoint lacks is an error.

        Reads from `tier`, default the fastest holding the step; a damaged chunk, a missing file or
        a copy that cannot be opened is read from the next slower tier instead (logged). Under
        torch.distributed, from each node's tiers and peers first (tiered.distributed.peers)."""
        self._check_open()
        self.saves.wait_reserved()  # (it readies the GPU devices a restore uses too)
        self.saves.raise_failure()
        t0 = time.perf_counter()
        with self._api_lock, tree.collector_paused():  # (metadata, indexes, plans: no cycles; see collector_paused)
            if self._distributed():
                step = self._dist.restore(self.restorer, state_dict, step, tier, strict=strict)
                source = "the nodes' tiers"
            else:
                step, source = self._restore_here(state_dict, step, tier, strict)
        log.info("tiered: restored step %d from %s in %.2f s", step, source, time.perf_counter() - t0)
        return step

    def _restore_here(self, state_dict: Any, step: int | None, tier: str | None, strict: bool) -> tuple[int, str]:
        """`restore` in one process: (the step, where it was read)."""
        step, order = self.catalog.restore_order(step, tier)
        if saved_through_dcp(order, step):
            from tiered.distributed.peers import restore_dcp

            restore_dcp(self.restorer, state_dict, step, order, strict=strict)
            return step, f"tier {order[0].name!r}"
        loaded, source = self.restorer.load(step, state_dict, strict=strict, device=None, order=order)
        tree.merge_into(state_dict, loaded)
        return step, f"tier {source!r}"

    def load(self, step: int | None = None, *, device: str | torch.device | None = None,
             tier: str | None = None) -> Any:
        """A fresh copy of a step's state (default: the newest on any tier), tensors on `device`
        or where they were saved. Reads and falls back as `restore` does."""
        self._check_open()
        with self._api_lock:
            step, order = self.catalog.restore_order(step, tier)
            return self.restorer.load(step, {}, strict=False, device=torch.device(device) if device is not None
                                      else None, order=order)[0]

    def _check_open(self) -> None:
        if self._closed:
            raise TieredError("this Engine is closed")


def _finish_at_exit(ref: "weakref.ref[Engine]") -> None:
    engine = ref()
    if engine is None or engine._closed:
        return
    pending = engine.saves.pending()
    if pending:
        log.warning("tiered: waiting for in-flight saves of steps %s before exit", pending)
    engine.close(raise_errors=False)
