"""Which ranks share a node, and which ranks keep a rank's replicas.

A node is the ranks that share node-local tiers (a memory tier, NVMe). Each rank names its node
by the first of: ``TIERED_NODE`` (set it where nodes are not what the launcher says), torchrun's
``GROUP_RANK`` (the agent's node rank), the host name. One all-gather at the engine's first
distributed call tells every rank every rank's node; nodes are numbered in the order of their
lowest rank.

Replica placement is by node, so that one lost node never takes a step's last in-memory copy:
the ranks keeping rank r's replicas are those of the same local index on the next k nodes (the
index taken modulo a smaller node's size), wrapping around.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from functools import cached_property
from typing import Any

log = logging.getLogger("tiered")


def node_key() -> str:
    """This process's name for its node (see the module's text)."""
    for var in ("TIERED_NODE", "GROUP_RANK"):
        value = os.environ.get(var)
        if value:
            return f"{var}={value}"
    return f"host={socket.gethostname()}"


@dataclass(frozen=True)
class Nodes:
    """The node of every rank: `of_rank[r]` is rank r's node, numbered 0.. by lowest rank."""

    of_rank: tuple[int, ...]

    @classmethod
    def from_keys(cls, keys: list[str]) -> "Nodes":
        number: dict[str, int] = {}
        return cls(tuple(number.setdefault(k, len(number)) for k in keys))

    @cached_property
    def _members(self) -> list[list[int]]:
        """The ranks of each node, ascending (made once: a job's lookups stay O(1) at any size)."""
        out: list[list[int]] = [[] for _ in range(max(self.of_rank) + 1 if self.of_rank else 0)]
        for r, n in enumerate(self.of_rank):
            out[n].append(r)
        return out

    @cached_property
    def _index(self) -> list[int]:
        """Each rank's place among its node's ranks (its local index)."""
        out = [0] * len(self.of_rank)
        for members in self._members:
            for i, r in enumerate(members):
                out[r] = i
        return out

    @property
    def count(self) -> int:
        return len(self._members)

    def ranks(self, node: int) -> list[int]:
        return list(self._members[node])

    def local_ranks(self, rank: int) -> list[int]:
        """The ranks on `rank`'s node (itself included)."""
        return self.ranks(self.of_rank[rank])

    def holders(self, rank: int, k: int) -> list[int]:
        """The ranks keeping `rank`'s replicas: one on each of the next `k` nodes (fewer where the
        job has fewer other nodes), the nearest first."""
        node, index = self.of_rank[rank], self._index[rank]
        out = []
        for j in range(1, min(k, self.count - 1) + 1):
            there = self._members[(node + j) % self.count]
            out.append(there[index % len(there)])
        return out

    def sources(self, rank: int, k: int) -> list[int]:
        """The ranks whose replicas `rank` keeps."""
        return [r for r in range(len(self.of_rank)) if rank in self.holders(r, k)]


def gather_nodes(group: Any = None, extra: Any = None) -> tuple[Nodes, list[Any]]:
    """Every rank's node, and every rank's `extra` (collective: one all-gather of each rank's
    `node_key` and `extra` on `group`)."""
    import torch.distributed as dist

    from tiered.distributed.roll import collective

    said: list[Any] = [None] * dist.get_world_size()
    mine = node_key()
    collective("finding which ranks share a node", lambda: dist.all_gather_object(said, (mine, extra), group=group))
    nodes = Nodes.from_keys([k for k, _ in said])
    if dist.get_rank() == 0:
        log.info("tiered: %d rank%s on %d node%s (told apart by %s)", len(said), "s" if len(said) > 1 else "",
                 nodes.count, "s" if nodes.count > 1 else "", mine.partition("=")[0])
    return nodes, [e for _, e in said]


def replicas_asked(config: Any) -> int:
    """The replicas this rank's config asks for (its memory tier's `replicas`; 0 without one)."""
    return getattr(config.fast_tier, "replicas", 0)


def replicas_to_keep(asked: list[int], nodes: Nodes, rank: int) -> int:
    """The replicas every rank keeps: what the configs ask, as every rank can (the fewest any
    rank's config asks, and fewer than the nodes), said once where that is less than asked."""
    want = max(asked)
    keep = min(min(asked), nodes.count - 1)
    if keep < want and rank == 0:
        why = (f"the job has {nodes.count} node{'s' if nodes.count > 1 else ''} (a replica goes to another node)"
               if keep == nodes.count - 1 else f"the configs of ranks {[r for r, a in enumerate(asked) if a == keep]} "
               f"ask for {keep}")
        log.warning("tiered: memory tier replicas: %d asked, %d kept: %s", want, keep, why)
    return keep
