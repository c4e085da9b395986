"""Restore falls back, per chunk, to a slower tier when a chunk is damaged or a file is missing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from helpers import assert_same, mixed_state, zeros_like_state

import tiered


def two_tiers(tmp_path: Path, fast_codec: str) -> dict:
    return {"migration": "in_process", "chunk_size": "64KiB", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "local"), "codec": fast_codec},
        {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd"}]}


def flip(path: Path, offsets) -> None:
    raw = bytearray(path.read_bytes())
    for o in offsets:
        raw[o] ^= 0xA5
    path.write_bytes(bytes(raw))


def saved(tmp_path, device: str, step: int = 5):
    codec = "ans" if device == "cuda" else "zstd"
    cfg = two_tiers(tmp_path, codec)
    state = mixed_state(device, seed=3)
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(step, state).wait()
        engine.wait_migrated(timeout=300)
        _, index = engine.read_index(step)
    return cfg, state, index


def test_damaged_chunks_are_read_from_the_slower_tier(tmp_path, device, caplog):
    cfg, state, index = saved(tmp_path, device)
    big = max(index.tensors, key=lambda t: len(t.chunks))
    assert len(big.chunks) >= 3
    data = tmp_path / "local" / "step_000000000005" / index.data_file
    flip(data, [big.chunks[0].offset + 7, big.chunks[2].offset + 1])
    target = zeros_like_state(state)
    with caplog.at_level(logging.WARNING, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        assert engine.restore(target) == 5
    assert_same(state, target)
    text = caplog.text
    assert f"read tensor {big.name!r} chunk 0 from tier 'shared' instead" in text
    assert f"read tensor {big.name!r} chunk 2 from tier 'shared' instead" in text
    assert "2 chunks of tier 'local' were damaged or missing; read instead from tier 'shared' (2 chunks)" in text


def test_missing_data_file_is_read_from_the_slower_tier(tmp_path, device, caplog):
    cfg, state, index = saved(tmp_path, device)
    (tmp_path / "local" / "step_000000000005" / index.data_file).unlink()
    with caplog.at_level(logging.WARNING, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        assert_same(state, engine.load(5))
    assert "reading every chunk from the slower tiers" in caplog.text


def test_unreadable_index_skips_to_the_slower_tier(tmp_path, caplog):
    cfg, state, index = saved(tmp_path, "cpu")
    (tmp_path / "local" / "step_000000000005" / "rank_00000.index.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        assert_same(state, engine.load())
    assert "cannot open it on tier 'local'" in caplog.text and "reading tier 'shared' instead" in caplog.text


def test_damage_on_every_tier_is_an_error_naming_them(tmp_path):
    cfg, state, index = saved(tmp_path, "cpu")
    rec = max(index.tensors, key=lambda t: len(t.chunks))
    flip(tmp_path / "local" / "step_000000000005" / index.data_file, [rec.chunks[1].offset + 3])
    with tiered.Engine.from_config(cfg) as engine:
        _, shared_index = engine.read_index(5, tier="shared")
        other = next(t for t in shared_index.tensors if t.name == rec.name)
        flip(tmp_path / "shared" / "step_000000000005" / shared_index.data_file, [other.chunks[1].offset + 3])
        with pytest.raises(tiered.CorruptionError, match=r"chunk 1 .*no slower tier holds a good copy of it "
                                                         r"\(tried: shared \(.*/shared/step_000000000005/"
                                                         r"rank_00000.data: .*corrupted"):
            engine.load(5)


def test_naming_a_tier_reads_it_and_falls_back_only_downwards(tmp_path):
    cfg, state, index = saved(tmp_path, "cpu")
    with tiered.Engine.from_config(cfg) as engine:
        engine.get_tier("local").delete(5)
        with pytest.raises(tiered.CheckpointNotFoundError, match="step 5 is not committed in tier 'local'"):
            engine.load(5, tier="local")
        assert_same(state, engine.load(5))               # the fastest tier holding it: shared
        assert_same(state, engine.load(tier="shared"))
        assert engine.latest_step() == 5 and engine.steps() == [5] and engine.steps("local") == []


def test_retention_evicts_from_the_fast_tier_once_the_slower_tier_has_it(tmp_path):
    cfg = two_tiers(tmp_path, "zstd")
    cfg["tiers"][0]["keep_last"] = 2
    w = {"w": torch.randn(10_000)}
    with tiered.Engine.from_config(cfg) as engine:
        for step in (1, 2, 3, 4):
            engine.save(step, w).wait()
        engine.wait_migrated(timeout=120)
        assert engine.steps("local") == [3, 4] and engine.steps("shared") == [1, 2, 3, 4]
        assert torch.equal(engine.load(1)["w"], w["w"])


def test_the_last_tier_is_bounded_by_its_rules_too(tmp_path):
    cfg = two_tiers(tmp_path, "zstd")
    cfg["tiers"][0]["keep_last"] = 2
    cfg["tiers"][1]["keep_last"] = 3
    w = {"w": torch.randn(10_000)}
    with tiered.Engine.from_config(cfg) as engine:
        for step in range(1, 7):
            engine.save(step, w).wait()
            engine.wait_migrated(timeout=120)
        assert engine.steps("local") == [5, 6] and engine.steps("shared") == [4, 5, 6]
        assert torch.equal(engine.load(4)["w"], w["w"])


def test_gpu_only_codec_without_a_gpu_reads_those_tensors_from_a_portable_tier(tmp_path, caplog):
    """A fast-tier copy in ans (as a GPU node writes it), read where nvCOMP is absent: the ans
    tensors come from the slower, portable tier. The ans copy is simulated by relabelling one
    zstd tensor's codec in the local index (its bytes are never decoded here)."""
    import dataclasses

    from tiered.format import checksum
    from tiered.format.manifest import CodecSpec, read_step

    if tiered.gpu.runtime.gpu_stack_available():
        pytest.skip("GPU codecs are present here: ans decodes on the GPU")
    cfg, state, _ = saved(tmp_path, "cpu")
    step_dir = tmp_path / "local" / "step_000000000005"
    with tiered.Engine.from_config(cfg) as engine:
        manifest, (idx,) = read_step(engine.get_tier("local"), 5)
    big = max(idx.tensors, key=lambda t: len(t.chunks))
    relabelled = dataclasses.replace(big, codec=CodecSpec.of("ans", data_type="<f4"))
    raw = dataclasses.replace(idx, tensors=tuple(relabelled if t is big else t for t in idx.tensors)).to_json()
    (step_dir / "rank_00000.index.json").write_bytes(raw)
    entry = dataclasses.replace(manifest.ranks[0], index_bytes=len(raw), index_checksum=checksum.wsum64(raw))
    (step_dir / "MANIFEST.json").write_bytes(dataclasses.replace(manifest, ranks=(entry,)).to_json())
    local_only = {"tiers": [cfg["tiers"][0]], "chunk_size": cfg["chunk_size"]}
    with tiered.Engine.from_config(local_only) as engine:
        with pytest.raises(tiered.CodecUnavailableError, match="needs an NVIDIA GPU"):
            engine.load(5)
    with caplog.at_level(logging.WARNING, logger="tiered"), tiered.Engine.from_config(cfg) as engine:
        assert_same(state, engine.load(5))  # local first; its ans tensor from shared
    assert f"stores {big.name!r} with ans, which needs a GPU to decode" in caplog.text
    assert f"ans needs a GPU to decode; read tensor {big.name!r} chunk 0 from tier 'shared' instead" in caplog.text
