"""torch.distributed.checkpoint (DCP) storage on tiered's format, codecs and tiers.

``dcp.save(state_dict, storage_writer=TieredStorageWriter(engine, step))``, ``dcp.async_save``
and ``dcp.load(state_dict, storage_reader=TieredStorageReader(engine, step), planner=SafeLoadPlanner())``.
DCP's planner decides what each rank writes (replicated tensors once, shards by their owners)
and what each rank reads (resharding: any world size to any other). Storage then works as in
the single-process engine: each rank stages its items (GPU tensors compressed on their GPU) and
writes ``rank_NNNNN.data`` and its index to its node-local tier; the coordinator writes the DCP
metadata and the manifest last, once every rank's files are durable (tiered.distributed.commit; see
docs/distributed.md).

The call orders DCP follows, and how the metadata is kept (JSON, never pickled), are in
tiered.distributed.storage, whose StepWriter and StepReader these classes extend for an Engine or a config.
"""

from __future__ import annotations

from typing import Any

import torch

from tiered.distributed.storage import (NotSavedThroughDcp, SafeLoadPlanner, StepReader, StepWriter, box_chunks,
                                        item_name)
from tiered.engine import Engine

__all__ = ["GpuStager", "NotSavedThroughDcp", "SafeLoadPlanner", "TieredStorageReader", "TieredStorageWriter",
           "box_chunks", "item_name"]


def _engine(engine_or_config: Any) -> tuple[Engine, bool]:
    """(the Engine, whether this object made it and so closes it)."""
    if isinstance(engine_or_config, Engine):
        return engine_or_config, False
    return Engine.from_config(engine_or_config), True


class TieredStorageWriter(StepWriter):
    """A DCP StorageWriter writing `step` with `engine` (an Engine, or a config for one that this
    writer owns and closes in `close()`). The checkpoint_id given to dcp.save, if any, is the step."""

    def __init__(self, engine: Any = None, step: int | None = None):
        self.engine, self._owns = _engine(engine)
        super().__init__(self.engine.saves, step)

    def close(self) -> None:
        if self._owns:
            self.engine.close()


class TieredStorageReader(StepReader):
    """A DCP StorageReader of `step` (default: the newest step on any tier) through `engine` (an
    Engine, or a config for one that this reader owns and closes in `close()`). Reads the fastest
    tier holding the step; a rank's files missing there (another node's local disk) are read from
    the next tier holding them. Each rank reads and decodes only the chunks covering what it loads."""

    def __init__(self, engine: Any = None, step: int | None = None, *, tier: str | None = None):
        self.engine, self._owns = _engine(engine)
        super().__init__(self.engine.restorer, step, tier=tier)

    def close(self) -> None:
        if self._owns:
            self.engine.close()


class GpuStager:
    """DCP's AsyncStager for ``dcp.async_save(state, storage_writer=TieredStorageWriter(...),
    async_stager=GpuStager())``: stages by copying each GPU tensor on its GPU (CPU tensors are
    copied in host memory), so tiered then compresses the staged GPU tensors on the GPU and
    writes them through KvikIO, instead of receiving host copies from DCP's default stager.

    Costs GPU memory for one copy of the state's GPU tensors until the save has read them, and
    blocks until the copies are made (the current stream is synchronized: everything queued
    before the save, the optimizer step included, finishes first). `Engine.save` needs no copy:
    its snapshot is the compressed state."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: Any) -> Any:
        gpus: set[torch.device] = set()
        staged = _copy_tree(state_dict, gpus)
        for device in gpus:  # the copies are made before the training loop may change the state
            torch.cuda.current_stream(device).synchronize()
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _copy_tree(node: Any, gpus: set) -> Any:
    """A copy of a state_dict's containers and tensors (DTensors stay DTensors, each tensor on
    its device); other values are shared."""
    if isinstance(node, torch.Tensor):
        if node.is_cuda:
            gpus.add(node.device)
        return node.detach().clone()
    if isinstance(node, dict):
        return type(node)((k, _copy_tree(v, gpus)) for k, v in node.items())
    if isinstance(node, list):
        return [_copy_tree(v, gpus) for v in node]
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return tuple(_copy_tree(v, gpus) for v in node)
    return node


