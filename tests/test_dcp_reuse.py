"""A reused DCP plan's items (tiered.distributed.reuse), without a process group: DCP's planner runs in one
process here, as it plans each rank's part under torchrun (tests/test_distributed.py saves and
loads through it at 2 ranks)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultSavePlanner

from tiered.distributed.reuse import PlanReuse
from tiered.distributed.storage import StepWriter


def _planned(state: dict):
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state, storage_meta=None, is_coordinator=True)
    plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    return planner, planner.finish_plan(plans[0]), metadata


def _state(step: float) -> dict:
    torch.manual_seed(0)
    return {"w": torch.nn.Parameter(torch.randn(4, 3) + step),     # requires grad: stored detached
            "t": (torch.randn(6, 8) + step).t(),                    # a view that is not contiguous
            "plain": torch.arange(5.0) + step,                      # stored as the very tensor
            "opt": {"state": {0: {"exp_avg": torch.ones(3) * step}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "extra": {"epoch": int(step), "name": "run"}}


def test_a_reused_plans_items_at_once_are_dcps_items_one_by_one():
    """`StepWriter.items` with a reused plan's token takes every item's data at once
    (`Resolve.batch`); the flat state is the one it makes item by item from DCP's own resolution
    of the same state: the same names, tensors (detached, contiguous, or the very tensor) and
    serialized values."""
    reuse = PlanReuse()
    first = _state(0)
    planner, final, metadata = _planned(first)
    sig, leaves = reuse.walk(first)
    reuse.remember(sig, leaves, reuse.paths(first), planner, final, metadata)
    for step in (0, 1, 2):  # (the plan's own save, then later saves of the same structure)
        state = first if step == 0 else _state(step)
        sig, leaves = reuse.walk(state)
        assert reuse.matches(sig)
        fast = StepWriter.items(final, reuse.resolver(leaves), reuse.token)
        own, own_final, _ = _planned(state)
        slow = StepWriter.items(own_final, lambda i, item: own.resolve_data(item))
        assert [leaf.path for leaf in fast.leaves] == [leaf.path for leaf in slow.leaves]
        for a, b in zip(fast.leaves, slow.leaves):
            assert a.tensor.dtype == b.tensor.dtype and torch.equal(a.tensor, b.tensor), a.path
            assert a.tensor.is_contiguous() and not a.tensor.requires_grad, a.path
        by_name = {leaf.path[0]: leaf.tensor for leaf in fast.leaves}  # (an item's name: its fqn@offsets)
        assert by_name["plain@0"] is state["plain"], "a tensor needing neither is handed on as it is"
        assert by_name["opt.state.0.exp_avg@0"] is state["opt"]["state"][0]["exp_avg"]
        assert by_name["w@0,0"] is not state["w"] and by_name["t@0,0"].data_ptr() != state["t"].data_ptr()
        assert fast.structure == (reuse.token, tuple(_byte_sizes(final, slow)))


def _byte_sizes(plan, flat) -> list[int]:
    """The byte counts of the plan's serialized items in `flat` (in the plan's order)."""
    from torch.distributed.checkpoint.planner import WriteItemType

    return [leaf.tensor.numel() for item, leaf in zip(plan.items, flat.leaves) if item.type == WriteItemType.BYTE_IO]
