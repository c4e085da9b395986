"""The memory tier: host RAM (a real tmpfs) above local NVMe or alone, bounded by retention and by
a size budget, refusing a path that is not memory-backed unless told."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same, mixed_state

import tiered
from tiered.errors import ConfigError


def state(step: int, mib: int = 1) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib * 256 * 1024, generator=g), "step": step}  # incompressible with codec none


def memory(path, **extra) -> dict:
    return {"name": "mem", "kind": "memory", "path": str(path), "codec": "none", **extra}


def test_a_memory_tier_saves_and_restores_and_says_where_it_is(small_fs, device):
    want = mixed_state(device, seed=1)
    with tiered.Engine.from_config({"tiers": [memory(small_fs / "mem", codec="auto")]}) as engine:
        engine.save(1, want).wait()
        tier = engine.get_tier("mem")
        assert type(tier).__name__ == "MemoryTier" and tier.filesystem == "tmpfs"
        assert tier.size == (24 << 20) // 2, "no size given: half of the filesystem"
        assert_same(want, engine.load(1, device=device))


def test_a_path_that_is_not_memory_is_refused_unless_told(tmp_path):
    from tiered.tiers.memory import filesystem_of

    if filesystem_of(tmp_path)[0] in ("tmpfs", "ramfs"):
        pytest.skip("this machine's temporary directory is in memory")
    with pytest.raises(ConfigError, match=r"not host memory \(tmpfs, ramfs\).*memory_only: false"):
        tiered.Engine.from_config({"tiers": [memory(tmp_path / "mem")]})
    with tiered.Engine.from_config({"tiers": [memory(tmp_path / "mem", memory_only=False, size="8MiB")]}) as engine:
        engine.save(1, state(1)).wait()
        assert engine.steps() == [1]


@pytest.mark.parametrize("bad, said", [
    ({"tiers": [{"name": "nvme", "kind": "local", "path": "/tmp/x"}, {"name": "mem", "kind": "memory"}]},
     "tiers[1].kind: a memory tier can only be the first tier"),
    ({"tiers": [{"name": "mem", "kind": "memory", "size": "4KiB"}]}, "tiers[0].size: must be at least 1MiB"),
])
def test_memory_tier_config_errors_name_the_field(bad, said):
    with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("]", r"\]")):
        tiered.Engine.from_config(bad)


def test_a_memory_filesystem_without_a_size_needs_one_given(ramfs):
    with pytest.raises(ConfigError, match="ramfs, which has no size of its own: give the tier a size"):
        tiered.Engine.from_config({"tiers": [memory(ramfs / "mem")]})
    with tiered.Engine.from_config({"tiers": [memory(ramfs / "mem", size="4MiB")]}) as engine:
        engine.save(1, state(1)).wait()
        assert torch.equal(engine.load(1)["w"], state(1)["w"])


def test_the_size_budget_makes_room_from_steps_a_slower_tier_holds(small_fs, tmp_path, caplog):
    """A 3.5 MiB budget and 1 MiB steps above a shared tier (a step is taken to need its raw bytes,
    their padding and 1 MiB, so two fit and a third needs room): each save fits by deleting the
    oldest steps the shared tier holds; every step restores bit-exact from one tier or the other."""
    import logging

    caplog.set_level(logging.INFO, logger="tiered")
    cfg = {"chunk_size": "1MiB", "migration": "in_process", "tiers": [
        memory(small_fs / "mem", size="3584KiB"),
        {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd"}]}
    with tiered.Engine.from_config(cfg) as engine:
        for step in range(1, 7):
            engine.save(step, state(step)).wait()
            engine.wait_migrated(timeout=60)
            assert engine.get_tier("mem").used_bytes() <= 3584 << 10
        assert engine.steps("shared") == [1, 2, 3, 4, 5, 6] and len(engine.steps("mem")) < 6
        assert engine.steps("mem")[-1] == 6
        for step in range(1, 7):
            assert torch.equal(engine.load(step)["w"], state(step)["w"])
    assert "from tier 'mem': its size budget (3.67 MB) needed" in caplog.text, caplog.text


@pytest.mark.parametrize("mode", ["fail", "next_tier"])
def test_a_full_memory_tier_with_nothing_below_to_make_room_fails_the_save_or_passes_it_on(small_fs, tmp_path, mode):
    cfg = {"chunk_size": "1MiB", "migration": "external", "on_fast_tier_error": mode, "on_save_failure": "raise",
           "tiers": [memory(small_fs / "mem", size="3584KiB"),
                     {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd"}]}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state(1)).wait()
        engine.save(2, state(2)).wait()  # (two steps fit; a third, taken to need 2.1 MB, does not)
        if mode == "fail":
            with pytest.raises(tiered.TieredError, match=r"tier 'mem' .* holds .* of its 3.67 MB.*can make room"):
                engine.save(3, state(3)).wait()
            assert engine.steps() == [1, 2]
        else:
            handle = engine.save(3, state(3))
            handle.wait()
            assert handle.tier == "shared" and engine.steps("shared") == [3]
        assert not list((small_fs / "mem").glob(".step_*"))


def test_memory_above_nvme_above_shared_migrates_down_and_restores_when_ram_is_gone(small_fs, tmp_path):
    """memory -> local -> shared: every step reaches the slower tiers; with the memory tier wiped
    (the node rebooted), the newest step restores from local NVMe, bit-exact."""
    import shutil

    cfg = {"chunk_size": "1MiB", "migration": "in_process", "tiers": [
        memory(small_fs / "mem", keep_last=1),
        {"name": "nvme", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "none", "keep_last": 2},
        {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd"}]}
    with tiered.Engine.from_config(cfg) as engine:
        for step in (1, 2, 3):
            engine.save(step, state(step)).wait()
        engine.wait_migrated(timeout=60)
        assert engine.steps("mem") == [3] and engine.steps("nvme") == [2, 3] and engine.steps("shared") == [1, 2, 3]
    shutil.rmtree(small_fs / "mem")
    with tiered.Engine.from_config(cfg) as engine:
        assert engine.steps("mem") == [] and engine.latest_step() == 3
        assert torch.equal(engine.load()["w"], state(3)["w"])
