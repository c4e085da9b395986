"""S3 faults, on a real SeaweedFS server of this module's own (it is killed and restarted):

- the server SIGKILLed in the middle of a migration's upload and restarted: the requests are
  retried with backoff and the step completes, bit-exact, with no multipart upload left behind;
- an attempt that gives up leaves no committed step, and the next attempt clears the abandoned
  multipart upload;
- throttling (SlowDown), 5xx answers and dropped connections, injected by a proxy in front of
  the server (tests/s3proxy.py), are retried with backoff and never reach the migrator;
- 4xx answers (denied, bad credentials, missing bucket) fail on the first attempt, clearly;
- S3 unreachable for longer than the client retries: the failure is reported, saves go on, and
  the migrator's own retry finishes the steps once S3 is back.

The soak mode runs more kill trials: ``TIERED_S3_FAULT_TRIALS=50 python -m pytest -q -s tests/test_s3_faults.py``.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time

import pytest
import torch
import yaml
from helpers import new_bucket, running_s3, s3_client
from s3proxy import FaultProxy

from tiered import Engine
from tiered.cli import main as cli
from tiered.errors import TieredError
from tiered.migrate import migrator

TRIALS = int(os.environ.get("TIERED_S3_FAULT_TRIALS", "1"))
STEP_FILES = {"MANIFEST.json", "*/rank_00000.index.json", "*/rank_00000.data"}
"""A committed step's objects: the manifest, and its files in the folder the manifest names (`*`)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of this module's own: it is killed and restarted."""
    with running_s3(tmp_path_factory.mktemp("seaweedfs-faults")) as s:
        yield s


@pytest.fixture
def bucket(server):
    return new_bucket(server)


@pytest.fixture
def fast_retries(monkeypatch):
    """The migrator's own retries start after 0.5 s instead of 5 s (the request retries are botocore's)."""
    monkeypatch.setattr(migrator, "RETRY_FIRST_S", 0.5)


def config(tmp_path, bucket, endpoint, **s3) -> dict:
    return {"version": 1, "chunk_size": "1MiB", "migration": "in_process", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "zstd"},
        {"name": "s3", "kind": "s3", "bucket": bucket, "prefix": "run", "endpoint_url": endpoint,
         "region": "us-east-1", "codec": "none", "part_size": "5MiB", **s3}]}


def state(step: int, mib: int = 12) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(mib * 1024 * 256, generator=g), "step": step}  # incompressible: mib MiB stored


def objects(server, bucket: str, step: int) -> set[str]:
    """The objects under the step, the folder its manifest names written `*` (any other folder,
    a stopped writer's, by its name)."""
    client, prefix = s3_client(server), f"run/step_{step:012d}/"
    keys = {o["Key"][len(prefix):] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", ())}
    folder = ""
    if "MANIFEST.json" in keys:
        folder = client.head_object(Bucket=bucket, Key=prefix + "MANIFEST.json")["Metadata"].get("tiered-files", "")
    return {"*/" + k[len(folder) + 1:] if folder and k.startswith(folder + "/") else k for k in keys}


def uploads(server, bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client(server).list_multipart_uploads(Bucket=bucket).get("Uploads", ())]


def check_on_s3(engine, server, bucket, step: int) -> None:
    """The step is committed on S3 with exactly its files, restores from S3 alone bit-exact, and
    no multipart upload is left open."""
    assert step in engine.steps("s3")
    assert objects(server, bucket, step) == STEP_FILES
    assert uploads(server, bucket) == []
    got = engine.load(step, tier="s3")
    assert torch.equal(got["w"], state(step)["w"]) and got["step"] == step


def wait_on_s3(engine, step: int, timeout: float = 180) -> int:
    """Wait until `step` is on S3; returns how many migration failures were reported on the way."""
    deadline, failures = time.monotonic() + timeout, 0
    while True:
        try:
            engine.wait_migrated(timeout=max(1.0, deadline - time.monotonic()))
            return failures
        except TieredError:
            failures += 1
            if time.monotonic() > deadline:
                raise


class Killer:
    """SIGKILLs the S3 server when the client is about to send the `nth` request of `op` (a random
    0-20 ms later, so that the request is in flight), and starts it again `down_s` later."""

    def __init__(self, server, client, op: str, nth: int, down_s: float):
        self.server, self.op, self.nth, self.down_s = server, op, nth, down_s
        self.seen, self.killed = 0, threading.Event()
        self.restarted = threading.Event()
        self._lock = threading.Lock()  # parts go out from several threads at once
        client.meta.events.register(f"before-send.s3.{op}", self._before_send)

    def _before_send(self, **_):
        with self._lock:
            self.seen += 1
            if self.seen != self.nth or self.killed.is_set():
                return
            self.killed.set()
        threading.Thread(target=self._crash, daemon=True).start()

    def _crash(self) -> None:
        time.sleep(random.uniform(0, 0.02))
        self.server.kill()
        time.sleep(self.down_s)
        self.server.start()
        self.restarted.set()


# Where the kill lands: the data file's parts, the multipart commit, the index and manifest PUTs.
KILL_POINTS = [("CreateMultipartUpload", 1), ("UploadPart", 2), ("CompleteMultipartUpload", 1), ("PutObject", 1),
               ("PutObject", 2)]


@pytest.mark.timeout(120 + 90 * TRIALS)
def test_server_killed_mid_upload_and_restarted(tmp_path, server, bucket, fast_retries, caplog):
    """For each kill point, TRIALS times: SIGKILL the server as the request goes out, restart it
    0.2-2 s later; the migration completes by itself, bit-exact, with nothing left behind."""
    caplog.set_level(logging.DEBUG, logger="botocore.retries")
    rng = random.Random(7)
    kills = steps = retried_failures = 0
    with Engine.from_config(config(tmp_path, bucket, server.endpoint_url)) as engine:
        client = engine.get_tier("s3").client
        for trial in range(TRIALS):
            for op, nth in KILL_POINTS:
                step = steps = steps + 1
                killer = Killer(server, client, op, nth, down_s=rng.uniform(0.2, 2.0))
                engine.save(step, state(step)).wait()
                retried_failures += wait_on_s3(engine, step)
                assert killer.killed.is_set(), f"trial {trial}: the kill at {op} #{nth} never happened"
                assert killer.restarted.wait(60)
                client.meta.events.unregister(f"before-send.s3.{op}", killer._before_send)
                kills += 1
                check_on_s3(engine, server, bucket, step)
    retries = caplog.text.count("Retry needed, retrying request after delay")
    print(f"\ns3 kill trials: {kills} kills of the server, {steps} steps migrated and restored bit-exact, "
          f"{retries} request retries, {retried_failures} migrations retried by the migrator, 0 steps lost")
    assert retries >= kills  # every kill was absorbed by retries, not by luck


def test_an_attempt_that_gives_up_commits_nothing_and_the_next_clears_its_upload(tmp_path, server, bucket):
    """One attempt per request: the kill fails the migration. Nothing on S3 is a step; the
    multipart upload the attempt could not abort is left open, and the next run aborts it."""
    proxy = FaultProxy(server.endpoint_url)
    try:
        cfg = config(tmp_path, bucket, proxy.endpoint_url, max_attempts=1)
        cfg["migration"] = "external"
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(cfg))
        with Engine.from_config(cfg) as engine:
            engine.save(1, state(1)).wait()
        proxy.before("UploadPart", 2, server.kill)
        assert cli(["migrate", "--config", str(path), "-q"]) == 1
        server.start()
        with Engine.from_config(cfg) as engine:
            assert engine.steps("s3") == [] and engine.steps() == [1]
        (left,) = uploads(server, bucket)
        assert re.fullmatch(r"run/step_000000000001/[^/]+__\d+__[0-9a-f]+/rank_00000\.data", left), left
        assert "MANIFEST.json" not in objects(server, bucket, 1)
        assert cli(["migrate", "--config", str(path), "-q"]) == 0
        with Engine.from_config(cfg) as engine:
            check_on_s3(engine, server, bucket, 1)
    finally:
        proxy.close()


FAULTS = [("CreateMultipartUpload", 2, 503, "SlowDown"), ("UploadPart", 3, 500, "InternalError"),
          ("CompleteMultipartUpload", 1, 503, "ServiceUnavailable"), ("PutObject", 2, 503, "SlowDown"),
          ("HeadObject", 1, 500, "InternalError"), ("ListObjectsV2", 1, 503, "SlowDown"),
          ("GetObject", 2, 500, "InternalError")]


def test_throttling_5xx_and_dropped_connections_are_retried_with_backoff(tmp_path, server, bucket, caplog):
    caplog.set_level(logging.DEBUG, logger="botocore.retries")
    proxy = FaultProxy(server.endpoint_url)
    try:
        with Engine.from_config(config(tmp_path, bucket, proxy.endpoint_url)) as engine:
            engine.get_tier("s3").steps()  # the first request happens before the faults
            for op, times, status, code in FAULTS:
                proxy.fail(op, times=times, status=status, code=code)
            proxy.drop("UploadPart", times=1)
            proxy.drop("GetObject", times=1)
            engine.save(1, state(1)).wait()
            engine.wait_migrated(timeout=180)  # raises if any failure reached the migrator
            check_on_s3(engine, server, bucket, 1)  # the ranged GETs of the restore meet faults too
        injected = proxy.injected()
        assert len(injected) == sum(f[1] for f in FAULTS) + 2, injected  # every scheduled fault was met
        delays = [float(d) for d in re.findall(r"retrying request after delay of: ([0-9.e-]+)", caplog.text)]
        assert len(delays) >= len(injected) and all(d > 0 for d in delays), delays
    finally:
        proxy.close()


def test_answers_lost_after_the_server_acted_leave_nothing_behind(tmp_path, server, bucket):
    """The server starts a multipart upload (or stores a part, or an object), but its answer is
    lost: the client retries and makes another. The step commits with exactly its objects, and
    the upload the client never heard of is aborted at the commit."""
    proxy = FaultProxy(server.endpoint_url)
    try:
        with Engine.from_config(config(tmp_path, bucket, proxy.endpoint_url)) as engine:
            engine.wait_migrated(timeout=60)
            for op in ("CreateMultipartUpload", "UploadPart", "PutObject", "CompleteMultipartUpload"):
                proxy.lose_answer(op, times=1)
            engine.save(1, state(1)).wait()
            engine.wait_migrated(timeout=180)
            assert len(proxy.injected("answer")) == 4, proxy.injected()
            check_on_s3(engine, server, bucket, 1)
    finally:
        proxy.close()


def test_a_lost_answer_to_the_manifest_leaves_the_writers_own_commit_whole(tmp_path, server, bucket, caplog):
    """The server stores the manifest and its answer is lost; the client sends it again and the
    server refuses it (If-None-Match). The manifest there is this writer's own (its folder, its
    bytes): the step is committed once, with its files (taking it for another writer's commit
    discarded the very files it names)."""
    proxy = FaultProxy(server.endpoint_url)
    try:
        with Engine.from_config(config(tmp_path, bucket, proxy.endpoint_url)) as engine:
            engine.wait_migrated(timeout=60)
            # (the step's objects: the data file in parts, then the index and the manifest, PutObject 1 and 2)
            proxy.before("PutObject", 2, lambda: proxy.lose_answer("PutObject", times=1))
            with caplog.at_level(logging.WARNING, logger="tiered"):
                engine.save(1, state(1)).wait()
                engine.wait_migrated(timeout=180)  # raises if the migration failed
            assert [op for op, _ in proxy.injected("answer")] == ["PutObject"], proxy.log
            assert [op for op, _ in proxy.log].count("PutObject") == 3, "the manifest went out twice"
            check_on_s3(engine, server, bucket, 1)
            assert "another writer" not in caplog.text
    finally:
        proxy.close()


def test_4xx_answers_fail_on_the_first_attempt_with_a_clear_message(tmp_path, server, bucket, monkeypatch):
    proxy = FaultProxy(server.endpoint_url)
    try:
        cfg = {**config(tmp_path, bucket, proxy.endpoint_url), "migration": "external"}  # no migrator requests
        with Engine.from_config(cfg) as engine:
            tier = engine.get_tier("s3")
            proxy.fail("PutObject", times=50, status=403, code="AccessDenied")
            with pytest.raises(TieredError, match="AccessDenied: the credentials are not allowed to do this"):
                tier.write_file(1, "rank_00000.index.json", b"{}")
            assert [op for op, _ in proxy.log].count("PutObject") == 1
        for label, change in (("wrong secret", {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}),
                              ("missing bucket", None)):
            before = len(proxy.log)
            with monkeypatch.context() as m:
                c = cfg
                if change:
                    for k, v in change.items():
                        m.setenv(k, v)
                else:
                    c = {**cfg, "tiers": [cfg["tiers"][0], {**cfg["tiers"][1], "bucket": "no-such-bucket-here"}]}
                with Engine.from_config(c) as engine, pytest.raises(TieredError) as info:
                    engine.get_tier("s3").steps()
            assert ("SignatureDoesNotMatch" if change else "NoSuchBucket") in str(info.value), (label, info.value)
            assert len(proxy.log) - before == 1, (label, proxy.log[before:])  # one request, no retry
    finally:
        proxy.close()


def test_s3_unreachable_saves_go_on_and_the_migrator_finishes_later(tmp_path, server, bucket, fast_retries,
                                                                      capsys):
    proxy = FaultProxy(server.endpoint_url)
    try:
        cfg = config(tmp_path, bucket, proxy.endpoint_url, max_attempts=2, timeout=2)
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(cfg))
        with Engine.from_config(cfg) as engine:
            engine.get_tier("s3").steps()
            proxy.drop("*", times=10**9)  # every connection is cut: unreachable
            for step in (1, 2, 3):
                engine.save(step, state(step, mib=2)).wait()
            with pytest.raises(TieredError, match="migration failed"):
                engine.wait_migrated(timeout=120)
            assert engine.steps("local") == [1, 2, 3]
            capsys.readouterr()
            assert cli(["ls", "--config", str(path)]) == 0
            listing = capsys.readouterr()
            assert re.search(r"# s3 .*: unreachable", listing.out) and "[1, 2, 3]" not in listing.out, listing
            assert re.search(r"^\s*3\s.*-$", listing.out, re.M), listing.out  # step 3: local only
            proxy.clear()
            for step in (1, 2, 3):
                wait_on_s3(engine, step)
            assert engine.steps("s3") == [1, 2, 3]
            for step in (1, 2, 3):
                assert torch.equal(engine.load(step, tier="s3")["w"], state(step, mib=2)["w"])
    finally:
        proxy.close()
