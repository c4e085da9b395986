"""Hugging Face `Trainer` with tiered: `TieredCallback` saves, `resume_checkpoint` resumes.

    pip install 'tiered[hf]'
    python examples/hf_trainer.py --dir /tmp/hf --stop-at 8     # a job stopped at step 8 (preempted)
    python examples/hf_trainer.py --dir /tmp/hf                 # resumes from step 8, trains to 16

The callback replaces the Trainer's own checkpoint save: the model's and optimizer's tensors go to
a tiered step, everything else the Trainer keeps (its state, the scheduler, RNG states) to a small
`checkpoint-<step>.tiered` file in `output_dir`. `resume_checkpoint(trainer, callback)` finds the
newest one for `trainer.train(resume_from_checkpoint=...)`. A tiny GPT-2 is built from a config
(no downloads); on a GPU the Trainer uses it. The last line prints the final loss: a run stopped
at 8 and resumed prints the same one as a run straight through.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from tiered.integrations.hf import TieredCallback, resume_checkpoint


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 100, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):
    """Ends the job at a step, as a preemption would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step
        return control


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="./.tiered/hf-example")
    ap.add_argument("--stop-at", type=int, default=None, help="end the job after this step")
    ap.add_argument("--max-steps", type=int, default=16)
    args = ap.parse_args()

    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    training = TrainingArguments(output_dir=f"{args.dir}/out", max_steps=args.max_steps, save_strategy="steps",
                                 save_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                                 report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True)
    config = {"tiers": [{"name": "local", "kind": "local", "path": f"{args.dir}/tiers/local"}]}
    callback = TieredCallback(config)
    callbacks = [callback] + ([StopAt(args.stop_at)] if args.stop_at else [])
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=callbacks)
    folder = resume_checkpoint(trainer, callback)  # None on a first run
    print("resuming from", folder or "nothing: a first run")
    trainer.train(resume_from_checkpoint=folder)
    callback.close()  # every save durable
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
    print(f"global step {trainer.state.global_step}, last loss {loss:.6f}")


if __name__ == "__main__":
    main()
