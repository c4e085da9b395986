"""Where a drain's copies wait, in saves the profiler does not slow: scripts/bench.py with CUDA
timing events around every drained run.

    python3 scripts/drain_timing.py --params 2e9 --train-steps 20 --batch 48 --scale 24 --free-gb 6 \
        --saves 6 --window-steps 3 --methods tiered_overlap --out short.json

takes scripts/bench.py's arguments and runs it with hooks on the drain's public steps
(tiered.gpu.pack's `pack_and_checksum` and `sum_partials`, tiered.stage.pools' `WavePages.take`
and `HostPool.view`; tiered.gpu.batch_copy's `copy_batch`): for each run of rows a drained wave
sends to the host, an event on the packing stream before and after its packing, and one on the
copy stream before and after its copy (the copy's start event fires once the copy before it is
done *and* its own packing is). A run copied straight from the slab's rows (tiered.gpu.drain's
`DIRECT_COPIES`) has no packing: its idle link is the writer's (or its wave's compression). A copy
that starts after the one before it ended left the link idle; that idle is put down to

- **the writer**, where the run's packing began after the link had gone idle: its packing had not
  been issued yet (the writer thread's host time), or it waited on the GPU for what a wave's first
  packing waits for (the wave's compression, its sizes crossing to the GPU);
- **the packing**, where the packing began in time and ended late (its kernel shares the SMs with
  training's).

Each save prints one line (`# drain-timing save N: ...`, `summary`), times from the moment the
training stream reached the `Engine.save` call: the first copy's start, the last one's end, the
copies' own rate, the idle and its two parts (and how much of each fell at a wave's first run),
the packing kernels' times, and the writer's host time issuing each wave. The idle at a wave's
first run is also set against when the wave's compression ended (an event after it on its encode
stream) and when the writer began issuing its drain (an event on a stream with no work, which
fires as the host records it): `wave_starts`.

`--alternate '{"A": {...}, "B": {...}}'` makes the saves alternate between two settings of the
drain's module constants (`tiered.gpu.write.DRAIN_DEPTH`, tiered.gpu.drain's, tiered.gpu.device's): the first save
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


def summary(runs: Sequence[dict], issue_ms: Sequence[float] = (), starts: Sequence[dict] = ()) -> dict:
    """One save's drain from its runs, in order: each a dict of `RUN_KEYS` (ms from the call's
    event), `bytes` and `first` (the first run of its wave); `issue_ms`, the writer's host time
    issuing each wave; `starts`, per wave in order, when it was `encoded` (its compression done)
    and `issued` (the writer began issuing its drain), ms from the call's event. See the module's
    docstring for how the idle link is put down."""
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
    if starts and len(starts) == got["waves"]:
        got.update(wave_starts(runs, starts))
    return got


def wave_starts(runs: Sequence[dict], starts: Sequence[dict]) -> dict:
    """The idle link at each wave's first run (after the first wave) against what that run's
    packing waited for: the wave's compression (`encoded`) and the writer's issuing of its drain
    (`issued`), each late by how far past the copy before it ended it came (capped at the idle);
    and how far ahead of that copy's end each came (median: negative is late)."""
    firsts = [n for n, r in enumerate(runs) if r["first"]]
    idle = issued_late = encoded_late = 0.0
    issued_ahead, encoded_ahead = [], []
    for n, start in zip(firsts[1:], starts[1:]):
        end = runs[n - 1]["copy_end"]
        gap = max(0.0, runs[n]["copy_start"] - end)
        idle += gap
        issued_late += min(gap, max(0.0, start["issued"] - end))
        encoded_late += min(gap, max(0.0, start["encoded"] - end))
        issued_ahead.append(end - start["issued"])
        encoded_ahead.append(end - start["encoded"])
    if not issued_ahead:
        return {}
    return {"at_wave_start_idle_ms": round(idle, 1), "issued_late_ms": round(issued_late, 1),
            "encoded_late_ms": round(encoded_late, 1),
            "issued_ahead_ms_median": round(statistics.median(issued_ahead), 2),
            "encoded_ahead_ms_median": round(statistics.median(encoded_ahead), 2)}


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
    import tiered.gpu.batch_copy as batch_copy
    import tiered.gpu.device as device
    import tiered.gpu.drain as drain
    import tiered.gpu.pack as pack
    import tiered.gpu.write as write
    from tiered.stage.pools import HostPool, WavePages

    where: dict[str, Any] = {}
    if args.alternate is not None:
        for setting in args.alternate.values():
            for key in setting:
                holder = next((m for m in (write, drain, device) if hasattr(m, key)), None)
                if holder is None:
                    raise SystemExit(f"--alternate: {key} is not a constant of tiered.gpu.write, tiered.gpu.drain or "
                                     "tiered.gpu.device")
                where[key] = holder

    saves: list[dict[str, Any]] = []
    now: dict[str, Any] = {"wave": None, "copy": None}
    save, issue_drain, pack_and_checksum, sum_partials, take, view, deliver_sizes, copy_batch = (
        tiered.Engine.save, device.GpuDevice.issue_drain, pack.pack_and_checksum, pack.sum_partials, WavePages.take,
        HostPool.view, device.deliver_sizes, batch_copy.copy_batch)
    probe: dict[int, Any] = {}  # per GPU, a stream with no work: an event on it fires when the host records it

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
        starts = [{"issued": call.elapsed_time(w["issued"]), "encoded": call.elapsed_time(e)}
                  for w, e in zip(s["waves"], s["encoded"])] if len(s["encoded"]) == len(s["waves"]) else []
        got = summary(timed, [w["issue_ms"] for w in s["waves"]], starts)
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
        saves.append({"call": event(torch.cuda.current_stream()), "waves": [], "encoded": [], "variant": variant})
        return save(self, *a, **k)

    def timed_deliver(pendings: Any) -> Any:
        got = deliver_sizes(pendings)  # (on the wave's encode stream, after its compression)
        if saves:
            saves[-1]["encoded"].append(event(torch.cuda.current_stream()))
        return got

    def timed_drain(self: Any, seg: Any, sizes: Any, acquire: Any) -> Any:
        if self.index not in probe:
            probe[self.index] = torch.cuda.Stream(self.device)
        wave = {"runs": [], "issued": event(probe[self.index])}
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

    def packed_run(wave: Any) -> bool:
        return wave is not None and bool(wave["runs"]) and not wave["runs"][-1].get("direct")

    def timed_take(self: Any, pages: int) -> Any:
        got = take(self, pages)
        if packed_run(now["wave"]):
            now["wave"]["runs"][-1]["copy_start"] = event(now["copy"])
        return got

    def timed_view(self: Any, page: int, nbytes: int) -> Any:
        if packed_run(now["wave"]):
            now["wave"]["runs"][-1]["bytes"] = int(nbytes)
        return view(self, page, nbytes)

    def timed_batch(dsts: Any, srcs: Any, sizes: Any, stream: Any) -> None:
        wave = now["wave"]
        if wave is None:
            return copy_batch(dsts, srcs, sizes, stream)
        start = event(stream)  # (fires once the copies before it, and the wave's compression, are done)
        run = {"pack_start": start, "pack_end": start, "copy_start": start, "first": not wave["runs"],
               "direct": True, "bytes": int(sum(int(n) for n in sizes))}
        copy_batch(dsts, srcs, sizes, stream)
        run["copy_end"] = event(stream)
        wave["runs"].append(run)

    tiered.Engine.save = timed_save
    device.GpuDevice.issue_drain, device.deliver_sizes = timed_drain, timed_deliver
    pack.pack_and_checksum, pack.sum_partials = timed_pack, timed_sums
    WavePages.take, HostPool.view = timed_take, timed_view
    batch_copy.copy_batch = timed_batch
    atexit.register(lambda: saves and report(len(saves) - 1))
    bench = Path(__file__).resolve().parent / "bench.py"
    sys.argv = [str(bench), *rest]
    runpy.run_path(str(bench), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
