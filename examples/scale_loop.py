"""A loop with a large state: `engine.guard(optimizer)` and `engine.reserve(state)`.

    python examples/scale_loop.py --width 4096 --layers 24 --steps 40     # ~2.4 GB of fp32 + AdamW state
    python examples/scale_loop.py --width 64 --layers 2 --steps 8         # tiny, as CI runs it on a CPU

With 10-100 GB of state per GPU two calls at start-up keep a save out of the training step:

- `engine.guard(optimizer)`: `save()` returns at once; the state is read on a side stream beside
  the next forward and backward, and `optimizer.step()` first waits (on the GPU) until it has.
- `engine.reserve(state)`: pins the host memory a save drains through and lays the saves out now,
  in the background, instead of inside the first save (which would stall for seconds per 10 GB).

Each save's `handle.stall_s` is how long the call blocked; `handle.persisted` resolves once the
step is durable and committed. Works on a CPU as well (guarded saves copy there).
"""

from __future__ import annotations

import argparse
import time

import torch

import tiered


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="./.tiered/scale-example")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU())
              for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randn(64, args.width, device=device)

    def step() -> float:
        loss = model(x).square().mean()
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        return loss.item()

    step()  # AdamW makes its state at its first step: reserve() needs the state as it will be saved
    config = {"tiers": [{"name": "local", "kind": "local", "path": f"{args.dir}/local"}]}
    with tiered.Engine.from_config(config) as engine:
        engine.guard(optimizer)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        engine.reserve(state)
        engine.wait_pinned()  # optional: here only so that the first save's figure is a warm one
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
        print(f"state ~{nbytes / 1e6:,.1f} MB on {device}; {engine.describe()}")
        handles = []
        for i in range(1, args.steps + 1):
            t0 = time.perf_counter()
            loss = step()
            if i % args.every == 0:
                handles.append(engine.save(i, {"model": model.state_dict(), "optim": optimizer.state_dict(),
                                               "step": i}))
                print(f"step {i}: loss {loss:.5f}, save() blocked {1e3 * handles[-1].stall_s:.2f} ms, "
                      f"step {1e3 * (time.perf_counter() - t0):.0f} ms")
        for h in handles:
            h.wait()
            print(f"step {h.persisted.result().step} durable on tier {h.tier!r}")


if __name__ == "__main__":
    main()
