"""What the drain's pack-and-checksum kernel costs the GPU, alone and beside a training-like load.

    python3 scripts/checksum_probe.py [--gb 4] [--reps 5] [--out r.json]

Rows of compressed-looking chunks (1 MiB chunks: rows of 1 MiB + 8 KiB, 0.78-0.95 MiB used,
random bytes) are drained as `Device.issue_drain` drains a wave: runs of rows of at most 64 MiB
(the write staging buffer), each packed end to end with `tiered.gpu_checksum` on a stream of its
own, then the checksums summed. Reported:
- alone: the GPU time of packing `--gb` GB (CUDA events), its rate, and the host time spent
  launching it (what the writer thread spends per run);
- beside load: a loop of bf16 matmuls on another stream (training's kernels: 8192 x 8192 x 8192,
  each ~1.3 ms on an H100) timed with and without the packing running at once; the difference is
  what the kernel takes from training;
- the checksums against `tiered.checksum.wsum64_rows_torch` (exact).
Whichever `tiered` is first on `sys.path` is measured: an A/B runs it twice with PYTHONPATH set
(the kernel's earlier one-program-per-row form took `sums` where it now takes `parts`). No
timing is asserted; docs/benchmarks.md quotes what it printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tiered import gpu_checksum
from tiered.checksum import wsum64_rows_torch
from tiered.chunks import extent_runs

MiB = 1 << 20
STRIDE = MiB + 8192
STAGING = 64 * MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=4.0, help="compressed bytes packed per repetition, GB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="write the figures here as JSON")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "checksum_probe needs a GPU"
    gpu_checksum.warm_up(torch.cuda.current_device())
    assert gpu_checksum.available(), f"the kernel does not run here: {gpu_checksum._state['why']}"
    new_api = hasattr(gpu_checksum, "sum_partials")
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    n = int(args.gb * 1e9 / (0.865 * MiB))
    rows = torch.randint(-2**31, 2**31 - 1, (n, STRIDE // 4), dtype=torch.int32, device=dev, generator=g).view(torch.uint8)
    sizes = torch.randint(int(0.78 * MiB), int(0.95 * MiB), (n,), generator=torch.Generator().manual_seed(1)).tolist()
    extents, bounds, offsets = extent_runs(sizes, STAGING)
    sizes_d = torch.tensor(sizes, device=dev)
    words_d = torch.tensor(offsets // 4, device=dev)
    staging = torch.empty(STAGING, dtype=torch.uint8, device=dev)
    sums = torch.empty(n, dtype=torch.int64, device=dev)
    stream = torch.cuda.Stream()
    packed = sum(extents)

    def drain() -> float:
        """Issue one drain of every row on `stream`; returns the host seconds spent issuing it."""
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            parts = gpu_checksum.partials(n, dev) if new_api else sums
            for i, k, _ in bounds:
                gpu_checksum.pack_and_checksum(rows, sizes_d, parts, staging, words_d, i, k)
            if new_api:
                gpu_checksum.sum_partials(parts, sums)
        return time.perf_counter() - t0

    drain()
    stream.synchronize()
    with torch.cuda.stream(stream):
        cols = torch.arange(STRIDE, device=dev)  # (the padding up to each extent is zero, as the kernel reads it)
        want = wsum64_rows_torch(rows.masked_fill(cols[None, :] >= sizes_d[:, None], 0))
    stream.synchronize()
    exact = bool(torch.equal(want, sums))

    alone, host = [], []
    for _ in range(args.reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        host.append(drain())
        b.record(stream)
        b.synchronize()
        alone.append(a.elapsed_time(b))

    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    train = torch.cuda.Stream()

    def load(matmuls: int, beside: bool) -> tuple[float, int]:
        """The load's GPU milliseconds, and how many drains ran beside it."""
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(train):
            a.record()
            for _ in range(matmuls):
                torch.mm(x, x)
            b.record()
        drains = 0
        while beside and not b.query():  # keep the packing going for as long as the load runs
            drain()
            stream.synchronize()
            drains += 1
        b.synchronize()
        return a.elapsed_time(b), drains

    one = statistics.median(load(20, False)[0] for _ in range(3)) / 20
    matmuls = max(20, int(2.5 * statistics.median(alone) / one))
    quiet, busy, drains = [], [], []
    for _ in range(args.reps):
        quiet.append(load(matmuls, False)[0])
        t, k = load(matmuls, True)
        busy.append(t)
        drains.append(k)
    out = {
        "device": torch.cuda.get_device_name(), "kernel": "slices" if new_api else "row per program",
        "rows": n, "packed_gb": round(packed / 1e9, 3), "runs": len(bounds), "checksums_exact": exact,
        "alone_ms": [round(t, 2) for t in alone], "alone_gbps": round(packed / 1e6 / statistics.median(alone), 1),
        "launch_host_ms": [round(1e3 * t, 2) for t in host],
        "load_matmuls": matmuls, "load_quiet_ms": [round(t, 1) for t in quiet], "load_beside_ms": [round(t, 1) for t in busy],
        "drains_beside": drains,
        "taken_from_load_ms_per_gb": [round((t - statistics.median(quiet)) / (k * packed / 1e9), 2)
                                      for t, k in zip(busy, drains)],
    }
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
