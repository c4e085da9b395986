#!/usr/bin/env python3
"""Flatten + plan cost of a state of many small tensors, with Python's collector on and paused
(tiered.tree.collector_paused), in a process holding about a million other objects (as one with
torch, Lightning or transformers loaded does), between "training steps" that make garbage.

    python scripts/plan_probe.py [--replicas 10] [--iterations 20] [--engine DIR]

Prints, for each mode twice: the median and max of flatten + plan, and the median and sum of
whole iterations (flatten + plan + 20 garbage-making steps). CPU only; no engine, no disk.

Under torchrun it times the distributed `Engine.save` instead (gloo; every rank saves the state,
rank 0 prints the warm call and the DCP planning part of it, tiered.dcp_reuse; then the same on
a fresh engine that `reserve()`s the state first, so that its first save reuses the plan):

    torchrun --nproc_per_node 2 scripts/plan_probe.py --engine DIR
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from tiered import tree
from tiered.plan import PlanCache

NAMES = ["w1", "b1", "w2", "b2", "ln.w", "ln.b", "attn.q", "attn.k", "attn.v", "attn.o", "attn.ob", "mlp.w", "mlp.b"]


def replica() -> dict:
    """A 16-layer model's state dict with AdamW state: 208 weights, 3 optimizer tensors each."""
    model = {f"layers.{i}.{n}": torch.zeros(4) for i in range(16) for n in NAMES}
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
             for i in range(len(model))}
    return {"model": model, "optim": {"state": state, "param_groups": [{"lr": 1e-3, "params": list(range(len(model)))}]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=10)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--engine", metavar="DIR", help="also time Engine.save of the state on a local tier in DIR")
    args = p.parse_args()
    reps = [replica() for _ in range(args.replicas)]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        if not args.engine:
            p.error("under torchrun: --engine DIR")
        dist.init_process_group("gloo")
        try:
            dist_calls(args.engine, lambda: {f"r{k}": r for k, r in enumerate(reps)})
        finally:
            dist.destroy_process_group()
        return

    def state() -> dict:  # new dicts every save, as model.state_dict() and optimizer.state_dict() make
        return {f"r{k}": {"model": dict(r["model"]),
                          "optim": {"state": {i: dict(v) for i, v in r["optim"]["state"].items()},
                                    "param_groups": r["optim"]["param_groups"]}} for k, r in enumerate(reps)}

    ballast = [[{} for _ in range(50)] for _ in range(20000)]  # ~1M tracked objects
    cache = PlanCache()
    for mode in ("collector on", "paused", "collector on", "paused"):
        plan_ms, whole_ms = [], []
        for _ in range(args.iterations):
            t0 = time.perf_counter()
            s = state()
            t1 = time.perf_counter()
            with tree.collector_paused() if mode == "paused" else contextlib.nullcontext():
                _, leaves = tree.flatten(s, share=True)
                cache.plan(leaves, "zstd", 1 << 20, False)
            t2 = time.perf_counter()
            for _ in range(20):  # a training step's Python garbage
                [{"a": [i, i + 1], "b": (i,)} for i in range(3000)]
            del s, leaves
            plan_ms.append(1e3 * (t2 - t1))
            whole_ms.append(1e3 * (time.perf_counter() - t0))
        warm = slice(3, None)
        print(f"{mode:>12}: flatten + plan median {statistics.median(plan_ms[warm]):.1f} ms "
              f"(max {max(plan_ms[warm]):.1f}); iteration median {statistics.median(whole_ms[warm]):.1f} ms, "
              f"sum {sum(whole_ms[warm]) / 1e3:.2f} s", flush=True)
    if args.engine:
        engine_calls(args.engine, state)
    del ballast


def timed_saves(engine, state, n: int, phase: str, garbage: bool = False) -> tuple[list[float], list[float]]:
    """Steps 1..n saved of `state()` and each waited for: (each call's ms, each save's `phase` ms);
    with `garbage`, 20 garbage-making "training steps" after each."""
    calls, phases = [], []
    for step in range(1, n + 1):
        t0 = time.perf_counter()
        h = engine.save(step, state())
        calls.append(1e3 * (time.perf_counter() - t0))
        phases.append(h.timings[phase])
        h.wait()
        for _ in range(20 if garbage else 0):
            [{"a": [i, i + 1], "b": (i,)} for i in range(3000)]
    return calls, phases


def engine_calls(root: str, state) -> None:
    """`Engine.save` of the same state on a local tier (codec none): the call's median over 12
    warm saves, as the engine runs it (collector paused) and with the pause taken out."""
    import shutil

    import tiered
    from tiered import tree as tree_mod

    paused = tree_mod.collector_paused
    for mode in ("paused", "collector on"):
        tree_mod.collector_paused = paused if mode == "paused" else contextlib.nullcontext
        shutil.rmtree(root, ignore_errors=True)
        cfg = {"tiers": [{"name": "local", "kind": "local", "path": root, "codec": "none"}], "migration": "in_process"}
        with tiered.Engine.from_config(cfg) as engine:
            calls, plans = timed_saves(engine, state, 15, "plan_ms", garbage=True)
        print(f"Engine.save, {mode:>12}: call median {statistics.median(calls[3:]):.1f} ms, "
              f"of it flatten + plan {statistics.median(plans[3:]):.1f} ms", flush=True)
    tree_mod.collector_paused = paused
    shutil.rmtree(root, ignore_errors=True)


def dist_calls(root: str, state) -> None:
    """Warm distributed `Engine.save` calls of the same state on one local tier (codec none)."""
    import shutil

    import torch.distributed as dist

    import tiered

    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": root, "codec": "none"}]}
    for reserve in (False, True):  # then a fresh engine whose `reserve()` plans first
        with tiered.Engine.from_config(cfg) as engine:
            t0 = time.perf_counter()
            if reserve:
                engine.reserve(state())
            reserved = 1e3 * (time.perf_counter() - t0)
            calls, plans = timed_saves(engine, state, 12, "dcp_plan_ms")
        dist.barrier()
        if dist.get_rank() == 0:
            n = sum(1 for _ in tiered.tree.flatten(state())[1])
            print(f"distributed Engine.save at {dist.get_world_size()} ranks, {n} tensors a rank"
                  f"{f', after reserve() ({reserved:.1f} ms)' if reserve else ''}: warm call median "
                  f"{statistics.median(calls[2:]):.1f} ms (range {min(calls[2:]):.1f}-{max(calls[2:]):.1f}), of it DCP "
                  f"planning {statistics.median(plans[2:]):.1f} ms; first save {calls[0]:.1f} ms, planning "
                  f"{plans[0]:.1f} ms", flush=True)
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()


if __name__ == "__main__":
    main()
