"""The scale bench's methods, one row each (scripts/scale.py lists them): tiered strict and
guarded, DCP with a pinned cache and with async staging, torch.save."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Any

import torch

import tiered
from tiered.units import parse_size
from baselines import dir_bytes
from scale_measure import (Row, Run, barrier, dist_group, done_at, gpu_free, measure, rank, restore_check, rss, say,
                           tensors_of)

def tiered_engine(run: Run) -> Any:
    """The size's tiered engine, made (and its host memory pinned, its saves laid out) the first
    time a tiered row asks."""
    engine = run.shared.get("engine")
    if engine is not None and run.shared.get("config") != (run.codec, run.pack_buffer):  # (its own engine)
        close_shared(run)
        engine = None
    if engine is None:
        cfg = tiered.load_config(None)
        doc: dict = {"tiers": [{"name": cfg.fast_tier.name, "kind": "local", "path": str(run.root / "tiered"),
                                **({} if run.codec == "auto" else {"codec": run.codec})}]}
        if run.pack_buffer is not None:
            doc["budgets"] = {"pack_buffer": run.pack_buffer}
        rss0, gpu0, t0 = rss(), gpu_free(run.device), time.perf_counter()
        engine = run.shared["engine"] = tiered.Engine.from_config(doc)
        engine.reserve(run.state)  # the start-up line that keeps pinning and laying out off the first save
        engine.wait_pinned()
        run.shared.update(pin_s=round(time.perf_counter() - t0, 1), pin_rss=rss() - rss0, gpu_free0=gpu0,
                          config=(run.codec, run.pack_buffer))
        say(f"#   tiered engine: host staging memory pinned in {run.shared['pin_s']} s")
    return engine


def close_shared(run: Run) -> None:
    engine = run.shared.pop("engine", None)
    if engine is not None:
        engine.close()
        barrier()
        if rank() == 0:
            shutil.rmtree(run.root / "tiered", ignore_errors=True)


def _tiered_row(row: Row, run: Run, base: float, first_step: int) -> None:
    engine = tiered_engine(run)
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
                     gpu_free0=run.shared["gpu_free0"])  # (all the engine holds, from before it was made)
    row.host_taken += run.shared["pin_rss"]  # the pinned pool, made before the windows
    row.extra["pin_s"] = run.shared["pin_s"]
    row.extra["codec"] = engine.fast_codec  # the policy's choice for the warm saves (codec: auto)
    timings = [h.timings for step, (h, _) in sorted(handles.items())][:run.saves]  # (not a traced save's)
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


def run_tiered_overlap(row: Row, run: Run, base: float, defer_walk: bool | None = None) -> None:
    engine = tiered_engine(run)
    guards = [engine.guard(opt, defer_walk=defer_walk) for opt in run.optimizers]
    if defer_walk:  # (reserved again, guarded now, as a loop that guards at set-up and reserves after its first step)
        engine.reserve(run.state)
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


METHODS = {
    "tiered": (run_tiered, "Engine.save, embedded default config"),
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
}


def row_spec(name: str) -> tuple[str, str, float | None, int | None]:
    """(method, codec or "", switch interval in ms or None, pack buffer bytes or None) of a row
    named on the command line: METHOD[:CODEC][@MS][/PACK] (tiered_overlap:none: that row's codec
    pinned; tiered_overlap@0.1: Python's switch interval during the row; tiered_overlap/1GiB: that
    row's engine with `budgets.pack_buffer: 1GiB`, so a save's waves of 1 MiB chunks are up to
    1,024 chunks, not 256). ValueError naming what is wrong. Compare rows of different budgets in
    separate processes: an engine made after another closed finds less GPU memory free than the
    first did (the first's buffers stay in torch's cache) and sizes its slab from that (GPU run
    309); with the cache emptied in between, the next row's training ran out of GPU memory before
    its first save (run 310; not investigated)."""
    spec, slash, pack_text = name.partition("/")
    spec, at, interval = spec.partition("@")
    base, _, codec = spec.partition(":")
    if base not in METHODS:
        raise ValueError(f"{name!r}: expected one of {', '.join(METHODS)}, optionally :CODEC, @MS and /PACK")
    try:
        ms = float(interval) if at else None
    except ValueError:
        ms = None
    if at and not (ms and ms > 0):
        raise ValueError(f"{name!r}: @{interval} is not a switch interval in ms (a positive number)")
    pack = None
    if slash:
        if not base.startswith("tiered"):
            raise ValueError(f"{name!r}: /PACK sets a tiered row's budgets.pack_buffer; {base} has none")
        try:
            pack = parse_size(pack_text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name!r}: /{pack_text} is not a size ({exc})") from None
    return base, codec, ms, pack
