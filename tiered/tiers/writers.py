"""Who writes or holds a step: writer ids, and whether the process behind one still runs.

A writer id is ``<host>__<pid>__<nonce>``. The host part is the host name and the process's PID
namespace (containers on one host share a host name, and each may have its own PID 1), so that a
process of this host and namespace can be asked whether it still runs (`os.kill(pid, 0)`). A
writer of another host (a node beside this one on a shared filesystem) cannot be asked; it counts
as alive for `FOREIGN_TTL_S` after its files last changed. Lease files (`tiered.tiers.leases`) and
the work directories of uncommitted steps (`tiered.tiers.local`, `tiered.tiers.s3`) are named by it.
"""

from __future__ import annotations

import os
import socket
import time
import uuid


def _host() -> str:
    try:
        ns = f"-{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        ns = ""
    return (socket.gethostname() + ns).replace("__", "_")


HOST = _host()
FOREIGN_TTL_S = 6 * 3600
"""How long a lease or an uncommitted step of another host counts as live after it last changed."""


_abandoned: set[str] = set()


def abandon(writer_id: str) -> None:
    """This process gave up writer `writer_id` (its save or copy failed): what it left is debris
    now, though the process still runs."""
    _abandoned.add(writer_id)


def new_writer_id() -> str:
    """A fresh id of a writer in this process."""
    return f"{HOST}__{os.getpid()}__{uuid.uuid4().hex[:12]}"


def parse_writer_id(text: str) -> tuple[str, int] | None:
    """(host, pid) of a writer id; None where `text` is not one."""
    parts = text.split("__")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2]:
        return None
    return parts[0], int(parts[1])


def alive(pid: int) -> bool:
    """Whether a process of this host and PID namespace runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def writer_live(writer_id: str, changed: float, now: float | None = None) -> bool:
    """Whether the writer `writer_id` may still be at work: its process runs (this host), or its
    files changed (`changed`, a time.time()) less than FOREIGN_TTL_S ago (another host, or an
    id that is not one)."""
    if writer_id in _abandoned:
        return False
    parsed = parse_writer_id(writer_id)
    if parsed is not None and parsed[0] == HOST:
        return alive(parsed[1])
    return (now if now is not None else time.time()) - changed < FOREIGN_TTL_S
