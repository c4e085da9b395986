"""Config parsing: the shipped configs load; every bad field names the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered.config import LocalTierConfig, PosixTierConfig, S3TierConfig, load_config
from tiered.errors import ConfigError
from tiered.units import parse_bandwidth, parse_size

ROOT = Path(__file__).resolve().parent.parent


def test_embedded_default_is_configs_local_yaml():
    cfg = load_config()
    assert cfg.tiers[0].path == Path(".tiered/local") and cfg.tiers[0].codec == "auto"
    assert (ROOT / "configs" / "local.yaml").read_text() == (ROOT / "tiered" / "configs" / "local.yaml").read_text()
    assert load_config(ROOT / "configs" / "local.yaml") == load_config().__class__(
        **{**load_config().__dict__, "source": str(ROOT / "configs" / "local.yaml")})


def test_example_cluster_config():
    cfg = load_config(ROOT / "configs" / "example-cluster.yaml")
    nvme, shared, s3 = cfg.tiers
    assert isinstance(nvme, LocalTierConfig) and nvme.codec == "auto" and nvme.bandwidth == 6e9
    assert nvme.keep_last == 3 and nvme.keep_every is None and s3.keep_last is None and not s3.retention
    assert isinstance(shared, PosixTierConfig) and shared.portable and shared.codec == "auto"
    assert shared.keep_last == 10 and shared.keep_every == 5000 and s3.codec == "zstd"
    assert isinstance(s3, S3TierConfig) and s3.bucket == "my-team-checkpoints" and s3.region == "us-east-1"
    assert cfg.budgets.gpu_buffer is None and cfg.budgets.host_buffer is None and cfg.chunk_size == 2**20
    assert s3.max_attempts == 10 and s3.timeout == 60.0 and s3.part_size == 64 * 2**20


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1 MiB", 2**20), (4096, 4096), ("1.5GB", 1_500_000_000),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8 parsecs", "-1", -5, "1.5B", True, "GiB", None])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_bandwidth():
    assert parse_bandwidth("12GB/s") == 12e9 and parse_bandwidth("800 MiB/s") == 800 * 2**20
    for bad in ("12GB", "fast", 0, "0GB/s"):
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


LOCAL = {"name": "local", "kind": "local", "path": "/tmp/x"}


@pytest.mark.parametrize("doc, field, message", [
    (dict(tiers=[LOCAL], chunk_sise="1MiB"), "chunk_sise", "unknown field"),
    (dict(tiers=[LOCAL], chunk_size="1000"), "chunk_size", "multiple of 4KiB"),
    (dict(tiers=[LOCAL], chunk_size="huge"), "chunk_size", "expected a size"),
    (dict(tiers=[LOCAL], version=2), "version", "unsupported config version 2"),
    (dict(tiers=[LOCAL], budgets={"gpu_buffer": "1KiB"}), "budgets.gpu_buffer", "at least 4 chunks"),
    (dict(tiers=[LOCAL], budgets={"gpu_bufer": "1GiB"}), "budgets.gpu_bufer", "unknown field"),
    (dict(tiers=[LOCAL], budgets=[1]), "budgets", "expected a mapping"),
    (dict(tiers=[LOCAL], codecs={"zstd": {"level": 22}}), "codecs.zstd.level", "must be 1..19"),
    (dict(tiers=[LOCAL], codecs={"zstd": {"level": "3"}}), "codecs.zstd.level", "expected an integer"),
    (dict(tiers=[LOCAL], codecs={"lz4": {}}), "codecs.lz4", "unknown field"),
    (dict(tiers=[]), "tiers", "at least one tier"),
    (dict(tiers="local"), "tiers", "expected a list"),
    (dict(), "tiers", "is required"),
    (dict(tiers=[{**LOCAL, "kind": "nvme"}]), "tiers[0].kind", "unknown tier kind 'nvme'"),
    (dict(tiers=[{**LOCAL, "codec": "lz4"}]), "tiers[0].codec", "unknown codec 'lz4'"),
    (dict(tiers=[{**LOCAL, "portable": True, "codec": "ans"}]), "tiers[0].codec", "needs a GPU to decode"),
    (dict(tiers=[{**LOCAL, "keep_last": 0}]), "tiers[0].keep_last", "at least 1"),
    (dict(tiers=[{**LOCAL, "keep_every": "often"}]), "tiers[0].keep_every", "expected an integer"),
    (dict(tiers=[{**LOCAL, "portable": "yes"}]), "tiers[0].portable", "expected true/false"),
    (dict(tiers=[{**LOCAL, "bandwidth": "fast"}]), "tiers[0].bandwidth", "expected a bandwidth"),
    (dict(tiers=[{**LOCAL, "direct_io": "maybe"}]), "tiers[0].direct_io", "auto, on or off"),
    (dict(tiers=[{**LOCAL, "pth": "/x"}]), "tiers[0].pth", "unknown field"),
    (dict(tiers=[{"name": "l", "kind": "local"}]), "tiers[0].path", "is required"),
    (dict(tiers=[{"kind": "local", "path": "/x"}]), "tiers[0].name", "is required"),
    (dict(tiers=[{**LOCAL, "name": "a/b"}]), "tiers[0].name", "letters, digits"),
    (dict(tiers=[LOCAL, LOCAL]), "tiers[1].name", "duplicate tier name"),
    (dict(tiers=[{"name": "s", "kind": "s3", "bucket": "b"}]), "tiers[0].kind", "first tier must be kind 'memory' or 'local'"),
    (dict(tiers=[LOCAL, {"name": "s", "kind": "s3"}]), "tiers[1].bucket", "is required"),
    (dict(tiers=[LOCAL, {"name": "s", "kind": "s3", "bucket": "b", "aws_secret_access_key": "x"}]),
     "tiers[1].aws_secret_access_key", "never read from YAML"),
    (dict(tiers=[LOCAL, {"name": "p", "kind": "posix", "path": "/y", "codec": "ans"}]), "tiers[1].codec",
     "needs a GPU"),
    (dict(tiers=[LOCAL], on_fast_tier_error="skip"), "on_fast_tier_error", "expected fail or next_tier"),
    (dict(tiers=[LOCAL], on_fast_tier_error="next_tier"), "on_fast_tier_error", "needs a second tier"),
    (dict(tiers=[LOCAL, {"name": "s", "kind": "s3", "bucket": "b", "max_attempts": 0}]), "tiers[1].max_attempts",
     "must be 1..100"),
    (dict(tiers=[LOCAL, {"name": "s", "kind": "s3", "bucket": "b", "max_attempts": "3"}]), "tiers[1].max_attempts",
     "expected an integer"),
    (dict(tiers=[LOCAL, {"name": "s", "kind": "s3", "bucket": "b", "timeout": -1}]), "tiers[1].timeout",
     "more than 0"),
    (dict(tiers=[LOCAL, {"name": "s", "kind": "s3", "bucket": "b", "timeout": "60s"}]), "tiers[1].timeout",
     "expected an integer or a number"),
    (dict(tiers=[LOCAL, {"name": "s", "kind": "s3", "bucket": "b", "part_size": "1MiB"}]), "tiers[1].part_size",
     "5MiB..5GiB"),
])
def test_bad_fields_name_file_and_field(tmp_path, doc, field, message):
    import yaml

    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: {field}: "), str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("tiers: [\n  {name: a,\n", r"invalid YAML \(line"),
    ("", "the config is empty"),
    ("- just\n- a list\n", "top level: expected a mapping"),
])
def test_invalid_yaml(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert str(err.value).startswith(str(path))


def test_missing_file():
    with pytest.raises(ConfigError, match="nope.yaml: cannot read config"):
        load_config("/nonexistent/nope.yaml")


def test_dict_source_and_frozen():
    cfg = load_config({"tiers": [LOCAL]})
    assert cfg.source == "<dict>"
    with pytest.raises(AttributeError):
        cfg.chunk_size = 5  # type: ignore[misc]
