"""One rank's data file copied down a tier: chunk by chunk, kept or recompressed, in file order.

`copy_rank` is what `tiered.migrate.migrator.migrate_step` runs per rank: read windows of the source
(ranged reads across tensor boundaries, several ahead), verify every chunk's checksum, keep the
chunk or decode and re-encode it (the CPU pool for codecs a CPU runs, a `GpuRecoder` for the
others), and write the results end to end, behind on a thread of their own; it returns the
rank's new index and its JSON. The GPU side of migration (`GpuRecoder`) is tiered.gpu.recode's.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

import numpy as np
import torch

from tiered.codecs import get_codec, get_codec_class
from tiered.config import ZstdSettings
from tiered.errors import CodecUnavailableError, CorruptionError
from tiered.format.checksum import wsum64
from tiered.format.manifest import ALIGNMENT, DTYPES, ChunkTable, CodecSpec, RankIndex, TensorRecord
from tiered.stage.cpu import WINDOW_BYTES, WindowBuffers, chunk_windows, decoded, read_chunk, verified
from tiered.stage.repair import ChunkRepair
from tiered.units import round_up

if TYPE_CHECKING:
    from tiered.gpu.recode import GpuRecoder


def target_spec(rec: TensorRecord, codec: str | None) -> CodecSpec:
    """Keep a tensor's chunks when the target tier takes their codec (or `codec` is None);
    else the tier's codec."""
    if codec is None or rec.codec.name == codec:
        return rec.codec
    return _spec_for(codec, rec.dtype)


@functools.lru_cache(maxsize=256)
def _spec_for(codec: str, dtype: str) -> CodecSpec:
    """`codec`'s description for tensors of `dtype` (a format name): asked per tensor of a step
    recompressed, of a few dtypes."""
    return get_codec_class(codec).spec_for(DTYPES[dtype])


class Prefetched:
    """A reader of one rank's data file whose first bytes (up to a window, `WINDOW_BYTES`) a remote
    tier starts fetching as soon as the manifest names the file (`DataReader.prefetch`), while
    the rank's index is still being read and parsed; `copy_rank` then reads through it. Its
    buffer is one of `buffers`, given back by `close()`."""

    def __init__(self, src: Any, step: int, data_file: str, data_bytes: int, buffers: WindowBuffers):
        self._buffers, self._head = buffers, None
        self.reader = src.open_data_reader(step, data_file, device=False) if data_bytes else None
        if self.reader is not None:
            head = buffers.take(min(data_bytes, WINDOW_BYTES))
            try:
                taken = self.reader.prefetch(0, head)
            except BaseException:
                self.reader.close()
                buffers.give(head)
                raise
            if taken:
                self._head = head
            else:
                buffers.give(head)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()  # waits for the prefetch's reads
            self.reader = None
        if self._head is not None:
            self._buffers.give(self._head)
            self._head = None


class CopiedRank(NamedTuple):
    """What `copy_rank` made: the rank's new index, and that index as the JSON the target stores."""

    index: RankIndex
    raw: bytes


def copy_rank(step, src, dst, index: RankIndex, codec, settings, pool, gpu, progress,
              buffers: WindowBuffers | None = None, prefetched: Prefetched | None = None,
              repair: ChunkRepair | None = None) -> CopiedRank:
    """`prefetched`: the caller's reader of this rank's data file (it closes it); None: one of its own.
    `repair`: where given, a chunk failing its checksum is taken from another tier's copy of the
    step (`ChunkRepair.stored`) instead of failing the copy (chunks a GPU recompresses excepted).

    The new index and its JSON are made once every chunk is handed to the writes, while the last
    of them land (a plain copy of 2,000 tensors on the 2-core CPU machine spent 16 ms on them
    after its data file was closed, on the copy's critical path); where the file's end or I/O
    mode came out otherwise than assumed then, they are made again."""
    own_reader = prefetched is None
    reader = prefetched.reader if prefetched is not None else \
        src.open_data_reader(step, index.data_file, device=False) if index.data_bytes else None
    # The source's size: exact when chunks are kept, close when recompressed (S3 sizes its parts by it).
    writer = dst.open_data_writer(step, index.data_file, device=False, size_hint=index.data_bytes)
    # File order: tensors without chunks first, then by first chunk offset (as the engine writes).
    ordered = sorted(index.tensors, key=lambda t: t.chunks[0].offset if t.chunks else -1)
    specs = [target_spec(rec, codec) for rec in ordered]
    chunks: dict[int, bytearray] = {rec.index: bytearray() for rec in ordered}  # (packed rows: see ChunkTable)
    row = ChunkTable.ROW.pack
    out = _Batches(writer)
    buffers = buffers if buffers is not None else WindowBuffers()
    end = 0
    try:
        i = 0
        while i < len(ordered):
            if _gpu_decode_cpu_encode(ordered[i], specs[i]):  # a run of tensors through the GPU and the pool
                k = i
                while k < len(ordered) and _gpu_decode_cpu_encode(ordered[k], specs[k]):
                    k += 1
                pieces = gpu_decoded_chunks(step, src, index, ordered[i:k], specs[i:k], settings, pool, gpu, progress)
            elif _needs_gpu(ordered[i], specs[i]):  # one tensor through the GPU
                pieces = (([(ordered[i], stored, size, crc)], data, None)
                          for stored, (data, size, crc) in tensor_chunks(step, src, index, ordered[i], specs[i],
                                                                           reader, settings, gpu, progress))
                k = i + 1
            else:  # a run of tensors through the CPU pool, in windows that cross tensor boundaries
                k = i
                while k < len(ordered) and not _needs_gpu(ordered[k], specs[k]):
                    k += 1
                pieces = _cpu_chunks(ordered[i:k], specs[i:k], reader, settings, pool, progress, buffers, repair)
            for entries, data, release in pieces:  # data: the stored bytes of `entries`, end to end
                start = end
                for rec, stored, size, crc in entries:
                    chunks[rec.index] += row(end, size, stored.raw_size, crc)
                    end += round_up(size, ALIGNMENT)
                out.add(start, data, done=release, pad=end - start - len(data))
            i = k
        records = tuple(TensorRecord(index=rec.index, name=rec.name, dtype=rec.dtype, shape=rec.shape,
                                     device=rec.device, is_numpy=rec.is_numpy, codec=spec,
                                     chunks=ChunkTable.packed(chunks[rec.index]))
                        for rec, spec in zip(ordered, specs))
        new = RankIndex(rank=index.rank, data_file=index.data_file, data_bytes=end, chunk_size=index.chunk_size,
                        skeleton=index.skeleton, tensors=records, io=getattr(writer, "io_mode", ""))
        raw = new.to_json()  # (while the writes handed over above land)
        out.finish()
        data_bytes = writer.close()
    except BaseException:
        out.abort()
        writer.abort()
        raise
    finally:
        if reader is not None and own_reader:
            reader.close()
    io = getattr(writer, "io_mode", "")
    if data_bytes != new.data_bytes or io != new.io:  # (a file tier that fell back to buffered writes, say)
        new = dataclasses.replace(new, data_bytes=data_bytes, io=io)
        raw = new.to_json()
    return CopiedRank(new, raw)


def _needs_gpu(rec: TensorRecord, spec: CodecSpec) -> bool:
    """Recompressing this tensor's chunks needs a GPU codec (to decode them, or to encode)."""
    return bool(rec.chunks) and spec != rec.codec and not (
        get_codec_class(rec.codec.name).cpu_capable and get_codec_class(spec.name).cpu_capable)


def _gpu_decode_cpu_encode(rec: TensorRecord, spec: CodecSpec) -> bool:
    """This tensor's chunks are decoded on the GPU (a GPU-only codec: ans) and encoded on the CPU."""
    return (_needs_gpu(rec, spec) and not get_codec_class(rec.codec.name).cpu_capable
            and get_codec_class(spec.name).cpu_capable)


def gpu_decoded_chunks(step, src, index: RankIndex, recs: list[TensorRecord], specs: list[CodecSpec], settings,
                        pool: ThreadPoolExecutor, gpu: "GpuRecoder | None", progress):
    """Yield ([(tensor record, source chunk record, stored size, checksum)], stored bytes, None) for
    every chunk of `recs` (tensors in a GPU-only codec going to a CPU codec), in order: decoded on
    the GPU in windows of `gpu.batch_chunks` chunks that cross tensor boundaries (one batched call
    and one copy to the host each: a state of thousands of small tensors is a few calls, not a few
    per tensor), each window encoded on the pool while the next one is read and decoded."""
    if gpu is None:
        raise CodecUnavailableError(
            f"{src.describe(step, index.data_file)}: tensor {recs[0].name!r}: recompressing {recs[0].codec.name!r} "
            "needs a GPU with nvCOMP to decode: run the migration on a GPU machine")
    codec_of = {rec.index: get_codec(spec, settings) for rec, spec in zip(recs, specs)}
    refs = [(rec, j) for rec in recs for j in range(len(rec.chunks))]

    def encode(codec: Any, host: np.ndarray, at: int, n: int) -> tuple[bytes, int, int]:
        return _encoded(codec.encode_chunk(memoryview(host[at:at + n])))

    dev_reader = gpu.reader(src, step, index)
    # Two pinned host buffers, taken in turn: a window is copied into one while the pool encodes
    # the previous one from the other (its results are waited for before the next window is decoded).
    # A fresh pageable buffer per window cost a page fault per 4 KiB and a slow copy: the decoding
    # thread spent 46% of its time there (1 GB step, ans -> zstd 0.51-0.55 GB/s).
    hosts = [gpu.host_window(index.chunk_size) for _ in range(2)]
    try:
        pending = None
        for n, w in enumerate(range(0, len(refs), gpu.batch_chunks)):
            win = refs[w:w + gpu.batch_chunks]
            host, offsets = gpu.decode_refs(dev_reader, win, index.chunk_size, hosts[n % 2])
            futures = [pool.submit(encode, codec_of[rec.index], host, at, rec.chunks[j].raw_size)
                       for (rec, j), at in zip(win, offsets)]
            if pending is not None:
                yield from _pool_results(*pending, progress)
            pending = (win, futures)
        if pending is not None:
            yield from _pool_results(*pending, progress)
    finally:
        dev_reader.close()


def _cpu_chunks(recs: list[TensorRecord], specs: list[CodecSpec], reader: Any, settings: ZstdSettings,
                pool: ThreadPoolExecutor, progress: Any, buffers: WindowBuffers, repair: ChunkRepair | None = None):
    """Yield ([(tensor record, source chunk record, stored size, checksum)], their bytes: the padded
    extents end to end, or one chunk's stored bytes unpadded; what to call once those are written,
    or None: the bytes may be reused once `_Batches.add` returns) for every chunk of `recs`, in order:
    read in windows that cross tensor boundaries, read ahead into `buffers`
    (`tiered.stage.cpu.chunk_windows`); each window's chunks verified and, where the codec changes,
    decoded and re-encoded on the pool, in runs of chunks (`RECOMPRESS_GROUP_BYTES`). A window
    whose chunks are all kept goes out as the bytes read, padding zeroed in place (no copy per
    chunk, no gathering copy); one that is recompressed, a chunk at a time. With `repair`, a chunk
    failing its checksum is taken from another tier (its window then goes a chunk at a time)."""
    spec_of = {rec.index: spec for rec, spec in zip(recs, specs)}

    def check(ref: tuple[TensorRecord, int], data: memoryview, base: int) -> memoryview | str:
        """The chunk's verified bytes; with `repair`, why it failed instead (a str)."""
        try:
            return verified(*ref, data, base, reader.path)
        except CorruptionError as exc:
            if repair is None:
                raise
            return str(exc)

    def keep(ref: tuple[TensorRecord, int], data: memoryview, base: int) -> tuple[TensorRecord, int, str] | None:
        rec, j = ref
        c = rec.chunks[j]
        got = check(ref, data, base)
        if isinstance(got, str):
            return rec, j, got
        # The padding is not under the checksum: what goes down a tier is zeros, whatever was read.
        data[c.offset - base + c.size:c.offset - base + c.extent] = _ZEROS[:c.extent - c.size]
        return None

    def one(ref: tuple[TensorRecord, int], stored: memoryview | str):
        rec, j = ref
        if isinstance(stored, str):  # failed its checksum: another tier's copy of the chunk
            out = repair.stored(rec, j, spec_of[rec.index], stored)
            return out, len(out), None
        if spec_of[rec.index] == rec.codec:
            return stored, len(stored), rec.chunks[j].checksum  # copied by _Batches.add before `data` is reused
        raw = decoded(get_codec(rec.codec, settings), rec, j, stored, reader.path)  # (none: `stored`, no copy)
        out = get_codec(spec_of[rec.index], settings).encode_chunk(raw)
        return out, len(out), None  # (its checksum: on the copying thread, `_results`, while the pool encodes on)

    def keep_all(group: list[tuple[TensorRecord, int]], data: memoryview, base: int) -> list[tuple[TensorRecord, int, str]]:
        return [bad for ref in group if (bad := keep(ref, data, base)) is not None]

    def recode(run: list[tuple[tuple[TensorRecord, int], memoryview]]) -> list[tuple[Any, int, int | None]]:
        return [one(ref, stored) for ref, stored in run]

    def results(win: list[tuple[TensorRecord, int]], data: memoryview, futures: list[Future]):
        return _results(win, (got for future in futures for got in future.result()), progress,
                        release=lambda: buffers.give(data))

    # A recompressed window's results are taken one window behind: its chunks are handed to the
    # pool before the previous window's results are waited for, so the pool does not run dry at
    # every window's end while the last few of its chunks finish.
    behind = None
    for win, data, base in chunk_windows([(rec, j) for rec in recs for j in range(len(rec.chunks))], reader, buffers):
        if all(spec_of[rec.index] == rec.codec for rec, _ in win):
            if behind is not None:
                yield from results(*behind)
                behind = None
            groups = _groups(win, VERIFY_GROUP_BYTES)
            if len(groups) == 1:
                bad = keep_all(win, data, base)
            else:
                bad = [b for found in pool.map(lambda group: keep_all(group, data, base), groups) for b in found]
            if bad:
                yield from _repaired(win, data, base, {(rec.index, j): why for rec, j, why in bad}, spec_of, repair)
                buffers.give(data)
            else:
                yield ([(rec, rec.chunks[j], rec.chunks[j].size, rec.chunks[j].checksum) for rec, j in win], data,
                       lambda data=data: buffers.give(data))  # once written
            _report(progress, win)
        else:
            # Verified here, while the pool encodes the window before: this thread would mostly
            # wait for the pool, which then only decodes and encodes (none -> zstd of 2,000
            # tensors on the 2-core CPU machine: the pool's one thread spent 17% of its time
            # verifying). Handed over in runs of RECOMPRESS_GROUP_BYTES, one pool task each.
            futures = [pool.submit(recode, [(ref, check(ref, data, base)) for ref in group])
                       for group in _groups(win, RECOMPRESS_GROUP_BYTES)]
            if behind is not None:
                yield from results(*behind)
            behind = (win, data, futures)
    if behind is not None:
        yield from results(*behind)


def _repaired(win: list[tuple[TensorRecord, int]], data: memoryview, base: int, bad: dict[tuple[int, int], str],
              spec_of: dict[int, CodecSpec], repair: ChunkRepair):
    """A window of kept chunks, some of which failed their checksum (`bad`: why, by (tensor, chunk)),
    a chunk at a time: the good ones copied out of the window, the bad ones from another tier."""
    for rec, j in win:
        c = rec.chunks[j]
        why = bad.get((rec.index, j))
        stored = repair.stored(rec, j, spec_of[rec.index], why) if why is not None else \
            bytes(data[c.offset - base:c.offset - base + c.size])
        yield [(rec, c, len(stored), c.checksum if why is None else wsum64(stored))], stored, None


def _pool_results(win: list[tuple[TensorRecord, int]], futures: list[Future], progress: Any,
                  release: Callable[[], None] | None = None):
    """`_results` of a window whose chunks were encoded on the pool one task each (`futures`:
    their `_encoded` results, in order)."""
    return _results(win, (future.result() for future in futures), progress, release)


def _results(win: list[tuple[TensorRecord, int]], results: Iterable[tuple[Any, int, int | None]], progress: Any,
             release: Callable[[], None] | None = None):
    """Yield ([(tensor record, source chunk record, stored size, checksum)], stored bytes, None) for
    each chunk of a window encoded on the pool (`results`: (stored bytes, size, checksum or None),
    in order, taken as they are iterated); then `release` the window's source memory and report its
    raw bytes to `progress`."""
    for (rec, j), (stored, size, crc) in zip(win, results):
        if crc is None:  # (a chunk recompressed on the CPU pool, checksummed here: see `_cpu_chunks`)
            crc = wsum64(stored)
        yield [(rec, rec.chunks[j], size, crc)], stored, None
    if release is not None:
        release()
    _report(progress, win)


def _report(progress: Any, win: list[tuple[TensorRecord, int]]) -> None:
    if progress:
        progress(sum(rec.chunks[j].raw_size for rec, j in win))


def _encoded(stored: bytes) -> tuple[bytes, int, int]:
    """(stored bytes, their size, their checksum) of a freshly encoded chunk (padded by `_Batches`)."""
    return stored, len(stored), wsum64(stored)


_ZEROS = bytes(ALIGNMENT)
VERIFY_GROUP_BYTES = 2 << 20
"""Kept chunks are verified on the pool in runs of about this many bytes, one task each: ~0.6 ms
of checksums against the 20-50 us a task costs (a task per 57 KB chunk cost more than it saved:
a 34 MB step of 600 tensors to S3 on the 2-core CPU machine reached 68-76% of boto3's upload
that way, 77-82% on the calling thread); a window of less is verified on the calling thread."""


def _groups(win: list[tuple[TensorRecord, int]], limit: int) -> list[list[tuple[TensorRecord, int]]]:
    """`win` cut into runs of consecutive chunks of at least `limit` stored bytes (the last one less)."""
    groups: list[list[tuple[TensorRecord, int]]] = [[]]
    size = 0
    for ref in win:
        if size >= limit:
            groups.append([])
            size = 0
        groups[-1].append(ref)
        size += ref[0].chunks[ref[1]].extent
    return groups


RECOMPRESS_GROUP_BYTES = 1 << 20
"""Chunks recompressed on the CPU pool go to it in runs of about this many stored bytes, one task
each: a state of many small tensors (128 KiB chunks) is a pool round trip per run, not per chunk
(none -> zstd of 2,000 tensors, one pool thread, the 2-core CPU machine: +6 to +20% a pair)."""
WRITE_BATCH = 16 << 20
"""Bytes of consecutive chunks gathered into one write of the target's data file."""


def _aligned(size: int) -> np.ndarray:
    """`size` bytes of page-aligned memory (an anonymous mapping)."""
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)


WRITE_BEHIND_BYTES = 128 << 20
"""Bytes handed to the target's writer and not yet written (at least one write): writing a window
overlaps verifying the next."""


class _Batches:
    """The target's writes, behind the caller. Single chunks are copied at once (numpy copies,
    without the GIL) into page-aligned gather buffers of WRITE_BATCH bytes, reused once written,
    and written as one request each (a chunk at a time would be one system call, or one S3 buffer
    append, per MiB; O_DIRECT needs no bounce copy of an aligned buffer); an extent handed over
    with `done` (a window of kept chunks) is written as it is. A writer that writes host extents
    on threads of its own (`write_host_async`: a file tier's large O_DIRECT pieces in parallel)
    is handed them at once; any other (S3, which takes bytes in order) gets them in order on one
    thread. At most WRITE_BEHIND_BYTES are handed over and not yet written. Call `finish` (or
    `abort`, after a failure) before closing the writer: the writer's close raises what failed."""

    def __init__(self, writer: Any):
        self.writer = writer
        self._buf: np.ndarray | None = None
        """The gather buffer being filled: bytes [start, start + size) of the file."""
        self.start, self.size = 0, 0
        self._free: list[np.ndarray] = []
        self._async = getattr(writer, "write_host_async", None)
        self._io = None if self._async is not None else ThreadPoolExecutor(1, thread_name_prefix="tiered-write")
        self._pending: deque[tuple[Future, int]] = deque()
        self._pending_bytes = 0
        self._inflight = 0
        """Bytes handed to `write_host_async` and not yet written."""
        self._landed = threading.Condition()

    def add(self, offset: int, data: Any, done: Callable[[], None] | None = None, pad: int = 0) -> None:
        """Write `data`, then `pad` zero bytes, at `offset`. With `done` (and no `pad`), `data`
        is written as it is and `done()` called once it is; otherwise it is copied before this
        returns, and the caller may reuse its memory."""
        n = len(data) + pad
        if self._buf is not None and (offset != self.start + self.size or self.size + n > len(self._buf)):
            self.flush()
        if done is not None:
            if pad:
                raise ValueError("an extent written as it is carries its own padding")
            self._write(offset, memoryview(data), done)
            return
        if self._buf is None:
            self._buf = self._free.pop() if self._free and n <= WRITE_BATCH else _aligned(max(n, WRITE_BATCH))
            self.start = offset
        at = self.size
        self._buf[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._buf[at + len(data):at + n] = 0
        self.size += n

    def flush(self) -> None:
        if self._buf is not None:
            buf = self._buf

            def written() -> None:
                if len(buf) == WRITE_BATCH:
                    self._free.append(buf)

            self._write(self.start, memoryview(buf)[:self.size], written)
            self._buf, self.size = None, 0

    def _write(self, offset: int, data: memoryview, done: Callable[[], None] | None = None) -> None:
        if self._async is not None:
            self._write_async(offset, data, done)
            return
        while self._pending and self._pending_bytes + len(data) > WRITE_BEHIND_BYTES:
            self._wait_one()  # backpressure; a failed write raises here

        def write() -> None:
            self.writer.write_host(offset, data)
            if done is not None:
                done()

        self._pending.append((self._io.submit(write), len(data)))
        self._pending_bytes += len(data)

    def _write_async(self, offset: int, data: memoryview, done: Callable[[], None] | None) -> None:
        n = len(data)
        with self._landed:
            while self._inflight and self._inflight + n > WRITE_BEHIND_BYTES:
                self._landed.wait()  # backpressure
            self._inflight += n

        def landed() -> None:  # called once the extent is written, or has failed
            with self._landed:
                self._inflight -= n
                self._landed.notify_all()
            if done is not None:
                done()

        try:
            self._async(offset, data, landed)
        except BaseException:  # refused before it was queued: `landed` will not be called for it
            landed()
            raise

    def _wait_one(self) -> None:
        future, n = self._pending.popleft()
        self._pending_bytes -= n
        future.result()

    def finish(self) -> None:
        """Write what is gathered and wait for every write; raises the first failure."""
        try:
            self.flush()
            while self._pending:
                self._wait_one()
        finally:
            self.abort()

    def abort(self) -> None:
        """Wait for the writes under way (their failures are not raised) and stop the thread."""
        for future, _ in self._pending:
            future.cancel()
        if self._io is not None:
            self._io.shutdown(wait=True)
        self._pending.clear()
        with self._landed:
            while self._inflight:
                self._landed.wait()


def tensor_chunks(step, src, index: RankIndex, rec: TensorRecord, spec: CodecSpec, reader, settings: ZstdSettings,
                  gpu: "GpuRecoder | None", progress):
    """Yield (source chunk record, (stored bytes, stored size, checksum)) in order, for a tensor
    going to a codec only a GPU encodes (ans; `_needs_gpu` without `_gpu_decode_cpu_encode`: a
    GPU-only source going to a CPU codec takes `gpu_decoded_chunks`), a window of
    `gpu.batch_chunks` chunks at a time (bounded memory): decoded on the CPU where its codec runs
    there, else on the GPU (checksums verified either way), and encoded on the GPU."""
    if not rec.chunks:
        return
    if gpu is None:
        raise CodecUnavailableError(
            f"{reader.path}: tensor {rec.name!r}: recompressing {rec.codec.name!r} to {spec.name!r} needs a GPU with "
            "nvCOMP: run the migration on a GPU machine")
    src_cpu = get_codec_class(rec.codec.name).cpu_capable
    dev_reader = None if src_cpu else gpu.reader(src, step, index)
    try:
        for w in range(0, len(rec.chunks), gpu.batch_chunks):
            idx = range(w, min(w + gpu.batch_chunks, len(rec.chunks)))
            if src_cpu:
                window = torch.from_numpy(np.concatenate([read_chunk(rec, j, reader, settings) for j in idx]))
            else:
                window = gpu.decode_window(dev_reader, rec, idx.start, idx.stop, index.chunk_size)
            cs = index.chunk_size
            parts = [window[(j - w) * cs:(j - w) * cs + rec.chunks[j].raw_size] for j in idx]
            yield from zip((rec.chunks[j] for j in idx), (_encoded(b) for b in gpu.encode_chunks(parts, spec)))
            _report(progress, [(rec, j) for j in idx])
    finally:
        if dev_reader is not None:
            dev_reader.close()
