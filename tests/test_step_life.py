"""A step's life under races, repairs and hostile files: one writer per step (local, POSIX, S3),
concurrent restores, files that are not what they claim, the debris of killed processes, and
states or configs that must be refused before anything is written. Concurrency is real processes
(tests/race_worker.py) racing over one tier."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import assert_same, mixed_state

import tiered
from tiered.cli import main, restore_main
from tiered.errors import ConfigError, FormatError, StateDictError

HERE = Path(__file__).parent


def env() -> dict:
    """The environment of a child process (read when it starts: the S3 fixture sets its keys)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}


def write_config(path: Path, tiers: list[dict], **extra) -> Path:
    path.write_text(yaml.safe_dump({"migration": "external", "chunk_size": "64KiB", **extra, "tiers": tiers}))
    return path


def local(tmp_path: Path, name: str = "local", kind: str = "local", **extra) -> dict:
    return {"name": name, "kind": kind, "path": str(tmp_path / name), "codec": "zstd", **extra}


def race(tmp_path: Path, commands: list[list[str]], timeout: float = 300) -> list[dict]:
    """Start every racer, let them all go at once, and return what each printed."""
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(HERE / "race_worker.py"), *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env()) for c in commands]
    deadline = time.monotonic() + timeout
    while len(list(tmp_path.glob("go.*.ready"))) < len(procs):  # (files that stay once made)
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, dead[0].stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the racers did not start"
        time.sleep(0.02)
    go.touch()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


# --- one writer per step ------------------------------------------------------------------
def test_two_engines_saving_the_same_steps_one_wins_each_and_the_other_is_told(tmp_path):
    """Two engines started together save steps 1-5 with different data into one directory: each
    step is committed by exactly one of them, holds that writer's state whole, and the other's
    save of it fails saying the step is committed."""
    config = write_config(tmp_path / "c.yaml", [local(tmp_path)], max_failed_saves=100)
    a, b = race(tmp_path, [["save", str(config), "a", "1,2,3,4,5", str(tmp_path / "go")],
                           ["save", str(config), "b", "1,2,3,4,5", str(tmp_path / "go")]])
    with tiered.Engine.from_config(config) as engine:
        assert engine.steps() == [1, 2, 3, 4, 5]
        for step in range(1, 6):
            results = {"a": a[str(step)], "b": b[str(step)]}
            winners = [w for w, r in results.items() if r == "ok"]
            assert len(winners) == 1, results
            loser = results["b" if winners == ["a"] else "a"]
            assert "committed" in loser, loser
            got = engine.load(step)
            assert got["writer"] == winners[0]
            assert_same({k: got[k] for k in ("w", "b")}, _state(winners[0], step))
    assert not list((tmp_path / "local").glob(".step_*"))  # the losers' copies were removed


def _state(writer: str, step: int) -> dict:
    sys.path.insert(0, str(HERE))
    from race_worker import state_of

    s = state_of(writer, step)
    return {"w": s["w"], "b": s["b"]}


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_two_processes_writing_the_same_steps_to_a_tier_one_wins_each(tmp_path, kind, request):
    """Two processes write steps 1-5 into one shared directory or S3 prefix as migrations do. A
    filesystem commits by a rename that never replaces; S3 puts the manifest with If-None-Match: *,
    each writer's files in a folder of its own. Each step: one winner, its files only; the other
    told the step is committed."""
    if kind == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        spec = {"kind": "s3", "bucket": bucket, "prefix": "race", "endpoint_url": server.endpoint_url}
    else:
        spec = {"kind": "posix", "path": str(tmp_path / "shared")}
    a, b = race(tmp_path, [["tier", json.dumps(spec), "a", "1,2,3,4,5", str(tmp_path / "go")],
                           ["tier", json.dumps(spec), "b", "1,2,3,4,5", str(tmp_path / "go")]])
    sys.path.insert(0, str(HERE))
    from race_worker import tier_of

    tier = tier_of(json.dumps(spec))
    assert tier.steps() == [1, 2, 3, 4, 5], (a, b)
    for step in range(1, 6):
        results = {"a": a[str(step)], "b": b[str(step)]}
        winners = [w for w, r in results.items() if r == "ok"]
        assert len(winners) == 1, results
        assert "committed" in results["b" if winners == ["a"] else "a"], results
        assert json.loads(tier.read_manifest(step))["writer"] == winners[0]
        assert tier.read_file(step, "rank_00000.index.json", 100) == winners[0].encode()
        reader = tier.open_data_reader(step, "rank_00000.data", device=False)
        assert bytes(reader.read_host(0, 4096)) == winners[0].encode() * 4096
        reader.close()
    assert tier.reclaim_debris() == []  # the losers removed their own files


def test_concurrent_restores_of_one_step_copy_it_once_and_none_sees_half_a_copy(tmp_path):
    config = write_config(tmp_path / "c.yaml", [local(tmp_path), local(tmp_path, "shared", "posix")])
    state = mixed_state("cpu", seed=4)
    with tiered.Engine.from_config(config) as engine:
        engine.save(8, state).wait()
    assert main(["migrate", "--config", str(config), "-q"]) == 0
    import shutil

    shutil.rmtree(tmp_path / "local")
    cmd = [sys.executable, "-m", "tiered.cli", "restore", "--config", str(config), "--step", "8", "-q"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1][-2000:] for o in outs]
    said = "".join(o[0] for o in outs)
    assert said.count("restored step 8 from tier 'shared'") + said.count("step 8 is on tier 'local'") == 4, said
    assert main(["verify", "--config", str(config), "--tier", "local", "-q"]) == 0
    with tiered.Engine.from_config(config) as engine:
        assert_same(state, engine.load(8, tier="local"))
    assert not list((tmp_path / "local").glob(".step_*"))


# --- repair, never destroy ----------------------------------------------------------------
def test_restore_falls_back_past_a_source_whose_index_is_damaged_and_copies_from_the_one_named(tmp_path, capsys):
    tiers = [local(tmp_path), local(tmp_path, "shared", "posix"), local(tmp_path, "archive", "posix")]
    config = write_config(tmp_path / "c.yaml", tiers)
    state = mixed_state("cpu", seed=5)
    with tiered.Engine.from_config(config) as engine:
        engine.save(2, state).wait()
    assert main(["migrate", "--config", str(config), "-q"]) == 0
    import shutil

    shutil.rmtree(tmp_path / "local")
    index = tmp_path / "shared" / "step_000000000002" / "rank_00000.index.json"
    index.write_bytes(index.read_bytes()[:-10])  # the first source's metadata is damaged
    capsys.readouterr()
    assert restore_main(["--config", str(config), "--step", "2", "-q"]) == 0
    out, err = capsys.readouterr()
    assert "tier 'shared' cannot serve step 2" in err and "restored step 2 from tier 'archive'" in out, out + err
    with tiered.Engine.from_config(config) as engine:
        assert_same(state, engine.load(2, tier="local"))
    # --from names the source; one that does not hold the step is said so.
    assert restore_main(["--config", str(config), "--step", "2", "--from", "archive", "--to", "shared", "-q"]) == 0
    assert main(["verify", "--config", str(config), "--tier", "shared", "-q"]) == 0  # repaired from archive
    assert restore_main(["--config", str(config), "--step", "3", "--from", "archive", "-q"]) == 1
    assert "step 3 is not committed on tier 'archive'" in capsys.readouterr().err
    assert restore_main(["--config", str(config), "--from", "nowhere", "-q"]) == 2
    assert "no tier named 'nowhere'" in capsys.readouterr().err


@pytest.mark.parametrize("archive_codec", ["zstd", "none"])  # chunks kept as they are / recompressed
def test_a_migration_takes_a_chunk_damaged_on_its_source_from_a_tier_above(tmp_path, archive_codec, caplog):
    tiers = [local(tmp_path), local(tmp_path, "shared", "posix"),
             local(tmp_path, "archive", "posix", codec=archive_codec)]
    config = write_config(tmp_path / "c.yaml", tiers)
    state = {"w": torch.randn(300_000), "b": torch.randn(50_000)}
    with tiered.Engine.from_config(config) as engine:
        engine.save(4, state).wait()
        from tiered.migrate.migrator import migrate_step

        migrate_step(4, engine.get_tier("local"), engine.get_tier("shared"), codec=None)
        _, index = engine.read_index(4, tier="shared")
    data = tmp_path / "shared" / "step_000000000004" / "rank_00000.data"
    raw = bytearray(data.read_bytes())
    raw[index.tensors[0].chunks[1].offset + 7] ^= 0x10
    data.write_bytes(bytes(raw))
    assert main(["migrate", "--config", str(config), "-q"]) == 0
    assert "chunk 1 from tier 'local' instead" in caplog.text, caplog.text
    assert main(["verify", "--config", str(config), "--tier", "archive", "-q"]) == 0
    with tiered.Engine.from_config(config) as engine:
        assert_same(state, engine.load(4, tier="archive"))


def test_a_tampered_skeleton_value_is_damage_the_reader_goes_around_and_verify_reports(tmp_path, capsys):
    from tiered.format import checksum
    from tiered.format.manifest import Manifest

    config = write_config(tmp_path / "c.yaml", [local(tmp_path), local(tmp_path, "shared", "posix")])
    state = {"w": torch.randn(1000), "dev": torch.device("cpu"), "dt": torch.float16}
    with tiered.Engine.from_config(config) as engine:
        engine.save(1, state).wait()
    assert main(["migrate", "--config", str(config), "-q"]) == 0
    d = tmp_path / "local" / "step_000000000001"
    raw = (d / "rank_00000.index.json").read_bytes().replace(b'"$device":"cpu"', b'"$device":"nonsense:7"')
    assert b"nonsense:7" in raw
    (d / "rank_00000.index.json").write_bytes(raw)
    # The manifest re-sealed to match: only the skeleton's value is wrong, as a careful forger would leave it.
    manifest = Manifest.from_json((d / "MANIFEST.json").read_bytes(), "m")
    import dataclasses

    entry = dataclasses.replace(manifest.ranks[0], index_bytes=len(raw), index_checksum=checksum.wsum64(raw))
    (d / "MANIFEST.json").write_bytes(dataclasses.replace(manifest, ranks=(entry,)).to_json())
    assert main(["verify", "--config", str(config), "--tier", "local", "-q"]) == 1
    assert "DAMAGED  tier 'local' step 1" in capsys.readouterr().out
    with tiered.Engine.from_config(config) as engine:
        assert_same(state, engine.load(1))  # from the shared tier


def test_an_index_claiming_more_than_its_chunks_can_hold_is_refused_before_any_allocation():
    from tiered.format.manifest import RankIndex

    doc = {"format": "tiered-index", "version": 2, "rank": 0, "data_file": "rank_00000.data", "data_bytes": 4096,
           "chunk_size": 1 << 20, "alignment": 4096, "checksum": "wsum64", "io": "", "skeleton": {"$tensor": 0},
           "tensors": [{"index": 0, "name": "w", "dtype": "uint8", "shape": [1 << 20], "device": "cpu",
                        "codec": {"name": "none", "configuration": {}},
                        "chunks": [[0, 16, 1 << 20, "0" * 16]]}]}
    with pytest.raises(FormatError, match="claims 1048576 bytes from 16 stored"):
        RankIndex.from_json(json.dumps(doc).encode(), "forged")


# --- hostile files ------------------------------------------------------------------------
def _two_copies(tmp_path: Path) -> tuple[Path, dict]:
    config = write_config(tmp_path / "c.yaml", [local(tmp_path), local(tmp_path, "shared", "posix")])
    state = mixed_state("cpu", seed=6)
    with tiered.Engine.from_config(config) as engine:
        engine.save(1, state).wait()
    assert main(["migrate", "--config", str(config), "-q"]) == 0
    return config, state


@pytest.mark.parametrize("what", ["fifo", "link-to-device", "link-out", "index-link"])
def test_files_that_are_not_regular_files_of_the_step_are_refused_and_read_around(tmp_path, capsys, what):
    config, state = _two_copies(tmp_path)
    d = tmp_path / "local" / "step_000000000001"
    outside = tmp_path / "outside.bin"
    outside.write_bytes((d / "rank_00000.data").read_bytes())  # the very bytes, outside the tier
    name = "rank_00000.index.json" if what == "index-link" else "rank_00000.data"
    (d / name).unlink()
    if what == "fifo":
        os.mkfifo(d / name)  # opened without O_NONBLOCK, a read would hang here for ever
    elif what == "link-to-device":
        (d / name).symlink_to("/dev/zero")  # read without bound, this never ends either
    else:
        (d / name).symlink_to(outside)
    capsys.readouterr()
    assert main(["verify", "--config", str(config), "--tier", "local", "-q"]) == 1
    report = capsys.readouterr().out
    assert "DAMAGED  tier 'local' step 1" in report and ("FIFO" in report or "symbolic link" in report), report
    with tiered.Engine.from_config(config) as engine:
        assert_same(state, engine.load(1))  # the shared copy stands in
    assert restore_main(["--config", str(config), "-q"]) == 0  # and repairs the local one, aside
    assert main(["verify", "--config", str(config), "--tier", "local", "-q"]) == 0
    assert outside.read_bytes()  # nothing outside the tier was touched


def test_a_step_directory_that_links_out_of_the_tier_is_never_listed_read_or_deleted(tmp_path, capsys):
    config, state = _two_copies(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "local" / "step_000000000001").rename(elsewhere)
    (tmp_path / "local" / "step_000000000009").symlink_to(elsewhere, target_is_directory=True)
    with tiered.Engine.from_config(config) as engine:
        assert engine.steps("local") == [] and engine.steps() == [1]
        with pytest.raises(FormatError, match="symbolic link"):
            engine.get_tier("local").delete(9)
    cfg = yaml.safe_load(config.read_text())
    cfg["tiers"][0]["keep_last"] = 1
    config.write_text(yaml.safe_dump(cfg))
    assert main(["gc", "--config", str(config), "-q"]) == 0
    assert (elsewhere / "MANIFEST.json").exists() and (elsewhere / "rank_00000.data").exists()
    assert main(["ls", "--config", str(config)]) == 0
    assert "9" not in capsys.readouterr().out.split("cells:")[0].split()[1:]


# --- debris -------------------------------------------------------------------------------
def test_gc_removes_what_stopped_writers_left_and_leaves_live_writers_alone(tmp_path, capsys):
    config, state = _two_copies(tmp_path)
    root = tmp_path / "local"
    # A deletion killed after its rename: the step is gone, its files are not.
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, shutil
        from tiered.tiers import LocalTier
        shutil.rmtree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        LocalTier("local", {str(root)!r}).delete(1)
        """)], env=env(), capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert list(root.glob(".step_000000000001__*.deleting"))
    # A distributed step whose only writer stopped; one whose writer runs (this process).
    from tiered.tiers import LocalTier

    dead = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from tiered.tiers import LocalTier
        LocalTier("local", {str(root)!r}).begin_rank(5, 0)
        """)], env=env(), capture_output=True, text=True, timeout=120)
    assert dead.returncode == 0, dead.stderr
    live = LocalTier("local", root)
    live.begin_rank(6, 0)
    live.begin_step(7)
    capsys.readouterr()
    assert main(["gc", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "removed 2 leftovers" in out and "an unfinished deletion of step_000000000001" in out, out
    assert "step_000000000005: an uncommitted step whose writers stopped" in out, out
    assert not list(root.glob(".step_000000000001__*")) and not (root / "step_000000000005").exists()
    assert (root / "step_000000000006").is_dir() and list(root.glob(".step_000000000007__*.writing"))
    live.discard(7)
    live.discard_rank(6, 0)
    with tiered.Engine.from_config(config) as engine:
        assert_same(state, engine.load(1))  # from the shared tier: the local copy was being deleted


def test_a_step_directory_an_older_tiered_left_uncommitted_gives_way_once_quiet(tmp_path):
    """tiered before 0.3 wrote a step in place and marked no writer: its uncommitted directory
    blocks a new save of that step only while its files still change (a writer may be at work);
    once quiet for UNMARKED_QUIET_S it is debris, and the save removes it and commits."""
    from tiered.tiers.local import UNMARKED_QUIET_S

    root = tmp_path / "local"
    left = root / "step_000000000003"
    left.mkdir(parents=True)
    (left / "rank_00000.data").write_bytes(b"x" * 4096)
    with tiered.Engine.from_config({"tiers": [local(tmp_path)], "on_save_failure": "raise"}) as engine:
        with pytest.raises(tiered.TieredError, match="being written in .* by another writer"):
            engine.save(3, {"w": torch.ones(8)}).wait()
        old = time.time() - UNMARKED_QUIET_S - 60
        for path in (left / "rank_00000.data", left):
            os.utime(path, (old, old))
        engine.save(3, {"w": torch.ones(8)}).wait()
        assert engine.steps() == [3] and torch.equal(engine.load(3)["w"], torch.ones(8))
    assert not list(root.glob(".step_*"))


# --- refused before anything is written ---------------------------------------------------
def _deep() -> dict:
    out = cur = {}
    for _ in range(5000):
        cur["x"] = {}
        cur = cur["x"]
    return out


def _loop() -> dict:
    d: dict = {"a": {"w": torch.ones(2)}}
    d["a"]["back"] = d
    return d


@pytest.mark.parametrize("bad, where", [
    (lambda: {"model": {"w": torch.empty(3, device="meta")}}, "model.w: a tensor on the meta device"),
    (lambda: {"opt": {"z": torch.zeros(4, dtype=torch.complex32)}}, "opt.z: dtype torch.complex32 is not supported"),
    (_deep, "x.x.x...x.x.x: the state nests 5000 containers deep"),
    (_loop, "a.back: the state refers to itself"),
    (lambda: {"rng": {"seed": 1 << 10000}}, "rng.seed: an int of 10001 bits"),
    (lambda: {"ids": [1, 2, 1 << 9000]}, "ids[2]: an int of 9001 bits"),
], ids=["meta", "complex32", "deep", "self-reference", "huge-int", "huge-int-in-list"])
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_state_the_format_cannot_hold_is_refused_in_the_call_naming_the_path(tmp_path, bad, where):
    with tiered.Engine.from_config({"tiers": [local(tmp_path)]}) as engine:
        with pytest.raises(StateDictError) as info:
            engine.save(1, bad())
        assert where in str(info.value)
        root = tmp_path / "local"
        assert not root.exists() or list(root.iterdir()) == []  # nothing of the step, aside or in place
        engine.save(1, {"w": torch.ones(3)}).wait()  # the engine goes on
        assert engine.steps() == [1]


@pytest.mark.parametrize("url, said", [
    ("http://AKIAEXAMPLE:s3cr3t-v4lue@127.0.0.1:9000", "carries credentials (http://<credentials>@127.0.0.1:9000)"),
    ("https://s3cr3t-v4lue@example.com", "carries credentials (https://<credentials>@example.com)"),
    ("https://example.com/?X-Amz-Signature=s3cr3t-v4lue", "takes no query string"),
])
def test_credentials_in_an_endpoint_url_are_refused_without_being_echoed(tmp_path, url, said):
    cfg = {"tiers": [local(tmp_path), {"name": "s3", "kind": "s3", "bucket": "b-1", "endpoint_url": url}]}
    with pytest.raises(ConfigError) as info:
        tiered.Engine.from_config(cfg)
    assert "tiers[1].endpoint_url" in str(info.value) and said in str(info.value)
    assert "s3cr3t" not in str(info.value) and "AKIAEXAMPLE" not in str(info.value)


# --- stress -------------------------------------------------------------------------------
STRESS_SAVES = int(os.environ.get("TIERED_STRESS_SAVES", "80"))
"""Saves in the stress test, over its two savers (docs/reliability.md quotes a run of 1,000)."""


def test_stress_concurrent_saves_loads_and_gc_over_one_tier_lose_nothing(tmp_path):
    """Two savers racing for overlapping step numbers, a reader loading the newest steps, and
    `tiered gc` (keep_last 4) in a loop, all over one tier, until the savers are done. No load
    ever sees part of a step or a mix of writers (the reader checks every step it loads against
    the writer recorded in it); every save is either committed or refused because the other
    writer committed that step; at the end the tier holds exactly the newest 4 steps saved, each
    whole."""
    config = write_config(tmp_path / "c.yaml", [local(tmp_path, keep_last=4)], max_failed_saves=1000)
    go, stop = tmp_path / "go", tmp_path / "stop"
    per = STRESS_SAVES // 2
    procs = [subprocess.Popen([sys.executable, str(HERE / "race_worker.py"), *c], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env())
             for c in (["stress", str(config), "a", str(per), str(go), "1"],
                       ["stress", str(config), "b", str(per), str(go), "2"],
                       ["read", str(config), str(go), str(stop)], ["gc", str(config), str(go), str(stop)])]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("go.*.ready"))) < 4:
            assert all(p.poll() is None for p in procs), [p.stderr.read()[-3000:] for p in procs if p.poll() is not None]
            assert time.monotonic() < deadline, "the racers did not start"
            time.sleep(0.02)
        go.touch()
        saved = []
        for p in procs[:2]:
            out, err = p.communicate(timeout=600 + STRESS_SAVES)
            assert p.returncode == 0, err[-3000:]
            saved.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        stop.touch()
    got = []
    for p in procs[2:]:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        got.append(json.loads(out.strip().splitlines()[-1]))
    (reader, gc) = got
    # (A step gc collected may be saved again by the other writer: both then report it committed.)
    committed = sorted(set(saved[0]["ok"]) | set(saved[1]["ok"]))
    assert all(len(s["ok"]) + s["refused"] == per for s in saved)
    assert reader["loads"] > 0 and gc["runs"] > 0
    assert main(["gc", "--config", str(config), "-q"]) == 0  # (the last save came after the last gc)
    sys.path.insert(0, str(HERE))
    from race_worker import holds_its_writers_state

    with tiered.Engine.from_config(config) as engine:
        assert engine.steps() == committed[-4:]
        for step in committed[-4:]:
            got_state = engine.load(step)
            assert holds_its_writers_state(got_state, step)
            assert step in (saved[0]["ok"] if got_state["writer"] == "a" else saved[1]["ok"])
    assert not list((tmp_path / "local").glob(".step_*"))
    refused = saved[0]["refused"] + saved[1]["refused"]
    print(f"\nstress: {2 * per} saves ({2 * per - refused} committed, {refused} refused as the other writer's), "
          f"{reader['loads']} loads ({reader['gone']} found collected), {gc['runs']} gc runs")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_ans_chunks_of_zeros_stay_within_what_an_index_may_claim(tmp_path, dtype):
    """An index may not claim more raw bytes per stored byte than its codec ever gives
    (`MAX_RATIO`): the most compressible chunk nvCOMP's ANS makes, 16 MiB of zeros (its largest chunk), within it."""
    from tiered.format.manifest import MAX_RATIO

    cfg = {"chunk_size": "16MiB", "migration": "external", "tiers": [local(tmp_path, codec="ans")]}
    n = (16 << 20) // torch.tensor([], dtype=dtype).element_size()
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, {"z": torch.zeros(n, dtype=dtype, device="cuda")}).wait()
        _, index = engine.read_index(1)  # (parsed: an index past the limit is refused here)
        (rec,) = index.tensors
        ratio = max(c.raw_size / c.size for c in rec.chunks)
        assert rec.codec.name == "ans" and ratio <= MAX_RATIO["ans"], ratio
        print(f"\nans, 16 MiB of {dtype} zeros: {ratio:.0f}x (limit {MAX_RATIO['ans']}x)")
        assert torch.count_nonzero(engine.load(1)["z"]) == 0
