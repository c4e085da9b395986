"""The CPU half of save and restore: snapshot copies, multi-threaded chunk codecs, checksums.

Used for CPU tensors, and for every tensor on machines without a GPU codec. Codec calls run on
a thread pool (zstandard and numpy release the GIL), one chunk per task.
"""

from __future__ import annotations

import mmap
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from tiered.codecs import get_codec
from tiered.config import ZstdSettings
from tiered.errors import CodecUnavailableError, CorruptionError
from tiered.format.checksum import wsum64, wsum64_each
from tiered.format.chunks import ALIGNMENT, extent_runs, greedy_runs
from tiered.format.manifest import TensorRecord, chunk_corruption
from tiered.stage.plan import ChunkRef, Runs, TensorPlan, chunk_refs
from tiered.stage.pools import HostPool
from tiered.units import round_up


@dataclass
class RawSegment:
    """Uncompressed snapshot bytes of consecutive chunks, in host pool pages."""

    chunks: list[ChunkRef]
    raw: torch.Tensor
    release: Callable[[], None]


def snapshot(plans: Sequence[TensorPlan], tensors: Sequence[torch.Tensor], host: HostPool, chunk_size: int,
             emit: Callable[[RawSegment], None], on_block: Callable[[], None]) -> None:
    """Copy CPU (or, without GPU codecs, CUDA) tensors into host staging, emitting segments.
    `tensors` is the save's tensors by leaf index (`SavePlan.tensors`).

    Blocks while the host budget is held by earlier segments (backpressure); a tensor larger
    than the budget is staged in pieces, each written before the next is copied.
    """
    chunks = _chunk_refs(plans)
    if not chunks:
        return
    total = sum(c.raw_size for c in chunks)
    host.want(total + 16 * host.page)  # slack: each wave rounds up to whole pages
    capacity = host.max_run_bytes  # one run of the ring: the pool, or one pinned block of it
    # One wave when it all fits; otherwise quarters of the pool, so copying overlaps writing.
    limit = capacity - 16 * host.page if total + 16 * host.page <= capacity else max(chunk_size, capacity // 4)
    ends = np.cumsum([c.raw_size for c in chunks])
    runs = Runs(plans)
    for i, k in greedy_runs(ends, limit):
        nbytes = int(ends[k - 1] - (ends[i - 1] if i else 0))
        page = host.ring.acquire(host.pages(nbytes), on_block)
        raw = host.view(page, nbytes)
        with torch.no_grad():
            _copy_wave(runs.within(i, k), tensors, raw, chunk_size)
        emit(RawSegment(chunks[i:k], raw, lambda p=page: host.ring.release(p)))


_refs: tuple[Sequence[TensorPlan], list[ChunkRef]] = ((), [])


def prepare(plans: Sequence[TensorPlan]) -> None:
    """At start-up (`Engine.reserve`): make the chunk records of saves of `plans` now, so that the
    first save of that plan makes none (a record per chunk: 41,919 of them took 40 ms of a first
    distributed save's call of 10,480 CPU tensors on the CPU machine, and the collector's pass
    over them when the call ended, more)."""
    _chunk_refs(plans)


def _chunk_refs(plans: Sequence[TensorPlan]) -> list[ChunkRef]:
    """`chunk_refs(plans)`, kept for the plans of the last save (a cached plan's are the same
    object from save to save): made anew, an object per chunk each save lives until the step is
    written and ends up in the cyclic collector's oldest generation (see tree._Kept)."""
    global _refs
    last, refs = _refs
    if last is not plans:
        refs = chunk_refs(plans)
        _refs = (plans, refs)
    return refs


def _copy_wave(items: list[tuple[TensorPlan, int, int]], tensors: Sequence[torch.Tensor], raw: torch.Tensor,
               chunk_size: int) -> None:
    """Copy each piece (plan, first chunk, count) end to end into `raw`. Runs of small whole
    tensors alike in dtype and shape go as one `torch.stack` and one copy: an optimizer's step
    counters are thousands of scalars, and a copy per tensor costs ~10 us of Python each."""
    pos, x = 0, 0
    while x < len(items):
        plan, j0, n = items[x]
        lo, hi = j0 * chunk_size, min(plan.nbytes, (j0 + n) * chunk_size)
        y = x + 1
        if lo == 0 and hi == plan.nbytes <= _STACK_BYTES:
            while y < len(items) and _alike(items[y], plan):
                y += 1
        if y - x > 1:
            stacked = torch.stack([tensors[p.index] for p, _, _ in items[x:y]])
            raw[pos:pos + (y - x) * hi].copy_(stacked.reshape(-1).view(torch.uint8))
            pos, x = pos + (y - x) * hi, y
            continue
        t = tensors[plan.index]
        src = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
        raw[pos:pos + hi - lo].copy_(src[lo:hi])
        pos, x = pos + hi - lo, x + 1


_STACK_BYTES = 64 << 10
"""Whole tensors up to this size may be stacked with their neighbours (see `_copy_wave`)."""


def _alike(item: tuple[TensorPlan, int, int], first: TensorPlan) -> bool:
    """`item` is a whole tensor of `first`'s dtype, shape and size."""
    p, j0, n = item
    return j0 == 0 and n == p.nchunks and p.nbytes == first.nbytes and p.dtype == first.dtype and p.shape == first.shape


def pad_extent(stored: bytes | memoryview) -> bytearray:
    """A chunk's stored bytes zero-padded to its aligned extent in the data file."""
    padded = bytearray(round_up(len(stored), ALIGNMENT))
    padded[:len(stored)] = stored
    return padded


def stored_extent(stored: bytes | memoryview) -> tuple[bytearray, int, int]:
    """(padded extent, stored size, checksum) of a freshly encoded chunk. A bytearray and two
    ints: the cyclic collector stops tracking such a tuple, where a memoryview it tracks for as
    long as it lives (thousands per save of an optimizer's `step` scalars: see tree._Kept)."""
    return pad_extent(stored), len(stored), wsum64(stored)


INLINE_CHUNK_BYTES = 16 << 10
"""Chunks averaging under this size are encoded on the calling thread, their checksums summed
together (`wsum64_each`): for them a pool task, or a checksum call each, costs more than the
encoding (an optimizer's `step` scalars are thousands of 4-byte chunks)."""


def encode_segment(seg: RawSegment, pool: ThreadPoolExecutor, settings: ZstdSettings) -> list[tuple[bytearray, int, int]]:
    """[(padded stored extent, stored size, checksum)] for each chunk of the segment, in order."""
    buf = seg.raw.numpy()
    starts = np.cumsum([0] + [c.raw_size for c in seg.chunks]).tolist()

    def stored(i: int) -> bytes:
        return get_codec(seg.chunks[i].plan.spec, settings).encode_chunk(memoryview(buf[starts[i]:starts[i + 1]]))

    if starts[-1] < INLINE_CHUNK_BYTES * len(seg.chunks):
        out = [stored(i) for i in range(len(seg.chunks))]
        return [(pad_extent(s), len(s), crc) for s, crc in zip(out, wsum64_each(out))]
    return list(pool.map(lambda i: stored_extent(stored(i)), range(len(seg.chunks))))


def joined_extents(extents: Sequence[bytearray], limit: int) -> Iterator[tuple[int, memoryview]]:
    """(offset from the first, bytes) of consecutive padded extents joined up to `limit` bytes
    (an extent larger than that alone, as it is): one write each instead of one per chunk."""
    at = 0
    for i, k, size in extent_runs([len(e) for e in extents], limit)[1]:
        yield at, memoryview(extents[i] if k == i + 1 else b"".join(extents[i:k]))
        at += size


WINDOW_CHUNKS, WINDOW_BYTES = 256, 64 << 20
"""One read of a data file: up to this many chunks and bytes, lying end to end in it. A window
of kept chunks is verified on the pool in runs of a few MiB, and one of recompressed chunks in
runs of about 1 MiB, so a window of many small chunks is still spread over the pool; at 64 chunks a
34 MB step of 600 tensors was ten windows of 3.6 MB, each read, verified and written in turn
(a copy from S3 spent ~50 ms on them after its last GET, on the lent H100 machine)."""
FIRST_WINDOW_BYTES = 4 << 20
"""The first window's byte limit; each next one's doubles, up to WINDOW_BYTES. A copy's first
bytes reach the target after a small read, not after 64 MiB read and verified (an S3 upload's
first part waited ~0.2 s for it)."""
READ_AHEAD_BYTES = 128 << 20
"""Bytes of windows read ahead of the one being processed (at least one window): reads of a
remote tier (S3's GETs) overlap one another and the verifying and decoding."""
_READERS = 8
"""Windows read at once, by default: a reader may say how many suit it (`parallel_reads`). With 4
at once, a 34 MB step of small tensors (then windows of 3.6 MB, a GET each from S3) took 60-70
ms of GETs on the lent H100 machine, about twice boto3's 8 parallel parts."""


class WindowBuffers:
    """Window buffers recycled between reads: a migration or restore reads its data file into the
    same few buffers instead of a fresh one per window (fresh memory costs a page fault per 4 KiB:
    more CPU than the copy into it on a small machine). Page-aligned anonymous mappings, so that
    a window of kept chunks goes to an O_DIRECT target as it is, with no bounce copy. Thread-safe."""

    KEEP = 8

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        with self._lock:
            fits = [b for b in self._free if len(b) >= size]
            if fits:
                buf = min(fits, key=len)
                self._free.remove(buf)
                return memoryview(buf)[:size]
        return memoryview(mmap.mmap(-1, max(size, 1)))[:size]

    @property
    def kept_bytes(self) -> int:
        """Bytes of the buffers kept for the next reads."""
        with self._lock:
            return sum(len(b) for b in self._free)

    def give(self, view: memoryview) -> None:
        """Return a buffer `take` gave; its bytes may be overwritten by the next read at once.
        At most `KEEP` are kept, the largest (windows of a data file are mostly the largest size)."""
        with self._lock:
            self._free.append(view.obj)
            if len(self._free) > self.KEEP:
                self._free.remove(min(self._free, key=len))


def chunk_windows(refs: Sequence[tuple[TensorRecord, int]], reader,
                  buffers: WindowBuffers | None = None) -> Iterator[tuple[list, memoryview, int]]:
    """(window of chunk refs, their bytes, file offset of those bytes) for `refs` (tensor record,
    chunk number) in file order: windows of chunks lying end to end cross tensor boundaries (a
    state of thousands of small tensors is a few reads, not a read and a pool round trip per
    tensor), one ranged read each, read ahead on threads of their own (`READ_AHEAD_BYTES`), in
    file order, at most the reader's `parallel_reads` windows at once (`_READERS` where it does
    not say). With `buffers`, each window is read into one of them; the caller gives it back when done."""
    windows: list[list[tuple[TensorRecord, int]]] = []
    sizes: list[int] = []
    end = 0
    limit = FIRST_WINDOW_BYTES
    for ref in refs:
        c = ref[0].chunks[ref[1]]
        if not windows or len(windows[-1]) >= WINDOW_CHUNKS or sizes[-1] + c.extent > limit or c.offset != end:
            if windows:
                limit = min(2 * limit, WINDOW_BYTES)
            windows.append([])
            sizes.append(0)
        windows[-1].append(ref)
        sizes[-1] += c.extent
        end = c.offset + c.extent
    if not windows:
        return

    def read(w: int) -> tuple[memoryview, int]:
        first = windows[w][0][0].chunks[windows[w][0][1]]
        if buffers is None:
            return reader.read_host(first.offset, sizes[w]), first.offset
        out = buffers.take(sizes[w])
        reader.read_into(first.offset, out)
        return out, first.offset

    at_once = max(1, int(getattr(reader, "parallel_reads", _READERS)))
    with ThreadPoolExecutor(at_once, thread_name_prefix="tiered-read") as io:
        ahead: deque = deque()
        nxt = inflight = 0

        def fill() -> None:  # read ahead: at least the next window, then up to READ_AHEAD_BYTES
            nonlocal nxt, inflight
            while nxt < len(windows) and (not ahead or inflight + sizes[nxt] <= READ_AHEAD_BYTES):
                ahead.append(io.submit(read, nxt))
                inflight += sizes[nxt]
                nxt += 1

        fill()
        for w in range(len(windows)):
            data, base = ahead.popleft().result()
            inflight -= sizes[w]
            fill()
            yield windows[w], data, base


def file_order(recs: Sequence[TensorRecord]) -> list[tuple[TensorRecord, int]]:
    """Every chunk of `recs` as (record, chunk number), in data file order."""
    return sorted(((rec, j) for rec in recs for j in range(len(rec.chunks))), key=lambda r: r[0].chunks[r[1]].offset)


def verified(rec: TensorRecord, j: int, data: memoryview, base: int, path: str) -> memoryview:
    """Chunk j's stored bytes out of a window read at `base`, checksum verified."""
    c = rec.chunks[j]
    stored = data[c.offset - base:c.offset - base + c.size]
    got = wsum64(stored)
    if got != c.checksum:
        raise chunk_corruption(path, rec, j, f"stored {c.checksum:016x}, computed {got:016x}")
    return stored


def decode_into(codec, rec: TensorRecord, j: int, stored: memoryview, out: memoryview, path: str) -> None:
    """Decode chunk j; a decoder failure on verified bytes is reported as corruption of that chunk."""
    try:
        codec.decode_chunk(stored, rec.chunks[j].raw_size, out)
    except (CorruptionError, CodecUnavailableError):
        raise
    except Exception as exc:  # zstd errors, size mismatches: the stored bytes are not what was written
        raise chunk_corruption(path, rec, j, f"{rec.codec.name} decode failed: {exc}") from None


def decoded(codec, rec: TensorRecord, j: int, stored: memoryview, path: str) -> memoryview:
    """Chunk j's raw bytes, to be read only: `stored` itself where the codec stores them as they
    are (`Codec.stores_raw`: no copy), else decoded into a new array (`decode_into`)."""
    raw_size = rec.chunks[j].raw_size
    if codec.stores_raw:
        if len(stored) != raw_size:
            raise chunk_corruption(path, rec, j, f"{rec.codec.name}: {len(stored)} bytes stored, {raw_size} expected")
        return stored
    raw = memoryview(np.empty(raw_size, dtype=np.uint8))
    decode_into(codec, rec, j, stored, raw, path)
    return raw


def read_chunk(rec: TensorRecord, j: int, reader, settings: ZstdSettings) -> np.ndarray:
    """Chunk j of `rec`: one ranged read, checksum verified, decoded on the CPU into a new array."""
    c = rec.chunks[j]
    stored = verified(rec, j, reader.read_host(c.offset, c.extent), c.offset, reader.path)
    raw = np.empty(c.raw_size, dtype=np.uint8)
    decode_into(get_codec(rec.codec, settings), rec, j, stored, memoryview(raw), reader.path)
    return raw


def decode_tensors(items: Sequence[tuple[TensorRecord, np.ndarray]], reader, pool: ThreadPoolExecutor,
                   settings: ZstdSettings, chunk_size: int, repair=None,
                   unread: str = "the data file is missing") -> None:
    """Read, verify and decode every chunk of each (record, out) -- `out` a uint8 array of
    rec.nbytes -- in windows that cross tensor boundaries (`chunk_windows`), chunks decoded on `pool`.

    `repair(rec, j, why)`, when given, supplies the raw bytes of a chunk that fails here (a
    checksum or decode error), and of every chunk when `reader` is None (`unread` says why).
    """
    outs = {rec.index: out for rec, out in items}
    buffers = WindowBuffers()

    def fix(rec: TensorRecord, j: int, why: str) -> None:
        outs[rec.index][j * chunk_size:j * chunk_size + rec.chunks[j].raw_size] = repair(rec, j, why)

    if reader is None:
        for rec, _ in items:
            for j in range(len(rec.chunks)):
                fix(rec, j, unread)
        return
    for window, data, base in chunk_windows(file_order([rec for rec, _ in items]), reader, buffers):
        def one(ref: tuple[TensorRecord, int]) -> None:
            rec, j = ref
            try:
                stored = verified(rec, j, data, base, reader.path)
                decode_into(get_codec(rec.codec, settings), rec, j, stored,
                            memoryview(outs[rec.index][j * chunk_size:j * chunk_size + rec.chunks[j].raw_size]),
                            reader.path)
            except CorruptionError as exc:
                if repair is None:
                    raise
                fix(rec, j, str(exc))

        list(pool.map(one, window))
        buffers.give(data)
