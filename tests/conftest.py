from __future__ import annotations

import os
import subprocess

import pytest
from helpers import new_bucket, running_s3

from tiered.gpu.runtime import gpu_stack_available

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


@pytest.fixture(scope="session", autouse=True)
def _bandwidth_cache(tmp_path_factory):
    """Probed tier bandwidths go to a per-run cache, never the user's ~/.cache/tiered."""
    saved = os.environ.get("TIERED_CACHE_DIR")
    os.environ["TIERED_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if saved is None:
        os.environ.pop("TIERED_CACHE_DIR", None)
    else:
        os.environ["TIERED_CACHE_DIR"] = saved


@pytest.fixture
def small_fs(tmp_path):
    """A real 24 MiB filesystem (tmpfs): writes past it fail with ENOSPC."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on loopback for the whole run (tests.helpers.running_s3)."""
    with running_s3(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket on the test server."""
    return new_bucket(s3_server)
