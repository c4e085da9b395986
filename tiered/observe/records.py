"""What happened: one JSON line per save and per migration hop, next to the checkpoints.

Each process appends to its own file, ``<fast tier path>/.tiered-records/<host>-<pid>.jsonl``
(the engine, a migrator process, `tiered migrate`), so writers never share a file; a line is
written with one ``write`` call, and a reader skips a line torn by a crash. Reading merges every
file, oldest first. `tiered stats`, `tiered report` and `tiered cost` read these records, and
`Engine.stats()` returns them.

Save record (``"kind": "save"``): ``step``, ``time`` (UTC, when it was durable), ``tier``,
``ranks``, ``stall_s`` (what ``save()`` blocked), ``staged_s`` and ``durable_s`` (from the call),
``raw_bytes``, ``stored_bytes``, ``codecs``, ``io``.

Migration record (``"kind": "migrate"``): ``step``, ``time`` (when it was committed there), ``src``,
``dst``, ``seconds``, ``raw_bytes``, ``stored_bytes``, ``codecs``, ``committed`` (when the step was
committed on the fast tier: ``time`` minus it is the migration lag).

A record that cannot be written is logged once and dropped: records never fail a save.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("tiered")

RECORDS_DIR = ".tiered-records"
VERSION = 1
_lock = threading.Lock()  # one write at a time in this process: the engine's and its migrator's records
_warned: set[Path] = set()
_listeners: list[Callable[[dict[str, Any]], None]] = []


def subscribe(listener: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Call `listener(record)` with every record this process writes from now on (its saves, and
    its migrations where it migrates itself: ``migration: in_process``); returns the function
    that unsubscribes it. It runs on the engine's threads: keep it short (hand the record to a
    queue, or to a logger that is thread-safe). An exception it raises is logged and ignored.

        tiered.observe.records.subscribe(lambda r: wandb.log({"ckpt/stall_s": r["stall_s"]}) if r["kind"] == "save" else None)
    """
    with _lock:
        _listeners.append(listener)

    def unsubscribe() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)
    return unsubscribe


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def records_root(config: Any) -> Path | None:
    """Where `config`'s records live: under its fast tier's path (None for a tier without one)."""
    path = getattr(config.fast_tier, "path", None)
    return None if path is None else Path(path) / RECORDS_DIR


class RecordLog:
    """This process's record file under `root` (None: records are off)."""

    def __init__(self, root: Path | None):
        self.root = root
        self.path = None if root is None else root / f"{socket.gethostname()}-{os.getpid()}.jsonl"
        self._lock = _lock

    def append(self, record: dict[str, Any]) -> None:
        with _lock:
            listeners = list(_listeners)
        for listener in listeners:
            try:
                listener(dict(record))
            except Exception:  # noqa: BLE001 - a logger's failure never fails a save
                log.exception("tiered: a records listener failed")
        if self.path is None:
            return
        line = (json.dumps({"v": VERSION, **record}, separators=(",", ":"), allow_nan=False) + "\n").encode()
        try:
            with self._lock:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
        except (OSError, ValueError) as exc:
            if self.path not in _warned:  # once per file and process: migrations make a log per step
                _warned.add(self.path)
                log.warning("tiered: cannot write the save and migration records to %s (%s): they are dropped",
                            self.path, exc)


def read_records(root: Path | None) -> list[dict[str, Any]]:
    """Every record under `root`, oldest first (lines that do not parse, such as one a crash cut
    short, are skipped)."""
    if root is None or not root.is_dir():
        return []
    out = []
    for path in sorted(root.glob("*.jsonl")):
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            log.warning("tiered: cannot read records %s: %s", path, exc)
            continue
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("kind") in KINDS and isinstance(rec.get("time"), str):
                rec["source"] = path.name
                out.append(rec)
    out.sort(key=lambda r: r["time"])
    return out


KINDS = ("save", "migrate", "save_failed")


def failure_record(step: int, tier: str, error: BaseException) -> dict[str, Any]:
    """A save that failed in the background and was not committed."""
    return {"kind": "save_failed", "step": step, "time": now(), "tier": tier, "error": str(error)[:2000]}


def save_record(manifest: Any, tier: str, handle: Any, durable_s: float, codecs: list[str], io: str) -> dict[str, Any]:
    staged_ms = handle.timings.get("staged_ms")
    return {"kind": "save", "step": manifest.step, "time": now(), "tier": tier, "ranks": manifest.world_size,
            "stall_s": round(handle.stall_s, 6), "staged_s": None if staged_ms is None else round(staged_ms / 1e3, 6),
            "durable_s": round(durable_s, 6), "raw_bytes": manifest.raw_bytes, "stored_bytes": manifest.stored_bytes,
            "codecs": codecs, "io": io}


def migrate_record(manifest: Any, src: str, dst: str, seconds: float, codecs: list[str]) -> dict[str, Any]:
    return {"kind": "migrate", "step": manifest.step, "time": now(), "src": src, "dst": dst,
            "seconds": round(seconds, 6), "raw_bytes": manifest.raw_bytes, "stored_bytes": manifest.stored_bytes,
            "codecs": codecs, "committed": manifest.created}
