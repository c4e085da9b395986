"""Memory budgets (`auto` and explicit), the host staging pool pinned in the background, and the
large parallel host writes that drain it."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import tiered
from tiered.config import ConfigError, load_config
from tiered.stage import budgets
from tiered.stage.pools import HostPool, RowRing
from tiered.tiers.local import IO_TASK, LocalDataWriter

GiB, MiB = 1 << 30, 1 << 20


@pytest.mark.parametrize("case", [
    # one rank, plenty of host memory: at most the GPU's memory
    dict(available=1000 * GiB, ranks=1, gpu=80 * GiB, want=80 * GiB),
    # half of what is available, shared by the node's ranks, in whole blocks
    dict(available=120 * GiB, ranks=1, gpu=80 * GiB, want=60 * GiB),
    dict(available=120 * GiB, ranks=8, gpu=80 * GiB, want=7 * GiB + 512 * MiB),
    dict(available=2048 * GiB, ranks=8, gpu=80 * GiB, want=80 * GiB),
    # never less than one block
    dict(available=256 * MiB, ranks=4, gpu=80 * GiB, want=512 * MiB),
    # no CUDA: plain memory, at most 8 GiB
    dict(available=64 * GiB, ranks=1, gpu=None, want=8 * GiB),
    dict(available=4 * GiB, ranks=1, gpu=None, want=2 * GiB),
])
def test_auto_host_buffer(case):
    got = budgets.auto_host_buffer(case["available"], case["ranks"], case["gpu"], 512 * MiB)
    assert got.nbytes == case["want"], got
    assert got.why


@pytest.mark.parametrize("case", [
    # the whole compressed state fits half of what is free
    dict(need=2 * GiB, free=6 * GiB, others=300 * MiB, minimum=600 * MiB, want=2 * GiB),
    # it does not: half of free, less the other buffers
    dict(need=20 * GiB, free=6 * GiB, others=512 * MiB, minimum=600 * MiB, want=3 * GiB - 512 * MiB),
    # almost nothing free: the minimum (two waves), never more memory than that
    dict(need=20 * GiB, free=1 * GiB, others=512 * MiB, minimum=600 * MiB, want=600 * MiB),
    # a tiny state still gets two waves' worth
    dict(need=1 * MiB, free=60 * GiB, others=0, minimum=8 * MiB, want=8 * MiB),
])
def test_auto_gpu_buffer(case):
    got = budgets.auto_gpu_buffer(case["need"], case["free"], case["others"], case["minimum"])
    assert got.nbytes == case["want"], got
    assert ("drains" in got.why) == (case["need"] > got.nbytes)


def test_budgets_default_to_auto_and_accept_sizes(tmp_path):
    tiers = [{"name": "l", "kind": "local", "path": str(tmp_path)}]
    cfg = load_config({"tiers": tiers})
    assert cfg.budgets.gpu_buffer is None and cfg.budgets.host_buffer is None
    cfg = load_config({"tiers": tiers, "budgets": {"gpu_buffer": "auto", "host_buffer": "3GiB"}})
    assert cfg.budgets.gpu_buffer is None and cfg.budgets.host_buffer == 3 * GiB
    with pytest.raises(ConfigError, match="budgets.host_buffer"):
        load_config({"tiers": tiers, "budgets": {"host_buffer": "lots"}})


def test_local_ranks_from_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert budgets.local_ranks() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert budgets.local_ranks() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert budgets.local_ranks() == 1
    assert budgets.host_available() > 0


def test_auto_host_buffer_is_logged_with_the_field(tmp_path, caplog):
    with caplog.at_level("INFO", "tiered"):
        with tiered.Engine.from_config({"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path)}]}):
            pass
    assert "budgets.host_buffer auto" in caplog.text and "set budgets.host_buffer" in caplog.text


# --- rings and the pool ------------------------------------------------------------------------
def test_ring_runs_never_straddle_a_boundary():
    ring = RowRing(12, boundary=4)
    assert ring.max_run == 4
    assert ring.acquire(3) == 0
    assert ring.acquire(3) == 4, "rows 3..5 would straddle row 4"
    assert ring.acquire(2) == 8, "rows 7..8 would straddle row 8"
    with pytest.raises(ValueError, match="runs of at most 4"):
        ring.acquire(5)


def test_ring_hands_out_rows_as_the_limit_grows():
    ring = RowRing(8, limit=0, boundary=4)
    assert ring.try_acquire(2) is None
    got = []
    t = threading.Thread(target=lambda: got.append(ring.acquire(4)))
    t.start()
    time.sleep(0.05)
    assert not got, "waits for rows that are not usable yet"
    ring.grow(4)
    t.join(5)
    assert got == [0]
    assert ring.try_acquire(1) is None
    ring.grow(8)
    assert ring.try_acquire(4) == 4


def test_a_drained_wave_takes_its_runs_pages_as_one_range_so_it_never_waits_holding_some():
    """A wave drained in several runs takes one range of host pages for all of them before any
    (`WavePages`). Taken run by run, the first run could land mid-ring and the next wait forever
    for a gap that long, with nothing left to free it: a hang seen on GPUs."""
    from tiered.stage.pools import WavePages

    ring = RowRing(10)
    older = ring.acquire(3)  # (an older wave's pages, still being written: rows 0..2)
    # Run by run: the first run of 4 takes rows 3..6; once the older wave is written, 6 rows are
    # free, but in gaps of 3 and 3: the second run of 4 would wait forever.
    first = ring.try_acquire(4)
    ring.release(older)
    assert first == 3 and ring.free_rows() == 6 and ring.try_acquire(4) is None
    ring.release(first)

    older = ring.acquire(3)
    got: list = []
    t = threading.Thread(target=lambda: got.append(WavePages(ring, [4, 4], RowRing.acquire)))
    t.start()
    time.sleep(0.05)
    assert not got, "waits for one range of 8 rows, holding none meanwhile"
    ring.release(older)
    t.join(5)
    assert got, "the wave got its pages once the older wave's were given back"
    pages = got[0]
    (a, release_a), (b, release_b) = pages.take(4), pages.take(4)
    assert (a, b) == (0, 4) and release_a is release_b
    release_a()
    assert ring.free_rows() == 2, "the range is given back with the last run"
    release_b()
    assert ring.free_rows() == 10

    single = WavePages(ring, [3], RowRing.acquire)
    start, release = single.take(3)
    assert single.whole is None and ring.free_rows() == 7
    single.give_back()
    assert ring.free_rows() == 10
    failed = WavePages(ring, [2, 5], RowRing.acquire)
    failed.take(2)
    failed.give_back()  # (a failure before every run was copied: the whole range goes back once)
    assert ring.free_rows() == 10
    with pytest.raises(tiered.TieredError, match=r"drains 45.06 kB .* budgets.host_buffer holds \(40.96 kB\)"):
        WavePages(ring, [6, 5], RowRing.acquire)  # (more than the pool: its last run would wait forever)
    assert ring.free_rows() == 10


def test_a_shared_release_takes_effect_at_its_last_call_from_any_thread():
    ring = RowRing(4)
    start = ring.acquire(4)
    release = ring.release_after(start, 50)
    threads = [threading.Thread(target=release) for _ in range(49)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ring.free_rows() == 0
    release()
    assert ring.free_rows() == 4


def test_host_pool_pins_on_demand_block_by_block_in_the_background():
    pinned, unpinned, gate = [], [], threading.Event()

    def pin(addr: int, n: int) -> bool:
        gate.wait(5)
        pinned.append((addr, n))
        return True

    pool = HostPool(10 * 4096, 4096, pin=pin, unpin=unpinned.append, block=4 * 4096)
    assert pool.max_run_bytes == 4 * 4096 and pool.ring.free_rows() == 0 and pool.wait_pinned(0)
    pool.want(3 * 4096)  # one block
    assert not pool.wait_pinned(0.05)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.ring.acquire(2)))
    t.start()
    gate.set()
    assert pool.wait_pinned(5)
    t.join(5)
    assert got == [0], "a save waiting for pages gets them as they are pinned"
    base = pool.buffer.data_ptr()
    assert base % 4096 == 0, "page aligned, as O_DIRECT needs"
    assert pinned == [(base, 4 * 4096)] and pool.pinned_bytes == 4 * 4096
    pool.want(2 * 4096)  # already pinned: nothing to do
    assert pool.wait_pinned(0) and len(pinned) == 1
    pool.want(1 << 40)  # more than the pool: all of it, no more
    assert pool.wait_pinned(5)
    assert pinned[1:] == [(base + 4 * 4096, 4 * 4096), (base + 8 * 4096, 2 * 4096)]
    assert pool.pinned_bytes == 10 * 4096 and pool.ring.free_rows() == 10 - 2
    pool.ring.release(0)
    page = pool.ring.acquire(2)
    pool.view(page, 8192).fill_(7)
    assert int(pool.view(page, 8192).sum()) == 7 * 8192
    pool.ring.release(page)
    pool.close()
    assert unpinned == [a for a, _ in pinned]


def test_host_pool_uses_the_rest_unpinned_when_pinning_fails(caplog):
    calls = []

    def pin(addr: int, n: int) -> bool:
        calls.append(addr)
        return len(calls) < 2

    pool = HostPool(8 * 4096, 4096, pin=pin, unpin=lambda a: None, block=2 * 4096)
    with caplog.at_level("WARNING", "tiered"):
        pool.want(8 * 4096)
        assert pool.wait_pinned(5)
    assert len(calls) == 2 and pool.ring.free_rows() == 8
    assert "pinning host staging memory failed" in caplog.text and "budgets.host_buffer" in caplog.text
    pool.close()

def test_a_save_says_once_where_it_will_wait_for_host_pages(caplog):
    """`want_for_save`: a save larger than the pool says the disk paces it, naming the budget; one
    that finds less pinned than it needs says it waits for pinning; each once per kind."""
    release = threading.Event()

    def pin(addr: int, n: int) -> bool:
        return release.wait(5)

    pool = HostPool(8 * 4096, 4096, pin=pin, unpin=lambda a: None, block=2 * 4096)
    warned: set[str] = set()
    with caplog.at_level("WARNING", "tiered"):
        pool.want_for_save(4 * 4096, warned, "cuda:3", "copies 16 KiB", "Raise budgets.host_buffer")
        pool.want_for_save(4 * 4096, warned, "cuda:3", "copies 16 KiB", "Raise budgets.host_buffer")
        assert warned == {"pin"} and caplog.text.count("waits for it") == 1
        assert "cuda:3: this save copies 16 KiB" in caplog.text and "engine.reserve(state)" in caplog.text
        pool.want_for_save(64 * 4096, warned, "cuda:3", "copies 256 KiB", "Raise budgets.host_buffer")
        pool.want_for_save(64 * 4096, warned, "cuda:3", "copies 256 KiB", "Raise budgets.host_buffer")
    assert warned == {"pin", "host"} and caplog.text.count("waits for the disk") == 1
    assert "holds at most 32.77 kB" in caplog.text and "Raise budgets.host_buffer" in caplog.text
    release.set()
    assert pool.wait_pinned(5) and pool.pinned_bytes == pool.capacity  # (wanted the whole pool)
    pool.close()



# --- large parallel host writes ------------------------------------------------------------------
def _aligned(nbytes: int, seed: int) -> tuple[HostPool, memoryview, bytes]:
    pool = HostPool(nbytes, 4096)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    pool.view(0, nbytes).copy_(data)
    return pool, memoryview(pool.view(0, nbytes).numpy()), data.numpy().tobytes()


def test_write_host_async_writes_large_extents_in_parallel_pieces(tmp_path):
    n = 2 * IO_TASK + 3 * 4096  # three pieces, the last one short
    pool, view, data = _aligned(n, 1)
    done = []
    w = LocalDataWriter(tmp_path / "d", "auto", device=False)
    w.write_host_async(4096, view, lambda: done.append(1))
    w.write_host_async(4096 + n, view[:8192], lambda: done.append(2))
    assert w.close() == 4096 + n + 8192
    assert sorted(done) == [1, 2], "each extent's on_done runs once, after all its pieces"
    got = (tmp_path / "d").read_bytes()
    assert got[:4096] == bytes(4096) and got[4096:4096 + n] == data and got[4096 + n:] == data[:8192]
    pool.close()


def test_write_host_async_failure_is_raised_by_close_and_releases(tmp_path):
    pool, view, _ = _aligned(IO_TASK + 4096, 2)
    done = []
    w = LocalDataWriter(tmp_path / "d", "off", device=False)
    os.close(w._fd)  # every write fails: EBADF
    w._fd = os.open(os.devnull, os.O_RDONLY)
    w.write_host_async(0, view, lambda: done.append(1))
    with pytest.raises(tiered.TieredError, match="write of"):
        w.close()
    assert done == [1], "pages are released even when their write failed"
    other = LocalDataWriter(tmp_path / "e", "off", device=False)
    with pytest.raises(ValueError, match="unaligned"):
        other.write_host_async(1, view)
    other.close()
    pool.close()


def test_queued_host_writes_hold_no_object_per_piece():
    """A large save drains pieces faster than the disk takes them; queued, they must not be
    objects the collector tracks one by one (futures, locks)."""
    import gc
    import threading

    from tiered.tiers.host_writes import HostWrites

    gate, got = threading.Event(), []
    writes = HostWrites(lambda view, offset: (gate.wait(), got.append((offset, bytes(view)))), 2, 4096, "test-write")
    data = memoryview(bytes(range(256)) * 64)  # 16 KiB: four pieces an extent
    done = []

    def mark() -> None:
        done.append(1)

    gc.collect()
    before = len(gc.get_objects())
    for e in range(500):
        writes.submit(e * len(data), data, mark)
    queued = len(gc.get_objects()) - before
    gate.set()
    writes.wait()
    writes.close()
    assert queued < 500 + 50, queued  # (an extent's queue entry; not 2,000 pieces, each with a future)
    assert len(done) == 500
    assert sorted(got) == [(e * len(data) + p, bytes(data[p:p + 4096]))
                           for e in range(500) for p in range(0, len(data), 4096)]


# --- on the GPU ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("gpu_buffer", [None, "64MiB"], ids=["auto", "explicit"])
def test_reserve_and_wait_pinned_leave_no_start_up_work_to_the_first_save(tmp_path, monkeypatch, caplog, gpu_buffer):
    """reserve() plans the state and lays it out in the pack buffer; the first save, once the slab
    is sized, keeps that layout (auto: a slab of more rows; explicit: the rows it was built for).
    (A 4 MiB pack buffer: waves of 4 chunks of `w`, and one of the small tensors, fewer than the
    10 rows reserve() lays out for; a wave cut at those rows is laid out again: test_misc.)"""
    from nvidia import nvcomp

    from tiered.gpu.layout import Layout

    built, made = [], []
    real = Layout.build.__func__
    monkeypatch.setattr(Layout, "build", classmethod(lambda cls, *a, **k: built.append(1) or real(cls, *a, **k)))
    real_codec = nvcomp.Codec
    monkeypatch.setattr(nvcomp, "Codec", lambda **kw: made.append(kw["cuda_stream"]) or real_codec(**kw))
    state = {"w": torch.randn(1 << 22, device="cuda"), "small": [torch.randn(100, device="cuda") for _ in range(8)]}
    cfg = {"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path)}], "budgets": {"pack_buffer": "4MiB"}}
    if gpu_buffer:
        cfg["budgets"]["gpu_buffer"] = gpu_buffer
    with caplog.at_level("INFO", "tiered"), tiered.Engine.from_config(cfg) as engine:
        engine.reserve(state)
        assert engine.wait_pinned(300) and len(built) == 1, "reserve() laid the state out"
        assert "pack buffer allocated (budgets.pack_buffer)" in caplog.text and "laid out in 5 waves" in caplog.text
        assert engine.wait_pinned(300)
        assert engine.workers.device(0).wait_warm(0), "the save kernels are compiled"
        encoders = {s.cuda_stream for s in engine.workers.device(0).encode_streams}
        made.clear()
        engine.save(1, state).wait()
        assert len(built) == 1, "the first save kept the layout reserve() made"
        assert not encoders & set(made), "reserve() made the codecs' nvCOMP objects on every encode stream"
        got = engine.load(1)
    assert torch.equal(got["w"], state["w"]) and all(torch.equal(a, b) for a, b in zip(got["small"], state["small"]))


@pytest.mark.gpu
def test_a_pack_buffer_that_does_not_fit_is_refused_after_reserve_naming_its_budget(tmp_path):
    state = {"w": torch.randn(1 << 20, device="cuda")}
    free = torch.cuda.mem_get_info()[0]
    cfg = {"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path)}],
           "budgets": {"pack_buffer": f"{2 * free // (1 << 20)}MiB"}}
    with tiered.Engine.from_config(cfg) as engine:
        engine.reserve(state)  # (it lays out on another thread: the next call that waits for it raises)
        with pytest.raises(tiered.TieredError, match=r"pack buffer \(budgets.pack_buffer\) does not fit"):
            engine.wait_pinned(120)
        with pytest.raises(tiered.TieredError, match=r"pack buffer \(budgets.pack_buffer\) does not fit"):
            engine.save(1, state).wait()  # (and the first save, which allocates it itself)


@pytest.mark.gpu
def test_a_first_save_whose_pack_buffer_does_not_fit_fails_the_same_way_again(tmp_path):
    """Without reserve(), the first save allocates the pack buffer: where it does not fit, that save
    and the next fail naming the budget (the slab is not left allocated without it)."""
    state = {"w": torch.randn(1 << 20, device="cuda")}
    free = torch.cuda.mem_get_info()[0]
    cfg = {"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path)}],
           "budgets": {"pack_buffer": f"{2 * free // (1 << 20)}MiB"}}
    with tiered.Engine.from_config(cfg) as engine:
        for step in (1, 2):
            with pytest.raises(tiered.TieredError, match=r"pack buffer \(budgets.pack_buffer\) does not fit"):
                engine.save(step, state).wait()
        assert engine.latest_step() is None


@pytest.mark.gpu
def test_auto_gpu_budget_is_logged_and_bounded_by_free_memory(tmp_path, caplog):
    state = {"w": torch.randn(32 << 20, device="cuda"), "b": torch.randn(1000, device="cuda").to(torch.bfloat16)}
    free = torch.cuda.mem_get_info()[0]
    with caplog.at_level("INFO", "tiered"):
        with tiered.Engine.from_config({"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path)}]}) as engine:
            engine.save(1, state).wait()
            taken = free - torch.cuda.mem_get_info()[0]
            got = engine.load(1)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert "budgets.gpu_buffer auto" in caplog.text and "the whole compressed state" in caplog.text
    assert taken < free // 2, f"took {taken} of {free} free bytes"


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["triton", "torch-fallback"])
def test_state_larger_than_the_slab_drains_through_pinned_memory(tmp_path, monkeypatch, fused):
    """A 512 MiB state through a 64 MiB slab: waves drain through a 96 MiB pinned pool, written
    from there in large pieces; bit-exact, and the pool is pinned (not pageable). Also without
    the Triton kernel (where Triton is missing): torch checksums and gathers."""
    from tiered.gpu import pack as gpu_checksum

    if not fused:
        monkeypatch.setattr(gpu_checksum, "available", lambda: False)
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {f"t{i}": torch.randn(16 << 20, device="cuda", generator=g) for i in range(8)}
    cfg = {"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path)}],
           "budgets": {"gpu_buffer": "64MiB", "pack_buffer": "16MiB", "host_buffer": "96MiB"}}
    with tiered.Engine.from_config(cfg) as engine:
        for step in (1, 2):
            engine.save(step, state).wait()
        assert engine.workers.host.pinned_bytes == 96 << 20, "the save wanted all of the pool"
        assert engine.workers.host.buffer.is_pinned()
        got = engine.load(2)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_reserve_takes_a_state_or_a_size(tmp_path):
    state = {"w": torch.randn(1000), "n": 3}
    with tiered.Engine.from_config({"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path)}]}) as engine:
        engine.reserve(state)
        engine.reserve(1 << 20)
        assert engine.wait_pinned(5)
        engine.save(1, state).wait()
        assert torch.equal(engine.load(1)["w"], state["w"])


def test_reserve_plans_the_state_so_its_first_save_does_not(tmp_path, monkeypatch):
    import tiered.stage.plan
    state = {"w": torch.randn(1000), "tied": None, "opt": {"m": torch.randn(10), "step": 3}}
    state["tied"] = state["w"]
    made = []
    real = tiered.stage.plan.make_plan
    monkeypatch.setattr(tiered.stage.plan, "make_plan", lambda *a, **k: made.append(1) or real(*a, **k))
    with tiered.Engine.from_config({"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path)}]}) as engine:
        engine.reserve(state)
        assert engine.wait_pinned(30) and len(made) == 1
        engine.save(1, state).wait()
        assert len(made) == 1, "the first save reused the plan reserve() made"
        engine.save(2, {**state, "extra": torch.zeros(3)}).wait()
        assert len(made) == 2, "another structure is planned again"
        got = engine.load(1)
    assert torch.equal(got["w"], state["w"]) and got["tied"] is got["w"]


def test_reserve_readies_saves_on_a_thread_of_its_own(tmp_path, monkeypatch, caplog):
    """reserve() walks the state and returns; the plan and the layout are made on another thread,
    and whatever needs them (a save, guard, restore, wait_pinned) waits for that thread first. A
    failure there is logged and the first save does the work itself."""
    import tiered.stage.plan
    state = {"w": torch.randn(1000), "opt": {"m": torch.randn(10), "step": 3}}
    gate, threads_seen = threading.Event(), []
    real = tiered.stage.plan.make_plan

    def slow_plan(*a, **k):
        threads_seen.append(threading.current_thread().name)
        assert gate.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(tiered.stage.plan, "make_plan", slow_plan)
    with tiered.Engine.from_config({"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path)}]}) as engine:
        t0 = time.perf_counter()
        engine.reserve(state)
        assert time.perf_counter() - t0 < 2 and not engine.wait_pinned(0.2), "the call does not plan"
        saved = []
        saver = threading.Thread(target=lambda: saved.append(engine.save(1, state)))
        saver.start()
        saver.join(0.3)
        assert saver.is_alive(), "the first save waits for the reservation rather than planning beside it"
        gate.set()
        saver.join(10)
        saved[0].wait()
        assert threads_seen == ["tiered-reserve"], "planned once, by the reservation's thread"
        assert torch.equal(engine.load(1)["w"], state["w"])

    def broken(*a, **k):
        raise RuntimeError("no plan today")

    monkeypatch.setattr(tiered.stage.plan, "make_plan", broken)
    with tiered.Engine.from_config({"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path / "b")}]}) as engine:
        with caplog.at_level("WARNING", "tiered"):
            engine.reserve(state)
            assert engine.wait_pinned(10)
        assert "reserve() could not ready saves" in caplog.text and "no plan today" in caplog.text
        monkeypatch.setattr(tiered.stage.plan, "make_plan", real)
        engine.save(2, state).wait()  # (the save plans itself)
        assert engine.steps() == [2]


def test_host_pool_touches_each_block_before_pinning_it():
    """The pinner has the kernel back a block's pages (the resident set grows by the block) before
    it registers it, a block ahead of the registration, on threads of their own."""
    def resident(addr: int) -> int:
        """Bytes of the mapping holding `addr` that are backed (its Rss in /proc/self/smaps)."""
        inside = False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "Rss:":
                    return int(line.split()[1]) * 1024
        raise AssertionError("no mapping holds the pool")

    block = 16 << 20
    seen = []
    pool = HostPool(4 * block, 4096, pin=lambda addr, n: seen.append((addr, n, resident(addr))) or True,
                    unpin=lambda a: None, block=block)
    base = pool.buffer.data_ptr()
    assert resident(base) < block, "nothing is backed before it is wanted"
    pool.want(4 * block)
    assert pool.wait_pinned(10)
    assert [(a - base, n) for a, n, _ in seen] == [(k * block, block) for k in range(4)]
    for k, (_, _, backed) in enumerate(seen):
        assert backed >= (k + 1) * block, f"block {k} registered before its pages were backed"
    pool.close()


def test_the_touching_threads_are_this_ranks_share_of_its_cores(monkeypatch):
    """As many touching threads as the machine's cores over the node's local ranks, or the cores a
    launcher bound the process to where those are fewer (its share already), at most
    TOUCH_THREADS, at least one."""
    from tiered.stage import pools

    monkeypatch.setattr(pools.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(pools.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert pools.touch_workers() == pools.TOUCH_THREADS == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert pools.touch_workers() == 8
    monkeypatch.setattr(pools.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    assert pools.touch_workers() == 12, "bound to 12 cores: those are this rank's, not 12 / 8"
    monkeypatch.setattr(pools.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert pools.touch_workers() == 1


def test_host_pool_maps_what_the_kernel_grants(tmp_path):
    """Under an address-space limit (as strict overcommit accounting imposes), the pool maps the
    most it is granted, halving, and says so, rather than failing the engine."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import logging, resource, sys
        import torch  # (mapped before the limit)
        from tiered.stage.pools import HostPool
        logging.basicConfig(level=logging.WARNING)
        with open("/proc/self/status") as f:
            size = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
        pool = HostPool(64 << 30)
        assert 0 < pool.capacity <= (1 << 30), pool.capacity
        page = pool.ring.acquire(4)
        pool.view(page, 4 * 4096).fill_(1)
        print("capacity", pool.capacity)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "could not be mapped" in out.stderr and "budgets.host_buffer" in out.stderr


def test_wait_pinned_timeout_is_for_pinning_and_compiling_together(tmp_path, monkeypatch):
    with tiered.Engine.from_config({"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path)}]}) as engine:
        given: list[float | None] = []

        def slow_pinning(timeout=None):  # pinning that takes the whole timeout and is not done
            time.sleep(timeout)
            return False

        def warm(timeout=None):
            given.append(timeout)
            return True

        monkeypatch.setattr(engine.workers.host, "wait_pinned", slow_pinning)
        monkeypatch.setattr(engine.workers, "wait_warm", warm)
        assert engine.wait_pinned(0.3) is False
        assert given and given[0] < 0.1, "the compile wait gets what is left of the timeout, not all of it again"
