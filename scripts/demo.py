#!/usr/bin/env python3
"""tiered demo: train a small GPT, checkpoint it every N steps, restore, check bit-exactness.

Runs on the embedded default config (configs/local.yaml: checkpoints under ./.tiered/local),
on the GPU when there is one (nvCOMP ANS through KvikIO), else on the CPU (zstd, POSIX I/O).
A second run resumes from the latest checkpoint. `rm -rf .tiered` starts over.

    python scripts/demo.py [--steps 60] [--save-every 20] [--config configs/local.yaml]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiered  # noqa: E402
from gptmodel import GPT, batch, shape_for, stdlib_corpus  # noqa: E402
from tiered.units import format_size  # noqa: E402


def build(device: str, params: float, ctx: int):
    d, layers, heads = shape_for(params)
    model = GPT(d, layers, heads, ctx).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def train_state(model, opt, step: int, data_gen: torch.Generator) -> dict:
    """Everything a resumed run needs: weights, optimizer, counters and every RNG."""
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": step,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                "data": data_gen.get_state(),
                **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})},
    }


def apply_rng(state: dict, data_gen: torch.Generator) -> None:
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    data_gen.set_state(rng["data"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def step_fn(model, opt, data, ctx, size, gen, device) -> float:
    x, y = batch(data, ctx, size, gen)
    x, y = x.to(device), y.to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
        loss = F.cross_entropy(model(x).float().view(-1, 256), y.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def same_tensors(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="cluster YAML (default: the embedded configs/local.yaml)")
    ap.add_argument("--steps", type=int, default=60, help="training steps in this run")
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--params", type=float, default=None, help="model size (default 20e6 GPU, 3e6 CPU)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = args.params or (20e6 if device == "cuda" else 3e6)
    ctx, size = 128, 16
    torch.manual_seed(0)
    data = stdlib_corpus(8 << 20)
    gen = torch.Generator().manual_seed(1)
    model, opt = build(device, params, ctx)

    engine = tiered.Engine.from_config(args.config)
    print(f"tiered demo: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter GPT on {device}; "
          f"{engine.describe()}")
    start = 0
    latest = engine.latest_step()
    if latest is not None:
        state = train_state(model, opt, 0, gen)
        engine.restore(state)
        opt.load_state_dict(state["optim"])
        apply_rng(state, gen)
        start = state["step"]
        print(f"resumed from step {start} (the latest committed checkpoint)")

    def report(handle):
        def done(fut):
            if fut.exception() is None:
                m = fut.result()
                print(f"  step {m.step:>5} durable: {format_size(m.stored_bytes)} written for "
                      f"{format_size(m.raw_bytes)} of state ({100 * m.saved_fraction:.1f}% saved)")
        handle.persisted.add_done_callback(done)

    for step in range(start + 1, start + args.steps + 1):
        loss = step_fn(model, opt, data, ctx, size, gen, device)
        if step % args.save_every == 0:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = engine.save(step, train_state(model, opt, step, gen))
            if device == "cuda":
                torch.cuda.current_stream().synchronize()
            stall = time.perf_counter() - t0
            print(f"step {step:>5}  loss {loss:.3f}  save(): training stalled {1e3 * stall:.1f} ms")
            report(handle)
    engine.wait()
    last = engine.latest_step()
    if last is None:
        print("no checkpoint was saved (raise --steps or lower --save-every)")
        engine.close()
        return 1

    # Restore the latest step into a fresh model and optimizer and compare bit for bit.
    model2, opt2 = build(device, params, ctx)
    gen2 = torch.Generator()
    state2 = train_state(model2, opt2, 0, gen2)
    t0 = time.perf_counter()
    engine.restore(state2, step=last)
    restore_s = time.perf_counter() - t0
    opt2.load_state_dict(state2["optim"])
    exact = last == start + args.steps and same_tensors(model.state_dict(), model2.state_dict()) \
        and same_tensors(opt.state_dict()["state"], opt2.state_dict()["state"])
    print(f"restored step {last} into a fresh model in {restore_s:.2f} s: "
          f"{'bit-exact' if exact else 'MISMATCH'} (weights and AdamW state)")
    if last == start + args.steps:
        # Both copies train on: the restored one must follow the original exactly.
        rng_after = train_state(model, opt, last, gen)["rng"]
        apply_rng(state2, gen2)
        l1 = [step_fn(model, opt, data, ctx, size, gen, device) for _ in range(3)]
        apply_rng({"rng": rng_after}, gen)  # the restored state's RNG equals this one
        l2 = [step_fn(model2, opt2, data, ctx, size, gen2, device) for _ in range(3)]
        same = l1 == l2 and same_tensors(model.state_dict(), model2.state_dict())
        print(f"training resumed from the checkpoint: next losses {', '.join(f'{x:.4f}' for x in l2)} "
              f"({'identical to' if same else 'DIFFERENT from'} the uninterrupted run)")
        exact = exact and same
    print(f"committed steps: {engine.steps()}  (run again to resume; rm -rf .tiered to start over)")
    engine.close()
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
