"""Shared builders and comparisons for the tests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch


def assert_same(a, b, path="state"):
    """Bit-exact equality of nested state (tensors compared byte for byte, NaN-safe)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"{path}: bytes differ"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a)}/{len(a)} vs {type(b)}/{len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, path
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} vs {b!r}"


def mixed_state(device: str, seed: int = 0) -> dict:
    """Every dtype and shape case the format must carry, nested in dicts, lists and tuples."""
    g = torch.Generator().manual_seed(seed)
    dev = torch.device(device)

    def rnd(*shape, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype).to(dev)

    base = rnd(64, 48)
    return {
        "weights": OrderedDict(
            fp32=rnd(700, 513),                                   # spans several 1 MiB chunks + a tail
            bf16=rnd(257, 300, dtype=torch.bfloat16),
            fp16=rnd(1000, dtype=torch.float16),
            fp64=rnd(33, dtype=torch.float64),
        ),
        "ints": [torch.randint(-2**40, 2**40, (4097,), generator=g).to(dev),
                 torch.randint(0, 255, (100,), generator=g, dtype=torch.uint8).to(dev),
                 torch.rand(513, generator=g).gt(0.5).to(dev)],
        "edge": {"empty": torch.empty(0, 7, device=dev), "scalar": torch.tensor(3.25, device=dev),
                 "scalar_int": torch.tensor(7, device=dev),
                 "noncontig": base.t(), "strided": base[::3, 1::2]},
        "meta": {"step": 12345, "lr": 3e-4, "betas": (0.9, 0.999), "name": "run-7", "flag": True, "none": None,
                 "inf": float("inf"), "nan": float("nan"), "blob": b"\x00\x01raw", 3: "int key",
                 "dtype": torch.bfloat16, "big": 2**70},
        "numpy": {"arr": np.arange(10, dtype=np.int32), "rng": np.random.default_rng(1).random(5)},
        "rng": torch.get_rng_state(),
    }


def zeros_like_state(state):
    """Same structure with every tensor zeroed (in new storage): a restore target."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, np.ndarray):
        return np.zeros_like(state)
    if isinstance(state, OrderedDict):
        return OrderedDict((k, zeros_like_state(v)) for k, v in state.items())
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    if isinstance(state, tuple):
        return tuple(zeros_like_state(v) for v in state)
    return None if not isinstance(state, (int, float, str, bytes)) else state


def clone_state(state):
    """A deep copy: tensors and arrays cloned (contiguity kept as is), containers rebuilt."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, OrderedDict):
        return OrderedDict((k, clone_state(v)) for k, v in state.items())
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(clone_state(v) for v in state)
    return state


def trained_model(device: str, steps: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512),
                                torch.nn.Linear(512, 64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(32, 256, device=device)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def fixture_state() -> dict:
    """A deterministic optimizer-like state, generated on the CPU (the same bits on any machine):
    what scripts/make_gpu_fixture.py saves from a GPU and tests/data/gpu-migrated holds."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(100_000, generator=g)
    return {
        "model": {"w": w, "emb": torch.randn(100_000, generator=g).to(torch.bfloat16)},
        "optim": {"exp_avg": torch.randn(100_000, generator=g) * 1e-3,
                  "exp_avg_sq": torch.rand(100_000, generator=g) ** 2 * 1e-6,
                  "step": torch.tensor(1234, dtype=torch.int64)},
        "meta": {"epoch": 3, "name": "fixture"},
    }


@contextlib.contextmanager
def running_s3(data_dir: Path) -> Iterator[Any]:
    """A real SeaweedFS S3 server on loopback, its keys in the environment (the standard AWS
    chain) as a user's would be, stopped after."""
    import pytest

    if os.environ.get("TIERED_SKIP_S3") == "1":
        # Explicit opt-out for machines without the S3 test server (the lent GPU machines);
        # CI never sets it, so a missing server fails there instead of skipping.
        pytest.skip("TIERED_SKIP_S3=1: S3 tests skipped on this machine")
    from tiered.testing import start_s3

    server = start_s3(data_dir)
    try:
        with server.environment():
            yield server
    finally:
        server.stop()


def s3_client(server: Any) -> Any:
    """A boto3 client for a test server, with its keys given explicitly: boto3.client()'s shared
    default session keeps the first keys it read, which would be another server's."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key,
                        config=Config(retries={"max_attempts": 10, "mode": "standard"}))


def new_bucket(server: Any) -> str:
    """A fresh bucket on a test server."""
    import secrets

    name = "t" + secrets.token_hex(8)
    s3_client(server).create_bucket(Bucket=name)
    return name


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's state dict, tensor bytes in order (for comparing runs across processes)."""
    return hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in model.state_dict().values())).hexdigest()


def run_two_ranks(worker: str, root: Path, timeout: float = 240) -> dict:
    """Run tests/`worker` under torchrun at 2 CPU ranks with (root, result file) as its arguments;
    return the JSON its rank 0 wrote there."""
    out = root / "result.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(Path(__file__).parent / worker), str(root), str(out)],
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def exit_without_teardown() -> None:
    """End a torchrun worker whose work is done and checked: destroy its process group, then skip
    the interpreter's teardown. In clean-clone CI runs a rank aborted there, after its work
    ("terminate called without an active exception", SIGABRT: gloo's threads outliving the
    interpreter, the class pytorch/pytorch#179291 discusses), and failed a run that had passed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cpu_scale_bench(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """Run scripts/bench.py's scale mode, tiny, on the CPU (`--scale 0.02 --train one
    --window-steps 1`, `--lead-in-s 0.05` unless `args` set it, the local tier under
    `tmp_path / "bench"`) with `args`; it must exit 0. Returns (the size's results, what it
    printed)."""
    out = tmp_path / "out.json"
    if "--lead-in-s" not in args:  # (the default 2 s of training before each window: seconds a save here)
        args = ("--lead-in-s", "0.05", *args)
    run = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "bench.py"),
                          "--device", "cpu", "--scale", "0.02", "--train", "one", "--window-steps", "1",
                          "--dir", str(tmp_path / "bench"), "--out", str(out), *args],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())["scale"][0], run.stdout
