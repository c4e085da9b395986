"""A plain training loop that saves with tiered and resumes where it stopped.

    python examples/plain_loop.py --dir /tmp/ckpt --steps 60           # trains, saves every 20 steps
    python examples/plain_loop.py --dir /tmp/ckpt --steps 100          # resumes from step 60

Runs on a CPU or a GPU. `save()` returns once the state may change again (on a GPU: once nvCOMP
has compressed it); writing and the commit happen in the background. `restore()` fills the
tensors of the state you hand it in place and returns the step it loaded. The config here is a
dict with one local tier; pass a YAML path instead for a cluster (configs/example-cluster.yaml).
"""

from __future__ import annotations

import argparse

import torch

import tiered


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 64, generator=g)
    return x.to(device), x.sum(1, keepdim=True).to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="./.tiered/example", help="where the checkpoints go")
    ap.add_argument("--steps", type=int, default=60, help="train until this step")
    ap.add_argument("--every", type=int, default=20, help="save every N steps")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"tiers": [{"name": "local", "kind": "local", "path": f"{args.dir}/local"}]}

    with tiered.Engine.from_config(config) as engine:
        start = 0
        if engine.latest_step() is not None:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 0}
            engine.restore(state)                      # model tensors are filled in place
            optimizer.load_state_dict(state["optim"])  # a fresh optimizer's state is created by restore()
            start = state["step"]
            print(f"resumed from step {start}")
        for step in range(start + 1, args.steps + 1):
            x, y = batch(step, device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.every == 0:
                handle = engine.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict(),
                                            "step": step})
                print(f"step {step}: loss {loss.item():.4f}, save() took {1e3 * handle.stall_s:.1f} ms")
        engine.wait()  # every save durable (a background failure is raised here)
        print("committed steps:", engine.steps())


if __name__ == "__main__":
    main()
