"""Chunks repaired from other tiers: every tier stores a tensor as chunks of the same uncompressed
size, whatever its codec, so chunk j of a tensor covers the same bytes on every tier, and a damaged
or missing chunk of one copy is served by another tier's copy of the step.

`ChunkRepair(...)(rec, j, why)` gives the raw bytes (a restore decodes into place);
`ChunkRepair.stored(rec, j, spec, why)` the stored bytes in the codec of a copy being built (a
repairing copy between tiers: `tiered-restore`): another tier's stored chunk as it is where its
codec is the same, else decoded there and encoded here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import numpy as np

from tiered.codecs import get_codec, get_codec_class
from tiered.config import ZstdSettings
from tiered.errors import CodecUnavailableError, CorruptionError, FormatError, TieredError
from tiered.format.manifest import CodecSpec, TensorRecord, read_manifest, read_rank_index
from tiered.stage import cpu

log = logging.getLogger("tiered")
_DETAILED = 3  # chunks logged one by one per repair; the rest are counted in the summary


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

    def _same_tensor(self, tier: Any, rec: TensorRecord) -> TensorRecord | None:
        """`rec`'s tensor as `tier`'s copy of the step stores it, where its chunks cover the same
        bytes (same dtype, shape and chunk count); None otherwise."""
        records = self._records(tier)
        other = records.get(rec.name) if records else None
        if other is None or other.dtype != rec.dtype or other.shape != rec.shape or len(other.chunks) != len(rec.chunks):
            return None
        return other

    def __call__(self, rec: TensorRecord, j: int, why: str) -> np.ndarray:
        tried = []
        with self._lock:
            for tier in self.tiers:
                tried.append(tier.name)
                other = self._same_tensor(tier, rec)
                if other is None:
                    continue
                if not get_codec_class(other.codec.name).cpu_capable:
                    continue  # a GPU-only copy: try a portable tier further down
                try:
                    raw = cpu.read_chunk(other, j, self._readers[tier.name], self.settings)
                except (TieredError, OSError) as exc:
                    log.warning("tiered: step %d: tier %r has no good copy either: %s", self.step, tier.name, exc)
                    tried[-1] = f"{tier.name} ({exc})"
                    continue
                self._count(tier.name, rec, j, why)
                return raw
        raise CorruptionError(f"{why}; no slower tier holds a good copy of it (tried: {'; '.join(tried) or 'none'})")

    def stored(self, rec: TensorRecord, j: int, spec: CodecSpec, why: str) -> bytes:
        """Chunk j of `rec` as stored bytes in `spec`: from the first tier whose copy holds it in
        that very codec, checksum verified, as it is (no GPU needed, whatever the codec); else
        decoded from a tier that holds it intact (`__call__`) and encoded here on the CPU."""
        with self._lock:
            for tier in self.tiers:
                other = self._same_tensor(tier, rec)
                if other is None or other.codec != spec:
                    continue
                c = other.chunks[j]
                reader = self._readers[tier.name]
                try:
                    data = cpu.verified(other, j, reader.read_host(c.offset, c.extent), c.offset, reader.path)
                except (TieredError, OSError) as exc:
                    log.warning("tiered: step %d: tier %r has no good copy either: %s", self.step, tier.name, exc)
                    continue
                self._count(tier.name, rec, j, why)
                return bytes(data)
        if not get_codec_class(spec.name).cpu_capable:
            raise CodecUnavailableError(f"{why}; no other tier holds it as {spec.name!r}, and re-encoding to "
                                        f"{spec.name!r} needs a GPU: run this on a GPU machine")
        return get_codec(spec, self.settings).encode_chunk(memoryview(self(rec, j, why)))

    def _count(self, tier: str, rec: TensorRecord, j: int, why: str) -> None:
        self.repaired[tier] = self.repaired.get(tier, 0) + 1
        if sum(self.repaired.values()) <= _DETAILED:
            log.warning("tiered: step %d: %s; read tensor %r chunk %d from tier %r instead", self.step, why,
                        rec.name, j, tier)

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
