"""PyTorch Lightning with tiered: `TieredCheckpointIO` as the Trainer's checkpoint plugin.

    pip install 'tiered[lightning]'
    python examples/lightning_resume.py --dir /tmp/pl --max-steps 40            # saves every 20 steps
    python examples/lightning_resume.py --dir /tmp/pl --max-steps 80 --resume   # resumes from "last"

`ModelCheckpoint` decides when and what to keep, as usual; the plugin keeps the weights and
optimizer states as a tiered step (compressed, written in the background, migrated down the
tiers) and a small pointer file where Lightning expects its `.ckpt`. `ckpt_path="last"` resumes
through Lightning's own logic. The last line prints a checksum of the weights: a run stopped at
40 and resumed to 80 prints the same one as a run straight to 80. (Stop at the end of an epoch, as
here: Lightning restarts a plain dataloader from the start of the epoch it resumes in.)
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from tiered.integrations.lightning import TieredCheckpointIO


class Regressor(LightningModule):
    def __init__(self, width: int = 64):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 16, generator=g)  # 20 steps an epoch
    y = x.sum(1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="./.tiered/lightning-example")
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--resume", action="store_true", help='resume from the "last" checkpoint')
    args = ap.parse_args()

    seed_everything(0)
    config = {"tiers": [{"name": "local", "kind": "local", "path": f"{args.dir}/tiers/local"}]}
    checkpoints = ModelCheckpoint(dirpath=f"{args.dir}/ckpts", every_n_train_steps=20, save_last=True)
    trainer = Trainer(max_steps=args.max_steps, plugins=[TieredCheckpointIO(config)], callbacks=[checkpoints],
                      logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="auto",
                      devices=1, deterministic=True)
    model = Regressor()
    trainer.fit(model, data(), ckpt_path="last" if args.resume else None)
    total = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"global step {trainer.global_step}, weights checksum {total:.12f}")


if __name__ == "__main__":
    main()
