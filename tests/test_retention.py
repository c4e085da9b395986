"""Retention bounds every tier, the last (or only) one too, with real directories: the oldest
steps beyond `keep_last` / `keep_every` go, never the newest, never one a restore or a migration
is reading; the engine and `tiered gc` apply the same rule and say what they deleted and why.
And two tiers on one storage are refused at load time."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import tiered
from tiered.cli import main
from tiered.tiers.leases import LEASE_DIR, hold, held_steps
from tiered.tiers.retention import apply_retention


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=g), "step": step}


def _one_tier(tmp_path, **rules) -> dict:
    return {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "zstd", **rules}]}


def test_one_tier_keeps_its_newest_keep_last_steps(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tiered")
    with tiered.Engine.from_config(_one_tier(tmp_path, keep_last=2)) as engine:
        for step in range(1, 6):
            engine.save(step, _state(step)).wait()
            assert len(engine.steps()) <= 2
        assert engine.steps() == [4, 5]
        for step in (4, 5):
            assert torch.equal(engine.load(step)["w"], _state(step)["w"])
    assert "deleted step 3 from tier 'local' (beyond this tier's rules; the last tier)" in caplog.text
    on_disk = sorted(p.name for p in (tmp_path / "nvme").iterdir() if p.name.startswith("step_"))
    assert on_disk == ["step_000000000004", "step_000000000005"]


def test_keep_every_keeps_milestones_and_the_newest_step(tmp_path):
    with tiered.Engine.from_config(_one_tier(tmp_path, keep_last=1, keep_every=4)) as engine:
        for step in range(1, 11):
            engine.save(step, _state(step)).wait()
        assert engine.steps() == [4, 8, 10]


def test_a_step_being_restored_is_not_deleted_by_retention(tmp_path):
    cfg = _one_tier(tmp_path, keep_last=1)
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, _state(1)).wait()
        engine.save(2, _state(2)).wait()
        assert engine.steps() == [2]
        tier = engine.catalog.get("local")
        with hold([tier], 2):  # as Restorer.load holds what it reads
            engine.save(3, _state(3)).wait()
            assert engine.steps() == [2, 3]  # 2 is beyond keep_last, but read
        engine.save(4, _state(4)).wait()
        assert engine.steps() == [4]


def test_a_lease_of_another_live_process_protects_the_step_and_a_dead_ones_does_not(tmp_path):
    """Retention in one process (a migrator's child, `tiered gc`) honours a restore in another."""
    cfg = _one_tier(tmp_path, keep_last=1)
    with tiered.Engine.from_config(cfg) as engine:
        for step in (1, 2):
            engine.save(step, _state(step)).wait()
        engine.save(3, _state(3)).wait()
        assert engine.steps() == [3]
        engine.save(4, _state(4)).wait()
        tier = engine.catalog.get("local")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tiered.tiers.local import LocalTier; "
         "from tiered.tiers.leases import hold\n"
         f"with hold([LocalTier('local', {str(tmp_path / 'nvme')!r})], 4):\n"
         "    print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert held_steps(tier) == {4}
        with tiered.Engine.from_config(cfg) as engine:
            engine.save(5, _state(5)).wait()
            assert engine.steps() == [4, 5]  # 4 is read by the other process
    finally:
        holder.kill()
        holder.wait()
    leases = list((tmp_path / "nvme" / LEASE_DIR).iterdir())
    assert len(leases) == 1  # the killed process left its lease
    assert held_steps(tier) == set() and not list((tmp_path / "nvme" / LEASE_DIR).iterdir())  # stale: removed
    deleted = apply_retention(tiered.load_config(cfg), lambda name: tier)
    assert deleted == {"local": {4: "beyond this tier's rules; the last tier"}}
    assert tier.steps() == [5]


def test_holding_a_step_of_an_s3_tier_writes_nothing_on_this_machine(tmp_path, monkeypatch):
    class S3Like:  # (an S3 tier's root names its bucket)
        root, bucket, prefix = "s3://bucket/run-1", "bucket", "run-1"

    monkeypatch.chdir(tmp_path)
    tier = S3Like()
    with hold([tier], 7):
        assert held_steps(tier) == {7}
    assert held_steps(tier) == set() and list(tmp_path.iterdir()) == []


def test_tiered_gc_applies_the_rule_to_the_only_tier_and_says_why(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    import yaml
    path.write_text(yaml.safe_dump(_one_tier(tmp_path)))
    with tiered.Engine.from_config(str(path)) as engine:
        for step in range(1, 5):
            engine.save(step, _state(step)).wait()
    path.write_text(yaml.safe_dump(_one_tier(tmp_path, keep_last=2)))  # the rule tightened afterwards
    assert main(["gc", "-q", "-c", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tier 'local' (keep_last 2): would delete 1, 2" in out and "step 1: beyond this tier's rules" in out
    assert main(["gc", "-q", "-c", str(path)]) == 0
    assert "deleted 1, 2" in capsys.readouterr().out
    with tiered.Engine.from_config(str(path)) as engine:
        assert engine.steps() == [3, 4]


def test_upper_tier_steps_every_tier_below_let_go_do_not_stay_for_ever(tmp_path):
    cfg = {"migration": "in_process", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "zstd", "keep_last": 2},
        {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd", "keep_last": 1}]}
    with tiered.Engine.from_config(cfg) as engine:
        for step in range(1, 7):
            engine.save(step, _state(step)).wait()
            engine.wait_migrated(60)
        assert engine.steps("shared") == [6]
        assert engine.steps("local") == [5, 6]


@pytest.mark.parametrize("second, why", [
    ({"kind": "posix", "path": "{root}/nvme"}, "both use {root}/nvme"),
    ({"kind": "posix", "path": "{root}/nvme/../nvme"}, "both use {root}/nvme"),
    ({"kind": "posix", "path": "{root}/nvme/shared"}, "{root}/nvme/shared lies inside {root}/nvme"),
    ({"kind": "posix", "path": "{root}/link"}, "both use {root}/nvme"),
    ({"kind": "posix", "path": "{root}"}, "{root}/nvme lies inside {root}"),
])
def test_two_tiers_on_one_directory_are_refused(tmp_path, second, why):
    root = os.path.realpath(tmp_path)
    (tmp_path / "nvme").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "nvme")
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"), "keep_last": 1},
                     {"name": "shared", **{k: v.format(root=root) for k, v in second.items()}}]}
    with pytest.raises(tiered.ConfigError, match="share one storage") as err:
        tiered.load_config(cfg)
    assert "tiers[1] ('shared') and tiers[0] ('local')" in str(err.value)
    assert why.format(root=root) in str(err.value)


def test_siblings_and_similar_names_are_not_refused(tmp_path):
    tiered.load_config({"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "ckpt")},
                                  {"name": "shared", "kind": "posix", "path": str(tmp_path / "ckpt-shared")},
                                  {"name": "s3a", "kind": "s3", "bucket": "b", "prefix": "run1"},
                                  {"name": "s3b", "kind": "s3", "bucket": "b", "prefix": "run10"},
                                  {"name": "s3c", "kind": "s3", "bucket": "b", "prefix": "run1",
                                   "endpoint_url": "http://127.0.0.1:9000"}]})


@pytest.mark.parametrize("a, b, why", [
    (dict(bucket="b", prefix="run1"), dict(bucket="b", prefix="run1/"), "both use s3://b/run1"),
    (dict(bucket="b", prefix="run1"), dict(bucket="b", prefix="run1/x"), "s3://b/run1/x lies inside s3://b/run1"),
    (dict(bucket="b"), dict(bucket="b", prefix="p"), "s3://b/p lies inside s3://b/"),
    (dict(bucket="b", endpoint_url="http://127.0.0.1:9000/"), dict(bucket="b", endpoint_url="http://127.0.0.1:9000"),
     "both use s3://b/ at http://127.0.0.1:9000"),
])
def test_two_s3_tiers_with_overlapping_prefixes_are_refused(tmp_path, a, b, why):
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme")},
                     {"name": "one", "kind": "s3", **a}, {"name": "two", "kind": "s3", **b}]}
    with pytest.raises(tiered.ConfigError, match="share one storage") as err:
        tiered.load_config(cfg)
    assert "tiers[2] ('two') and tiers[1] ('one')" in str(err.value) and why in str(err.value)


def test_the_user_case_same_directory_for_local_and_shared_is_refused_before_anything_is_lost(tmp_path):
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "ckpt"), "keep_last": 1},
                     {"name": "shared", "kind": "posix", "path": str(tmp_path / "ckpt")}]}
    with pytest.raises(tiered.ConfigError):
        tiered.Engine.from_config(cfg)
    time.sleep(0)  # nothing was started


SOAK_SAVES = int(os.environ.get("TIERED_RETENTION_SOAK", "40"))


def test_soak_a_loop_saving_every_step_never_fills_a_tier_sized_for_a_few(small_fs):
    """Saves every step, without waiting for each, into a real 24 MiB filesystem that holds four
    steps: keep_last 3 keeps it from filling, no committed step within the rule is lost, and every
    kept step restores bit-exact. `TIERED_RETENTION_SOAK=1000` is the soak run (docs/reliability.md)."""
    cfg = {"chunk_size": "1MiB", "budgets": {"host_buffer": "16MiB"}, "on_save_failure": "raise",
           "tiers": [{"name": "local", "kind": "local", "path": str(small_fs / "nvme"), "codec": "none", "keep_last": 3}]}

    def big(step: int) -> dict:  # 5 MiB stored as is: four steps fit in 24 MiB, five do not
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(5 << 18, generator=g), "step": step}

    with tiered.Engine.from_config(cfg) as engine:
        most = 0
        for step in range(1, SOAK_SAVES + 1):
            engine.save(step, big(step))  # a failed save would raise here (on_save_failure: raise)
            most = max(most, shutil.disk_usage(small_fs).used)
            # (a listing beside the writer is not a snapshot: it may see a step gone and miss the
            # one just committed; so the kept steps are checked once the saves are durable)
            assert len(engine.steps()) <= 4
            if step % 25 == 0 or step == SOAK_SAVES:
                engine.wait()
                assert engine.steps() == [s for s in range(step - 2, step + 1) if s > 0], step
                for kept in engine.steps():
                    assert torch.equal(engine.load(kept)["w"], big(kept)["w"]), kept
        assert most <= 4 * (5 << 20) + (1 << 20), most
        print(f"retention soak: {SOAK_SAVES} saves, at most {most / 2**20:.1f} MiB of 24 MiB used, "
              f"kept {engine.steps()}, each restored bit-exact")


def test_an_s3_last_tier_is_bounded_by_its_rules_on_a_real_server(tmp_path, s3_server, s3_bucket, capsys):
    """keep_last on the S3 tier (the last one) deletes its oldest steps there too; the local tier
    lets a step go once S3 holds it."""
    import yaml

    cfg = {"migration": "in_process", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "zstd", "keep_last": 1},
        {"name": "s3", "kind": "s3", "bucket": s3_bucket, "prefix": "run", "endpoint_url": s3_server.endpoint_url,
         "region": "us-east-1", "codec": "zstd", "keep_last": 2}]}
    with tiered.Engine.from_config(cfg) as engine:
        for step in range(1, 6):
            engine.save(step, _state(step)).wait()
            engine.wait_migrated(120)
        assert engine.steps("s3") == [4, 5] and engine.steps("local") == [5]
        assert torch.equal(engine.load(4)["w"], _state(4)["w"])  # from S3
    path = tmp_path / "t.yaml"
    cfg["tiers"][1]["keep_last"] = 1
    path.write_text(yaml.safe_dump(cfg))
    assert main(["gc", "-q", "-c", str(path)]) == 0
    assert "tier 's3' (keep_last 1): deleted 4" in capsys.readouterr().out
