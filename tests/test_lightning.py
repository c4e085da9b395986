"""The Lightning plugin with the real Lightning Trainer: save every N steps through tiered, stop,
resume bit-exact, and continue with the same losses as an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs Lightning: pip install 'tiered[lightning]'")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from tiered.integrations.lightning import TieredCheckpointIO, TieredMetrics  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


class Losses(Callback):
    def __init__(self):
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.by_step[trainer.global_step] = outputs["loss"].item()


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)  # 8 steps an epoch


def _fit(root: Path, config: dict, max_steps: int, ckpt_path=None, top_k: int = 2, accelerator: str = "cpu"):
    pl.seed_everything(0)
    model, losses = Tiny(), Losses()
    io = TieredCheckpointIO(config)
    checkpoints = ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=4, save_top_k=top_k,
                                  monitor="train_loss", mode="min", save_last=True)
    trainer = pl.Trainer(max_steps=max_steps, plugins=[io], callbacks=[checkpoints, losses], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator=accelerator, devices=1,
                         deterministic=True)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model, trainer, losses.by_step, io


def _same_state(a: Tiny, ta, b: Tiny, tb) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    sa, sb = ta.optimizers[0].state_dict()["state"], tb.optimizers[0].state_dict()["state"]
    for k in sa:
        for field in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][field]), torch.as_tensor(sb[k][field])), (k, field)
    assert ta.lr_scheduler_configs[0].scheduler.state_dict() == tb.lr_scheduler_configs[0].scheduler.state_dict()


def test_lightning_saves_through_tiered_and_resumes_from_last_bit_exact(tmp_path, tier_config):
    config = tier_config("zstd")
    ref_model, ref_trainer, ref_losses, _ = _fit(tmp_path / "ref", config | {"tiers": [
        {**config["tiers"][0], "path": str(tmp_path / "ref-tier")}]}, max_steps=16)

    _, _, first, io = _fit(tmp_path, config, max_steps=8)
    ckpts = tmp_path / "ckpts"
    assert (ckpts / "last.ckpt").is_file() and io.engine.steps() == [4, 8]
    # the pointer is small: the tensors are in the tiered step
    assert (ckpts / "last.ckpt").stat().st_size < 64 << 10

    model, trainer, resumed, io = _fit(tmp_path, config, max_steps=16, ckpt_path="last")
    assert first == {s: ref_losses[s] for s in range(1, 9)}
    assert resumed == {s: ref_losses[s] for s in range(9, 17)}, "the resumed run continues with the same losses"
    _same_state(model, trainer, ref_model, ref_trainer)
    assert io.engine.steps() == [4, 8, 12, 16]
    # save_top_k=2 removed the others' files; last.ckpt names step 16
    names = sorted(p.name for p in ckpts.glob("*.ckpt"))
    assert len(names) == 3 and "last.ckpt" in names, names
    assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 16


def test_resume_from_a_checkpoint_path(tmp_path, tier_config):
    """An end-of-epoch checkpoint's path (mid-epoch, Lightning restarts a plain DataLoader's epoch)."""
    config = tier_config("zstd")
    _, _, ref, _ = _fit(tmp_path / "ref", config | {"tiers": [
        {**config["tiers"][0], "path": str(tmp_path / "ref-tier")}]}, max_steps=16)
    _fit(tmp_path, config, max_steps=8, top_k=-1)
    step8 = next((tmp_path / "ckpts").glob("*step=8.ckpt"))
    _, trainer, resumed, _ = _fit(tmp_path / "again", config, max_steps=16, ckpt_path=step8)
    assert resumed == {s: ref[s] for s in range(9, 17)}


def test_a_checkpoint_not_saved_through_tiered_is_refused_clearly(tmp_path, tier_config):
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}, "global_step": 3}, path)
    io = TieredCheckpointIO(tier_config("zstd"))
    with pytest.raises(Exception, match="not a tiered checkpoint pointer"):
        io.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.teardown()


def test_tiered_metrics_reach_the_trainers_logger(tmp_path, tier_config):
    from lightning.pytorch.loggers import CSVLogger

    pl.seed_everything(0)
    logger = CSVLogger(tmp_path / "logs", name="run")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=4, save_top_k=-1)
    trainer = pl.Trainer(max_steps=8, plugins=[TieredCheckpointIO(tier_config("zstd"))],
                         callbacks=[checkpoints, TieredMetrics()], logger=logger, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(Tiny(), _data())
    import csv

    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    saves = {int(r["step"]): r for r in rows if r.get("tiered/save_stall_ms")}
    assert sorted(saves) == [4, 8], rows
    assert all(float(r["tiered/save_durable_s"]) > 0 and float(r["tiered/save_stored_gb"]) > 0 for r in saves.values())


def test_ddp_saves_from_rank_zero_and_every_rank_resumes(tmp_path):
    """Two CPU ranks under torchrun (Lightning's DDP strategy, gloo)."""
    from helpers import run_two_ranks

    got = run_two_ranks("lightning_ddp_worker.py", tmp_path)
    assert got["world"] == 2 and got["steps"] == [4, 8, 12]
    ref = {int(k): v for k, v in got["ref"].items()}
    assert {int(k): v for k, v in got["resumed"].items()} == {s: ref[s] for s in range(9, 13)}
    assert got["digest"] == got["ref_digest"], "the resumed DDP run ends with the same weights"


def test_a_new_run_in_an_old_runs_tier_is_refused_clearly(tmp_path, tier_config):
    config = tier_config("zstd")
    _fit(tmp_path / "first", config, max_steps=4)
    with pytest.raises(Exception, match="An earlier run saved it in the same tier"):
        _fit(tmp_path / "second", config, max_steps=4)  # a fresh run: its step 4 is the old run's
    # nothing of the first run was touched
    io = TieredCheckpointIO(config)
    assert io.engine.steps() == [4] and io.load_checkpoint(tmp_path / "first" / "ckpts" / "last.ckpt")["global_step"] == 4
    io.teardown()


@pytest.mark.gpu
def test_lightning_on_a_gpu_with_ans_resumes_bit_exact(tmp_path, tier_config):
    """The GPU path: weights and AdamW state on the GPU, compressed with nvCOMP ANS."""
    config = tier_config("ans")
    ref_model, ref_trainer, ref_losses, _ = _fit(tmp_path / "ref", config | {"tiers": [
        {**config["tiers"][0], "path": str(tmp_path / "ref-tier")}]}, max_steps=16, accelerator="gpu")
    _, _, _, io = _fit(tmp_path, config, max_steps=8, accelerator="gpu")
    _, index = io.engine.read_index(8)
    assert {t.codec.name for t in index.tensors if t.device.startswith("cuda")} == {"ans"}
    model, trainer, resumed, _ = _fit(tmp_path, config, max_steps=16, ckpt_path="last", accelerator="gpu")
    assert resumed == {s: ref_losses[s] for s in range(9, 17)}
    _same_state(model, trainer, ref_model, ref_trainer)
