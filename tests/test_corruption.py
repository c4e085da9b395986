"""Corruption on any tier: a flipped bit or a truncation in any data, index or manifest file is
detected on restore, the restore falls back to the good copy on the other tier (bit-exact), and
`tiered verify` reports the damage naming the file. With no good copy left, the error names the
file (and, for a damaged chunk, the tensor and the chunk).

Besides the fixed matrix, random damage: a random bit of a random file on a random tier (within
the stored bytes of a data file: the padding between chunks is never read), or a truncation at a
random length. ``TIERED_CORRUPTION_TRIALS=1000 python -m pytest -q -s tests/test_corruption.py -k random``
is the soak run (CI: 25 trials)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import s3_client

from tiered import Engine
from tiered.cli import main as cli
from tiered.errors import TieredError

STEP = 7
STEP_DIR = f"step_{STEP:012d}"
TRIALS = int(os.environ.get("TIERED_CORRUPTION_TRIALS", "25"))


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(512, 512, generator=g), "b": torch.randn(700, generator=g)}, "step": STEP}


def zeros() -> dict:
    return {"model": {"w": torch.zeros(512, 512), "b": torch.zeros(700)}, "step": 0}


def write_config(root: Path) -> Path:
    cfg = {"version": 1, "chunk_size": "64KiB", "migration": "external", "tiers": [
        {"name": "local", "kind": "local", "path": str(root / "nvme"), "codec": "zstd"},
        {"name": "shared", "kind": "posix", "path": str(root / "shared"), "codec": "zstd"}]}
    path = root / "tiers.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Step 7 committed on both tiers."""
    root = tmp_path_factory.mktemp("pristine")
    cfg = write_config(root)
    with Engine.from_config(str(cfg)) as engine:
        engine.save(STEP, state()).wait()
    assert cli(["migrate", "--config", str(cfg), "-q"]) == 0
    return root


def damage(path: Path, how: str) -> None:
    index = path.with_name(path.name.replace(".data", ".index.json"))
    path.write_bytes(damaged(path.read_bytes(), path.name, how, index.read_bytes() if index.exists() else b""))


def damaged(raw: bytes, name: str, how: str, index: bytes) -> bytes:
    """`raw` truncated to half, or with one bit flipped: for a data file, inside the stored bytes
    of chunk 1 of model.w (found through its `index`); elsewhere, in the middle."""
    if how == "truncate":
        return raw[:len(raw) // 2]
    out = bytearray(raw)
    if name.endswith(".data"):
        offset, size = next(t["chunks"][1] for t in json.loads(index)["tensors"] if t["name"] == "model.w")[:2]
        pos = offset + size // 2
    else:
        pos = len(raw) // 2
    out[pos] ^= 0x10
    return bytes(out)


CASES = [(tier, name, how) for tier in ("nvme", "shared")
         for name in ("rank_00000.data", "rank_00000.index.json", "MANIFEST.json")
         for how in ("flip", "truncate")]


@pytest.mark.parametrize("tier,name,how", CASES, ids=[f"{t}-{n.split('.')[-2] if n.count('.') > 1 else n}-{h}"
                                                      for t, n, h in CASES])
def test_damage_is_detected_reported_and_restored_around(pristine, tmp_path, tier, name, how, caplog, capsys):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    cfg = write_config(root)
    damage(root / tier / STEP_DIR / name, how)
    caplog.set_level(logging.WARNING, logger="tiered")
    out = zeros()
    with Engine.from_config(str(cfg)) as engine:
        assert engine.restore(out, STEP) == STEP
    assert torch.equal(out["model"]["w"], state()["model"]["w"]) and torch.equal(out["model"]["b"], state()["model"]["b"])
    other = "shared" if tier == "nvme" else "local"
    if tier == "nvme":  # the damaged copy was the one read first: the restore says it went around it
        assert other in caplog.text and name.split(".")[0] in caplog.text, caplog.text
    capsys.readouterr()
    assert cli(["verify", "--config", str(cfg), "--step", "all", "-q"]) == 1
    report = capsys.readouterr().out
    assert f"DAMAGED  tier {'local' if tier == 'nvme' else 'shared'!r} step {STEP}" in report, report
    assert name in report or (name == "rank_00000.data" and "rank_00000" in report), report


def test_random_damage_is_caught_and_never_restores_wrong_data(pristine, tmp_path, capsys):
    rng = random.Random(11)
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    cfg = write_config(root)
    names = ("rank_00000.data", "rank_00000.index.json", "MANIFEST.json")
    good = {(t, n): (root / t / STEP_DIR / n).read_bytes() for t in ("nvme", "shared") for n in names}
    extents = {t: [(c[0], c[1]) for r in json.loads(good[t, names[1]])["tensors"] for c in r["chunks"]]
               for t in ("nvme", "shared")}
    kinds = {}
    for trial in range(TRIALS):
        tier, name = rng.choice(("nvme", "shared")), rng.choice(names)
        raw = bytearray(good[tier, name])
        if rng.random() < 0.2:
            raw = raw[:rng.randrange(len(raw))]
            what = "truncated"
        else:
            if name.endswith(".data"):
                offset, size = rng.choice(extents[tier])
                pos = offset + rng.randrange(size)
            else:
                pos = rng.randrange(len(raw))
            raw[pos] ^= 1 << rng.randrange(8)
            what = "flipped"
        path = root / tier / STEP_DIR / name
        path.write_bytes(bytes(raw))
        out = zeros()
        with Engine.from_config(str(cfg)) as engine:
            assert engine.restore(out, STEP) == STEP
        assert torch.equal(out["model"]["w"], state()["model"]["w"]), (trial, tier, name, what)
        assert torch.equal(out["model"]["b"], state()["model"]["b"]), (trial, tier, name, what)
        capsys.readouterr()
        tier_name = "local" if tier == "nvme" else "shared"
        assert cli(["verify", "--config", str(cfg), "--tier", tier_name, "--step", "all", "-q"]) == 1, \
            (trial, tier, name, what)
        assert f"DAMAGED  tier {tier_name!r} step {STEP}" in capsys.readouterr().out, (trial, tier, name, what)
        path.write_bytes(good[tier, name])
        kinds[what] = kinds.get(what, 0) + 1
    print(f"\nrandom damage: {TRIALS} trials ({kinds}), every one caught by verify, every restore bit-exact")


def test_with_no_good_copy_the_error_names_file_tensor_and_chunk(pristine, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(pristine, root)
    cfg = write_config(root)
    for tier in ("nvme", "shared"):
        damage(root / tier / STEP_DIR / "rank_00000.data", "flip")
    with Engine.from_config(str(cfg)) as engine, pytest.raises(TieredError) as info:
        engine.restore(zeros(), STEP)
    msg = str(info.value)
    assert "rank_00000.data" in msg and "'model.w'" in msg and "chunk 1 " in msg, msg


S3_CASES = [(name, how) for name in ("rank_00000.data", "rank_00000.index.json", "MANIFEST.json")
            for how in ("flip", "truncate")]


@pytest.mark.parametrize("name,how", S3_CASES, ids=[f"{n.split('.')[-2] if n.count('.') > 1 else n}-{h}"
                                                    for n, h in S3_CASES])
def test_damage_on_s3_is_detected_reported_and_restored_around(tmp_path, s3_server, s3_bucket, name, how, caplog,
                                                               capsys):
    """Objects damaged in place on S3. With the local copy damaged the same way, the restore
    reads the S3 copy; with both damaged, verify names the S3 object and the error names it too."""
    cfg = {"version": 1, "chunk_size": "64KiB", "migration": "external", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "zstd"},
        {"name": "s3", "kind": "s3", "bucket": s3_bucket, "prefix": "run", "endpoint_url": s3_server.endpoint_url,
         "region": "us-east-1", "codec": "zstd"}]}
    path = tmp_path / "tiers.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with Engine.from_config(cfg) as engine:
        engine.save(STEP, state()).wait()
    assert cli(["migrate", "--config", str(path), "-q"]) == 0
    caplog.set_level(logging.WARNING, logger="tiered")

    damage(tmp_path / "nvme" / STEP_DIR / name, how)  # the local copy, read first, is bad: S3's is read
    out = zeros()
    with Engine.from_config(cfg) as engine:
        assert engine.restore(out, STEP) == STEP
    assert torch.equal(out["model"]["w"], state()["model"]["w"]) and torch.equal(out["model"]["b"], state()["model"]["b"])
    assert "'s3'" in caplog.text or "s3://" in caplog.text, caplog.text

    s3 = s3_client(s3_server)
    manifest = s3.head_object(Bucket=s3_bucket, Key=f"run/{STEP_DIR}/MANIFEST.json")
    folder = manifest["Metadata"]["tiered-files"] + "/"  # where the writer that committed it put the files
    key = f"run/{STEP_DIR}/{'' if name == 'MANIFEST.json' else folder}{name}"
    index = s3.get_object(Bucket=s3_bucket, Key=f"run/{STEP_DIR}/{folder}rank_00000.index.json")["Body"].read()
    raw = s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=s3_bucket, Key=key, Body=damaged(raw, name, how, index),
                  Metadata=manifest["Metadata"] if name == "MANIFEST.json" else {})
    capsys.readouterr()
    assert cli(["verify", "--config", str(path), "--tier", "s3", "--step", "all", "-q"]) == 1
    report = capsys.readouterr().out
    assert f"DAMAGED  tier 's3' step {STEP}" in report and name.split(".")[0] in report, report
    with Engine.from_config(cfg) as engine, pytest.raises(TieredError) as info:
        engine.restore(zeros(), STEP)
    msg = str(info.value)
    assert f"s3://{s3_bucket}/{key}" in msg or (name == "MANIFEST.json" and "s3" in msg), msg
    if (name, how) == ("rank_00000.data", "flip"):
        assert "'model.w'" in msg and "chunk 1 " in msg, msg
