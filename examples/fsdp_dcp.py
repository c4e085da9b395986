"""FSDP2 under torchrun: every rank saves its own shards with `Engine.save`, and `dcp.save` writes
through tiered's storage; a later job at another world size restores them.

    torchrun --nproc-per-node 2 examples/fsdp_dcp.py --dir /tmp/fsdp --steps 20   # 2 ranks train and save
    torchrun --nproc-per-node 1 examples/fsdp_dcp.py --dir /tmp/fsdp --check      # 1 rank restores both

On GPUs (NCCL) each rank compresses its shards with nvCOMP; on CPUs (gloo, as CI runs it) with
zstd. `get_state_dict(model, optimizer)` gives the sharded state (DTensors); `Engine.save` and
`Engine.restore` are collectives, called on every rank; rank 0 commits a step once every rank's
files are durable. A step saved at N ranks loads at any M through DCP's resharding planner, each
rank decoding only the chunks its shards need. With node-local tiers on several nodes, put a shared
tier below them so that every rank can read every rank's files (docs/distributed.md).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import tiered
from tiered.dcp import TieredStorageReader, TieredStorageWriter


def build(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def checksum(model: torch.nn.Module) -> float:
    """The same number at any world size: the sum of every full parameter."""
    return sum(p.full_tensor().double().sum().item() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="./.tiered/fsdp-example")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--check", action="store_true", help="restore the newest step and the dcp.save copy instead")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before the engine: its threads use this GPU
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    rank = dist.get_rank()
    # One tier that every rank of this example reaches (one machine). Engine steps and dcp.save
    # steps live in separate tiers here, since both number their steps.
    engine = tiered.Engine.from_config({"tiers": [{"name": "local", "kind": "local", "path": f"{args.dir}/engine"}]})
    dcp_engine = tiered.Engine.from_config({"tiers": [{"name": "local", "kind": "local", "path": f"{args.dir}/dcp"}]})
    model, optimizer = build(device)

    if not args.check:
        for step in range(1, args.steps + 1):
            torch.manual_seed(1000 + step)
            x = torch.randn(16, 32, device=device)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 10 == 0:
                msd, osd = get_state_dict(model, optimizer)
                engine.save(step, {"model": msd, "optim": osd, "step": step})  # on every rank
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, storage_writer=TieredStorageWriter(dcp_engine, args.steps))
        engine.wait()
        total = checksum(model)  # a collective: on every rank
        if rank == 0:
            print(f"{dist.get_world_size()} ranks saved steps {engine.steps()}; weights checksum {total:.9f}")
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd, "step": 0}
        step = engine.restore(state)  # resharded to this world size
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        from_engine = checksum(model)
        latest = dcp_engine.latest_step()
        msd, osd = get_state_dict(model, optimizer)
        dcp.load({"model": msd, "optim": osd}, storage_reader=TieredStorageReader(dcp_engine, latest))
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        from_dcp = checksum(model)
        if rank == 0:
            print(f"{dist.get_world_size()} rank(s) restored Engine step {step} (weights checksum {from_engine:.9f}) "
                  f"and dcp.save step {latest} (weights checksum {from_dcp:.9f})")
    engine.close()
    dcp_engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
