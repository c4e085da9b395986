"""PyTorch Lightning: `TieredCheckpointIO`, a ``CheckpointIO`` plugin.

    from tiered.integrations.lightning import TieredCheckpointIO

    trainer = Trainer(plugins=[TieredCheckpointIO("tiered.yaml")],
                      callbacks=[ModelCheckpoint(every_n_train_steps=500, save_top_k=3, save_last=True)])
    trainer.fit(model)                     # saves through tiered, asynchronously
    trainer.fit(model, ckpt_path="last")   # resumes from the newest checkpoint

Each checkpoint Lightning writes is one tiered step, numbered by ``global_step``: the model's
``state_dict`` and the ``optimizer_states`` go through the engine (GPU compression, background
writes, migration down the tiers); the rest of the checkpoint (loops, callbacks, schedulers,
hyperparameters) and the RNG states go into a small pointer file at the path Lightning chose, once
the step is durable (`tiered.integrations.common`). So ``ckpt_path="last"``, a checkpoint's path,
``ModelCheckpoint``'s ``save_top_k``, ``every_n_train_steps`` and ``save_last`` (also ``"link"``)
work as with Lightning's own IO. Like Lightning's ``AsyncCheckpointIO``, ``save_checkpoint``
returns before the files are written; unlike it, the state is snapshotted on the GPU, not
copied whole to the host first.
"""

from __future__ import annotations

import os
import queue
from typing import Any, Optional

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("tiered.integrations.lightning needs Lightning: pip install 'tiered[lightning]'") from exc

import torch

from tiered.integrations.common import StepStore, set_rng_states, single_process
from tiered.observe.records import subscribe

TENSOR_KEYS = ("state_dict", "optimizer_states")
"""The parts of a Lightning checkpoint that go through the engine; the rest goes in the pointer."""


class TieredCheckpointIO(CheckpointIO):
    """`config`: a tiered config (path, dict, None for the embedded default) or an `Engine`.
    `restore_rng`: on load, restore the RNG states saved with the checkpoint (single process only:
    under DDP every rank keeps its own streams)."""

    def __init__(self, config: Any = None, *, restore_rng: bool = True):
        super().__init__()
        self.store = StepStore(config)
        self.restore_rng = restore_rng

    @property
    def engine(self) -> Any:
        return self.store.engine

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("TieredCheckpointIO takes no storage_options: tiers and codecs come from its config")
        if "global_step" not in checkpoint:
            raise ValueError("this checkpoint has no 'global_step', which names its tiered step: "
                             "save it through a Lightning Trainer")
        tensors = {k: checkpoint[k] for k in TENSOR_KEYS if k in checkpoint}
        rest = {k: v for k, v in checkpoint.items() if k not in TENSOR_KEYS}
        self.store.save(int(checkpoint["global_step"]), tensors, rest, path)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        device = map_location if isinstance(map_location, str) or hasattr(map_location, "type") else None
        checkpoint, rng = self.store.load(
            path, device=device,
            read=lambda p: torch.load(p, map_location="cpu", weights_only=weights_only))
        if self.restore_rng and single_process():
            set_rng_states(rng)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        self.store.remove(os.fspath(path))

    def teardown(self) -> None:
        """Lightning calls this at the end of fit: wait until every checkpoint is durable (and
        its pointer written), then close the engine this plugin made."""
        self.store.close()


class TieredMetrics(Callback):
    """Sends what each tiered save and migration cost to the Trainer's loggers (TensorBoard, W&B,
    CSV...): ``tiered/save_stall_ms``, ``tiered/save_durable_s``, ``tiered/save_stored_gb``,
    ``tiered/save_saved_pct``, and ``tiered/migrate_<src>_<dst>_s`` where this process migrates.
    Logged at the next training batch's end after the record, at the saved step.

        Trainer(plugins=[TieredCheckpointIO(cfg)], callbacks=[TieredMetrics(), ...])
    """

    def __init__(self) -> None:
        self._records: "queue.SimpleQueue[dict]" = queue.SimpleQueue()
        self._unsubscribe: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._unsubscribe is None:
            self._unsubscribe = subscribe(self._records.put)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.flush(trainer)
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.flush(trainer)

    def flush(self, trainer: Any) -> None:
        """Log the records that came since the last call."""
        while True:
            try:
                r = self._records.get_nowait()
            except queue.Empty:
                return
            if r["kind"] == "save":
                saved = 1 - r["stored_bytes"] / r["raw_bytes"] if r["raw_bytes"] else 0.0
                metrics = {"tiered/save_stall_ms": 1e3 * r["stall_s"], "tiered/save_durable_s": r["durable_s"],
                           "tiered/save_stored_gb": r["stored_bytes"] / 1e9, "tiered/save_saved_pct": 100 * saved}
            else:
                metrics = {f"tiered/migrate_{r['src']}_{r['dst']}_s": r["seconds"]}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=r["step"])
