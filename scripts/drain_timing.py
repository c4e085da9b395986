"""Where a drain's copies wait, in saves the profiler does not slow: scripts/bench.py with CUDA
timing events around every drained run.

    python3 scripts/drain_timing.py --params 2e9 --train-steps 20 --batch 48 --scale 24 --free-gb 6 \
        --saves 6 --window-steps 3 --methods tiered_overlap --out short.json

takes scripts/bench.py's arguments and runs it with hooks on the drain's public steps
(tiered.gpu.pack's `pack_and_checksum` and `sum_partials`, tiered.stage.pools' `WavePages.take`
and `HostPool.view`): for each run of rows a drained wave sends to the host, an event on the
packing stream before and after its packing, and one on the copy stream before and after its copy
(the copy's start event fires once the copy before it is done *and* its own packing is). A copy
that starts after the one before it ended left the link idle; that idle is put down to

- **the writer**, where the run's packing began after the link had gone idle: its packing had not
  been issued yet (the writer thread's host time), or it waited on the GPU for what a wave's first
  packing waits for (the wave's compression, its sizes crossing to the GPU);
- **the packing**, where the packing began in time and ended late (its kernel shares the SMs with
  training's).

Each save prints one line (`# drain-timing save N: ...`, `summary`), times from the moment the
training stream reached the `Engine.save` call: the first copy's start, the last one's end, the
copies' own rate, the idle and its two parts (and how much of each fell at a wave's first run),
the packing kernels' times, and the writer's host time issuing each wave.

`--alternate '{"A": {...}, "B": {...}}'` makes the saves alternate between two settings of the
drain's module constants (`tiered.gpu.write.DRAIN_DEPTH`, tiered.gpu.device's): the first save
and every odd one take B, every even one A, so both share one engine, slab, machine and run. A
traced save (`bench.py --trace`) shows every copy but is the row's last, after a pause, and runs
under the profiler's host cost; these events cost the writer four records a run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import runpy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

RUN_KEYS = ("pack_start", "pack_end", "copy_start", "copy_end")


def summary(runs: Sequence[dict], issue_ms: Sequence[float] = ()) -> dict:
    """One save's drain from its runs, in order: each a dict of `RUN_KEYS` (ms from the call's
    event), `bytes` and `first` (the first run of its wave); `issue_ms`, the writer's host time
    issuing each wave. See the module's docstring for how the idle link is put down."""
    if not runs:
        return {"runs": 0}
    busy = sum(r["copy_end"] - r["copy_start"] for r in runs)
    nbytes = sum(r["bytes"] for r in runs)
    writer = pack = writer_first = pack_first = 0.0
    for before, r in zip(runs, runs[1:]):
        idle = max(0.0, r["copy_start"] - before["copy_end"])
        late = min(idle, max(0.0, r["pack_start"] - before["copy_end"]))
        writer += late
        pack += idle - late
        if r["first"]:
            writer_first += late
            pack_first += idle - late
    kernels = sorted(r["pack_end"] - r["pack_start"] for r in runs)
    first, last = runs[0]["copy_start"], runs[-1]["copy_end"]
    got = {"runs": len(runs), "waves": sum(1 for r in runs if r["first"]), "gb": round(nbytes / 1e9, 2),
           "first_ms": round(first, 1), "last_ms": round(last, 1), "span_ms": round(last - first, 1),
           "copies_gbps": round(nbytes / busy / 1e6, 1) if busy > 0 else None,
           "idle_ms": round(last - first - busy, 1), "idle_writer_ms": round(writer, 1),
           "idle_packing_ms": round(pack, 1), "at_wave_start_writer_ms": round(writer_first, 1),
           "at_wave_start_packing_ms": round(pack_first, 1),
           "packing_ms_median": round(statistics.median(kernels), 3),
           "packing_ms_p90": round(kernels[int(0.9 * (len(kernels) - 1))], 3), "packing_ms_max": round(kernels[-1], 3)}
    if issue_ms:
        got.update(issue_ms=round(sum(issue_ms), 1), issue_ms_median=round(statistics.median(issue_ms), 2),
                   issue_ms_max=round(max(issue_ms), 2))
    return got


def variant_of(n: int) -> str:
    """The setting of `--alternate` that save n (from 0) takes: B for the first and every
    odd-numbered save, A for the rest."""
    return "B" if n % 2 == 0 else "A"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--alternate", type=json.loads, default=None)
    args, rest = ap.parse_known_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("drain_timing.py times a GPU's drain: it needs CUDA (scripts/bench.py runs on the CPU)")
    import tiered
    import tiered.gpu.device as device
    import tiered.gpu.pack as pack
    import tiered.gpu.write as write
    from tiered.stage.pools import HostPool, WavePages

    where = {"DRAIN_DEPTH": write}
    if args.alternate is not None:
        for setting in args.alternate.values():
            for key in setting:
                where.setdefault(key, device)
                if not hasattr(where[key], key):
                    raise SystemExit(f"--alternate: {key} is not a constant of tiered.gpu.write or tiered.gpu.device")

    saves: list[dict[str, Any]] = []
    now: dict[str, Any] = {"wave": None, "copy": None}
    save, issue_drain, pack_and_checksum, sum_partials, take, view = (
        tiered.Engine.save, device.GpuDevice.issue_drain, pack.pack_and_checksum, pack.sum_partials, WavePages.take,
        HostPool.view)

    def event(stream: Any) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def report(n: int) -> None:
        s = saves[n]
        if s.get("done"):
            return
        s["done"] = True
        runs = [r for w in s["waves"] for r in w["runs"] if all(k in r for k in RUN_KEYS)]
        if runs:
            runs[-1]["copy_end"].synchronize()
        call = s["call"]
        timed = [{**{k: call.elapsed_time(r[k]) for k in RUN_KEYS}, "bytes": r["bytes"], "first": r["first"]}
                 for r in runs]
        got = summary(timed, [w["issue_ms"] for w in s["waves"]])
        label = f" ({s['variant']}: {json.dumps(args.alternate[s['variant']])})" if args.alternate else ""
        print(f"# drain-timing save {n + 1}{label}: {json.dumps(got)}", flush=True)

    def timed_save(self: Any, *a: Any, **k: Any) -> Any:
        if saves:
            report(len(saves) - 1)  # (its copies are done: the bench waited for it to be durable)
        variant = None
        if args.alternate is not None:
            variant = variant_of(len(saves))
            for key, value in args.alternate[variant].items():
                setattr(where[key], key, value)
        saves.append({"call": event(torch.cuda.current_stream()), "waves": [], "variant": variant})
        return save(self, *a, **k)

    def timed_drain(self: Any, seg: Any, sizes: Any, acquire: Any) -> Any:
        wave = {"runs": []}
        now["wave"], now["copy"] = wave, self.writer_stream
        t0 = time.perf_counter()
        try:
            return issue_drain(self, seg, sizes, acquire)
        finally:
            wave["issue_ms"] = 1e3 * (time.perf_counter() - t0)
            now["wave"] = None
            if saves:
                saves[-1]["waves"].append(wave)

    def copy_ended(wave: dict) -> None:
        """The run before this point has its copy issued: the copy stream's next event follows it."""
        if wave["runs"] and "copy_start" in wave["runs"][-1] and "copy_end" not in wave["runs"][-1]:
            wave["runs"][-1]["copy_end"] = event(now["copy"])

    def timed_pack(rows: Any, sizes: Any, parts: Any, dst: Any, offsets: Any, first: int, end: int) -> None:
        wave = now["wave"]
        if wave is None:
            return pack_and_checksum(rows, sizes, parts, dst, offsets, first, end)
        copy_ended(wave)
        stream = torch.cuda.current_stream()
        run = {"pack_start": event(stream), "first": not wave["runs"]}
        pack_and_checksum(rows, sizes, parts, dst, offsets, first, end)
        run["pack_end"] = event(stream)
        wave["runs"].append(run)

    def timed_sums(parts: Any, sums: Any) -> None:
        if now["wave"] is not None:
            copy_ended(now["wave"])
        return sum_partials(parts, sums)

    def timed_take(self: Any, pages: int) -> Any:
        got = take(self, pages)
        wave = now["wave"]
        if wave is not None and wave["runs"]:
            wave["runs"][-1]["copy_start"] = event(now["copy"])
        return got

    def timed_view(self: Any, page: int, nbytes: int) -> Any:
        wave = now["wave"]
        if wave is not None and wave["runs"]:
            wave["runs"][-1]["bytes"] = int(nbytes)
        return view(self, page, nbytes)

    tiered.Engine.save = timed_save
    device.GpuDevice.issue_drain = timed_drain
    pack.pack_and_checksum, pack.sum_partials = timed_pack, timed_sums
    WavePages.take, HostPool.view = timed_take, timed_view
    atexit.register(lambda: saves and report(len(saves) - 1))
    bench = Path(__file__).resolve().parent / "bench.py"
    sys.argv = [str(bench), *rest]
    runpy.run_path(str(bench), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
