"""One rank of a job whose nodes are torchrun launches on this machine (tests/test_peers.py).

An FSDP2 model trained with AdamW on gloo (CPU), batches a function of the step, saved through
`Engine.save` every `--every` steps to a memory tier with replicas on the other node.

Modes:
  train   train steps 1..--steps, saving; print each step's loss (``loss <step> <value>``). With
          --die-after S: after step S's save is committed and kept by the replicas' ranks, write
          each rank's shards of that state to --shards and end the process at once (os._exit:
          no engine closed, nothing flushed), as a node lost with the job (--migrate: once the
          step is on the shared tier too).
  resume  restore the newest step (`Engine.restore`), check every shard bit for bit against
          --shards, print ``restored <step>``, then train to --steps, printing the losses.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from helpers import exit_without_teardown  # (this script's folder is first on sys.path)
from tiered import Engine


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # (on the CPU, also where there are GPUs)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step * dist.get_world_size() + dist.get_rank())
    x = torch.randn(64, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out = loss.detach().clone()
    dist.all_reduce(out)
    return out.item() / dist.get_world_size()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def local_shards(state: dict) -> dict[str, torch.Tensor]:
    out = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, torch.Tensor):
            t = obj.to_local() if hasattr(obj, "to_local") else obj
            out[prefix] = t.detach().clone()
    walk("", state)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "resume"])
    ap.add_argument("--config", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--shards", default=None, help="directory of each rank's shards at --die-after")
    ap.add_argument("--expect", type=int, default=None, help="resume: the step the restore must pick")
    ap.add_argument("--migrate", action="store_true", help="--die-after: the step is on every tier first")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build()
    engine = Engine.from_config(args.config)
    first = 1
    if args.mode == "resume":
        train_step(model, opt, 0)  # (the optimizer makes its state; the restore overwrites it)
        state = state_of(model, opt, 0)
        step = engine.restore(state)
        assert args.expect is None or step == args.expect, (step, args.expect)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert state["step"] == step
        saved = torch.load(os.path.join(args.shards, f"rank{rank}.pt"))
        got = local_shards(state_of(model, opt, step))
        assert saved.keys() == got.keys(), (sorted(saved), sorted(got))
        for k in saved:
            assert torch.equal(saved[k], got[k]), f"rank {rank}: {k} differs after the restore"
        print(f"restored {step}", flush=True)
        first = step + 1
    for step in range(first, args.steps + 1):
        loss = train_step(model, opt, step)
        if rank == 0:
            print(f"loss {step} {loss!r}", flush=True)
        if step % args.every == 0:
            engine.save(step, state_of(model, opt, step))
        if step == args.die_after:
            engine.wait_replicated(timeout=120)
            if args.migrate:
                engine.wait_migrated(timeout=120)
            os.makedirs(args.shards, exist_ok=True)
            torch.save(local_shards(state_of(model, opt, step)), os.path.join(args.shards, f"rank{rank}.pt"))
            dist.barrier()
            sys.stdout.flush()
            os._exit(0)  # the job ends here, as when a node is lost: nothing closed or flushed
    engine.close()
    exit_without_teardown()


if __name__ == "__main__":
    main()
