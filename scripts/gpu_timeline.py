"""Where a save's window spends its GPU time: a torch.profiler trace of one window, reduced to
what each training step's kernels took and what the save's own GPU work took beside them.

A guarded 24 GB save slowed the step after it by 230-310 ms on one lent H100 (docs/benchmarks.md) while the GIL was late only ~50 ms in that window. On the GPU, a timeline
tells apart two things the rest can be:
- the training stream's kernels ran slower (they shared the SMs and memory with the save's
  packing, compression and checksums): a step's busy time grows;
- the training stream stood idle (its optimizer step waited for the save's reads, or the host
  could not launch): a step's idle time inside its span grows.

`scripts/bench.py --scale ... --trace` records one more save's window of each row with it, after
the measured ones (profiling costs the host microseconds per operator: that window's stall is
kept apart). Training runs on the stream whose kernels ran longest; each of its operations
belongs to the step that launched it (through the CUDA call that shares its correlation id);
every other stream's work is the save's. Times are in ms from the save call's start. The drain's
copies to the host (on every stream they ran on) have the link's idle time between them split
into gaps where the next copy was issued late and those where it waited on the GPU (`copy_gaps`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections import defaultdict
from typing import Any

import torch

SAVE_MARK = "bench.save"
STEP_MARK = "bench.step"
"""Names of the `torch.profiler.record_function` ranges a traced window carries."""
DRAIN_COPY_BYTES = 1 << 20
"""A copy to the host this large is a drained run's (a wave's sizes and checksums are kilobytes)."""


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def overlap_ms(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of (union of xs) ∩ (union of ys)."""
    return union_ms(xs) + union_ms(ys) - union_ms(xs + ys)


def copy_gaps(copies: list[dict], launch: dict[Any, dict]) -> dict:
    """Where a drain's copies to the host (on one stream or several) left the link idle: a gap is
    time when none of them ran. `late_ms`, the part of a gap before the next copy was even issued
    (its CUDA call ended after the copies before it had), and `gpu_ms`, the rest (issued in time,
    it waited on the GPU: for the packing it depends on, or for its turn). `launch`: runtime
    calls by correlation id. `busy_ms`: the union of the copies' spans."""
    copies = sorted(copies, key=lambda e: e["ts"])
    late = gpu = 0.0
    n_late = n_gpu = 0
    end = copies[0]["ts"] + copies[0]["dur"] if copies else 0.0
    for b in copies[1:]:
        gap = b["ts"] - end
        if gap > 0:
            call = launch.get(b.get("args", {}).get("correlation"))
            issued = call["ts"] + call["dur"] if call else end
            part = min(gap, max(0.0, issued - end))
            late, gpu = late + part, gpu + gap - part
            n_late, n_gpu = n_late + (part > 0), n_gpu + (part < gap)
        end = max(end, b["ts"] + b["dur"])
    busy = end - copies[0]["ts"] - late - gpu if copies else 0.0  # (the span less its gaps)
    return {"copies": len(copies), "streams": len({e.get("args", {}).get("stream") for e in copies}),
            "busy_ms": round(busy / 1e3, 1), "late_ms": round(late / 1e3, 1), "late_gaps": n_late,
            "gpu_ms": round(gpu / 1e3, 1), "gpu_gaps": n_gpu}


def summarize(trace: dict) -> dict:
    """The window's timeline from a chrome trace (`torch.profiler`'s export): per training step,
    the CPU span and the GPU busy and idle time of what it launched on the training stream (the
    stream whose kernels ran longest); the save's GPU work on its other streams, by stream and
    kind; how long training's and the save's kernels ran at once."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    marks = [e for e in events if e.get("cat") == "user_annotation"]
    save = next((e for e in marks if e["name"] == SAVE_MARK), None)
    steps = sorted((e for e in marks if e["name"].startswith(STEP_MARK)), key=lambda e: e["ts"])
    if not steps:
        return {"error": f"no {STEP_MARK} ranges in the trace"}
    t0 = save["ts"] if save else steps[0]["ts"]
    main_tid = steps[0]["tid"]

    def ms(ts: float) -> float:
        return (ts - t0) / 1e3

    calls = {e["args"]["correlation"]: e for e in events
             if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    launch = {k: e["ts"] for k, e in calls.items()}
    step_spans = [(ms(e["ts"]), ms(e["ts"] + e["dur"])) for e in steps]
    gpu_ops = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy_by_stream: dict[Any, float] = defaultdict(float)
    for e in gpu_ops:
        if e["cat"] == "kernel":
            busy_by_stream[e.get("args", {}).get("stream")] += e["dur"]
    train_stream = max(busy_by_stream, key=busy_by_stream.get) if busy_by_stream else None
    train: dict[int, list] = defaultdict(list)  # step index -> GPU intervals of its operations
    saves: dict[str, list] = defaultdict(list)  # "stream kind" -> GPU intervals
    save_bytes: dict[str, int] = defaultdict(int)
    copies: dict[Any, list] = defaultdict(list)  # stream -> the save's copies on it
    save_kernels: dict[str, float] = defaultdict(float)
    train_all: list = []
    for e in gpu_ops:
        cat, args = e["cat"], e.get("args", {})
        span = (ms(e["ts"]), ms(e["ts"] + e["dur"]))
        if args.get("stream") == train_stream:
            at = ms(launch.get(args.get("correlation"), e["ts"]))
            k = next((i for i, (a, b) in enumerate(step_spans) if a <= at <= b), -1 if at < step_spans[0][0] else None)
            if k is not None:
                train[k].append(span)
            if cat == "kernel":
                train_all.append(span)
            continue
        key = f"stream {args.get('stream')} {cat}"
        saves[key].append(span)
        if cat == "gpu_memcpy":
            save_bytes[key] += int(args.get("bytes", 0))
            copies[args.get("stream")].append(e)
        elif cat == "kernel":
            save_kernels[e["name"][:60]] += span[1] - span[0]
    out: dict[str, Any] = {"train_stream": train_stream, "steps": []}
    for i, (a, b) in enumerate(step_spans):
        gpu = train.get(i, [])
        busy = union_ms(gpu)
        first, last = (min(s for s, _ in gpu), max(t for _, t in gpu)) if gpu else (0.0, 0.0)
        out["steps"].append({"cpu": [round(a, 1), round(b, 1)], "gpu": [round(first, 1), round(last, 1)],
                             "busy_ms": round(busy, 1), "idle_ms": round(last - first - busy, 1)})
    if train.get(-1):
        out["before_first_step_busy_ms"] = round(union_ms(train[-1]), 1)  # the save call's own launches
    save_kernel_spans = [s for key, spans in saves.items() if key.endswith("kernel") for s in spans]
    out["save"] = {key: {"n": len(spans), "busy_ms": round(union_ms(spans), 1),
                         "from_ms": round(min(s for s, _ in spans), 1), "to_ms": round(max(t for _, t in spans), 1),
                         **({"gb": round(save_bytes[key] / 1e9, 2)} if key in save_bytes else {})}
                   for key, spans in sorted(saves.items())}
    drain = [e for on in copies.values() for e in on  # (the save's drain: its large copies to the host)
             if "DtoH" in e["name"] and int(e["args"].get("bytes", 0)) >= DRAIN_COPY_BYTES]
    if drain:
        out["drain_copy_gaps"] = {"from_ms": round(ms(min(e["ts"] for e in drain)), 1),
                                  "to_ms": round(ms(max(e["ts"] + e["dur"] for e in drain)), 1),
                                  **copy_gaps(drain, calls)}
    out["save_kernels_top"] = {k: round(v, 1) for k, v in sorted(save_kernels.items(), key=lambda kv: -kv[1])[:6]}
    out["kernels_at_once_ms"] = round(overlap_ms(train_all, save_kernel_spans), 1)
    opt = [e for e in marks if e["name"].startswith("Optimizer.step") and e["tid"] == main_tid
           and step_spans[0][0] <= ms(e["ts"]) <= step_spans[0][1]]
    if opt:  # the first guarded step waits here for the save's reads to be issued
        first = min(opt, key=lambda e: e["ts"])
        out["first_optimizer_step"] = [round(ms(first["ts"]), 1), round(first["dur"] / 1e3, 1)]
    return out


class Timeline:
    """`with Timeline(device) as tl: ...`; then `tl.summary` (see `summarize`). `keep`: a path to
    write the whole chrome trace to as well."""

    def __init__(self, device: str, keep: str | None = None):
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts)
        self.keep = keep
        self.summary: dict = {}

    def __enter__(self) -> "Timeline":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                self.summary = summarize(json.load(f))
            if self.keep:
                os.replace(path, self.keep)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
