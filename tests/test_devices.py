"""The engine's background threads work on the GPU of the thread that made the engine (tiered.threads).

A new thread's current CUDA device is GPU 0. Under torchrun on a node of several GPUs, a rank whose
engine thread made a CUDA call outside a device scope opened a context on GPU 0: about 0.5 GB of
another rank's nearly full GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import tiered
from tiered import threads


def test_start_runs_the_target_on_a_named_daemon_thread():
    seen: list = []
    t = threads.start(lambda a, b: seen.append((a, b, threading.current_thread().name)), 1, 2, name="tiered-x")
    t.join(5)
    assert t.daemon and seen == [(1, 2, "tiered-x")]


def test_pool_threads_run_the_initializer_first():
    marks: list = []
    with threads.pool(2, "tiered-y", lambda: marks.append(threading.current_thread().name)) as pool:
        ran = list(pool.map(lambda _: (threading.current_thread().name, threading.current_thread().name in marks),
                            range(8)))
    assert all(initialized for _, initialized in ran)  # every task's thread had run the initializer
    assert all(name.startswith("tiered-y") for name, _ in ran)


def test_threads_told_a_gpu_make_it_current_first(monkeypatch, tmp_path):
    """A process that has not used CUDA yet (the migrator process) names the GPU its threads run
    on: each makes it current before its first CUDA call (a thread's own is GPU 0). The
    migrator's thread and pool are made so. (On a 2-GPU machine, test_an_engine_on_gpu_1_...
    checks the contexts themselves.)"""
    from tiered.config import load_config
    from tiered.migrate import migrator
    from tiered.tiers.catalog import TierCatalog

    made: list = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: made.append((threading.current_thread().name, i)))
    threads.start(lambda: None, name="tiered-a", gpu=3).join(5)
    with threads.pool(1, "tiered-b", gpu=2) as p:
        p.submit(lambda: None).result()
    threads.start(lambda: None, name="tiered-c").join(5)  # (no CUDA in use here: none chosen)
    assert made == [("tiered-a", 3), ("tiered-b_0", 2)]
    made.clear()
    raw = {"migration": "external", "tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "l")},
                                              {"name": "shared", "kind": "posix", "path": str(tmp_path / "s")}]}
    with tiered.Engine.from_config(raw) as engine:
        engine.save(1, {"w": torch.arange(1 << 16, dtype=torch.float32)}).wait()
    cfg = load_config(raw)
    m = migrator.BackgroundMigrator(cfg, TierCatalog(cfg).get, lambda: None, gpu=1)
    m.submit(1)
    m.wait(timeout=60)
    m.stop()
    assert TierCatalog(cfg).get("shared").has_step(1)
    assert {name.rstrip("_0123456789") for name, _ in made} == {"tiered-migrate", "tiered-migrator"}
    assert {i for _, i in made} == {1}


def test_the_migrator_process_sees_the_engines_gpu_alone():
    """The child decodes on the engine's GPU and sees no other: a library that opens a context on
    GPU 0 whatever GPU it works on (nvCOMP 6.0 does) cannot take another rank's memory
    there. The engine's index is among the devices the engine sees, so an inherited
    CUDA_VISIBLE_DEVICES is indexed, never replaced by a physical ordinal."""
    from tiered.migrate.process import child_env

    base = {"PATH": "/bin"}
    assert child_env(base, None) == base
    assert child_env(base, 1) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1", "TIERED_MIGRATOR_GPU": "0"}
    assert child_env({**base, "CUDA_VISIBLE_DEVICES": "4, 6"}, 1)["CUDA_VISIBLE_DEVICES"] == "6"
    uuids = "GPU-3d9d0cda-7c36,GPU-6e0448a4-f0ec"
    assert child_env({"CUDA_VISIBLE_DEVICES": uuids}, 0) == {"CUDA_VISIBLE_DEVICES": "GPU-3d9d0cda-7c36",
                                                               "TIERED_MIGRATOR_GPU": "0"}
    assert child_env({"CUDA_VISIBLE_DEVICES": "2"}, 3) == {"CUDA_VISIBLE_DEVICES": "2", "TIERED_MIGRATOR_GPU": "3"}


def test_without_cuda_in_use_threads_choose_no_device():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("this process already uses CUDA")
    assert threads.current_gpu() is None


_ON_GPU_1 = textwrap.dedent("""
    import ctypes, json, logging, os, subprocess, sys, torch, tiered
    logging.basicConfig(level=logging.WARNING)
    torch.cuda.set_device(1)
    root, codec = sys.argv[1], sys.argv[2]
    libcuda = ctypes.CDLL("libcuda.so.1")
    phases = []

    def on_gpu_0():
        flags, active = ctypes.c_uint(), ctypes.c_int()
        libcuda.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active))
        return bool(active.value)

    def phase(name):  # whether this process holds GPU 0's primary context by now: where it came from
        phases.append([name, on_gpu_0()])

    # Which call of which thread opened GPU 0's primary context: every C function called from
    # Python, on every thread, is checked before and after. Each call that spanned the moment is
    # kept (the one that opened it, and any that waited meanwhile: a lock's acquire, a join).
    caught, before = [], {}
    def profile(frame, event, arg):
        if len(caught) >= 12 or event not in ("c_call", "c_return", "c_exception"):
            return
        me = threading.get_ident()
        if event == "c_call":
            before[me] = on_gpu_0()
        elif before.get(me) is False and on_gpu_0():
            before[me] = None
            caught.append(f"{threading.current_thread().name}: {arg!r}\\n" + "".join(traceback.format_stack(frame)[-10:]))
    import threading, traceback
    threading.setprofile(profile)
    sys.setprofile(profile)

    cfg = {"chunk_size": "1MiB", "tiers": [
        {"name": "local", "kind": "local", "path": root + "/local", "codec": codec},
        {"name": "shared", "kind": "posix", "path": root + "/shared", "codec": "zstd"}]}
    g = torch.Generator(device="cuda:1").manual_seed(0)
    state = {"w": torch.randn(16 << 20, device="cuda:1", generator=g), "n": torch.arange(10)}
    phase("state made")
    with tiered.Engine.from_config(cfg) as engine:  # migration: process, the default
        phase("engine made")
        engine.guard(torch.optim.SGD([torch.zeros(1, device="cuda:1", requires_grad=True)]))
        for step in (1, 2):
            engine.save(step, state).wait()
            phase(f"save {step}")
        engine.wait_migrated(timeout=300)  # ans -> zstd: decoded on a GPU by the migrator process (none: on no GPU)
        phase("migrated")
        out = {"w": torch.zeros_like(state["w"]), "n": torch.zeros(10, dtype=torch.long)}
        engine.restore(out, step=2)
        phase("restored")
        assert torch.equal(out["w"], state["w"]) and torch.equal(out["n"], state["n"])
        torch.cuda.synchronize(1)
        pids = {os.getpid()}
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids |= {int(p) for p in f.read().split()}
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout
    print(json.dumps({"engine": os.getpid(), "pids": sorted(pids), "apps": apps, "gpu1": "GPU-" + str(torch.cuda.get_device_properties(1).uuid),
                      "phases": phases, "caught": caught}))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi")
@pytest.mark.parametrize("codec", ["ans", "none"])
def test_an_engine_on_gpu_1_opens_no_context_on_gpu_0_but_nvcomps_which_it_reports(tmp_path, codec):
    """Saves (guarded and strict), migration through the child process (ANS decoded on the GPU),
    a restore. The migrator process holds a context on GPU 1 alone. The engine's own process holds
    one on GPU 0 only where nvCOMP opened it (nvCOMP 6.0 does, on its first call, whatever GPU it
    is told), and then the engine's log says so. With
    `none` (the copy engines, tiered.stage.host_copy: no nvCOMP call; the pages given back on the host
    writes' own threads) the engine's process holds none on GPU 0 at all."""
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _ON_GPU_1, str(tmp_path), codec], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    where = {}
    for line in got["apps"].splitlines():
        pid, uuid = (x.strip() for x in line.split(","))
        if pid.isdigit() and int(pid) in got["pids"]:
            where.setdefault(int(pid), set()).add(uuid)
    print("the calls that spanned GPU 0's context opening:", *got["caught"], sep="\n")
    if not where:
        pytest.skip(f"nvidia-smi lists no process of this container's ids: {got['apps']!r}")
    gpu1 = got["gpu1"]
    children = {pid: uuids for pid, uuids in where.items() if pid != got["engine"]}
    assert (children or codec == "none") and all(uuids == {gpu1} for uuids in children.values()), (where, gpu1)
    mine = where.get(got["engine"], set())
    if codec == "none":
        assert mine == {gpu1}, (mine, gpu1, "the engine's process held GPU 0's context after:", got["phases"],
                                "the calls that spanned its opening:", "\n".join(got["caught"]))
    said = "opened a CUDA context on GPU 0" in done.stderr
    assert gpu1 in mine and said == bool(mine - {gpu1}), (
        mine, gpu1, said, "the engine's process held GPU 0's context after:", got["phases"],
        "the calls that spanned its opening:", "\n".join(got["caught"]), done.stderr[-2000:])


def test_a_call_that_opens_gpu_0s_context_from_another_gpu_is_logged_once(monkeypatch, caplog):
    """nvCOMP 6.0 opens a context on GPU 0 on its first call, whatever GPU it works on: the engine's first bound is watched, and where GPU 0's primary context appeared
    during it, on a process working on another GPU, a warning names the remedy, once."""
    import logging

    from tiered.codecs import _nvcomp

    states = iter([False, True])
    monkeypatch.setattr(_nvcomp, "primary_context_active", lambda index: next(states))
    monkeypatch.setattr(_nvcomp, "_told", [])
    with caplog.at_level(logging.WARNING, logger="tiered"):
        assert _nvcomp.noting_gpu0(1, lambda: 42) == 42
        assert _nvcomp.noting_gpu0(1, lambda: 43) == 43  # (told once: not asked again)
    said = [r.getMessage() for r in caplog.records if "GPU 0" in r.getMessage()]
    assert len(said) == 1 and "cuda:1" in said[0] and "CUDA_VISIBLE_DEVICES" in said[0]

    caplog.clear()
    monkeypatch.setattr(_nvcomp, "_told", [])
    for index, seen in ((0, [False, True]), (1, [False, False]), (1, [True, True])):
        states = iter(seen)  # on GPU 0 itself; not opened by the call; open before it
        monkeypatch.setattr(_nvcomp, "primary_context_active", lambda i, s=states: next(s))
        _nvcomp.noting_gpu0(index, lambda: None)
    assert not [r for r in caplog.records if "GPU 0" in r.getMessage()]
