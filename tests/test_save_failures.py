"""A failed save never stops training by itself (``on_save_failure: warn``, the default): the step
is not committed, its partial files are removed, the failure is logged and recorded, retention
runs and the next save proceeds; only `max_failed_saves` failures in a row, or a failure with no
commit for `max_time_without_commit`, stop the run. ``raise`` keeps the next call raising. On a
real (small) filesystem that fills up."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import tiered
from tiered.cli import main
from tiered.errors import BackgroundSaveError, SaveFailuresExceeded
from tiered.save.failures import SaveFailures


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 20, generator=g), "step": step}  # 4 MiB, stored as is


def config(root: Path, **extra) -> dict:
    return {"chunk_size": "1MiB", "budgets": {"host_buffer": "8MiB"}, **extra,
            "tiers": [{"name": "local", "kind": "local", "path": str(root / "nvme"), "codec": "none", "keep_last": 1}]}


def fill(fs: Path, leave: int) -> Path:
    """A ballast file that leaves `leave` bytes free on `fs`."""
    ballast = fs / "ballast"
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return ballast


def test_a_full_disk_does_not_stop_training_until_saves_keep_failing(small_fs, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tiered")
    with tiered.Engine.from_config(config(small_fs)) as engine:
        engine.save(1, state(1)).wait()
        engine.save(2, state(2)).wait()
        assert engine.steps() == [2]  # keep_last 1
        ballast = fill(small_fs, 1 << 20)
        failed = []
        for step in (3, 4, 5):
            h = engine.save(step, state(step))  # never raises: training goes on
            with pytest.raises(BackgroundSaveError, match="No space left on device"):
                h.wait()  # the save's own handle says it failed
            failed.append(step)
            assert not (small_fs / "nvme" / f"step_{step:012d}").exists()  # partial files removed
            assert engine.steps() == [2]  # the committed step within the rule is kept
        assert "1 failed in a row, 2 more stop it" in caplog.text
        assert "The step is not committed and its partial files are removed" in caplog.text
        with pytest.raises(SaveFailuresExceeded, match=r"3 saves in a row failed \(max_failed_saves: 3\)"):
            engine.save(6, state(6))
        records = [r for r in engine.stats() if r["kind"] == "save_failed"]
        assert [r["step"] for r in records] == failed and "No space left" in records[0]["error"]
        ballast.unlink()
        engine.save(7, state(7)).wait()  # the fault gone, saves commit again
        assert engine.steps() == [7]
        assert torch.equal(engine.load(7)["w"], state(7)["w"])


def test_tiered_stats_counts_the_failed_saves(small_fs, tmp_path, capsys):
    import yaml
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(config(small_fs)))
    with tiered.Engine.from_config(str(path)) as engine:
        engine.save(1, state(1)).wait()
        ballast = fill(small_fs, 1 << 20)
        h = engine.save(2, state(2))
        with pytest.raises(BackgroundSaveError):
            h.wait()
        ballast.unlink()
    assert main(["stats", "-q", "-c", str(path)]) == 0
    out = capsys.readouterr().out
    assert "failed saves: 1 (not committed); the last, step 2" in out and "No space left" in out
    prom = tmp_path / "t.prom"
    assert main(["stats", "-q", "-c", str(path), "--prometheus", str(prom)]) == 0
    assert "tiered_save_failures_total 1\n" in prom.read_text()


def test_on_save_failure_raise_keeps_the_next_call_raising(small_fs):
    with tiered.Engine.from_config(config(small_fs, on_save_failure="raise")) as engine:
        engine.save(1, state(1)).wait()
        ballast = fill(small_fs, 1 << 20)
        engine.save(2, state(2))  # fails in the background
        with pytest.raises(BackgroundSaveError, match=r"save\(step=2\) failed: .*No space left on device"):
            engine.wait()
        ballast.unlink()
        engine.save(3, state(3)).wait()
        assert engine.steps() == [3]


def test_no_commit_for_too_long_stops_the_run_at_the_next_failure(small_fs):
    cfg = config(small_fs, max_failed_saves=100, max_time_without_commit="0.001s")
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state(1)).wait()
        ballast = fill(small_fs, 1 << 20)
        h = engine.save(2, state(2))
        with pytest.raises(BackgroundSaveError):
            h.wait()
        with pytest.raises(SaveFailuresExceeded, match=r"no save has committed for .* \(max_time_without_commit"):
            engine.wait()
        ballast.unlink()


def test_a_tier_that_refuses_the_step_outright_is_a_failed_save_too(tmp_path):
    """The fast tier's directory is a file (a mount gone): save() returns a failed handle."""
    (tmp_path / "nvme").write_bytes(b"not a directory")
    with tiered.Engine.from_config(config(tmp_path, migration="external")) as engine:
        h = engine.save(1, state(1))
        with pytest.raises(BackgroundSaveError, match=r"save\(step=1\) failed"):
            h.wait()
        with pytest.raises(BackgroundSaveError):
            h.staged.result()
    with tiered.Engine.from_config(config(tmp_path, on_save_failure="raise")) as engine:
        with pytest.raises((tiered.TieredError, OSError)):
            engine.save(1, state(1))  # raise: the call itself fails, as before


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("case", [
    # (events, expected: does the next call raise after the last event, and what)
    dict(policy="warn", max_failed=3, bound=None, events=["fail", "fail"], raises=None),
    dict(policy="warn", max_failed=3, bound=None, events=["fail", "fail", "fail"], raises="3 saves in a row"),
    dict(policy="warn", max_failed=3, bound=None, events=["fail", "fail", "commit", "fail", "fail"], raises=None),
    dict(policy="warn", max_failed=1, bound=None, events=["fail"], raises="1 saves in a row"),
    dict(policy="warn", max_failed=9, bound=60.0, events=["commit", "wait 30", "fail"], raises=None),
    dict(policy="warn", max_failed=9, bound=60.0, events=["commit", "wait 61", "fail"], raises="no save has committed"),
    dict(policy="raise", max_failed=3, bound=None, events=["fail"], raises="background work of save"),
])
def test_save_failures_policy(case):
    cfg = type("C", (), {"on_save_failure": case["policy"], "max_failed_saves": case["max_failed"],
                         "max_time_without_commit": case["bound"]})()
    clock = FakeClock()
    failures = SaveFailures(cfg, clock)
    for i, event in enumerate(case["events"]):
        if event == "fail":
            failures.record(BackgroundSaveError(i, OSError("boom")))
        elif event == "commit":
            failures.committed()
        else:
            clock.now += float(event.split()[1])
    got = failures.take()
    if case["raises"] is None:
        assert got is None
    else:
        assert got is not None and case["raises"] in str(got)
        assert failures.take() is None  # raised once
