"""`tiered-restore` under torchrun: each rank's files of a step brought back onto its node's
fast tier, from the ranks on other nodes keeping its replicas (a replaced node before training
starts). The same decision and transfers as `Engine.restore` (tiered.distributed.peers), without
loading anything: the training job's restore then reads every rank's files on its own node.

    torchrun --nnodes 4 --nproc_per_node 8 ... -m tiered.cli.restore --config cluster.yaml
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

from tiered.cli.common import EXIT_FAILED, EXIT_OK
from tiered.tiers.catalog import TierCatalog


def under_torchrun() -> bool:
    """Launched as one rank of several (torchrun, or any launcher setting RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def restore_from_peers(args: argparse.Namespace, catalog: TierCatalog) -> int:
    import torch.distributed as dist

    from tiered.distributed.nodes import gather_nodes, replicas_asked, replicas_to_keep
    from tiered.distributed.peers import NODE_LOCAL, agree, fetch

    dist.init_process_group("gloo", timeout=timedelta(seconds=catalog.config.distributed_timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        nodes, asked = gather_nodes(None, replicas_asked(catalog.config))
        plan = agree(catalog, nodes, replicas_to_keep(asked, nodes, rank), args.step)
        if plan.step is None:
            if rank == 0:
                print(f"tiered-restore: nothing restorable at {world} ranks: no step is held whole by the nodes' "
                      "tiers, their replicas and the shared tiers together")
            return EXIT_FAILED
        step = plan.step
        if plan.resharded:
            if rank == 0:
                print(f"step {step} was saved at another world size than these {world} ranks: nothing to bring "
                      "from peers; the job's restore reshards it from the tiers that hold it whole")
            return EXIT_OK
        came = fetch(plan, catalog, None) if plan.sends or plan.slow else {}
        where = came.get(rank)
        ok = True
        if where is None:
            print(f"rank {rank}: step {step}: its files are on this node ({catalog.fast.name})")
        elif where.startswith("the slower tiers"):
            slow = [n for n, s in catalog.committed([t.name for t in catalog.config.tiers
                                                     if t.kind not in NODE_LOCAL]).items() if s and step in s]
            ok = bool(slow)
            print(f"rank {rank}: step {step}: its files came from no peer ({where}); "
                  + (f"the job's restore reads them from tier {slow[0]!r}" if ok else "and no shared tier holds "
                     "the step: it cannot be restored at this world size"))
        else:
            print(f"rank {rank}: step {step}: its files came from {where}, onto tier {catalog.fast.name!r}")
        said: list[object] = [None] * world
        dist.all_gather_object(said, ok)
        return EXIT_OK if all(said) else EXIT_FAILED
    finally:
        dist.destroy_process_group()
