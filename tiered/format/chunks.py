"""A tensor's chunk records in the on-disk format (`tiered.format.manifest`): where each compressed chunk
lies in a rank's data file, packed without an object per chunk, and how runs of chunks go out in
large writes.
"""

from __future__ import annotations

import functools
import struct
from typing import Iterable, Iterator, NamedTuple, Sequence, overload

import numpy as np

from tiered.units import round_up

ALIGNMENT = 4096
"""Every chunk starts at a multiple of this in its data file (O_DIRECT's and cuFile's unit)."""


class ChunkRecord(NamedTuple):
    """One chunk's place in the data file (an item of a ChunkTable)."""

    offset: int
    """Byte offset in the rank's data file, a multiple of ALIGNMENT."""
    size: int
    """Stored (compressed) bytes; the extent on disk is size rounded up to ALIGNMENT, zero padded."""
    raw_size: int
    """Uncompressed bytes."""
    checksum: int
    """wsum64 of the stored bytes."""

    @property
    def extent(self) -> int:
        return round_up(self.size, ALIGNMENT)


class ChunkTable(Sequence[ChunkRecord]):
    """A tensor's chunk records: a sequence of ChunkRecord.

    A save's writer builds it packed, four 64-bit integers per chunk in one byte string, and
    writes the index from that: no object per chunk. A save of a large state places tens of
    thousands of chunks, and as objects they lived long enough to set off the collector's full
    passes over the training process, each of which holds every Python thread: 170-244 ms inside
    each save of a 24 GB state. A byte string is not an object the collector
    tracks. A table read from an index, or first read by index, holds its records as a tuple,
    so that restores and migration read them at a tuple's speed."""

    __slots__ = ("_raw", "_records")
    ROW = struct.Struct("<qqqQ")
    """One packed chunk: offset, size, raw size, checksum (a writer packs its rows: `packed`)."""

    def __init__(self, records: Iterable[Sequence[int]] = ()):
        self._records: tuple[ChunkRecord, ...] | None = tuple(
            r if type(r) is ChunkRecord else ChunkRecord(*r) for r in records)
        self._raw: bytearray | None = None

    @classmethod
    def packed(cls, raw: bytearray) -> "ChunkTable":
        """The table of rows a writer packed with ROW, end to end (taken, not copied)."""
        if len(raw) % cls.ROW.size:
            raise ValueError(f"{len(raw)} bytes are not whole chunk rows")
        table = cls()
        table._raw, table._records = raw, None
        return table

    def _rows(self) -> tuple[ChunkRecord, ...]:
        if self._records is None:
            self._records = tuple(map(ChunkRecord._make, self.ROW.iter_unpack(self._raw or b"")))
        return self._records

    def __len__(self) -> int:
        return len(self._records) if self._records is not None else len(self._raw or b"") // self.ROW.size

    @overload
    def __getitem__(self, i: int) -> ChunkRecord: ...

    @overload
    def __getitem__(self, i: slice) -> "ChunkTable": ...

    def __getitem__(self, i: int | slice) -> "ChunkRecord | ChunkTable":
        if isinstance(i, slice):
            return ChunkTable(self._rows()[i])
        return self._rows()[i]

    def __iter__(self) -> Iterator[ChunkRecord]:
        return iter(self._rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            return self._rows() == other._rows()
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._rows())

    def __repr__(self) -> str:
        return f"ChunkTable({list(self)!r})"

    @property
    def stored_bytes(self) -> int:
        if self._records is not None:
            return sum(r.size for r in self._records)
        return self.packed_stored_bytes(self._raw or b"")

    @staticmethod
    def packed_stored_bytes(raw: bytes | bytearray) -> int:
        """The stored bytes of packed rows (`packed`), without making a table."""
        return sum(memoryview(raw).cast("q")[1::4].tolist()) if raw else 0

    def to_json(self) -> str:
        """The JSON array of [offset, size, raw size, "checksum as 16 hex digits"] per chunk."""
        if self._records is None:
            return self.packed_json(self._raw or b"")
        return _rows_json(self._records)

    @classmethod
    def packed_json(cls, raw: bytes | bytearray) -> str:
        """`to_json` of packed rows (`packed`), without making a table: one unpack and one
        format call per block of rows, not per chunk (a save's writer makes its index this way)."""
        n = len(raw) // cls.ROW.size
        parts = []
        for at in range(0, n, _BLOCK):
            text, layout = _rows_format(min(_BLOCK, n - at))
            parts.append(text % layout.unpack_from(raw, at * cls.ROW.size))
        return "[" + ",".join(parts) + "]"


def _rows_json(rows: Iterable[Sequence[int]]) -> str:
    return "[" + ",".join([f'[{o},{s},{r},"{c:016x}"]' for o, s, r, c in rows]) + "]"


_BLOCK = 256
"""Rows formatted per call by `ChunkTable.packed_json`."""


@functools.lru_cache(maxsize=_BLOCK)
def _rows_format(n: int) -> tuple[str, struct.Struct]:
    """The text template and the packed layout of `n` rows."""
    return ",".join(['[%d,%d,%d,"%016x"]'] * n), struct.Struct("<" + "qqqQ" * n)


def greedy_runs(ends: np.ndarray, limit: int, max_count: int | None = None) -> list[tuple[int, int]]:
    """[(first, end)]: consecutive items whose sizes (given as their running sum `ends`) fit
    `limit` together, at most `max_count` of them; each run as long as it can be, and at least
    one item, even one larger than `limit`. Searched with numpy, not item by item: the callers
    run on threads whose Python time a training loop that shares the GIL pays for."""
    bounds: list[tuple[int, int]] = []
    i, n = 0, len(ends)
    while i < n:
        base = int(ends[i - 1]) if i else 0
        k = int(np.searchsorted(ends, base + limit, side="right"))
        if max_count is not None:
            k = min(k, i + max_count)
        k = max(k, i + 1)
        bounds.append((i, k))
        i = k
    return bounds


def extent_runs(sizes: Sequence[int], limit: int) -> tuple[list[int], list[tuple[int, int, int]], np.ndarray]:
    """How consecutive chunks go out in large writes: (each one's aligned extent, [(first, end,
    bytes)] runs of them whose extents end to end fit `limit` bytes (one alone may not), each
    one's byte offset in its run). A drained wave has thousands of rows (`greedy_runs`)."""
    ext = (np.asarray(sizes, dtype=np.int64) + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT
    ends = np.cumsum(ext)
    starts = ends - ext
    offsets = np.empty_like(ext)
    bounds: list[tuple[int, int, int]] = []
    for i, k in greedy_runs(ends, limit):
        offsets[i:k] = starts[i:k] - starts[i]
        bounds.append((i, k, int(ends[k - 1] - starts[i])))
    return ext.tolist(), bounds, offsets
