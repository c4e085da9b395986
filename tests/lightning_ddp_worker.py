"""Run under torchrun (2 CPU ranks, gloo) by test_lightning.py: Lightning's DDP strategy saves
through TieredCheckpointIO from rank 0 (Engine.save(local=True)) and every rank resumes from
"last". Writes what rank 0 saw to argv[2] as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from helpers import exit_without_teardown, weights_digest  # noqa: E402
from test_lightning import Losses, Tiny, _data  # noqa: E402

from tiered.integrations.lightning import TieredCheckpointIO  # noqa: E402


def fit(root: Path, tier: Path, max_steps: int, ckpt_path=None):
    pl.seed_everything(0)
    model, losses = Tiny(), Losses()
    io = TieredCheckpointIO({"tiers": [{"name": "local", "kind": "local", "path": str(tier), "codec": "zstd"}]})
    trainer = pl.Trainer(max_steps=max_steps, strategy="ddp", accelerator="cpu", devices=2, plugins=[io],
                         callbacks=[ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=4, save_top_k=-1,
                                                    save_last=True), losses],
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return trainer, losses.by_step, weights_digest(model), io


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    _, ref, ref_digest, _ = fit(root / "ref", root / "ref-tier", 12)
    fit(root / "run", root / "tier", 8)
    trainer, resumed, digest, io = fit(root / "run", root / "tier", 12, ckpt_path="last")
    if trainer.global_rank == 0:
        out.write_text(json.dumps({"ref": ref, "resumed": resumed, "ref_digest": ref_digest, "digest": digest,
                                   "steps": io.engine.steps(), "world": trainer.world_size}))


if __name__ == "__main__":
    main()
    exit_without_teardown()
