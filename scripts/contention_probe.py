"""What a background process's kind of work costs a training step on the same machine (issue 15).

    python3 scripts/contention_probe.py [--loads cpu:4,cpu-idle:4,gpu,disk,all,process] [--block 10] [--blocks 12]

`migration: process` moves a step down the tiers in a child process: ANS decode on the GPU
(stream priority 0), zstd on a quarter of the cores at nice +10, and writes to the lower tier. The
bench (`measure_migration`) measures what the whole of it costs a training step; this probe takes
the parts apart. It trains the bench's model (the standard 200M-parameter GPT, batch 16) and
times training steps (forward, backward, AdamW, synchronized) with a child process running one
kind of load, against as many steps with the child paused, alternating every `--block` steps (so
that the machine's own drift, which moved the bench's idle medians by 10-15% between rounds,
falls on both sides alike):

- `cpu:N`: N threads compressing 64 MiB of fp32 values with zstd (level 3) in a loop, the process
  at nice +10, as the migrator's child runs (a quarter of 16 cores: 4).
- `cpu-idle:N`: the same under Linux's SCHED_IDLE policy (it runs only on otherwise idle CPUs).
- `gpu`: nvCOMP ANS decode of 256 MiB, then a copy of the result to pinned host memory, on a
  stream of priority 0, paced at `--gpu-gbps` of decoded bytes (the migrator's GPU work, at its
  pace), in a CUDA context of its own, as the child's is.
- `disk`: O_DIRECT writes of 16 MiB blocks under `--dir`, fsync'd, at the disk's speed.
- `all`: cpu:4, gpu and disk at once, every thread at nice +10 (as in the migrator's child; the
  `gpu` and `disk` loads alone run at nice 0).
- `process`, `daemon`: the real migrator in that mode, recompressing the model's state ans -> zstd
  to a shared tier under `--dir` (the bench's `measure_migration`, whose own rounds these are).

Prints one line per load: the step's median and quartiles with the load and without, and the
difference. No timing is asserted; docs/benchmarks.md quotes what it printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


# --- the child: one kind of load until its stdin closes -----------------------------------
class Switch:
    """On while the parent says so (`on`/`off` lines on stdin); `stop` once stdin closes."""

    def __init__(self) -> None:
        self.on, self._stopped = threading.Event(), False

    def wait(self) -> bool:
        """Block while off; False once stopped."""
        self.on.wait()
        return not self._stopped

    def stop(self) -> None:
        self._stopped = True
        self.on.set()


def _cpu_load(threads: int, idle: bool, stop: Switch) -> list[threading.Thread]:
    import zstandard

    os.setpriority(os.PRIO_PROCESS, 0, 10)
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    data = (torch.randn(16 * MiB, generator=torch.Generator().manual_seed(1)) * 0.02).numpy().tobytes()

    def run() -> None:
        if idle:  # (the policy is per thread on Linux; new threads inherit the creator's)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        c = zstandard.ZstdCompressor(level=3)
        while stop.wait():
            c.compress(data)

    return [threading.Thread(target=run, daemon=True) for _ in range(threads)]


def _gpu_load(gbps: float, stop: Switch) -> list[threading.Thread]:
    sys.path.insert(0, str(HERE.parent))
    from tiered.codecs import _nvcomp

    chunk, n = MiB, 256
    stream = torch.cuda.Stream(priority=0)
    with torch.cuda.stream(stream):
        raw = (torch.randn(n * chunk // 4, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) * 0.02)
        raw = raw.view(torch.uint8)
        stride = _nvcomp.max_compressed("ANS", chunk, "<f4")
        slab = torch.empty(n * stride, dtype=torch.uint8, device="cuda")
        out = torch.empty_like(raw)
        host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=True)
    offsets = [k * chunk for k in range(n)]
    sizes = _nvcomp.encode("ANS", "<f4", stream, chunk, raw, offsets, [chunk] * n, slab,
                           [k * stride for k in range(n)], stride).sizes()

    def run() -> None:
        with torch.cuda.stream(stream):
            while stop.wait():
                t0 = time.perf_counter()
                _nvcomp.decode("ANS", "<f4", stream, chunk, slab, [k * stride for k in range(n)], sizes, out,
                               offsets, [chunk] * n)
                host.copy_(out, non_blocking=True)
                stream.synchronize()
                time.sleep(max(0.0, raw.numel() / (gbps * 1e9) - (time.perf_counter() - t0)))

    return [threading.Thread(target=run, daemon=True)]


def _disk_load(root: Path, stop: Switch) -> list[threading.Thread]:
    import mmap

    root.mkdir(parents=True, exist_ok=True)
    buf = mmap.mmap(-1, 16 * MiB)
    buf.write(os.urandom(16 * MiB))

    def run() -> None:
        k = 0
        while stop.wait():
            path = root / f"load-{k % 2}.bin"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
            try:
                for _ in range(64):  # 1 GiB a file
                    if not stop.on.is_set():
                        break
                    os.write(fd, buf)
                os.fsync(fd)
            finally:
                os.close(fd)
            k += 1

    return [threading.Thread(target=run, daemon=True)]


def child(load: str, gbps: float, root: Path) -> None:
    stop = Switch()
    kind, _, n = load.partition(":")
    work: list[threading.Thread] = []
    if kind in ("cpu", "cpu-idle"):
        work += _cpu_load(int(n or 4), kind == "cpu-idle", stop)
    if kind in ("gpu", "all"):
        work += _gpu_load(gbps, stop)
    if kind in ("disk", "all"):
        work += _disk_load(root, stop)
    if kind == "all":
        work += _cpu_load(4, False, stop)
    if not work:
        raise SystemExit(f"contention_probe: unknown load {load!r}")
    for t in work:
        t.start()
    print("ready", flush=True)
    for line in sys.stdin:  # until the parent closes it
        if line.strip() == "on":
            stop.on.set()
        elif line.strip() == "off":
            stop.on.clear()
    stop.stop()
    for t in work:
        t.join()


# --- the parent: training steps with and without a child ------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="cpu:4,cpu-idle:4,gpu,disk,all")
    ap.add_argument("--block", type=int, default=10, help="training steps per block, with the load or without")
    ap.add_argument("--blocks", type=int, default=12, help="blocks with the load, as many without, alternating")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--gpu-gbps", type=float, default=1.0, help="decoded GB/s of the gpu load")
    ap.add_argument("--dir", default="./.tiered/contention")
    ap.add_argument("--out", default=None, help="write results JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path(args.dir)
    if args.child:
        child(args.child, args.gpu_gbps, root)
        return
    if not torch.cuda.is_available():
        sys.exit("contention_probe: needs a CUDA GPU")
    sys.path.insert(0, str(HERE))
    from bench import measure_migration, train

    model, opt, info, step_fn, _ = train("cuda", 200e6, 30, 256, args.batch)

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step_fn()
            torch.cuda.synchronize()
            out.append(1e3 * (time.perf_counter() - t0))
        return out

    steps(10)
    results = {"model": info, "cpus": os.cpu_count(), "loads": []}
    print(f"{info['params'] / 1e6:.0f}M parameters, batch {args.batch}, {os.cpu_count()} CPUs; "
          f"{args.blocks} blocks of {args.block} steps with each load, alternating with as many without")
    print("| load | step without (quartiles) | step with (quartiles) | difference |")
    print("|---|---|---|---|")
    for load in args.loads.split(","):
        if load in ("process", "daemon"):
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            m = measure_migration(state, step_fn, "cuda", root / "migration", "ans", load)
            results["loads"].append(m)
            qi, qb = m["train_step_ms_idle_quartiles"], m["train_step_ms_migrating_quartiles"]
            print(f"| {load} (the migrator) | {m['train_step_ms_idle']} ms ({qi[0]:.1f}–{qi[1]:.1f}) "
                  f"| {m['train_step_ms_migrating']} ms ({qb[0]:.1f}–{qb[1]:.1f}) | {m['train_step_slowdown_pct']:+.1f}% |",
                  flush=True)
            rounds = m["steps_ms"]["migrating"]
            first = [t for r in rounds for t in r[:5]]
            rest = [t for r in rounds for t in r[5:]]
            print(f"|   its first 5 steps after each save / the rest | | {statistics.median(first):.2f} / "
                  f"{statistics.median(rest):.2f} ms | |", flush=True)
            continue
        idle: list[float] = []
        busy: list[float] = []
        proc = subprocess.Popen([sys.executable, __file__, "--child", load, "--gpu-gbps", str(args.gpu_gbps),
                                 "--dir", str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            if proc.stdout.readline().strip() != "ready":
                sys.exit(f"contention_probe: the {load} load did not start")
            for _ in range(args.blocks):
                for on, times in (("on", busy), ("off", idle)):
                    proc.stdin.write(on + "\n")
                    proc.stdin.flush()
                    time.sleep(0.2)  # (the load gets going, or winds down)
                    times += steps(args.block)
        finally:
            proc.stdin.close()
            proc.wait(120)
        qi, qb = statistics.quantiles(idle, n=4), statistics.quantiles(busy, n=4)
        row = {"load": load, "idle_ms": round(qi[1], 2), "idle_quartiles": [round(qi[0], 2), round(qi[2], 2)],
               "busy_ms": round(qb[1], 2), "busy_quartiles": [round(qb[0], 2), round(qb[2], 2)],
               "slowdown_pct": round(100 * (qb[1] / qi[1] - 1), 1)}
        results["loads"].append(row)
        print(f"| {load} | {row['idle_ms']} ms ({qi[0]:.1f}–{qi[2]:.1f}) | {row['busy_ms']} ms ({qb[0]:.1f}–{qb[2]:.1f}) "
              f"| {row['slowdown_pct']:+.1f}% |", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
