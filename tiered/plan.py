"""Planning a save: flatten the state, choose each tensor's codec, order and group the chunks.

Pure data in, frozen data out: no I/O and no device work happens here.
"""

from __future__ import annotations

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


def choose_codec(tensor: torch.Tensor, tier_codec: str, gpu_codecs: bool) -> CodecSpec:
    """The tier's codec where it can run for this tensor; zstd for tensors a GPU codec cannot reach.

    `ans` runs only on GPU tensors with nVCOMP present; CPU tensors (RNG states, counters, a
    CPU-only run) get `zstd`, which every machine decodes.
    """
    name = tier_codec
    cls = get_codec_class(name)
    if not cls.cpu_capable and not (tensor.is_cuda and gpu_codecs):
        name = "zstd"
    if tensor.is_cuda and not gpu_codecs:
        name = "zstd" if name != "none" else name
    return get_codec_class(name).spec_for(tensor.dtype)


def make_plan(leaves: list[Leaf], tier_codec: str, chunk_size: int, gpu_codecs: bool) -> SavePlan:
    gpu: dict[int, list[TensorPlan]] = {}
    cpu: list[TensorPlan] = []
    for i, leaf in enumerate(leaves):
        t = leaf.tensor
        dtype_name(t.dtype)  # refuses dtypes the format cannot store, naming them
        spec = choose_codec(t, tier_codec, gpu_codecs)
        p = TensorPlan(i, path_str(leaf.path), t, spec, leaf.is_numpy, chunk_size, t.numel() * t.element_size())
        if t.is_cuda and gpu_codecs:
            gpu.setdefault(t.device.index, []).append(p)
        else:
            cpu.append(p)
    # Group by codec spec so each wave makes one batched codec call per spec; keep state order inside.
    grouped = {d: tuple(sorted(ps, key=lambda p: (p.spec.name, str(p.spec.configuration)))) for d, ps in gpu.items()}
    return SavePlan(gpu=grouped, cpu=tuple(cpu))
