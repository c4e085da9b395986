"""Opening a step's files on a filesystem tier as a hostile directory may hold them.

Only regular files inside the step's own directory are opened: neither the step directory nor the
file may be a symbolic link (`O_NOFOLLOW` at both levels, the file opened relative to the directory
it was checked in), and a FIFO, a socket or a device is refused after `fstat` (opened with
`O_NONBLOCK`, so that a FIFO without a writer cannot hang the open). Every refusal is a
`FormatError`: a reader falls back to the next tier, and `tiered verify` reports the step damaged.
Small files (manifests, indexes) are read up to the size the format allows and no further, whatever
the file claims.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from tiered.errors import CheckpointNotFoundError, FormatError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_step_dir(path: Path, missing: str | None = None) -> int:
    """A descriptor of the step directory `path`, refused where it is a link or not a directory;
    CheckpointNotFoundError(`missing`, or a message naming it) where it is absent."""
    try:
        return os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFoundError(missing or f"{path}: step directory is missing") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise FormatError(f"{path}: not a directory of this tier (a symbolic link or another kind of "
                              "file): refused") from None
        raise FormatError(f"{path}: cannot open: {exc.strerror}") from None


def open_regular(step_dir: Path, name: str, missing: str | None = None) -> int:
    """A read-only descriptor of the regular file `name` inside `step_dir`; FormatError where it
    (or the directory) is a link or not a regular file; CheckpointNotFoundError(`missing`, or a
    message naming the file) where it is absent."""
    path = step_dir / name
    dfd = open_step_dir(step_dir, missing)
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        raise CheckpointNotFoundError(missing or f"{path}: file is missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FormatError(f"{path}: a symbolic link: refused (a step's files are regular files)") from None
        raise FormatError(f"{path}: cannot open: {exc.strerror}") from None
    finally:
        os.close(dfd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FormatError(f"{path}: not a regular file ({_kind(mode)}): refused")
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(step_dir: Path, name: str, max_bytes: int, missing: str | None = None) -> bytes:
    """A small file's bytes, at most `max_bytes`: FormatError where it holds more (the read stops
    there, whatever its size claims)."""
    fd = open_regular(step_dir, name, missing)
    try:
        chunks, got = [], 0
        while True:
            piece = os.read(fd, min(max_bytes + 1 - got, 16 << 20))
            if not piece:
                break
            chunks.append(piece)
            got += len(piece)
            if got > max_bytes:
                raise FormatError(f"{step_dir / name}: larger than the {max_bytes} bytes allowed")
        return b"".join(chunks)
    except OSError as exc:
        raise FormatError(f"{step_dir / name}: cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)


def fd_path(fd: int, fallback: Path) -> str:
    """A path that opens the very file behind `fd` (for libraries that open by path: KvikIO, an
    O_DIRECT descriptor): /proc/self/fd/N where there is one, else `fallback`."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(fallback)


def is_regular(path: Path) -> bool:
    """`path` is a regular file, not through a link."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_real_dir(path: Path) -> bool:
    """`path` is a directory, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"
