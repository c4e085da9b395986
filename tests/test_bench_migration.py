"""The scale bench's `migration` row (scripts/scale_migration.py):
training windows while a step migrates to a shared tier against windows with the migrator idle,
a save's stall in each, and each step's time to the shared tier, run end to end on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import cpu_scale_bench

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("row", ["migration", "migration:in_process"])
def test_the_migration_row_measures_training_beside_the_migrator_and_cleans_up(tmp_path, row):
    root = tmp_path / "bench"
    # The default mode's row with its shared tier elsewhere (`--shared-dir`), the thread's under --dir.
    shared = tmp_path / "elsewhere" / "shared"
    elsewhere = ["--shared-dir", str(shared)] if row == "migration" else []
    size, printed = cpu_scale_bench(tmp_path, "--saves", "3", "--methods", row, *elsewhere)
    [got] = size["rows"]
    assert got["name"] == row and got["error"] is None, got["error"]
    m = got["migration"]
    assert m["mode"] == ("in_process" if row.endswith("in_process") else "process")
    assert m["window_ms"]["idle"]["n"] >= 3 and len(m["windows_ms"]["idle"]) == m["window_ms"]["idle"]["n"]
    assert [s["stall_ms"] is not None for s in got["saves"]] == [True, True], "the first save, then one idle"
    assert set(m["stall_ms"]) >= {"first", "idle", "migrating", "migrating_vs_idle", "migrating_through_window"}
    assert all(s >= 0 for s in m["to_shared_s"]) and len(m["to_shared_s"]) == 2
    assert sorted(m["migrate_s"]) == ["1", "2", "3"] and all(v > 0 for v in m["migrate_s"].values()), m["migrate_s"]
    assert m["migrate_gbps"] > 0
    assert m["shared_codecs"] == ["zstd"] and m["stored_bytes_shared"] > 0
    assert got["restore_s"] is None, "no restore: the row is not one of the bit-exact checks"
    assert f"{row} (" in printed and "while a step migrates" in printed, printed[-2000:]
    assert not root.exists(), "both tiers deleted with the bench's root"
    assert not shared.exists(), "a shared tier elsewhere deleted with the row"
    if elsewhere:
        assert str(shared) in got["migration"]["shared_root"]


def test_the_migration_row_refuses_disks_that_cannot_hold_its_steps(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        from scale_migration import check_room
    finally:
        sys.path.remove(str(SCRIPTS))
    local, shared = tmp_path / "local", tmp_path / "shared"
    local.mkdir(), shared.mkdir()
    check_room(local, shared, 1 << 20)  # (a MiB a step fits)
    with pytest.raises(RuntimeError, match=r"needs .* GB free at .*local.*\(--shared-dir\) or run a smaller --scale"):
        check_room(local, shared, 1 << 60)


def test_the_migration_row_names_a_mode_it_does_not_know():
    sys.path.insert(0, str(SCRIPTS))
    try:
        from scale_methods import row_spec
    finally:
        sys.path.remove(str(SCRIPTS))
    assert row_spec("migration")[0] == "migration"
    with pytest.raises(ValueError, match="migration:external: expected one of process, in_process"):
        row_spec("migration:external")
