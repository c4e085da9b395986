"""Flatten a state_dict into tensor leaves and a JSON skeleton; put it back together.

Tensors (and numpy arrays) become leaves stored as chunks; everything else — step counters,
RNG states, scheduler and dataloader state — is encoded into the skeleton as plain JSON with
explicit type tags. Nothing is ever pickled, so loading runs no code from the checkpoint.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import math
import threading
from collections import OrderedDict
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from tiered.errors import StateDictError

KeyPath = tuple[Any, ...]


class Leaf(NamedTuple):
    """One tensor of a state (a named tuple: a state has thousands, made on every save)."""

    path: KeyPath
    tensor: torch.Tensor
    is_numpy: bool


def path_str(path: KeyPath) -> str:
    """model.layers[0].weight-style name for messages and listings."""
    out = ""
    for key in path:
        if isinstance(key, int) and not isinstance(key, bool):
            out += f"[{key}]"
        else:
            out += ("." if out else "") + str(key)
    return out or "<root>"


_pause_lock = threading.Lock()
_pause = {"depth": 0, "enable": False}
"""Blocks of `collector_paused` open in any thread, and whether the collector goes back on when
the last one ends."""


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a bounded burst of allocation: `Engine.save`
    flattens, plans and snapshots a state, tens of thousands of small objects, none of them in
    cycles. With the collector on, those objects set off collections that walk every object of
    the process. On a state of 8,320 tensors in a process of about a million objects, flatten +
    plan took 187-193 ms with it on and 38-39 ms paused, and a CPU save's call 243 ms against
    88 ms (docs/benchmarks.md). A restore parses as many (indexes, DCP's
    metadata and plans): parsing the DCP metadata of 10,480 tensors took 403 ms with it on and
    128 ms paused. Refcounting still frees memory.

    The collector is one per process, and blocks of several threads overlap (`reserve()`'s call
    and its thread's plan; a save's call and the stager's): it is back on, if it was, when the
    last open block ends, not the first. Back on when the first ends, the other thread's burst
    runs with it on: planning 7,880 tensors on `reserve()`'s thread so set off a full pass of the
    process there that held the GIL 156-182 ms on the CPU machine (docs/architecture.md, "Why
    `reserve()`, and why it works on a thread of its own")."""
    with _pause_lock:
        if _pause["depth"] == 0:
            _pause["enable"] = gc.isenabled()
            gc.disable()
        _pause["depth"] += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pause["depth"] -= 1
            if _pause["depth"] == 0 and _pause["enable"]:
                gc.enable()


def age_kept() -> None:
    """Collect Python's young generations now (`Engine.reserve`, at start-up): what was made for
    saves of a structure and is kept from save to save (skeleton nodes, plans, chunk records,
    serialized values) moves to the oldest generation here. Otherwise the first save's call
    passes over all of it when the collector comes back on: 145 ms of a first distributed save
    of 10,480 CPU tensors on the CPU machine, where warm saves had none."""
    gc.collect(1)


class _Kept:
    """Skeleton nodes kept from one flatten to the next, so that a save of the same structure makes
    none anew. The skeleton lives until the step's index is written (seconds), and the cyclic
    collector moves what lives that long into its oldest generation: thousands of new tuples,
    lists and dicts per save set off a full collection every few saves, which held the GIL for
    ~180 ms beside training at 24 GB. A tensor's reference {"$tensor": i} is one
    object per index; a (key, node) pair and a dict's node are kept where every node under them
    is, looked up by the ids of those nodes: each kept value holds the objects whose ids its key
    names, so an id in a key always means that object (whichever thread put it there). Bounded:
    pairs and nodes are dropped whole past `LIMIT`; references are kept up to `MAX_REFS`."""

    LIMIT = 1 << 16
    """Pairs and nodes kept at least (more for a larger state: 4 per leaf)."""
    MAX_REFS = 1 << 16
    """References kept (~19 MB at most; a state of more tensors makes its later ones anew)."""

    def __init__(self) -> None:
        self.refs: list[dict] = []
        self.pairs: dict[tuple[Any, int], tuple[Any, Any]] = {}
        self.nodes: dict[tuple[str, tuple[int, ...]], dict] = {}
        self.tensor_nodes: dict[tuple[Any, ...], dict] = {}
        """Nodes of dicts whose every value is a tensor (`_tensor_dict`), by tag, keys and the
        leaves they refer to: one lookup per dict, not one per pair."""
        self.ids: set[int] = set()
        self._grow = threading.Lock()

    def ref(self, i: int) -> dict:
        if i >= self.MAX_REFS:
            return {"$tensor": i}
        refs = self.refs
        with self._grow:  # (two threads growing it at once would give an index two references)
            while len(refs) <= i:
                r = {"$tensor": len(refs)}
                refs.append(r)
                self.ids.add(id(r))
        return refs[i]

    def trim(self, leaves: int) -> None:
        if len(self.pairs) + len(self.nodes) + len(self.tensor_nodes) > max(self.LIMIT, 4 * leaves):
            self.pairs.clear()
            self.nodes.clear()
            self.tensor_nodes.clear()
            self.ids = {id(r) for r in self.refs}


_kept = _Kept()


class Flat:
    """A state already flattened (`FlatNames.flatten`); `flatten` returns its skeleton and leaves.

    `structure`, where the maker knows it: a value that equals another Flat's only where both
    have leaves of the same paths, dtypes, shapes and devices, in the same order (a reused
    DCP plan's: tiered.distributed.reuse). The plan cache compares it instead of every leaf."""

    __slots__ = ("skeleton", "leaves", "structure")

    def __init__(self, skeleton: Any, leaves: list[Leaf], structure: Any = None):
        self.skeleton, self.leaves, self.structure = skeleton, leaves, structure


def structure_of(state: Any) -> Any:
    """A Flat state's `structure` (None for any other state: the plan cache compares its leaves)."""
    return state.structure if type(state) is Flat else None


class FlatNames:
    """Flat states {names[i]: tensors[i]} of plain tensors (a rank's items in a distributed save),
    flattened as `flatten` would flatten that dict (without `share`) but without walking it: the
    skeleton and the leaves' paths are made once, here, for every state of these names."""

    __slots__ = ("paths", "skeleton")

    def __init__(self, names: list[str]):
        self.paths = [(name,) for name in names]
        self.skeleton = {"$dict": tuple((name, _kept.ref(i)) for i, name in enumerate(names))}

    def flatten(self, tensors: list[torch.Tensor], structure: Any = None) -> Flat:
        """The state of these names and `tensors`, each taken as it is (detached by the caller);
        `structure`: see `Flat`."""
        if len(tensors) != len(self.paths):
            raise ValueError(f"{len(tensors)} tensors for {len(self.paths)} names")
        strided = torch.strided
        for path, t in zip(self.paths, tensors):
            if type(t) not in PLAIN_TENSORS:
                raise StateDictError(f"{path_str(path)}: an item of type {type(t).__name__}, not a plain tensor")
            if t.layout is not strided:
                raise StateDictError(f"{path_str(path)}: {t.layout} tensors are not supported")
        return Flat(self.skeleton, [_new_leaf(Leaf, (path, t, False)) for path, t in zip(self.paths, tensors)],
                    structure)


def flatten(state: Any, *, share: bool = False) -> tuple[Any, list[Leaf]]:
    """(skeleton, leaves): the skeleton refers to leaf i as {"$tensor": i}. Its nodes may be
    those of an earlier flatten of the same structure (`_Kept`): it is read, never changed.
    A `Flat` state is already flattened: its skeleton and leaves.

    With `share`, a tensor that is the same view of the same memory as an earlier one (tied
    weights: an embedding and an output layer holding one Parameter; one tensor put in the state
    twice) is not a leaf of its own: the skeleton refers to the earlier leaf again, so it is
    stored once and loads as one tensor in both places. Views that overlap otherwise (another
    offset, shape or stride) stay separate leaves."""
    if type(state) is Flat:
        return state.skeleton, state.leaves
    leaves: list[Leaf] = []
    try:
        skeleton = _encode(state, (), leaves, {} if share else None)
    except RecursionError:
        raise StateDictError(_too_deep(state)) from None
    _kept.trim(len(leaves))
    return skeleton, leaves


def _too_deep(state: Any) -> str:
    """Why walking `state` ran out of stack: the path of a container that contains itself, or
    how deep the state nests (found without recursion, after the walk failed)."""
    stack: list[tuple[Any, KeyPath, frozenset]] = [(state, (), frozenset())]
    deepest: KeyPath = ()
    while stack:
        obj, path, above = stack.pop()
        if not isinstance(obj, (dict, list, tuple)):
            continue
        if id(obj) in above:
            return f"{path_str(path)}: the state refers to itself here (a container inside itself): it cannot be saved"
        if len(path) > len(deepest):
            deepest = path
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        stack.extend((v, path + (k,), above | {id(obj)}) for k, v in items)
    where = path_str(deepest) if len(deepest) <= 8 else \
        f"{path_str(deepest[:3])}...{path_str(deepest[-3:])}"
    return (f"{where}: the state nests {len(deepest)} containers deep, deeper than Python's recursion limit "
            "lets it be walked: flatten it")


def shares(skeleton: Any) -> bool:
    """The skeleton refers to some leaf from more than one place (see `flatten(share=True)`)."""
    refs = list(walk_leaves(skeleton))
    return len(refs) != len(set(refs))


def _view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same view of the same memory; None for empty tensors."""
    if t.numel() == 0:
        return None
    return t.data_ptr(), t.device, t.dtype, t.shape, t.stride()  # (the address of its first element)


PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
"""The tensor types stored as leaves, tested by exact type (subclasses such as DTensor go
through tiered.dcp)."""
_PLAIN_KEYS = frozenset({str, int})
"""The key types a dict of tensors is flattened in one pass with (`_tensor_dict`)."""
_DICT = {dict}
_new_leaf = tuple.__new__
"""`Leaf(...)` without the named tuple's Python-level constructor: a save makes thousands."""


def _encode(obj: Any, path: KeyPath, leaves: list[Leaf], seen: dict | None = None) -> Any:
    # Per node, in a save's call, on the training thread: the common types are tested first,
    # by exact type, and a dict's tensors are placed without a call of this function each.
    # Nodes of the same structure as a save before are that save's nodes (`_Kept`).
    cls = type(obj)
    if cls in PLAIN_TENSORS:
        return _tensor_leaf(obj, path, leaves, seen)
    if cls is dict or cls is OrderedDict or isinstance(obj, dict):
        if obj and set(map(type, obj)) <= _PLAIN_KEYS:
            types = set(map(type, obj.values()))
            if types <= PLAIN_TENSORS:
                return _tensor_dict(obj, "$odict" if isinstance(obj, OrderedDict) else "$dict", path, leaves, seen)
            if types == _DICT:
                got = _tensor_dicts(obj, "$odict" if isinstance(obj, OrderedDict) else "$dict", path, leaves, seen)
                if got is not None:
                    return got
        items = []
        append = items.append
        pairs, kept_ids = _kept.pairs, _kept.ids
        whole = True  # (every pair kept: the node may be)
        for k, v in obj.items():
            if type(k) is str or type(k) is int:  # (an optimizer's state is keyed by int)
                k_enc = k
            elif isinstance(k, (str, int, float, bool, type(None), tuple)):
                k_enc = _encode(k, path, [])
                whole = False
            else:
                raise StateDictError(f"{path_str(path)}: dict key {k!r} of type {type(k).__name__} is not supported")
            node = _tensor_leaf(v, path + (k,), leaves, seen) if type(v) in PLAIN_TENSORS \
                else _encode(v, path + (k,), leaves, seen)
            if whole:
                key = (k_enc, id(node))
                pair = pairs.get(key)
                if pair is None:
                    pair = (k_enc, node)
                    if key[1] in kept_ids:
                        pairs[key] = pair
                    else:
                        whole = False
            else:
                pair = (k_enc, node)
            append(pair)
        tag = "$odict" if isinstance(obj, OrderedDict) else "$dict"
        if not whole:
            return {tag: items}
        key = (tag, tuple([id(p) for p in items]))
        got = _kept.nodes.get(key)
        if got is None:
            got = _kept.nodes[key] = {tag: tuple(items)}
            kept_ids.add(id(got))
        return got
    if obj is None or isinstance(obj, (str, int)):  # int covers bool
        if cls is int and obj.bit_length() > MAX_INT_BITS:
            raise _big_int(obj, path)
        return obj
    if isinstance(obj, torch.nn.Parameter):  # (a subclass of Parameter)
        return _tensor_leaf(obj, path, leaves, seen)
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
            raise StateDictError(f"{path_str(path)}: {obj.layout} / quantized / nested tensors are not supported")
        raise StateDictError(f"{path_str(path)}: tensor subclass {type(obj).__name__} is not supported "
                             "(DTensor support goes through tiered.dcp)")
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.fields is not None:
            raise StateDictError(f"{path_str(path)}: numpy arrays of dtype {obj.dtype} cannot be stored without pickling")
        leaves.append(Leaf(path, torch.from_numpy(np.ascontiguousarray(obj).copy()), True))
        return _kept.ref(len(leaves) - 1)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if isinstance(obj, np.generic):
        return {"$np": obj.dtype.str, "v": _encode(obj.item(), path, leaves, seen)}
    if isinstance(obj, bytes):
        return {"$bytes": base64.b64encode(obj).decode()}
    if isinstance(obj, torch.dtype):
        return {"$dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"$device": str(obj)}
    if isinstance(obj, torch.Size):
        return {"$size": list(obj)}
    if isinstance(obj, list):
        if all(type(v) is int or type(v) is str for v in obj):  # (a param group's ids: one call, not one each)
            if any(type(v) is int and v.bit_length() > MAX_INT_BITS for v in obj):
                i = next(i for i, v in enumerate(obj) if type(v) is int and v.bit_length() > MAX_INT_BITS)
                raise _big_int(obj[i], path + (i,))
            return list(obj)
        return [_encode(v, path + (i,), leaves, seen) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"$tuple": [_encode(v, path + (i,), leaves, seen) for i, v in enumerate(obj)]}
    raise StateDictError(
        f"{path_str(path)}: cannot checkpoint an object of type {type(obj).__module__}.{type(obj).__qualname__}; "
        "supported: tensors, numpy arrays, dict/list/tuple, str/int/float/bool/None/bytes, torch dtype/device/Size. "
        "Call .state_dict() on objects first.")


MAX_INT_BITS = 8192
"""The largest Python int a skeleton holds, in bits (2,467 decimal digits): JSON readers refuse
integers past 4,300 digits (Python's int-to-str limit), so a larger one would save and never load."""


def _big_int(value: int, path: KeyPath) -> StateDictError:
    return StateDictError(f"{path_str(path)}: an int of {value.bit_length()} bits, more than the {MAX_INT_BITS} a "
                          "checkpoint stores: keep it as bytes or a tensor")


def _tensor_leaf(obj: torch.Tensor, path: KeyPath, leaves: list[Leaf], seen: dict | None) -> Any:
    """A plain tensor or Parameter: a new leaf, or (`seen`: flatten's `share`) a reference to
    the earlier leaf that is the same view of the same memory."""
    if obj.layout is not torch.strided or obj.is_quantized or obj.is_nested:
        raise _unsupported(obj, path)
    n = len(leaves)
    if seen is not None:  # by address first: the whole view key only where two tensors share one
        addr = obj.data_ptr()
        same = seen.get(addr)
        if same is None:
            seen[addr] = n  # (the common case: one leaf at an address, kept as its index)
        else:
            i = _same_view(obj, addr, same, leaves, seen)
            if i is not None:
                return _kept.ref(i)
    leaves.append(_new_leaf(Leaf, (path, obj.detach() if obj.requires_grad else obj, False)))
    refs = _kept.refs
    return refs[n] if n < len(refs) else _kept.ref(n)


class _NotPlain(Exception):
    """`_place` met a value that is not a plain tensor, or a key that is not a str or int."""


def _place(obj: dict, path: KeyPath, leaves: list[Leaf], seen: dict | None) -> list[int] | None:
    """Make the leaves of a dict of tensors (key: a str or int; value: a plain tensor or Parameter),
    each as `_tensor_leaf` makes it, in one pass. Returns None where every value is a new leaf
    (len(leaves) at the call on, in order), else the leaf each value refers to (`seen`: a tensor
    that is the same view of the same memory as an earlier leaf refers to that one). Raises
    _NotPlain at a value or key of another kind, leaving the leaves made so far to the caller."""
    strided, plain, keytypes = torch.strided, PLAIN_TENSORS, _PLAIN_KEYS
    append = leaves.append
    n0 = len(leaves)
    idx: list[int] | None = None  # (the leaves referred to, made only once a value is an earlier leaf)
    for k, t in obj.items():
        if type(t) not in plain or type(k) not in keytypes:
            raise _NotPlain
        if t.layout is not strided or t.is_quantized or t.is_nested:
            raise _unsupported(t, path + (k,))
        n = len(leaves)
        if seen is not None:
            addr = t.data_ptr()
            same = seen.get(addr)
            if same is None:
                seen[addr] = n
            else:
                i = _same_view(t, addr, same, leaves, seen)
                if i is not None:
                    if idx is None:
                        idx = list(range(n0, n))
                    idx.append(i)
                    continue
        if idx is not None:
            idx.append(n)
        append(_new_leaf(Leaf, (path + (k,), t.detach() if t.requires_grad else t, False)))
    return idx


def _tensor_dict(obj: dict, tag: str, path: KeyPath, leaves: list[Leaf], seen: dict | None) -> dict:
    """`_encode` of a dict whose every key is a str or int and every value a plain tensor or
    Parameter (a model's state_dict, an optimizer's state of one parameter): a save's hot path,
    walked in one pass instead of `_encode`'s pair by pair (16-17% of the walk of a GPT + AdamW
    state: docs/benchmarks.md). Its leaves as `_tensor_leaf` makes them; its node kept
    by its keys and the leaves it refers to."""
    n0 = len(leaves)
    idx = _place(obj, path, leaves, seen)  # (the caller found every key and value plain)
    keys = tuple(obj)
    key = (tag, keys, n0) if idx is None else (tag, keys, tuple(idx))  # (no earlier leaf: leaves n0, n0 + 1, ...)
    kept = _kept.tensor_nodes
    node = kept.get(key)
    if node is None:
        node = {tag: tuple(zip(keys, [_kept.ref(i) for i in (range(n0, len(leaves)) if idx is None else idx)]))}
        if len(leaves) <= _Kept.MAX_REFS:  # (every reference is a kept one: the node may be kept)
            kept[key] = node
            _kept.ids.add(id(node))
    return node


def _tensor_dicts(obj: dict, tag: str, path: KeyPath, leaves: list[Leaf], seen: dict | None) -> dict | None:
    """`_encode` of a dict of dicts (exactly `dict`) of tensors, every key a str or int: an
    optimizer's state ({param id: {"step": t, "exp_avg": t, "exp_avg_sq": t}}), which is most of a
    save's tensors, in small dicts. Walked in one pass (`_place` per inner dict), the whole node
    kept by every inner dict's keys and leaves (one lookup, not one per inner dict): 14 ms of an
    18 ms walk of 10,360 tensors was this (docs/benchmarks.md). None, with nothing
    added, where some inner value is not a plain tensor (or some inner key not a str or int):
    `_encode` then walks it node by node."""
    n0 = len(leaves)
    inner_keys: list[tuple[Any, ...]] = []
    firsts: list[Any] = []
    """Per inner dict: its first leaf (its leaves follow), or the tuple of the leaves it refers to."""
    try:
        for k0, inner in obj.items():
            n1 = len(leaves)
            idx = _place(inner, path + (k0,), leaves, seen)
            inner_keys.append(tuple(inner))
            firsts.append(n1 if idx is None else tuple(idx))
    except _NotPlain:
        _forget(leaves, seen, n0)
        return None
    keys = tuple(obj)
    key = (tag, keys, tuple(inner_keys), tuple(firsts))
    kept = _kept.tensor_nodes
    node = kept.get(key)
    if node is None:
        ref = _kept.ref
        inner_nodes = [{"$dict": tuple(zip(ks, [ref(i) for i in (range(f, f + len(ks)) if type(f) is int else f)]))}
                       for ks, f in zip(inner_keys, firsts)]
        node = {tag: tuple(zip(keys, inner_nodes))}
        if len(leaves) <= _Kept.MAX_REFS:  # (every reference is a kept one: the node may be kept)
            kept[key] = node
            _kept.ids.add(id(node))
    return node


def _forget(leaves: list[Leaf], seen: dict | None, n: int) -> None:
    """Undo the leaves from `n` on (and, with `seen`, where they were noted)."""
    if seen is not None:
        for leaf in leaves[n:]:
            addr = leaf[1].data_ptr()
            same = seen.get(addr)
            if type(same) is int:
                if same >= n:
                    del seen[addr]
            elif same is not None:
                same[:] = [i for i in same if i < n]
                if not same:
                    del seen[addr]
    del leaves[n:]


def _same_view(t: torch.Tensor, addr: int, same: int | list[int], leaves: list[Leaf], seen: dict) -> int | None:
    """The earlier leaf (at `t`'s address, `same`: its index or indices) that is the same view of
    the same memory as `t`, or None: `t` will be leaf len(leaves), noted at that address."""
    if type(same) is int:
        same = seen[addr] = [same]
    key = _view_key(t)
    if key is not None:
        for i in same:
            if _view_key(leaves[i][1]) == key:
                return i
    same.append(len(leaves))
    return None


def _unsupported(t: torch.Tensor, path: KeyPath) -> StateDictError:
    return StateDictError(f"{path_str(path)}: {t.layout} / quantized / nested tensors are not supported")


def decode(skeleton: Any, leaf: Any) -> Any:
    """Rebuild the object tree; `leaf(i)` supplies leaf i (a tensor or numpy array)."""
    return _decode(skeleton, lambda i, path: leaf(i), ())


def decode_at(skeleton: Any, leaf: Any) -> Any:
    """`decode`, with `leaf(i, name)` told where in the tree (`path_str`) leaf i goes."""
    return _decode(skeleton, lambda i, path: leaf(i, path_str(path)), ())


def leaf_places(skeleton: Any) -> list[tuple[str, int]]:
    """(name, leaf index) of every place the skeleton refers to a leaf, in decode order."""
    out: list[tuple[str, int]] = []
    decode_at(skeleton, lambda i, name: out.append((name, i)))
    return out


_SCALARS = frozenset({str, int, float, bool, type(None)})
"""What JSON gives that decodes as itself (a float that is not finite is tagged: "$float")."""


def _decode(node: Any, leaf: Any, path: KeyPath) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        if set(map(type, node)) <= _SCALARS:  # (a list of plain values: one pass in C)
            return list(node)
        return [_decode(v, leaf, path + (i,)) for i, v in enumerate(node)]
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise ValueError(f"malformed skeleton node {str(node)[:80]}")
    tag = next(iter(node))
    val = node[tag]
    if tag == "$tensor":
        return leaf(_index(val), path)
    if tag in ("$dict", "$odict"):
        cls = OrderedDict if tag == "$odict" else dict
        out = cls()
        for k, v in val:
            key = k if type(k) is str or type(k) is int else _decode(k, _no_tensor, path)
            out[key] = v if type(v) in _SCALARS else _decode(v, leaf, path + (key,))
        return out
    if tag == "$tuple":
        if type(val) is list and set(map(type, val)) <= _SCALARS:  # (DCP's planner data: paths of names)
            return tuple(val)
        return tuple(_decode(v, leaf, path + (i,)) for i, v in enumerate(val))
    if tag == "$float":
        if val not in ("nan", "inf", "-inf"):
            raise ValueError(f"bad float {val!r}")
        return float(val)
    if tag == "$np":
        dtype = np.dtype(val)
        if dtype.kind not in "biufc":
            raise ValueError(f"numpy scalar of dtype {val!r} is not plain data")
        return dtype.type(_decode(node["v"], leaf, path))
    if tag == "$bytes":
        return base64.b64decode(val, validate=True)
    if tag == "$dtype":
        dtype = getattr(torch, val, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {val!r}")
        return dtype
    if tag == "$device":
        return torch.device(val)
    if tag == "$size":
        return torch.Size(val)
    raise ValueError(f"unknown skeleton tag {tag!r}")


def _no_tensor(i: int, path: KeyPath) -> Any:
    raise ValueError(f"{path_str(path)}: a dict key refers to a tensor")


def _index(val: Any) -> int:
    if not isinstance(val, int) or isinstance(val, bool) or val < 0:
        raise ValueError(f"bad tensor reference {val!r}")
    return val


def walk_leaves(skeleton: Any) -> Iterator[int]:
    """Every tensor index the skeleton refers to."""
    if isinstance(skeleton, list):
        for v in skeleton:
            yield from walk_leaves(v)
    elif isinstance(skeleton, dict):
        if "$tensor" in skeleton:
            yield _index(skeleton["$tensor"])
        for tag in ("$dict", "$odict"):
            for _, v in skeleton.get(tag, ()):
                yield from walk_leaves(v)
        for v in skeleton.get("$tuple", ()):
            yield from walk_leaves(v)


def merge_into(target: Any, loaded: Any, path: KeyPath = ()) -> Any:
    """Copy `loaded` into `target` in place where possible; return the object to keep.

    Tensors already present in `target` receive the loaded bytes (see Engine.restore: those were
    decoded straight into them); containers are updated key by key so references held by the
    caller (model.state_dict() tensors, the dict itself) stay valid. Values that cannot be
    updated in place (ints, tuples, new keys) are replaced in their parent container.
    """
    if isinstance(target, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            target[k] = merge_into(target[k], v, path + (k,)) if k in target else v
        return target
    if isinstance(target, list) and isinstance(loaded, list) and len(target) == len(loaded):
        for i, v in enumerate(loaded):
            target[i] = merge_into(target[i], v, path + (i,))
        return target
    if isinstance(target, torch.Tensor) and isinstance(loaded, torch.Tensor) and target.shape == loaded.shape \
            and target.dtype == loaded.dtype and target.device == loaded.device \
            and (target.numel() == 0 or target.data_ptr() == loaded.data_ptr()):
        return target  # the restore decoded into this very tensor (through a detached alias)
    if isinstance(target, np.ndarray) and isinstance(loaded, np.ndarray) and target.shape == loaded.shape \
            and target.dtype == loaded.dtype and target.flags.writeable:
        target[...] = loaded
        return target
    return loaded
