"""Warm distributed saves skip DCP's planning: a state of the same structure reuses the last plan.

DCP's DefaultSavePlanner flattens the state and builds a write item for every tensor on every
save: 112-120 ms at 2 ranks for a state of 8,320 tensors on this repository's CPU machine, 116 ms
on an H200 for 7,880, growing with the tensor count. Every save of a training run
has the same structure, so `PlanReuse` walks the state once per save the way DCP's flatten does
(`torch.distributed.checkpoint`'s traversal: mappings entered, lists entered where they hold
tensors, mappings or such lists, anything else a leaf), recording each leaf's path and what DCP's
write items depend on: type, shape, dtype, device, requires_grad, pinned memory, and a DTensor's
placements, mesh and local shape. Where that signature equals the last save's on every rank (the
caller's one all-reduce), the last final plan and metadata serve again, and each item's data is
the leaf at the path DCP's flatten gave its name: the tensor itself, a DTensor's local tensor, or
a value serialized as DCP's planner does. A state DCP would plan in a way this cannot follow
(ShardedTensor, objects that make their own write items) is planned by DCP every time.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = ()  # type: ignore[assignment,misc]

_TENSOR, _LOCAL, _BYTES = 0, 1, 2


class PlanReuse:
    """The last distributed save's plan, and when the next one may reuse it."""

    def __init__(self) -> None:
        self._sig: list | None = None
        self._plan: SavePlan | None = None
        self._metadata: Any = None
        self._sources: list[tuple[int, int]] = []
        """Per item of the plan: (its leaf's position in `walk`'s leaves, its kind)."""
        self._positions: list[int] = []
        """Per item: its leaf's position (`_sources`' first column, for `Resolve.batch`)."""
        self._locals: list[int] = []
        """The items that are a DTensor's local tensor."""
        self._bytes: list[int] = []
        """The items that are values serialized (BYTE_IO)."""
        self._serialized: dict[int, tuple[bytes, bytes]] = {}
        """Per leaf serialized for a BYTE_IO item: (its pickle, its torch.save bytes) last time."""
        self.token: object | None = None
        """One object per kept plan: every save that reuses it resolves tensor items of the same
        dtypes, shapes and devices, in the same order (the signature says so), so the save
        pipeline's plan cache compares this instead of each item (`tree.Flat.structure`)."""

    @staticmethod
    def walk(state: Any) -> tuple[list, list]:
        """(signature, leaves) of `state`, in DCP's traversal order. The signature holds each
        mapping's keys and each list's length where the walk enters them, and each leaf's
        properties, in that order: equal signatures mean the same paths to the same kinds of
        leaves, without a path made per leaf (`paths` makes them, for a plan DCP makes)."""
        sig: list = []
        leaves: list = []
        _walk(state, sig, leaves)
        return sig, leaves

    @staticmethod
    def paths(state: Any) -> list[tuple]:
        """Each leaf's path in `state` (DCP's flatten: mapping keys as strings, list indices),
        in `walk`'s order."""
        out: list[tuple] = []
        for key, value in state.items():
            _paths(value, (str(key),), out)
        return out

    def matches(self, sig: list) -> bool:
        """The last save's plan fits a state of signature `sig` (this rank's view)."""
        return self._sig is not None and self._sig == sig

    def plan(self) -> tuple[SavePlan, Any]:
        """The last save's final plan for this rank and its metadata (the coordinator's; else None)."""
        assert self._plan is not None
        return self._plan, self._metadata

    def resolver(self, leaves: list) -> "Resolve":
        """The data of the last plan's items, from this save's `leaves` (`Resolve`)."""
        return Resolve(self._sources, self._positions, self._locals, self._bytes, self._serialized, leaves)

    def remember(self, sig: list, leaves: list, paths: list[tuple], planner: SavePlanner, plan: SavePlan,
                 metadata: Any) -> None:
        """Keep a save DCP planned, for the next ones to reuse where each of its items can be
        found again by its path (`paths`: each leaf's; otherwise nothing is kept, and DCP plans
        the next save too)."""
        self._sig, self.token = None, None
        mappings = getattr(planner, "mappings", None)
        if not isinstance(mappings, dict) or _OWN_WAY in sig or len(paths) != len(leaves):
            return
        where = {path: i for i, path in enumerate(paths)}
        sources = []
        for item in plan.items:
            pos = where.get(mappings.get(item.index.fqn))
            if pos is None:
                return
            obj = leaves[pos]
            if item.type == WriteItemType.BYTE_IO:
                sources.append((pos, _BYTES))
            elif isinstance(obj, DTensor):
                sources.append((pos, _LOCAL))
            elif type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
                sources.append((pos, _TENSOR))
            else:
                return
        self._sig, self._plan, self._metadata, self._sources = sig, plan, metadata, sources
        self._positions = [pos for pos, _ in sources]
        self._locals = [j for j, (_, kind) in enumerate(sources) if kind == _LOCAL]
        self._bytes = [j for j, (_, kind) in enumerate(sources) if kind == _BYTES]
        self._serialized = {}
        self.token = object()


class Resolve:
    """A reused plan's items' data from one save's leaves: `resolve(i, item)` gives item i's, as
    a planner's `resolve_data` does (the tensor itself, a DTensor's local tensor, or a value
    serialized into a BytesIO); `batch()` gives every item's at once, in the plan's order, by
    position rather than item by item (`StepWriter.items`: thousands of items a save, on the
    training thread). It holds the plan's lists as they were when it was made."""

    __slots__ = ("_sources", "_positions", "_locals", "_bytes", "_serialized", "_leaves")

    def __init__(self, sources: list[tuple[int, int]], positions: list[int], local_items: list[int],
                 byte_items: list[int], serialized: dict[int, tuple[bytes, bytes]], leaves: list):
        self._sources, self._positions, self._locals, self._bytes = sources, positions, local_items, byte_items
        self._serialized, self._leaves = serialized, leaves

    def __call__(self, i: int, item: WriteItem) -> Any:
        pos, kind = self._sources[i]
        obj = self._leaves[pos]
        if kind == _TENSOR:
            return obj
        if kind == _LOCAL:
            return obj.to_local()
        return _serialize(self._serialized, pos, obj)

    def batch(self) -> tuple[list, list[int]]:
        """(every item's data, in the plan's order; the positions in it of the serialized values)."""
        leaves = self._leaves
        out = [leaves[p] for p in self._positions]
        for j in self._locals:
            out[j] = out[j].to_local()
        for j in self._bytes:
            out[j] = _serialize(self._serialized, self._positions[j], out[j])
        return out, self._bytes


def _serialize(kept: dict[int, tuple[bytes, bytes]], pos: int, obj: Any) -> io.BytesIO:
    """Leaf `pos` (`obj`), a value, serialized as DefaultSavePlanner.transform_object does, but
    torch.save (a zip archive, ~0.1 ms) runs only where the value changed since the plan's last
    save (`kept`: per leaf, its pickle and its torch.save bytes then): an optimizer's
    hyperparameters (a dozen per param group) mostly do not. Compared by their pickle, not by `==`
    on a kept object that the caller may have changed in place since."""
    try:
        key = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - not picklable plainly: torch.save decides
        key = None
    got = kept.get(pos)
    if key is not None and got is not None and got[0] == key:
        return io.BytesIO(got[1])
    data = io.BytesIO()
    torch.save(obj, data)
    if key is not None:
        kept[pos] = (key, data.getvalue())
    return data


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_OWN_WAY = ("x",)
"""A leaf DCP plans its own way (ShardedTensor, objects that make their own write items)."""
_OBJECT = ("o",)


def _walk(value: Any, sig: list, leaves: list) -> None:
    # Per leaf, on the training thread (7,880 tensors at 24 GB a rank): a mapping's tensors are
    # taken in its own loop, exact types first, with no recursion and no path per leaf.
    cls = type(value)
    if cls is dict or isinstance(value, Mapping):
        sig.append(("m", tuple(value)))
        for v in value.values():
            c = type(v)
            if c is torch.Tensor or c is torch.nn.Parameter:
                sig.append(_tensor_sig(v))
                leaves.append(v)
            else:
                _walk(v, sig, leaves)
    elif cls in _PLAIN:
        sig.append(_tensor_sig(value))
        leaves.append(value)
    elif cls is list and not _terminal(value):
        sig.append(("l", len(value)))
        for v in value:
            _walk(v, sig, leaves)
    else:
        sig.append(_leaf_sig(value))
        leaves.append(value)


def _paths(value: Any, path: tuple, out: list) -> None:
    """`_walk`'s leaves' paths, as DCP's flatten names them."""
    if type(value) is dict or isinstance(value, Mapping):
        for k, v in value.items():
            _paths(v, path + (str(k),), out)
    elif type(value) is list and not _terminal(value):
        for i, v in enumerate(value):
            _paths(v, path + (i,), out)
    else:
        out.append(path)


def _terminal(value: list) -> bool:
    """DCP's rule: a list is a leaf unless it holds a tensor, a mapping, or a list that is not one."""
    for entry in value:
        if isinstance(entry, (torch.Tensor, Mapping)) or (isinstance(entry, list) and not _terminal(entry)):
            return False
    return True


def _leaf_sig(value: Any) -> tuple:
    if isinstance(value, DTensor):
        local = value.to_local()
        return ("d", value.shape, value.dtype, value.device, value.requires_grad, tuple(value.placements),
                id(value.device_mesh), local.shape)
    if isinstance(value, torch.Tensor):
        if type(value) not in _PLAIN:
            return _OWN_WAY  # ShardedTensor and other subclasses: DCP plans them its own way
        return _tensor_sig(value)
    if hasattr(value, "__create_write_items__"):
        return _OWN_WAY
    return _OBJECT


def _tensor_sig(value: torch.Tensor) -> tuple:
    """What DCP's write item for a plain tensor depends on."""
    return (value.shape, value.dtype, value.device, value.requires_grad, not value.is_cuda and value.is_pinned())
