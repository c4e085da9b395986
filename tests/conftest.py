from __future__ import annotations

import fcntl
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


@pytest.fixture(autouse=True)
def one_gpu_test_at_a_time(request, tmp_path_factory):
    """Run by several workers (`pytest -n 2`, as CI does), the GPU tests still run one at a time:
    some read the GPU's free memory, which another worker's test would move. The lock file lies
    in the run's temporary folder, which pytest-xdist's workers share."""
    if not (HAS_GPU and request.node.get_closest_marker("gpu")):
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "tiered-gpu-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


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


def _mounted(tmp_path, name: str, fstype: str, *options: str):
    """A fresh filesystem of `fstype` mounted at tmp_path/name for the test (root only)."""
    mount = tmp_path / name
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {fstype} needs root")
    r = subprocess.run(["mount", "-t", fstype, *options, fstype, str(mount)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here: {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_fs(tmp_path):
    """A real 24 MiB filesystem (tmpfs): writes past it fail with ENOSPC."""
    yield from _mounted(tmp_path, "small", "tmpfs", "-o", "size=24m")


@pytest.fixture
def ramfs(tmp_path):
    """A real ramfs mount: a filesystem that refuses O_DIRECT (EINVAL at open), as some network
    and FUSE filesystems do (tmpfs accepts it since Linux 6.6)."""
    yield from _mounted(tmp_path, "ramfs", "ramfs")


class FailingDisk:
    """An ext4 filesystem on a loop device over a file: `fail_reads()` cuts the file short, and
    from then on every read of a block past the cut fails with EIO, as a dying disk's do."""

    def __init__(self, tmp_path):
        self.image, self.mount = tmp_path / "disk.img", tmp_path / "disk"
        self.mount.mkdir()
        with open(self.image, "wb") as f:
            f.truncate(64 << 20)
        self.device = self._run("losetup", "-f", "--show", str(self.image)).strip()
        try:
            self._run("mkfs.ext4", "-q", "-O", "^has_journal", self.device)
            self._run("mount", self.device, str(self.mount))
        except BaseException:
            self._run("losetup", "-d", self.device, check=False)
            raise

    @staticmethod
    def _run(*cmd, check=True):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if check and r.returncode != 0:
            pytest.skip(f"no loop-device filesystem here ({' '.join(cmd[:2])}: {r.stderr.strip()})")
        return r.stdout

    def fail_reads(self, keep: int = 1 << 20) -> None:
        """Blocks past the first `keep` bytes of the device now fail to read (EIO); the page cache
        of every file on it is dropped first, so that reads go to the device."""
        subprocess.run(["sync"], check=True)
        for path in self.mount.rglob("*"):
            if path.is_file() and not path.is_symlink():
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        os.truncate(self.image, keep)

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.mount)], check=False)
        subprocess.run(["losetup", "-d", self.device], check=False)


@pytest.fixture
def failing_disk(tmp_path):
    """A real filesystem whose reads can be made to fail with EIO (`FailingDisk`); root only."""
    if os.geteuid() != 0:
        pytest.skip("a loop device needs root")
    disk = FailingDisk(tmp_path)
    try:
        yield disk
    finally:
        disk.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on loopback for the whole run (tests.helpers.running_s3)."""
    with running_s3(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket on the test server."""
    return new_bucket(s3_server)
