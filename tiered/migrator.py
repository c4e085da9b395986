"""Copying committed steps down the tiers, recompressing where the target tier takes another codec.

Call order for one step (`migrate_step`):

    src.read_manifest(step) -> per rank: read + validate the index (pinned by the manifest)
    dst.begin_step(step)    -> refuses a committed step; clears debris of an interrupted attempt
    per rank, per tensor, in windows of chunks:
        src ranged read -> verify each chunk's checksum -> keep the chunk, or decode and re-encode it
        -> dst.open_data_writer(...).write_host(...) in file order
    dst.write_file(index) per rank -> dst.commit(manifest)   # manifest last: the commit

Idempotent: a step already committed on `dst` is skipped. Resumable: a migration killed at any
point leaves `dst` without that step's manifest, and the next attempt starts the step over.
Deterministic: the target manifest keeps the source's `created` and `writer`, and the encoders
are deterministic, so a restarted migration produces byte-identical files.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from tiered import checksum
from tiered.codecs import get_codec, get_codec_class
from tiered.config import ZstdSettings
from tiered.cpu import decode_into, pad_extent, read_windows, stored_extent, verified
from tiered.errors import CodecUnavailableError, TieredError
from tiered.format import ChunkRecord, CodecSpec, Manifest, RankEntry, RankIndex, TensorRecord, read_step
from tiered.units import format_size

log = logging.getLogger("tiered")
_WINDOW = 64  # chunks per ranged read: bounds memory whatever the tensor's size


def target_spec(rec: TensorRecord, codec: str) -> CodecSpec:
    """Keep a tensor's chunks when the target tier takes their codec; else the tier's codec."""
    if rec.codec.name == codec:
        return rec.codec
    return get_codec_class(codec).spec_for(rec.torch_dtype)


def migrate_step(step: int, src: Any, dst: Any, *, codec: str, settings: ZstdSettings = ZstdSettings(),
                 pool: ThreadPoolExecutor | None = None, gpu_decode: Callable[..., Any] | None = None,
                 progress: Callable[[int], None] | None = None) -> Manifest | None:
    """Copy committed `step` from tier `src` to tier `dst`, storing chunks with `codec` there.

    Returns the new manifest, or None when `dst` already has the step.
    `gpu_decode(src, step, index, rec)` returns a tensor's raw bytes as a uint8 numpy array (see
    `gpu_decoder`); it is needed only for codecs without a CPU decoder (ans).
    `progress(n)` is called with the raw bytes of each tensor done.
    """
    if dst.has_step(step):
        return None
    t0 = time.perf_counter()
    manifest, indexes = read_step(src, step)
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(thread_name_prefix="tiered-migrate")
    dst.begin_step(step)
    try:
        ranks, stored = [], 0
        for entry, index in zip(manifest.ranks, indexes):
            new_index = _copy_rank(step, src, dst, index, codec, settings, pool, gpu_decode, progress)
            raw_index = new_index.to_json()
            dst.write_file(step, entry.index_file, raw_index)
            stored += sum(t.stored_bytes for t in new_index.tensors)
            ranks.append(RankEntry(entry.rank, entry.index_file, len(raw_index), checksum.wsum64(raw_index),
                                   new_index.data_file, new_index.data_bytes))
        new_manifest = Manifest(step=step, world_size=manifest.world_size, ranks=tuple(ranks),
                                raw_bytes=manifest.raw_bytes, stored_bytes=stored, created=manifest.created,
                                writer=manifest.writer)
        dst.commit(step, new_manifest.to_json())
    except BaseException:
        dst.discard(step)
        raise
    finally:
        if own_pool:
            pool.shutdown()
    log.info("tiered: step %d migrated %s -> %s: %s stored (%.1f%% saved) in %.2f s", step, src.name, dst.name,
             format_size(stored), 100 * new_manifest.saved_fraction, time.perf_counter() - t0)
    return new_manifest


def _copy_rank(step, src, dst, index: RankIndex, codec, settings, pool, gpu_decode, progress) -> RankIndex:
    reader = src.open_data_reader(step, index.data_file, device=False) if index.data_bytes else None
    writer = dst.open_data_writer(step, index.data_file, device=False)
    end = 0
    records = []
    try:
        # File order: tensors without chunks first, then by first chunk offset (as the engine writes).
        for rec in sorted(index.tensors, key=lambda t: t.chunks[0].offset if t.chunks else -1):
            spec = target_spec(rec, codec)
            chunks = []
            decode = (lambda r: gpu_decode(src, step, index, r)) if gpu_decode else None
            for stored, padded_crc in _tensor_chunks(rec, spec, reader, index.chunk_size, settings, pool, decode):
                padded, size, crc = padded_crc
                chunks.append(ChunkRecord(end, size, stored.raw_size, crc))
                writer.write_host(end, padded)
                end += len(padded)
            records.append(TensorRecord(index=rec.index, name=rec.name, dtype=rec.dtype, shape=rec.shape,
                                        device=rec.device, is_numpy=rec.is_numpy, codec=spec, chunks=tuple(chunks)))
            if progress:
                progress(rec.nbytes)
        data_bytes = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        if reader is not None:
            reader.close()
    return RankIndex(rank=index.rank, data_file=index.data_file, data_bytes=data_bytes, chunk_size=index.chunk_size,
                     skeleton=index.skeleton, tensors=tuple(records), io=getattr(writer, "io_mode", ""))


def _tensor_chunks(rec: TensorRecord, spec: CodecSpec, reader, chunk_size: int, settings: ZstdSettings,
                   pool: ThreadPoolExecutor, gpu_decode):
    """Yield (source chunk record, (padded stored bytes, stored size, checksum)) in order."""
    if not rec.chunks:
        return
    keep = spec == rec.codec
    src_codec = get_codec(rec.codec, settings)
    if not keep and not src_codec.cpu_capable:
        if gpu_decode is None:
            raise CodecUnavailableError(
                f"{reader.path}: tensor {rec.name!r} is stored with {rec.codec.name!r}, which needs a GPU with "
                "nvCOMP to decode: run the migration on a GPU machine")
        raw_all = gpu_decode(rec)  # verified by the GPU decoder's checksums
        dst_codec = get_codec(spec, settings)
        for w in range(0, len(rec.chunks), _WINDOW):
            idx = range(w, min(w + _WINDOW, len(rec.chunks)))

            def encode(j: int):
                return stored_extent(dst_codec.encode_chunk(
                    memoryview(raw_all[j * chunk_size:j * chunk_size + rec.chunks[j].raw_size])))

            yield from zip((rec.chunks[j] for j in idx), pool.map(encode, idx))
        return
    dst_codec = get_codec(spec, settings)
    for window, data, base in read_windows(rec, reader):
        def one(j: int):
            stored = verified(rec, j, data, base, reader.path)
            if keep:
                return pad_extent(stored), len(stored), rec.chunks[j].checksum
            raw = np.empty(rec.chunks[j].raw_size, dtype=np.uint8)
            decode_into(src_codec, rec, j, stored, memoryview(raw), reader.path)
            return stored_extent(dst_codec.encode_chunk(memoryview(raw)))

        yield from zip((rec.chunks[j] for j in window), pool.map(one, window))


def gpu_decoder(device: Any) -> Callable[..., np.ndarray]:
    """A `gpu_decode` for migrate_step: decodes one tensor on `device` (a tiered.gpu.GpuDevice),
    reading through KvikIO where the source tier reads into GPU memory, through host memory
    otherwise. Holds the whole tensor on the GPU and then on the host while it is re-encoded."""
    from tiered.gpu import device_reader

    def decode(src: Any, step: int, index: RankIndex, rec: TensorRecord) -> np.ndarray:
        reader = device_reader(src, step, index.data_file)
        try:
            tmp = torch.empty(rec.shape, dtype=rec.torch_dtype, device=device.device)
            device.restore([(rec, tmp)], reader, index.chunk_size)
        finally:
            reader.close()
        return tmp.reshape(-1).view(torch.uint8).cpu().numpy()

    return decode


class BackgroundMigrator:
    """Copies each committed step down the tiers on a thread of its own, one hop at a time (each
    tier from the one above it, so a step is recompressed once, where the codec changes).

    Call order: ``submit(step)`` after each commit; ``wait(timeout)`` to block until queued steps
    are everywhere (raises the first failure since the last call); ``stop()`` finishes the queue
    and ends the thread. On start it queues committed steps that an earlier run left unmigrated.
    A failed migration leaves the step on the faster tiers: nothing committed is ever lost.
    """

    def __init__(self, config: Any, get_tier: Callable[[str], Any], pool: ThreadPoolExecutor,
                 make_gpu_decode: Callable[[], Any]):
        self._config, self._get_tier, self._pool = config, get_tier, pool
        self._make_gpu_decode = make_gpu_decode
        self._queue: "queue.Queue[int | None]" = queue.Queue()
        self._pending: set[int] = set()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._scanned = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiered-migrator", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        with self._lock:
            if step in self._pending:
                return
            self._pending.add(step)
        self._queue.put(step)

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._scanned.wait(timeout)
        while True:
            with self._lock:
                busy = sorted(self._pending)
                err, self._error = self._error, None
            if err is not None:
                raise TieredError(f"migration failed: {err!r}") from err
            if not busy:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"steps {busy} are still migrating")
            time.sleep(0.05)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._error = self._error or exc

    def _run(self) -> None:
        tiers = self._config.tiers
        try:  # resume: steps an earlier run committed but did not finish migrating
            lowest = set(self._get_tier(tiers[-1].name).steps())
            for step in self._get_tier(tiers[0].name).steps():
                if step not in lowest:
                    log.info("tiered: resuming migration of step %d", step)
                    self.submit(step)
        except Exception as exc:  # noqa: BLE001 - e.g. S3 unreachable now; new steps still queue
            log.error("tiered: cannot list the tiers to resume migrations: %r", exc)
            self._fail(exc)
        finally:
            self._scanned.set()
        gpu_decode = None
        while (step := self._queue.get()) is not None:
            try:
                for upper, lower in zip(tiers, tiers[1:]):
                    if gpu_decode is None:
                        gpu_decode = self._make_gpu_decode()
                    migrate_step(step, self._get_tier(upper.name), self._get_tier(lower.name), codec=lower.codec,
                                 settings=self._config.zstd, pool=self._pool, gpu_decode=gpu_decode)
            except BaseException as exc:  # noqa: BLE001 - the step stays on the faster tiers
                log.error("tiered: migration of step %d failed (it stays on the faster tiers): %r", step, exc)
                self._fail(exc)
            finally:
                with self._lock:
                    self._pending.discard(step)
