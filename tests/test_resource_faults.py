"""Resource faults on real directories and a real (small) filesystem: permission denied, disk
full. The save fails with a clear error (or, with ``on_fast_tier_error: next_tier``, goes to
the next tier), the process goes on, nothing committed is lost, and the next save works once
the fault is gone. A tier that refuses a migration keeps the step on the faster tier; the
migrator retries it until it succeeds.

Permission bits do not bind root: as root, the permission scenarios run in a process without
CAP_DAC_OVERRIDE (setpriv). The disk-full scenarios mount a 24 MiB tmpfs (root only)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiered

HERE = Path(__file__).parent


def run_worker(mode: str, root: Path) -> dict:
    cmd = [sys.executable, str(HERE / "fault_worker.py"), mode, str(root)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root, permission faults need setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "log": r.stderr}


def test_permission_denied_fails_the_save_clearly_and_the_next_save_works(tmp_path):
    out = run_worker("fail", tmp_path)
    nvme = tmp_path / "nvme"
    assert "error_2" in out and "Permission denied" in out["error_2"] and str(nvme) in out["error_2"], out
    assert out["training_goes_on"] == 8.0 and out["handle_3"] == "local"
    # The shared tier refused the migration of step 4: reported, naming the cause, then retried.
    assert "migration failed" in out["migration_error"] and "Permission denied" in out["migration_error"], out
    assert out["local"] == [1, 3, 4] and out["shared"] == [1, 3, 4], out  # step 2 never became visible
    assert all(out["restored"].values()), out
    assert "retried in" in out["log"], out["log"]


def test_a_fast_tier_that_refuses_the_save_falls_back_to_the_next_when_configured(tmp_path):
    out = run_worker("next_tier", tmp_path)
    assert "error_2" not in out and out["tier_2"] == "shared", out
    assert "cannot take step 2" in out["log"] and "Permission denied" in out["log"], out["log"]
    assert out["handle_3"] == "local" and "takes saves again (from step 3)" in out["log"], out["log"]
    assert out["local"] == [1, 3, 4] and out["shared"] == [1, 2, 3, 4], out
    assert all(out["restored"].values()), out


def state(step: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib * 1024 * 256, generator=g), "step": step}  # incompressible with codec none


def config(small_fs: Path, tmp_path: Path, mode: str) -> dict:
    return {"chunk_size": "1MiB", "migration": "external", "on_fast_tier_error": mode,
            "budgets": {"host_buffer": "8MiB", "gpu_buffer": "8MiB", "pack_buffer": "4MiB"}, "tiers": [
                {"name": "local", "kind": "local", "path": str(small_fs / "nvme"), "codec": "none"},
                {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "none"}]}


def test_disk_full_fails_that_save_and_the_next_one_works(small_fs, tmp_path):
    with tiered.Engine.from_config(config(small_fs, tmp_path, "fail")) as engine:
        engine.save(1, state(1, 4)).wait()
        with pytest.raises(tiered.BackgroundSaveError, match=r"save\(step=2\) failed: .*rank_00000.data: write .* No space left on device"):
            engine.save(2, state(2, 32)).wait()  # 32 MiB onto a 24 MiB filesystem
        assert engine.steps() == [1]
        assert not (small_fs / "nvme" / "step_000000000002").exists()  # its partial files were removed
        engine.save(3, state(3, 4)).wait()
        assert engine.steps() == [1, 3]
        for s in (1, 3):
            assert torch.equal(engine.load(s)["w"], state(s, 4)["w"])


def test_disk_full_sends_the_save_to_the_next_tier_when_configured(small_fs, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tiered")
    with tiered.Engine.from_config(config(small_fs, tmp_path, "next_tier")) as engine:
        assert engine.save(1, state(1, 4)).tier == "local"
        big = engine.save(2, state(2, 32))
        big.wait()
        assert big.tier == "shared" and engine.steps("shared") == [2] and engine.steps("local") == [1]
        assert "free, and the step may need up to" in caplog.text, caplog.text
        assert torch.equal(engine.load(2)["w"], state(2, 32)["w"])
        assert engine.save(3, state(3, 4)).tier == "local"
        engine.wait()
        assert engine.steps() == [1, 2, 3]


def test_a_fast_tier_gone_sends_gpu_and_cpu_saves_to_the_next_tier(tmp_path, device, caplog):
    """The fast tier's directory is replaced by a file (a mount gone wrong: no step directory can
    be made, whoever runs it). With next_tier, GPU tensors go to the shared tier through host
    memory in zstd; when the directory is back, saves return to it."""
    caplog.set_level(logging.INFO, logger="tiered")
    nvme = tmp_path / "nvme"
    cfg = {"chunk_size": "256KiB", "migration": "external", "on_fast_tier_error": "next_tier", "tiers": [
        {"name": "local", "kind": "local", "path": str(nvme), "codec": "ans" if device == "cuda" else "zstd"},
        {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared")}]}

    def st(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(1 << 20, generator=g).to(device), "n": torch.arange(10), "step": step}

    with tiered.Engine.from_config(cfg) as engine:
        assert engine.save(1, st(1)).tier == "local"
        engine.wait()
        nvme.rename(tmp_path / "nvme.away")
        nvme.write_bytes(b"not a directory")
        h = engine.save(2, st(2))
        h.wait()
        assert h.tier == "shared" and engine.steps("shared") == [2]
        _, index = engine.read_index(2, tier="shared")
        assert {t.codec.name for t in index.tensors if t.chunks} == {"zstd"}
        got = engine.load(2)
        assert torch.equal(got["w"].cpu(), st(2)["w"].cpu()) and got["w"].device.type == device
        (tmp_path / "shared").rename(tmp_path / "shared.away")
        (tmp_path / "shared").write_bytes(b"not a directory either")
        failed = engine.save(9, st(9))  # both tiers refuse it: a failed save, training goes on
        with pytest.raises(tiered.BackgroundSaveError, match=r"step 9: the fast tier 'local' cannot take it \(.*\), "
                                                             r"and neither can tier 'shared' \("):
            failed.wait()
        (tmp_path / "shared").unlink()
        (tmp_path / "shared.away").rename(tmp_path / "shared")
        nvme.unlink()
        (tmp_path / "nvme.away").rename(nvme)
        assert engine.save(3, st(3)).tier == "local"
        engine.wait()
        assert engine.steps("local") == [1, 3] and engine.steps() == [1, 2, 3]
    assert "cannot take step 2" in caplog.text and "takes saves again (from step 3)" in caplog.text, caplog.text


def test_a_save_that_stands_still_logs_where_the_engines_threads_stand(tmp_path, monkeypatch, caplog):
    """A disk that stops answering (here: the data file's writes wait) leaves a save in flight
    with no progress: after STUCK_S the log names the step and every engine thread's stack, the
    writer's in the write among them, once; the save completes when the disk answers again."""
    import threading

    from tiered.observe import watch
    from tiered.tiers.local import LocalDataWriter

    monkeypatch.setattr(watch, "WATCH_S", 0.05)
    monkeypatch.setattr(watch, "STUCK_S", 0.3)
    answer = threading.Event()

    def stuck(write):
        def stuck(self, *args, **kwargs):
            answer.wait(30)
            return write(self, *args, **kwargs)
        return stuck

    for name in ("write_host", "write_host_async"):
        monkeypatch.setattr(LocalDataWriter, name, stuck(getattr(LocalDataWriter, name)))
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "local"), "codec": "zstd"}]}
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    with caplog.at_level(logging.WARNING, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        handle = engine.save(7, state)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("no progress" in r.getMessage() for r in caplog.records):
            time.sleep(0.05)
        time.sleep(0.5)  # (several more looks: still once)
        answer.set()
        handle.wait(60)
        engine.restore(out := {"w": torch.zeros_like(state["w"])}, step=7)
    said = [r.getMessage() for r in caplog.records if "no progress" in r.getMessage()]
    assert len(said) == 1, said
    assert "step 7" in said[0] and "tiered-writer" in said[0] and "in stuck" in said[0], said[0]
    assert torch.equal(out["w"], state["w"])


def test_eio_on_a_real_disk_is_damage_read_around_and_reported(failing_disk, tmp_path, capsys):
    """The fast tier's disk fails its reads (EIO, a real filesystem over a device that has lost
    its blocks): the restore reads the shared tier's copy bit-exact and `tiered verify` names the
    error."""
    import yaml

    from tiered.cli import main

    cfg = {"chunk_size": "1MiB", "migration": "external", "tiers": [
        {"name": "local", "kind": "local", "path": str(failing_disk.mount / "nvme"), "codec": "none"},
        {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd"}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    want = state(1, 16)
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, want).wait()
    assert main(["migrate", "--config", str(path), "-q"]) == 0
    failing_disk.fail_reads()
    capsys.readouterr()
    assert main(["verify", "--config", str(path), "--tier", "local", "-q"]) == 1
    assert "Input/output error" in capsys.readouterr().out
    with tiered.Engine.from_config(cfg) as engine:
        got = engine.load(1)
    assert torch.equal(got["w"], want["w"])


@pytest.mark.parametrize("direct_io", ["auto", "on"])
def test_a_real_filesystem_that_refuses_o_direct(ramfs, direct_io):
    """ramfs refuses O_DIRECT at open (EINVAL): `auto` writes and reads buffered, saying so in
    the index; `on` fails the save with an error naming the setting."""
    cfg = {"migration": "external", "tiers": [{"name": "local", "kind": "local", "path": str(ramfs / "nvme"),
                                               "direct_io": direct_io}]}
    w = torch.randn(600_000)
    with tiered.Engine.from_config(cfg) as engine:
        handle = engine.save(1, {"w": w})
        if direct_io == "on":
            with pytest.raises(tiered.BackgroundSaveError, match="cannot open with O_DIRECT.*direct_io: auto or off"):
                handle.wait()
            engine.wait()
            assert engine.steps() == []
        else:
            handle.wait()
            _, index = engine.read_index(1)
            assert index.io == "posix-buffered"
            assert torch.equal(engine.load(1)["w"], w)
