"""When a drain's copies ran, in saves the profiler does not slow: scripts/bench.py with CUDA timing
events around each drained wave.

    python3 scripts/drain_timing.py --params 2e9 --train-steps 20 --batch 48 --scale 24 --free-gb 6 \
        --saves 6 --window-steps 3 --methods tiered_overlap --out short.json

takes scripts/bench.py's arguments and runs it with two hooks: at each `Engine.save` call, an
event on the training stream; around each wave `GpuDevice.issue_drain` issues, an event on the
copy stream before the wave's copies are issued and one after them. A wave's first event fires
once the copies before it are done *and* the writer has begun to issue this wave, so a gap
between one wave's last copy and the next wave's first event is time the copy stream stood idle
waiting for the writer to begin it; the writer's host time from there to the wave's first copy,
and every wait on the GPU, count inside the wave. Each save prints one line (`# drain-timing save N: ...`, `summary`): when its copies
started and ended after the training stream reached the call, the writer's gaps between waves,
and how much longer the span was than its bytes at the link's rate.

A traced save (`bench.py --trace`) shows every copy but is the row's last, after a pause, and
runs under the profiler's host cost; these events cost the writer two records a wave.
"""

from __future__ import annotations

import atexit
import runpy
import sys
from pathlib import Path
from typing import Any, Sequence

LINK_GBPS = 55.0
"""The device-to-pinned-host rate the span is held against (an H200's, docs/benchmarks.md)."""


def summary(waves: Sequence[tuple[float, float, int]], link_gbps: float = LINK_GBPS) -> dict:
    """One save's drain from its waves' (start ms, end ms, bytes), times from the call's event on
    the training stream: `first_ms` and `last_ms`, the copy stream's first start and last end;
    `writer_gaps_ms`, idle between a wave's end and the next one's start (and the largest five);
    `idle_ms`, the span less the bytes at `link_gbps`."""
    if not waves:
        return {"waves": 0}
    gaps = [max(0.0, b[0] - a[1]) for a, b in zip(waves, waves[1:])]
    nbytes = sum(w[2] for w in waves)
    first, last = waves[0][0], waves[-1][1]
    return {"waves": len(waves), "gb": round(nbytes / 1e9, 2), "first_ms": round(first, 1), "last_ms": round(last, 1),
            "writer_gaps_ms": round(sum(gaps), 1), "largest_gaps_ms": sorted((round(g, 2) for g in gaps), reverse=True)[:5],
            "span_ms": round(last - first, 1), "idle_ms": round(last - first - nbytes / link_gbps / 1e6, 1)}


def main(argv: list[str]) -> None:
    import torch

    import tiered
    from tiered.gpu.device import GpuDevice

    saves: list[dict[str, Any]] = []
    save, issue_drain = tiered.Engine.save, GpuDevice.issue_drain

    def event(stream: Any) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def report(n: int) -> None:
        s = saves[n]
        if s.get("done"):
            return
        s["done"] = True
        for _, end, _ in s["waves"]:
            end.synchronize()
        call = s["call"]
        got = summary([(call.elapsed_time(a), call.elapsed_time(b), nbytes) for a, b, nbytes in s["waves"]])
        print(f"# drain-timing save {n + 1}: {got}", flush=True)

    def timed_save(self: Any, *args: Any, **kwargs: Any) -> Any:
        if saves:
            report(len(saves) - 1)  # (its copies are done: the bench waited for it to be durable)
        saves.append({"call": event(torch.cuda.current_stream()), "waves": []})
        return save(self, *args, **kwargs)

    def timed_drain(self: Any, seg: Any, sizes: Any, acquire: Any) -> Any:
        start = event(self.writer_stream)
        drained = issue_drain(self, seg, sizes, acquire)
        if saves:
            saves[-1]["waves"].append((start, event(self.writer_stream), sum(int(h.numel()) for _, _, h, _ in drained.runs)))
        return drained

    tiered.Engine.save = timed_save
    GpuDevice.issue_drain = timed_drain
    atexit.register(lambda: saves and report(len(saves) - 1))
    bench = Path(__file__).resolve().parent / "bench.py"
    sys.argv = [str(bench), *argv]
    runpy.run_path(str(bench), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
