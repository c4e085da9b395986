#!/usr/bin/env python3
"""The Python a guarded `Engine.save` call runs on the training thread, piece by piece, on a state
of real modules and a real AdamW: ten replicas of a 16-block GPT (259 parameters each, with
their optimizer state: 10,360 tensors), tiny tensors, so only the per-tensor work counts.

    python scripts/call_probe.py [--device cuda|cpu] [--iterations 40] [--engine DIR]

Prints the medians (after 5 warm-up iterations, collector paused, as in a save) of: the walk of
the state (`tree.flatten`), the cached plan's key and reuse (`PlanCache.plan`), the storages the
optimizers guard (`overlap.Guarded`) and the search for the rest (`overlap.overlap_plan`).
With `--engine DIR`, it times whole guarded `Engine.save` calls instead (a local tier under DIR,
codec none), blocks of five saves in turn: the call walks the state (`guard(defer_walk=False)`),
the default (`guard(optimizer)`: the call walks until a walk has taken 10 ms), and the stager
thread walks it (`defer_walk=True`), with the optimizer step after each save that waits for it;
it prints the median call of each (the first save of a block is not counted). To compare two versions, run it with each first on PYTHONPATH, alternately, pinned to one core
(`taskset -c 3`): the host's speed moves from one process to the next (docs/benchmarks.md,
session 14).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import tiered
from tiered import tree
from tiered.overlap import Guarded, overlap_plan
from tiered.plan import PlanCache


def block() -> torch.nn.Module:
    """One transformer block's parameters (16 tensors), at width 8."""
    return torch.nn.ModuleDict({
        "ln1": torch.nn.LayerNorm(8), "q": torch.nn.Linear(8, 8), "k": torch.nn.Linear(8, 8),
        "v": torch.nn.Linear(8, 8), "o": torch.nn.Linear(8, 8), "ln2": torch.nn.LayerNorm(8),
        "fc": torch.nn.Linear(8, 32), "proj": torch.nn.Linear(32, 8)})


def gpt(device: str) -> torch.nn.Module:
    """A 16-block GPT's parameters (259 tensors), at width 8."""
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(16, 8),
                                "blocks": torch.nn.ModuleList([block() for _ in range(16)]),
                                "lnf": torch.nn.LayerNorm(8)}).to(device)


def replicas(device: str, n: int = 10) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """`n` GPTs, each with an AdamW that has stepped once (its state made), from a fixed seed."""
    torch.manual_seed(0)
    reps = []
    for _ in range(n):
        m = gpt(device)
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        sum(q.sum() for q in m.parameters()).backward()
        o.step()
        reps.append((m, o))
    return reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--engine", default=None, metavar="DIR", help="time guarded Engine.save calls (tier under DIR)")
    args = p.parse_args()
    reps = replicas(args.device)
    opts = [o for _, o in reps]
    if args.engine:
        return engine_calls(reps, args.engine, args.iterations)

    def state() -> dict:  # new dicts every save, as model.state_dict() and optimizer.state_dict() make
        return {f"r{i}": {"model": m.state_dict(), "optim": o.state_dict()} for i, (m, o) in enumerate(reps)}

    gpu = args.device == "cuda"
    cache = PlanCache()
    _, leaves = tree.flatten(state(), share=True)
    cache.plan(leaves, "ans", 1 << 20, gpu)
    times: dict[str, list[float]] = {k: [] for k in ("flatten", "plan", "guarded", "overlap_plan", "sum")}
    with tree.collector_paused():
        for _ in range(args.iterations):
            s = state()
            t1 = time.perf_counter()
            _, leaves = tree.flatten(s, share=True)
            t2 = time.perf_counter()
            plan = cache.plan(leaves, "ans", 1 << 20, gpu)
            t3 = time.perf_counter()
            guarded = Guarded(opts)
            t4 = time.perf_counter()
            overlap_plan(plan, guarded, lambda i: 1 << 40)
            t5 = time.perf_counter()
            for k, a, b in (("flatten", t1, t2), ("plan", t2, t3), ("guarded", t3, t4), ("overlap_plan", t4, t5),
                            ("sum", t1, t5)):
                times[k].append(1e3 * (b - a))
            del s
            gc.collect(0)
    where = tiered.__file__.rsplit("/tiered/", 1)[0]
    print(f"{where}: {len(leaves)} tensors on {args.device}: "
          + ", ".join(f"{k} {statistics.median(v[5:]):.2f}" for k, v in times.items())
          + f" ms (medians of {len(times['sum'][5:])})", flush=True)


def engine_calls(reps: list, root: str, iterations: int) -> None:
    """Guarded saves of the replicas' state, blocks of five walking in the call and five not."""
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": root, "codec": "none"}]}
    modes = (False, None, True)  # defer_walk: never (walk in the call), the default, always
    calls: dict[bool | None, list[float]] = {m: [] for m in modes}
    step = 0
    with tiered.Engine.from_config(cfg) as engine:
        for block in range(3 * max(1, iterations // 10)):
            defer = modes[block % 3]
            guards = [engine.guard(o, defer_walk=defer) for _, o in reps]
            state = {f"r{i}": {"model": m.state_dict(), "optim": o.state_dict()} for i, (m, o) in enumerate(reps)}
            engine.reserve(state)
            for n in range(5):
                step += 1
                state = {f"r{i}": {"model": m.state_dict(), "optim": o.state_dict()} for i, (m, o) in enumerate(reps)}
                t0 = time.perf_counter()
                engine.save(step, state)
                t1 = time.perf_counter()
                for o in (o for _, o in reps):
                    o.step()  # (waits for the save's walk and reads)
                engine.wait()
                engine.catalog.fast.delete(step)
                if n:  # (the first of a block: after the guards changed)
                    calls[defer].append(1e3 * (t1 - t0))
            for g in guards:
                g.remove()
    n = len(tree.flatten(state, share=True)[1])
    print(f"{n} tensors, guarded Engine.save call: walk in the call {statistics.median(calls[False]):.2f} ms, "
          f"the default {statistics.median(calls[None]):.2f} ms, deferred walk {statistics.median(calls[True]):.2f} "
          f"ms (medians of {len(calls[True])} each)", flush=True)


if __name__ == "__main__":
    main()
