"""Node-local tier (NVMe): step directories under a root path.

    <root>/step_000000000100/                            a committed step: manifest.json, rank files
    <root>/.step_000000000100__<writer>.writing/         that step while one process writes it
    <root>/.step_000000000100__<writer>.deleting/        a step being deleted
    <root>/.tiered-leases/                               steps in use (tiered.tiers.leases)

**One writer per step.** A process writing a step (`begin_step`) writes it into a work directory
of its own and commits it by writing the manifest there and renaming the directory to the step's
name. rename(2) onto a directory that is not empty fails, so a commit never replaces a committed
step: of two writers of one step, the second to commit fails and says so, and no reader ever sees
a mix of their files or a step without its manifest. The ranks of a distributed save (several
processes, one directory: `begin_rank`) write into the step's directory itself, each process
marking it with a ``.writer__<writer>`` file while it writes; their commit links the manifest into
place (link(2) never replaces either; the same manifest from another node counts as done). A
damaged step is replaced only by a new copy built aside (`commit(..., replace=True)`: the two
directories exchanged atomically where the filesystem can, renameat2). Deleting a step renames its
directory away (readers stop seeing it at once) and then removes it.

**Debris** (a killed writer's work directory, a killed deletion, a distributed step whose writers
all stopped before the commit) is what no live writer owns (`tiered.tiers.writers`):
`reclaim_debris` removes it, called by `tiered gc` and by the engine at start-up on its fast tier.

**Hostile files.** Steps are real directories holding a regular manifest; every file of a step is
opened through `tiered.tiers.files` (regular files only, no link followed out of the step).

File I/O (KvikIO, O_DIRECT, fsync) is `tiered.tiers.local_io`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from tiered.errors import FormatError, TieredError
from tiered.format.manifest import (MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_step_dir, rank_file_names, safe_name,
                                    step_dir_name)
from tiered.tiers.base import committed_error
from tiered.tiers.files import is_real_dir, is_regular, open_regular, read_bounded
from tiered.tiers.local_io import (IO_TASK, AlignedBuffer, LocalDataReader, LocalDataWriter, durable_tmp,
                                   drain_quietly, fsync_dir, kvikio_mode, replace_durably, wait_done, wait_futures)
from tiered.tiers.writers import abandon, new_writer_id, writer_live

__all__ = ["DELETING", "IO_TASK", "WRITING", "durable_tmp", "AlignedBuffer", "LocalDataReader", "LocalDataWriter", "LocalTier", "drain_quietly",
           "fsync_dir", "kvikio_mode", "replace_durably", "wait_done", "wait_futures"]

log = logging.getLogger("tiered")
WRITING, DELETING = ".writing", ".deleting"
"""Suffixes of the hidden directories beside the steps: a step being written, one being deleted."""
_MARK = ".writer__"
UNMARKED_QUIET_S = 600
"""An uncommitted step directory no writer has marked is debris once nothing in it has changed for
this long: a save by tiered before 0.3 left such directories, and a restarted run saving that
step again must not wait FOREIGN_TTL_S for them."""
_LINKLESS = {errno.EPERM, errno.EXDEV, errno.EMLINK, getattr(errno, "ENOTSUP", -1), getattr(errno, "EOPNOTSUPP", -1)}
"""link(2) errors of a filesystem without hard links."""


class LocalTier:
    supports_rename = True
    reads_into_gpu = True

    def __init__(self, name: str, root: Path, direct_io: str = "auto"):
        self.name = name
        self.root = Path(root).absolute()
        self.direct_io = direct_io
        self._lock = threading.Lock()
        self._work: dict[int, Path] = {}
        """Steps this object writes alone (`begin_step`) -> their work directories."""
        self._marks: dict[int, Path] = {}
        """Distributed steps this process writes ranks of (`begin_rank`) -> its writer mark."""

    def __repr__(self) -> str:
        return f"LocalTier({self.name!r}, {str(self.root)!r})"

    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def _files(self, step: int) -> Path:
        """Where the files of `step` are written and read: this writer's work directory while it
        writes the step alone, else the step's directory."""
        with self._lock:
            return self._work.get(step) or self.step_dir(step)

    # --- listing ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for entry in entries:
            step = parse_step_dir(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False) and \
                    is_regular(Path(entry.path) / MANIFEST_NAME):
                out.append(step)
        return sorted(out)

    def has_step(self, step: int) -> bool:
        d = self.step_dir(step)
        return is_real_dir(d) and is_regular(d / MANIFEST_NAME)

    # --- writing ---------------------------------------------------------------------------
    def begin_step(self, step: int, replacing: bool = False) -> None:
        """Start writing `step` alone: refuse a committed step (unless `replacing` it: a copy to
        stand in for a damaged one, committed with `commit(..., replace=True)`); the files go to a
        work directory of this writer's own until the commit."""
        if not replacing and self.has_step(step):
            raise committed_error(self.name, step, str(self.step_dir(step)))
        work = self._aside(step_dir_name(step), WRITING)
        self._make_dir(work)
        with self._lock:
            old, self._work[step] = self._work.get(step), work
        if old is not None:  # an attempt of this writer that was neither committed nor discarded
            shutil.rmtree(old, ignore_errors=True)

    def begin_rank(self, step: int, rank: int) -> None:
        """Start one rank's files of a step that several ranks write into one directory: refuse a
        committed step, mark the directory as written by this process, remove only this rank's
        leftovers (others may be writing beside it)."""
        d = self.step_dir(step)
        if self.has_step(step):
            raise committed_error(self.name, step, str(d))
        self._make_dir(d)
        if not is_real_dir(d):
            raise FormatError(f"{d}: not a directory of this tier (a symbolic link?): refused")
        with self._lock:
            if len(self._marks) > 16:  # (steps committed since, whose committer removed every mark)
                for done in [s for s in self._marks if s != step and self.has_step(s)]:
                    del self._marks[done]
            mark = self._marks.get(step)
            if mark is None:
                mark = self._marks[step] = d / f"{_MARK}{new_writer_id()}"
                os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
        if self.has_step(step):  # committed between the check above and the mark (a rename into place)
            self._unmark(step)
            raise committed_error(self.name, step, str(d))
        for name in rank_file_names(rank):
            (d / name).unlink(missing_ok=True)

    def _unmark(self, step: int) -> None:
        with self._lock:
            mark = self._marks.pop(step, None)
        if mark is not None:
            mark.unlink(missing_ok=True)

    @staticmethod
    def _make_dir(d: Path) -> None:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TieredError(f"{d}: cannot create step directory: {exc.strerror}") from None

    def discard(self, step: int) -> None:
        """Remove this writer's uncommitted files of `step` after a failure (never a committed
        step, never another writer's files)."""
        with self._lock:
            work = self._work.pop(step, None)
        if work is not None:
            abandon(work.name[1:-len(WRITING)].partition("__")[2])  # (what rmtree leaves is debris)
            shutil.rmtree(work, ignore_errors=True)

    def discard_rank(self, step: int, rank: int) -> None:
        """Remove one rank's files of an uncommitted step (never those of a committed step)."""
        d = self.step_dir(step)
        if is_real_dir(d) and not self.has_step(step):
            for name in rank_file_names(rank):
                (d / name).unlink(missing_ok=True)
        self._unmark(step)

    def file_size(self, step: int, name: str) -> int | None:
        """Bytes of a regular file of the step, or None where it is missing."""
        d = self._files(step)
        path = d / safe_name(name, str(d), "file name")
        return path.stat().st_size if is_regular(path) else None

    def file_path(self, step: int, name: str) -> Path:
        """Where this writer writes a file of `step` (its work directory while it writes the step alone)."""
        d = self._files(step)
        return d / safe_name(name, str(d), "file name")

    def open_data_writer(self, step: int, name: str, device: bool, size_hint: int | None = None) -> LocalDataWriter:
        d = self._files(step)
        return LocalDataWriter(d / safe_name(name, str(d), "data file"), self.direct_io, device)

    def write_file(self, step: int, name: str, data: bytes) -> None:
        # By rename, so that a reader never sees a partial file even where several nodes write
        # the same file (a step's DCP metadata on a shared tier).
        d = self._files(step)
        path = d / safe_name(name, str(d), "file name")
        os.replace(durable_tmp(path, data), path)

    def commit(self, step: int, manifest: bytes, replace: bool = False) -> None:
        """Commit `step`: the manifest, durable, then the step in place under its name. Never
        replaces a committed step, except with `replace` (a copy built aside to stand in for a
        damaged one: `begin_step` first), which swaps the two and removes the old."""
        with self._lock:
            work = self._work.get(step)
        if work is None:
            if replace:
                raise TieredError(f"step {step}: a replacing commit needs the copy built aside (begin_step)")
            self._commit_in_place(step, manifest)
            return
        tmp = durable_tmp(work / MANIFEST_NAME, manifest)
        os.replace(tmp, work / MANIFEST_NAME)
        fsync_dir(work)
        d = self.step_dir(step)
        if replace and self.has_step(step):
            self._exchange(work, d)
        else:
            self._rename_into_place(step, work, d)
        with self._lock:
            self._work.pop(step, None)
        fsync_dir(self.root)

    def commit_rank(self, step: int, names: tuple[str, ...], manifest: bytes) -> None:
        """Commit files of one rank of a distributed step (`names`, its index last) that this
        writer built aside (`begin_step(step, replacing=True)`, beside the step's other files but
        the manifest), on a node-local tier that may hold the step already: where it does not, the
        copy becomes the step; where another writer committed the same manifest first (another rank
        of this node), the files are linked into it, the index last (a reader finds a rank by its
        index), never replacing one there."""
        with self._lock:
            work = self._work.get(step)
        if work is None:
            raise TieredError(f"step {step}: a rank's files to commit must be built aside first (begin_step)")
        if not self.has_step(step):
            try:
                self.commit(step, manifest)
                return
            except TieredError:
                if not self.has_step(step):
                    raise
        self._same_manifest(step, manifest)
        d = self.step_dir(step)
        try:
            for name in names:
                try:
                    os.link(work / name, d / safe_name(name, str(d), "file name"))
                except FileExistsError:
                    log.info("tiered: %s: already there (another writer restored it), kept", d / name)
                except OSError as exc:
                    if exc.errno not in _LINKLESS:
                        raise TieredError(f"{d}: cannot add {name} to step {step}: {exc.strerror}") from None
                    if not (d / name).exists():
                        os.rename(work / name, d / name)
            fsync_dir(d)
        finally:
            self.discard(step)

    def _rename_into_place(self, step: int, work: Path, d: Path) -> None:
        for attempt in range(2):
            try:
                os.rename(work, d)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise TieredError(f"{d}: cannot commit step {step}: {exc.strerror}") from None
            if self.has_step(step):
                raise TieredError(f"step {step} was committed in tier {self.name!r} ({d}) by another writer while "
                                  "this one wrote it: steps are immutable, this copy is discarded (save under a "
                                  "new step number, or give each job its own directory)")
            if not is_real_dir(d):
                raise FormatError(f"{d}: in the way of step {step}'s commit and not a directory of this tier "
                                  "(a file or a symbolic link): remove it")
            live = self._live_writers(d)
            if live or attempt:
                raise TieredError(f"step {step} is being written in {d} by another writer ({live or 'unknown'}): "
                                  "this copy is discarded")
            log.info("tiered: %s: removing the uncommitted files of a stopped writer of step %d", d, step)
            self._remove(d)

    def _commit_in_place(self, step: int, manifest: bytes) -> None:
        """The commit of a step whose ranks wrote into its directory: link the manifest in (a link
        never replaces); a manifest already there with the same bytes (another node committed the
        same step) counts as this commit."""
        d = self.step_dir(step)
        if not is_real_dir(d):
            raise FormatError(f"{d}: not a directory of this tier: cannot commit step {step}")
        tmp: Path | None = durable_tmp(d / MANIFEST_NAME, manifest)
        try:
            try:
                os.link(tmp, d / MANIFEST_NAME)
            except FileExistsError:
                self._same_manifest(step, manifest)
            except OSError as exc:
                if exc.errno not in _LINKLESS:
                    raise TieredError(f"{d}: cannot commit step {step}: {exc.strerror}") from None
                # A filesystem without hard links: check, then rename (two steps there).
                if self.has_step(step):
                    self._same_manifest(step, manifest)
                else:
                    os.replace(tmp, d / MANIFEST_NAME)
                    tmp = None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        fsync_dir(d)
        fsync_dir(self.root)
        for entry in os.scandir(d):
            if entry.name.startswith(_MARK):
                Path(entry.path).unlink(missing_ok=True)
        with self._lock:
            self._marks.pop(step, None)

    def _same_manifest(self, step: int, manifest: bytes) -> None:
        if self.read_manifest(step) != manifest:
            raise TieredError(f"step {step} was committed in tier {self.name!r} ({self.step_dir(step)}) by another "
                              "writer with other contents: steps are immutable, this one is not committed")

    def _exchange(self, work: Path, d: Path) -> None:
        """Put the copy in `work` in place of the committed step `d` (its manifest is there) and
        remove the old: atomically where the filesystem exchanges directories (renameat2), else
        by two renames (for a moment the step is on neither name: readers fall back)."""
        if _exchange_dirs(work, d):
            self._remove(work)
            return
        aside = self._aside(d.name, DELETING)
        os.rename(d, aside)
        os.rename(work, d)
        shutil.rmtree(aside, ignore_errors=True)

    def delete(self, step: int) -> None:
        """Delete a committed step: its directory is renamed away first (readers stop seeing the
        step at once; a crash part-way leaves debris that `reclaim_debris` removes), then removed.
        A step name that is a link is refused and left alone."""
        d = self.step_dir(step)
        if os.path.islink(d):
            raise FormatError(f"{d}: a symbolic link, not a step directory of this tier: left alone")
        self._remove(d)

    def _aside(self, step_name: str, kind: str) -> Path:
        """A hidden directory beside the steps (same directory: renames stay within it), owned by
        a new writer id of this process."""
        return self.root / f".{step_name}__{new_writer_id()}{kind}"

    def _remove(self, d: Path) -> None:
        aside = self._aside(d.name, DELETING)
        try:
            os.rename(d, aside)
        except FileNotFoundError:
            return
        fsync_dir(self.root)
        shutil.rmtree(aside, ignore_errors=True)

    # --- debris ----------------------------------------------------------------------------
    def _live_writers(self, d: Path) -> str:
        """The writers that may still be at work in the uncommitted step directory `d` ('' for
        none): its marks' processes where they run; a directory without marks (a save of tiered
        before 0.3, or ranks between making it and marking it) whose files changed within
        UNMARKED_QUIET_S counts as written by an unknown writer."""
        try:
            entries = list(os.scandir(d))
        except OSError:
            return ""
        marks = [e for e in entries if e.name.startswith(_MARK)]
        if marks:
            return ", ".join(e.name[len(_MARK):] for e in marks
                             if writer_live(e.name[len(_MARK):], e.stat(follow_symlinks=False).st_mtime))
        return "an unknown writer" if time.time() - _changed(d, entries) < UNMARKED_QUIET_S else ""

    def reclaim_debris(self, dry_run: bool = False) -> list[str]:
        """Remove what no live writer owns: work directories of writers that stopped, deletions
        that did not finish, uncommitted step directories whose writers all stopped. Returns one
        line per removal (what, and why); with `dry_run` removes nothing."""
        done: list[str] = []
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            entries = []
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            kind = next((k for k in (WRITING, DELETING) if entry.name.startswith(".") and entry.name.endswith(k)), None)
            if kind is not None:
                step_name, _, writer = entry.name[1:-len(kind)].partition("__")
                if parse_step_dir(step_name) is None or writer_live(writer, _changed(Path(entry.path))):
                    continue
                what = "an unfinished deletion" if kind == DELETING else "an uncommitted copy"
                done.append(f"{entry.path}: {what} of {step_name} by a writer that stopped ({writer})")
                if not dry_run:
                    shutil.rmtree(entry.path, ignore_errors=True)
            elif parse_step_dir(entry.name) is not None:
                d = Path(entry.path)
                if is_regular(d / MANIFEST_NAME) or self._live_writers(d):
                    continue
                done.append(f"{d}: an uncommitted step whose writers stopped")
                if not dry_run:
                    self._remove(d)
        for line in done:
            log.info("tiered: %s %s", "would remove" if dry_run else "removed", line)
        return done

    # --- reading ---------------------------------------------------------------------------
    def read_manifest(self, step: int) -> bytes:
        return read_bounded(self.step_dir(step), MANIFEST_NAME, MAX_MANIFEST_BYTES,
                            f"step {step} is not committed in tier {self.name!r} ({self.root})")

    def read_file(self, step: int, name: str, max_bytes: int) -> bytes:
        d = self._files(step)
        return read_bounded(d, safe_name(name, str(d), "file name"), max_bytes)

    def open_data_reader(self, step: int, name: str, device: bool) -> LocalDataReader:
        d = self._files(step)
        name = safe_name(name, str(d), "data file")
        fd = open_regular(d, name, f"{d / name}: data file is missing")
        try:
            return LocalDataReader(fd, d / name, device, self.direct_io)
        except BaseException:
            os.close(fd)
            raise

    def describe(self, step: int, name: str) -> str:
        return str(self.step_dir(step) / name)

    def probe_bandwidth(self, nbytes: int) -> float:
        """Write `nbytes` to a scratch file the way a data file is written (host buffers, O_DIRECT
        per `direct_io`, fsync) and return the bytes/s seen; the file is removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f".tiered-probe-{os.getpid()}"
        block = AlignedBuffer(min(nbytes, 16 << 20))
        block.view[:] = os.urandom(block.size)
        try:
            t0 = time.perf_counter()
            writer = LocalDataWriter(path, self.direct_io, device=False)
            try:
                for offset in range(0, nbytes, block.size):
                    writer.write_host(offset, block.view)
                writer.close()
            except BaseException:
                writer.abort()
                raise
            return nbytes / max(time.perf_counter() - t0, 1e-9)
        finally:
            block.close()
            path.unlink(missing_ok=True)


def _changed(d: Path, entries: list[os.DirEntry] | None = None) -> float:
    """When `d` or a file directly in it last changed (0 where it cannot be read)."""
    newest = 0.0
    try:
        newest = os.lstat(d).st_mtime
        for e in entries if entries is not None else os.scandir(d):
            newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    except OSError:
        pass
    return newest


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange_dirs(a: Path, b: Path) -> bool:
    """Exchange two directories atomically (Linux renameat2 RENAME_EXCHANGE); False where the
    system or filesystem cannot (then nothing was changed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0
