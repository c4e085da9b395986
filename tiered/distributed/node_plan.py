"""DCP's save planning with a copy of every replicated item on each node.

DCP's planner writes an item that several ranks hold (a replicated tensor, a plain value such as
the step) once, from one rank. Where the fast tiers are node-local, that rank's node is then the
only one holding it, and every other node must read that rank's file from another node's disk, or
from a slower tier, to restore even when nothing was lost. `NodeCopiesPlanner` keeps DCP's plan
and metadata and adds each replicated item to one rank of every other node that holds it (the
rank with the least added there), so that each node restores from its own tiers alone. The
commit records the copies beside the item's first location (tiered.distributed.commit.StoredItem.
copies), and a reader takes the copy on its own node (tiered.distributed.storage.StepReader).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan


def with_node_copies(local: Sequence[SavePlan], final: Sequence[SavePlan], of_rank: Sequence[int]) -> list[SavePlan]:
    """`final` (DCP's deduplicated plans, one a rank) with each item that several ranks' `local`
    plans hold added to one rank of every node that held it and was left without a copy."""
    held: dict[Any, list[int]] = {}
    for rank, plan in enumerate(local):
        for item in plan.items:
            held.setdefault(item.index, []).append(rank)
    placed: dict[Any, Any] = {}
    nodes_with: dict[Any, set[int]] = {}
    for rank, plan in enumerate(final):
        for item in plan.items:
            placed[item.index] = item
            nodes_with.setdefault(item.index, set()).add(of_rank[rank])
    added: list[list[Any]] = [[] for _ in final]
    load = [0] * len(final)
    for index, ranks in held.items():
        if len(ranks) < 2 or index not in placed:
            continue
        item = placed[index]
        for node in sorted({of_rank[r] for r in ranks} - nodes_with[index]):
            rank = min((r for r in ranks if of_rank[r] == node), key=lambda r: (load[r], r))
            added[rank].append(item)
            load[rank] += item.tensor_storage_size() or 1
    return [dataclasses.replace(plan, items=list(plan.items) + extra) if extra else plan
            for plan, extra in zip(final, added)]


class NodeCopiesPlanner(DefaultSavePlanner):
    """DCP's default save planner, plus a copy of each replicated item on every node
    (`with_node_copies`); `of_rank[r]` is rank r's node."""

    def __init__(self, of_rank: Sequence[int], **kwargs: Any):
        super().__init__(**kwargs)
        self.of_rank = list(of_rank)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        plans, metadata = super().create_global_plan(all_plans)
        if len(set(self.of_rank)) < 2:
            return plans, metadata
        return with_node_copies(all_plans, plans, self.of_rank), metadata
