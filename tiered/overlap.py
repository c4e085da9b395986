"""Which tensors of a save an optimizer guards, for saves that overlap the next forward/backward.

Training mutates what it checkpoints only in the optimizer step: parameters and optimizer
state. With `Engine.guard(optimizer)`, `save()` returns before the GPU has read the state, the
state is read on a side stream while the next forward and backward run, and the guarded
optimizer's `step()` waits (on the GPU, through an event) until it has been read. Everything
else in the state (buffers that forward updates, such as BatchNorm statistics; an EMA copy
updated by hand) is not guarded: it is cloned in the caller's stream when `save()` is called,
and saved from the clone. Where that would copy much (more than `CLONE_LIMIT`, or a quarter
of the GPU memory free), the save is staged strictly instead, and the log says why once.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable

import torch

from tiered.plan import SavePlan
from tiered.tree import PLAIN_TENSORS
from tiered.units import format_size

log = logging.getLogger("tiered")

CLONE_LIMIT = 1 << 30
"""Unguarded GPU bytes a save clones at most to overlap; beyond it the save is strict."""


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """The device (-1: the CPU) and first byte of a tensor's (or a DTensor's local shard's) memory.

    Cheap, since every save asks it of every tensor: a view that starts elsewhere in a guarded
    tensor's memory gets another key and is cloned, which is safe (only ever more copying)."""
    if type(t) not in PLAIN_TENSORS and hasattr(t, "to_local"):
        t = t.to_local()
    return t.get_device(), t.data_ptr()


def guarded_storages(optimizers: Iterable[Any]) -> set[tuple[int, int]]:
    """The storages that only `optimizer.step()` changes: each optimizer's parameters and state."""
    keys = {storage_key(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    keys.update({storage_key(v) for opt in optimizers for state in opt.state.values() for v in state.values()
                 if isinstance(v, torch.Tensor)})
    return keys


def overlap_plan(plan: SavePlan, guarded: set[tuple[int, int]], free_gpu: Any) -> tuple[SavePlan | None, str]:
    """(the plan with its unguarded tensors replaced by clones, "") or (None, why not) when
    cloning them would copy too much GPU memory. `free_gpu(index)`: free bytes on that GPU."""
    tensors: list[torch.Tensor] = list(plan.tensors)
    unguarded = [i for i, t in enumerate(tensors) if storage_key(t) not in guarded]
    per_gpu: dict[int, int] = {}
    for i in unguarded:
        t = tensors[i]
        if t.is_cuda:
            per_gpu[t.device.index] = per_gpu.get(t.device.index, 0) + t.numel() * t.element_size()
    for index, nbytes in per_gpu.items():
        limit = min(CLONE_LIMIT, free_gpu(index) // 4)
        if nbytes > limit:
            return None, (f"{format_size(nbytes)} of the state on cuda:{index} is not guarded by an optimizer (not a "
                          f"parameter or optimizer state) and would have to be copied; the limit is "
                          f"{format_size(limit)}")
    for i in unguarded:
        tensors[i] = tensors[i].clone()
    return dataclasses.replace(plan, tensors=tuple(tensors)), ""


class Guard:
    """What `Engine.guard` returns: `remove()` stops guarding (later saves are strict again)."""

    def __init__(self, guards: list[Any], optimizer: Any, hook: Any, order: Any):
        self._guards, self.optimizer, self._hook, self._order = guards, optimizer, hook, order

    def remove(self) -> None:
        """Order the current streams after saves in flight, then stop guarding."""
        self._order()
        self._hook.remove()
        if self.optimizer in self._guards:
            self._guards.remove(self.optimizer)

