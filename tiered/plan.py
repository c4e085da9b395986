"""Planning a save: flatten the state, choose each tensor's codec, order and group the chunks.

Pure data in, frozen data out: no I/O and no device work happens here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tiered.codecs import get_codec_class
from tiered.format import CodecSpec, dtype_name
from tiered.tree import Leaf, path_str


@dataclass(frozen=True)
class TensorPlan:
    index: int
    """Leaf number in the skeleton."""
    name: str
    tensor: torch.Tensor
    spec: CodecSpec
    is_numpy: bool
    chunk_size: int
    nbytes: int

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
    return [ChunkRef(p, j, p.raw_size(j)) for p in plans for j in range(p.nchunks)]


def pieces(chunks: "list[ChunkRef] | tuple[ChunkRef, ...]") -> list[tuple[TensorPlan, int, int]]:
    """Runs of consecutive chunks of one tensor: (plan, first chunk, count)."""
    runs: list[tuple[TensorPlan, int, int]] = []
    for c in chunks:
        if runs and runs[-1][0] is c.plan and runs[-1][1] + runs[-1][2] == c.j:
            p, j0, n = runs[-1]
            runs[-1] = (p, j0, n + 1)
        else:
            runs.append((c.plan, c.j, 1))
    return runs


@dataclass(frozen=True)
class SavePlan:
    gpu: dict[int, tuple[TensorPlan, ...]]
    """CUDA device index -> its tensors, grouped by codec spec (one batched call per group)."""
    cpu: tuple[TensorPlan, ...]

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
    gpu: dict[int, list[TensorPlan]] = {}
    cpu: list[TensorPlan] = []
    for i, leaf in enumerate(leaves):
        t = leaf.tensor
        on_gpu = t.is_cuda and gpu_codecs
        spec = choose_codec(tier_codec, t.dtype, on_gpu)
        p = TensorPlan(i, path_str(leaf.path), t, spec, leaf.is_numpy, chunk_size, t.numel() * t.element_size())
        if on_gpu:
            gpu.setdefault(t.device.index, []).append(p)
        else:
            cpu.append(p)
    # Group by codec spec so each wave makes one batched codec call per spec; keep state order inside.
    grouped = {d: tuple(sorted(ps, key=lambda p: (p.spec.name, str(p.spec.configuration)))) for d, ps in gpu.items()}
    return SavePlan(gpu=grouped, cpu=tuple(cpu))
