"""Engine round trips, several steps, interrupted saves, corruption, background failures."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same, clone_state, mixed_state, trained_model, zeros_like_state

import tiered
from tiered.format.manifest import RankIndex


def test_mixed_state_round_trip_in_place(tier_config, device):
    state = mixed_state(device)
    target = zeros_like_state(state)
    keep = target["weights"]["fp32"]
    with tiered.Engine.from_config(tier_config()) as engine:
        handle = engine.save(5, state)
        manifest = handle.wait()
        assert handle.staged.done() and manifest.step == 5
        assert engine.restore(target) == 5
    assert_same(state, target)
    assert target["weights"]["fp32"] is keep, "tensors present in the target are filled in place"


def test_restore_into_non_contiguous_target(tier_config, device):
    src = torch.randn(300, 5000, device=device)
    target = torch.zeros(5000, 300, device=device).t()  # same shape, transposed layout
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, {"w": src}).wait()
        sd = {"w": target}
        engine.restore(sd)
    assert sd["w"] is target and not target.is_contiguous()
    assert torch.equal(target, src)


def test_load_returns_fresh_copy_on_saved_device(tier_config, device):
    state = mixed_state(device, seed=3)
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, state).wait()
        loaded = engine.load()
        on_cpu = engine.load(1, device="cpu")
    assert_same(state, loaded)
    assert loaded["weights"]["fp32"].device.type == device
    assert on_cpu["weights"]["fp32"].device.type == "cpu"


def test_optimizer_state_after_training_round_trips(tier_config, device):
    model, opt = trained_model(device, steps=4)
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(4, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
        model2, opt2 = trained_model(device, steps=0, seed=1)  # fresh optimizer: no state yet
        sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        engine.restore(sd)
    opt2.load_state_dict(sd["optim"])
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    # Training continues identically from the restored state.
    x = torch.randn(8, 256, device=device, generator=torch.Generator(device).manual_seed(9))
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_several_saves_restore_latest_and_older(tier_config, device):
    with tiered.Engine.from_config(tier_config()) as engine:
        states = {}
        for step in (10, 20, 30):
            states[step] = {"w": torch.full((300, 300), float(step), device=device) + torch.randn(300, 300, device=device),
                            "step": step}
            engine.save(step, states[step])
        engine.wait()
        assert engine.steps() == [10, 20, 30] and engine.latest_step() == 30
        for step in (None, 20, 10):
            target = {"w": torch.zeros(300, 300, device=device), "step": -1}
            got = engine.restore(target, step=step)
            assert got == (step or 30)
            assert_same(states[got], target)


def test_saving_a_committed_step_again_is_refused(tier_config):
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, {"a": torch.ones(3)}).wait()
        with pytest.raises(tiered.TieredError, match="already committed"):
            engine.save(1, {"a": torch.zeros(3)})
        assert torch.equal(engine.load(1)["a"], torch.ones(3))


def test_a_save_says_where_its_call_went(tier_config):
    """A handle's timings split the planning (`plan_ms`) into the walk of the state and the tier's
    step being made: the bench's phases tell a slow disk from a slow walk."""
    with tiered.Engine.from_config(tier_config()) as engine:
        h = engine.save(1, {"a": torch.ones(3), "n": 2})
        h.wait()
    t = h.timings
    assert {"plan_ms", "flatten_ms", "begin_ms", "cpu_snapshot_ms"} <= set(t), t
    assert 0 < t["flatten_ms"] and 0 < t["begin_ms"] and t["flatten_ms"] + t["begin_ms"] <= t["plan_ms"]


def test_restore_without_checkpoint_and_unknown_step(tier_config):
    with tiered.Engine.from_config(tier_config()) as engine:
        with pytest.raises(tiered.CheckpointNotFoundError, match="no committed checkpoint"):
            engine.restore({"a": torch.zeros(1)})
        engine.save(3, {"a": torch.ones(1)}).wait()
        with pytest.raises(tiered.CheckpointNotFoundError, match=r"step 4 .*committed steps: 3"):
            engine.restore({"a": torch.zeros(1)}, step=4)


def test_restore_mismatch_and_strict(tier_config):
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, {"a": torch.ones(3, 4), "b": torch.ones(2)}).wait()
        with pytest.raises(tiered.StateDictError, match=r"a: step 1 stores float32\[3, 4\].*float32\[4, 3\]"):
            engine.restore({"a": torch.zeros(4, 3), "b": torch.zeros(2)})
        with pytest.raises(tiered.StateDictError, match="no entry for extra"):
            engine.restore({"a": torch.zeros(3, 4), "b": torch.zeros(2), "extra": torch.zeros(1)})
        target = {"a": torch.zeros(3, 4), "b": torch.zeros(2), "extra": torch.zeros(1)}
        engine.restore(target, strict=False)
        assert torch.equal(target["a"], torch.ones(3, 4)) and torch.equal(target["extra"], torch.zeros(1))


def test_unsupported_objects_are_refused_without_pickling(tier_config):
    class Thing:
        pass

    with tiered.Engine.from_config(tier_config()) as engine:
        with pytest.raises(tiered.StateDictError, match=r"opt\.sched: cannot checkpoint an object of type .*Thing"):
            engine.save(1, {"opt": {"sched": Thing()}})
        assert engine.steps() == []


def _committed_then_killed(tmp_path: Path, when: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import os, signal, torch, tiered
        from tiered.tiers.local import LocalTier, LocalDataWriter
        cfg = {{"tiers": [{{"name": "local", "kind": "local", "path": {str(tmp_path / "local")!r}}}]}}
        engine = tiered.Engine.from_config(cfg)
        engine.save(1, {{"w": torch.arange(300000, dtype=torch.float32)}}).wait()
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        if {when!r} == "before-commit":
            LocalTier.commit = die
        else:
            LocalDataWriter.close = die
        engine.save(2, {{"w": torch.zeros(300000)}})
        engine.wait()
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.mark.parametrize("when", ["before-commit", "during-data-write"])
def test_save_killed_before_commit_is_invisible(tmp_path, tier_config, when):
    proc = _committed_then_killed(tmp_path, when)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    local = tmp_path / "local"
    assert list(local.glob(".step_000000000002__*.writing")), "the killed save had started writing"
    assert not (local / "step_000000000002").exists()
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.reclaimed.wait()  # the engine removes a stopped writer's debris on its fast tier at start-up
        assert not list(local.glob(".step_*"))
        assert engine.steps() == [1] and engine.latest_step() == 1
        target = {"w": torch.zeros(300000)}
        assert engine.restore(target) == 1
        assert torch.equal(target["w"], torch.arange(300000, dtype=torch.float32))
        with pytest.raises(tiered.CheckpointNotFoundError):
            engine.restore(target, step=2)
        # The debris is replaced by a clean save of the same step.
        engine.save(2, {"w": torch.ones(300000)}).wait()
        assert engine.steps() == [1, 2]


def _chunk_of(root: Path, step: int, name: str, j: int):
    d = root / f"step_{step:012d}"
    index = RankIndex.from_json((d / "rank_00000.index.json").read_bytes(), "x")
    rec = next(t for t in index.tensors if t.name == name)
    return d / "rank_00000.data", rec.chunks[j]


@pytest.mark.parametrize("codec", ["ans", "zstd", "none"])
def test_corrupted_chunk_names_file_tensor_and_chunk(tmp_path, tier_config, device, codec):
    if codec == "ans" and device == "cpu":
        pytest.skip("CPU tensors are stored with zstd")
    state = {"layer": {"w": torch.randn(600, 1000, device=device)}, "b": torch.randn(10, device=device)}
    with tiered.Engine.from_config(tier_config(codec)) as engine:
        engine.save(7, state).wait()
        path, chunk = _chunk_of(tmp_path / "local", 7, "layer.w", 2)
        with open(path, "r+b") as f:
            f.seek(chunk.offset + chunk.size // 2)
            byte = f.read(1)
            f.seek(chunk.offset + chunk.size // 2)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(tiered.CorruptionError) as err:
            engine.restore({"layer": {"w": torch.zeros(600, 1000, device=device)}, "b": torch.zeros(10, device=device)})
    msg = str(err.value)
    assert str(path) in msg and "'layer.w'" in msg and "chunk 2 of 3" in msg, msg


def test_truncated_data_file_is_reported(tmp_path, tier_config):
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, {"w": torch.randn(500, 1000)}).wait()
        path = tmp_path / "local" / "step_000000000001" / "rank_00000.data"
        os.truncate(path, path.stat().st_size - 4096)
        with pytest.raises(tiered.FormatError, match="truncated"):
            engine.restore({"w": torch.zeros(500, 1000)})


def test_corrupted_index_is_reported(tmp_path, tier_config):
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, {"w": torch.randn(10)}).wait()
        path = tmp_path / "local" / "step_000000000001" / "rank_00000.index.json"
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 1
        path.write_bytes(bytes(raw))
        with pytest.raises(tiered.FormatError, match="rank_00000.index.json: index does not match"):
            engine.restore({"w": torch.zeros(10)})


def test_background_failure_is_raised_on_next_save_then_recovers(tier_config, monkeypatch):
    """With `on_save_failure: raise`, the next call raises a background failure (the default,
    `warn`, lets training go on: tests/test_save_failures.py)."""
    from tiered.tiers import local

    real = local.LocalDataWriter.write_host
    calls = {"n": 0}

    def failing(self, offset, buf):
        calls["n"] += 1
        raise OSError(28, "No space left on device")

    with tiered.Engine.from_config({**tier_config(), "on_save_failure": "raise"}) as engine:
        monkeypatch.setattr(local.LocalDataWriter, "write_host", failing)
        handle = engine.save(1, {"w": torch.randn(1000)})
        with pytest.raises(tiered.BackgroundSaveError, match="No space left"):
            handle.wait()
        h2 = engine.save(2, {"w": torch.randn(1000)})  # step 1's failure was raised by its handle: not again
        assert h2.persisted.exception() is not None  # (the future itself: waits, reports nothing)
        with pytest.raises(tiered.BackgroundSaveError, match=r"save\(step=2\)"):
            engine.save(3, {"w": torch.randn(1000)})  # nobody took step 2's failure from its handle
        assert engine.steps() == []
        assert not engine.tier.step_dir(1).exists(), "a failed save's files are removed"
        assert not list(engine.tier.root.glob(".step_*")), "a failed save's files are removed"
        monkeypatch.setattr(local.LocalDataWriter, "write_host", real)
        engine.save(3, {"w": torch.ones(1000)}).wait()
        engine.wait()
        assert engine.steps() == [3]
    assert calls["n"] >= 1


def test_background_failure_is_raised_by_wait(tier_config, monkeypatch):
    from tiered.tiers import local

    def failing(self, step, data):
        raise OSError(5, "Input/output error")

    with tiered.Engine.from_config({**tier_config(), "on_save_failure": "raise"}) as engine:
        monkeypatch.setattr(local.LocalTier, "commit", failing)
        engine.save(1, {"w": torch.randn(10)})
        with pytest.raises(tiered.BackgroundSaveError, match="Input/output error"):
            engine.wait()
        engine.wait()  # raised once, not forever
    with tiered.Engine.from_config(tier_config()) as engine:  # warn: recorded, and wait() does not raise
        monkeypatch.setattr(local.LocalTier, "commit", failing)
        h = engine.save(2, {"w": torch.randn(10)})
        engine.wait()
        assert isinstance(h.persisted.exception(), tiered.BackgroundSaveError)
        assert [r["step"] for r in engine.stats() if r["kind"] == "save_failed"] == [1, 2]  # (one records dir)


@pytest.mark.parametrize("codec", ["zstd", "ans", "none"])
def test_small_budgets_work_in_waves(tier_config, device, codec, caplog):
    if codec == "ans" and device == "cpu":
        pytest.skip("CPU tensors are stored with zstd")
    # Budgets of a few chunks force many waves, spills and ring wrap-arounds in one save.
    cfg = tier_config(codec, gpu_buffer="5MiB", pack_buffer="4MiB", host_buffer="6MiB")
    state = {f"t{i}": torch.randn(700_000 + 1000 * i, device=device) for i in range(6)}
    with tiered.Engine.from_config(cfg) as engine:
        for step in range(3):
            engine.save(step, state)
        engine.wait()
        target = zeros_like_state(state)
        with caplog.at_level(logging.INFO, logger="tiered"):
            engine.restore(target, step=2)
    assert_same(state, target)
    if device == "cuda":  # a GPU restore logs where its time went, wave by wave of its budget
        waves = [int(m.group(1)) for r in caplog.records
                 if (m := re.search(r"cuda:\d+: read .+ in (\d+) waves of up to .+ of which waiting on the reads",
                                    r.getMessage()))]
        assert len(waves) == 1 and waves[0] > 1, [r.getMessage() for r in caplog.records]


@pytest.mark.gpu
@pytest.mark.parametrize("direct", [True, False], ids=["copied-from-the-rows", "packed-first"])
@pytest.mark.parametrize("mapped", [True, False], ids=["sizes-in-pinned-memory", "sizes-copied"])
def test_a_drain_keeps_every_step_whether_its_kernels_reach_pinned_memory_or_not(tier_config, monkeypatch, mapped,
                                                                                  direct):
    """A drained wave's rows either cross straight from the slab, batched (`DIRECT_COPIES`), or
    packed into staging buffers first; its sizes, offsets and checksums either stay in pinned
    memory, read and stored there by the kernels (`MAPPED_IO`), or cross on a stream of their
    own: every way, every step restores bit-exact, each chunk's checksum verified as it is read."""
    from tiered.gpu import batch_copy, drain

    monkeypatch.setattr(drain, "MAPPED_IO", mapped)
    monkeypatch.setattr(drain, "DIRECT_COPIES", direct)
    if direct:
        assert batch_copy.available(), batch_copy.why_not()
    used = []
    for way in ("_direct", "_packed"):
        real = getattr(drain.Drainer, way)
        monkeypatch.setattr(drain.Drainer, way, lambda self, *a, _real=real, _way=way: used.append(_way) or _real(self, *a))
    cfg = tier_config("ans", gpu_buffer="5MiB", pack_buffer="4MiB", host_buffer="6MiB")
    states = [{f"t{i}": torch.randn(700_000 + 1000 * i, device="cuda") for i in range(6)} for _ in range(3)]
    with tiered.Engine.from_config(cfg) as engine:
        for step, state in enumerate(states):
            engine.save(step, state)
        engine.wait()
        for step, state in enumerate(states):
            target = zeros_like_state(state)
            engine.restore(target, step=step)
            assert_same(state, target, f"step {step}")
    assert used and set(used) == {"_direct" if direct else "_packed"}, used


@pytest.mark.gpu
def test_a_wave_the_host_budget_cannot_hold_fails_its_save_and_names_the_budget(tier_config):
    """A GPU save whose wave drains through more pinned host memory than budgets.host_buffer
    holds fails with an error naming the budgets (before 4e400f3 its last run waited forever for
    pages its first run held); the step before it stays restorable and later saves that fit go on."""
    cfg = tier_config("ans", gpu_buffer="5MiB", pack_buffer="4MiB", host_buffer="1MiB")
    cfg["chunk_size"] = "256KiB"  # (budgets must hold 4 chunks: a 1 MiB host budget needs chunks this small)
    small = {"t": torch.randn(200_000, device="cuda")}  # (0.8 MB: fits the slab, nothing drains)
    big = {f"t{i}": torch.randn(700_000, device="cuda") for i in range(6)}  # (waves of ~4 MiB drain)
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, small).wait()
        with pytest.raises(tiered.BackgroundSaveError, match=r"budgets\.host_buffer holds .*budgets\.pack_buffer"):
            engine.save(2, big).wait(timeout=60)
        assert engine.latest_step() == 1
        engine.save(3, small).wait(timeout=60)  # (the engine goes on saving what fits)
        target = zeros_like_state(small)
        engine.restore(target, step=1)
    assert_same(small, target)


def test_reserve_makes_the_chunk_records_of_the_first_save(tier_config, monkeypatch):
    """A CPU save's records of its chunks (one object per chunk, kept from save to save) are made
    by `reserve()`, not in the first save's call."""
    from tiered.stage import cpu

    made = []
    real = cpu.chunk_refs
    monkeypatch.setattr(cpu, "chunk_refs", lambda plans: made.append(len(plans)) or real(plans))
    state = {f"t{i}": torch.randn(1000 + i) for i in range(50)}
    with tiered.Engine.from_config(tier_config("zstd")) as engine:
        engine.reserve(state)
        assert engine.wait_pinned(60) and made == [50]
        for step in (1, 2):
            engine.save(step, state).wait()
        assert made == [50], "the saves made the records again"
        target = zeros_like_state(state)
        engine.restore(target, step=2)
    assert_same(state, target)


def test_the_stager_plans_and_stages_with_the_collector_paused(tier_config, monkeypatch):
    """A guarded save's walk, plan and staging on the stager thread make thousands of objects
    that die young. With the collector on there (the call's own pause ended as it returned),
    they set off full passes on that thread, each holding the GIL beside training: two in 16
    saves of 7,920 CPU tensors on the CPU machine, 173-221 ms each; after, one in 16 saves, on the
    main thread, as in a loop that made the same state dicts without saving. They run paused."""
    import gc
    import threading

    from tiered.save.pipeline import SavePipeline

    seen: list[bool] = []
    returned = threading.Event()
    real = SavePipeline._stage

    def stage(self, job, strict=False):
        if threading.current_thread().name.startswith("tiered-stager"):
            assert returned.wait(60)  # (the save's call, and its pause, are over)
            seen.append(gc.isenabled())
        return real(self, job, strict)

    monkeypatch.setattr(SavePipeline, "_stage", stage)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    with tiered.Engine.from_config(tier_config("none")) as engine:
        engine.guard(optimizer)
        for step in (1, 2):
            handle = engine.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})
            returned.set()
            handle.wait()
            returned.clear()
    assert seen == [False, False]
    assert gc.isenabled()


def test_a_save_keeps_no_object_per_tensor_alive_for_the_collector(tier_config):
    """What a save keeps alive until its step is written, Python's collector moves to its oldest
    generation, and enough of it sets off a full pass that holds the GIL beside training (180-224
    ms every four or five saves at 24 GB on an H100). Saves of one structure (new
    dicts each time, as state_dict() makes) leave no tracked object per tensor alive after the
    call: not the skeleton, the chunk records, nor the encoded chunks."""
    import gc

    g = torch.Generator().manual_seed(1)
    params = [torch.randn(64, generator=g) for _ in range(700)]
    moments = [(torch.randn(64, generator=g), torch.randn(64, generator=g), torch.tensor(3.0)) for _ in params]

    def state() -> dict:
        return {"model": OrderedDict((f"layer{i}.weight", p) for i, p in enumerate(params)),
                "optim": {"state": {i: {"step": s, "exp_avg": a, "exp_avg_sq": b} for i, (a, b, s) in enumerate(moments)},
                          "param_groups": [{"lr": 0.001, "params": list(range(len(params)))}]}}

    with tiered.Engine.from_config(tier_config("zstd")) as engine:
        engine.save(0, state()).wait()
        for step in (1, 2):
            s = state()
            gc.collect()
            before = {id(o) for o in gc.get_objects()}
            handle = engine.save(step, s)
            del s
            gc.collect(1)  # (what a collection now would move on: tuples of untracked objects go untracked)
            kept = [type(o).__name__ for o in gc.get_objects() if id(o) not in before]
            handle.wait()
            assert len(kept) < 400, f"{len(kept)} new tracked objects for 2,800 tensors: " \
                f"{sorted(set(kept), key=kept.count)[-5:]}"


def test_cpu_state_is_snapshotted_before_save_returns(tier_config):
    w = torch.arange(2_000_000, dtype=torch.float32)
    with tiered.Engine.from_config(tier_config()) as engine:
        handle = engine.save(1, {"w": w})
        assert handle.staged.done()
        w.zero_()  # the state may change as soon as save() returns
        handle.wait()
        assert torch.equal(engine.load(1)["w"], torch.arange(2_000_000, dtype=torch.float32))


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_runs_of_small_cpu_tensors_are_stacked_and_restore_exactly(tier_config, codec):
    """Step counters and other small CPU tensors, alike in runs (stacked into one copy) and not
    (a different dtype, shape or size between them, one larger than the stacking bound, a view,
    a tensor that requires grad), each round trip bit-exact and are snapshotted at save()."""
    g = torch.Generator().manual_seed(5)
    state = {f"step{i}": torch.tensor(float(i)) for i in range(300)}
    state.update({"flag": torch.tensor(True), "ids": torch.arange(7, dtype=torch.int64),
                  "pair0": torch.randn(2, 3, generator=g), "pair1": torch.randn(2, 3, generator=g),
                  "tall": torch.randn(3, 2, generator=g), "half": torch.randn(2, 3, generator=g).half(),
                  "big": torch.randn(40_000, generator=g), "view": torch.randn(4, 4, generator=g).t(),
                  "grad": torch.randn(5, requires_grad=True, generator=g)})
    state.update({f"later{i}": torch.tensor(i, dtype=torch.int32) for i in range(50)})
    expected = {k: v.detach().clone() for k, v in state.items()}
    with tiered.Engine.from_config(tier_config(codec)) as engine:
        handle = engine.save(1, state)
        with torch.no_grad():
            for v in state.values():
                v.add_(1) if v.dtype != torch.bool else v.logical_not_()
        handle.wait()
        got = engine.load(1)
    assert list(got) == list(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.gpu
def test_gpu_state_may_change_after_save_returns(tier_config):
    w = torch.randn(64_000_000, device="cuda")
    expected = w.clone()
    with tiered.Engine.from_config(tier_config()) as engine:
        handle = engine.save(1, {"w": w})
        w.mul_(0).add_(1)  # enqueued after save() returned: must not reach the checkpoint
        handle.wait()
        assert torch.equal(engine.load(1)["w"], expected)


@pytest.mark.gpu
@pytest.mark.parametrize("budgets", [{}, {"pack_buffer": "4MiB", "gpu_buffer": "12MiB"}], ids=["default", "waves"])
def test_tensors_read_in_place_or_packed_are_saved_as_they_were_at_save(tier_config, budgets):
    """ANS reads contiguous tensors at 16-byte addresses in place (gpu_layout.Wave.sources): the
    state changed on the training stream right after save() returns must not reach the step,
    whether a tensor was read in place, packed (strided, a view 4 bytes in, a size that is not a
    multiple of 16 bytes), or split between waves (small budgets)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    base = torch.randn(3_000_000, device="cuda", generator=g)
    state = {"big": torch.randn(5_000_000, device="cuda", generator=g),
             "odd": torch.randn(1_000_003, device="cuda", generator=g),
             "strided": torch.randn(1500, 700, device="cuda", generator=g).t(),
             "view4": base[1:2_000_001], "view16": base[4:1_000_004],
             "half": torch.randn(3_000_000, device="cuda", generator=g).to(torch.bfloat16),
             "ints": torch.arange(700_000, device="cuda"), "tiny": torch.randn(3, device="cuda", generator=g)}
    expected = {k: v.clone() for k, v in state.items()}
    with tiered.Engine.from_config(tier_config(**budgets)) as engine:
        for step in (1, 2):
            handle = engine.save(step, state)
            with torch.no_grad():
                for v in list(state.values()) + [base]:
                    v.add_(1)  # enqueued after save() returned: must not reach the step
            handle.wait()
            got = engine.load(step, device="cuda")
            for k, want in expected.items():
                assert got[k].dtype == want.dtype and torch.equal(got[k], want), (step, k)
            expected = {k: v.clone() for k, v in state.items()}


def test_state_without_tensor_bytes(tier_config):
    state = {"step": 3, "empty": torch.empty(0), "sched": {"lr": [0.1, 0.01]}}
    with tiered.Engine.from_config(tier_config()) as engine:
        assert engine.save(1, state).wait().stored_bytes == 0
        target = {"step": 0, "empty": torch.empty(0), "sched": {"lr": [0.0, 0.0]}}
        engine.restore(target)
    assert_same(state, target)


def test_handle_reports_sizes(tier_config):
    with tiered.Engine.from_config(tier_config()) as engine:
        handle = engine.save(1, {"w": torch.zeros(1_000_000)})
        manifest = handle.wait()
    assert handle.raw_bytes == 4_000_000 == manifest.raw_bytes
    assert manifest.stored_bytes < 100_000 and manifest.saved_fraction > 0.97
    assert handle.stall_s > 0


def test_staging_failure_is_raised_once_by_save(tier_config, monkeypatch):
    from tiered.stage import cpu

    real = cpu.snapshot

    def broken(*args, **kwargs):
        raise MemoryError("host staging exhausted")

    with tiered.Engine.from_config(tier_config()) as engine:
        monkeypatch.setattr(cpu, "snapshot", broken)
        with pytest.raises(MemoryError, match="host staging"):
            engine.save(1, {"w": torch.ones(10)})
        monkeypatch.setattr(cpu, "snapshot", real)
        engine.save(2, {"w": torch.ones(10)}).wait()  # the failure is not raised a second time
        engine.wait()
        assert engine.steps() == [2]


def test_closed_engine_refuses_work(tier_config):
    engine = tiered.Engine.from_config(tier_config())
    engine.close()
    with pytest.raises(tiered.TieredError, match="closed"):
        engine.save(1, {"a": torch.zeros(1)})


def test_numpy_target_filled_in_place(tier_config):
    arr = np.arange(100, dtype=np.float64)
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, {"a": arr}).wait()
        target = {"a": np.zeros(100)}
        keep = target["a"]
        engine.restore(target)
    assert target["a"] is keep and np.array_equal(keep, arr)


def test_thousands_of_small_cpu_tensors_get_each_chunks_own_checksum(tmp_path):
    """An optimizer's `step` scalars and other tiny CPU tensors are encoded on the writer and
    their checksums summed together (`cpu.encode_segment`, `checksum.wsum64_each`): each chunk's
    recorded checksum is wsum64 of its stored bytes as the data file holds them, and the state
    comes back bit-exact."""
    from tiered.format.checksum import wsum64

    state = {"steps": {f"s{i}": torch.tensor(float(i)) for i in range(600)},
             "odd": {f"b{n}": torch.arange(n, dtype=torch.int8) for n in range(1, 12)},
             "half": torch.arange(3, dtype=torch.float16), "long": torch.tensor([1 << 40, -5])}
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path), "codec": "zstd"}], "migration": "external"}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        _, index = engine.read_index(1)
        data = next(tmp_path.rglob(index.data_file)).read_bytes()
        chunks = [c for t in index.tensors for c in t.chunks]
        assert len(chunks) == 600 + 11 + 2
        assert all(c.checksum == wsum64(data[c.offset:c.offset + c.size]) for c in chunks)
        back = zeros_like_state(state)
        engine.restore(back, step=1)
    assert_same(state, back)


@pytest.mark.gpu
def test_cpu_written_zstd_restores_on_gpu_and_gpu_written_on_cpu(tier_config):
    model, opt = trained_model("cuda", steps=3)
    gpu_state = {"model": model.state_dict(), "optim": opt.state_dict()}
    cpu_state = {"model": {k: v.cpu() for k, v in gpu_state["model"].items()}}
    with tiered.Engine.from_config(tier_config("zstd")) as engine:
        engine.save(1, cpu_state).wait()    # CPU tensors: zstandard on the CPU
        engine.save(2, gpu_state).wait()    # GPU tensors: nvCOMP Zstd on the GPU
        _, index1 = engine.read_index(1)
        _, index2 = engine.read_index(2)
        assert {t.codec.name for t in index1.tensors} == {"zstd"} and "kvikio" not in index1.io
        assert {t.codec.name for t in index2.tensors} == {"zstd"} and "kvikio" in index2.io
        on_gpu = {"model": {k: torch.zeros_like(v) for k, v in gpu_state["model"].items()}}
        engine.restore(on_gpu, step=1)                 # CPU-written -> decoded on the GPU
        assert_same(dict(gpu_state["model"]), on_gpu["model"])  # the target keeps its own dict type
        on_cpu = engine.load(2, device="cpu")          # GPU-written -> decoded on the CPU
    assert_same(OrderedDict((k, v.cpu()) for k, v in gpu_state["model"].items()), on_cpu["model"])


@pytest.mark.gpu
def test_ans_saves_space_on_trained_fp32_and_bf16(tier_config):
    model, opt = trained_model("cuda", steps=20)
    with tiered.Engine.from_config(tier_config("ans")) as engine:
        m32 = engine.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
        m16 = engine.save(2, {"model": {k: v.bfloat16() for k, v in model.state_dict().items()}}).wait()
        _, index = engine.read_index(1)
        gpu_fp32 = [t for t in index.tensors if t.dtype == "float32" and t.device.startswith("cuda") and t.chunks]
        assert gpu_fp32 and {(t.codec.name, t.codec.params.get("data_type")) for t in gpu_fp32} == {("ans", "<f4")}
        target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "optim": opt.state_dict()}
        engine.restore(target, step=1)
    assert_same(dict(model.state_dict()), target["model"])
    # Small model: ratios are lower than the 200M-parameter benchmark's, but must show typed ANS at work.
    assert m32.saved_fraction > 0.10, m32
    assert m16.saved_fraction > 0.25, m16


def test_script_ending_right_after_save_still_commits(tmp_path):
    script = textwrap.dedent(f"""
        import torch, tiered
        cfg = {{"tiers": [{{"name": "local", "kind": "local", "path": {str(tmp_path / "local")!r}}}]}}
        engine = tiered.Engine.from_config(cfg)
        engine.save(7, {{"w": torch.arange(3_000_000, dtype=torch.float32)}})
        # no wait(), no close(): the interpreter exits now
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "local")}]}
    with tiered.Engine.from_config(cfg) as engine:
        assert engine.steps() == [7]
        assert torch.equal(engine.load()["w"], torch.arange(3_000_000, dtype=torch.float32))


@pytest.mark.gpu
def test_an_engine_readies_the_gpus_its_process_holds_memory_on_and_guard_those_of_its_parameters(tmp_path):
    """A first save without `reserve` waited for its kernels to load (0.46-1.43 s on an H200): an
    engine made once the process holds GPU memory readies that GPU at once; one made before
    readies none (under torchrun it could be the wrong one) until `guard` names the parameters'."""
    script = textwrap.dedent(f"""
        import torch, tiered
        cfg = {{"tiers": [{{"name": "local", "kind": "local", "path": {str(tmp_path / "local")!r}}}]}}
        early = tiered.Engine.from_config(cfg)
        assert early.workers.devices() == [] and torch.cuda.memory_allocated(0) == 0, "no GPU readied yet"
        model = torch.nn.Linear(64, 64).cuda()
        early.guard(torch.optim.AdamW(model.parameters()))
        assert early.workers.devices() == [0] and early.workers.wait_warm(300), "guard() readied the GPU"
        early.close()
        late = tiered.Engine.from_config(cfg)
        assert late.workers.devices() == [0] and late.workers.wait_warm(300), "an engine made on a GPU readies it"
        late.save(1, model.state_dict()).wait()
        late.close()
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_VISIBLE_DEVICES": "0"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.parametrize("direct_io, expect", [("off", "posix-buffered"), ("auto", "posix-buffered")])
def test_filesystem_without_o_direct(tmp_path, monkeypatch, direct_io, expect):
    """auto falls back to buffered I/O where O_DIRECT is refused (tmpfs, some network FS); off never asks."""
    from tiered.tiers import local

    real_open = os.open
    asked = []

    def no_direct(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            asked.append(path)
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(local.os, "open", no_direct)
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path), "direct_io": direct_io}]}
    w = torch.randn(500_000)
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, {"w": w}).wait()
        _, index = engine.read_index(1)
        assert index.io == expect
        assert torch.equal(engine.load()["w"].view(torch.int32), w.view(torch.int32))
    assert bool(asked) == (direct_io == "auto" and hasattr(os, "O_DIRECT"))


def test_direct_io_on_refused_is_a_clear_error(tmp_path, monkeypatch):
    from tiered.tiers import local

    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    monkeypatch.setattr(local.os, "open", no_direct)
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path), "direct_io": "on"}]}
    with tiered.Engine.from_config(cfg) as engine:
        handle = engine.save(1, {"w": torch.randn(1000)})
        with pytest.raises(tiered.BackgroundSaveError, match="cannot open with O_DIRECT.*direct_io: auto or off"):
            handle.wait()
        engine.wait()  # the failure was reported once, by the handle


def test_small_chunks_and_many_chunks_per_tensor(tmp_path, device):
    # 64 KiB chunks: a 6 MB tensor is ~92 chunks, more than one CPU read window.
    cfg = {"chunk_size": "64KiB", "tiers": [{"name": "local", "kind": "local", "path": str(tmp_path)}]}
    state = {"w": torch.randn(1_500_000, device=device), "b": torch.randn(3, device=device)}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        _, index = engine.read_index(1)
        assert index.chunk_size == 65536 and len(next(t for t in index.tensors if t.name == "w").chunks) == 92
        target = zeros_like_state(state)
        engine.restore(target)
        on_cpu = engine.load(device="cpu")
    assert_same(state, target)
    assert_same({k: v.cpu() for k, v in state.items()}, on_cpu)


@pytest.mark.parametrize("budgets", [{}, dict(gpu_buffer="5MiB", pack_buffer="4MiB", host_buffer="6MiB")],
                         ids=["default-budgets", "small-budgets"])
def test_saves_of_one_structure_reuse_the_plan_and_keep_each_steps_values(tier_config, device, budgets):
    # The plan (and, on a GPU, the pack layout) is cached across saves of one structure; each step
    # must still hold its own values, and a changed structure must be planned anew.
    expected = {}
    with tiered.Engine.from_config(tier_config(**budgets)) as engine:
        for step in range(3):  # new tensors each time, as model.state_dict() gives
            expected[step] = mixed_state(device, seed=step)
            engine.save(step, expected[step])
        state = mixed_state(device, seed=3)
        engine.save(3, state)
        expected[3] = clone_state(state)
        for t in state["weights"].values():  # the same tensors, changed in place
            t.add_(1)
        engine.save(4, state)
        expected[4] = state
        other = {**mixed_state(device, seed=5), "extra": torch.ones(3, device=device)}
        other["weights"]["fp32"] = torch.randn(100, 7, device=device)  # a shape changes
        engine.save(5, other)
        expected[5] = other
        expected[6] = mixed_state(device, seed=6)  # and back to the first structure
        engine.save(6, expected[6])
        engine.wait()
        for step, want in expected.items():
            assert_same(want, engine.load(step), f"step {step}")


def test_engine_keeps_no_reference_to_a_saved_state(tier_config, device):
    import gc
    import weakref

    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(0, {"warm": torch.ones(10, device=device)}).wait()  # buffers allocated
        if device == "cpu":
            arr = np.ones(4_000_000, dtype=np.float32)
            alive = weakref.ref(arr)
            state = {"w": torch.from_numpy(arr)}
            del arr
        else:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            state = {"w": torch.ones(64_000_000, device=device)}
        engine.save(1, state).wait()
        del state
        gc.collect()
        if device == "cpu":
            assert alive() is None, "the engine still references the saved tensors"
        else:
            torch.cuda.synchronize()
            torch.empty(1, device=device)  # lets the allocator retire blocks freed behind stream events
            assert torch.cuda.memory_allocated() < base + 64_000_000, "the saved GPU tensor was not freed"


def test_a_step_the_format_cannot_list_is_refused_at_save(tier_config):
    """Steps are named with 12 digits: a larger one would be saved, then invisible to steps(),
    ls, load and gc. save() refuses it, naming the limit; the largest listable step works."""
    with tiered.Engine.from_config(tier_config("zstd")) as engine:
        for bad in (10**12, -1, 2**80):
            with pytest.raises(ValueError, match=r"step must be an integer from 0 to 999999999999"):
                engine.save(bad, {"w": torch.ones(4)})
        engine.save(10**12 - 1, {"w": torch.ones(4)}).wait()
        assert engine.steps() == [10**12 - 1]
        assert torch.equal(engine.load(10**12 - 1)["w"], torch.ones(4))
