"""Backpressure: saves issued faster than the disk drains keep memory within the budgets: save()
waits for the writer instead of buffering, and every step still commits intact.

The disk is slowed on purpose (each write of the local tier sleeps), so the writer is the
bottleneck. Checked: the host staging pool never exceeds host_buffer, the process's resident
memory grows by far less than the bytes saved, saves wait for the writer to free staging rows
(counted where save() blocks, not timed), and every step restores bit-exact."""

from __future__ import annotations

import time

import torch

from tiered import Engine
from tiered.staging import RowRing
from tiered.tiers.local import LocalDataWriter


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1024, 1024, generator=g), "v": torch.randn(1024, 1024, generator=g), "step": step}


def test_saves_faster_than_the_disk_block_instead_of_buffering(tmp_path, monkeypatch):
    real = LocalDataWriter.write_host

    def slow_write(self, offset, buf):
        time.sleep(0.004)  # ~16 MB/s for 64 KiB writes: far slower than the saves below
        return real(self, offset, buf)

    monkeypatch.setattr(LocalDataWriter, "write_host", slow_write)
    waits = []
    real_acquire = RowRing.acquire

    def acquire(self, n, on_block=None):  # counts the acquisitions that had to wait for the writer
        def blocked():
            waits.append(n)
            if on_block is not None:
                on_block()
        return real_acquire(self, n, blocked)

    monkeypatch.setattr(RowRing, "acquire", acquire)
    budget = 4 << 20  # one save's state is 8 MiB: twice the host budget
    cfg = {"chunk_size": "64KiB", "budgets": {"host_buffer": budget, "gpu_buffer": "4MiB", "pack_buffer": "1MiB"},
           "tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "none"}]}
    steps = 12
    states = [state(s) for s in range(1, steps + 1)]  # built up front: not part of the growth measured
    with Engine.from_config(cfg) as engine:
        engine.save(0, state(0)).wait()  # the pool is allocated (once) here
        rss0 = rss_bytes()
        waits.clear()
        peak, handles = rss0, []
        for s, st in zip(range(1, steps + 1), states):
            handles.append(engine.save(s, st))
            peak = max(peak, rss_bytes())
            assert engine._host.buffer.numel() <= budget
        for h in handles:
            h.wait()
        saved = sum(v.nbytes for st in states for v in st.values() if isinstance(v, torch.Tensor))
        growth = peak - rss0
        # 96 MiB were saved through 4 MiB of staging: memory did not grow with the backlog.
        assert growth < saved / 4, f"resident memory grew {growth >> 20} MiB while saving {saved >> 20} MiB"
        # save() waited for the writer to free staging rows, again and again: backpressure.
        assert len(waits) >= steps, f"save() waited for the writer {len(waits)} times in {steps} saves"
        for s in (1, steps // 2, steps):
            out = engine.load(s)
            assert torch.equal(out["w"], states[s - 1]["w"]) and torch.equal(out["v"], states[s - 1]["v"])
