"""The Hugging Face callback with the real Trainer: a GPT-2 built from a config (no downloads)
saves through tiered every N steps, stops, resumes bit-exact, and continues with the same losses."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'tiered[hf]'")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate: pip install 'tiered[hf]'")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from tiered.integrations.hf import TieredCallback, resume_checkpoint, saved_steps  # noqa: E402


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (32, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True  # the job ends here, as a preempted one would
        return control


def _trainer(out, config, stop_at=None):
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out), max_steps=16, save_strategy="steps", save_steps=4,
                             per_device_train_batch_size=4, learning_rate=1e-3, lr_scheduler_type="linear",
                             logging_steps=1, report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True)
    callback = TieredCallback(config)
    callbacks = [callback] + ([_StopAt(stop_at)] if stop_at else [])
    trainer = Trainer(model=model, args=args, train_dataset=_Data(), callbacks=callbacks)
    return trainer, callback


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_hf_trainer_saves_through_tiered_and_resumes_bit_exact(tmp_path, tier_config):
    config = tier_config("zstd")
    ref, ref_cb = _trainer(tmp_path / "ref", {"tiers": [{**config["tiers"][0], "path": str(tmp_path / "ref-tier")}]})
    ref.train()

    first, cb = _trainer(tmp_path / "run", config, stop_at=8)
    first.train()
    assert saved_steps(tmp_path / "run") == [4, 8] and cb.engine.steps() == [4, 8]
    assert not list((tmp_path / "run").glob("checkpoint-*/")), "the Trainer's own save was skipped"
    cb.close()

    again, cb2 = _trainer(tmp_path / "run", config)
    folder = resume_checkpoint(again, cb2)
    assert folder.endswith("checkpoint-8")
    again.train(resume_from_checkpoint=folder)
    assert again.state.global_step == 16
    want = _losses(ref)
    assert {s: v for s, v in _losses(again).items() if s > 8} == {s: want[s] for s in range(9, 17)}
    for (name, x), (_, y) in zip(again.model.state_dict().items(), ref.model.state_dict().items()):
        assert torch.equal(x, y), name
    a, b = again.optimizer.state_dict()["state"], ref.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k][f], b[k][f]) for k in a for f in a[k] if torch.is_tensor(a[k][f]))
    # tied input and output embeddings stay one tensor through the tiered step
    model = again.model
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    cb2.close()
    ref_cb.close()


def test_resume_without_a_tiered_checkpoint_is_a_first_run(tmp_path, tier_config):
    trainer, cb = _trainer(tmp_path / "fresh", tier_config("zstd"))
    assert resume_checkpoint(trainer, cb) is None
    with pytest.raises(FileNotFoundError, match="no tiered checkpoint of step 5"):
        resume_checkpoint(trainer, cb, step=5)
    cb.close()


def test_ddp_saves_from_the_first_process_and_every_process_resumes(tmp_path):
    """Two CPU processes under torchrun (the Trainer's DDP, gloo)."""
    from helpers import run_two_ranks

    got = run_two_ranks("hf_ddp_worker.py", tmp_path)
    assert got["world"] == 2 and got["steps"] == [4, 8, 12, 16] and got["folder"].endswith("checkpoint-8")
    ref = {int(k): v for k, v in got["ref"].items()}
    assert {int(k): v for k, v in got["resumed"].items() if int(k) > 8} == {s: ref[s] for s in range(9, 17)}
    assert got["digest"] == got["ref_digest"], "the resumed DDP run ends with the same weights"


def test_the_amp_scaler_in_accelerates_optimizer_is_saved_and_restored(tmp_path, tier_config):
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import TrainerControl, TrainerState

    trainer, cb = _trainer(tmp_path / "amp", tier_config("zstd"))
    model = trainer.model
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    opt = AcceleratedOptimizer(torch.optim.AdamW(model.parameters()), device_placement=False, scaler=scaler)
    state, control = TrainerState(global_step=4), TrainerControl(should_save=True)
    cb.on_step_end(trainer.args, state, control, model=model, optimizer=opt, lr_scheduler=None)
    cb.store.wait()
    folder = resume_checkpoint(trainer, cb)
    saved = torch.load(f"{folder}/scaler.pt", weights_only=True)
    assert saved["scale"] == 1024.0 and not control.should_save
    cb.close()
