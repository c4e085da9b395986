"""The TorchTitan-style DCP recipe of docs/integrations.md: `Stateful` wrappers saved with
`dcp.async_save` through `TieredStorageWriter` every N steps, then a resume with `dcp.load`
that continues with the same losses as an uninterrupted run."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import tiered
from tiered.dcp import TieredStorageReader, TieredStorageWriter


class AppState(Stateful):
    """Model and optimizer as DCP saves them (TorchTitan's CheckpointManager does the same)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(1, keepdim=True)


def _train(model, opt, steps, engine=None, every=4, first=1) -> dict[int, float]:
    losses, pending = {}, None
    for step in range(first, first + steps):
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.item()
        if engine is not None and step % every == 0:
            if pending is not None:
                pending.result()  # one save in flight at a time, as TorchTitan does
            pending = dcp.async_save({"app": AppState(model, opt)}, storage_writer=TieredStorageWriter(engine, step))
    if pending is not None:
        pending.result()
    return losses


def test_dcp_async_save_recipe_resumes_bit_exact(tier_config):
    model, opt = _setup()
    ref = _train(model, opt, 12)

    with tiered.Engine.from_config(tier_config("zstd")) as engine:
        m1, o1 = _setup()
        _train(m1, o1, 8, engine)  # the job stops after step 8
        assert engine.steps() == [4, 8]

        m2, o2 = _setup()
        state = {"app": AppState(m2, o2)}
        step = engine.latest_step()
        dcp.load(state, storage_reader=TieredStorageReader(engine, step))
        resumed = _train(m2, o2, 12 - step, first=step + 1)
    assert resumed == {s: ref[s] for s in range(9, 13)}
    for a, b in zip(m2.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
