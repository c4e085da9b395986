"""The scale bench's `migration` row: training beside the
engine's migrator while a step of the scale state moves down to a shared tier, against the same
training with the migrator idle.

The engine is the default config with a second tier below the local one: a POSIX directory on
the same disk, `codec: zstd` (the portable tier: ANS is decoded on the GPU, zstd encoded on the
CPU), `migration: process` (the default) or the mode the row names (`migration:in_process`).
Every optimizer is guarded, as in `tiered_overlap`. One pass, three saves:

1. save 1 (the first save; the migrator idle); the windows until it is durable are not counted
   (its own drain runs there); then every window until it is on the shared tier: **migrating**;
2. as many windows with nothing to migrate: **idle** (at least 3, at most `IDLE_MAX`);
3. save 2 with the migrator idle: its stall against the idle windows' median;
4. once step 2 is durable and `BUSY_BEFORE_SAVE` windows of its migration have run, save 3: its
   stall against the median of the migrating windows so far (the save's own cost while a step
   migrates) and against the idle median (all training lost in that window);
5. windows until steps 2 and 3 are on the shared tier (migrating again, but for those before
   step 3 is durable).

A window that a step's migration starts or ends inside is counted in neither list. The row
reports the window medians, quartiles and counts of both kinds (`migration` in its JSON), the
slowdown, the stalls, each step's seconds from durable to the shared tier as the bench saw it
(looked for between windows), and each step's migration as the migrator timed it (its records).
Steps are deleted from both tiers once migrated, so the local tier holds at most two stored copies
of the state and the shared tier one (and what step 3 writes there before step 2 is deleted); one
disk for both must hold three (24 GB on a 64 GB disk does not: `--shared-dir` puts the shared tier
elsewhere), checked after step 1 with its stored size. Nothing is restored: the migration's own checks
(every chunk verified as it is read) are what this row relies on; the tests restore migrated steps.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import tiered
from scale_measure import Row, Run, done_at, rss, say, tensors_of, world

IDLE_MAX = 12
"""The most idle windows measured (the migrating ones set the count, up to this)."""
BUSY_BEFORE_SAVE = 2
"""Windows of step 2's migration run before save 3 (a save while a step migrates)."""
MODES = ("process", "in_process")


def migration_spec(mode: str) -> str:
    """The row's migration mode from its name's ":" part (empty: the default); ValueError naming it."""
    if mode and mode not in MODES:
        raise ValueError(f"migration:{mode}: expected one of {', '.join(MODES)} (or none: the default, process)")
    return mode or "process"


def _quartiles(ms: list[float]) -> dict | None:
    if not ms:
        return None
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else ms * 3
    return {"median": round(statistics.median(ms), 1), "q1": round(q[0], 1), "q3": round(q[2], 1), "n": len(ms),
            "min": round(min(ms), 1), "max": round(max(ms), 1)}


def run_migration(row: Row, run: Run, base: float) -> None:
    if world() > 1:
        raise RuntimeError("the migration row runs on one rank (one migrator per node)")
    mode = migration_spec(run.load)
    local, shared = run.root / "migration-local", run.shared_root or run.root / "migration-shared"
    codec = {} if run.codec == "auto" else {"codec": run.codec}
    cfg = {"migration": mode, "tiers": [{"name": "local", "kind": "local", "path": str(local), **codec},
                                        {"name": "shared", "kind": "posix", "path": str(shared), "codec": "zstd"}]}
    shutil.rmtree(shared, ignore_errors=True)  # (`--shared-dir` is wiped, as --dir is)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors_of(run.state))
    rss0, t0 = rss(), time.perf_counter()
    engine = tiered.Engine.from_config(cfg)
    try:
        guards = [engine.guard(opt) for opt in run.optimizers]
        engine.reserve(run.state)
        engine.wait_pinned()
        say(f"#   {row.name}: engine with a shared tier (zstd), migration: {mode}, pinned in "
            f"{time.perf_counter() - t0:.1f} s")
        out = _measure(engine, run, state_bytes, mode, (local, shared))
        row.host_taken = rss() - rss0
        for g in guards:
            g.remove()
    finally:
        engine.close()
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)
    # The row's saves, for the table: the first, then the save with the migrator idle (its "warm"
    # figure); the save made while a step migrates is in `migration` and its own line.
    for s in out.pop("saves"):
        row.saves.append(s)
    row.stored = out["stored_bytes_shared"]
    row.extra["migration"] = out
    say(f"#   {describe(row.name, out)}")


def describe(name: str, m: dict) -> str:
    """One line of a migration row's figures (`m`: its "migration"), as the run and the tables say it."""
    busy, idle = m["window_ms"]["migrating"], m["window_ms"]["idle"]
    return (f"{name} ({m['mode']}): windows of {m['window_steps']} steps while a step migrates "
            f"{busy and busy['median']} ms (quartiles {busy and busy['q1']}–{busy and busy['q3']}, "
            f"n={busy and busy['n']}), idle {idle and idle['median']} ms (quartiles {idle and idle['q1']}–"
            f"{idle and idle['q3']}, n={idle and idle['n']}): slowdown {m['slowdown_pct']}%; save stall "
            f"idle {m['stall_ms']['idle']} ms, while a step migrates {m['stall_ms']['migrating']} ms "
            f"({m['stall_ms']['migrating_vs_idle']} against the idle windows); durable to shared "
            f"{', '.join(str(s) for s in m['to_shared_s'])} s ({m['to_shared_gbps']} GB/s of state, "
            f"stored as {', '.join(m['shared_codecs'])}); the migrator's own time per step "
            f"{m.get('migrate_s')} s (at best {m.get('migrate_gbps')} GB/s of state)")


def check_room(local: Path, shared: Path, stored: int) -> None:
    """Raise, naming `--shared-dir`, where the disks cannot hold what the rest of the row keeps at
    once: steps 2 and 3 on the local tier and step 2 on the shared one (`stored` bytes each, step 1's;
    a tenth more for what step 3 writes to the shared tier before step 2 is deleted there)."""
    need = {local: 2.0 * stored, shared: 1.1 * stored}
    if os.stat(local).st_dev == os.stat(shared).st_dev:
        need = {local: 3.1 * stored}
    for path, nbytes in need.items():
        free = shutil.disk_usage(path).free
        if free < nbytes:
            raise RuntimeError(
                f"the migration row needs {nbytes / 1e9:.1f} GB free at {path} for the rest of its steps "
                f"({stored / 1e9:.2f} GB each, as stored), {free / 1e9:.1f} GB is: give the shared tier "
                f"another disk (--shared-dir) or run a smaller --scale")


def _measure(engine: Any, run: Run, state_bytes: int, mode: str, roots: tuple[Path, Path]) -> dict:
    window = run.window
    windows: dict[str, list[float]] = {"migrating": [], "idle": []}
    durable_at: dict[int, float] = {}
    shared_at: dict[int, float] = {}
    handles: dict[int, Any] = {}
    saves: list[dict] = []
    dropped: set[int] = set()

    def on_shared(step: int) -> bool:
        if step not in shared_at and step in engine.steps("shared"):
            shared_at[step] = time.perf_counter()
        return step in shared_at

    def durable(step: int) -> bool:
        h, box = handles[step]
        if step not in durable_at and h.done() and box:
            h.wait()  # (raises the save's failure)
            durable_at[step] = box[0]  # (when it completed, not when it was looked at)
        return step in durable_at

    def migrating(steps: list[int]) -> bool:
        """Some step of `steps` is durable and not yet on the shared tier, and none still drains."""
        return all(durable(s) for s in steps) and not all(on_shared(s) for s in steps)

    def timed_window(steps: list[int], kind: str | None) -> None:
        """One window; counted as `kind` if the state of `steps` was the same before and after it."""
        before = migrating(steps) if kind == "migrating" else True
        secs = window.run()[0]
        if (kind == "migrating" and before and migrating(steps)) or kind == "idle":
            windows[kind].append(1e3 * secs)
            # (each as it comes: a row cut off by a time limit still shows what it measured)
            say(f"#   window {len(windows[kind])} {kind} (steps {steps or '-'}): {1e3 * secs:.1f} ms")

    def save(step: int, against: float, moving: int | None = None) -> dict:
        """A save in a window: its stall against `against` (ms), its call, its time to durable;
        with `moving`, whether that step was still migrating when the save's window ended."""
        t_call = time.perf_counter()

        def call_save() -> Any:
            h = engine.save(step, run.state)
            handles[step] = h, done_at(h.persisted)  # (at once: the time it completes, even within the window)
            return h

        secs, call, _ = window.run(call_save)
        rec = {"stall_ms": round(1e3 * secs - against, 1), "call_ms": round(1e3 * call, 1), "base_ms": round(against, 1)}
        if moving is not None:
            rec["migrating_through_window"] = not on_shared(moving)
        while not durable(step):
            window.run()  # (its own drain: not counted)
        rec["durable_s"] = round(durable_at[step] - t_call, 2)
        return rec

    def failed() -> None:
        """Raise a migration failure the engine has seen (no save may be in flight: waits for those)."""
        try:
            engine.wait_migrated(timeout=0)
        except TimeoutError:
            pass  # (still migrating)

    def drop(step: int) -> None:
        """Delete a migrated step from both tiers, once."""
        if step not in dropped:
            dropped.add(step)
            engine.get_tier("shared").delete(step)
            if step in engine.steps("local"):
                engine.get_tier("local").delete(step)

    base_ms = 1e3 * window.baseline()
    saves.append(save(1, base_ms))
    while not on_shared(1):
        failed()
        timed_window([1], "migrating")
    stored_1 = engine.read_index(1, tier="local")[0].stored_bytes
    drop(1)
    check_room(*roots, stored_1)
    for _ in range(min(IDLE_MAX, max(3, len(windows["migrating"])))):
        timed_window([], "idle")
    idle_ms = statistics.median(windows["idle"])
    saves.append(save(2, idle_ms))
    for _ in range(BUSY_BEFORE_SAVE):
        if on_shared(2):
            break
        timed_window([2], "migrating")
    busy_now = statistics.median(windows["migrating"]) if windows["migrating"] else idle_ms
    while_migrating = save(3, busy_now, moving=2)
    while not (on_shared(2) and on_shared(3)):
        failed()
        timed_window([2, 3], "migrating")
        if on_shared(2):
            drop(2)  # (at once: its copies and step 3's would not fit a 24 GB state's disk otherwise)
    # Each step's migration as the migrator timed it (its records: tiered.observe.records), from its start
    hops = {r["step"]: r for r in engine.stats() if r.get("kind") == "migrate" and r.get("dst") == "shared"}
    migrate_s = {s: round(hops[s]["seconds"], 2) for s in (1, 2, 3) if s in hops}
    manifest, index = engine.read_index(3, tier="shared")
    stored_shared = manifest.stored_bytes
    codecs = sorted({t.codec.name for t in index.tensors if t.chunks})
    drop(2)
    drop(3)
    busy = _quartiles(windows["migrating"])
    idle = _quartiles(windows["idle"])
    to_shared = [round(shared_at[s] - durable_at[s], 2) for s in (1, 2)]  # (3 queued behind 2)
    return {
        "mode": mode, "window_steps": window.steps,
        "window_ms": {"migrating": busy, "idle": idle},
        "windows_ms": {k: [round(v, 1) for v in vs] for k, vs in windows.items()},
        "slowdown_pct": round(100 * (busy["median"] / idle["median"] - 1), 1) if busy and idle else None,
        "stall_ms": {"first": saves[0]["stall_ms"], "idle": saves[1]["stall_ms"],
                     "migrating": while_migrating["stall_ms"],
                     "migrating_vs_idle": round(while_migrating["stall_ms"] + busy_now - idle_ms, 1),
                     "migrating_through_window": while_migrating["migrating_through_window"]},
        "save_while_migrating": while_migrating,
        # (seconds from durable until the step was seen on the shared tier, looked for between
        # windows: up to a window late; step 2's with step 3's save beside it)
        "to_shared_s": to_shared,
        "migrate_s": migrate_s,  # (the migrator's own time for each step, from the start of its copy)
        "migrate_gbps": round(state_bytes / 1e9 / min(migrate_s.values()), 3) if migrate_s else None, "to_shared_gbps": round(state_bytes / 1e9 / statistics.median(to_shared), 3)
        if statistics.median(to_shared) > 0 else None,
        "stored_bytes_shared": stored_shared, "shared_codecs": codecs, "shared_root": str(roots[1]), "saves": saves,
    }
