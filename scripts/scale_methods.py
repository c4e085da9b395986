"""The scale bench's methods, one row each (scripts/scale.py lists them): tiered strict and
guarded, DCP with a pinned cache and with async staging, torch.save; and two rows that save
nothing, to price one part of a save's work alone beside the loop: `gil_load` (Python on another
thread) and `d2h_load` (copies to pinned host memory by the copy engines); and `migration`
(training while a step migrates to a shared tier, scripts/scale_migration.py)."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Any

import torch

import tiered
from tiered.stage.stage_after import stage_after_seconds
from tiered.units import parse_size
from baselines import dir_bytes
from scale_measure import (Row, Run, barrier, dist_group, done_at, gpu_free, measure, rank, restore_check, rss, say,
                           tensors_of)
from scale_migration import migration_spec, run_migration

def tiered_engine(run: Run) -> Any:
    """The size's tiered engine, made (and its host memory pinned, its saves laid out) the first
    time a tiered row asks."""
    engine = run.shared.get("engine")
    if engine is not None and run.shared.get("config") != (run.codec, run.pack_buffer):  # (its own engine)
        close_shared(run)
        engine = None
    if engine is None:
        rss0, gpu0, t0 = rss(), gpu_free(run.device), time.perf_counter()
        engine = run.shared["engine"] = tiered.Engine.from_config(engine_doc(run, "tiered"))
        t1 = time.perf_counter()
        engine.reserve(run.state)  # the start-up line that keeps pinning and laying out off the first save
        call = time.perf_counter() - t1
        engine.wait_pinned()
        run.shared.update(pin_s=round(time.perf_counter() - t0, 1), pin_rss=rss() - rss0, gpu_free0=gpu0,
                          config=(run.codec, run.pack_buffer), reserve_call_ms=[round(1e3 * call, 1)])
        say(f"#   tiered engine: reserve() returned in {1e3 * call:.1f} ms; host staging memory pinned in "
            f"{run.shared['pin_s']} s")
    return engine


def engine_doc(run: Run, folder: str) -> dict:
    """A tiered row's config: the embedded default's, its tier at `run.root / folder`, and the
    row's codec and pack buffer where its name pins them (`ROW:CODEC`, `ROW/SIZE`)."""
    cfg = tiered.load_config(None)
    doc: dict = {"tiers": [{"name": cfg.fast_tier.name, "kind": "local", "path": str(run.root / folder),
                            **({} if run.codec == "auto" else {"codec": run.codec})}]}
    if run.pack_buffer is not None:
        doc["budgets"] = {"pack_buffer": run.pack_buffer}
    return doc


def close_shared(run: Run) -> None:
    engine = run.shared.pop("engine", None)
    if engine is not None:
        engine.close()
        barrier()
        if rank() == 0:
            shutil.rmtree(run.root / "tiered", ignore_errors=True)


def _tiered_row(row: Row, run: Run, base: float, first_step: int, engine: Any = None) -> None:
    """A tiered row's saves and restore check, on the size's shared engine (reserved, pinned), or on
    `engine` (the plain row's, made for it)."""
    shared = engine is None
    engine = tiered_engine(run) if shared else engine
    handles: dict[int, Any] = {}

    def save(n: int):
        step = first_step + n
        h = engine.save(step, run.state)
        handles[step] = (h, done_at(h.persisted))
        return step

    def durable(step: int) -> float:
        h, box = handles[step]
        h.wait()
        while not box:
            time.sleep(0.001)
        return box[0]

    prints = measure(row, run, base, save, durable,
                     lambda n: rank() == 0 and engine.catalog.fast.delete(first_step + n),
                     gpu_free0=run.shared["gpu_free0"] if shared else None)  # (all the engine holds, from before it was made)
    if shared:
        row.host_taken += run.shared["pin_rss"]  # the pinned pool, made before the windows
        row.extra["pin_s"] = run.shared["pin_s"]
        row.extra["reserve_call_ms"] = run.shared["reserve_call_ms"]
    row.extra["codec"] = engine.fast_codec  # the policy's choice for the warm saves (codec: auto)
    if run.device == "cuda" and engine.gpu_codecs:
        row.extra["slab_bytes"] = engine.workers.device(torch.cuda.current_device()).slab_bytes
        row.extra["wave_bytes"] = engine.config.budgets.pack_buffer
    timings = [h.timings for step, (h, _) in sorted(handles.items())][:run.saves]  # (not a traced save's)
    for rec, t in zip(row.saves, timings):  # when each save's reads began and ended
        rec["timings_ms"] = {k: round(t[k], 1) for k in ("step_after_ms", "stage_after_ms", "staged_ms") if k in t}
    warm = timings[1:]
    row.extra["save_timings_ms"] = {k: round(statistics.median(t.get(k, 0.0) for t in warm), 1)
                                    for k in (warm[0] if warm else {})}
    row.extra["first_save_timings_ms"] = {k: round(v, 1) for k, v in timings[0].items()} if timings else {}
    say(f"#   {row.name} save() phases, warm median ms: {row.extra['save_timings_ms']}")
    say(f"#   {row.name} save() phases, first save ms: {row.extra['first_save_timings_ms']}")
    last = first_step + run.windows
    row.stored = engine.read_index(last)[0].stored_bytes
    restore_check(row, run.state, prints, run.device, run.drop_caches, lambda: engine.restore(run.state, step=last),
                  run.root / "ceiling-restore")
    barrier()
    if rank() == 0:
        engine.catalog.fast.delete(last)


def run_tiered(row: Row, run: Run, base: float) -> None:
    _tiered_row(row, run, base, 0)


def run_plain(row: Row, run: Run, base: float) -> None:
    """The README's first snippet: an engine made from the default config, no `guard`, no
    `reserve`: its first save plans, lays out and pins inside the save (the row's first save),
    and its warm saves are strict ones."""
    close_shared(run)  # (the shared engine's pinned memory goes first)
    engine = tiered.Engine.from_config(engine_doc(run, "tiered-plain"))
    try:
        _tiered_row(row, run, base, 400, engine)
        row.extra["host_pinned_bytes"] = engine.workers.host.pinned_bytes
    finally:
        engine.close()
        barrier()
        if rank() == 0:
            shutil.rmtree(run.root / "tiered-plain", ignore_errors=True)


def run_tiered_overlap(row: Row, run: Run, base: float, defer_walk: bool | None = None) -> None:
    engine = tiered_engine(run)
    guards = [engine.guard(opt, defer_walk=defer_walk, stage_after_ms=run.stage_after_ms) for opt in run.optimizers]
    t0 = time.perf_counter()
    engine.reserve(run.state)  # (again, guarded now, as a loop that guards at set-up and reserves after its first step)
    run.shared["reserve_call_ms"] = run.shared["reserve_call_ms"][:1] + [round(1e3 * (time.perf_counter() - t0), 1)]
    engine.wait_pinned()
    try:
        _tiered_row(row, run, base, {None: 100, True: 200, False: 300}[defer_walk])
    finally:
        for g in guards:
            g.remove()


def run_tiered_overlap_deferred(row: Row, run: Run, base: float) -> None:
    run_tiered_overlap(row, run, base, defer_walk=True)


def run_tiered_overlap_walk(row: Row, run: Run, base: float) -> None:
    run_tiered_overlap(row, run, base, defer_walk=False)


def _dcp_row(row: Row, run: Run, base: float, stager: Any) -> None:
    import torch.distributed.checkpoint as dcp

    root, device = run.root / row.name, run.device
    # The pinned cache needs an accelerator: CPU mode (a smoke test) stages into plain memory.
    writer = dcp.FileSystemWriter(str(root / "0"), cache_staged_state_dict=stager is None and device == "cuda")
    pending: dict[int, Any] = {}

    kwargs: dict = {"async_stager": stager} if stager is not None else {}
    d = dist_group()
    if d and d.get_world_size() > 1:
        # The background save's collectives get a gloo group of their own, as TorchTitan does: on
        # the default group they would interleave with training's and deadlock.
        if "ckpt_group" not in run.shared:
            run.shared["ckpt_group"] = d.new_group(backend="gloo")
        kwargs["process_group"] = run.shared["ckpt_group"]

    def save(n: int):
        resp = dcp.async_save(run.state, checkpoint_id=str(root / str(n)), storage_writer=writer, **kwargs)
        fut = getattr(resp, "upload_completion", resp)
        pending[n] = (fut, done_at(fut))
        return (n, resp)

    def durable(result) -> float:
        fut, box = pending[result[0]]
        fut.result()
        while not box:
            time.sleep(0.001)
        return box[0]

    def staged(result) -> None:  # the optimizer step waits for the stager to have copied the state
        resp = result[1]
        if hasattr(resp, "staging_completion"):
            resp.staging_completion.result()

    prints = measure(row, run, base, save, durable,
                     lambda n: rank() == 0 and shutil.rmtree(root / str(n), ignore_errors=True),
                     staged if stager is not None else None)
    last = root / str(run.windows)
    barrier()
    row.stored = dir_bytes(last)
    restore_check(row, run.state, prints, device, run.drop_caches, lambda: dcp.load(run.state, checkpoint_id=str(last)),
                  run.root / "ceiling-restore")
    barrier()
    if rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def run_dcp_pinned(row: Row, run: Run, base: float) -> None:
    _dcp_row(row, run, base, None)


def run_dcp_stager(row: Row, run: Run, base: float) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = run.device == "cuda"
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=cuda))
    try:
        _dcp_row(row, run, base, stager)
    finally:
        stager.close()


def run_torch_save(row: Row, run: Run, base: float) -> None:
    root = run.root / row.name
    root.mkdir(parents=True, exist_ok=True)

    def save(n: int):
        path = root / f"{n}.rank{rank()}.pt"
        torch.save(run.state, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter()

    prints = measure(row, run, base, save, lambda done: done,
                     lambda n: (root / f"{n}.rank{rank()}.pt").unlink(missing_ok=True))
    path = root / f"{run.windows}.rank{rank()}.pt"
    row.stored = path.stat().st_size
    row.extra["stored_per_rank"] = True  # each rank its own file

    def load() -> None:
        loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        for dst, src in zip(tensors_of(run.state), tensors_of(loaded)):
            dst.copy_(src)

    restore_check(row, run.state, prints, run.device, run.drop_caches, load, run.root / "ceiling-restore")
    barrier()
    if rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def load_spec(method: str, text: str, defaults: tuple[float, ...], form: str) -> tuple[float, ...]:
    """The numbers of a `METHOD:AxBxC` row (`x` between them, as `--methods` is comma-separated),
    the missing ones from `defaults`. ValueError naming what is wrong."""
    if not text:
        return defaults
    try:
        values = [float(v) for v in text.split("x")]
    except ValueError:
        values = []
    if not 1 <= len(values) <= len(defaults) or any(v < 0 for v in values) or values[0] <= 0:
        raise ValueError(f"{method}:{text}: expected {form}, numbers x-separated, the first positive")
    return tuple(values) + defaults[len(values):]


def no_save_spec(text: str) -> float:
    """The seconds after each save's point that a `no_save[:S]` row counts as durable (default 1)."""
    return load_spec("no_save", text, (1.0,), "S (seconds)")[0]


def run_no_save(row: Row, run: Run, base: float) -> None:
    """No save and no load: the control row. Its stall is what the bench measures with nothing in
    the save's window: from one window to the next the GPU's clock moves with its recent power
    (+25 ms at 2.4 GB without the lead-in window). It counts as durable S seconds
    after each save's point, resting the GPU as long as a save's wait for durable would."""
    rest = no_save_spec(run.load)

    def durable(until: float) -> float:
        time.sleep(max(0.0, until - time.perf_counter()))
        return time.perf_counter()

    measure(row, run, base, lambda n: time.perf_counter() + rest, durable, lambda n: None)


def gil_load_spec(text: str) -> tuple[float, float, float]:
    """(total, burst, span) in ms of a `gil_load:TOTAL[xBURST[xSPAN]]` row (defaults: 100 ms in
    bursts of 0.5 ms over 500 ms)."""
    total, burst, span = load_spec("gil_load", text, (100.0, 0.5, 500.0), "TOTAL[xBURST[xSPAN]] in ms")
    if not 0 < burst <= total:
        raise ValueError(f"gil_load:{text}: a burst of {burst} ms: it must be positive and at most the total ({total} ms)")
    return total, burst, span


def d2h_load_spec(text: str) -> tuple[float, float]:
    """(GB, span ms) of a `d2h_load:GB[xSPAN]` row (defaults: 20 GB, issued at once)."""
    gb, span = load_spec("d2h_load", text, (20.0, 0.0), "GB[xSPAN ms]")
    return gb, span


def gil_burn(total_ms: float, burst_ms: float, span_ms: float) -> None:
    """Run pure Python for `total_ms` of this thread's CPU time, in bursts of `burst_ms` spread
    evenly over `span_ms` of wall time (a burst that starts late runs at once): the GIL held
    as a save's threads hold it, in short pieces between the training thread's launches."""
    n = max(1, round(total_ms / burst_ms))
    t0 = time.perf_counter()
    for i in range(n):
        c0 = time.thread_time()
        while time.thread_time() - c0 < burst_ms / 1e3:
            pass
        rest = t0 + (i + 1) * span_ms / 1e3 / n - time.perf_counter()
        if rest > 0:
            time.sleep(rest)


def run_gil_load(row: Row, run: Run, base: float) -> None:
    """No save: at each save's point a thread (started before the windows) runs `gil_burn`, and
    the window measures what that Python alone costs training (the row's stall). Nothing is
    stored or restored."""
    import queue
    import threading

    total, burst, span = gil_load_spec(run.load)
    asks: queue.SimpleQueue = queue.SimpleQueue()

    def serve() -> None:
        while (box := asks.get()) is not None:
            gil_burn(total, burst, span)
            box.append(time.perf_counter())

    worker = threading.Thread(target=serve, name="gil-load", daemon=True)
    worker.start()

    def start(n: int) -> list:
        box: list[float] = []
        asks.put(box)
        return box

    def durable(box: list) -> float:
        while not box:
            time.sleep(0.001)
        return box[0]

    try:
        measure(row, run, base, start, durable, lambda n: None)
    finally:
        asks.put(None)
        worker.join()
    row.extra["gil_load_ms"] = {"total": total, "burst": burst, "span": span}


def run_d2h_load(row: Row, run: Run, base: float) -> None:
    """No save: at each save's point, GB of the state's GPU tensors (in order, from the first again
    once all are issued) are copied to pinned host memory on a stream of their own, by the copy
    engines, as a save's drain does (into a 1 GiB ring, overwritten: only the traffic counts);
    issued at once, or in even pieces over SPAN ms. The window measures what that traffic alone
    costs training. Nothing is stored or restored."""
    import threading

    gb, span = d2h_load_spec(run.load)
    if run.device != "cuda":
        raise ValueError("d2h_load needs a GPU")
    sources = [t.detach().reshape(-1).view(torch.uint8) for t in tensors_of(run.state) if t.is_cuda and t.numel()]
    ring = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    pieces: list[tuple[torch.Tensor, int]] = []  # (source, where in the ring)
    want, at, k = int(gb * 1e9), 0, 0
    while want > 0:
        src = sources[k % len(sources)][:min(want, ring.numel())]
        if at + src.numel() > ring.numel():
            at = 0
        pieces.append((src, at))
        at, want, k = at + src.numel(), want - src.numel(), k + 1

    def issue(part) -> None:
        with torch.cuda.stream(stream):
            for src, where in part:
                ring[where:where + src.numel()].copy_(src, non_blocking=True)

    def start(n: int):
        stream.wait_stream(torch.cuda.current_stream())
        done = torch.cuda.Event()
        if span <= 0:
            issue(pieces)
            done.record(stream)
            return done, None
        steps = max(1, int(span // 10))  # a piece every 10 ms

        def paced() -> None:
            t0 = time.perf_counter()
            for i in range(steps):
                issue(pieces[i * len(pieces) // steps:(i + 1) * len(pieces) // steps])
                rest = t0 + (i + 1) * span / 1e3 / steps - time.perf_counter()
                if rest > 0:
                    time.sleep(rest)
            done.record(stream)

        th = threading.Thread(target=paced, name="d2h-load", daemon=True)
        th.start()
        return done, th

    def durable(result) -> float:
        done, th = result
        if th is not None:
            th.join()
        done.synchronize()
        return time.perf_counter()

    measure(row, run, base, start, durable, lambda n: None)
    row.extra["d2h_load"] = {"gb": gb, "span_ms": span, "copies": len(pieces)}


METHODS = {
    "tiered": (run_tiered, "Engine.save, embedded default config"),
    "tiered_plain": (run_plain, "the README's first snippet: the default config, no guard, no reserve (its first save "
                                "pins and lays out inside the save; warm saves strict); its own engine"),
    "tiered_overlap": (run_tiered_overlap, "the same engine with engine.guard(optimizer): the state is read beside "
                                           "the next forward and backward; the optimizer step waits for it; once "
                                           "a call's walk took 10 ms, the stager thread walks the state"),
    "tiered_overlap_deferred": (run_tiered_overlap_deferred, "tiered_overlap with guard(defer_walk=True): save() "
                                                             "walks nothing, the stager thread walks the state"),
    "tiered_overlap_walk": (run_tiered_overlap_walk, "tiered_overlap with guard(defer_walk=False): every save() "
                                                     "walks the state in its call"),
    "dcp_pinned": (run_dcp_pinned, "async_save, one FileSystemWriter(cache_staged_state_dict=True) reused"),
    "dcp_stager": (run_dcp_stager, "async_save + DefaultStager(use_async_staging=True), waited for before optimizer.step"),
    "torch_save": (run_torch_save, "torch.save + fsync: synchronous"),
    "no_save": (run_no_save, "no save: the control row, what the bench measures with nothing in the save's window; "
                             "durable S seconds after each save's point (no_save:S; default 1)"),
    "gil_load": (run_gil_load, "no save: Python on another thread at each save's point, TOTAL ms of its CPU in "
                               "BURST-ms pieces over SPAN ms (gil_load:TOTAL[xBURST[xSPAN]]; default 100x0.5x500)"),
    "d2h_load": (run_d2h_load, "no save: GB of the state's GPU tensors copied to pinned host memory at each save's "
                               "point by the copy engines, at once or over SPAN ms (d2h_load:GB[xSPAN]; default 20x0)"),
    "migration": (run_migration, "training while a step migrates to a shared tier (zstd) below the default "
                                 "config's local one, against the migrator idle (migration:MODE; default "
                                 "process); guarded saves; no restore"),
}

LOAD_SPECS = {"no_save": no_save_spec, "gil_load": gil_load_spec, "d2h_load": d2h_load_spec,
              "migration": migration_spec}
"""The rows whose name's ":" part is not a codec, and its reader: the rows that save nothing (their
load) and the migration row (its mode). None of them restores."""


def row_spec(name: str) -> tuple[str, str, float | None, int | None, float | str]:
    """(method, codec or "", switch interval in ms or None, pack buffer bytes or None, stage_after_ms)
    of a row named on the command line: METHOD[:CODEC][@MS][/PACK][+AFTER] (tiered_overlap:none:
    that row's codec pinned; tiered_overlap@0.1: Python's switch interval during the row;
    tiered_overlap/1GiB: that row's engine with `budgets.pack_buffer: 1GiB`, so a save's waves of 1
    MiB chunks are up to 1,024 chunks, not 256; tiered_overlap+250: its guards'
    `stage_after_ms=250`, +0 none; without +AFTER, or +auto, the default "auto"). ValueError
    naming what is wrong. Compare rows of different budgets in separate processes: an engine
    made after another closed finds less GPU memory free than the first did (the first's buffers
    stay in torch's cache) and sizes its slab from that; with the cache emptied in
    between, the next row's training ran out of GPU memory before its first save (not
    investigated)."""
    spec, plus, after_text = name.partition("+")
    spec, slash, pack_text = spec.partition("/")
    spec, at, interval = spec.partition("@")
    base, _, codec = spec.partition(":")
    if base not in METHODS:
        raise ValueError(f"{name!r}: expected one of {', '.join(METHODS)}, optionally :CODEC, @MS, /PACK and +AFTER")
    try:
        ms = float(interval) if at else None
    except ValueError:
        ms = None
    if at and not (ms and ms > 0):
        raise ValueError(f"{name!r}: @{interval} is not a switch interval in ms (a positive number)")
    if base in LOAD_SPECS:  # (its ":" part is the load, not a codec)
        LOAD_SPECS[base](codec)
    pack = None
    if slash:
        if not base.startswith("tiered"):
            raise ValueError(f"{name!r}: /PACK sets a tiered row's budgets.pack_buffer; {base} has none")
        try:
            pack = parse_size(pack_text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name!r}: /{pack_text} is not a size ({exc})") from None
    after: float | str = "auto"
    if plus and not base.startswith("tiered_overlap"):
        raise ValueError(f"{name!r}: +AFTER sets an overlapped row's guard(stage_after_ms=AFTER); {base} has none")
    if plus and after_text != "auto":
        try:
            after = float(after_text)
            stage_after_seconds(after)  # (the engine's own check)
        except ValueError:
            raise ValueError(f"{name!r}: +{after_text} is not a stage_after_ms (a non-negative number of ms)") from None
    return base, codec, ms, pack, after
