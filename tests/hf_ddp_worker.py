"""Run under torchrun (2 CPU ranks, gloo) by test_hf.py: the HF Trainer's DDP saves through
TieredCallback from the first process, and every process resumes through resume_checkpoint.
Writes what the first process saw to argv[2] as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import exit_without_teardown, weights_digest  # noqa: E402
from test_hf import _losses, _trainer  # noqa: E402

from tiered.integrations.hf import resume_checkpoint  # noqa: E402


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    tier = {"tiers": [{"name": "local", "kind": "local", "path": str(root / "tier"), "codec": "zstd"}]}
    ref, ref_cb = _trainer(root / "ref", {"tiers": [{**tier["tiers"][0], "path": str(root / "ref-tier")}]})
    ref.train()
    first, cb = _trainer(root / "run", tier, stop_at=8)
    first.train()
    again, cb2 = _trainer(root / "run", tier)
    folder = resume_checkpoint(again, cb2)
    again.train(resume_from_checkpoint=folder)
    if again.is_world_process_zero():
        out.write_text(json.dumps({"ref": _losses(ref), "resumed": _losses(again), "world": again.args.world_size,
                                   "digest": weights_digest(again.model), "ref_digest": weights_digest(ref.model),
                                   "steps": cb2.engine.steps(), "folder": folder}))
    for c in (cb, cb2, ref_cb):
        c.close()


if __name__ == "__main__":
    main()
    exit_without_teardown()
