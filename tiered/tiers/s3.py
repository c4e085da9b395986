"""S3 tier: one object per file, under ``s3://bucket/prefix/step_<12 digits>/``.

Data files are uploaded as parallel multipart uploads while they are written (parts sized to the
object where its size is known, at most `part_size`; at most `max_concurrency` in flight: bounded
memory); reads are ranged GETs, so a reader fetches only the chunks it needs, and a large range
goes out as parallel GETs of `READ_PIECE` bytes. An empty data file is not uploaded at all (its index
says `data_bytes: 0`, and readers do not open it). S3 has no rename: the manifest is the **last** object
written, and a step without one does not exist. Credentials come only from the standard AWS
chain (environment, shared config and `profile`, instance or pod role); they are never read from
YAML, logged or stored. boto3 is imported on first use.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np

from tiered.errors import CheckpointNotFoundError, FormatError, TieredError
from tiered.format.manifest import (MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_step_dir, rank_file_names, safe_name,
                                    step_dir_name)
from tiered.tiers.base import committed_error
from tiered.units import round_up

log = logging.getLogger("tiered")
_MIN_PART = 5 * 1024 * 1024  # S3's minimum for every part but the last
READ_PIECE = 8 * 1024 * 1024
"""Bytes per ranged GET when a large range is read in parallel pieces."""
_MIN_PREFETCH_PIECE = 1 << 20
"""A prefetch of a small range still goes out as one GET per connection, of at least this many bytes."""


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise TieredError("the S3 tier needs boto3: pip install 'tiered[s3]'") from None
    return boto3


def _client_error(exc: Exception, what: str) -> TieredError:
    """A clear, credential-free message for a failed S3 call (an S3 error answer, or a connection
    that failed: botocore's message names the endpoint, never a key)."""
    code = _code(exc)
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

    def __init__(self, tier: "S3Tier", key: str, part_size: int):
        self.tier, self.key, self.part_size = tier, key, part_size
        self._buf = tier.spare.take(min(part_size, _MIN_PART))
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
                raise _client_error(exc, f"{self.tier.url(self.key)}: cannot start upload") from None
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
            raise _client_error(exc, f"{self.tier.url(self.key)}: upload failed") from None
        self.tier.spare.give(self._buf)
        self._buf, self._fill = bytearray(), 0
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

    def __init__(self, tier: "S3Tier", key: str):
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
        if _code(exc) in ("404", "NoSuchKey", "NotFound"):
            return CheckpointNotFoundError(f"{self.path}: data file is missing")
        return _client_error(exc, f"{self.path}: {what}")

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
            if _code(exc) == "InvalidRange":  # the range starts past the object's end
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
    return max(_MIN_PART, min(part_size, want))


def _code(exc: Exception) -> str:
    """The S3 error code of an answer ('' where none came: connection errors, timeouts)."""
    return str((getattr(exc, "response", None) or {}).get("Error", {}).get("Code", ""))


class S3Tier:
    supports_rename = False
    reads_into_gpu = False

    def __init__(self, name: str, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, profile: str | None = None, part_size: int = 64 << 20,
                 max_concurrency: int = 8, max_attempts: int = 10, timeout: float = 60.0):
        if part_size < _MIN_PART:
            raise ValueError(f"part_size must be at least {_MIN_PART} bytes (S3's minimum part)")
        self.name, self.bucket, self.prefix = name, bucket, prefix.strip("/")
        self.part_size, self.max_concurrency = part_size, max_concurrency
        boto3 = _boto3()
        from botocore.config import Config

        session = boto3.session.Session(profile_name=profile, region_name=region)
        # Retries belong to botocore's adaptive mode: throttling (SlowDown, 429), 5xx answers and
        # lost or silent connections are retried with exponential backoff and full jitter (and
        # throttling also slows this client's request rate); 4xx answers fail on the first attempt.
        self.client = session.client("s3", endpoint_url=endpoint_url, config=Config(
            retries={"max_attempts": max_attempts, "mode": "adaptive"}, connect_timeout=timeout,
            read_timeout=timeout, max_pool_connections=max(10, 2 * max_concurrency)))
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"tiered-s3-{name}")
        self.spare = PartBuffers((max_concurrency + 1) * part_size)
        # Reads get a pool of their own: a restore's ranged GETs never queue behind uploads.
        self.read_pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"tiered-s3r-{name}")
        self.root = self.url("")

    def __repr__(self) -> str:
        return f"S3Tier({self.name!r}, {self.root!r})"

    def _key(self, step: int, name: str = "") -> str:
        return "/".join(p for p in (self.prefix, step_dir_name(step), name) if p) + ("" if name else "/")

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}/{self.prefix}"

    def describe(self, step: int, name: str) -> str:
        return self.url(self._key(step, name))

    def _list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                keys.extend(o["Key"] for o in page.get("Contents", ()))
        except Exception as exc:  # noqa: BLE001
            raise _client_error(exc, f"s3://{self.bucket}/{prefix}: cannot list") from None
        return keys

    def steps(self) -> list[int]:
        base = f"{self.prefix}/" if self.prefix else ""
        out = []
        for key in self._list(base):
            parts = key[len(base):].split("/")
            if len(parts) == 2 and parts[1] == MANIFEST_NAME and (step := parse_step_dir(parts[0])) is not None:
                out.append(step)
        return sorted(out)

    def has_step(self, step: int) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(step, MANIFEST_NAME))
            return True
        except Exception as exc:  # noqa: BLE001
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise _client_error(exc, f"{self.describe(step, MANIFEST_NAME)}: cannot check") from None

    def begin_step(self, step: int) -> None:
        if self.has_step(step):
            raise committed_error(self.name, step, self.describe(step, ''))
        self._remove(step)

    def _remove(self, step: int) -> None:
        """Delete a step's objects and abort its unfinished multipart uploads."""
        prefix = self._key(step)
        keys = self._list(prefix)
        try:
            for i in range(0, len(keys), 1000):
                self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            self._abort_uploads(prefix)
        except Exception as exc:  # noqa: BLE001
            raise _client_error(exc, f"{self.describe(step, '')}: cannot clear uncommitted objects") from None
        if keys:
            log.info("tiered: removed %d uncommitted objects of step %d in %s", len(keys), step, self.root)

    def _abort_uploads(self, prefix: str, only_key: str | None = None) -> int:
        """Abort the unfinished multipart uploads under `prefix` (of `only_key` alone, if given);
        returns how many."""
        n = 0
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix):
            for up in page.get("Uploads", ()):
                if only_key is None or up["Key"] == only_key:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    n += 1
        return n

    def discard(self, step: int) -> None:
        if not self.has_step(step):
            self._remove(step)

    def begin_rank(self, step: int, rank: int) -> None:
        """Start one rank's objects of a step other ranks upload beside it: refuse a committed
        step, remove only this rank's leftovers."""
        if self.has_step(step):
            raise committed_error(self.name, step, self.describe(step, ''))
        self._remove_rank(step, rank)

    def discard_rank(self, step: int, rank: int) -> None:
        if not self.has_step(step):
            self._remove_rank(step, rank)

    def _remove_rank(self, step: int, rank: int) -> None:
        keys = [self._key(step, name) for name in rank_file_names(rank)]
        try:
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
            for key in keys:
                self._abort_uploads(key, only_key=key)
        except Exception as exc:  # noqa: BLE001
            raise _client_error(exc, f"{self.describe(step, '')}: cannot clear rank {rank}'s uncommitted objects") from None

    def file_size(self, step: int, name: str) -> int | None:
        """Bytes of an object of the step, or None where it is missing."""
        key = self._key(step, safe_name(name, self.root, "file name"))
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except Exception as exc:  # noqa: BLE001
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise _client_error(exc, f"{self.url(key)}: cannot check") from None

    def delete(self, step: int) -> None:
        """Delete a committed step: the manifest object first (the step is gone for readers at
        once; a crash part-way leaves only uncommitted objects), then the rest."""
        key = self._key(step, MANIFEST_NAME)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001
            raise _client_error(exc, f"{self.url(key)}: cannot delete") from None
        self._remove(step)

    def probe_bandwidth(self, nbytes: int) -> float:
        """Upload `nbytes` to a scratch object as a data file is uploaded (parallel multipart)
        and return the bytes/s seen; the object is deleted."""
        key = "/".join(p for p in (self.prefix, f".tiered-probe-{os.getpid()}") if p)
        block = memoryview(os.urandom(min(nbytes, 16 << 20)))
        t0 = time.perf_counter()
        writer = S3DataWriter(self, key, part_size_for(nbytes, self.part_size, self.max_concurrency))
        try:
            for offset in range(0, nbytes, len(block)):
                writer.write_host(offset, block)
            writer.close()
            return nbytes / max(time.perf_counter() - t0, 1e-9)
        finally:
            writer.abort()
            try:
                self.client.delete_object(Bucket=self.bucket, Key=key)
            except Exception:  # noqa: BLE001 - a stray probe object is harmless
                pass

    def open_data_writer(self, step: int, name: str, device: bool, size_hint: int | None = None) -> S3DataWriter:
        if device:
            raise TieredError(f"tier {self.name!r} (S3) writes from host memory only")
        return S3DataWriter(self, self._key(step, safe_name(name, self.root, "data file")),
                            part_size_for(size_hint, self.part_size, self.max_concurrency))

    def write_file(self, step: int, name: str, data: bytes) -> None:
        key = self._key(step, safe_name(name, self.root, "file name"))
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        except Exception as exc:  # noqa: BLE001
            raise _client_error(exc, f"{self.url(key)}: upload failed") from None

    def commit(self, step: int, manifest: bytes) -> None:
        """The manifest is the last object of a step: its presence is the commit. Then any
        multipart upload still open under the step is abandoned (every file of the step is
        complete): one whose creation the server carried out but whose answer was lost, so that
        the client retried with a new one. It is aborted, so that it costs no storage."""
        self.write_file(step, MANIFEST_NAME, manifest)
        try:
            n = self._abort_uploads(self._key(step))
        except Exception as exc:  # noqa: BLE001 - the step is committed; deleting it aborts them too
            log.warning("tiered: %s: cannot abort abandoned multipart uploads: %s", self.describe(step, ""),
                        _client_error(exc, "list or abort"))
            return
        if n:
            log.info("tiered: aborted %d abandoned multipart upload(s) of step %d in %s", n, step, self.root)

    def _get(self, key: str, max_bytes: int) -> bytes:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):
                raise CheckpointNotFoundError(f"{self.url(key)}: object is missing") from None
            raise _client_error(exc, f"{self.url(key)}: cannot read") from None
        if int(obj["ContentLength"]) > max_bytes:
            obj["Body"].close()
            raise FormatError(f"{self.url(key)}: larger than the {max_bytes} bytes allowed")
        return obj["Body"].read()

    def read_manifest(self, step: int) -> bytes:
        try:
            return self._get(self._key(step, MANIFEST_NAME), MAX_MANIFEST_BYTES)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"step {step} is not committed in tier {self.name!r} ({self.root})") from None

    def read_file(self, step: int, name: str, max_bytes: int) -> bytes:
        return self._get(self._key(step, safe_name(name, self.describe(step, ""), "file name")), max_bytes)

    def open_data_reader(self, step: int, name: str, device: bool) -> S3DataReader:
        if device:
            raise TieredError(f"tier {self.name!r} (S3) reads into host memory only")
        return S3DataReader(self, self._key(step, safe_name(name, self.describe(step, ""), "data file")))
