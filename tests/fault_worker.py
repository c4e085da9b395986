"""Permission faults, run by tests/test_resource_faults.py in a process of its own: as root it runs
without CAP_DAC_OVERRIDE (setpriv), so that a directory's mode bits bind it as they bind a user.

    python tests/fault_worker.py MODE ROOT    # MODE: fail | next_tier; prints one JSON line of results

Each scenario makes a tier's directory unwritable (chmod 0555), saves and migrates through the
fault, restores the mode, and checks that the next save and the migrator's retry work.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

import tiered
from tiered.migrate import migrator


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g), "step": step}


def same(engine, step: int, tier: str | None = None) -> bool:
    got = engine.load(step, tier=tier)
    return torch.equal(got["w"], state(step)["w"]) and got["step"] == step


def main(mode: str, root: Path) -> dict:
    migrator.RETRY_FIRST_S = 0.5
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    nvme, shared = root / "nvme", root / "shared"
    cfg = {"chunk_size": "64KiB", "migration": "in_process", "on_fast_tier_error": mode, "tiers": [
        {"name": "local", "kind": "local", "path": str(nvme), "codec": "zstd"},
        {"name": "shared", "kind": "posix", "path": str(shared), "codec": "zstd"}]}
    out: dict = {}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state(1)).wait()
        engine.wait_migrated(timeout=60)
        nvme.chmod(0o555)  # the fast tier refuses new step directories
        try:
            handle = engine.save(2, state(2))
            handle.wait()
            out["tier_2"] = handle.tier
        except tiered.TieredError as exc:
            out["error_2"] = str(exc)
        out["training_goes_on"] = float((torch.ones(4) * 2).sum())  # the process is alive and computing
        nvme.chmod(0o755)
        out["handle_3"] = engine.save(3, state(3)).tier
        engine.wait()
        engine.wait_migrated(timeout=60)
        shared.chmod(0o555)  # now the shared tier refuses: migration fails, is reported, is retried
        engine.save(4, state(4)).wait()
        try:
            engine.wait_migrated(timeout=60)
        except tiered.TieredError as exc:
            out["migration_error"] = str(exc)
        shared.chmod(0o755)
        engine.wait_migrated(timeout=60)
        out["local"], out["shared"] = engine.steps("local"), engine.steps("shared")
        out["restored"] = {s: same(engine, s) for s in out["shared"]}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], Path(sys.argv[2]))))
