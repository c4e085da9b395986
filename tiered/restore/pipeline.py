"""The restore pipeline: read plan -> fetch with per-chunk fallback -> verify -> decode -> place.

    Restorer.load(step, target, order)          order: TierCatalog.restore_order's tiers
      -> open the step on the first tier whose manifest and index read (the next one otherwise)
      -> plan: each stored tensor to its destination (the target's tensor where shape and dtype
         match, else a new one on `device` or where it was saved)
      -> decode_rank: GPU codecs read into GPU buffers (KvikIO), checksums verified and decoded on
         the GPU (tiered.gpu.device); CPU codecs read in windows, verified and decoded on the codec pool
         (tiered.stage.cpu: chunk_windows -> verified -> decode_into, the same chunk reads the migrator
         and `verify_step` use)
      -> a chunk failing its checksum, or a missing data file, is served by `ChunkRepair`
         (tiered.stage.repair) from the next slower tier holding the step
      -> the state rebuilt from the index's skeleton (tiered.format.tree)

`Engine.restore` / `Engine.load` call `Restorer`; DCP's StorageReader (tiered.distributed.storage)
calls `decode_rank` and `ChunkRepair` for the chunk ranges its plan needs; `tiered verify` calls
`verify_step`.

Every tier stores a tensor as chunks of the same uncompressed size, whatever its codec, so chunk
j of a tensor covers the same bytes on every tier: a damaged or missing chunk on the fast tier is
replaced by decoding chunk j of the same tensor from the next tier that holds the step. Used by
`Engine.restore` / `Engine.load`; say what happened in the log, once per chunk for the first few
and as a summary at the end.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tiered import threads
from tiered.codecs import get_codec, get_codec_class
from tiered.config import ZstdSettings
from tiered.errors import (CheckpointNotFoundError, CodecUnavailableError, FormatError, StateDictError,
                           TieredError)
from tiered.format import tree
from tiered.format.manifest import (Manifest, RankIndex, TensorRecord, dtype_name, index_file_name, read_step)
from tiered.gpu.runtime import Workers
from tiered.stage import cpu
from tiered.stage.repair import ChunkRepair
from tiered.tiers import device_reader
from tiered.tiers.catalog import TierCatalog, summarize
from tiered.tiers.leases import hold

log = logging.getLogger("tiered")
STAGED_BYTES = 256 << 20
"""Bytes a restore decodes into buffers of its own, at a time, before copying them to destinations
it cannot decode into directly (GPU tensors without GPU codecs, non-contiguous views, parts of a
stored tensor: also `dcp_storage`'s bound)."""


def decode_rank(step: int, index: RankIndex, dests: dict[int, torch.Tensor], tier: Any, repair: ChunkRepair | None, *,
                gpu_ready: bool, device: Callable[[int], Any], pool: ThreadPoolExecutor, settings: ZstdSettings) -> None:
    """Decode every tensor of one rank's `index` into `dests` (tensor index -> destination): CPU
    codecs on `pool`, GPU codecs on `device(cuda index)` (a GpuDevice). `repair` (a ChunkRepair,
    or None) stands in for chunks that fail here, for the whole data file when it is missing or
    truncated, and for tensors in a GPU-only codec on a machine without GPU codecs."""
    by_gpu: dict[int, list[tuple[TensorRecord, torch.Tensor]]] = {}
    on_cpu: list[tuple[TensorRecord, torch.Tensor]] = []
    elsewhere: set[int] = set()  # tensors this machine cannot decode from this tier: read from slower ones
    for rec in index.tensors:
        dst = dests[rec.index]
        cls = get_codec_class(rec.codec.name)
        if not cls.cpu_capable and not gpu_ready and repair is not None and rec.chunks:
            if not elsewhere:
                log.warning("tiered: step %d: tier %r stores %r with %s, which needs a GPU to decode; reading such "
                            "tensors from the slower tiers", step, tier.name, rec.name, rec.codec.name)
            elsewhere.add(rec.index)
            on_cpu.append((rec, dst))
            continue
        if not cls.cpu_capable and not gpu_ready:
            raise CodecUnavailableError(
                f"{tier.describe(step, index.data_file)}: tensor {rec.name!r} is stored with codec "
                f"{rec.codec.name!r}, which needs an NVIDIA GPU with nvCOMP to decode. Restore on a GPU "
                "machine, or from a tier holding a CPU-decodable copy (zstd).")
        if gpu_ready and cls.gpu_capable and (dst.is_cuda or not cls.cpu_capable):
            by_gpu.setdefault(dst.device.index if dst.is_cuda else torch.cuda.current_device(), []).append((rec, dst))
        else:
            on_cpu.append((rec, dst))
    if index.data_bytes == 0:  # no tensor bytes in this rank: nothing to read (S3 stores no object)
        for rec, dst in on_cpu + [item for items in by_gpu.values() for item in items]:
            if rec.chunks:
                raise FormatError(f"{tier.describe(step, index.data_file)}: chunks in an empty data file")
        return
    host_reader = None
    try:
        host_reader = tier.open_data_reader(step, index.data_file, device=False)
        if host_reader.size != index.data_bytes:
            raise FormatError(f"{host_reader.path}: data file has {host_reader.size} bytes, the index says "
                              f"{index.data_bytes} (truncated or replaced)")
    except (TieredError, OSError) as exc:
        if host_reader is not None:
            host_reader.close()
            host_reader = None
        if repair is None:
            raise
        log.warning("tiered: step %d: %s; reading every chunk from the slower tiers", step, exc)
        # Every tensor through the CPU path, its chunks supplied by the slower tiers.
        on_cpu += [item for items in by_gpu.values() for item in items]
        by_gpu = {}
    def decode_on_cpu() -> None:
        try:
            todo = [(rec, dst) for rec, dst in on_cpu if rec.nbytes]
            for rec, dst in todo:
                if rec.index in elsewhere:
                    decode_into_place([(rec, dst)], None, f"{rec.codec.name} needs a GPU to decode")
            decode_into_place([item for item in todo if item[0].index not in elsewhere], host_reader,
                              "the data file is missing")
        finally:
            if host_reader is not None:
                host_reader.close()

    def decode_into_place(items: list[tuple[TensorRecord, torch.Tensor]], reader: Any, why: str) -> None:
        """Decode straight into contiguous CPU destinations; into buffers of at most
        `STAGED_BYTES` at a time for the others (GPU tensors, views), copied there after."""
        batch: list[tuple[TensorRecord, np.ndarray]] = []
        after: list[tuple[torch.Tensor, np.ndarray, TensorRecord]] = []
        staged = 0
        for k, (rec, dst) in enumerate(items):
            if dst.device.type == "cpu" and dst.is_contiguous():
                batch.append((rec, dst.reshape(-1).view(torch.uint8).numpy()))
            else:
                out = np.empty(rec.nbytes, dtype=np.uint8)
                batch.append((rec, out))
                after.append((dst, out, rec))
                staged += rec.nbytes
            if staged >= STAGED_BYTES or k == len(items) - 1:
                cpu.decode_tensors(batch, reader, pool, settings, index.chunk_size, repair, why)
                for d, out, r in after:
                    d.copy_(torch.from_numpy(out).view(r.torch_dtype).reshape(r.shape))
                batch, after, staged = [], [], 0

    if not by_gpu:
        decode_on_cpu()
        return
    # CPU tensors (optimizer step counters, RNG states: small, many) decode on a thread meanwhile.
    failed: list[BaseException] = []

    def run_cpu() -> None:
        try:
            decode_on_cpu()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            failed.append(exc)

    worker = threads.start(run_cpu, name="tiered-restore-cpu")
    try:
        for dev, items in by_gpu.items():
            reader = device_reader(tier, step, index.data_file)
            try:
                device(dev).restore(items, reader, index.chunk_size, repair)
            finally:
                reader.close()
    finally:
        worker.join()
    if failed:
        raise failed[0]


class Restorer:
    """The restore side of one Engine: reads committed steps back through `workers`."""

    def __init__(self, config: Any, catalog: TierCatalog, workers: Workers):
        self.config, self.catalog, self.workers = config, catalog, workers

    def read_index(self, step: int, tier: str | None = None, rank: int = 0) -> tuple[Manifest, RankIndex]:
        """A committed step's manifest and the index of `rank`, validated and cross-checked."""
        manifest, indexes = read_step(self.catalog.get(tier), step)
        if manifest.world_size == 1:
            return manifest, indexes[0]
        found = [i for i in indexes if i.rank == rank]
        if not found:
            raise CheckpointNotFoundError(f"step {step} has no files of rank {rank}")
        return manifest, found[0]

    def decode(self, step: int, index: RankIndex, dests: dict[int, torch.Tensor], tier: Any,
               repair: "ChunkRepair | None") -> None:
        """`decode_rank` with this engine's codec pool and GPU devices."""
        decode_rank(step, index, dests, tier, repair, gpu_ready=self.workers.gpu_ready, device=self.workers.device,
                    pool=self.workers.pool, settings=self.config.zstd)

    def load(self, step: int, target: Any, *, strict: bool, device: torch.device | None,
             order: list[Any]) -> tuple[Any, str]:
        """Decode `step` from the first tier of `order` that opens; the rest stand in for its
        damaged chunks. Returns (state, name of the tier read). Retention leaves the step on
        every tier of `order` while it is read (`tiered.tiers.leases`)."""
        with hold(order, step):
            return self._load(step, target, strict=strict, device=device, order=order)

    def _load(self, step: int, target: Any, *, strict: bool, device: torch.device | None,
              order: list[Any]) -> tuple[Any, str]:
        for i, tier in enumerate(order):
            try:
                manifest, indexes = read_step(tier, step)
                if manifest.dcp is not None:
                    raise FormatError(f"{tier.describe(step, 'MANIFEST.json')}: step {step} was saved through "
                                      "torch.distributed.checkpoint: load it into a state_dict with Engine.restore "
                                      "or dcp.load(..., storage_reader=tiered.dcp.TieredStorageReader(...))")
                index = indexes[0]  # saved by one process; every rank restores the same state
                break
            except (TieredError, OSError) as exc:
                if i + 1 == len(order):
                    raise
                log.warning("tiered: step %d: cannot open it on tier %r (%s); reading tier %r instead", step,
                            tier.name, exc, order[i + 1].name)
        repair = ChunkRepair(step, 0, tier.name, order[i + 1:], self.config.zstd, index.chunk_size)
        _, leaves = tree.flatten(target)
        targets = {tree.path_str(leaf.path): leaf for leaf in leaves}
        records = {rec.index: rec for rec in index.tensors}
        try:
            places = tree.leaf_places(index.skeleton)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise FormatError(f"{tier.describe(step, index_file_name(0))}: skeleton: {exc}") from None
        dests: dict[int, torch.Tensor] = {}
        given: dict[str, torch.Tensor] = {}
        """Target tensors that receive a tensor stored once for several places (tied weights
        restored into a state whose tensors are not tied): copied after decoding."""
        for name, i in places:
            rec = records[i]
            leaf = targets.pop(name, None)
            if leaf is not None:
                t = leaf.tensor
                if t.dtype != rec.torch_dtype or tuple(t.shape) != rec.shape:
                    raise StateDictError(f"{name}: step {step} stores {rec.dtype}{list(rec.shape)}, but the "
                                         f"state_dict has {dtype_name(t.dtype)}{list(t.shape)}")
                if not leaf.is_numpy:
                    if i not in dests:
                        dests[i] = t
                    elif t.data_ptr() != dests[i].data_ptr() or t.device != dests[i].device:
                        given[name] = t
                    continue
            if i not in dests:
                where = device or (leaf.tensor.device if leaf is not None else _saved_device(rec.device))
                dests[i] = torch.empty(rec.shape, dtype=rec.torch_dtype, device=where)
        if strict and targets:
            raise StateDictError(f"step {step} has no entry for {summarize(sorted(targets))} of the given state_dict "
                                 "(pass strict=False to leave them as they are)")
        try:
            self.decode(step, index, dests, tier, repair if repair else None)
        finally:
            repair.close()
        where_stored = dict(places)
        for name, t in given.items():
            t.copy_(dests[where_stored[name]])
        numpy_leaves = {rec.index for rec in index.tensors if rec.is_numpy}

        def leaf_at(i: int, name: str) -> Any:
            if name in given:
                return given[name]
            return dests[i].cpu().numpy() if i in numpy_leaves else dests[i]  # (numpy: on the host, whatever `device`)

        return tree.decode_at(index.skeleton, leaf_at), tier.name


def _saved_device(device: str) -> torch.device:
    try:
        d = torch.device(device)
    except RuntimeError:
        return torch.device("cpu")
    if d.type == "cuda" and torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count():
        return d
    return torch.device("cpu")


def verify_step(tier: Any, step: int, indexes: Sequence[Any], pool: Any, settings: Any, *, quick: bool,
                progress: Callable[[int], None]) -> str:
    """Read every chunk of the ranks `indexes` of `step` on `tier`, check its checksum and, unless
    `quick`, decode it where this machine can (CPU codecs; ans needs a GPU). Raises the first
    damage found; returns a note on what was checked. `progress(n)`: raw bytes done."""
    undecoded = 0
    for index in indexes:
        if not index.data_bytes:
            continue
        reader = tier.open_data_reader(step, index.data_file, device=False)
        try:
            if reader.size != index.data_bytes:
                raise TieredError(f"{reader.path}: data file has {reader.size} bytes, the index says {index.data_bytes}")
            for rec in index.tensors:
                if not quick and not get_codec(rec.codec, settings).cpu_capable:
                    undecoded += len(rec.chunks)
            buffers = cpu.WindowBuffers()
            for window, data, base in cpu.chunk_windows(cpu.file_order(index.tensors), reader, buffers):
                def one(ref: tuple[TensorRecord, int]) -> None:
                    rec, j = ref
                    stored = cpu.verified(rec, j, data, base, reader.path)
                    codec = get_codec(rec.codec, settings)
                    if not quick and codec.cpu_capable:
                        out = np.empty(rec.chunks[j].raw_size, dtype=np.uint8)
                        cpu.decode_into(codec, rec, j, stored, memoryview(out), reader.path)

                list(pool.map(one, window))
                buffers.give(data)
                progress(sum(rec.chunks[j].raw_size for rec, j in window))
        finally:
            reader.close()
    if quick:
        return " (checksums)"
    return f" (checksums; {undecoded} ans chunks not decoded: that needs a GPU)" if undecoded else \
        " (checksums and decode)"
