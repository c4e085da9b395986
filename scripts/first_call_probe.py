#!/usr/bin/env python3
"""Time the first `Engine.save` calls of a fresh process, after `reserve()`.

What a first save does that a warm one does not (kernels loaded, nvCOMP objects made), without
training around it.

    python3 scripts/first_call_probe.py [--tensors 64] [--saves 4]

A state of `--tensors` fp32 tensors of 16 MiB on the GPU (64: 1 GiB); `reserve()`, then waits
for the pinned pool and the checksum kernel, then saves each step and prints the call's time,
the call plus a device synchronize, and the GPU phases of the call (`handle.timings`). To compare
two versions, run it with each first on PYTHONPATH, alternately (docs/benchmarks.md, session 15).
Needs a GPU and the GPU stack.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import tiered  # noqa: E402

KEYS = ("cuda:0.layout_ms", "cuda:0.pack_ms", "cuda:0.encode_ms", "staged_ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--saves", type=int, default=4)
    args = ap.parse_args()
    print("tiered from", pathlib.Path(tiered.__file__).parent, flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"t{i}": torch.randn(1 << 22, device="cuda", generator=g) for i in range(args.tensors)}
    with tempfile.TemporaryDirectory() as root, \
            tiered.Engine.from_config({"tiers": [{"name": "l", "kind": "local", "path": root}]}) as engine:
        t = time.perf_counter()
        engine.reserve(state)
        print(f"reserve {1e3 * (time.perf_counter() - t):.1f} ms", flush=True)
        engine.wait_pinned(60)
        engine.workers.wait_warm(60)
        for step in range(1, args.saves + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            handle = engine.save(step, state)
            call = time.perf_counter() - t
            torch.cuda.synchronize()
            synced = time.perf_counter() - t
            handle.wait()
            print(f"save {step}: call {1e3 * call:.1f} ms, call + synchronize {1e3 * synced:.1f} ms",
                  {k: round(handle.timings.get(k, -1), 1) for k in KEYS}, flush=True)


if __name__ == "__main__":
    main()
