"""S3 tier: one object per file, under ``s3://bucket/prefix/step_<12 digits>/``.

    <prefix>/step_000000000100/MANIFEST.json                the commit: the last object written
    <prefix>/step_000000000100/<writer>/rank_00000.data     the files of the writer that committed it
    <prefix>/step_000000000100/rank_00000.data              files of a step whose ranks uploaded them
                                                            from several nodes (`begin_rank`)

S3 has no rename: the manifest is the **last** object written, and a step without one does not
exist. **One writer per step**: a process writing a step alone (`begin_step`) uploads its files
under a folder of its own (its writer id, `tiered.tiers.writers`), and commits by putting the
manifest with ``If-None-Match: *`` (a conditional write: S3 since 2024, SeaweedFS, MinIO), naming
that folder in the manifest object's metadata. The second of two writers of one step is refused
by the server and fails, naming the step, and its files never mixed with the first writer's. A
server that ignores the condition lets the last manifest win; each committed version is then
still one writer's whole step (its own folder), never a mix. A replacing commit (a repaired copy
built aside) puts the manifest unconditionally and then removes the old copy's objects.

Credentials come only from the standard AWS chain (environment, shared config and `profile`,
instance or pod role); they are never read from YAML, logged or stored. Object I/O is
`tiered.tiers.s3_io`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiered.errors import CheckpointNotFoundError, FormatError, TieredError
from tiered.format.manifest import (MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_step_dir, rank_file_names, safe_name,
                                    step_dir_name)
from tiered.tiers.base import committed_error
from tiered.tiers.s3_io import (MIN_PART, READ_PIECE, PartBuffers, S3DataReader, S3DataWriter, boto3_module,
                                client_error, error_code, part_size_for)
from tiered.tiers.writers import abandon, new_writer_id, parse_writer_id, writer_live

__all__ = ["READ_PIECE", "PartBuffers", "S3DataReader", "S3DataWriter", "S3Tier", "part_size_for"]

log = logging.getLogger("tiered")
FILES_META = "tiered-files"
"""Metadata of a manifest object: the folder of the step's files (absent: directly in the step)."""
_MISSING = ("404", "NoSuchKey", "NotFound")


class S3Tier:
    supports_rename = False
    reads_into_gpu = False

    def __init__(self, name: str, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, profile: str | None = None, part_size: int = 64 << 20,
                 max_concurrency: int = 8, max_attempts: int = 10, timeout: float = 60.0):
        if part_size < MIN_PART:
            raise ValueError(f"part_size must be at least {MIN_PART} bytes (S3's minimum part)")
        self.name, self.bucket, self.prefix = name, bucket, prefix.strip("/")
        self.part_size, self.max_concurrency = part_size, max_concurrency
        boto3 = boto3_module()
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
        self._lock = threading.Lock()
        self._writing: dict[int, str] = {}
        """Steps this object writes alone -> the folder (writer id) of their files."""
        self._folders: dict[int, str] = {}
        """Committed steps -> the folder of their files ('' directly in the step), as read."""
        self._uploaded: dict[str, int] = {}
        """Objects this writer uploaded into its folders (`note_upload`) -> their sizes, until the
        step is committed or discarded."""

    def __repr__(self) -> str:
        return f"S3Tier({self.name!r}, {self.root!r})"

    def _key(self, step: int, name: str = "") -> str:
        return "/".join(p for p in (self.prefix, step_dir_name(step), name) if p) + ("" if name else "/")

    def _file_key(self, step: int, name: str, what: str) -> str:
        """The key of file `name` of `step`: in this writer's folder while it writes the step,
        else in the folder the committed manifest names."""
        name = safe_name(name, self.describe(step, ""), what)
        with self._lock:
            folder = self._writing.get(step)
        if folder is None:
            folder = self._folder(step)
        return self._key(step, f"{folder}/{name}" if folder else name)

    def _folder(self, step: int) -> str:
        with self._lock:
            if step in self._folders:
                return self._folders[step]
        key = self._key(step, MANIFEST_NAME)
        try:
            meta = self.client.head_object(Bucket=self.bucket, Key=key).get("Metadata", {})
        except Exception as exc:  # noqa: BLE001
            if error_code(exc) in _MISSING:
                return ""  # not committed (yet): a distributed step's files sit in the step itself
            raise client_error(exc, f"{self.url(key)}: cannot read") from None
        folder = meta.get(FILES_META, "")
        if folder and parse_writer_id(folder) is None:
            raise FormatError(f"{self.url(key)}: names {folder!r} as the folder of its files, not a writer id")
        with self._lock:
            self._folders[step] = folder
        return folder

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}/{self.prefix}"

    def describe(self, step: int, name: str) -> str:
        """The URL of a file of the step, in its writer's folder where that is known here (no request)."""
        with self._lock:
            folder = self._writing.get(step) or self._folders.get(step)
        inside = folder and name and name != MANIFEST_NAME
        return self.url(self._key(step, f"{folder}/{name}" if inside else name))

    def _list(self, prefix: str, details: bool = False) -> list[Any]:
        found: list[Any] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                found.extend(o if details else o["Key"] for o in page.get("Contents", ()))
        except Exception as exc:  # noqa: BLE001
            raise client_error(exc, f"s3://{self.bucket}/{prefix}: cannot list") from None
        return found

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
            if error_code(exc) in _MISSING:
                return False
            raise client_error(exc, f"{self.describe(step, MANIFEST_NAME)}: cannot check") from None

    # --- writing ---------------------------------------------------------------------------
    def begin_step(self, step: int, replacing: bool = False) -> None:
        """Start writing `step` alone: refuse a committed step (unless `replacing` it, see
        `commit`); the files go to a folder of this writer's own (no other writer's objects are
        touched)."""
        if not replacing and self.has_step(step):
            raise committed_error(self.name, step, self.describe(step, ''))
        with self._lock:
            old, self._writing[step] = self._writing.get(step), new_writer_id()
        self._forget_uploads(self._key(step))  # (an earlier attempt's)
        if old is not None:
            abandon(old)
            self._remove_prefix(self._key(step, old) + "/", f"step {step}'s abandoned attempt")

    def _remove_prefix(self, prefix: str, what: str) -> int:
        """Delete the objects under `prefix` and abort its unfinished multipart uploads."""
        keys = self._list(prefix)
        try:
            self._delete_keys(keys)
            self._abort_uploads(prefix)
        except Exception as exc:  # noqa: BLE001
            raise client_error(exc, f"s3://{self.bucket}/{prefix}: cannot remove {what}") from None
        return len(keys)

    def _delete_keys(self, keys: list[str]) -> None:
        """Delete objects, 1,000 a request (S3's limit); boto3's errors are the caller's to word."""
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})

    def _abort_uploads(self, prefix: str, only_key: str | None = None) -> int:
        """Abort the unfinished multipart uploads under `prefix` (of `only_key` alone, if given);
        returns how many."""
        n = 0
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix):
            for up in page.get("Uploads", ()):
                if only_key is not None and up["Key"] != only_key:
                    continue
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                n += 1
        return n

    def discard(self, step: int) -> None:
        """Remove this writer's uncommitted objects of `step` (never another writer's)."""
        with self._lock:
            folder = self._writing.pop(step, None)
        if folder is not None:
            self._forget_uploads(self._key(step, folder) + "/")
            abandon(folder)  # (what a failed removal leaves, `reclaim_debris` takes later)
            self._remove_prefix(self._key(step, folder) + "/", f"step {step}'s uncommitted objects")

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
            raise client_error(exc, f"{self.describe(step, '')}: cannot clear rank {rank}'s uncommitted objects") from None

    def file_size(self, step: int, name: str) -> int | None:
        """Bytes of an object of the step, or None where it is missing."""
        key = self._file_key(step, name, "file name")
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except Exception as exc:  # noqa: BLE001
            if error_code(exc) in _MISSING:
                return None
            raise client_error(exc, f"{self.url(key)}: cannot check") from None

    def delete(self, step: int) -> None:
        """Delete a committed step: the manifest object first (the step is gone for readers at
        once; a crash part-way leaves only uncommitted objects), then the rest."""
        key = self._key(step, MANIFEST_NAME)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001
            raise client_error(exc, f"{self.url(key)}: cannot delete") from None
        with self._lock:
            self._folders.pop(step, None)
        n = self._remove_prefix(self._key(step), f"step {step}'s objects")
        log.debug("tiered: removed %d objects of step %d in %s", n, step, self.root)

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
            except Exception:  # noqa: BLE001,S110 - a stray probe object is harmless
                pass

    def open_data_writer(self, step: int, name: str, device: bool, size_hint: int | None = None) -> S3DataWriter:
        if device:
            raise TieredError(f"tier {self.name!r} (S3) writes from host memory only")
        return S3DataWriter(self, self._file_key(step, name, "data file"),
                            part_size_for(size_hint, self.part_size, self.max_concurrency))

    def write_file(self, step: int, name: str, data: bytes) -> None:
        key = self._file_key(step, name, "file name")
        self._put(key, data)
        self.note_upload(key, len(data))

    def note_upload(self, key: str, size: int) -> None:
        """`key` was uploaded, `size` bytes: where it lies in a folder this writer is writing, the
        commit checks the server still lists it (kept until the step is committed or discarded)."""
        with self._lock:
            if any(key.startswith(self._key(step, folder) + "/") for step, folder in self._writing.items()):
                self._uploaded[key] = size

    def _lost_uploads(self, step: int, folder: str) -> list[str]:
        """What this writer uploaded into `folder` of `step` that the server no longer lists at the
        size it was written (removed under it, or lost by a server that had acknowledged it): the
        commit names none of it (one listing of the folder)."""
        prefix = self._key(step, folder) + "/"
        with self._lock:
            want = {k: n for k, n in self._uploaded.items() if k.startswith(prefix)}
        if not want:
            return []
        got = {o["Key"]: int(o["Size"]) for o in self._list(prefix, details=True)}
        return sorted(k for k, n in want.items() if got.get(k) != n)

    def _forget_uploads(self, prefix: str) -> None:
        with self._lock:
            for key in [k for k in self._uploaded if k.startswith(prefix)]:
                del self._uploaded[key]

    def _lost_error(self, step: int, lost: list[str]) -> TieredError:
        return TieredError(f"step {step}: {len(lost)} object(s) uploaded to tier {self.name!r} are gone or of another "
                           f"size before the commit ({self.url(lost[0])}{', ...' if len(lost) > 1 else ''}): removed "
                           "while the step was written, or lost by the server; the step is not committed there")

    def _put(self, key: str, data: bytes, **extra: Any) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **extra)
        except Exception as exc:  # noqa: BLE001
            raise client_error(exc, f"{self.url(key)}: upload failed") from None

    def commit(self, step: int, manifest: bytes, replace: bool = False) -> None:
        """Put the manifest, the step's last object: its presence is the commit. Conditional
        (If-None-Match: *): never over another writer's commit, except with `replace` (a copy built
        aside, begun with `begin_step`, standing in for a damaged one), whose old objects then go.
        Then any multipart upload still open under this writer's files is aborted (one whose
        creation the server carried out but whose answer was lost, so that the client retried)."""
        key = self._key(step, MANIFEST_NAME)
        with self._lock:
            folder = self._writing.get(step)
        if replace and folder is None:
            raise TieredError(f"step {step}: a replacing commit needs the copy built aside (begin_step)")
        meta = {"Metadata": {FILES_META: folder}} if folder else {}
        lost = self._lost_uploads(step, folder) if folder else []
        if lost:
            raise self._lost_error(step, lost)
        try:
            if replace:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=manifest, **meta)
            else:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=manifest, IfNoneMatch="*", **meta)
        except Exception as exc:  # noqa: BLE001
            code = error_code(exc)
            if code not in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise client_error(exc, f"{self.url(key)}: upload failed") from None
            if self.read_manifest(step) == manifest and self._folder(step) == (folder or ""):
                # This writer's own manifest, whose first attempt the server carried out before its
                # answer was lost (the client sent it again: a server killed as it answered); or,
                # without a folder, another node's commit of the same distributed step. Done.
                pass
            else:
                raise TieredError(f"step {step} was committed in tier {self.name!r} ({self.describe(step, '')}) by "
                                  "another writer while this one wrote it: steps are immutable, this copy is "
                                  "discarded (save under a new step number, or give each job its own prefix)") from None
        with self._lock:
            self._writing.pop(step, None)
            self._folders[step] = folder or ""
        if folder:
            self._forget_uploads(self._key(step, folder) + "/")
        if replace:
            self._remove_others(step, folder)
        try:
            n = self._abort_uploads(self._key(step, folder) + "/" if folder else self._key(step))
        except Exception as exc:  # noqa: BLE001 - the step is committed; deleting it aborts them too
            log.warning("tiered: %s: cannot abort abandoned multipart uploads: %s", self.describe(step, ""),
                        client_error(exc, "list or abort"))
            return
        if n:
            log.info("tiered: aborted %d abandoned multipart upload(s) of step %d in %s", n, step, self.root)

    def _remove_others(self, step: int, folder: str) -> None:
        """After a replacing commit: every object of the step outside `folder`, but the manifest."""
        keep = (self._key(step, MANIFEST_NAME), self._key(step, folder) + "/")
        stale = [k for k in self._list(self._key(step)) if k != keep[0] and not k.startswith(keep[1])]
        try:
            self._delete_keys(stale)
        except Exception as exc:  # noqa: BLE001 - the new copy is committed; debris is reclaimed later
            log.warning("tiered: step %d: the replaced copy's objects stay for `tiered gc`: %s", step,
                        client_error(exc, "delete"))

    # --- debris ----------------------------------------------------------------------------
    def reclaim_debris(self, dry_run: bool = False) -> list[str]:
        """Remove the objects of writers that stopped before committing: per step, every folder
        other than the committed one (all of them where nothing is committed), and the objects
        of an uncommitted distributed step, once their writer is not live (`writer_live`: this
        host's process has exited; another host's objects are older than FOREIGN_TTL_S). Returns
        one line per removal; with `dry_run` removes nothing."""
        base = f"{self.prefix}/" if self.prefix else ""
        groups: dict[tuple[int, str], list[Any]] = {}
        for obj in self._list(base, details=True):
            parts = obj["Key"][len(base):].split("/")
            step = parse_step_dir(parts[0]) if len(parts) >= 2 else None
            if step is None or (len(parts) == 2 and parts[1] == MANIFEST_NAME):
                continue
            groups.setdefault((step, parts[1] if len(parts) == 3 else ""), []).append(obj)
        done = []
        for (step, folder), objs in sorted(groups.items()):
            committed = self.has_step(step)
            if committed and self._folder(step) == folder:
                continue
            newest = max(o["LastModified"].timestamp() for o in objs)
            if writer_live(folder, newest):
                continue
            what = f"{len(objs)} objects of step {step}" + (f" by writer {folder}" if folder else "")
            done.append(f"{self.url(self._key(step, folder))}: {what}, {'beside the commit' if committed else 'uncommitted'}")
            if not dry_run:
                try:
                    self._delete_keys([o["Key"] for o in objs])
                except Exception as exc:  # noqa: BLE001
                    raise client_error(exc, f"{self.root}: cannot remove debris") from None
        try:  # multipart uploads of writers that stopped (a live writer aborts its own at its commit)
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base):
                for up in page.get("Uploads", ()):
                    parts = up["Key"][len(base):].split("/")
                    folder = parts[1] if len(parts) == 3 else ""
                    if parse_step_dir(parts[0]) is None or writer_live(folder, up["Initiated"].timestamp()):
                        continue
                    done.append(f"{self.url(up['Key'])}: an unfinished upload" + (f" by writer {folder}" if folder else ""))
                    if not dry_run:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
        except Exception as exc:  # noqa: BLE001
            raise client_error(exc, f"{self.root}: cannot abort abandoned uploads") from None
        for line in done:
            log.info("tiered: %s %s", "would remove" if dry_run else "removed", line)
        return done

    # --- reading ---------------------------------------------------------------------------
    def _get(self, key: str, max_bytes: int, meta: dict[str, str] | None = None) -> bytes:
        """The object's bytes, at most `max_bytes`; its metadata into `meta`, where given."""
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001
            if error_code(exc) in _MISSING:
                raise CheckpointNotFoundError(f"{self.url(key)}: object is missing") from None
            raise client_error(exc, f"{self.url(key)}: cannot read") from None
        with obj["Body"] as body:
            if int(obj["ContentLength"]) > max_bytes:
                raise FormatError(f"{self.url(key)}: larger than the {max_bytes} bytes allowed")
            data = body.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise FormatError(f"{self.url(key)}: larger than the {max_bytes} bytes allowed")
        if meta is not None:
            meta.update(obj.get("Metadata", {}))
        return data

    def read_manifest(self, step: int) -> bytes:
        """The manifest; where its files are is noted on the way (the same request: a restore's
        reads of the files that follow ask nothing more)."""
        meta: dict[str, str] = {}
        try:
            raw = self._get(self._key(step, MANIFEST_NAME), MAX_MANIFEST_BYTES, meta)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"step {step} is not committed in tier {self.name!r} ({self.root})") from None
        folder = meta.get(FILES_META, "")
        if folder and parse_writer_id(folder) is None:
            raise FormatError(f"{self.describe(step, MANIFEST_NAME)}: names {folder!r} as the folder of its files, "
                              "not a writer id")
        with self._lock:
            self._folders[step] = folder
        return raw

    def read_file(self, step: int, name: str, max_bytes: int) -> bytes:
        return self._get(self._file_key(step, name, "file name"), max_bytes)

    def open_data_reader(self, step: int, name: str, device: bool) -> S3DataReader:
        if device:
            raise TieredError(f"tier {self.name!r} (S3) reads into host memory only")
        return S3DataReader(self, self._file_key(step, name, "data file"))
