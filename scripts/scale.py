"""The scale mode of scripts/bench.py: a per-GPU state of 10-100 GB, GPU memory nearly full.

    python scripts/bench.py --scale 24 --free-gb 6          # one size
    python scripts/bench.py --scale 2.4,12,24 --free-gb 6   # how each cost grows with the state

The state is built from the benchmark's trained GPT and its AdamW state: replica 0 is the live
model and optimizer, replicas 1.. copies of them (real statistics, not random data) up to the
requested size. With `--train all` (the default) every replica is a model with its optimizer and
a training step runs every forward and backward, then every optimizer step: the compute and the
update order of one model whose state is that large. With `--train one` only replica 0 trains
and the others are static clones. A GPU memory ballast then leaves `--free-gb`
free. Side by side, one method after another on the same state and disk:

  tiered       Engine.save with the embedded default config (only the tier's path changed);
               the engine is made before the row's windows with `engine.reserve(state)`, its
               start-up line, and pinning its host staging memory in the background is waited
               for before the first save and reported (`pin_s`)
  tiered_overlap  the same engine with `engine.guard(optimizer)` for every optimizer, then
               reserved again: save() returns at once, the state is read beside the next
               forward and backward, and the optimizer step waits for it; once a walk of the
               state (reserve's, or a call's) took 10 ms, the stager thread walks it; the stager
               starts a save's reads when `stage_after_ms="auto"` says
  tiered_overlap_deferred  the same with `guard(optimizer, defer_walk=True)`, the engine reserved
               again once guarded: from the first save on, save() walks nothing, the stager
               thread walks the state
  tiered_overlap_walk  the same with `guard(optimizer, defer_walk=False)`: every call walks the
               state
  tiered_plain the README's first snippet, on an engine of its own made for the row: the default
               config, no guard, no reserve, so its first save plans, lays out and pins inside the
               save, and its warm saves are strict ones (run it after the other tiered rows:
               the engine before it leaves its GPU buffers in torch's cache, so this one's slab is
               sized from less free memory, and the row says how large: `slab_bytes`)
  dcp_pinned   DCP async_save, one FileSystemWriter(cache_staged_state_dict=True) reused
               (TorchTitan's pinned-memory mode; the copy to host happens inside the call)
  dcp_stager   DCP async_save with DefaultStager(StagingOptions(use_async_staging=True)):
               staging overlaps the next forward and backward and is waited for before the
               optimizer step (a failure, e.g. on torch versions where it crashes, is reported)
  torch_save   torch.save + fsync (synchronous)
  migration    training while a guarded save's step migrates to a shared tier (zstd, a directory
               on the same disk, or --shared-dir) below the default config's local one, against
               the migrator idle; the stall of a save with the migrator idle and of one made
               while a step migrates; each step's seconds to the shared tier
               (scripts/scale_migration.py). `migration` runs the default mode (process);
               `migration:in_process` the thread. No restore.

Under torchrun (`torchrun --nproc-per-node 2 scripts/bench.py --scale 24 ...`) every rank builds
its own state of that size on its own GPU, all ranks write to one disk, each training step ends
with an all-reduce (ranks step together, as data-parallel training does), tiered saves through
`Engine.save` (its distributed path) and DCP through its process group; rank 0 reports each
save's slowest rank (stall, call, durable, restore), the GPU memory of the rank that took most,
and the host memory and stored bytes of all ranks together. Started as above, every rank sees
every GPU, as torchrun leaves it, and nvCOMP takes a context on GPU 0 in each (docs/distributed.md).
To start each rank seeing its own GPU alone, as docs/distributed.md advises:
`torchrun --nproc-per-node 2 --no-python sh -c 'CUDA_VISIBLE_DEVICES=$LOCAL_RANK exec python3 scripts/bench.py --scale 24 ...'`.

For each: the training stall as the loop feels it (the wall time of a window of real training
steps, forward + backward + optimizer step, that contains one save, minus the same window
without a save run just before it, which itself comes after `--lead-in-s` (2 s) of training not
measured, so that both windows follow training: the GPU's clock follows its recent power, and on
a power-capped H200 a window right after another ran ~25 ms slower than one after the wait for
the last save to be durable; `--lead-in-s 0` leaves the lead-in out;
the `no_save` row saves nothing and shows what the bench measures then; the stall against the
median of the method's first baseline windows is kept as `stall_vs_start_ms`),
next to the save call's own time; time to durable (from the call until
committed and fsync'd); stored bytes; GPU memory the method took (free GPU memory before its
first save minus the least seen after; for tiered, from before the engine was made, so its
`reserve` and a second row on the same engine count too) and host memory (growth of the
process's resident set, pinned buffers included); the cold restore into the zeroed state, page
cache dropped where permitted, checked bit-exact by a fingerprint of every tensor taken before
zeroing. Same-run ceilings: O_DIRECT write and read of the disk (under torchrun by rank 0 alone,
then by every rank at once; the durable and restore targets use the faster; and the read rate
again just before each restore, every rank at once, a second restore target: these disks drift
within a run), pinned device-to-host copy, and
the GPU codecs' encode rate alone on a batch of the state's own tensors (what compressing the
state takes of a GPU that training keeps busy), and a step's forward and backward alone
(`forward_backward_ms`, synced before the optimizer update). From these and the row's own slab
and stored bytes, each overlapped row gets its floor (`floor_of`): what must cross PCIe before
the optimizer step, less what the forward and backward hide, plus the first wave's encode. With
`--batch` sized for ~0.3 s steps (`--batch 24` at `--scale 24` on an H200) these are the
short-step rows of docs/benchmarks.md. The tiered rows also record `reserve()`'s call time.
Per save, also where its stall lands: each step of its window against the same step of the window just before it (`extra_steps_ms`; the row's
`warm_extra_steps_ms`: their medians over the warm saves, printed beside the call), and the full passes of Python's
collector that ran inside its window, on any thread and on the engine's (`scripts/gc_watch.py`):
one holds the GIL for ~0.2 s here, and shows as stall whoever set it off; and those from the call
until the step was durable (`full_gc_to_durable_ms`), which also covers the commit, long after
the window at this scale.

Its parts: scripts/scale_measure.py (ranks, the state, the windows and rows every method shares)
and scripts/scale_methods.py (one function a row); this module runs one size and reports it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from scale_measure import (Row, Run, Window, barrier, combine, disk_together, forward_backward_ms, gather, gpu_free,
                           rank, say, sync, tensors_of, world)
from scale_methods import LOAD_SPECS, METHODS, close_shared, row_spec, tiered_engine
from scale_migration import describe as describe_migration
from tiered.units import format_size

GiB = 1 << 30

# --- one size --------------------------------------------------------------------------------
def run_size(size_gb: float, live: Any, device: str, root: Path, *, free_gb: float, saves: int,
             window_steps: int, methods: list[str], drop_caches, ceilings: Callable[[int], dict],
             progress: Callable[[dict], None] = lambda out: None, gil_watch: bool = False,
             trace: str | None = None, codec: str = "auto", shared_dir: Path | None = None,
             settle_ms: float = 0.0, lead_in_s: float = 2.0) -> dict:
    """Every method at one size; `progress(out)` after each row (a run cut off keeps the rows done)."""
    state, step_fn, optimizers = live.build(int(size_gb * 1e9))
    replicas = len(state)
    if world() > 1:  # each rank's own shard, as under FSDP: DCP would otherwise save replicated keys once
        state = {f"rank{rank()}": state}
    state_bytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    out: dict = {"ranks": world()}
    barrier()  # one rank measures the disk's ceilings, alone on it
    out["ceilings"] = gather(ceilings(min(state_bytes, 8 << 30), tensors_of(state)) if rank() == 0 else None)[0]
    if world() > 1:
        out["ceilings"]["disk_together"] = disk_together(root / "ceiling-together", min(state_bytes, 4 << 30))
    # Activations and gradients allocated before the ballast is sized, after the ceilings: these
    # end in `torch.cuda.empty_cache()`, which gave a step's activations back to the driver, so a
    # ballast sized from what was then free left training too little (out of memory).
    step_fn()
    sync(device)
    # The ballast is sized after the ceilings, which rank 0 alone measures: what their probes keep
    # on its GPU counts as used, so that every rank is left `free_gb`. With the ballast first, rank
    # 0 had 1.65 GB less free than rank 1 at its first save, each rank seeing only its own GPU; the likeliest holder, not measured, is nvCOMP's cached zstd codec (`gpu_codec_gbps`).
    ballast = None
    if device == "cuda":
        free = gpu_free(device)
        want = free - int(free_gb * GiB)
        if want > 0:
            ballast = torch.empty(want, dtype=torch.uint8, device=device)
    out = {"state_gb": round(state_bytes / 1e9, 2), "tensors": len(tensors_of(state)), "replicas": replicas,
           "gpu_free_gb": round(gpu_free(device) / GiB, 2), **out}
    say(f"# scale {size_gb} GB: {out['state_gb']} GB, {out['tensors']} tensors, {out['gpu_free_gb']} GiB GPU memory free")
    if rank() == 0:
        say(f"# ceilings: {out['ceilings']}")
    window = Window(step_fn, device, window_steps)
    out["window_ms"] = round(1e3 * window.baseline(), 1)
    out["forward_backward_ms"] = forward_backward_ms(step_fn, device)
    out["window_steps_ms"] = window.last_steps_ms  # the last baseline window's steps
    root.mkdir(parents=True, exist_ok=True)
    one_copy = shutil.disk_usage(root).free < 2.2 * state_bytes * world()
    if one_copy:
        say("#   the disk holds less than two copies of the state: each step is deleted before the next save")
    run = Run(state, window, saves, root, device, drop_caches, optimizers, one_copy, gil_watch=gil_watch,
              trace=trace, codec=codec, shared_root=shared_dir, settle_ms=settle_ms,
              lead_in_s=lead_in_s)
    rows = []
    try:
        for k, name in enumerate(methods):
            base_name, row_codec, interval, pack, run.stage_after_ms = row_spec(name)
            fn, note = METHODS[base_name]
            load = row_codec if base_name in LOAD_SPECS else ""  # (a load row's ":" part is its load)
            run.codec, run.pack_buffer, run.load = (row_codec or codec) if not load else codec, pack, load
            row = Row(name, note + (f"; codec: {row_codec}" if row_codec and not load else "")
                      + (f"; sys.setswitchinterval({interval} ms) for the row" if interval else "")
                      + (f"; budgets.pack_buffer: {format_size(pack)}" if pack else "")
                      + (f"; guard(stage_after_ms={run.stage_after_ms:g})" if run.stage_after_ms != "auto" else ""))
            old_interval = sys.getswitchinterval()
            try:
                if name.startswith("tiered") and base_name != "tiered_plain":
                    tiered_engine(run)  # made, and its memory pinned, before the baseline windows
                if interval:
                    sys.setswitchinterval(interval / 1e3)
                fn(row, run, window.baseline())
            except Exception as exc:  # noqa: BLE001 - reported as the row's result (with the saves it made), honestly
                row.error = f"{type(exc).__name__}: {exc}"[:400]
                say(f"#   {name} FAILED: {row.error}")
                shutil.rmtree(root / name, ignore_errors=True)
            finally:
                sys.setswitchinterval(old_interval)
            rows.append(combine(gather(row.summary())))
            out["rows"] = rows
            progress(out)
            if not any(m.startswith("tiered") for m in methods[k + 1:]):
                close_shared(run)  # its pinned memory goes before the other methods run
    finally:
        close_shared(run)
    for r in out["rows"]:
        if r["name"].startswith("tiered_overlap") and not r["error"]:
            r["floor"] = floor_of(out, r)
    out["targets"] = targets(out)
    del ballast, state, run, step_fn, optimizers
    live.release()
    return out


def floor_of(out: dict, r: dict) -> dict | None:
    """The physical floor of an overlapped save's stall at this size, from parts measured in this
    run: the compressed bytes that do not fit the GPU slab must cross PCIe (at the pinned
    device-to-host rate) before the optimizer step may change the state, and the forward and
    backward hide that much of it; the first wave's encode comes before any of it can start.
    floor = max(0, (stored - slab) / D2H - forward_backward) + wave / encode rate. The save's own
    GPU time beside training (the whole state at the encode rate, `encode_ms`) is shown apart,
    not counted in it. None where a part was not measured (no GPU, a row without a slab)."""
    c = out["ceilings"]
    d2h, ans = c.get("d2h_pinned_gbps"), c.get("gpu_codecs", {}).get("ans", {}).get("encode_gbps")
    fb, slab, wave, stored = out.get("forward_backward_ms"), r.get("slab_bytes"), r.get("wave_bytes"), r["stored_bytes"]
    if not (d2h and ans and fb and slab and wave and stored):
        return None
    raw = out["state_gb"] * 1e9
    cross = max(0, stored - slab)
    link_ms = 1e3 * cross / (d2h * 1e9)
    wave_ms = 1e3 * min(wave, raw) / (ans * 1e9)
    floor = max(0.0, link_ms - fb) + wave_ms
    return {"floor_ms": round(floor, 1), "must_cross_gb": round(cross / 1e9, 2), "slab_gb": round(slab / 1e9, 2),
            "link_ms": round(link_ms, 1), "forward_backward_ms": fb, "first_wave_encode_ms": round(wave_ms, 1),
            "d2h_gbps": d2h, "encode_gbps": ans, "encode_ms": round(1e3 * raw / (ans * 1e9), 1)}


def disk_bounds(ceilings: dict) -> dict:
    """The write and read rates that the durable and restore targets are held to: the disk
    probed by one rank alone, or (several ranks) by all at once, whichever was faster: the
    stricter bound (ranks that shared the disk worse than one rank alone would still be held to
    one rank's rate)."""
    alone, together = ceilings.get("disk", {}), ceilings.get("disk_together", {})
    return {k: max(alone.get(k) or 0, together.get(k) or 0) or None for k in ("write_gbps", "read_gbps")}


def targets(out: dict) -> dict:
    """The scale targets (docs/benchmarks.md, "Targets"), from this size's rows, for each tiered row (strict, overlapped, and any
    run with a codec pinned: `tiered_overlap:none`): its stall, durable and restore."""
    rows = {r["name"]: r for r in out["rows"]}
    disk = disk_bounds(out["ceilings"])
    usable = [r for r in out["rows"] if r["name"].startswith("tiered") and not r["error"] and r["warm_stall_ms"]]
    if not usable:
        return {}
    dcp = rows.get("dcp_pinned")
    res = {}
    for r in usable:
        name = r["name"]
        stall = r["warm_stall_ms"]["median"]
        res[f"{name}: stall <= 50 ms"] = (stall <= 50, f"{stall} ms")
        if dcp and dcp["warm_stall_ms"]:
            theirs = dcp["warm_stall_ms"]["median"]
            res[f"{name}: stall <= DCP pinned / 10"] = (stall <= theirs / 10, f"{stall} vs {theirs} ms")
            res[f"{name}: stall <= DCP pinned / 7"] = (stall <= theirs / 7,
                                                       f"{stall} vs {theirs} ms ({theirs / max(stall, 1e-3):.1f}x)")
        if r.get("floor"):
            f = r["floor"]["floor_ms"]
            res[f"{name}: stall <= 1.3 x the floor"] = (stall <= 1.3 * f, f"{stall} vs {f} ms ({stall / max(f, 1e-3):.2f}x)")
        if r["first"]:
            res[f"{name}: first save stalls no more than a warm one (within 20% or 20 ms)"] = (
                r["first"]["stall_ms"] <= max(1.2 * stall, stall + 20), f"{r['first']['stall_ms']} vs {stall} ms")
            if name.startswith("tiered_plain"):
                res[f"{name}: first save (no reserve) <= 2 x a warm strict one"] = (
                    r["first"]["stall_ms"] <= 2 * stall, f"{r['first']['stall_ms']} vs {stall} ms "
                                                         f"({r['first']['stall_ms'] / max(stall, 1e-3):.2f}x)")
        if r.get("reserve_call_ms"):
            res[f"{name}: reserve() returns within 100 ms"] = (max(r["reserve_call_ms"]) <= 100,
                                                              f"{r['reserve_call_ms']} ms")
    for t in usable if disk.get("write_gbps") and disk.get("read_gbps") else ():
        bound = 1.15 * t["stored_bytes"] / (disk["write_gbps"] * 1e9)
        res[f"{t['name']}: durable <= 1.15 x stored / write ceiling"] = (
            t["warm_durable_s"]["median"] <= bound, f"{t['warm_durable_s']['median']} s vs {bound:.2f} s")
        if t["restore_s"] is not None:
            bound = 1.15 * t["stored_bytes"] / (disk["read_gbps"] * 1e9)
            res[f"{t['name']}: restore <= 1.15 x stored / read ceiling"] = (
                t["restore_s"] <= bound, f"{t['restore_s']} s vs {bound:.2f} s")
            at = t.get("read_gbps_at_restore")
            if at:  # the disk as it read just before the restore, every rank at once (`restore_check`)
                bound = 1.15 * t["stored_bytes"] / (at * 1e9)
                res[f"{t['name']}: restore <= 1.15 x stored / read ceiling probed just before it"] = (
                    t["restore_s"] <= bound, f"{t['restore_s']} s vs {bound:.2f} s ({at} GB/s)")
    return {k: {"met": bool(ok), "measured": got} for k, (ok, got) in res.items()}


def print_size(out: dict) -> None:
    print(f"\n## scale: {out['state_gb']} GB state{' per rank, %d ranks' % out['ranks'] if out.get('ranks', 1) > 1 else ''} "
          f"({out['tensors']} tensors, {out['replicas']} replicas), "
          f"{out['gpu_free_gb']} GiB GPU memory free, window of training steps {out['window_ms']} ms")
    c = out["ceilings"]
    disk = c.get("disk", {})
    ans = c.get("gpu_codecs", {}).get("ans", {}).get("encode_gbps")
    together = c.get("disk_together")
    print(f"ceilings: O_DIRECT write {disk.get('write_gbps')} GB/s, read {disk.get('read_gbps')} GB/s"
          + (" (one rank alone); all %d ranks at once: write %s GB/s, read %s GB/s" % (
              together["ranks"], together["write_gbps"], together["read_gbps"]) if together else "")
          + (f", pinned D2H {c['d2h_pinned_gbps']} GB/s" if "d2h_pinned_gbps" in c else "")
          + (f", GPU ANS encode {ans} GB/s alone on one batch of up to 256 chunks (this state at that rate: "
             f"{1e3 * out['state_gb'] / ans:.0f} ms of the whole GPU; a traced 24 GB save's ANS kernels ran at ~700 "
             "GB/s)" if ans else ""))
    print("| method | stall ms warm median (range) | first save stall ms | saves 3+: stall ms median (range) | call ms "
          "warm median | durable s warm median (range) | stored GB | GPU taken GB | host taken GB | cold restore s | "
          "bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        if r["error"]:
            done = "; ".join(f"save {i + 1}: stall {x['stall_ms']} ms, durable {x['durable_s']} s"
                             for i, x in enumerate(r["saves"]))
            print(f"| {r['name']} | FAILED: {r['error']}{f' (after {done})' if done else ''} | | | | | | | | | |")
            continue
        s, d, cm, later = r["warm_stall_ms"], r["warm_durable_s"], r["warm_call_ms"], r.get("later_stall_ms")
        later = f"{later['median']} ({later['min']}–{later['max']})" if later else "—"
        print(f"| {r['name']} | {s['median']} ({s['min']}–{s['max']}) | {r['first']['stall_ms']} | {later} | "
              f"{cm['median']} | "
              f"{d['median']} ({d['min']}–{d['max']}) | {r['stored_bytes'] / 1e9:.2f} | {r['gpu_taken_bytes'] / 1e9:.2f} | "
              f"{r['host_taken_bytes'] / 1e9:.2f} | {r['restore_s']} | {r['restore_bit_exact']} |")
    if out.get("forward_backward_ms"):
        print(f"a step's forward and backward alone: {out['forward_backward_ms']} ms")
    for r in out["rows"]:
        f = r.get("floor")
        if f:
            print(f"{r['name']}: the floor {f['floor_ms']} ms = max(0, {f['must_cross_gb']} GB past the "
                  f"{f['slab_gb']} GB slab at {f['d2h_gbps']} GB/s ({f['link_ms']} ms) - {f['forward_backward_ms']} ms "
                  f"of forward and backward) + the first wave's encode ({f['first_wave_encode_ms']} ms at "
                  f"{f['encode_gbps']} GB/s); the whole state's encode alone would take {f['encode_ms']} ms of the GPU")
    for r in out["rows"]:
        x, cm = r.get("warm_extra_steps_ms"), r.get("warm_call_ms")
        if x and cm and not r["error"]:
            print(f"{r['name']}: where the warm stall lands (medians, ms): the call {cm['median']}, then each step of "
                  f"the window against the same step of the window just before it: "
                  + ", ".join(f"{v:+.1f}" for v in x[:-1]) + f"; the GPU's backlog at the end {x[-1]:+.1f}")
    for r in out["rows"]:
        b = r.get("baseline_window_ms")
        if b and not r["error"]:
            n = r.get("lead_in_windows", 0)  # (what its windows had: from its own baseline)
            after = f", itself right after {n} not measured" if n else ""
            print(f"{r['name']}: the windows without a save (one just before each save{after}, which its stall is "
                  f"measured against) took {b['median']} ms, {b['min']}–{b['max']} over the run "
                  f"(a spread of {b['max'] - b['min']:.1f} ms)")
    control = next((r for r in out["rows"] if r["name"].startswith("no_save") and not r["error"]), None)
    if control:
        c = control["warm_stall_ms"]["median"]
        print(f"{control['name']} (nothing saved) measured {c} ms: the warm medians less that: "
              + ", ".join(f"{r['name']} {r['warm_stall_ms']['median'] - c:+.1f} ms" for r in out["rows"]
                          if r is not control and not r["error"] and r.get("warm_stall_ms")))
    for r in out["rows"]:
        if r.get("migration") and not r["error"]:
            print(describe_migration(r["name"], r["migration"]))
    if out["targets"]:
        print("\n| target (tiered, default config) | met | measured |\n|---|---|---|")
        for k, v in out["targets"].items():
            print(f"| {k} | {'yes' if v['met'] else 'MISSED'} | {v['measured']} |")
