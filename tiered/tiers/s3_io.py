"""The I/O of the S3 tier (`tiered.tiers.s3`): objects written and read, and S3's errors worded
without credentials.

Data files are uploaded as parallel multipart uploads while they are written (parts sized to the
object where its size is known, at most `part_size`; at most `max_concurrency` in flight: bounded
memory); reads are ranged GETs, so a reader fetches only the chunks it needs, and a large range
goes out as parallel GETs of `READ_PIECE` bytes. boto3 is imported on first use.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np

from tiered.errors import CheckpointNotFoundError, TieredError
from tiered.units import round_up

log = logging.getLogger("tiered")
MIN_PART = 5 * 1024 * 1024  # S3's minimum for every part but the last
READ_PIECE = 8 * 1024 * 1024
"""Bytes per ranged GET when a large range is read in parallel pieces."""
_MIN_PREFETCH_PIECE = 1 << 20
"""A prefetch of a small range still goes out as one GET per connection, of at least this many bytes."""


def boto3_module() -> Any:
    try:
        import boto3
    except ImportError:
        raise TieredError("the S3 tier needs boto3: pip install 'tiered[s3]'") from None
    return boto3


def client_error(exc: Exception, what: str) -> TieredError:
    """A clear, credential-free message for a failed S3 call (an S3 error answer, or a connection
    that failed: botocore's message names the endpoint, never a key)."""
    code = error_code(exc)
    if not code:
        return TieredError(f"{what}: {type(exc).__name__}: {exc}")
    hint = {
        "InvalidAccessKeyId": "the access key is not known to this endpoint",
        "SignatureDoesNotMatch": "the secret key does not match the access key",
        "AccessDenied": "the credentials are not allowed to do this",
        "NoSuchBucket": "the bucket does not exist",
    }.get(code, "")
    return TieredError(f"{what}: {code}{': ' + hint if hint else ''}")


class PartBuffers:
    """Part buffers kept between uploads, up to `limit` bytes: fresh memory costs a page fault per
    4 KiB, which on the lent H100 machine made filling parts (one thread) the slower side of a
    275 MB upload. The peak of an upload's own parts is what is kept (at most `max_concurrency`
    + 1 parts of at most `part_size`), so a migrator keeps one upload's memory between steps.
    Thread-safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free: dict[int, list[bytearray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            kept = self._free.get(size)
            if kept:
                self._bytes -= size
                return kept.pop()
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        size = len(buf)
        with self._lock:
            if size and self._bytes + size <= self.limit:
                self._free.setdefault(size, []).append(buf)
                self._bytes += size


class S3DataWriter:
    """Sequential writer of one object through a parallel multipart upload."""

    io_mode = "s3-multipart"

    def __init__(self, tier: Any, key: str, part_size: int):
        self.tier, self.key, self.part_size = tier, key, part_size
        self._buf = tier.spare.take(min(part_size, MIN_PART))
        """The part being filled: its first `_fill` bytes. Handed to the upload as it is when full
        (one copy per byte, from the caller's buffer into the part), and the next one started in
        a buffer an earlier part, or an earlier object's, has finished with (`S3Tier.spare`).
        Parts start small and double up to `part_size` (S3 takes parts of any size from 5 MiB):
        the first one goes out after 5 MiB written, not after a whole `part_size`."""
        self._fill = 0
        self._end = 0
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._slots = threading.Semaphore(tier.max_concurrency)

    def write_host(self, offset: int, buf: memoryview) -> None:
        if offset != self._end:
            raise TieredError(f"{self.tier.url(self.key)}: S3 data files are written in order "
                              f"(write at {offset}, expected {self._end})")
        src = memoryview(buf).cast("B")
        self._end += len(src)
        while len(src):
            n = min(len(src), len(self._buf) - self._fill)
            # numpy copies straight, without the GIL; `bytearray[a:b] = memoryview` first copies
            # the view into a temporary bytearray: fresh memory, a page fault per 4 KiB (26,000-
            # 55,000 per 275 MB step, most of the upload's system time on the 2-core CPU machine).
            np.copyto(np.frombuffer(self._buf, np.uint8, n, self._fill), np.frombuffer(src, np.uint8, n))
            self._fill += n
            src = src[n:]
            if self._fill == len(self._buf):
                part, self._fill = self._buf, 0
                self._buf = self.tier.spare.take(min(2 * len(part), self.part_size))
                self._submit(part, reuse=True)

    def write_device(self, offset: int, buf: Any) -> None:
        raise TieredError(f"tier {self.tier.name!r} (S3) writes from host memory only")

    def _submit(self, part: bytes | bytearray, reuse: bool = False) -> None:
        s3 = self.tier.client
        if self._upload_id is None:
            try:
                self._upload_id = s3.create_multipart_upload(Bucket=self.tier.bucket, Key=self.key)["UploadId"]
            except Exception as exc:  # noqa: BLE001
                raise client_error(exc, f"{self.tier.url(self.key)}: cannot start upload") from None
        number = len(self._parts) + 1
        self._slots.acquire()  # backpressure: at most max_concurrency parts in memory and in flight

        def upload() -> dict[str, Any]:
            try:
                r = s3.upload_part(Bucket=self.tier.bucket, Key=self.key, UploadId=self._upload_id,
                                   PartNumber=number, Body=part)
                return {"PartNumber": number, "ETag": r["ETag"]}
            finally:
                if reuse:
                    self.tier.spare.give(part)  # its upload is over (retries included)
                self._slots.release()

        self._parts.append(self.tier.pool.submit(upload))

    def wait(self) -> None:
        for f in self._parts:
            f.result()

    def close(self) -> int:
        s3 = self.tier.client
        try:
            tail = memoryview(self._buf)[:self._fill]
            if self._upload_id is None and not self._fill:
                # No chunks (the rank's state has no tensor bytes): the index records data_bytes 0
                # and readers never open the file, so no object is needed. (SeaweedFS also stalls
                # the next request on a connection that carried an empty-body PUT.)
                return 0
            if self._upload_id is None:
                s3.put_object(Bucket=self.tier.bucket, Key=self.key, Body=bytes(tail))
            else:
                if self._fill:
                    self._submit(bytes(tail))
                parts = [f.result() for f in self._parts]
                s3.complete_multipart_upload(Bucket=self.tier.bucket, Key=self.key, UploadId=self._upload_id,
                                             MultipartUpload={"Parts": parts})
        except TieredError:
            self.abort()
            raise
        except Exception as exc:  # noqa: BLE001
            self.abort()
            raise client_error(exc, f"{self.tier.url(self.key)}: upload failed") from None
        self.tier.spare.give(self._buf)
        self._buf, self._fill = bytearray(), 0
        self.tier.note_upload(self.key, self._end)
        return self._end

    def abort(self) -> None:
        for f in self._parts:
            f.exception()
        if self._upload_id is not None:
            try:
                self.tier.client.abort_multipart_upload(Bucket=self.tier.bucket, Key=self.key, UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - best effort; begin_step and discard abort leftovers too
                pass
            self._upload_id = None


class S3DataReader:
    """Ranged reads of one object. Opening it makes no request: a copy's first GET is its first
    round trip. The object's `size` is asked for (a HEAD) only where a caller wants it (a restore
    checks it against the index first) or to word an error; a missing object or a short one
    fails on the read that meets it."""

    io_mode = "s3-range"

    def __init__(self, tier: Any, key: str):
        self.tier, self.key = tier, key
        self.path = tier.url(key)
        self._size: int | None = None
        self._head: tuple[int, memoryview, int, list[Future]] | None = None  # see prefetch

    @property
    def size(self) -> int:
        if self._size is None:
            try:
                self._size = int(self.tier.client.head_object(Bucket=self.tier.bucket, Key=self.key)["ContentLength"])
            except Exception as exc:  # noqa: BLE001
                raise self._error(exc, "cannot read") from None
        return self._size

    def _error(self, exc: Exception, what: str) -> TieredError:
        if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
            return CheckpointNotFoundError(f"{self.path}: data file is missing")
        return client_error(exc, f"{self.path}: {what}")

    def _truncated(self, offset: int, size: int) -> TieredError:
        return TieredError(f"{self.path}: object is truncated: needs bytes {offset}..{offset + size}, has {self.size}")

    def read_host(self, offset: int, size: int) -> memoryview:
        """Bytes [offset, offset + size): one ranged GET, or for a large range (a window of chunks
        being restored or migrated) pieces of `READ_PIECE` bytes fetched in parallel, up to the
        tier's `max_concurrency` at once, into one buffer."""
        out = memoryview(bytearray(size))
        self.read_into(offset, out)
        return out

    def prefetch(self, offset: int, out: memoryview) -> bool:
        """Start fetching bytes [offset, offset + len(out)) into `out` now; later reads of ranges
        that start inside it wait for those GETs and copy from `out` instead of asking again.

        A copy from S3 calls this with the first bytes of a data file as soon as the manifest has
        named it, so that its first GETs do not wait for the rank's index to arrive and be parsed
        (a small step's copy spent ~27 ms before its first data GET on the lent H100 machine). The
        range goes out as parallel GETs, one per connection for a small one (at least 1 MiB each,
        at most `READ_PIECE`). `out` is written until `close()`, which waits for them. Returns True:
        the reader uses `out` (a tier whose reads start at once declines, returning False)."""
        if self._head is not None:
            raise TieredError(f"{self.path}: prefetch started twice")
        size = len(out)
        conns = max(1, self.tier.max_concurrency)
        piece = min(READ_PIECE, max(_MIN_PREFETCH_PIECE, round_up(-(-size // conns), _MIN_PREFETCH_PIECE)))
        self._head = (offset, out, piece, [self.tier.read_pool.submit(
            self._get_range, offset + start, out[start:start + piece]) for start in range(0, size, piece)])
        return True

    def _from_head(self, offset: int, out: memoryview) -> int:
        """Bytes of `out` (from its start) served from the prefetched range: 0 unless `offset`
        lies inside it. Waits for the GETs that cover them; their failures are raised here."""
        if self._head is None:
            return 0
        base, head, piece, pieces = self._head
        if not base <= offset < base + len(head):
            return 0
        n = min(len(out), base + len(head) - offset)
        lo, hi = offset - base, offset - base + n
        for future in pieces[lo // piece:-(-hi // piece)]:
            future.result()
        # numpy copies without the GIL: the readers of several windows copy at once.
        np.copyto(np.frombuffer(out, np.uint8, n), np.frombuffer(head[lo:hi], np.uint8))
        return n

    def read_into(self, offset: int, out: memoryview) -> None:
        """As `read_host`, into the caller's buffer."""
        size = len(out)
        if self._size is not None and offset + size > self._size:
            raise self._truncated(offset, size)
        served = self._from_head(offset, out)
        if served:
            offset, out, size = offset + served, out[served:], size - served
        if size < 2 * READ_PIECE or self.tier.max_concurrency < 2:
            if size:
                self._get_range(offset, out)
            return
        futures = [self.tier.read_pool.submit(self._get_range, offset + start, out[start:start + READ_PIECE])
                   for start in range(0, size, READ_PIECE)]
        for f in futures:
            f.result()

    def _get_range(self, offset: int, out: memoryview) -> None:
        """Bytes [offset, offset + len(out)) into `out`, straight from the response (no copy)."""
        size = len(out)
        try:
            body = self.tier.client.get_object(Bucket=self.tier.bucket, Key=self.key,
                                               Range=f"bytes={offset}-{offset + size - 1}")["Body"]
            done = 0
            with body:
                while done < size and (n := body.readinto(out[done:])):
                    done += n
        except Exception as exc:  # noqa: BLE001
            if error_code(exc) == "InvalidRange":  # the range starts past the object's end
                raise self._truncated(offset, size) from None
            raise self._error(exc, "ranged read failed") from None
        if done != size:
            raise self._truncated(offset, size)

    def read_device_async(self, offset: int, size: int, out: Any) -> Any:
        raise TieredError(f"tier {self.tier.name!r} (S3) reads into host memory only")

    def read_device(self, offset: int, size: int, out: Any) -> None:
        self.read_device_async(offset, size, out)

    def close(self) -> None:
        """Waits for a prefetch's GETs: the caller may reuse its buffer once this returns."""
        if self._head is not None:
            wait_futures(self._head[3])
            self._head = None


def part_size_for(size_hint: int | None, part_size: int, concurrency: int) -> int:
    """The part size for an object of about `size_hint` bytes: small enough that it goes out as up
    to `concurrency` parts in flight at once (a 34 MB step as seven 5 MiB parts, not as one PUT
    after the whole file is read), never under S3's 5 MiB minimum nor over the tier's `part_size`.
    Without a hint: `part_size`."""
    if not size_hint or size_hint <= 0:
        return part_size
    want = -(-size_hint // max(1, concurrency))
    want = -(-want // (1 << 20)) * (1 << 20)  # whole MiB
    return max(MIN_PART, min(part_size, want))


def error_code(exc: Exception) -> str:
    """The S3 error code of an answer ('' where none came: connection errors, timeouts)."""
    return str((getattr(exc, "response", None) or {}).get("Error", {}).get("Code", ""))


