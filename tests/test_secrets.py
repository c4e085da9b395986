"""Credentials never appear in logs, manifests, indexes, the DCP metadata or error messages.

Everything runs with every logger at DEBUG (boto3's and botocore's included, which log request
details at that level), so a leak anywhere in tiered's calls would be caught here."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from helpers import s3_client

from tiered import Engine
from tiered.errors import TieredError


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_credentials_never_reach_logs_files_or_errors(tmp_path, s3_server, s3_bucket, caplog, monkeypatch, capsys):
    caplog.set_level(logging.DEBUG)  # root: tiered, boto3, botocore, urllib3 all at DEBUG
    secrets = [s3_server.secret_key]
    key_ids = [s3_server.access_key]
    cfg = {"migration": "in_process", "chunk_size": "64KiB", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "zstd"},
        {"name": "s3", "kind": "s3", "bucket": s3_bucket, "prefix": "run", "endpoint_url": s3_server.endpoint_url,
         "region": "us-east-1", "codec": "zstd"}]}
    state = {"w": torch.randn(300, 300), "step": 4}
    with Engine.from_config(cfg) as engine:
        engine.save(4, state).wait()
        engine.wait_migrated()
        out = {"w": torch.zeros(300, 300), "step": 0}
        engine.restore(out, tier="s3")
        assert torch.equal(out["w"], state["w"])
    errors = []
    # Wrong secret, wrong key id, missing bucket: each error is clear and carries no key.
    for var, value in (("AWS_SECRET_ACCESS_KEY", "wrong-" + s3_server.secret_key[:8]),
                       ("AWS_ACCESS_KEY_ID", "wrong-" + s3_server.access_key)):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            (secrets if "SECRET" in var else key_ids).append(value)
            with pytest.raises(TieredError) as info, Engine.from_config(cfg) as engine:
                engine.get_tier("s3").steps()
            errors.append(str(info.value))
    bad_bucket = {**cfg, "tiers": [cfg["tiers"][0], {**cfg["tiers"][1], "bucket": "no-such-bucket-here"}]}
    with pytest.raises(TieredError) as info, Engine.from_config(bad_bucket) as engine:
        engine.get_tier("s3").steps()
    errors.append(str(info.value))

    client = s3_client(s3_server)
    stored = [client.get_object(Bucket=s3_bucket, Key=o["Key"])["Body"].read()
              for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    stored += [p.read_bytes() for p in all_files(tmp_path / "nvme")]
    captured = capsys.readouterr()
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("tiered"))
    texts = {"log": caplog.text, "stdout": captured.out, "stderr": captured.err, "errors": "\n".join(errors)}
    assert len(caplog.records) > 20 and ours and len(stored) >= 4  # the run did log and store things
    # Secret keys appear nowhere, not even in botocore's own DEBUG request logs (it logs the
    # signature, never the key). Key IDs are identifiers, not secrets: botocore's DEBUG log shows
    # them in the Authorization header it sends; tiered's logs, errors and files never do.
    for secret in secrets:
        for where, text in texts.items():
            assert secret not in text, f"a secret key appears in the {where}"
        for blob in stored:
            assert secret.encode() not in blob, "a secret key appears in a stored file"
    for key_id in key_ids:
        for where, text in {"tiered's log": ours, "errors": texts["errors"], "stdout": captured.out}.items():
            assert key_id not in text, f"a key ID appears in {where}"
        for blob in stored:
            assert key_id.encode() not in blob, "a key ID appears in a stored file"
