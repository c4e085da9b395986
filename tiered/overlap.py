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
from typing import Any, Iterable, Sequence

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


class Guarded:
    """What the optimizers guard, asked of each tensor of a save (`t in guarded`): their state's
    plain tensors by identity (`optimizer.state_dict()` hands out the very tensors the step
    updates), and their parameters' memory by first byte (`model.state_dict()` hands out new
    detached views of it), as that of state that is a tensor subclass (a DTensor: a save reads its
    local shard). Identity costs a set lookup, not two calls on the tensor: for a state of
    thousands of tensors, milliseconds of a save's call (docs/benchmarks.md, session 17). Any
    other alias of optimizer state counts as unguarded, so it is cloned: safe, only more copying.
    Made per save, from the optimizers as they are then."""

    def __init__(self, optimizers: Iterable[Any]):
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        state = [v for opt in optimizers for st in opt.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor)]
        self._held = params + state
        """(Holding them keeps each id below that object's while this lives.)"""
        self._state = state
        self._ids = set(map(id, self._held))
        plain = PLAIN_TENSORS  # (storage_key inlined for plain tensors: a save asks it of every parameter)
        self._keys = {(p.get_device(), p.data_ptr()) if type(p) in plain else storage_key(p) for p in params}
        self._keys.update([storage_key(t) for t in state if type(t) not in plain])
        self._state_keys: set[tuple[int, int]] | None = None

    def __contains__(self, t: torch.Tensor) -> bool:
        return id(t) in self._ids or storage_key(t) in self._keys

    def unguarded(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """The positions of the tensors that are not `in` this: as `in` asks it of each, in one
        pass (a save asks it of every tensor of its state)."""
        ids, keys, plain = self._ids, self._keys, PLAIN_TENSORS
        return [i for i, t in enumerate(tensors) if id(t) not in ids
                and ((t.get_device(), t.data_ptr()) if type(t) in plain else storage_key(t)) not in keys]

    def by_memory(self, t: torch.Tensor) -> bool:
        """`t` starts at the first byte of a parameter's or of optimizer state's memory, whatever
        object it is: a detached alias of the very tensor that a wrapper handed on (only the
        guarded step updates that memory). The first call reads every state tensor's memory (two
        calls on each), so `overlap_plan` asks only of what `in` did not find, and only before it
        would stage a save strictly."""
        if self._state_keys is None:
            self._state_keys = {storage_key(s) for s in self._state}
        key = storage_key(t)
        return key in self._keys or key in self._state_keys


def overlap_plan(plan: SavePlan, guarded: Guarded, free_gpu: Any) -> tuple[SavePlan | None, str]:
    """(the plan with its unguarded tensors replaced by clones, "") or (None, why not) when
    cloning them would copy too much GPU memory. `free_gpu(index)`: free bytes on that GPU."""
    tensors: list[torch.Tensor] = list(plan.tensors)
    unguarded = guarded.unguarded(tensors)
    over = _over_limit(tensors, unguarded, free_gpu)
    if over:  # before staging strictly: aliases of guarded memory that are other objects are guarded too
        unguarded = [i for i in unguarded if not guarded.by_memory(tensors[i])]
        over = _over_limit(tensors, unguarded, free_gpu)
    if over:
        index, nbytes, limit = over
        return None, (f"{format_size(nbytes)} of the state on cuda:{index} is not guarded by an optimizer (not a "
                      f"parameter or optimizer state) and would have to be copied; the limit is "
                      f"{format_size(limit)}")
    for i in unguarded:
        tensors[i] = tensors[i].clone()
    return dataclasses.replace(plan, tensors=tuple(tensors)), ""


def _over_limit(tensors: list[torch.Tensor], unguarded: list[int], free_gpu: Any) -> tuple[int, int, int] | None:
    """(GPU index, unguarded bytes there, the limit) for the first GPU where cloning the
    unguarded tensors would copy more than `CLONE_LIMIT` or a quarter of its free memory; None
    where no GPU would."""
    per_gpu: dict[int, int] = {}
    for i in unguarded:
        t = tensors[i]
        if t.is_cuda:
            per_gpu[t.device.index] = per_gpu.get(t.device.index, 0) + t.numel() * t.element_size()
    for index, nbytes in per_gpu.items():
        limit = min(CLONE_LIMIT, free_gpu(index) // 4)
        if nbytes > limit:
            return index, nbytes, limit
    return None


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

