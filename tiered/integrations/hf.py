"""Hugging Face Trainer: `TieredCallback` saves through tiered, `resume_checkpoint` resumes.

    from tiered.integrations.hf import TieredCallback, resume_checkpoint

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[TieredCallback("tiered.yaml")])
    trainer.train()                                        # saves at args.save_steps, through tiered
    trainer.train(resume_from_checkpoint=resume_checkpoint(trainer, "tiered.yaml"))   # newest step

**Saving.** Where the Trainer would save (``save_strategy``/``save_steps``), the callback saves
instead: the model's and the optimizer's state dicts through the engine, as the step
``global_step`` (compressed on the GPU, written in the background), and the scheduler, the AMP
scaler, the RNG states and the ``TrainerState`` in a small pointer file,
``output_dir/checkpoint-<step>.tiered``, once the step is durable
(`tiered.integrations.common`). The Trainer's own save is skipped, so ``save_total_limit`` does
not apply: the tiers' retention (``keep_last``) bounds what is kept. The saved ``TrainerState`` is
the one at the end of the step, before that step's log line and evaluation.

**Resuming.** `resume_checkpoint` rebuilds a Trainer checkpoint folder from a tiered step
(weights, optimizer, scheduler, scaler, RNG, trainer state, in the Trainer's own file names) and
returns its path for ``trainer.train(resume_from_checkpoint=...)``, so the Trainer's own resume
(skipping the batches already seen, restoring each state) runs unchanged. That costs one local
write of the state at a cold start; the save path never writes these files.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("tiered.integrations.hf needs transformers: pip install 'tiered[hf]'") from exc

import torch

from tiered.integrations.common import StepStore, rng_states

POINTER_SUFFIX = ".tiered"


def pointer_path(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}{POINTER_SUFFIX}"


class TieredCallback(TrainerCallback):
    """`config`: a tiered config (path, dict, None for the embedded default) or an `Engine`.
    `trainer`: the Trainer, only where its optimizer does not carry the AMP gradient scaler
    (accelerate's optimizer does: fp16 training saves it without this)."""

    def __init__(self, config: Any = None, *, trainer: Any = None):
        self.store = StepStore(config)
        self.trainer = trainer

    @property
    def engine(self) -> Any:
        return self.store.engine

    def on_step_end(self, args, state, control, **kwargs):
        return self._save_if_asked(args, state, control, **kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):  # save_strategy="epoch"
        return self._save_if_asked(args, state, control, **kwargs)

    def _save_if_asked(self, args, state, control, **kwargs):
        if not control.should_save:
            return control
        control.should_save = False  # saved here instead: the Trainer's own save would write it all again
        per_process = None
        if args.world_size > 1:  # every process's RNG streams (dropout differs by process), as the Trainer keeps them
            import torch.distributed as dist

            buf = io.BytesIO()
            torch.save(rng_states(), buf)  # as bytes: tensors inside gather_object's pickles do not load back
            per_process = [None] * args.world_size if state.is_world_process_zero else None
            dist.gather_object(buf.getvalue(), per_process, dst=0)
            if per_process is not None:
                per_process = [torch.load(io.BytesIO(b), weights_only=True) for b in per_process]
        if not state.is_world_process_zero:  # the Trainer saves replicated (DDP) state from one process too
            return control
        model, optimizer, scheduler = kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        if model is None or optimizer is None:
            raise ValueError("TieredCallback needs the Trainer's model and optimizer (passed to every callback)")
        tensors = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        # The AMP gradient scaler (fp16): the Trainer's optimizer is accelerate's, which holds it.
        scaler = getattr(optimizer, "scaler", None)
        if scaler is None:
            scaler = getattr(getattr(self.trainer, "accelerator", None), "scaler", None)
        rest = {"scheduler": scheduler.state_dict() if scheduler is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True), "rng_per_process": per_process}
        self.store.save(int(state.global_step), tensors, rest, pointer_path(args.output_dir, state.global_step))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.store.wait()  # every checkpoint durable, its pointer written, before train() returns
        return control

    def close(self) -> None:
        """Close the engine this callback made (at exit it is closed anyway, after its saves)."""
        self.store.close()


def saved_steps(output_dir: str | os.PathLike) -> list[int]:
    """Steps with a pointer under `output_dir`, ascending."""
    out = []
    for p in Path(output_dir).glob(f"checkpoint-*{POINTER_SUFFIX}"):
        digits = p.name[len("checkpoint-"):-len(POINTER_SUFFIX)]
        if digits.isdigit():
            out.append(int(digits))
    return sorted(out)


def resume_checkpoint(trainer: Any, config: Any = None, step: int | None = None) -> str | None:
    """The path of a Trainer checkpoint folder rebuilt from tiered `step` (default: the newest
    with a pointer in ``trainer.args.output_dir``), for ``trainer.train(resume_from_checkpoint=)``;
    None where there is none (a first run). `config`: as for `TieredCallback`, or the callback
    itself (its engine is used)."""
    output_dir = trainer.args.output_dir
    several = trainer.args.world_size > 1
    chosen: Any = None
    if not several or trainer.is_world_process_zero():
        steps = saved_steps(output_dir)
        if step is None:
            chosen = steps[-1] if steps else None
        elif step in steps:
            chosen = step
        else:
            chosen = FileNotFoundError(f"no tiered checkpoint of step {step} in {output_dir} "
                                       f"(saved: {steps or 'none'})")
    if several:  # the first process decides, so that every process resumes from the same step
        import torch.distributed as dist

        box = [chosen]
        dist.broadcast_object_list(box, src=0)
        chosen = box[0]
    if isinstance(chosen, Exception):
        raise chosen
    if chosen is None:
        return None
    step = chosen
    folder = Path(output_dir) / "tiered-resume" / f"checkpoint-{step}"
    accelerator = getattr(trainer, "accelerator", None)
    if several and not trainer.is_world_process_zero():
        if accelerator is not None:
            accelerator.wait_for_everyone()  # the first process rebuilds the folder (output_dir is shared)
        return str(folder)
    store = config.store if isinstance(config, TieredCallback) else StepStore(config)
    try:
        saved, rng = store.load(pointer_path(output_dir, step), device="cpu")
    finally:
        if not isinstance(config, TieredCallback):
            store.close()
    _write_folder(folder, saved, rng)
    if trainer.args.world_size > 1 and accelerator is not None:
        accelerator.wait_for_everyone()
    return str(folder)


def _write_folder(folder: Path, saved: dict[str, Any], rng: dict[str, Any]) -> None:
    """The Trainer's checkpoint files, from a tiered step's state and its pointer."""
    from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
    from transformers.utils import WEIGHTS_NAME

    folder.mkdir(parents=True, exist_ok=True)
    torch.save(saved["model"], folder / WEIGHTS_NAME)
    torch.save(saved["optimizer"], folder / OPTIMIZER_NAME)
    if saved.get("scheduler") is not None:
        torch.save(saved["scheduler"], folder / SCHEDULER_NAME)
    if saved.get("scaler") is not None:
        torch.save(saved["scaler"], folder / SCALER_NAME)
    per_process = saved.get("rng_per_process")
    if per_process:  # the Trainer's files of several processes: rng_state_<i>.pth, all CUDA devices each
        for i, r in enumerate(per_process):
            torch.save(_hf_rng(r, all_devices=True), folder / f"rng_state_{i}.pth")
    else:
        torch.save(_hf_rng(rng, all_devices=False), folder / "rng_state.pth")
    (folder / TRAINER_STATE_NAME).write_text(json.dumps(json.loads(saved["trainer_state"]), indent=2))


def _hf_rng(rng: dict[str, Any], all_devices: bool) -> dict[str, Any]:
    """`tiered.integrations.common.rng_states` in the Trainer's rng_state file format."""
    name, keys, pos, has_gauss, cached = rng["numpy"]
    out = {"python": rng["python"], "numpy": (name, keys.numpy(), pos, has_gauss, cached), "cpu": rng["torch"]}
    if rng.get("cuda"):
        here = torch.cuda.current_device() if torch.cuda.is_available() else 0
        out["cuda"] = rng["cuda"] if all_devices else rng["cuda"][here]
    return out
