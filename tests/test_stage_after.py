"""`Engine.guard`'s default `stage_after_ms="auto"`: the stager waits as long as the loop's step
leaves room for, measured from the guarded optimizer's steps and the last save's read."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from helpers import assert_same, trained_model

import tiered
from tiered.stage.stage_after import AUTO_MAX_MS, READ_MARGIN, StageAfter, stage_after_seconds


class Clock:
    """A loop's time played out without spending it: `StageAfter`'s clock, and its wait, which
    moves the clock by the time waited (all of it, unless the event is set already)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        if event.is_set():
            return True
        self.now += timeout
        return False


def _stage() -> tuple[StageAfter, Clock]:
    clock = Clock()
    return StageAfter(clock=clock, wait=clock.wait), clock


def _steps(stage: StageAfter, clock: Clock, opt: object, n: int, every: float) -> None:
    for _ in range(n):
        clock.now += every
        stage.stepped(opt)


def _read(stage: StageAfter, clock: Clock, read_s: float) -> dict:
    """One save through `wait` whose read then took `read_s` (its handle's staged_ms, as the engine sets it)."""
    timings: dict[str, float] = {}
    started = clock.now
    stage.wait(started, threading.Event(), 1, timings)
    clock.now += read_s
    timings["staged_ms"] = 1e3 * (clock.now - started)
    return timings


def test_auto_waits_a_quarter_step_then_what_the_last_read_leaves_of_it_at_most_250_ms():
    stage, clock = _stage()
    opt = object()
    stage.set(opt, stage_after_seconds("auto"))
    assert stage.auto_seconds() == (0.0, 0.0, None), "no step seen: no wait"
    stage.stepped(opt)
    assert stage.auto_seconds() == (0.0, 0.0, None), "one step: no interval yet"
    _steps(stage, clock, opt, 2, 0.4)
    chosen, period, read = stage.auto_seconds()
    assert period == pytest.approx(0.4) and read is None
    assert chosen == pytest.approx(0.1), "no save read yet: a quarter of the step"
    first = _read(stage, clock, 0.2)
    assert first["stage_after_ms"] == pytest.approx(100.0), "the stager waited what auto chose"
    chosen, period, read = stage.auto_seconds()
    assert read == pytest.approx(0.2)  # (the 100 ms waited are not the read's)
    assert chosen == pytest.approx(0.4 - READ_MARGIN * 0.2)
    _read(stage, clock, 0.0)
    assert stage.auto_seconds()[0] == pytest.approx(AUTO_MAX_MS / 1e3), "a quick read: at most 250 ms"
    _read(stage, clock, 0.7)  # 1.5 x 0.7 s outlasts the 0.4 s step: wait for nothing
    assert stage.auto_seconds()[0] == 0.0
    assert "stage_after_ms" not in _read(stage, clock, 0.0), "a save with no room to wait does not"


def test_auto_follows_the_quickest_guarded_optimizer_and_a_fixed_wait_longer_than_it_wins():
    stage, clock = _stage()
    slow, quick = object(), object()
    stage.set(slow, None)
    stage.set(quick, None)
    _steps(stage, clock, slow, 2, 0.4)
    _steps(stage, clock, quick, 2, 0.1)
    chosen, period, _ = stage.auto_seconds()
    assert period == pytest.approx(0.1) and chosen == pytest.approx(0.025), "the step that comes first bounds the wait"
    stage.drop(quick)
    assert stage.auto_seconds()[1] == pytest.approx(0.4)
    stage.set(quick, 0.3)
    assert _read(stage, clock, 0.0)["stage_after_ms"] == pytest.approx(300.0), "a fixed 300 ms beside auto's 100"


def test_auto_says_its_choice_once_before_a_read_is_timed_and_once_after(caplog):
    stage, clock = _stage()
    opt = object()
    stage.set(opt, None)
    _steps(stage, clock, opt, 2, 0.2)
    with caplog.at_level(logging.INFO, logger="tiered"):
        for read in (0.01, 0.01, 0.01):
            _read(stage, clock, read)
    said = [r.getMessage() for r in caplog.records if "stage_after_ms='auto'" in r.getMessage()]
    assert len(said) == 2, said
    assert "a quarter of the" in said[0] and "until a save's read has been timed" in said[0], said
    assert "less 1.5 x the" in said[1] and "walk, plan and read took" in said[1], said


@pytest.mark.parametrize("bad", ["AUTO", "soon", b"auto", -0.5])
def test_stage_after_ms_names_auto_in_its_error(bad):
    with pytest.raises(ValueError, match="must be 'auto' or a non-negative number of milliseconds"):
        stage_after_seconds(bad)


def _loop_step(model, opt, pause: float) -> None:
    loss = model(torch.randn(32, 256)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    time.sleep(pause)  # (forward and backward of a larger model)
    opt.step()


def test_the_default_guard_waits_as_the_loop_leaves_room_and_says_so_once(tier_config, caplog):
    """A loop of 1 s steps under `guard(opt)` (room for a wait, whatever the machine: a tiny
    state's read takes far less): the first save before any step reads at once, the next ones
    wait, the log says what auto chose once, and every step restores to the state at its save.
    `stage_after_ms=0` never waits."""
    model, opt = trained_model("cpu", steps=1)
    want = {}
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(tier_config("zstd")) as engine:
        guard = engine.guard(opt)
        waits = []
        for step in range(1, 5):
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            want[step] = {k: v.clone() for k, v in model.state_dict().items()}
            handle = engine.save(step, state)
            _loop_step(model, opt, 1.0)
            handle.wait()
            waits.append(handle.timings.get("stage_after_ms", 0.0))
            if step == 1:
                _loop_step(model, opt, 1.0)  # (two steps: the interval auto measures)
        assert waits[0] == 0.0, "no step interval seen before the first save: it read at once"
        assert all(w > 0 for w in waits[1:]), waits  # (each waited: how long is the unit tests' above)
        guard.remove()
        engine.guard(opt, stage_after_ms=0)
        handle = engine.save(9, {"model": model.state_dict(), "optim": opt.state_dict()})
        _loop_step(model, opt, 0.4)
        handle.wait()
        assert "stage_after_ms" not in handle.timings, "0: at once"
    said = [r.getMessage() for r in caplog.records if "stage_after_ms='auto'" in r.getMessage()]
    # (the first save read at once and was timed, so auto's first choice already counts its read)
    assert len(said) == 1 and "the optimizer steps every" in said[0] and \
        "the last save's walk, plan and read took" in said[0], said
    assert not any(r.levelno >= logging.WARNING for r in caplog.records), "auto's wait cut short is no warning"
    with tiered.Engine.from_config(tier_config("zstd")) as engine:
        for step, model_state in want.items():
            assert_same(dict(engine.load(step)["model"]), model_state)


def test_a_wait_cut_short_warns_once_when_fixed_and_never_under_auto(caplog):
    """Something waiting for the reads before the wait is over starts them at once. Under a fixed
    `stage_after_ms` that is worth a warning (once: the loop's step is shorter than asked for);
    under auto it is how short steps go (the host launches the optimizer step ahead of the GPU)."""
    hurry = threading.Event()
    hurry.set()
    for fixed, warned in ((None, 0), (60.0, 1)):
        stage, clock = _stage()
        opt = object()
        stage.set(opt, fixed)
        _steps(stage, clock, opt, 2, 0.4)
        with caplog.at_level(logging.DEBUG, logger="tiered"):
            caplog.clear()
            for step in (1, 2):
                timings: dict[str, float] = {}
                stage.wait(clock.now, hurry, step, timings)
                assert timings["stage_after_ms"] == 0.0, "cut short: read at once"
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == warned and all("step 1" in r.getMessage() for r in warnings)
