#!/usr/bin/env python3
"""The call of a guarded distributed `Engine.save`, on GPUs, piece by piece: every rank holds ten
replicas of a 16-block GPT with a real AdamW (scripts/call_probe.py: 10,360 tensors a rank, tiny,
so only the per-tensor work counts), guards the optimizers, reserves, then saves 25 times (an
optimizer step between saves, each save waited for) to an `ans` local tier.

    TAG=new torchrun --standalone --nproc-per-node 2 scripts/dist_call_probe.py
    DEFER_WALK=1 torchrun ...     # guard(optimizer, defer_walk=True): DCP's plan on the stager thread

Each rank prints one JSON line: the median and range of the call from the 6th save on, and the
medians of its parts (`SaveHandle.timings`): DCP's plan (the walk of the state, the all-reduce),
then this rank's items and their staging (of it, the save pipeline's plan). With `DEFER_WALK=1`
the call defers them: DCP's plan's parts are then the stager thread's, and `stager_plan_ms` is
all its planning (the default guard keeps a distributed save's planning in its call). To compare
two versions of the engine, run it with each first on PYTHONPATH, alternately, on one machine,
with a different TAG each (the tier's directory, /tmp/dist-call-TAG, is left for the caller to
remove).
NCCL default group, so the planning runs on the gloo group the engine makes, as in training.
Without CUDA it runs on the CPU (gloo, `codec: none`; the engine told the default group is NCCL,
so that it plans on a group of its own there too), to check the probe itself.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import tiered
from call_probe import replicas

PARTS = ("dcp_walk_ms", "dcp_agree_ms", "dcp_plan_ms", "dcp_stage_ms", "plan_ms", "stager_plan_ms")


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if gpu else "gloo")
    if not gpu:  # as with NCCL: the engine plans on a gloo group of its own (a deferred save's plan needs one)
        import tiered.distributed

        tiered.distributed.default_backend = lambda: "nccl"
    reps = replicas(f"cuda:{local}" if gpu else "cpu", 10)
    opts = [o for _, o in reps]

    def state() -> dict:  # new dicts every save, as model.state_dict() and optimizer.state_dict() make
        return {f"r{i}": {"model": m.state_dict(), "optim": o.state_dict()} for i, (m, o) in enumerate(reps)}

    cfg = {"tiers": [{"name": "local", "kind": "local", "path": f"/tmp/dist-call-{os.environ.get('TAG', 'probe')}",
                      "codec": "ans" if gpu else "none"}]}
    calls, timings = [], []
    with tiered.Engine.from_config(cfg) as engine:
        guards = [engine.guard(o, defer_walk=True if os.environ.get("DEFER_WALK") == "1" else None) for o in opts]
        engine.reserve(state())
        engine.wait_pinned()
        for step in range(1, 26):
            s = state()
            if gpu:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            h = engine.save(step, s)
            calls.append(1e3 * (time.perf_counter() - t0))
            for o in opts:
                o.step()
            h.wait()
            timings.append(dict(h.timings))  # (after the wait: a deferred save's parts come from the stager thread)
        for g in guards:
            g.remove()
    warm, parts = calls[5:], timings[5:]
    print(json.dumps({"rank": dist.get_rank(), "code": tiered.__file__.rsplit("/tiered/", 1)[0],
                      "call_median": round(statistics.median(warm), 2),
                      "call_range": [round(min(warm), 1), round(max(warm), 1)],
                      **{k: round(statistics.median(t.get(k, 0.0) for t in parts), 2) for k in PARTS}}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
