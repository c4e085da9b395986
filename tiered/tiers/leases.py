"""Steps in use: a restore reading a step, a migration copying it. Retention never deletes them.

Within a process, a registry of (tier location, step). Across processes (the migrator's child
process applying retention while the training process restores; `tiered gc` beside a running
job), a lease file per use on filesystem tiers, under ``<root>/.tiered-leases/``, named
``<step>__<writer id>`` (`tiered.tiers.writers`). A lease of this host whose process has exited is
stale and is removed when found; one of another host counts for `FOREIGN_TTL_S` after it was
written (a process there cannot be asked whether it still runs). An S3 tier has the in-process
registry only.

    with hold(order, step):          # every tier the read may touch
        ...read the step...
    held_steps(tier)                 # what retention must leave alone
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Sequence

from tiered.tiers.writers import FOREIGN_TTL_S, HOST, alive, new_writer_id, parse_writer_id

log = logging.getLogger("tiered")
LEASE_DIR = ".tiered-leases"
__all__ = ["FOREIGN_TTL_S", "LEASE_DIR", "hold", "held_steps", "location"]

_lock = threading.Lock()
_held: Counter = Counter()


def location(tier: Any) -> str:
    """Where a tier keeps its steps: its root directory, or its bucket and prefix."""
    root = getattr(tier, "root", None)
    if isinstance(root, Path):
        return str(root.absolute())
    return str(root) if root is not None else f"s3://{tier.bucket}/{tier.prefix}"


@contextlib.contextmanager
def hold(tiers: Sequence[Any], step: int) -> Iterator[None]:
    """Keep `step` from retention on each of `tiers` while the block runs."""
    keys = [(location(t), step) for t in tiers]
    with _lock:
        _held.update(keys)
    files = [f for f in (_write_lease(t, step) for t in tiers) if f is not None]
    try:
        yield
    finally:
        for f in files:
            with contextlib.suppress(OSError):
                f.unlink()
        with _lock:
            _held.subtract(keys)
            for k in keys:
                if _held[k] <= 0:
                    del _held[k]


def held_steps(tier: Any) -> set[int]:
    """The steps of `tier` that a restore or a migration holds now, in this process or, on a
    filesystem tier, in any live process."""
    where = location(tier)
    with _lock:
        out = {step for (loc, step), n in _held.items() if loc == where and n > 0}
    root = getattr(tier, "root", None)
    if not isinstance(root, Path):  # (S3: this process's registry only)
        return out
    folder = root / LEASE_DIR
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return out
    now = time.time()
    for entry in entries:
        step_text, _, writer = entry.name.partition("__")
        parsed = parse_writer_id(writer)
        if not step_text.isdigit() or parsed is None:
            continue
        step, (host, pid) = int(step_text), parsed
        if host == HOST:
            if alive(pid):
                out.add(step)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                log.info("tiered: removed a stale lease on step %d of %s (process %d has exited)", step, where, pid)
        else:
            with contextlib.suppress(OSError):
                if now - entry.stat().st_mtime < FOREIGN_TTL_S:
                    out.add(step)
    return out


def _write_lease(tier: Any, step: int) -> Path | None:
    root = getattr(tier, "root", None)
    if not isinstance(root, Path):  # (an S3 tier's root names its bucket: no directory of this machine)
        return None
    folder = root / LEASE_DIR
    path = folder / f"{step}__{new_writer_id()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=False)
    except OSError as exc:  # a read-only tier: this process's registry still holds the step
        log.debug("tiered: no lease file for step %d on %s: %s", step, root, exc)
        return None
    return path

