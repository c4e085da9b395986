"""The file I/O of the filesystem tiers (`tiered.tiers.local`, `tiered.tiers.posix`): one rank's
data file written and read, and the small durable writes beside it.

GPU buffers are written and read with KvikIO (cuFile): GPUDirect Storage where the driver and
filesystem support it, KvikIO's POSIX compat mode otherwise; which one ran is logged once and
recorded in each index (`io`). Host buffers use POSIX pwrite, with O_DIRECT where the filesystem
supports it (every extent is 4 KiB aligned in offset, length and memory). Data is fsynced before
the index and the manifest are written. Files are created with `O_NOFOLLOW` and read only through
descriptors `tiered.tiers.files` opened and checked; KvikIO and the O_DIRECT descriptor open that
same file again through /proc/self/fd, never the path.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tiered.errors import TieredError
from tiered.format.manifest import ALIGNMENT
from tiered.tiers.files import fd_path
from tiered.tiers.host_writes import HostWrites

log = logging.getLogger("tiered")
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_logged_modes: set[str] = set()


def _open_direct(path: Any, flags: int, direct_io: str) -> int:
    """`path` opened with `flags` and O_DIRECT; -1 where the filesystem refuses O_DIRECT
    (EINVAL) and `direct_io` is auto. Under `direct_io: on`, or for any other error, a
    TieredError naming the field."""
    try:
        return os.open(path, flags | _O_DIRECT, 0o644)
    except OSError as exc:
        if direct_io == "on" or exc.errno != errno.EINVAL:
            raise TieredError(f"{path}: cannot open with O_DIRECT ({exc.strerror}); "
                              "set direct_io: auto or off for this tier") from None
        return -1


def _log_mode_once(mode: str, detail: str) -> None:
    if mode not in _logged_modes:
        _logged_modes.add(mode)
        log.info("tiered: %s", detail)


IO_THREADS = 4
"""KvikIO threads for the large requests below, unless KVIKIO_NTHREADS says otherwise."""
IO_TASK = 16 << 20
"""Bytes per KvikIO task: requests are split into tasks of this size, run on its threads."""
_configured = False


def kvikio_mode() -> str:
    """"kvikio-gds" or "kvikio-compat" (imports KvikIO; call only where CUDA is in use).

    On first use it also sets KvikIO's thread pool to IO_THREADS threads and, in compat mode,
    O_DIRECT reads, unless KVIKIO_NTHREADS / KVIKIO_AUTO_DIRECT_IO_READ are set. KvikIO's
    defaults are one thread and buffered reads: measured on the lent H100s (docs/architecture.md,
    "KvikIO settings"), 2 GB of reads into GPU memory ran at 1.5-1.6 GB/s that way and at
    2.1 GB/s with 4 threads, 16 MiB tasks and O_DIRECT. These are process-wide KvikIO settings.
    """
    global _configured
    import kvikio.defaults

    mode = "kvikio-compat" if kvikio.defaults.is_compat_mode_preferred() else "kvikio-gds"
    if not _configured:
        _configured = True
        settings: dict[str, Any] = {}
        if "KVIKIO_NTHREADS" not in os.environ and kvikio.defaults.get("num_threads") < IO_THREADS:
            settings["num_threads"] = IO_THREADS
        if mode == "kvikio-compat" and "KVIKIO_AUTO_DIRECT_IO_READ" not in os.environ:
            settings["auto_direct_io_read"] = True
        if settings:
            kvikio.defaults.set(settings)
        log.info("tiered: KvikIO %s: %d I/O threads, %d MiB tasks, O_DIRECT reads %s, O_DIRECT writes %s", mode,
                 kvikio.defaults.get("num_threads"), IO_TASK >> 20, _on(kvikio.defaults, "auto_direct_io_read"),
                 _on(kvikio.defaults, "auto_direct_io_write"))
    return mode


def _on(defaults: Any, key: str) -> str:
    try:
        return "on" if defaults.get(key) else "off"
    except (KeyError, ValueError, AttributeError):  # an older KvikIO without the setting
        return "n/a"


def durable_tmp(path: Path, data: bytes) -> Path:
    """`data` written and fsync'd beside `path`, under a temporary name of this process and
    thread (ranks of other nodes may write the same file into a shared directory)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_NOFOLLOW, 0o644)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes) -> None:
    """`path` holds `data` whole, durably, or its old content: written beside it and fsync'd,
    renamed over it, and the directory fsync'd (a small file outside any step: a trainer's
    checkpoint pointer, a metrics file)."""
    os.replace(durable_tmp(path, data), path)
    fsync_dir(path.parent)


class AlignedBuffer:
    """Page-aligned host memory (what O_DIRECT needs), reused across writes."""

    def __init__(self, size: int):
        self.size = size
        self._mm = mmap.mmap(-1, size)
        self.view = memoryview(self._mm)

    def close(self) -> None:
        self.view.release()
        try:
            self._mm.close()
        except BufferError:
            # A slice is still referenced (by the traceback of a failed write, which the save's
            # error keeps): the mapping is freed with it. Raising here would hide that error.
            pass


class LocalDataWriter:
    """Writes one rank's data file. Host extents: POSIX (O_DIRECT when possible). Device extents:
    KvikIO, asynchronously; close() waits for every pending write, then fsyncs."""

    def __init__(self, path: Path, direct_io: str, device: bool):
        self.path = path
        self._fd = -1
        self._direct = False
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_NOFOLLOW
        if direct_io != "off" and _O_DIRECT:
            self._fd = _open_direct(path, flags, direct_io)
            self._direct = self._fd >= 0
        if self._fd < 0:
            self._fd = os.open(path, flags, 0o644)
        self._direct_policy = direct_io
        self._bounce: AlignedBuffer | None = None
        self._cufile: Any = None
        self._futures: list[Any] = []
        self._host = HostWrites(self._pwrite_all, IO_THREADS, IO_TASK, "tiered-write")
        self._reopen = threading.Lock()
        self._end = 0
        host_mode = "posix-odirect" if self._direct else "posix-buffered"
        self.io_mode = host_mode
        if device:
            import kvikio

            self._cufile = kvikio.CuFile(fd_path(self._fd, path), "r+")
            mode = kvikio_mode()
            _log_mode_once(mode, f"KvikIO writes GPU buffers in {'GPUDirect Storage' if mode == 'kvikio-gds' else 'compat (POSIX) mode: GDS is not available'}")
            self.io_mode = f"{mode}+{host_mode}"

    def write_host(self, offset: int, buf: memoryview) -> None:
        n = len(buf)
        if offset % ALIGNMENT or n % ALIGNMENT:
            raise ValueError(f"unaligned extent at {offset}+{n}")
        if self._direct and not _is_aligned(buf):
            if self._bounce is None or self._bounce.size < n:
                if self._bounce is not None:
                    self._bounce.close()
                self._bounce = AlignedBuffer(max(n, 8 << 20))
            self._bounce.view[:n] = buf
            buf = self._bounce.view[:n]
        self._pwrite_all(buf, offset)
        self._end = max(self._end, offset + n)

    def write_host_async(self, offset: int, buf: memoryview, on_done: Any = None) -> None:
        """Write a page-aligned host extent at `offset` in IO_TASK pieces on IO_THREADS threads
        (large O_DIRECT requests in parallel reach more of the disk than one thread); then call
        `on_done()`, whether or not it failed. Failures are raised by wait() and close()."""
        n = len(buf)
        if offset % ALIGNMENT or n % ALIGNMENT:
            raise ValueError(f"unaligned extent at {offset}+{n}")
        if self._direct and not _is_aligned(buf):
            self.write_host(offset, buf)
            if on_done is not None:
                on_done()
            return
        self._host.submit(offset, buf, on_done)
        self._end = max(self._end, offset + n)

    def _pwrite_all(self, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            try:
                done += os.pwrite(self._fd, buf[done:], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self._direct and self._direct_policy == "auto":
                    # The filesystem accepted O_DIRECT at open but refuses this write: go buffered.
                    with self._reopen:
                        if self._direct:
                            log.info("tiered: %s: O_DIRECT write refused, falling back to buffered I/O", self.path)
                            fd = os.open(fd_path(self._fd, self.path), os.O_WRONLY, 0o644)
                            old, self._fd, self._direct = self._fd, fd, False
                            os.close(old)
                            self.io_mode = self.io_mode.replace("posix-odirect", "posix-buffered")
                    continue
                raise TieredError(f"{self.path}: write of {len(buf)} bytes at offset {offset} failed: "
                                  f"{exc.strerror}") from None

    def write_device(self, offset: int, buf: torch.Tensor) -> Any:
        """Start writing a GPU buffer at `offset`; returns the KvikIO future (close() collects it)."""
        if self._cufile is None:
            raise TieredError("write_device on a writer opened without device support")
        future = self._cufile.pwrite(buf, size=buf.numel(), file_offset=offset, task_size=IO_TASK)
        self._futures.append(future)
        self._end = max(self._end, offset + buf.numel())
        return future

    def wait(self) -> None:
        futures, self._futures = self._futures, []
        try:
            wait_futures(futures)
        finally:
            self._host.wait()  # (all of them finish before any failure is raised)

    def wait_for(self, future: Any) -> None:
        """Wait until one write is done (its result is collected by wait() or close(); a future
        they have already collected is done)."""
        if any(f is future for f in self._futures):
            wait_done(future)

    def close(self) -> int:
        """Wait, fsync, close. Returns the file size."""
        try:
            self.wait()
            if self._cufile is not None:
                self._cufile.close()
                self._cufile = None
            os.fsync(self._fd)
        except OSError as exc:
            raise TieredError(f"{self.path}: fsync failed: {exc.strerror}") from None
        finally:
            self._release()
        return self._end

    def abort(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - already failing; the step stays uncommitted
            pass
        self._release()

    def _release(self) -> None:
        self._host.close()
        if self._cufile is not None:
            self._cufile.close()
            self._cufile = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._bounce is not None:
            self._bounce.close()
            self._bounce = None


def wait_done(future: Any) -> None:
    """Wait until a KvikIO future is done, without taking its result (get() belongs to whoever
    collects it) and without holding the GIL in a native wait (see wait_futures)."""
    delay = 1e-4
    while not future.done():
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)


def drain_quietly(futures: list[Any]) -> None:
    """On a failure path: wait until none of `futures` is still running, ignoring their errors
    (and futures whose result was already taken, which KvikIO then reports as invalid)."""
    for f in futures:
        try:
            wait_done(f)
        except Exception:  # noqa: BLE001 - already failing; this only makes sure the I/O has stopped
            pass


def wait_futures(futures: list[Any]) -> None:
    """Wait for KvikIO futures without holding the GIL in a native wait.

    A blocking `IOFuture.get()` may keep the GIL for the whole write; the training thread would
    then stall behind the background writer. Polling `done()` leaves the GIL to other threads.
    """
    for f in futures:
        wait_done(f)
        f.get()


def _is_aligned(buf: memoryview) -> bool:
    import ctypes

    if buf.readonly:
        return False
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return addr % ALIGNMENT == 0


DIRECT_READ_MIN = 1 << 20
"""Host reads of at least this many bytes, page-aligned in offset and memory, use O_DIRECT (where
the tier's `direct_io` allows it): a migration or restore reads windows of up to 64 MiB into
page-aligned buffers. Through the page cache such a read costs a kernel copy of every byte (on
the 2-core CPU machine, ~31% of the client's CPU in a 275 MB upload to S3, which that machine's
two cores bound) and fills the cache with checkpoint data that will not be read again, evicting
what training reads (its data set). Smaller or unaligned reads (single chunks, indexes) stay
buffered."""


class LocalDataReader:
    """Reads one rank's data file: host ranges with POSIX reads (large aligned ones O_DIRECT,
    `DIRECT_READ_MIN`), device ranges with KvikIO."""

    parallel_reads = 2
    """Windows a migration or restore reads at once from this file (`tiered.stage.cpu.chunk_windows`).
    One O_DIRECT read of a window already keeps the disk's queue full; windows read at once
    share the disk and land together, so the one needed first waits for all of them: with 8 at
    once, a 2,000-tensor step's first window (3 MiB) landed with the 120 MiB read beside it,
    34-64 ms after it was asked for, while the copy's pool waited (2-core CPU machine, session
    37; docs/benchmarks.md). Two: the next window, and one read ahead. A shared filesystem's
    reader reads more at once (`tiered.tiers.posix`)."""

    def __init__(self, fd: int, path: Path, device: bool, direct_io: str = "auto"):
        """`fd`: the data file, opened read-only and checked (`tiered.tiers.files.open_regular`);
        the reader owns it from here."""
        self.path = str(path)
        self._fd = fd
        self.size = os.fstat(self._fd).st_size
        self._direct_policy = direct_io if _O_DIRECT else "off"
        self._direct_fd = -1
        """A second descriptor, opened with O_DIRECT on the first read that can use it."""
        self._direct_lock = threading.Lock()
        self._cufile: Any = None
        self.io_mode = "posix"
        if device:
            import kvikio

            self._cufile = kvikio.CuFile(fd_path(self._fd, path), "r")
            self.io_mode = kvikio_mode()

    def _check(self, offset: int, size: int) -> None:
        if offset + size > self.size:
            raise TieredError(f"{self.path}: file is truncated: needs bytes {offset}..{offset + size}, "
                              f"has {self.size}")

    def read_host(self, offset: int, size: int) -> memoryview:
        view = memoryview(bytearray(size))
        self.read_into(offset, view)
        return view

    def prefetch(self, offset: int, out: memoryview) -> bool:
        """Declined: a file's reads start at once (see the DataReader protocol)."""
        return False

    def read_into(self, offset: int, out: memoryview) -> None:
        size = len(out)
        self._check(offset, size)
        done = 0
        try:
            if size >= DIRECT_READ_MIN and not offset % ALIGNMENT and self._direct_policy != "off" and \
                    _is_aligned(out):
                done = self._read_direct(offset, out)
            while done < size:  # buffered: the whole range, or what O_DIRECT left (an unaligned tail)
                n = os.preadv(self._fd, [out[done:]], offset + done)
                if n == 0:
                    raise TieredError(f"{self.path}: unexpected end of file at {offset + done}")
                done += n
        except OSError as exc:  # (EIO from a failing disk: the reader falls back to another tier)
            raise TieredError(f"{self.path}: read of {size} bytes at offset {offset} failed: {exc.strerror}") from None

    def _read_direct(self, offset: int, out: memoryview) -> int:
        """Read the whole pages of `out` (page-aligned, at a page-aligned `offset`) with O_DIRECT;
        returns the bytes read, which the caller completes with buffered reads. 0 where the
        filesystem refuses O_DIRECT (`direct_io: auto`: reads stay buffered from then on)."""
        fd = self._direct_descriptor()
        if fd < 0:
            return 0
        whole = len(out) - len(out) % ALIGNMENT
        done = 0
        while done < whole:
            try:
                n = os.preadv(fd, [out[done:whole]], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                if self._direct_policy == "on":
                    raise TieredError(f"{self.path}: O_DIRECT read refused ({exc.strerror}); "
                                      "set direct_io: auto or off for this tier") from None
                self._direct_policy = "off"
                _log_mode_once("direct-read-refused", f"{self.path}: O_DIRECT read refused, reading through the "
                                                      "page cache")
                break
            done += n
            if n % ALIGNMENT or not n:  # the end of the file (or a short read): the rest buffered
                break
        return done

    def _direct_descriptor(self) -> int:
        with self._direct_lock:
            if self._direct_fd < 0:
                self._direct_fd = _open_direct(fd_path(self._fd, Path(self.path)), os.O_RDONLY, self._direct_policy)
                if self._direct_fd < 0:
                    self._direct_policy = "off"
            return self._direct_fd

    def read_device_async(self, offset: int, size: int, out: torch.Tensor) -> Any:
        self._check(offset, size)
        return self._cufile.pread(out, size=size, file_offset=offset, task_size=IO_TASK)

    def read_device(self, offset: int, size: int, out: torch.Tensor) -> None:
        self.read_device_async(offset, size, out).get()

    def close(self) -> None:
        if self._cufile is not None:
            self._cufile.close()
            self._cufile = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1
