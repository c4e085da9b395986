"""Restore fallback: a chunk that fails on the tier being read comes from a slower tier instead.

Every tier stores a tensor as chunks of the same uncompressed size, whatever its codec, so chunk
j of a tensor covers the same bytes on every tier: a damaged or missing chunk on the fast tier is
replaced by decoding chunk j of the same tensor from the next tier that holds the step. Used by
`Engine.restore` / `Engine.load`; say what happened in the log, once per chunk for the first few
and as a summary at the end.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import numpy as np

from tiered.codecs import get_codec, get_codec_class
from tiered.config import ZstdSettings
from tiered.cpu import decode_into, verified
from tiered.errors import CorruptionError, TieredError
from tiered.format import TensorRecord, read_step

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
                index = read_step(tier, self.step)[1][self.rank]
            except (TieredError, OSError, IndexError) as exc:
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
                reader = self._readers[tier.name]
                c = other.chunks[j]
                try:
                    stored = verified(other, j, reader.read_host(c.offset, c.extent), c.offset, reader.path)
                    raw = np.empty(c.raw_size, dtype=np.uint8)
                    decode_into(get_codec(other.codec, self.settings), other, j, stored, memoryview(raw), reader.path)
                except (TieredError, OSError) as exc:
                    log.warning("tiered: step %d: tier %r has no good copy either: %s", self.step, tier.name, exc)
                    continue
                self.repaired[tier.name] = self.repaired.get(tier.name, 0) + 1
                if sum(self.repaired.values()) <= _DETAILED:
                    log.warning("tiered: step %d: %s; read tensor %r chunk %d from tier %r instead", self.step, why,
                                rec.name, j, tier.name)
                return raw
        raise CorruptionError(f"{why}; no slower tier holds a good copy of it (tried: {', '.join(tried) or 'none'})")

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

