"""codec: auto end to end: measured samples and tier bandwidth feed tiered.policy.choose_codec."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import pytest
import torch
from conftest import HAS_GPU
from helpers import assert_same, trained_model

import tiered
from tiered.config import ZstdSettings
from tiered.format import tree
from tiered.gpu.recode import GpuRecoder
from tiered.observe.probe import Sample, measure, sample_positions, tier_bandwidth
from tiered.stage.plan import make_plan


@pytest.mark.parametrize("sizes, chunk, n, expected", [
    ([10], 1, 4, [(0, 1), (0, 3), (0, 6), (0, 8)]),
    ([1, 1, 8], 1, 5, [(1, 0), (2, 1), (2, 3), (2, 5), (2, 7)]),  # big tensors get more samples
    ([3, 0, 2], 1, 16, [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]),  # fewer chunks than samples: all
    ([], 1, 4, []),
])
def test_sample_positions(sizes, chunk, n, expected):
    assert sample_positions(sizes, chunk, n) == expected


def test_measure_counts_kept_chunks_as_free():
    rng = np.random.default_rng(0)
    sample = Sample()
    for _ in range(4):
        raw = (rng.standard_normal(16384).astype(np.float32)).view(np.uint8)
        sample.add(torch.float32, raw, ("zstd", 50_000))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        got = {s.name: s for s in measure(sample, ["zstd", "none"], pool=pool, settings=ZstdSettings())}
    assert got["zstd"].throughput >= 1e14 and got["zstd"].ratio == pytest.approx(200_000 / sample.raw_bytes)
    assert got["none"].ratio == 1.0 and got["zstd"].cpu_decodable


def test_bandwidth_is_probed_once_and_cached(tmp_path, monkeypatch):
    from tiered.config import load_config
    from tiered.tiers import make_tier

    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config({"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme")}]}).tiers[0]
    tier = make_tier(cfg)
    calls = []
    real = tier.probe_bandwidth
    monkeypatch.setattr(tier, "probe_bandwidth", lambda n: calls.append(n) or real(n))
    first = tier_bandwidth(cfg, tier, nbytes=4 << 20)
    assert first > 0 and calls == [4 << 20]
    assert tier_bandwidth(cfg, tier) == first and len(calls) == 1  # cached
    doc = json.loads((tmp_path / "cache" / "bandwidth.json").read_text())
    assert doc[f"local:{os.path.realpath(tmp_path / 'nvme')}"]["bytes_per_s"] == first
    pinned = load_config({"tiers": [{"name": "l", "kind": "local", "path": str(tmp_path), "bandwidth": "3GB/s"}]})
    assert tier_bandwidth(pinned.tiers[0], tier) == 3e9 and len(calls) == 1  # configured: never probed


@pytest.mark.parametrize("bandwidth, expected", [("100GB/s", "none"), ("5MB/s", "zstd")])
def test_fast_tier_codec_on_cpu_follows_the_disk(tmp_path, bandwidth, expected, caplog):
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path), "bandwidth": bandwidth}]}
    state = {"w": torch.randn(2_000_000), "b": torch.randn(300_000).to(torch.bfloat16)}
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        # Before any measurement: ans where GPU codecs exist (for GPU tensors), else zstd.
        assert engine.fast_codec == ("ans" if HAS_GPU else "zstd") and "codec: auto" in engine.describe()
        engine.save(1, state).wait()
        engine.saves.codec.join(60)
        assert engine.fast_codec == expected
        engine.save(2, state).wait()
        _, index = engine.read_index(2)
        assert {t.codec.name for t in index.tensors} == {expected}
        assert_same(state, engine.load(2))
    assert f"tier 'local' codec: {expected} for the next saves" in caplog.text


def test_a_probe_a_write_cache_fooled_is_capped_by_the_first_large_save(tmp_path, monkeypatch, caplog):
    """A 64 MiB probe can land in a write cache; a save of OBSERVE_BYTES or more shows the rate
    the disk keeps, and the policy takes the lower one (here the threshold is lowered to the
    test's size, and the tier made slow to write)."""
    import tiered.save.fast_codec as fast_codec
    from tiered.tiers.local import LocalTier

    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fast_codec, "OBSERVE_BYTES", 1 << 20)
    monkeypatch.setattr(LocalTier, "probe_bandwidth", lambda self, n: 100e9)  # what the cache showed
    real_commit = LocalTier.commit

    def slow_commit(self, step, manifest):  # the disk keeps a few MB/s
        time.sleep(1.0)
        return real_commit(self, step, manifest)

    monkeypatch.setattr(LocalTier, "commit", slow_commit)
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme")}]}
    state = {"w": torch.randn(2_000_000), "b": torch.randn(300_000).to(torch.bfloat16)}
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        engine.saves.codec.join(60)
        assert engine.fast_codec == "zstd", caplog.text
    assert "tier 'local' codec: zstd for the next saves" in caplog.text


@pytest.mark.parametrize("bandwidth, expected", [("100GB/s", "none"), ("5MB/s", "zstd")])
def test_reserve_decides_codec_auto_before_the_first_save(tmp_path, bandwidth, expected, caplog):
    """`reserve` measures the sample at start-up: the first save already uses the codec chosen,
    and nothing is measured after it (no thread beside training)."""
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path), "bandwidth": bandwidth}]}
    state = {"w": torch.randn(2_000_000), "b": torch.randn(300_000).to(torch.bfloat16)}
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        assert engine.saves.codec.pending
        engine.reserve(state)
        assert engine.wait_pinned(60)  # (reserve's work runs on a thread of its own)
        assert not engine.saves.codec.pending and engine.fast_codec == expected
        assert "codec: auto" not in engine.describe()
        engine.save(1, state).wait()
        assert engine.saves.codec._thread is None  # (a configured bandwidth: no first-save check either)
        _, index = engine.read_index(1)
        assert {t.codec.name for t in index.tensors} == {expected}
        assert_same(state, engine.load(1))
    assert f"tier 'local' codec: {expected} for the next saves" in caplog.text and "at reserve()" in caplog.text
    assert caplog.text.count("for the next saves") == 1


def test_after_reserve_a_slow_first_save_still_caps_a_probe_a_write_cache_fooled(tmp_path, monkeypatch, caplog):
    """The probe read a write cache (100 GB/s): `reserve` chooses to store as is; the first save
    of OBSERVE_BYTES or more writes at a few MB/s, and the same sample decides again: zstd."""
    import tiered.save.fast_codec as fast_codec
    from tiered.tiers.local import LocalTier

    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fast_codec, "OBSERVE_BYTES", 1 << 20)
    monkeypatch.setattr(LocalTier, "probe_bandwidth", lambda self, n: 100e9)
    real_commit = LocalTier.commit

    def slow_commit(self, step, manifest):
        time.sleep(1.0)
        return real_commit(self, step, manifest)

    monkeypatch.setattr(LocalTier, "commit", slow_commit)
    encoded: list[str] = []
    real_measure = fast_codec.measure
    monkeypatch.setattr(fast_codec, "measure", lambda sample, names, **kw: encoded.append("x") or real_measure(sample, names, **kw))
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme")}]}
    state = {"w": torch.randn(2_000_000), "b": torch.randn(300_000).to(torch.bfloat16)}
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        engine.reserve(state)
        assert engine.wait_pinned(60) and engine.fast_codec == "none", caplog.text
        engine.save(1, state).wait()
        engine.saves.codec.join(60)
        assert engine.fast_codec == "zstd", caplog.text
        engine.save(2, state).wait()
        assert {t.codec.name for t in engine.read_index(2)[1].tensors} == {"zstd"}
    assert len(encoded) == 1  # the sample was encoded once, at reserve()
    assert "below the probe's" in caplog.text


def test_migration_codec_auto_on_a_slow_portable_tier_is_zstd(tmp_path):
    cfg = {"migration": "in_process", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "l"), "codec": "none"},
        {"name": "slow", "kind": "posix", "path": str(tmp_path / "s"), "bandwidth": "5MB/s"},
        {"name": "fast", "kind": "posix", "path": str(tmp_path / "f"), "bandwidth": "1000GB/s"}]}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, {"w": torch.randn(1_000_000)}).wait()
        engine.wait_migrated(timeout=120)
        codecs = {name: {t.codec.name for t in engine.read_index(1, tier=name)[1].tensors} for name in ("slow", "fast")}
    # The slow tier recompresses; from it, keeping zstd chunks is free, so the fast tier keeps them.
    assert codecs == {"slow": {"zstd"}, "fast": {"zstd"}}


@pytest.mark.gpu
def test_auto_on_gpu_is_ans_locally_and_zstd_down(tmp_path):
    model, opt = trained_model("cuda", steps=3)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    cfg = {"migration": "in_process", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "l"), "bandwidth": "500MB/s"},
        {"name": "shared", "kind": "posix", "path": str(tmp_path / "s"), "bandwidth": "20MB/s"}]}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        engine.saves.codec.join(120)
        assert engine.fast_codec == "ans"
        engine.save(2, state).wait()
        engine.wait_migrated(timeout=300)
        gpu_float = {t.codec.name for t in engine.read_index(2)[1].tensors if t.device.startswith("cuda")
                     and t.dtype in ("float32", "bfloat16")}
        shared = {t.codec.name for t in engine.read_index(2, tier="shared")[1].tensors if t.chunks}
        assert gpu_float == {"ans"} and shared == {"zstd"}
        assert_same({k: v.cpu() for k, v in state["model"].items()},
                    dict(engine.load(2, tier="shared", device="cpu")["model"]))


@pytest.mark.gpu
def test_codec_auto_on_gpu_takes_the_save_codecs_rate_from_the_save_and_little_memory(tmp_path, caplog):
    """Beside training the measurement takes no full batch of memory: the save codec's throughput
    is the first save's own (timed on the GPU), the rest come from the sample as one batch."""
    model, opt = trained_model("cuda", steps=3)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "l"), "bandwidth": "2GB/s"}]}
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        engine.saves.codec.join(120)
        assert engine.fast_codec == "ans"
        device = engine.saves.workers.device(torch.cuda.current_device())
        clock = device.clock_next_stage()
        engine.save(2, state).wait()
        rates = clock.rates()
        assert set(rates) == {"ans"} and rates["ans"] > 1e8, rates  # its waves timed on the GPU

        sample = Sample()
        for t in list(state["model"].values())[:4]:
            sample.add(t.dtype, t.reshape(-1).view(torch.uint8)[:1 << 20].clone())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stream = torch.cuda.Stream()
        got = {s.name: s for s in measure(sample, ["ans", "zstd", "none"], pool=engine.saves.workers.pool,
                                          settings=ZstdSettings(), gpu=GpuRecoder(device), slots=4, stream=stream,
                                          rates={"ans": 5e10})}
        # the sample (4 MiB) as one batch: its copy, pack and slab, not batch_chunks of them
        assert torch.cuda.max_memory_allocated() - base < 32 << 20
        assert got["ans"].throughput == pytest.approx(5e10) and got["ans"].ratio < 1
        assert 0 < got["zstd"].ratio < 1 and got["none"].ratio == pytest.approx(1, abs=0.02)
    assert "measuring failed" not in caplog.text


@pytest.mark.gpu
def test_reserve_on_gpu_measures_a_full_batch_and_gives_its_memory_back(tmp_path, caplog):
    """On a GPU with room, `reserve` measures every codec at a full batch at start-up and gives
    that memory back to training's allocator; the first save is ANS and measures nothing."""
    model, opt = trained_model("cuda", steps=3)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "l"), "bandwidth": "2GB/s"}]}
    with caplog.at_level(logging.INFO, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        device = engine.saves.workers.device(torch.cuda.current_device())
        device.wait_warm()
        leaves = tree.flatten(state)[1]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        engine.saves.codec.at_reserve(make_plan(leaves, "ans", engine.config.chunk_size, True))  # what reserve() calls
        assert not engine.saves.codec.pending and engine.fast_codec == "ans", caplog.text
        # the full batch was measured (2 x 256 MiB on a stream of its own), and none of it is left cached
        assert torch.cuda.memory_reserved() - before < 64 << 20
        assert "ans" in caplog.text and "zstd" in caplog.text
        engine.reserve(state)  # (decided: measures nothing again)
        engine.save(1, state).wait()
        assert engine.saves.codec._thread is None
        assert {t.codec.name for t in engine.read_index(1)[1].tensors if t.device.startswith("cuda")} == {"ans"}
        assert_same({k: v.cpu() for k, v in state["model"].items()}, dict(engine.load(1, device="cpu")["model"]))
    assert caplog.text.count("at reserve()") == 1 and "measuring failed" not in caplog.text


@pytest.mark.gpu
def test_a_host_late_to_queue_the_timed_encode_does_not_slow_the_measured_rate(tmp_path, monkeypatch, caplog):
    """Launches held up on the host (behind a registration of pinned memory, as while `reserve`
    pins) must not land in the encode's timed window: a codec once measured 150x slow there, and
    `codec: auto` stored the run's saves uncompressed."""
    import tiered.gpu.waves as waves
    from tiered.codecs import get_codec_class

    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "l")}]}
    with tiered.Engine.from_config(cfg) as engine:
        device = engine.saves.workers.device(torch.cuda.current_device())
        chunks = [torch.randn(1 << 18, device="cuda").view(torch.uint8) for _ in range(4)]
        spec = get_codec_class("ans").spec_for(torch.float32)
        recoder = GpuRecoder(device)
        alone, _ = recoder.measure_encode(chunks, spec, slots=len(chunks))  # (timed as is: not scaled from a batch)
        real, calls = waves.encode_slots, []

        def late(*args, **kwargs):  # the timed call's launches held 0.3 s on the host (the warm-up's are not)
            calls.append(kwargs.get("packed", False))
            if kwargs.get("packed"):
                time.sleep(0.3)
            return real(*args, **kwargs)

        monkeypatch.setattr(waves, "encode_slots", late)
        with caplog.at_level(logging.INFO, logger="tiered"):
            held, _ = recoder.measure_encode(chunks, spec, slots=len(chunks))
    assert calls.count(True) > 1  # timed again, with a longer wait, until the host was ahead
    assert held < 0.05, (held, alone)  # 4 MiB of ANS, not the 0.3 s the host took to queue it
    assert "host late" not in caplog.text
