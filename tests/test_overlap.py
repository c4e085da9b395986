"""Saves overlapped with the next forward and backward (`Engine.guard`): what the optimizer step
waits for, what is cloned instead, and that the snapshot holds while training goes on."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from helpers import trained_model

import tiered
from tiered.stage import overlap


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _step(model, opt, device, n=1):
    for _ in range(n):
        loss = model(torch.randn(32, 256, device=device)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_guarded_optimizer_step_waits_for_the_snapshot(tier_config, device):
    """Training steps right after each save: every step restores to the state at its save()."""
    model, opt = trained_model(device, steps=2)
    extra = torch.nn.Linear(4096, 1024).to(device)  # a larger state: staging takes a while
    opt.add_param_group({"params": extra.parameters()})
    _step(model, opt, device)
    expected = {}
    with tiered.Engine.from_config(tier_config()) as engine:
        guard = engine.guard(opt)
        for step in range(1, 4):
            state = {"model": model.state_dict(), "extra": extra.state_dict(), "optim": opt.state_dict()}
            expected[step] = _copy(state)
            engine.save(step, state)
            if step % 2:
                _step(model, opt, device)  # changes the parameters in place at once: the hook orders it
            else:
                engine.order_updates()  # a change not made through optimizer.step() is ordered by hand
                with torch.no_grad():
                    for p in extra.parameters():
                        p.add_(1.0)
        engine.wait()
        guard.remove()
        for step, want in expected.items():
            assert _equal(engine.load(step, device=device), want), f"step {step}"
    assert not opt._optimizer_step_pre_hooks, "remove() unregisters the hook"


def test_unguarded_tensors_are_cloned_at_save(tier_config, device):
    """A buffer the optimizer does not own (an EMA copy, BatchNorm statistics) may change right
    after save() returns: the save holds its value at the call."""
    model, opt = trained_model(device, steps=1)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    big = torch.arange(4 << 20, dtype=torch.float32, device=device)
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.guard(opt)
        state = {"model": model.state_dict(), "ema": ema, "big": big, "optim": opt.state_dict()}
        want = _copy(state)
        engine.save(1, state)
        big.mul_(-1)  # at once, before any optimizer step
        for v in ema.values():
            v.zero_()
        engine.wait()
        assert _equal(engine.load(1, device=device), want)


def test_guard_keys_cover_parameters_state_and_views():
    model, opt = trained_model("cpu", steps=1)
    guarded = overlap.Guarded([opt])
    sd, osd = model.state_dict(), opt.state_dict()
    assert all(t in guarded for t in sd.values()), "state_dict tensors share the parameters' memory"
    assert all(v in guarded for st in osd["state"].values() for v in st.values()), "the optimizer's own tensors"
    w = next(iter(model.parameters()))
    assert w[0] in guarded, "a view from the first byte is the parameter's memory"
    assert w[1] not in guarded, "a view that starts elsewhere counts as unguarded (cloned: safe)"
    assert w.clone() not in guarded
    m = next(iter(opt.state.values()))["exp_avg"]
    assert m.view(-1) not in guarded, "`in` finds optimizer state by identity (cheap: asked of every tensor)"
    assert guarded.by_memory(m.view(-1)) and guarded.by_memory(m.detach()), "its memory, whatever the object"
    assert not guarded.by_memory(m.view(-1)[1:]) and not guarded.by_memory(m.clone())
    assert torch.zeros(3) not in guarded and not guarded.by_memory(torch.zeros(3))


def test_distributed_items_are_the_optimizers_own_tensors():
    """A distributed save hands the pipeline DCP's items: tensors that need no detaching are the
    very objects the optimizer holds, so a guarded save finds them by identity (a
    detached alias of every Adam moment made 2-rank saves strict, 614 ms a save at 24 GB)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from tiered.distributed.storage import StepWriter

    model, opt = trained_model("cpu", steps=1)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict={"model": model.state_dict(), "optim": opt.state_dict()}, is_coordinator=True)
    plan = planner.create_local_plan()
    items = [leaf.tensor for leaf in StepWriter.items(plan, lambda i, item: planner.resolve_data(item)).leaves]
    state_ids = {id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)}
    assert sum(id(t) in state_ids for t in items) == len(state_ids)
    guarded = overlap.Guarded([opt])
    assert all(t in guarded for t in items if t.dtype != torch.uint8), "parameters by memory, state by identity"


def test_without_guard_saves_are_strict_and_stager_never_starts(tier_config):
    model, opt = trained_model("cpu", steps=1)
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, _state(model, opt)).wait()
        assert not any(t.name == "tiered-stager" for t in threading.enumerate())


@pytest.mark.gpu
def test_too_much_unguarded_state_falls_back_to_strict(tier_config, monkeypatch, caplog):
    monkeypatch.setattr(overlap, "CLONE_LIMIT", 1 << 20)
    model, opt = trained_model("cuda", steps=1)
    loose = torch.randn(1 << 20, device="cuda")  # 4 MiB, not the optimizer's
    with tiered.Engine.from_config(tier_config()) as engine, caplog.at_level(logging.WARNING, "tiered"):
        engine.guard(opt, stage_after_ms=60_000)  # (a strict save does not wait for it)
        state = {"model": model.state_dict(), "loose": loose}
        want = _copy(state)
        t0 = time.perf_counter()
        handle = engine.save(1, state)
        loose.zero_()  # on the training stream: ordered after the strict save's reads
        engine.wait()
        assert time.perf_counter() - t0 < 30 and "stage_after_ms" not in handle.timings
        assert _equal(engine.load(1, device="cuda"), want)
    assert "staged strictly" in caplog.text and "not guarded by an optimizer" in caplog.text
    assert "before guard(stage_after_ms" not in caplog.text


@pytest.mark.gpu
def test_detached_aliases_of_optimizer_state_are_guarded_not_strict(tier_config, monkeypatch, caplog):
    """A wrapper that hands on detached aliases of the optimizer's moments (other objects, the
    same memory) still gets an overlapped save, exact, rather than a strict one."""
    monkeypatch.setattr(overlap, "CLONE_LIMIT", 1 << 10)
    model, opt = trained_model("cuda", steps=1)
    with tiered.Engine.from_config(tier_config()) as engine, caplog.at_level(logging.WARNING, "tiered"):
        engine.guard(opt)
        osd = opt.state_dict()
        state = {"model": model.state_dict(),
                 "optim": {k: {n: v.detach() for n, v in st.items()} for k, st in osd["state"].items()}}
        want = _copy(state)
        engine.save(1, state)
        _step(model, opt, "cuda")  # waits for the snapshot through the guard
        engine.wait()
        assert _equal(engine.load(1, device="cuda"), want)
    assert "staged strictly" not in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("defer_walk", [False, True])
@pytest.mark.parametrize("codec", ["ans", "none"])
def test_a_state_let_go_right_after_a_guarded_save_is_saved_as_it_was(tmp_path, codec, defer_walk):
    """save() returns before the GPU has read the state; the caller lets it go at once and new
    tensors on the training stream take the freed memory and overwrite it. The engine holds what
    it reads until read (it marks no tensor's memory for its own stream), so the step has the
    state as it was at save(). With `defer_walk`, step 2's tensors are new to the state: the
    stager clones them, and every read of the save waits for those clones (the
    copy-engine path's own stream did not)."""
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path), "codec": codec}]}
    g = torch.Generator(device="cuda").manual_seed(2)
    param = torch.zeros(16, device="cuda", requires_grad=True)
    with tiered.Engine.from_config(cfg) as engine:
        engine.guard(torch.optim.SGD([param], lr=0.1), defer_walk=defer_walk)
        for step in (1, 2):
            state = {f"x{i}": torch.randn(1 << 20, device="cuda", generator=g) for i in range(8)}
            want = {k: v.cpu() for k, v in state.items()}
            busy = torch.randn(4096, 4096, device="cuda")
            for _ in range(30):  # the training stream is busy: the save reads after this
                busy = torch.nn.functional.normalize(busy @ busy, dim=1)
            handle = engine.save(step, state)
            del state
            junk = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]
            handle.wait()
            got = engine.load(step, device="cpu")
            wrong = [k for k in want if not torch.equal(got[k], want[k])]
            assert not wrong, (step, wrong, [(got[k][:3].tolist(), want[k][:3].tolist()) for k in wrong[:2]])
            del junk


@pytest.mark.gpu
def test_saves_and_restores_are_exact_when_new_memory_is_filled_with_nan(tmp_path):
    """Under torch.use_deterministic_algorithms (Lightning's deterministic=True), new memory is
    filled with NaN by a kernel on the stream that allocates it. The engine's buffers, and a
    restore's, must be filled before the work that writes them, not beside it: on an H100 a
    restore came back NaN once Lightning's test had left the mode on."""
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path), "codec": "ans"}]}
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {f"x{i}": torch.randn(1 << 20, device="cuda", generator=g) for i in range(4)}
    want = {k: v.cpu() for k, v in state.items()}
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with tiered.Engine.from_config(cfg) as engine:
            param = torch.zeros(16, device="cuda", requires_grad=True)
            engine.guard(torch.optim.SGD([param], lr=0.1))  # (the first save allocates from the stager)
            for step in (1, 2):
                torch.cuda._sleep(50_000_000)  # the caller's stream is busy: fills queued on it run late
                engine.save(step, state).wait()
                torch.cuda._sleep(50_000_000)
                got = engine.load(step, device="cpu")
                assert all(torch.equal(got[k], want[k]) for k in want), (step, "load")
                target = {k: torch.zeros_like(v) for k, v in state.items()}
                torch.cuda._sleep(50_000_000)
                engine.restore(target, step=step)
                assert all(torch.equal(target[k].cpu(), want[k]) for k in want), (step, "restore")
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def test_guard_covers_dtensor_parameters_and_state_by_their_local_shards(tmp_path):
    """Under FSDP2 parameters and optimizer state are DTensors; a save reads their local shards,
    which are other objects than the DTensors the optimizer holds: guarded by their memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        opt = torch.optim.AdamW([p])
        p.sum().backward()
        opt.step()
        guarded = overlap.Guarded([opt])
        state = opt.state[p]
        assert p.to_local() in guarded and state["exp_avg"].to_local() in guarded
        assert state["exp_avg_sq"].to_local().clone() not in guarded
    finally:
        dist.destroy_process_group()


class _HeldWalk:
    """`tree.flatten` as the engine calls it, noting the thread of each call; a walk on another
    thread than the test's waits until `release()` (so the test can change the state first)."""

    def __init__(self, monkeypatch):
        from tiered.save import pipeline as save_module

        self.threads: list[str] = []
        self.go = threading.Event()
        real = save_module.tree.flatten

        def flatten(state, **kw):
            self.threads.append(threading.current_thread().name)
            if threading.current_thread() is not threading.main_thread():
                assert self.go.wait(30), "the test never let the stager's walk go"
            return real(state, **kw)

        monkeypatch.setattr(save_module.tree, "flatten", flatten)

    def release(self) -> None:
        self.go.set()


def test_a_guarded_save_after_the_first_is_walked_by_the_stager_not_its_call(tier_config, device, monkeypatch):
    """Once a guarded save has learned the state's structure, the next save's call walks nothing:
    it returns before the state is walked, the stager thread walks and plans it, and the step
    holds the state as it was at the call (the optimizer step waits for the walk too)."""
    model, opt = trained_model(device, steps=1)
    walks = _HeldWalk(monkeypatch)
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.guard(opt, defer_walk=True)
        walks.release()
        engine.save(1, _state(model, opt)).wait()
        assert walks.threads == ["MainThread"], "the first save learns the structure in its call"
        walks.go.clear()
        state = _state(model, opt)
        want = _copy(state)
        handle = engine.save(2, state)
        assert walks.threads == ["MainThread"], "the second save's call walked nothing"
        assert "call_ms" in handle.timings and not handle.staged.done()
        threading.Timer(0.2, walks.release).start()
        _step(model, opt, device)  # waits until the stager has walked and read the state
        assert walks.threads == ["MainThread", "tiered-stager"]
        handle.wait()
        assert {"stager_plan_ms", "flatten_ms", "staged_ms"} <= set(handle.timings)
        assert _equal(engine.load(2, device=device), want)


def test_a_deferred_save_clones_in_its_call_what_the_last_save_found_unguarded(tier_config, device, monkeypatch):
    """A buffer no optimizer updates (an EMA copy, BatchNorm statistics) and that the last save
    held is cloned in the call of the next, though the stager walks the state later: a change
    right after save() returns is not saved."""
    model, opt = trained_model(device, steps=1)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    walks = _HeldWalk(monkeypatch)
    walks.release()
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.guard(opt, defer_walk=True)
        engine.save(1, {"model": model.state_dict(), "ema": ema}).wait()
        walks.go.clear()
        state = {"model": model.state_dict(), "ema": ema}
        want = _copy(state)
        engine.save(2, state)
        for v in ema.values():  # before the stager has walked the state
            v.add_(1.0)
        walks.release()
        engine.wait()
        assert walks.threads[-1] == "tiered-stager"
        assert _equal(engine.load(2, device=device), want)


def test_a_tensor_new_to_a_deferred_save_is_copied_by_the_stager_and_logged(tier_config, device, monkeypatch,
                                                                             caplog):
    """A tensor the last save did not have, that no optimizer updates, is copied when the stager
    walks the state (said once in the log); from the next save on it is cloned in the call."""
    model, opt = trained_model(device, steps=1)
    extra = torch.arange(1000, dtype=torch.float32, device=device)
    walks = _HeldWalk(monkeypatch)
    walks.release()
    with tiered.Engine.from_config(tier_config()) as engine, caplog.at_level(logging.INFO, "tiered"):
        engine.guard(opt, defer_walk=True)
        engine.save(1, {"model": model.state_dict()}).wait()
        state = {"model": model.state_dict(), "extra": {"counts": extra}}
        want2 = _copy(state)
        engine.save(2, state).wait()
        assert "1 tensors that no guarded optimizer updates lie where the last save had none (the first: " \
            "extra.counts" in caplog.text
        walks.go.clear()
        state = {"model": model.state_dict(), "extra": {"counts": extra}}
        want3 = _copy(state)
        engine.save(3, state)
        extra.mul_(-1)  # before the stager has walked step 3: its clone was made in the call
        walks.release()
        engine.wait()
        assert _equal(engine.load(2, device=device), want2) and _equal(engine.load(3, device=device), want3)
    assert caplog.text.count("lie where the last save had none") == 1


def test_a_deferred_save_of_a_state_that_cannot_be_stored_fails_at_the_next_call(tier_config):
    """The stager finds what the call did not look at: the save fails in the background, naming
    what is wrong, nothing of the step is left behind, and later saves go on."""
    model, opt = trained_model("cpu", steps=1)
    with tiered.Engine.from_config({**tier_config(), "on_save_failure": "raise"}) as engine:
        engine.guard(opt, defer_walk=True)
        engine.save(1, _state(model, opt)).wait()
        engine.save(2, {**_state(model, opt), "bad": object()})
        with pytest.raises(tiered.BackgroundSaveError,
                           match=r"save\(step=2\).*StateDictError: bad: cannot checkpoint an object of type"):
            engine.wait()
        assert engine.steps() == [1] and not (engine.tier.step_dir(2)).exists()
        assert not list(engine.tier.root.glob(".step_*"))  # nor anything of it aside
        engine.save(3, _state(model, opt)).wait()
        assert engine.steps() == [1, 3]
        with pytest.raises(tiered.TieredError, match="already committed|committed"):
            engine.save(3, _state(model, opt))


def test_reserve_after_guard_lets_the_first_save_skip_its_walk_and_a_new_guard_walks_again(tier_config,
                                                                                          monkeypatch):
    model, opt = trained_model("cpu", steps=1)
    walks = _HeldWalk(monkeypatch)
    walks.release()
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.guard(opt, defer_walk=True)
        engine.reserve(_state(model, opt))
        engine.save(1, _state(model, opt)).wait()
        assert walks.threads == ["MainThread", "tiered-stager"], "reserve() walked it; the save's call did not"
        other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
        engine.guard(other, defer_walk=True)  # another optimizer: what is guarded changed, so the next call walks
        engine.save(2, _state(model, opt)).wait()
        assert walks.threads[-1] == "MainThread"


def test_a_guard_keeps_the_walk_in_the_call_unless_asked_to_defer_it(tier_config, monkeypatch):
    """`guard(optimizer, defer_walk=False)`: every save's call walks its state (its values are
    read then), however long the walk takes, as long as that guard stands, and nothing is kept for
    deferred saves; once it gives way to one with `defer_walk=True`, the next save learns the
    state in its call and the ones after walk nothing."""
    from tiered.save import pipeline as save_module

    monkeypatch.setattr(save_module, "DEFER_AFTER_MS", 0.0)  # (every walk is long enough to defer)
    model, opt = trained_model("cpu", steps=1)
    walks = _HeldWalk(monkeypatch)
    walks.release()
    with tiered.Engine.from_config(tier_config()) as engine:
        guard = engine.guard(opt, defer_walk=False)
        engine.reserve(_state(model, opt))
        for step in (1, 2, 3):
            engine.save(step, _state(model, opt)).wait()
        assert walks.threads == ["MainThread"] * 4
        guard.remove()
        engine.guard(opt, defer_walk=True)
        for step in (4, 5):
            engine.save(step, _state(model, opt)).wait()
        assert walks.threads[4:] == ["MainThread", "tiered-stager"]


@pytest.mark.parametrize("walk_ms", [0.0, 1e9])
def test_by_default_a_guarded_save_defers_the_walk_once_a_call_has_taken_long_to_walk(tier_config, monkeypatch,
                                                                                       caplog, walk_ms):
    """`guard(optimizer)`: a walk and plan that took `DEFER_AFTER_MS` (a large state) in
    `reserve` (after the guard) or in a save's call makes the saves after it walk on the stager
    thread, said once in the log; a shorter one keeps the walk in the call. Without `reserve`
    the first save's call walks and decides."""
    from tiered.save import pipeline as save_module

    monkeypatch.setattr(save_module, "DEFER_AFTER_MS", walk_ms)
    model, opt = trained_model("cpu", steps=1)
    walks = _HeldWalk(monkeypatch)
    walks.release()
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(tier_config()) as engine:
        engine.guard(opt)
        engine.reserve(_state(model, opt))
        want = _copy(_state(model, opt))
        for step in (1, 2, 3):
            engine.save(step, _state(model, opt)).wait()
        walked = list(walks.threads)
        assert all(_equal(engine.load(step), want) for step in (1, 2, 3))
    del walks.threads[:]
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(tier_config()) as engine:
        engine.guard(opt)  # (no reserve: the first save's call decides)
        for step in (4, 5):
            engine.save(step, _state(model, opt)).wait()
    deferred = [r.getMessage() for r in caplog.records if "on, the stager thread does" in r.getMessage()]
    if walk_ms == 0.0:
        assert walked == ["MainThread"] + ["tiered-stager"] * 3, "reserve() walked, then the stager thread"
        assert len(deferred) == 2 and "reserve() walked" in deferred[0] and "tensors) in" in deferred[0]
        assert "save() walked" in deferred[1] and walks.threads == ["MainThread", "tiered-stager"]
    else:
        assert walked == ["MainThread"] * 4 and not deferred and walks.threads == ["MainThread"] * 2


def test_new_tensors_too_large_to_clone_are_read_as_they_are_and_the_next_save_is_strict(tier_config, monkeypatch,
                                                                                        caplog):
    """Where cloning the tensors new to a deferred save would copy more than the limit (GPU
    memory: forced here), they are read as they are, the log says so, and the next save walks
    its state in its call and is staged strictly, as a first save over the limit is."""
    model, opt = trained_model("cpu", steps=1)
    over = {"on": False}
    real = overlap._over_limit
    monkeypatch.setattr(overlap, "_over_limit",
                        lambda tensors, unguarded, free: (0, 1 << 40, 1) if over["on"] and unguarded
                        else real(tensors, unguarded, free))
    walks = _HeldWalk(monkeypatch)
    walks.release()
    extra = torch.arange(100, dtype=torch.float32)
    with tiered.Engine.from_config(tier_config()) as engine, caplog.at_level(logging.INFO, "tiered"):
        engine.guard(opt, defer_walk=True)
        engine.save(1, {"model": model.state_dict()}).wait()
        over["on"] = True
        want = _copy({"model": model.state_dict(), "extra": extra})
        engine.save(2, {"model": model.state_dict(), "extra": extra}).wait()
        assert "read as they are by the stager thread" in caplog.text and "staged strictly" in caplog.text
        engine.save(3, {"model": model.state_dict(), "extra": extra}).wait()
        assert walks.threads == ["MainThread", "tiered-stager", "MainThread"]
        assert "saves are staged strictly" in caplog.text
        assert _equal(engine.load(2), want) and _equal(engine.load(3), want)


def test_the_calls_clones_leave_memory_freed_since_alone():
    """`Learned.clone_now` clones the last save's unguarded views whose memory is still in use,
    not memory resized or let go since (FSDP frees a parameter's storage by resizing it to 0):
    making the view again there would grow that storage back."""
    t = torch.arange(10.0)
    view = t[2:8:2]
    gone = torch.ones(3)
    learned = overlap.Learned([], [t, view, gone], [0, 1, 2], [], 40)
    del gone
    clones = learned.clone_now()
    assert set(clones) == {overlap.view_key(t), overlap.view_key(view)}
    assert clones[overlap.view_key(view)].tolist() == [2.0, 4.0, 6.0]
    t.untyped_storage().resize_(0)
    assert learned.clone_now() == {} and t.untyped_storage().nbytes() == 0


def test_stage_after_ms_starts_the_read_that_long_after_the_call_unless_something_waits_first(tier_config, device,
                                                                                               caplog):
    """`guard(optimizer, stage_after_ms=...)`: the stager thread reads a save no sooner than that
    after its call; an optimizer step (or `wait`, a handle's `wait`, `close`) before then starts
    the read at once, and the first such step is logged. Every step holds the state at its call."""
    model, opt = trained_model(device, steps=1)
    want = {}
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(tier_config()) as engine:
        guard = engine.guard(opt, stage_after_ms=300)
        state = _state(model, opt)
        want[1] = _copy(state)
        t0 = time.perf_counter()
        handle = engine.save(1, state)
        handle.staged.result()
        assert time.perf_counter() - t0 >= 0.3, "nothing waited for it: read 300 ms after the call"
        assert handle.timings["stage_after_ms"] > 0
        guard.remove()  # (orders the streams after the save, as the optimizer step would)
        assert handle.timings["step_after_ms"] >= 300, "when the update came after the call: the room to wait"
        engine.guard(opt, stage_after_ms=60_000)
        engine.guard(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), stage_after_ms=60_000)  # (said once)
        t0 = time.perf_counter()
        for step in (2, 3):
            state = _state(model, opt)
            want[step] = _copy(state)
            engine.save(step, state)
            _step(model, opt, device)  # the optimizer step waits for the read: it starts now
        state = _state(model, opt)
        want[4] = _copy(state)
        engine.save(4, state)
        engine.wait()  # so does a wait for the save
        assert time.perf_counter() - t0 < 30, "the optimizer step and wait() started the reads long before 60 s"
        state = _state(model, opt)
        want[5] = _copy(state)
        engine.save(5, state).wait()  # and the handle's wait
        state = _state(model, opt)
        want[6] = _copy(state)
        engine.save(6, state)  # and close(), below
    assert time.perf_counter() - t0 < 30
    cut = [r.getMessage() for r in caplog.records if "before guard(stage_after_ms=60000) had passed" in r.getMessage()]
    assert len(cut) == 1 and "step 2" in cut[0], "said once, at the first"
    assert not any("stage_after_ms=300)" in r.getMessage() for r in caplog.records)
    said = [r.getMessage() for r in caplog.records if "overlapped saves are read from" in r.getMessage()]
    assert len(said) == 2 and "300 ms" in said[0] and "60000 ms" in said[1], said
    with tiered.Engine.from_config(tier_config()) as engine:
        for step, expected in want.items():
            assert _equal(engine.load(step, device=device), expected), f"step {step}"


@pytest.mark.parametrize("bad", [-1, "250", float("nan"), float("inf"), True, None])
def test_stage_after_ms_must_be_a_non_negative_number_of_milliseconds(tier_config, bad):
    model, opt = trained_model("cpu", steps=1)
    with tiered.Engine.from_config(tier_config()) as engine:
        with pytest.raises(ValueError, match="stage_after_ms must be .auto. or a non-negative number of milliseconds"):
            engine.guard(opt, stage_after_ms=bad)
        assert not opt._optimizer_step_pre_hooks, "nothing guarded"
        engine.save(1, _state(model, opt)).wait()
        assert not any(t.name == "tiered-stager" for t in threading.enumerate())
