#!/usr/bin/env python3
"""What a distributed restore costs besides its reads: a state of ten small GPTs with AdamW
(10,480 tensors a rank, a few KB each), saved once through `Engine.save` under torchrun, then
restored four times; rank 0 prints each restore's time and where it went (the DCP metadata read,
the planner's steps, the reads and decodes).

    torchrun --nproc-per-node 2 scripts/restore_probe.py DIR [--device cpu|cuda]

On the CPU machine it runs on gloo; with --device cuda each rank uses its own GPU and the default
group is NCCL. To compare two versions, put each first on PYTHONPATH in turn, alternately
(docs/benchmarks.md, session 27).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiered  # noqa: E402
from call_probe import replicas  # noqa: E402
from tiered import dcp_storage  # noqa: E402

SPENT: dict[str, float] = collections.defaultdict(float)


def timed(owner, name: str) -> None:
    """Add the time spent in `owner.name` to SPENT[name]."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPENT[name] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="where the step is saved (a local tier)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    for owner, name in ((dcp_storage.StepReader, "read_metadata"), (dcp_storage.StepReader, "read_data"),
                        (dcp_storage, "_read_rank"), (dcp_storage, "_decode_batch"),
                        (dcp_storage.SafeLoadPlanner, "set_up_planner"),
                        (dcp_storage.SafeLoadPlanner, "create_local_plan")):
        timed(owner, name)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    reps = replicas(args.device)
    state = {f"r{i}": {"model": m.state_dict(), "optim": o.state_dict()} for i, (m, o) in enumerate(reps)}
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": args.dir}], "migration": "external"}
    where = tiered.__file__.rsplit("/tiered/", 1)[0]
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        engine.wait()
        for i in range(4):
            dist.barrier()
            SPENT.clear()
            t0 = time.perf_counter()
            engine.restore(state, step=1)
            if args.device == "cuda":
                torch.cuda.synchronize()
            took = time.perf_counter() - t0
            dist.barrier()
            if rank == 0:
                print(f"{where} {args.device} restore {i}: {1e3 * took:.0f} ms; "
                      + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in SPENT.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
