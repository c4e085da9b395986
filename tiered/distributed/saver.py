"""`Engine.save` / `Engine.restore` under torch.distributed: one call on every rank, through DCP.

Save, on every rank (`DistributedSaver.save`):

    DCP's DefaultSavePlanner plans (gather the local plans to the coordinator, which removes
    duplicates of replicated tensors, scatter the final plans)    -- collectives on a CPU group;
    a state of the last save's structure reuses its plan instead (tiered.distributed.reuse; one all-reduce)
    -> StepWriter.stage_items (tiered.distributed.storage): this rank's items are staged as a single-process save stages
       (GPU tensors compressed on their GPU); save() returns here
    background, in save order (one thread per engine):
    -> this rank's data file and index are durable on its node-local tier
    -> it posts its WriteResults to the job's key-value store (c10d's store, as torchrun sets up)
    -> the coordinator waits for every rank's post, writes the DCP metadata and the manifest
       (`tiered.distributed.commit.commit_step`), and posts the manifest
    -> every node's local rank 0 commits that same manifest on its own node-local tier, so each
       node sees the step (holding its own ranks' files); each rank queues its migration.

`Engine.reserve(state)` at start-up runs the same planning (every rank calls it), so that the
first save reuses its plan (`DistributedSaver.reserve`).

No rank waits for another in the training step: only the planning is collective. The background
exchange goes through the store, not collectives, so it never interleaves with training's.

The planning's collectives never touch the GPU (`cpu_group`): on an NCCL default group, an
all-reduce of the reuse flag is a CUDA tensor whose `.item()` waits for everything training has
queued on its stream, so a loop whose host runs ahead of its GPU would find its GPU idle for the
rest of the save's call. Where the default group has no CPU backend, the saver makes a gloo group
of all ranks once, as TorchTitan does for its asynchronous checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from datetime import timedelta
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from tiered import threads
from tiered.distributed.commit import (RankSummary, StoredItem, adopt_commit, commit_step, post_commit,
                                       post_failure, results_of, store, wait_for_keys)
from tiered.distributed.node_plan import NodeCopiesPlanner
from tiered.distributed.nodes import gather_nodes, replicas_asked, replicas_to_keep
from tiered.distributed.replicas import Replicator
from tiered.distributed.reuse import PlanReuse
from tiered.distributed.roll import collective, doing, last_doing
from tiered.distributed.storage import StepWriter
from tiered.errors import BackgroundSaveError, TieredError
from tiered.format import tree
from tiered.format.manifest import Manifest, RankEntry
from tiered.observe.records import save_record
from tiered.save.handle import SaveHandle

log = logging.getLogger("tiered")


class DistributedSaver:
    """The distributed side of one Engine's `saves` (a SavePipeline): plans collectively, stages
    locally, commits in the background."""

    def __init__(self, saves: Any):
        self.saves = saves
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        saves.bind_rank(self.rank, self.world)
        self._group = cpu_group(self.saves.config.distributed_timeout)
        """Where the planning's collectives run: None for the default group, which does CPU ones."""
        # One all-gather: each rank's node, the replicas its config asks, and an id (rank 0's names
        # the replicas' keys in the job's store).
        self.nodes, said = gather_nodes(self._group, (replicas_asked(saves.config), os.urandom(8).hex()))
        """Which ranks share a node: a replicated item is stored once a node (NodeCopiesPlanner)."""
        self.replicas = replicas_to_keep([asked for asked, _ in said], self.nodes, self.rank)
        """Ranks on other nodes keeping each rank's steps (the memory tier's `replicas`, as every rank can)."""
        self._replicator = Replicator(saves, self.nodes.holders(self.rank, self.replicas),
                                      self.nodes.sources(self.rank, self.replicas), said[0][1],
                                      saves.config.distributed_timeout) if self.replicas else None
        self._told_default = False
        self._reuse = PlanReuse()
        """The last save's plan, reused while the state keeps its structure."""
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self._jobs: "queue.Queue[Any]" = queue.Queue()
        self._thread = threads.start(self._loop, name="tiered-commit")

    @property
    def plan_group(self) -> Any:
        """The group of the engine's CPU collectives (None: the default group)."""
        return self._group

    def wait_replicated(self, timeout: float | None = None) -> None:
        """Wait until this rank's newest committed step is kept by the ranks keeping its replicas
        (at most `timeout` seconds, default `distributed_timeout`); TieredError naming those that do not."""
        self.wait()
        if self._replicator is None:
            return
        missing = self._replicator.wait(self.saves.config.distributed_timeout if timeout is None else timeout)
        if missing:
            raise TieredError(f"rank {self.rank}: its newest step has no replica on " + "; ".join(
                f"rank {h} ({why})" for h, why in sorted(missing.items())))

    def replica_group(self) -> Any:
        """The group replicas travel on: the replicator's own, or (no replicas kept now, but some
        kept by an earlier run are asked for at a restore) the planning's CPU group."""
        return self._replicator.group if self._replicator is not None else self._group

    def restore(self, restorer: Any, state_dict: Any, step: int | None, tier: str | None, *, strict: bool) -> int:
        """`Engine.restore` on every rank (tiered.distributed.peers)."""
        from tiered.distributed.peers import restore

        self.wait()
        return restore(self, restorer, state_dict, step, tier, strict=strict)

    # --- save ------------------------------------------------------------------------------
    def save(self, step: int, state_dict: Any) -> SaveHandle:
        t0 = time.perf_counter()
        later = self._save_later(step, state_dict, t0)
        if later is not None:
            return later
        self.saves.wait_planned()  # (a deferred save's collectives first: on every rank in save order)
        writer = self._writer(step)
        parts: dict[str, float] = {}
        final, metadata, resolve, structure = self._plan(state_dict, writer, parts)
        t1 = time.perf_counter()
        save_id = f"{final.storage_data}/{step}"  # a reused plan carries the id of the save that made it
        try:
            rank_handle = writer.stage_items(final, resolve, structure, deferrable=True)
        except BaseException as exc:
            # The other ranks go on; tell the coordinator at once rather than let it wait.
            store().set(_rank_key(save_id, self.rank), json.dumps({"error": f"rank {self.rank}: {exc!r}"}))
            raise
        handle = self._handle(step, rank_handle)
        # Where a distributed call goes: DCP's plan (of it: the walk of the state, and the one
        # all-reduce, which also waits for the slowest rank to call save), then this rank's items
        # and their staging (the single-process timings above).
        handle.timings.update(dcp_plan_ms=1e3 * (t1 - t0), dcp_stage_ms=1e3 * (time.perf_counter() - t1), **parts)
        planned: Future = Future()
        planned.set_result((final, metadata, save_id))
        return self._queue(step, planned, rank_handle, handle, t0)

    def _save_later(self, step: int, state_dict: Any, t0: float) -> SaveHandle | None:
        """A guarded save (`defer_walk=True`) whose state an earlier save learned
        (`SavePipeline.save_later`): the call clones what is unguarded and returns; the stager
        thread plans with DCP (the walk, the all-reduce: in save order on every rank, as no call
        plans while one is pending) and makes this rank's items, before it reads them. None
        where the call must plan, or where the planning's collectives would run on the default
        group (a CPU one), which training's own collectives use from its threads: from the
        stager thread they could pair with those in another order on each rank."""
        if self._group is None:
            if not self._told_default and self.saves.defers():
                self._told_default = True
                log.warning("tiered: guard(optimizer, defer_walk=True): saves still plan with DCP in their call, "
                            "since they plan on the default process group (%s), where training's own collectives "
                            "could pair with a stager thread's in another order on each rank (with an NCCL "
                            "default group the engine plans on a gloo group of its own, and the stager thread "
                            "does)", default_backend())
            return None
        planned: Future = Future()
        """(final plan, metadata, save id) once the stager thread has planned, for the commit."""

        def prepare(timings: dict[str, float]) -> tree.Flat:
            t1 = time.perf_counter()
            writer = self._writer(step)
            parts: dict[str, float] = {}
            try:
                final, metadata, resolve, structure = self._plan(state_dict, writer, parts)
            except BaseException as exc:
                planned.set_exception(exc)
                raise
            planned.set_result((final, metadata, f"{final.storage_data}/{step}"))
            timings.update(dcp_plan_ms=1e3 * (time.perf_counter() - t1), **parts)
            return writer.items(final, resolve, structure)  # (a failure: the commit posts it, from the rank's handle)

        rank_handle = self.saves.save_later(step, prepare)
        if rank_handle is None:
            return None
        return self._queue(step, planned, rank_handle, self._handle(step, rank_handle), t0)

    def _writer(self, step: int) -> StepWriter:
        """This rank's StepWriter of `step`, set up as DCP sets up a storage writer."""
        writer = StepWriter(self.saves, step)
        writer.set_up_storage_writer(self.rank == 0, rank=self.rank)
        return writer

    @staticmethod
    def _handle(step: int, rank_handle: Any) -> SaveHandle:
        """The distributed save's handle: staged as this rank's save is, persisted once committed."""
        handle = SaveHandle(step)
        if rank_handle is None:
            handle.staged.set_result(step)
        else:
            handle.raw_bytes = rank_handle.raw_bytes
            handle.timings = rank_handle.timings  # (one dict: a deferred save's stager adds to it)
            handle.on_wait = rank_handle.on_wait
            rank_handle.staged.add_done_callback(lambda f: _mirror(f, handle.staged))
        return handle

    def _queue(self, step: int, planned: Future, rank_handle: Any, handle: SaveHandle, t0: float) -> SaveHandle:
        with self._lock:
            self._pending.append(handle)
        handle.stall_s = time.perf_counter() - t0
        self._jobs.put((step, planned, rank_handle, handle, t0))
        return handle

    def _plan(self, state_dict: Any, writer: StepWriter,
              timings: dict[str, float] | None = None) -> tuple[Any, Any, Any, Any]:
        """(this rank's final DCP plan, the metadata (the coordinator's), a resolver of its items'
        data, and the plan's structure token where it is a kept one (`PlanReuse.token`; else
        None)) for a save of `state_dict` through `writer`. Every save of a training run has the
        same structure: when no rank's state changed structure (tiered.distributed.reuse; one all-reduce
        of a flag tells), the last plan is reused, without DCP planning, gathering and
        scattering it again. `timings` gets the walk's and the all-reduce's milliseconds."""
        coordinator = self.rank == 0
        t0 = time.perf_counter()
        sig, leaves = self._reuse.walk(state_dict)
        t1 = time.perf_counter()
        same = self._all(self._reuse.matches(sig))
        if timings is not None:
            timings.update(dcp_walk_ms=1e3 * (t1 - t0), dcp_agree_ms=1e3 * (time.perf_counter() - t1))
        if same:
            final, metadata = self._reuse.plan()
            if coordinator:
                metadata = dataclasses.replace(metadata, storage_meta=writer.storage_meta())
            return final, metadata, self._reuse.resolver(leaves), self._reuse.token
        planner = NodeCopiesPlanner(self.nodes.of_rank)
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        local = planner.create_local_plan()
        gathered = [None] * self.world if coordinator else None
        collective("a save: gathering DCP's plans on rank 0",
                   lambda: dist.gather_object(local, gathered, dst=0, group=self._group))
        scattered = [None] * self.world if coordinator else None
        metadata = None
        if coordinator:
            plans, metadata = planner.create_global_plan(gathered)
            scattered = writer.prepare_global_plan(plans)
        out = [None]
        collective("a save: scattering DCP's final plans",
                   lambda: dist.scatter_object_list(out, scattered, src=0, group=self._group))
        final = planner.finish_plan(out[0])
        self._reuse.remember(sig, leaves, self._reuse.paths(state_dict), planner, final, metadata)
        # Kept: its resolver serializes values as the planner does, and keeps them, so `reserve` makes
        # the first save's.
        if self._reuse.matches(sig):
            return final, metadata, self._reuse.resolver(leaves), self._reuse.token
        return final, metadata, lambda i, item: planner.resolve_data(item), None

    def reserve(self, state_dict: Any) -> int:
        """`Engine.reserve` on every rank (collective, as a save is): plan saves of `state_dict`
        with DCP now, so that the first save reuses the plan instead of planning (513-527 ms of
        a first save of 8,320 tensors a rank at 2 ranks, gloo), and ready
        this rank's part of it as a single-process `reserve` readies a state
        (SavePipeline.reserve). Returns that part's bytes."""
        self.saves.wait_planned()
        writer = self._writer(0)  # (the step is a placeholder: a reused plan takes each save's)
        final, _, resolve, structure = self._plan(state_dict, writer)
        return self.saves.reserve(writer.items(final, resolve, structure), rank_only=True)

    def _all(self, flag: bool) -> bool:
        """`flag` holds on every rank (an all-reduce of one int on the CPU, `cpu_group`)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        collective("a save: agreeing whether the state kept its structure",
                   lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group))
        return bool(t.item())

    def wait(self) -> None:
        """Wait until every queued save is committed or has failed (failures: the engine raises them)."""
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
            for h in pending:
                h.persisted.exception()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        if self._replicator is not None:
            self._replicator.close()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            step, planned, rank_handle, handle, t0 = job
            try:
                final, metadata, save_id = planned.result()  # (a deferred save: once the stager has planned)
                manifest = self._commit(step, list(final.items), rank_handle, metadata, save_id)
            except BaseException as exc:  # noqa: BLE001 - surfaced by the next save()/wait()
                err = exc if isinstance(exc, BackgroundSaveError) else BackgroundSaveError(step, exc)
                try:
                    if not self.saves.tier.has_step(step):  # never committed: this rank's files go
                        self.saves.tier.discard_rank(step, self.rank)
                except Exception as cleanup:  # noqa: BLE001 - the save's own failure is what matters
                    log.warning("tiered: step %d: cannot remove this rank's files: %s", step, cleanup)
                then = self.saves.record_failure(err)
                log.error("tiered: %s. The step is not committed and this rank's files are removed; %s", err, then)
                if not handle.staged.done():
                    handle.staged.set_exception(err)
                handle.persisted.set_exception(err)
                continue
            if self.rank == 0:  # the coordinator's record of the step, for every rank
                self.saves.records.append(save_record(manifest, self.saves.tier.name, handle,
                                                      time.perf_counter() - t0, [], "dcp"))
            self.saves.notify_committed(step)
            if self._replicator is not None:
                self._replicator.committed(step)
            handle.persisted.set_result(manifest)

    def _commit(self, step: int, items: list[Any], rank_handle: Any, metadata: Any, save_id: str) -> Manifest:
        # The results, their JSON and the metadata are several objects an item, alive together for
        # a moment: made with the collector on, they set off two full collections a save on this
        # thread, 310-420 ms each holding the GIL beside training (10,480 items a rank, CPU
        # machine). So they are made with it paused, after the waits, and dropped within.
        s = store()
        timeout = timedelta(seconds=self.saves.config.distributed_timeout)
        doing(f"step {step}: writing its files")
        try:
            persisted = rank_handle.persisted.result() if rank_handle is not None else None
            with tree.collector_paused():
                s.set(_rank_key(save_id, self.rank),
                      _encode_results(results_of(items, persisted, self.rank) if rank_handle is not None else []))
        except BaseException as exc:
            s.set(_rank_key(save_id, self.rank), json.dumps({"error": f"rank {self.rank}: {exc!r}"}))
            raise
        if self.rank == 0:
            try:
                keys = [_rank_key(save_id, r) for r in range(self.world)]
                doing(f"step {step}: committing it, once every rank has written its files")
                wait_for_keys(keys, timeout, lambda missing: (
                    f"step {step} was not committed: {last_doing(keys.index(k) for k in missing)} did not report "
                    f"their files durable within {timeout} (distributed_timeout)"))
                with tree.collector_paused():
                    posted = [json.loads(s.get(k)) for k in keys]
                    failed = [p["error"] for p in posted if isinstance(p, dict)]
                    if failed:
                        raise TieredError(f"step {step} was not committed: {'; '.join(failed)}")
                    manifest = commit_step(self.saves.tier, step, metadata,
                                           [r for p in posted for r in _decode_results(p)], self.world)
                    del posted
                for k in keys:
                    s.delete_key(k)
            except BaseException as exc:
                post_failure(save_id, repr(exc))
                raise
            post_commit(self.saves.tier, save_id, manifest)
            return manifest
        doing(f"step {step}: waiting for rank 0's commit")
        return adopt_commit(self.saves, step, save_id)


def default_backend() -> str:
    """The default group's backend, as `dist.get_backend()` names it ("nccl", "gloo",
    "cpu:gloo,cuda:nccl")."""
    return str(dist.get_backend())


def cpu_group(timeout_s: float) -> Any:
    """The group a save's planning collectives run on, on CPU tensors: None (the default group)
    where the default group has a CPU backend, else a new gloo group of every rank (collective:
    every rank makes it, as every rank makes its engine's first distributed call)."""
    backend = default_backend()
    if "gloo" in backend or "mpi" in backend:
        return None
    if not dist.is_gloo_available():
        raise TieredError(f"torch.distributed's default group is {backend!r}, which has no CPU backend, and gloo is "
                          "not available in this torch: initialise the process group with a CPU backend too, "
                          "e.g. init_process_group('cpu:gloo,cuda:nccl')")
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise TieredError(f"torch.distributed's default group is {backend!r}, which has no CPU backend, and making a "
                          f"gloo group for the saves' planning failed ({exc}): initialise the process group with a "
                          "CPU backend too, e.g. init_process_group('cpu:gloo,cuda:nccl'), and where gloo picks the "
                          "wrong network interface, set GLOO_SOCKET_IFNAME") from exc
    log.info("tiered: the default process group is %r: saves plan over a gloo group of all %d ranks (made once), "
             "so that no save waits for the GPU", backend, dist.get_world_size())
    return group


def _rank_key(save_id: str, rank: int) -> str:
    """Where a rank posts what it wrote (or why it could not)."""
    return f"tiered/{save_id}/rank/{rank}"


def _mirror(src: Any, dst: Any) -> None:
    if dst.done():
        return
    exc = src.exception()
    dst.set_exception(exc) if exc is not None else dst.set_result(src.result())


def _encode_results(results: list[WriteResult]) -> str:
    out = []
    for r in results:
        s: StoredItem = r.storage_data
        f = s.files
        out.append([r.index.fqn, None if r.index.offset is None else list(r.index.offset), r.index.index,
                    r.size_in_bytes, s.rank, s.tensor,
                    None if f is None else [f.entry.rank, f.entry.index_file, f.entry.index_bytes,
                                            f.entry.index_checksum, f.entry.data_file, f.entry.data_bytes,
                                            f.raw_bytes, f.stored_bytes]])
    return json.dumps(out)


def _decode_results(posted: list[Any]) -> list[WriteResult]:
    out = []
    for fqn, offset, idx, size, rank, tensor, f in posted:
        files = None if f is None else RankSummary(RankEntry(*f[:6]), f[6], f[7])
        out.append(WriteResult(index=MetadataIndex(fqn, None if offset is None else torch.Size(offset), idx),
                               size_in_bytes=size, storage_data=StoredItem(rank, tensor, files)))
    return out
