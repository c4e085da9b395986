"""Reading a step back: every tensor of a rank decoded into its destination (`decode_rank`), and
the fallback that serves a chunk failing on the tier being read from a slower tier (`ChunkRepair`).

Every tier stores a tensor as chunks of the same uncompressed size, whatever its codec, so chunk
j of a tensor covers the same bytes on every tier: a damaged or missing chunk on the fast tier is
replaced by decoding chunk j of the same tensor from the next tier that holds the step. Used by
`Engine.restore` / `Engine.load`; say what happened in the log, once per chunk for the first few
and as a summary at the end.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tiered import cpu
from tiered.codecs import get_codec_class
from tiered.config import ZstdSettings
from tiered.errors import CodecUnavailableError, CorruptionError, FormatError, TieredError
from tiered.format import RankIndex, TensorRecord, read_manifest, read_rank_index

log = logging.getLogger("tiered")
_DETAILED = 3  # chunks logged one by one per restore; the rest are counted in the summary


class ChunkRepair:
    """Call as ``repair(rec, j, why)`` -> chunk j of `rec` as raw bytes, from the first of
    `tiers` (slower tiers, in order) whose copy of the step holds it intact. Thread-safe."""

    def __init__(self, step: int, rank: int, failed: str, tiers: Sequence[Any], settings: ZstdSettings,
                 chunk_size: int):
        self.step, self.rank, self.failed, self.tiers = step, rank, failed, list(tiers)
        self.settings, self.chunk_size = settings, chunk_size
        self._indexes: dict[str, dict[str, TensorRecord] | None] = {}
        self._readers: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.repaired: dict[str, int] = {}
        """Chunks read from each slower tier."""

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def _records(self, tier: Any) -> dict[str, TensorRecord] | None:
        if tier.name not in self._indexes:
            try:
                manifest = read_manifest(tier, self.step)
                entry = manifest.entry(self.rank)
                if entry is None:
                    raise FormatError(f"step {self.step} has no files of rank {self.rank} there")
                index = read_rank_index(tier, self.step, entry)
            except (TieredError, OSError) as exc:
                log.warning("tiered: step %d: tier %r cannot stand in for %r: %s", self.step, tier.name,
                            self.failed, exc)
                self._indexes[tier.name] = None
                return None
            usable = index.chunk_size == self.chunk_size
            if not usable:
                log.warning("tiered: step %d: tier %r uses chunk_size %d, tier %r %d: cannot mix their chunks",
                            self.step, tier.name, index.chunk_size, self.failed, self.chunk_size)
            self._indexes[tier.name] = {t.name: t for t in index.tensors} if usable else None
            if usable and index.data_bytes:
                self._readers[tier.name] = tier.open_data_reader(self.step, index.data_file, device=False)
        return self._indexes[tier.name]

    def __call__(self, rec: TensorRecord, j: int, why: str) -> np.ndarray:
        tried = []
        with self._lock:
            for tier in self.tiers:
                tried.append(tier.name)
                records = self._records(tier)
                other = records.get(rec.name) if records else None
                if other is None or other.dtype != rec.dtype or other.shape != rec.shape \
                        or len(other.chunks) != len(rec.chunks):
                    continue
                if not get_codec_class(other.codec.name).cpu_capable:
                    continue  # a GPU-only copy: try a portable tier further down
                try:
                    raw = cpu.read_chunk(other, j, self._readers[tier.name], self.settings)
                except (TieredError, OSError) as exc:
                    log.warning("tiered: step %d: tier %r has no good copy either: %s", self.step, tier.name, exc)
                    tried[-1] = f"{tier.name} ({exc})"
                    continue
                self.repaired[tier.name] = self.repaired.get(tier.name, 0) + 1
                if sum(self.repaired.values()) <= _DETAILED:
                    log.warning("tiered: step %d: %s; read tensor %r chunk %d from tier %r instead", self.step, why,
                                rec.name, j, tier.name)
                return raw
        raise CorruptionError(f"{why}; no slower tier holds a good copy of it (tried: {'; '.join(tried) or 'none'})")

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        if self.repaired:
            log.warning("tiered: step %d: %s of tier %r were damaged or missing; read instead from %s", self.step,
                        _chunks(sum(self.repaired.values())), self.failed,
                        ", ".join(f"tier {t!r} ({_chunks(n)})" for t, n in self.repaired.items()))


def _chunks(n: int) -> str:
    return f"{n} chunk{'s' if n != 1 else ''}"


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
            for rec, dst in on_cpu:
                if not rec.nbytes:
                    continue
                reader, why = (None, f"{rec.codec.name} needs a GPU to decode") if rec.index in elsewhere else \
                    (host_reader, "the data file is missing")
                if dst.device.type == "cpu" and dst.is_contiguous():
                    out = dst.reshape(-1).view(torch.uint8).numpy()
                    cpu.decode_tensor(rec, reader, out, pool, settings, index.chunk_size, repair, why)
                else:
                    out = np.empty(rec.nbytes, dtype=np.uint8)
                    cpu.decode_tensor(rec, reader, out, pool, settings, index.chunk_size, repair, why)
                    dst.copy_(torch.from_numpy(out).view(rec.torch_dtype).reshape(rec.shape))
        finally:
            if host_reader is not None:
                host_reader.close()

    if not by_gpu:
        decode_on_cpu()
        return
    from tiered.gpu import device_reader

    # CPU tensors (optimizer step counters, RNG states: small, many) decode on a thread meanwhile.
    failed: list[BaseException] = []

    def run_cpu() -> None:
        try:
            decode_on_cpu()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            failed.append(exc)

    worker = threading.Thread(target=run_cpu, name="tiered-restore-cpu", daemon=True)
    worker.start()
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
