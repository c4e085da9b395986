"""What the trainer integrations share: a trainer's checkpoint kept as one tiered step plus a
small pointer file at the path the trainer names.

- The step (`Engine.save(step, tensors, local=True)`) holds the large part: model weights and
  optimizer states, compressed on the GPU and written in the background. Its number is the
  trainer's global step, so `tiered-restore` and `tiered ls` show training steps.
- The pointer (``torch.save`` format, a few KB) holds everything else the trainer put in its
  checkpoint (loop and callback states, schedulers, hyperparameters), the RNG states of the
  saving process, and which step and fast tier it names. It is written atomically once the step
  is durable, so a crash leaves either no pointer or one whose step is committed: a trainer's
  "last checkpoint" is always loadable.

Two paths saved at one global step (Lightning's ``last.ckpt`` beside its top-k file; a trainer
saving twice at a step) share the step: weights and optimizer states only change when the global
step does. Each path keeps its own pointer, with the rest of the checkpoint as it was when that
path was saved.

Removing a path removes its pointer. The step's bytes follow the tiers' retention
(``keep_last``/``keep_every``, applied after each save and by `tiered gc`).
"""

from __future__ import annotations

import io
import logging
import os
import random
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tiered.engine import Engine
from tiered.errors import TieredError
from tiered.tiers.local import replace_durably

log = logging.getLogger("tiered")

POINTER_FORMAT = "tiered-checkpoint-pointer"
POINTER_VERSION = 1


def rng_states() -> dict[str, Any]:
    """The RNG states of this process: Python, NumPy, torch CPU and every CUDA device (in types a
    weights-only ``torch.load`` accepts: tuples, numbers, strings, tensors)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.copy()), pos, has_gauss, cached),
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` returned (CUDA states where this process has as many devices)."""
    random.setstate(states["python"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


def single_process() -> bool:
    """No torch.distributed job of several ranks runs here (RNG states are restored only then:
    under DDP each rank keeps its own streams, as the trainers do)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class StepStore:
    """One engine (made from `config` at first use, or given) and the pointers written through it.

    `config`: anything `tiered.load_config` takes (a path, a dict, None for the embedded
    default), or an `Engine` the caller owns (then `close()` leaves it open).
    """

    def __init__(self, config: Any = None):
        self._own = not isinstance(config, Engine)
        self._engine: Engine | None = None if self._own else config
        self._config = config
        self._lock = threading.Condition()
        self._inflight: dict[int, Any] = {}
        """Saves of this store not yet durable, by step."""
        self._saved: set[int] = set()
        """Steps this store saved (a second path at one of them shares it)."""
        self._pending: dict[str, object] = {}
        """Pointers waiting for their step, by path (a token: a later save or a remove replaces it)."""
        self._callbacks = 0
        """Pointer writes registered on saves' futures and not yet run."""

    @property
    def engine(self) -> Engine:
        with self._lock:
            if self._engine is None:
                self._engine = Engine.from_config(self._config)
                fast = self._engine.config.fast_tier
                if fast.keep_last is None and fast.keep_every is None and len(self._engine.config.tiers) == 1:
                    log.info("tiered: tier %r keeps every step: a trainer that removes old checkpoints removes its "
                             "pointers only; set keep_last on the tier to bound the disk", fast.name)
            return self._engine

    def save(self, step: int, tensors: Any, rest: dict[str, Any], path: str | os.PathLike) -> Any:
        """Save `tensors` as `step` (unless this store saved that step already) and write the
        pointer to `path` once the step is durable. Returns the step's handle, or None where the
        step was durable already. A step committed before, by another run in the same tier, is
        refused (steps are immutable): a new experiment needs a tier of its own."""
        engine, key = self.engine, os.fspath(path)
        buf = io.BytesIO()  # the rest is captured now: the trainer changes it once this returns
        torch.save({"format": POINTER_FORMAT, "version": POINTER_VERSION, "step": step,
                    "fast_tier": engine.config.fast_tier.name, "rng": rng_states(), "checkpoint": rest}, buf)
        data, token = buf.getvalue(), object()
        with self._lock:
            handle, mine = self._inflight.get(step), step in self._saved
        if handle is None and not mine:
            try:
                handle = engine.save(step, tensors, local=True)
            except TieredError as exc:
                if step in engine.steps(engine.config.fast_tier.name):
                    raise TieredError(f"{exc}. An earlier run saved it in the same tier: give each training run a "
                                      "tier path of its own; to branch from an older checkpoint, delete the "
                                      "steps after it first") from None
                raise
            with self._lock:
                self._inflight[step] = handle
                self._saved.add(step)
        with self._lock:
            self._pending[key] = token
        if handle is None:
            self._write(key, token, data)
            return None
        with self._lock:
            self._callbacks += 1
        handle.persisted.add_done_callback(lambda fut: self._persisted(step, fut, key, token, data))
        return handle

    def _persisted(self, step: int, fut: Any, key: str, token: object, data: bytes) -> None:
        try:
            with self._lock:
                if self._inflight.get(step) is not None and self._inflight[step].persisted is fut:
                    del self._inflight[step]
            if fut.exception() is None:
                self._write(key, token, data)
                return
            with self._lock:  # the failure is raised by the engine's next save() or wait(); no pointer
                if self._pending.get(key) is token:
                    del self._pending[key]
            log.error("tiered: step %d failed, so %s was not written: %s", step, key, fut.exception())
        finally:
            with self._lock:
                self._callbacks -= 1
                self._lock.notify_all()

    def _write(self, key: str, token: object, data: bytes) -> None:
        with self._lock:
            if self._pending.get(key) is not token:
                return  # removed, or saved again, meanwhile
            del self._pending[key]
            Path(key).parent.mkdir(parents=True, exist_ok=True)
            replace_durably(Path(key), data)

    def load(self, path: str | os.PathLike, device: Any = None,
             read: Callable[[str], dict] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the trainer's checkpoint, merged back from the pointer at `path` and its step; the
        pointer's RNG states). `read` loads the pointer (default ``torch.load`` on the CPU, not
        weights-only: the pointer holds the trainer's own objects, as its checkpoint would)."""
        self.wait_pointer(path)
        key = os.fspath(path)
        if not os.path.isfile(key):
            raise FileNotFoundError(f"checkpoint not found: {key}")
        pointer = read(key) if read is not None else torch.load(key, map_location="cpu", weights_only=False)
        if not isinstance(pointer, dict) or pointer.get("format") != POINTER_FORMAT:
            raise TieredError(f"{key} is not a tiered checkpoint pointer (a checkpoint saved without tiered?); "
                              "load it with the trainer's own checkpoint IO")
        if pointer.get("version") != POINTER_VERSION:
            raise TieredError(f"{key}: tiered pointer version {pointer.get('version')} is not readable by this "
                              f"tiered (reads version {POINTER_VERSION}); upgrade tiered")
        engine = self.engine
        if pointer["fast_tier"] != engine.config.fast_tier.name:
            log.warning("tiered: %s was saved with fast tier %r; this config's is %r", key, pointer["fast_tier"],
                        engine.config.fast_tier.name)
        tensors = engine.load(pointer["step"], device=device)
        return {**pointer["checkpoint"], **tensors}, pointer["rng"]

    def remove(self, path: str | os.PathLike) -> None:
        key = os.fspath(path)
        with self._lock:
            self._pending.pop(key, None)  # a pointer still waiting for its step is never written
        try:
            os.unlink(key)
        except FileNotFoundError:
            pass

    def wait_pointer(self, path: str | os.PathLike) -> None:
        """Wait until a pointer this store is still to write for `path` is written (or failed)."""
        key = os.fspath(path)
        with self._lock:
            self._lock.wait_for(lambda: key not in self._pending or not self._callbacks)

    def wait(self) -> None:
        """Every save durable and every pointer written; raises the first failure."""
        if self._engine is not None:
            self._engine.wait()
        with self._lock:
            self._lock.wait_for(lambda: not self._callbacks)

    def close(self) -> None:
        """Wait for the saves in flight, and close the engine this store made."""
        with self._lock:
            engine, self._engine = self._engine, (None if self._own else self._engine)
        if engine is not None:
            try:
                engine.wait()
                with self._lock:
                    self._lock.wait_for(lambda: not self._callbacks)
            finally:
                if self._own:
                    engine.close()
