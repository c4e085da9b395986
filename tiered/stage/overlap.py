"""Which tensors of a save an optimizer guards, for saves that overlap the next forward/backward.

Training mutates what it checkpoints only in the optimizer step: parameters and optimizer
state. With `Engine.guard(optimizer)`, `save()` returns before the GPU has read the state, the
state is read on a side stream while the next forward and backward run, and the guarded
optimizer's `step()` waits (on the GPU, through an event) until it has been read. Everything
else in the state (buffers that forward updates, such as BatchNorm statistics; an EMA copy
updated by hand) is not guarded: it is cloned in the caller's stream when `save()` is called,
and saved from the clone. Where that would copy much (more than `CLONE_LIMIT`, or a quarter
of the GPU memory free), the save is staged strictly instead, and the log says why once.

Once a guarded save's call, or `Engine.reserve` under a guard, has walked and planned a large
state (`tiered.save.pipeline.DEFER_AFTER_MS`; with `Engine.guard(optimizer, defer_walk=True)` on every
guard, once either has planned it at all), the next `save()` walks
nothing: it clones what the last save found unguarded (`Learned`, by the memory it lies in),
records where training's streams are, and returns; the stager thread walks
and plans the state (`deferred_plan`) before it reads it, and the guarded optimizer step waits
for that as it waits for the reads. What the walk then finds unguarded that was not cloned in
the call (a tensor new to the state) is cloned by the stager, after what training had queued at
the call: a tensor the next forward writes (a new BatchNorm's statistics) may then hold a later
value in that one save, which the log says. Values that are not tensors are read by the stager
too, before the optimizer step. A small state's walk stays in the call: on the stager thread
it shares the GIL with the training thread launching the next step, and where launching bounds
the step that saved nothing (docs/benchmarks.md);
`defer_walk=False` keeps every walk in the call. Under torchrun a save's walk comes with DCP's
plan (a collective): the stager thread does both only with `defer_walk=True` on every guard
(`SavePipeline.save_later`); the default guard keeps them in the call .
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch

from tiered.format.tree import PLAIN_TENSORS
from tiered.stage.plan import SavePlan
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
    thousands of tensors, milliseconds of a save's call (docs/benchmarks.md). Any
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


def to_clone(tensors: Sequence[torch.Tensor], guarded: Guarded, free_gpu: Any) -> tuple[list[int] | None, str]:
    """(the positions of the tensors an overlapped save clones, "") or (None, why not) when
    cloning them would copy too much GPU memory. `free_gpu(index)`: free bytes on that GPU."""
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
    return unguarded, ""


def overlap_plan(plan: SavePlan, guarded: Guarded, free_gpu: Any) -> tuple[SavePlan | None, str, list[int]]:
    """(the plan with its unguarded tensors replaced by clones, "", their positions) or (None, why
    not, []): see `to_clone`."""
    unguarded, why = to_clone(plan.tensors, guarded, free_gpu)
    if unguarded is None:
        return None, why, []
    tensors: list[torch.Tensor] = list(plan.tensors)
    for i in unguarded:
        tensors[i] = tensors[i].clone()
    return dataclasses.replace(plan, tensors=tuple(tensors)), "", unguarded


def view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same view of the same memory."""
    return t.get_device(), t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


class _Source(NamedTuple):
    """Where an unguarded tensor of the last save lies: its memory held weakly (a tensor the
    caller made for that save alone is let go with it), and its view of that memory."""

    storage: "weakref.ref[Any]"
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    key: tuple[Any, ...]
    end: int
    """The byte of the storage after the view's last element: what it must still hold."""


def _source(t: torch.Tensor) -> _Source:
    size = t.element_size()
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return _Source(weakref.ref(t.untyped_storage()), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                   t.device, view_key(t), (t.storage_offset() + span) * size)


class Learned:
    """What an overlapped save learned of its state, for the next `save()` to return without
    walking it: the optimizers that guarded it, the GPUs its tensors were on, and where its
    unguarded tensors lie. Made by the stager thread (or `reserve`, or a first save) from the
    save's plan; read by the call, which clones the unguarded tensors whose memory is still in
    use (`clone_now`) and records events on those GPUs."""

    def __init__(self, guards: Sequence[Any], tensors: Sequence[torch.Tensor], unguarded: Sequence[int],
                 devices: Iterable[int], raw_bytes: int):
        self.guards = tuple(guards)
        self.devices = tuple(devices)
        self.raw_bytes = raw_bytes
        self.sources = [_source(tensors[i]) for i in unguarded]

    def fits(self, guards: Sequence[Any]) -> bool:
        """Learned under these very optimizers (a guard added or removed since: walk again)."""
        return len(guards) == len(self.guards) and all(a is b for a, b in zip(guards, self.guards))

    def clone_now(self) -> dict[tuple[Any, ...], torch.Tensor]:
        """Clones, on the current streams, of the last save's unguarded tensors whose memory is
        still in use, by `view_key`: one clone and one small view per tensor, no walk."""
        clones = {}
        for src in self.sources:
            storage = src.storage()
            # (memory resized or moved since, as FSDP frees a parameter's: not that view; and set_
            # would grow the storage back)
            if storage is None or storage.nbytes() < src.end or \
                    storage.data_ptr() + src.offset * src.key[2].itemsize != src.key[1]:
                continue
            view = torch.empty(0, dtype=src.dtype, device=src.device).set_(storage, src.offset, src.shape, src.stride)
            clones[src.key] = view.clone()
        return clones


def clone_after(t: torch.Tensor, after: dict[int, Any], stream_of: Callable[[int], Any]) -> torch.Tensor:
    """A clone of `t` made on the save's stream (`stream_of(gpu)`) after what training had queued
    at the save's call (`after[gpu]`, an event), which then stands for the clone too: the save's
    reads, on whichever stream, wait for it (a CPU tensor: cloned now)."""
    index = t.get_device()
    if index < 0:
        return t.clone()
    stream = stream_of(index)
    with torch.cuda.stream(stream):
        if after.get(index) is not None:
            stream.wait_event(after[index])
        made = t.clone()
        after[index] = torch.cuda.Event()
        after[index].record(stream)
    return made


class Deferred(NamedTuple):
    """`deferred_plan`'s answer."""

    plan: SavePlan
    """The plan with every unguarded tensor replaced by a clone (or, beyond the limit, read as it is)."""
    unguarded: list[int]
    """The positions of the unguarded tensors (for the next `Learned`)."""
    new: list[int]
    """Of those, the ones `save()` had no clone of (cloned now, or read as they are)."""
    why: str
    """Non-empty where the new ones were too large to clone (`to_clone`'s reason)."""


def deferred_plan(plan: SavePlan, guarded: Guarded, free_gpu: Any, clones: dict[tuple[Any, ...], torch.Tensor],
                  clone: Callable[[torch.Tensor], torch.Tensor]) -> Deferred:
    """For a save whose call walked nothing (on the stager thread, once it has walked the state):
    its unguarded tensors replaced by the clones `save()` made of the same views (`clones`), the
    others by `clone(t)`, unless cloning those would copy too much GPU memory: they are then
    read as they are."""
    tensors: list[torch.Tensor] = list(plan.tensors)
    unguarded = guarded.unguarded(tensors)
    new = []
    for i in unguarded:
        made = clones.get(view_key(tensors[i]))
        if made is None:
            new.append(i)
        else:
            tensors[i] = made
    why = ""
    if new:
        fresh, why = to_clone([tensors[i] for i in new], guarded, free_gpu)
        fresh_set = set(new)
        unguarded = [i for i in unguarded if i not in fresh_set]  # (the next call clones these: not those read as is)
        if fresh is not None:
            new = [new[j] for j in fresh]  # (less aliases of guarded memory)
            for i in new:
                tensors[i] = clone(tensors[i])
            unguarded += new
    return Deferred(dataclasses.replace(plan, tensors=tuple(tensors)), unguarded, new, why)


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


def say_new(step: int, got: Deferred, first: str) -> None:
    """Log that a deferred save found unguarded tensors its call had not cloned (`got.new`, the
    first of them at path `first`), and what became of them."""
    log.log(logging.WARNING if got.why else logging.INFO,
            "tiered: step %d: %d tensors that no guarded optimizer updates lie where the last save had none (the "
            "first: %s; a tensor made anew for each save, such as an RNG state, always does): %s by the stager "
            "thread after save() returned, so one that the next forward changes holds its later value; %s", step,
            len(got.new), first, "read as they are" if got.why else "copied",
            f"{got.why}, so the next save is planned in its call and staged strictly" if got.why
            else "from the next save on, those that stay where they are are copied in save()")


def recorded(index: int) -> Any:
    """An event recorded now on GPU `index`'s current stream."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(index))
    return ev


class Guard:
    """What `Engine.guard` returns: `remove()` stops guarding (later saves are strict again)."""

    def __init__(self, optimizer: Any, hook: Any, order: Callable[[], None], forget: Callable[[Any], None]):
        self.optimizer, self._hook, self._order, self._forget = optimizer, hook, order, forget

    def remove(self) -> None:
        """Order the current streams after saves in flight, then stop guarding."""
        self._order()
        self._hook.remove()
        self._forget(self.optimizer)

