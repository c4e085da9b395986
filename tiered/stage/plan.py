"""Planning a save: flatten the state, choose each tensor's codec, order and group the chunks.

Pure data in, frozen data out: no I/O and no device work happens here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from tiered.codecs import get_codec_class
from tiered.errors import FormatError, StateDictError
from tiered.format.manifest import CodecSpec, dtype_name
from tiered.format.tree import Leaf, path_str


@dataclass(frozen=True)
class TensorPlan:
    """How one leaf is saved. Holds no tensor (the save's `SavePlan.tensors` does), so plans and
    everything derived from them can be cached across saves without keeping old state alive."""

    index: int
    """Leaf number in the skeleton."""
    name: str
    spec: CodecSpec
    is_numpy: bool
    chunk_size: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str

    @property
    def nchunks(self) -> int:
        return -(-self.nbytes // self.chunk_size)

    def raw_size(self, j: int) -> int:
        return min(self.chunk_size, self.nbytes - j * self.chunk_size)


@dataclass(frozen=True, slots=True)
class ChunkRef:
    plan: TensorPlan
    j: int
    raw_size: int


def chunk_refs(plans: "tuple[TensorPlan, ...] | list[TensorPlan]") -> list[ChunkRef]:
    refs: list[ChunkRef] = []
    for p in plans:
        n, cs = p.nchunks, p.chunk_size
        if n:  # (every chunk but the last is whole: `raw_size`)
            refs.extend([ChunkRef(p, j, cs) for j in range(n - 1)])
            refs.append(ChunkRef(p, n - 1, p.nbytes - (n - 1) * cs))
    return refs


class Runs:
    """The runs of one tensor's chunks, (plan, first chunk, count), in consecutive ranges of
    `chunk_refs(plans)` (a save's waves), found per tensor, not per chunk: a wave's chunks are
    thousands at scale, and this Python runs beside a training loop that shares the GIL."""

    def __init__(self, plans: Sequence[TensorPlan]):
        self.plans = [p for p in plans if p.nchunks]
        self.starts = [0]
        for p in self.plans:
            self.starts.append(self.starts[-1] + p.nchunks)
        self._t = 0

    def within(self, i: int, k: int) -> list[tuple[TensorPlan, int, int]]:
        """(plan, first chunk, count) of chunks [i, k); ranges asked for in order."""
        out = []
        t, starts = self._t, self.starts
        while starts[t + 1] <= i:
            t += 1
        while t < len(self.plans) and starts[t] < k:
            j0 = max(i - starts[t], 0)
            out.append((self.plans[t], j0, min(k, starts[t + 1]) - starts[t] - j0))
            if starts[t + 1] > k:
                break
            t += 1
        self._t = t
        return out


@dataclass(frozen=True)
class SavePlan:
    gpu: dict[int, tuple[TensorPlan, ...]]
    """CUDA device index -> its tensors, grouped by codec spec (one batched call per group)."""
    cpu: tuple[TensorPlan, ...]
    raw_bytes: int
    """The tensors' bytes in all."""
    tensors: tuple[torch.Tensor, ...] = ()
    """This save's tensors, by leaf index."""

    @property
    def all(self) -> tuple[TensorPlan, ...]:
        return tuple(p for group in self.gpu.values() for p in group) + self.cpu


@functools.lru_cache(maxsize=256)
def choose_codec(tier_codec: str, dtype: torch.dtype, on_gpu: bool) -> CodecSpec:
    """The tier's codec where it can run; zstd where it cannot.

    `on_gpu`: the tensor is on a GPU and the GPU codecs (nvCOMP) are present. `ans` runs only
    there; CPU tensors (RNG states, counters, a CPU-only run) get `zstd`, which every machine
    decodes. Pure: the same inputs always give the same spec.
    """
    name = tier_codec
    if not get_codec_class(name).cpu_capable and not on_gpu:
        name = "zstd"
    dtype_name(dtype)  # refuses dtypes the format cannot store, naming them
    return get_codec_class(name).spec_for(dtype)


def make_plan(leaves: list[Leaf], tier_codec: str, chunk_size: int, gpu_codecs: bool) -> SavePlan:
    """The plan of a state's leaves; a leaf the format cannot store (a meta tensor, a dtype it does
    not list) is refused here, in the save's call, naming its path."""
    gpu: dict[int, list[TensorPlan]] = {}
    cpu: list[TensorPlan] = []
    for i, leaf in enumerate(leaves):
        t = leaf.tensor
        if t.is_meta:
            raise StateDictError(f"{path_str(leaf.path)}: a tensor on the meta device holds no data to save "
                                 "(materialize it first: to_empty() and initialize or load it)")
        on_gpu = t.is_cuda and gpu_codecs
        try:
            spec = choose_codec(tier_codec, t.dtype, on_gpu)
        except FormatError as exc:
            raise StateDictError(f"{path_str(leaf.path)}: {exc}") from None
        p = TensorPlan(i, path_str(leaf.path), spec, leaf.is_numpy, chunk_size, t.numel() * t.element_size(), t.dtype,
                       tuple(t.shape), str(t.device))
        if on_gpu:
            gpu.setdefault(t.device.index, []).append(p)
        else:
            cpu.append(p)
    # Group by codec spec so each wave makes one batched codec call per spec; keep state order inside.
    grouped = {d: tuple(sorted(ps, key=lambda p: (p.spec.name, str(p.spec.configuration)))) for d, ps in gpu.items()}
    return SavePlan(gpu=grouped, cpu=tuple(cpu), tensors=tuple(leaf.tensor for leaf in leaves),
                    raw_bytes=sum(p.nbytes for group in grouped.values() for p in group) + sum(p.nbytes for p in cpu))


class PlanCache:
    """The last save's plan, reused while the state keeps its structure.

    Every save of a training run passes the same structure: the same keys, dtypes, shapes and
    devices, with new values. Planning it again costs milliseconds of Python per save on states
    of hundreds of tensors; the key below costs a fraction of that. The cached plan holds no
    tensors. The devices cache their pack layouts on the identity of `SavePlan.gpu`'s groups.
    """

    def __init__(self) -> None:
        self._key: Any = None
        self._plan: SavePlan | None = None

    def plan(self, leaves: list[Leaf], tier_codec: str, chunk_size: int, gpu_codecs: bool,
             structure: Any = None) -> SavePlan:
        """`structure`: the leaves' `tree.Flat.structure`, where known; it stands for the key of
        each leaf's path, dtype, shape and device (a distributed save's: its reused DCP plan
        compared them on its own walk of the state already)."""
        if structure is not None:
            key: Any = (structure, tier_codec, chunk_size, gpu_codecs)
        else:  # (on the training thread, per tensor: a list of plain tuples, compared in C)
            key = [(path, t.dtype, t.shape, t.device, is_numpy) for path, t, is_numpy in leaves]
            key.append((tier_codec, chunk_size, gpu_codecs))
        if self._plan is None or key != self._key:
            plan = make_plan(leaves, tier_codec, chunk_size, gpu_codecs)
            self._plan, self._key = replace(plan, tensors=()), key  # (no tensors kept)
            return plan
        return replace(self._plan, tensors=tuple([leaf[1] for leaf in leaves]))
