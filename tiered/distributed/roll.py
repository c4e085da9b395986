"""Collectives that fail with names: which ranks did not answer, and what they were doing.

Before each collective of a distributed save, commit or restore, every rank posts to the job's
store (torchrun's c10d store) that it reached it, ``tiered/roll/<n>/<rank>`` (n counts this
process's collectives, which every rank makes in the same order), and as it works, what it is
doing, ``tiered/doing/<rank>``. A collective that fails (a peer's process gone: gloo's
"Connection closed by peer"; the group's timeout) is raised again as a `CollectiveError` naming
the ranks that never reached it and what each last said it was doing. The waits of the commit
(`tiered.distributed.commit.wait_for_keys`) name them the same way.

    doing("restore of step 20: reading its part")
    said = collective("restore of step 20: agreeing on the outcome", lambda: dist.all_gather_object(...))
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Callable, Iterable, TypeVar

from tiered.errors import CollectiveError

log = logging.getLogger("tiered")
T = TypeVar("T")
_count = itertools.count()
_lock = threading.Lock()


def store() -> Any:
    """The key-value store of the default process group (torchrun's rendezvous store)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def doing(what: str) -> None:
    """Post what this rank is doing now (read by the other ranks only when something fails)."""
    try:
        store().set(f"tiered/doing/{_rank()[0]}", what)
    except Exception as exc:  # noqa: BLE001 - a note for a failure's message, never a failure of its own
        log.debug("tiered: cannot post what this rank is doing: %s", exc)


def last_doing(ranks: Iterable[int]) -> str:
    """``rank 1 (last seen: restore of step 20: reading its part)``, for each of `ranks`."""
    s, out = store(), []
    for r in ranks:
        key = f"tiered/doing/{r}"
        try:
            seen = s.get(key).decode(errors="replace") if s.check([key]) else "nothing posted"
        except Exception:  # noqa: BLE001 - the store itself may be gone with the job
            seen = "unknown: the store does not answer"
        out.append(f"rank {r} (last seen: {seen})")
    return ", ".join(out)


def collective(what: str, fn: Callable[[], T]) -> T:
    """Run the collective `fn`, which every rank calls in the same order; on failure, raise a
    `CollectiveError` naming the ranks that did not reach it and what they were doing."""
    rank, world = _rank()
    with _lock:
        n = next(_count)
    s = store()
    s.set(f"tiered/roll/{n}/{rank}", what)
    if n:
        try:
            s.delete_key(f"tiered/roll/{n - 1}/{rank}")  # (the store keeps one key a rank)
        except Exception:  # noqa: BLE001 - a key left over costs a few bytes
            pass
    doing(what)
    try:
        return fn()
    except Exception as exc:
        try:
            missing = [r for r in range(world) if r != rank and not s.check([f"tiered/roll/{n}/{r}"])]
        except Exception:  # noqa: BLE001 - the store is gone too: say what is known
            missing = []
        who = (f"rank(s) {last_doing(missing)} did not reach it" if missing else
               "every rank reached it; one of them stopped or timed out inside it")
        raise CollectiveError(f"{what}: failed on rank {rank} ({type(exc).__name__}: {exc}); {who}") from exc
