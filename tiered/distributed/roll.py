"""Collectives that fail with names: which ranks did not answer, and what they were doing.

Each rank keeps one key in the job's store (torchrun's c10d store), ``tiered/rank/<rank>``: the
number of the last collective of a save, commit or restore it reached (every rank makes them in
the same order) and what it is doing now. A collective that fails (a peer's process gone: gloo's
"Connection closed by peer"; the group's timeout) is raised again as a `CollectiveError` naming
the ranks that never reached it and what each last said it was doing; the waits of the commit
(`tiered.distributed.commit.wait_for_keys`) name them the same way. One small write per
collective and per phase of a rank: the store is read only when something fails.

    doing("the restore of step 20: reading its part")
    collective("the restore of step 20: agreeing on its outcome", lambda: dist.all_gather_object(...))
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Iterable, TypeVar

from tiered.errors import CollectiveError

log = logging.getLogger("tiered")
T = TypeVar("T")
_reached = -1
"""The number of the last collective this process reached."""
_lock = threading.Lock()


def store() -> Any:
    """The key-value store of the default process group (torchrun's rendezvous store)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _post(n: int, what: str) -> None:
    store().set(f"tiered/rank/{_rank()[0]}", json.dumps({"n": n, "doing": what}))


def _read(rank: int) -> dict | None:
    s, key = store(), f"tiered/rank/{rank}"
    return json.loads(s.get(key)) if s.check([key]) else None


def doing(what: str, n: int | None = None) -> None:
    """Post what this rank is doing now (read by the other ranks only when something fails)."""
    try:
        _post(_reached if n is None else n, what)
    except Exception as exc:  # noqa: BLE001 - a note for a failure's message, never a failure of its own
        log.debug("tiered: cannot post what this rank is doing: %s", exc)


def last_doing(ranks: Iterable[int]) -> str:
    """``rank 1 (last seen: the restore of step 20: reading its part)``, for each of `ranks`."""
    out = []
    for r in ranks:
        try:
            posted = _read(r)
            seen = posted["doing"] if posted else "nothing posted"
        except Exception:  # noqa: BLE001 - the store itself may be gone with the job
            seen = "unknown: the store does not answer"
        out.append(f"rank {r} (last seen: {seen})")
    return ", ".join(out)


def collective(what: str, fn: Callable[[], T]) -> T:
    """Run the collective `fn`, which every rank calls in the same order; on failure, raise a
    `CollectiveError` naming the ranks that did not reach it and what they were doing."""
    global _reached
    rank, world = _rank()
    with _lock:
        n = _reached = _reached + 1
    doing(what, n)
    try:
        return fn()
    except Exception as exc:
        try:
            missing = [r for r in range(world) if r != rank and ((_read(r) or {"n": -1})["n"] < n)]
        except Exception:  # noqa: BLE001 - the store is gone too: say what is known
            missing = []
        who = (f"{last_doing(missing)} did not reach it" if missing else
               "every rank reached it; one of them stopped or timed out inside it")
        raise CollectiveError(f"{what}: failed on rank {rank} ({type(exc).__name__}: {exc}); {who}") from exc
