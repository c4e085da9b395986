from __future__ import annotations

import pytest

from tiered.engine import gpu_stack_available


HAS_GPU = gpu_stack_available()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs CUDA with nvCOMP and KvikIO"))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def tier_config(tmp_path):
    def make(codec: str = "ans", **budgets) -> dict:
        cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "local"), "codec": codec}]}
        if budgets:
            cfg["budgets"] = budgets
        return cfg

    return make
