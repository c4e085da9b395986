"""The copy-engine path (tiered.stage.host_copy): GPU tensors stored as they are go straight into host
pages laid out as the data file lays them out, and are checksummed and written from there.

The layout and the staging run on the CPU here (CPU tensors, no stream); the GPU tests save
through the engine with `codec: none`, which takes this path for every GPU tensor."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from helpers import assert_same, mixed_state, zeros_like_state

import tiered
from tiered import threads
from tiered.format.checksum import wsum64
from tiered.format.chunks import ALIGNMENT
from tiered.format.manifest import CodecSpec
from tiered.stage.host_copy import HostLayout, stage, write_segment
from tiered.stage.plan import TensorPlan
from tiered.stage.pools import HostPool
from tiered.tiers.local import LocalTier
from tiered.units import round_up

CS = 64 << 10


def _plans(tensors: list[torch.Tensor]) -> tuple[TensorPlan, ...]:
    return tuple(TensorPlan(i, f"t{i}", CodecSpec.of("none"), False, CS, t.numel() * t.element_size(), t.dtype,
                            tuple(t.shape), str(t.device)) for i, t in enumerate(tensors))


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(300, 200, generator=g)
    return [
        torch.randn(5, generator=g),                          # a tail of a page
        torch.randn(3 * CS // 4 + 25, generator=g),           # three chunks and a tail
        torch.empty(0),                                        # no chunk
        torch.randint(0, 2**40, (CS // 2,), generator=g),     # larger than a run: in pieces
        base.t(),                                              # strided: made contiguous first
        torch.tensor(2.5, dtype=torch.float64),                # 0-d
        torch.rand(777, generator=g).gt(0.5),                  # bool
        torch.randn(CS // 2, generator=g).to(torch.bfloat16),  # exactly one chunk
    ]


def test_the_layout_puts_each_chunk_where_the_data_file_does():
    tensors = _tensors()
    plans = _plans(tensors)
    layout = HostLayout.build(plans, CS, run_bytes=3 * CS)
    at = 0  # the data file: each chunk at the next aligned offset (save.py's `place`)
    seen: dict[int, int] = {}
    for run in layout.runs:
        assert run.nbytes <= 3 * CS or run.end - run.first == 1
        got = [at + int(o) for o in run.offsets]
        want = []
        for ref in layout.refs[run.first:run.end]:
            want.append(at + sum(round_up(c.raw_size, ALIGNMENT) for c in layout.refs[run.first:run.first + len(want)]))
            assert ref.raw_size == run.sizes[len(want) - 1]
        assert got == want
        for p, pos in run.whole:
            seen[p.index] = seen.get(p.index, 0) + p.nbytes
            assert pos % ALIGNMENT == 0
        for i, lo, hi, pos in run.pieces:
            seen[i] = seen.get(i, 0) + hi - lo
            assert lo % CS == 0 and pos % ALIGNMENT == 0
        at += run.nbytes
    assert at == layout.nbytes == sum(round_up(c.raw_size, ALIGNMENT) for c in layout.refs)
    assert seen == {p.index: p.nbytes for p in plans if p.nbytes}, "every byte copied once"
    assert any(run.pieces for run in layout.runs), "the large tensor is split across runs"


def test_staged_pages_hold_the_chunks_with_zeroed_padding_and_their_checksums():
    tensors = _tensors()
    plans = _plans(tensors)
    host = HostPool(16 * CS)
    host.buffer.fill_(0xAB)  # pages hold an earlier save's bytes: the padding must not keep them
    layout = HostLayout.build(plans, CS, run_bytes=3 * CS)
    segments, timings = [], {}
    pool = threads.pool(2, "test-codec")
    try:
        stage(layout, tensors, host, None, segments.append, lambda: None, timings)
        assert len(segments) == len(layout.runs) and timings["copy_ms"] >= 0
        for seg in segments:
            sums = seg.checksums(pool)
            raw = seg.raw.numpy()
            end = 0
            for ref, off, size, crc in zip(seg.chunks, seg.run.offsets, seg.run.sizes, sums):
                t = tensors[ref.plan.index].contiguous().reshape(-1).view(torch.uint8).numpy()
                chunk = t[ref.j * CS:ref.j * CS + ref.raw_size]
                assert raw[off:off + size].tobytes() == chunk.tobytes()
                assert crc == wsum64(chunk)
                assert not raw[end:off].any(), "padding is zero"
                end = off + size
            assert not raw[end:].any()
            seg.release()
        assert host.ring.free_rows() == host.ring.rows, "every page given back"
    finally:
        pool.shutdown()
        host.close()


def test_a_segment_is_written_where_its_chunks_are_placed(tmp_path):
    """write_segment through a real local tier: the file holds every chunk at the offset `place`
    returned for it (as save.py places chunks), and the pages come back once written."""
    tensors = _tensors()
    plans = _plans(tensors)
    host = HostPool(16 * CS)
    layout = HostLayout.build(plans, CS, run_bytes=2 * CS)
    tier = LocalTier("local", tmp_path)
    tier.begin_step(1)
    writer = tier.open_data_writer(1, "rank_00000.data", device=False)
    placed: list[tuple[object, int, int, int]] = []
    end = [0]

    def place(refs, sizes, sums):
        first = end[0]
        for ref, size, crc in zip(refs, sizes, sums):
            placed.append((ref, end[0], size, crc))
            end[0] += round_up(size, ALIGNMENT)
        return first

    pool = threads.pool(2, "test-codec")
    try:
        stage(layout, tensors, host, None, lambda seg: write_segment(seg, writer, place, pool, {}), lambda: None, {})
        assert writer.close() == end[0] == layout.nbytes
        reader = tier.open_data_reader(1, "rank_00000.data", device=False)  # (uncommitted: the writer's own copy)
        data = np.frombuffer(reader.read_host(0, reader.size), dtype=np.uint8)
        reader.close()
        for ref, off, size, crc in placed:
            t = tensors[ref.plan.index].contiguous().reshape(-1).view(torch.uint8).numpy()
            assert data[off:off + size].tobytes() == t[ref.j * CS:ref.j * CS + size].tobytes()
            assert wsum64(data[off:off + size]) == crc
        assert host.ring.free_rows() == host.ring.rows
    finally:
        pool.shutdown()
        host.close()


def test_a_cpu_none_save_is_written_from_its_pages_in_place_and_restores_exactly(tier_config):
    """CPU tensors stored as they are take the same path, copied on the calling thread: strided,
    empty, 0-d, bool and numpy leaves, and a tensor larger than a run of a small host budget
    (in pieces, the pool reused while the writer frees it); every step restores bit-exact."""
    state = mixed_state("cpu")
    state["big"] = torch.randn(3_000_000)  # 12 MB: pieces across runs of 1.5 MiB
    with tiered.Engine.from_config(tier_config("none", host_buffer="6MiB")) as engine:
        handles = [engine.save(step, state) for step in (1, 2)]
        engine.wait()
        timings = handles[1].timings
        assert timings.get("cpu.copy_ms", 0) > 0 and timings.get("write.checksum_ms", 0) > 0, timings
        for step in (1, 2):
            target = zeros_like_state(state)
            engine.restore(target, step=step)
            assert_same(state, target)
        assert_same(state, engine.load(2))


@pytest.mark.gpu
def test_a_none_save_copies_gpu_tensors_to_the_host_and_restores_them_exactly(tier_config):
    """`codec: none` on a GPU: every tensor goes by the copy engines into host pages (no slab, no
    GPU memory taken), including strided, empty, 0-d and bool tensors, and a tensor larger than a
    run of the small host budget; each step restores bit-exact, on the GPU and from `load`."""
    cfg = tier_config("none", host_buffer="6MiB")
    state = mixed_state("cuda")
    state["big"] = torch.randn(3_000_000, device="cuda")  # 12 MB: pieces across runs of 1.5 MiB
    with tiered.Engine.from_config(cfg) as engine:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        handles = [engine.save(step, state) for step in (1, 2)]
        engine.wait()
        assert torch.cuda.memory_allocated() - before < (1 << 20), "a none save takes no GPU buffers"
        timings = handles[1].timings
        assert timings.get("cuda:0.copy_ms", 0) > 0 and timings.get("write.checksum_ms", 0) > 0, timings
        assert "cuda:0.encode_ms" not in timings, timings
        for step in (1, 2):
            target = zeros_like_state(state)
            engine.restore(target, step=step)
            assert_same(state, target)
        assert_same(state, engine.load(2, device="cuda"))


@pytest.mark.gpu
def test_a_guarded_none_save_holds_the_optimizer_step_until_copied(tmp_path):
    """With the optimizer guarded, save() returns before the copies; the step that follows waits
    for them, so the saved step is the state as it was at save(), not after the update."""
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path), "codec": "none"}]}
    model = torch.nn.Linear(2048, 2048, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with tiered.Engine.from_config(cfg) as engine:
        engine.guard(opt)
        for step in (1, 2, 3):
            model(torch.randn(64, 2048, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            want = {"model": type(state["model"])((k, v.clone()) for k, v in state["model"].items())}
            busy = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):  # the training stream is busy: the copies start after this
                busy = torch.nn.functional.normalize(busy @ busy, dim=1)
            engine.save(step, state)
            model(torch.randn(64, 2048, device="cuda")).square().mean().backward()
            opt.step()  # must wait for the save's copies
            opt.zero_grad()
            engine.wait()
            got = engine.load(step, device="cuda")
            assert_same(want["model"], got["model"])


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="thread priorities are a Linux feature here")
def test_checksum_threads_run_below_the_training_threads_priority(tier_config):
    """The copy-engine path's checksums run on few threads that yield the CPU to training."""
    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with tiered.Engine.from_config(tier_config("none")) as engine:
        theirs = engine.workers.checksums.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert theirs == min(19, me + 10)
