"""A distributed restore from each node's own tiers, and from peers after a node loss.

`Engine.restore` under torch.distributed (same world size as the save):

1. Each rank reports what its node holds of each step: its own files (on the node's memory and
   local tiers) and the replicas it keeps of other ranks (tiered.distributed.replicas); rank 0 adds
   the steps committed on the shared tiers. One all-gather.
2. Every rank decides alike (`tiered.policy.peer_restore_plan`): the newest step that every rank
   it lists can have, from its own node, from a rank keeping its replica, or from a shared tier.
3. A rank whose files its node lacks (a replacement node: memory and local tiers empty) receives
   them from the nearest rank keeping its replica; they are checked chunk by chunk and committed
   on its node's fast tier (tiered.distributed.transfer), so the node holds the step again. A
   replica that fails a check is asked of the next rank keeping one; what no peer has comes from
   the slower tiers. The transfers run in one order on every rank (no two ranks wait on each
   other); an all-gather after each round says which failed.
4. Each rank reads only what its shards need, from its own node where it is there
   (tiered.distributed.storage.StepReader, with the ranks of its node: a replicated item is read
   from its copy on this node).

A step saved at another world size reshards through DCP's planner from the tiers holding the
whole step, and the log says so.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import torch.distributed as dist

from tiered.distributed.roll import collective, doing
from tiered.distributed.storage import SafeLoadPlanner, StepReader
from tiered.distributed.transfer import receive_rank, send_rank
from tiered.errors import CheckpointNotFoundError, TieredError
from tiered.format import tree
from tiered.format.manifest import read_manifest
from tiered.policy import Holdings, PeerPlan, peer_restore_plan
from tiered.tiers.catalog import saved_through_dcp
from tiered.tiers.leases import hold
from tiered.units import format_size

log = logging.getLogger("tiered")

NODE_LOCAL = ("memory", "local")


def holdings(catalog: Any, rank: int, nodes: Any, *, slow: bool) -> Holdings:
    """What this rank's node holds of each step for this rank (see the module's text): its own
    files, and the replicas on its node that it is the one to keep (of the ranks whose replicas
    go to its local index); with `slow`, the steps committed on the shared tiers too."""
    own: dict[int, tuple[int, tuple[int, ...]]] = {}
    local = [t.name for t in catalog.config.tiers if t.kind in NODE_LOCAL]
    for name in local:
        tier = catalog.get(name)
        for step in tier.steps():
            if step in own:
                continue
            try:
                manifest = read_manifest(tier, step)
                entry = manifest.entry(rank)
                if entry is None or tier.file_size(step, entry.index_file) is not None:
                    own[step] = (manifest.world_size, tuple(r.rank for r in manifest.ranks))
            except (TieredError, OSError) as exc:
                log.warning("tiered: step %d on tier %r cannot be read: %s", step, name, exc)
    replicas: dict[int, dict[int, tuple[int, tuple[int, ...]]]] = {}
    memory = catalog.fast if catalog.config.fast_tier.kind == "memory" else None
    for source in memory.replica_sources() if memory is not None else []:
        if source >= len(nodes.of_rank) or rank not in nodes.holders(source, nodes.count - 1):
            continue
        tier = memory.replica_tier(source)
        for step in tier.steps():
            try:
                manifest = read_manifest(tier, step)
            except (TieredError, OSError) as exc:
                log.warning("tiered: rank %d's replica of step %d cannot be read: %s", source, step, exc)
                continue
            replicas.setdefault(step, {})[source] = (manifest.world_size, tuple(r.rank for r in manifest.ranks))
    shared: list[int] = []
    if slow:
        listed = catalog.committed([t.name for t in catalog.config.tiers if t.kind not in NODE_LOCAL])
        shared = sorted(set().union(*(set(s) for s in listed.values() if s is not None)))
    return Holdings(own, replicas, tuple(shared))


def agree(catalog: Any, nodes: Any, k: int, step: int | None, group: Any = None) -> PeerPlan:
    """Steps 1 and 2 of the module's text (collective)."""
    rank = dist.get_rank()
    mine = holdings(catalog, rank, nodes, slow=rank == 0)
    reports: list[Any] = [None] * dist.get_world_size()
    collective("a restore: telling what each node holds", lambda: dist.all_gather_object(reports, mine, group=group))
    return peer_restore_plan(reports, step, nodes.of_rank)


def fetch(plan: PeerPlan, catalog: Any, group: Any) -> dict[int, str]:
    """Step 3 of the module's text (collective): the ranks lacking their files of `plan.step`
    receive them from the ranks keeping their replicas. Returns {rank: where its files came
    from} for every rank that lacked them."""
    step = plan.step
    rank = dist.get_rank()
    tried = {r: 0 for r in plan.sends}
    came: dict[int, str] = {r: "the slower tiers (no peer keeps them)" for r in plan.slow}
    pending = dict(plan.sends)
    while pending:
        pairs = sorted((r, holders[tried[r]]) for r, holders in pending.items())
        outcome: str | None = None
        for receiver, holder in pairs:
            if rank == holder:
                doing(f"the restore of step {step}: sending rank {receiver} its files")
                try:
                    send_rank(catalog.fast.replica_tier(receiver), step, receiver, receiver, group)
                except (TieredError, OSError) as exc:
                    log.error("tiered: step %d: cannot send rank %d its replica: %s", step, receiver, exc)
            elif rank == receiver:
                doing(f"the restore of step {step}: receiving its files from rank {holder}")
                outcome = _receive(step, holder, catalog, group)
        said: list[Any] = [None] * dist.get_world_size()
        collective(f"the restore of step {step}: which ranks received their files",
                   lambda: dist.all_gather_object(said, outcome, group=group))
        for receiver, holder in pairs:
            where = said[receiver]
            if where is not None and not where.startswith("!"):
                came[receiver] = where
                del pending[receiver]
                continue
            tried[receiver] += 1
            if tried[receiver] >= len(pending[receiver]):
                came[receiver] = f"the slower tiers ({where[1:] if where else 'no answer'})"
                del pending[receiver]
    if rank == 0 and came:
        log.info("tiered: step %d: %s", step, "; ".join(f"rank {r}'s files from {w}" for r, w in sorted(came.items())))
    return came


def _receive(step: int, holder: int, catalog: Any, group: Any) -> str:
    """Receive this rank's files of `step` from `holder` into the node's fast tier: where they
    came from and how fast, or "!" and why not."""
    try:
        got = receive_rank(holder, group, catalog.fast, into_step=True, step=step)
    except (TieredError, OSError) as exc:
        log.error("tiered: step %d: rank %d's replica (its files) from rank %d failed: %s", step, dist.get_rank(),
                  holder, exc)
        return f"!rank {holder}'s replica failed: {exc}"
    if got is None:
        return f"!rank {holder} had no replica to send"
    rate = got.stored_bytes / max(got.seconds, 1e-9)
    where = (f"rank {holder}'s replica ({format_size(got.stored_bytes)} in {got.seconds:.2f} s, {format_size(rate)}/s; "
             f"every chunk checked {got.checking_s:.2f} s after the last byte)")
    log.info("tiered: step %d: rank %d's files came from %s", step, dist.get_rank(), where)
    return where


def restore(saver: Any, restorer: Any, state_dict: Any, step: int | None, tier: str | None, *, strict: bool) -> int:
    """`Engine.restore` under torch.distributed (see the module's text); returns the step."""
    catalog = restorer.catalog
    t0 = time.perf_counter()
    came: dict[int, str] = {}
    if tier is None:
        plan = agree(catalog, saver.nodes, saver.replicas, step, saver.plan_group)
        if plan.step is None:
            raise CheckpointNotFoundError("no committed checkpoint to restore: no rank's node and no shared tier "
                                          "holds one")
        step = plan.step
        if plan.resharded:
            if dist.get_rank() == 0:
                log.info("tiered: step %d was saved at another world size than this job's %d: each rank reads what "
                         "its shards need from the tiers that hold the whole step", step, dist.get_world_size())
        elif plan.sends or plan.slow:
            came = fetch(plan, catalog, saver.replica_group())
    else:
        step = agree_on_step(step, lambda: catalog.restore_order(None, tier)[0])
    step, order = catalog.restore_order(step, tier)
    if saved_through_dcp(order, step):
        restore_dcp(restorer, state_dict, step, order, strict=strict,
                    node_ranks=set(saver.nodes.local_ranks(dist.get_rank())))
    else:  # (saved by one process: every rank loads all of it)
        loaded, _ = restorer.load(step, state_dict, strict=strict, device=None, order=order)
        tree.merge_into(state_dict, loaded)
    if came and dist.get_rank() == 0:
        log.info("tiered: step %d restored in %.2f s; ranks %s from peers", step, time.perf_counter() - t0,
                 ", ".join(str(r) for r, w in sorted(came.items()) if w.startswith("rank")) or "none")
    return step


def agree_on_step(step: int | None, find: Any) -> int:
    """The step every rank restores: `step`, or the newest one rank 0 finds."""
    box = [find() if step is None and dist.get_rank() == 0 else step]
    collective("a restore: agreeing on the step (rank 0 picks it)", lambda: dist.broadcast_object_list(box, src=0))
    if box[0] is None:
        raise TieredError("no committed checkpoint to restore (rank 0 found none)")
    return box[0]


def restore_dcp(restorer: Any, state_dict: Any, step: int, order: list[Any], *, strict: bool,
                node_ranks: set[int] | None = None) -> None:
    """Load DCP-saved `step` into `state_dict` in place through `restorer` (a Restorer),
    resharding as DCP's planner decides, from the tiers `order` (those holding the step, fastest
    first, as TierCatalog.restore_order found them).

    Each rank plans and reads its own part alone (`no_dist`): DCP's default load planning changes
    no rank's plan, so gathering every rank's plan on rank 0 and scattering it back, pickled (over
    a second of a 2-rank restore of 10,480 tensors a rank on the CPU machine, and growing with the
    ranks on rank 0), only cost time. One small all-gather after it keeps DCP's promise that a
    restore fails on every rank or on none: a rank that loaded its part raises too where another
    could not, naming that rank and why."""
    with hold(order, step):  # retention leaves the step on these tiers while it is read
        _restore_dcp(restorer, state_dict, step, order, strict=strict, node_ranks=node_ranks)


def _restore_dcp(restorer: Any, state_dict: Any, step: int, order: list[Any], *, strict: bool,
                 node_ranks: set[int] | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = StepReader(restorer, step)
    reader.sources = order
    reader.node_ranks = node_ranks
    failure: BaseException | None = None
    doing(f"the restore of step {step}: reading its part")
    try:
        with warnings.catch_warnings():  # (DCP warns that it assumes a single process, which is meant here)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=not strict),
                     no_dist=True)
    except CheckpointException as exc:  # (a BaseException: DCP wraps this rank's error, as "rank 0" of its own)
        failure = next((f[0] if isinstance(f, tuple) else f for f in exc.failures.values()), exc)
    except Exception as exc:  # noqa: BLE001 - every rank hears of it below, then this rank raises it
        failure = exc
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        said: list[Any] = [None] * dist.get_world_size()
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"[:2000]
        collective(f"the restore of step {step}: agreeing on its outcome", lambda: dist.all_gather_object(said, mine))
        others = [(rank, why) for rank, why in enumerate(said) if why is not None and rank != dist.get_rank()]
        if failure is None and others:
            rank, why = others[0]
            raise TieredError(f"step {step}: the restore failed on rank{'s' if len(others) > 1 else ''} "
                              f"{', '.join(str(r) for r, _ in others)} (rank {rank}: {why}); this rank's state is "
                              "loaded, but the ranks would train from different steps")
    if failure is not None:
        raise failure
