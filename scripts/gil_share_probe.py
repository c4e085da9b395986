#!/usr/bin/env python3
"""What a walk of a state on another thread costs a thread that launches short operations: the
question behind `Engine.guard(optimizer, defer_walk=True)`, where the stager thread walks the
state while the training thread launches the next step.

A training thread that launches kernels runs short operations, each letting the GIL go for a
moment. A walk of the state (`tiered.tree.flatten`, Python from end to end) on another thread
takes the GIL whenever it is let go, and keeps it until Python's switch interval (5 ms by default)
makes it yield. So the launches can end later beside the walk than after a walk done first.

Per round, on the CPU (alternated, medians over the rounds):
  - `loop`: 3,000 small torch ops (`torch.tanh` of a 64x64 tensor), alone;
  - `walk`: the flatten of ten replicas of a 16-block GPT with AdamW (10,360 tensors), alone;
  - `walk, then loop`: the walk on this thread, then the ops: when the ops are all issued (the
    walk in save()'s call);
  - `loop beside the walk`: the walk started on another thread, then the ops here: when the ops
    are all issued (the deferred walk);
  - the same with the walk in ten pieces, the GIL let go between them (`time.sleep(0)`), and with
    the switch interval lowered during the walk.

    python scripts/gil_share_probe.py [--rounds 20]

It needs two cores or more to mean anything (on one core both threads share it anyway).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from call_probe import replicas  # noqa: E402
from tiered import tree  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    reps = replicas("cpu")
    x = torch.randn(64, 64)

    def state() -> dict:
        return {f"r{i}": {"model": m.state_dict(), "optim": o.state_dict()} for i, (m, o) in enumerate(reps)}

    def loop() -> None:
        y = x
        for _ in range(3000):
            y = torch.tanh(y)

    def walk() -> None:
        with tree.collector_paused():
            tree.flatten(state(), share=True)

    def walk_in_pieces() -> None:
        s = state()
        with tree.collector_paused():
            for k, v in s.items():
                tree.flatten({k: v}, share=True)
                time.sleep(0)  # (lets the GIL go: a waiting thread takes it now, not at the switch interval)

    def walk_switching(interval: float):
        def run() -> None:
            old = sys.getswitchinterval()
            sys.setswitchinterval(interval)
            try:
                walk()
            finally:
                sys.setswitchinterval(old)
        return run

    def alone(f) -> float:
        t0 = time.perf_counter()
        f()
        return 1e3 * (time.perf_counter() - t0)

    def then_loop() -> float:
        t0 = time.perf_counter()
        walk()
        loop()
        return 1e3 * (time.perf_counter() - t0)

    def beside(w) -> float:
        th = threading.Thread(target=w)
        t0 = time.perf_counter()
        th.start()
        loop()
        t1 = time.perf_counter()
        th.join()
        return 1e3 * (t1 - t0)

    cases = {
        "loop alone": lambda: alone(loop),
        "walk alone": lambda: alone(walk),
        "walk, then loop: ops issued after": then_loop,
        "loop beside the walk: ops issued after": lambda: beside(walk),
        "loop beside the walk in ten pieces": lambda: beside(walk_in_pieces),
        "loop beside the walk, switch interval 0.1 ms": lambda: beside(walk_switching(1e-4)),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(2):  # warm-up
        for f in cases.values():
            f()
    for _ in range(args.rounds):
        for k, f in cases.items():
            times[k].append(f())
    n = len(tree.flatten(state(), share=True)[1])
    print(f"{n} tensors, {args.rounds} rounds, medians (range) in ms:")
    for k, v in times.items():
        print(f"  {k:48s} {statistics.median(v):7.2f}  ({min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
