#!/usr/bin/env python3
"""Make tests/data/gpu-migrated: a step saved from a GPU (nvCOMP ANS through KvikIO) and migrated
by the background migrator to a portable tier (ANS decoded on the GPU, re-encoded as zstd on the CPU).

CPU-only CI then uploads that step, byte for byte, to S3 (SeaweedFS) and restores it without a
GPU (tests/test_cli.py::test_gpu_made_s3_copy_restores_without_a_gpu).

    python scripts/make_gpu_fixture.py OUT_DIR     # on a GPU machine; copy OUT_DIR/gpu-migrated over
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import tiered  # noqa: E402
from helpers import fixture_state  # noqa: E402


def main() -> int:
    out = Path(sys.argv[1]) / "gpu-migrated"
    if not tiered.gpu.runtime.gpu_stack_available():
        print("make_gpu_fixture: needs CUDA with nvCOMP and KvikIO", file=sys.stderr)
        return 2
    state = fixture_state()
    on_gpu = {k: {n: (t.cuda() if t.dim() else t) for n, t in v.items()} if k != "meta" else v for k, v in state.items()}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"chunk_size": "64KiB", "migration": "in_process", "tiers": [
            {"name": "nvme", "kind": "local", "path": f"{tmp}/nvme", "codec": "ans"},
            {"name": "shared", "kind": "posix", "path": f"{tmp}/shared", "codec": "zstd"}]}
        with tiered.Engine.from_config(cfg) as engine:
            engine.save(1, on_gpu).wait()
            engine.wait_migrated(timeout=300)
            _, fast = engine.read_index(1)
            _, portable = engine.read_index(1, tier="shared")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(Path(tmp) / "shared", out)
    (out / "step_000000000001" / "MANIFEST.json").exists() or sys.exit("not committed")
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "fast_tier_io": fast.io,
            "fast_tier_codecs": sorted({t.codec.name for t in fast.tensors if t.chunks}),
            "portable_codecs": sorted({t.codec.name for t in portable.tensors if t.chunks})}
    (out / "PROVENANCE.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
