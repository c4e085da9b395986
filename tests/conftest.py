from __future__ import annotations

import pytest
import torch


def gpu_stack() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import kvikio  # noqa: F401
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


HAS_GPU = gpu_stack()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CUDA with nvCOMP and KvikIO")


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
