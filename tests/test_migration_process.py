"""`migration: process`, the default: the engine's migrator in a supervised child process."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tiered
from tiered.errors import TieredError


def _config(tmp_path: Path, **extra) -> dict:
    return {**extra, "chunk_size": "64KiB", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "local"), "codec": "zstd"},
        {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd"}]}


def _state(seed: int, mb: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mb << 18, generator=g), "step": seed}


def _lock_free(tmp_path: Path) -> bool:
    fd = os.open(tmp_path / "local" / ".tiered-migrate.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_the_default_engine_migrates_through_a_child_process(tmp_path):
    with tiered.Engine.from_config(_config(tmp_path)) as engine:
        assert engine.config.migration == "process"
        engine.save(1, _state(1)).wait()
        engine.wait_migrated(120)
        child = engine._migrator.pid
        assert child != os.getpid()
        assert (tmp_path / "local" / ".tiered-migrate.lock").read_text().strip() == str(child), \
            "the child holds the fast tier's migration lock"
        got = engine.load(1, tier="shared")
        hops = [r for r in engine.stats() if r["kind"] == "migrate"]
        assert [(r["step"], r["src"], r["dst"]) for r in hops] == [(1, "local", "shared")]
        assert hops[0]["source"].endswith(f"-{child}.jsonl"), "the child records its migrations in a file of its own"
    assert torch.equal(got["w"], _state(1)["w"]) and got["step"] == 1
    assert _lock_free(tmp_path), "the child exited with the engine"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads listed in /proc (Linux)")
def test_the_child_and_all_its_threads_run_niced(tmp_path):
    """Training owns the machine: every thread of the child runs at nice +10 (on Linux a
    thread's own: the threads its imports start too, not only the main thread and its later
    ones), while the training process keeps its own priority."""
    ours = os.getpriority(os.PRIO_PROCESS, 0)  # (an earlier test may have run `tiered migrate` in this process)
    with tiered.Engine.from_config(_config(tmp_path)) as engine:
        engine.save(1, _state(1)).wait()
        engine.wait_migrated(120)
        child = engine._migrator.pid
        tids = [int(t) for t in os.listdir(f"/proc/{child}/task")]
        assert len(tids) > 2, "the child's migrator and pool threads"
        assert {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in tids} == {tid: 10 for tid in tids}
        assert os.getpriority(os.PRIO_PROCESS, 0) == ours


def test_close_lets_the_child_finish_the_queue(tmp_path):
    with tiered.Engine.from_config(_config(tmp_path)) as engine:
        for step in (1, 2, 3):
            engine.save(step, _state(step)).wait()
    # closed without wait_migrated(): the child finished what was queued before it exited
    engine = tiered.Engine.from_config(_config(tmp_path, migration="external"))
    assert engine.steps("shared") == [1, 2, 3]
    engine.close()


def test_a_killed_child_is_restarted_and_resumes_leaving_nothing_partial(tmp_path):
    with tiered.Engine.from_config(_config(tmp_path)) as engine:
        engine.wait_migrated(120)  # the child is up
        first = engine._migrator.pid
        engine.save(1, _state(1, mb=96)).wait()
        shared = tmp_path / "shared"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(shared.glob("*")):
            time.sleep(0.005)
        os.kill(first, signal.SIGKILL)  # mid-copy, or just before it
        with pytest.raises(TieredError, match="exited with status"):
            engine.wait_migrated(120)
        engine.wait_migrated(120)  # the new child resumed step 1
        assert engine._migrator.pid != first
        got = engine.load(1, tier="shared")
    assert torch.equal(got["w"], _state(1, mb=96)["w"])


def test_killing_the_training_process_leaves_the_queued_steps_migrating(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import tiered
        from test_migration_process import _config, _state
        from pathlib import Path
        engine = tiered.Engine.from_config(_config(Path({str(tmp_path)!r})))
        for step in (1, 2):
            engine.save(step, _state(step, mb=32)).wait()
        print(engine._migrator.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # right after the commits: nothing is migrated yet, or little
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    child = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 120
    engine = tiered.Engine.from_config(_config(tmp_path, migration="external"))
    try:
        while time.monotonic() < deadline and engine.steps("shared") != [1, 2]:
            time.sleep(0.1)
        assert engine.steps("shared") == [1, 2], "the orphaned child migrated what was queued"
        for step in (1, 2):
            assert torch.equal(engine.load(step, tier="shared")["w"], _state(step, mb=32)["w"])
    finally:
        engine.close()
    while time.monotonic() < deadline and not _lock_free(tmp_path):
        time.sleep(0.1)
    assert _lock_free(tmp_path), f"the child (pid {child}) exited once its queue was done"


@pytest.mark.gpu
def test_the_child_recompresses_a_gpu_checkpoint_stored_with_ans(tmp_path):
    """ANS is decoded on the GPU: the child makes its own CUDA context for it."""
    cfg = _config(tmp_path)
    cfg["tiers"][0]["codec"] = "ans"
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(8 << 20, generator=g).cuda(), "m": torch.randn(1 << 20, generator=g).cuda()}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        engine.wait_migrated(300)
        assert {t.codec.name for t in engine.read_index(1, tier="local")[1].tensors} == {"ans"}
        assert {t.codec.name for t in engine.read_index(1, tier="shared")[1].tensors} == {"zstd"}
        got = engine.load(1, tier="shared")
    assert all(torch.equal(got[k].cpu(), state[k].cpu()) for k in state)
