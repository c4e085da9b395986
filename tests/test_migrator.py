"""Migration of committed steps down the tiers: copy, recompress, idempotent, resumable after SIGKILL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from helpers import assert_same, mixed_state, trained_model

import tiered
from tiered.migrate.migrator import GpuRecoder, migrate_step


def cluster(tmp_path: Path, codec: str, s3=None, bucket=None, migration: str = "external") -> dict:
    """nvme -> shared [-> s3]; `external` migration unless a test wants the engine's own."""
    tiers = [{"name": "nvme", "kind": "local", "path": str(tmp_path / "nvme"), "codec": codec},
             {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd"}]
    if s3 is not None:
        tiers.append({"name": "s3", "kind": "s3", "bucket": bucket, "prefix": "run-1",
                      "endpoint_url": s3.endpoint_url, "region": "us-east-1"})
    return {"migration": migration, "tiers": tiers}


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_copy_down_and_restore_from_each_tier(tmp_path, s3_server, s3_bucket, codec):
    state = mixed_state("cpu", seed=2)
    with tiered.Engine.from_config(cluster(tmp_path, codec, s3_server, s3_bucket)) as engine:
        engine.save(10, state).wait()
        nvme, shared, s3 = (engine.get_tier(n) for n in ("nvme", "shared", "s3"))
        m1 = migrate_step(10, nvme, shared, codec="zstd")
        m2 = migrate_step(10, shared, s3, codec="zstd")
        assert engine.steps("shared") == [10] and engine.steps("s3") == [10]
        src_manifest, src_index = engine.read_index(10)
        _, s3_index = engine.read_index(10, tier="s3")
        assert m1.created == m2.created == src_manifest.created
        assert {t.codec.name for t in s3_index.tensors if t.chunks} == {"zstd"}
        if codec == "none":
            assert m2.stored_bytes < src_manifest.stored_bytes, "none -> zstd recompresses"
        else:
            assert m1.stored_bytes == src_manifest.stored_bytes, "zstd chunks are copied as they are"
        for tier in ("shared", "s3"):
            assert_same(state, engine.load(10, tier=tier))
        target = {k: v for k, v in mixed_state("cpu", seed=99).items()}
        engine.restore(target, tier="s3")
        assert_same(state, target)


def test_a_copy_from_s3_fetches_the_data_while_the_index_is_read(tmp_path, s3_server, s3_bucket, monkeypatch):
    import threading

    from tiered.format.manifest import RankIndex
    from tiered.tiers import LocalTier

    state = mixed_state("cpu", seed=3)
    with tiered.Engine.from_config(cluster(tmp_path, "zstd", s3_server, s3_bucket)) as engine:
        engine.save(4, state).wait()
        s3 = engine.get_tier("s3")
        migrate_step(4, engine.get_tier("nvme"), s3, codec=None)
        data_gets: list[str] = []
        fetching = threading.Event()

        def get(params, **_):
            if params["Key"].endswith(".data"):
                data_gets.append(params["Range"])
                fetching.set()

        s3.client.meta.events.register("provide-client-params.s3.GetObject", get)
        parse = RankIndex.from_json

        def parse_once_fetching(raw, source):  # the data's GETs have gone out before the index is parsed
            assert fetching.wait(30), "no GET of the data file before its index was parsed"
            return parse(raw, source)

        monkeypatch.setattr(RankIndex, "from_json", staticmethod(parse_once_fetching))
        back = LocalTier("back", tmp_path / "back")
        migrate_step(4, s3, back, codec=None)
        monkeypatch.setattr(RankIndex, "from_json", parse)
        size = s3.file_size(4, "rank_00000.data")
        assert size < 8 << 20 and len(data_gets) == min(s3.max_concurrency, -(-size // (1 << 20))), \
            "a small data file is fetched once, one GET per connection"
        assert (tmp_path / "back" / "step_000000000004" / "rank_00000.data").read_bytes() == \
            (tmp_path / "nvme" / "step_000000000004" / "rank_00000.data").read_bytes()
    with tiered.Engine.from_config({"tiers": [{"name": "back", "kind": "local", "path": str(tmp_path / "back")}],
                                    "migration": "external"}) as restored:
        assert_same(state, restored.load(4))


def test_migration_is_idempotent_and_deterministic(tmp_path):
    with tiered.Engine.from_config(cluster(tmp_path, "none")) as engine:
        engine.save(1, {"w": torch.randn(700_000), "meta": {"step": 1}}).wait()
        nvme, shared = engine.get_tier("nvme"), engine.get_tier("shared")
        assert migrate_step(1, nvme, shared, codec="zstd") is not None
        first = files_of(tmp_path / "shared")
        assert migrate_step(1, nvme, shared, codec="zstd") is None  # already there: nothing happens
        assert files_of(tmp_path / "shared") == first
        # A second, independent migration of the same step produces the very same bytes.
        from tiered.tiers import PosixTier

        other = PosixTier("other", tmp_path / "other")
        migrate_step(1, nvme, other, codec="zstd")
        assert files_of(tmp_path / "other") == first


def test_copied_index_follows_a_target_that_falls_back_to_buffered_writes(tmp_path, monkeypatch):
    """A copy makes the new index while its last writes land. Where the target then falls back to
    buffered writes (O_DIRECT refused on the file's last write, after the index was made), the
    index it stores says so, its data_bytes is the file's, and the step reads back."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    import errno
    import threading

    from tiered.format.manifest import RankIndex

    state = {"w": torch.randn(2_000_000), "b": torch.randn(5)}
    with tiered.Engine.from_config(cluster(tmp_path, "zstd")) as engine:
        engine.save(1, state).wait()
        _, src = engine.read_index(1)
        made = threading.Event()
        real_to_json, real_open, real_pwrite = RankIndex.to_json, os.open, os.pwrite
        direct: set[int] = set()

        def to_json(self):
            raw = real_to_json(self)
            made.set()
            return raw

        def open_(path, flags, *args, **kwargs):
            fd = real_open(path, flags, *args, **kwargs)
            if flags & os.O_DIRECT and str(path).startswith(str(tmp_path / "shared")):
                direct.add(fd)
            return fd

        def pwrite(fd, buf, offset):
            if fd in direct and offset + len(buf) >= src.data_bytes:  # the file's last write
                assert made.wait(60), "the index was not made before the last write landed"
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, buf, offset)

        monkeypatch.setattr(RankIndex, "to_json", to_json)
        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "pwrite", pwrite)
        migrate_step(1, engine.get_tier("nvme"), engine.get_tier("shared"), codec="zstd")
        monkeypatch.undo()
        if not direct:
            pytest.skip(f"{tmp_path} takes no O_DIRECT files")
        _, index = engine.read_index(1, tier="shared")
        assert "posix-buffered" in index.io and "odirect" not in index.io
        data_file = next((tmp_path / "shared").rglob("*.data"))
        assert index.data_bytes == data_file.stat().st_size == src.data_bytes
        assert_same(state, engine.load(1, tier="shared"))


def test_migration_killed_mid_copy_restarts_to_identical_files(tmp_path, s3_server, s3_bucket):
    cfg = cluster(tmp_path, "none", s3_server, s3_bucket)
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(3, {f"t{i}": torch.randn(1_500_000) for i in range(8)}).wait()
    # A migrator process that dies (SIGKILL) after uploading part of the data.
    script = textwrap.dedent(f"""
        import os, signal, tiered
        from tiered.migrate.migrator import migrate_step
        from tiered.tiers import s3 as s3mod
        engine = tiered.Engine.from_config({cfg!r})
        real, n = s3mod.S3DataWriter._submit, [0]
        def submit(self, part, **kwargs):
            n[0] += 1
            if n[0] == 3:
                self.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            real(self, part, **kwargs)
        s3mod.S3DataWriter._submit = submit
        engine.get_tier("s3").part_size = 5 * 1024 * 1024
        migrate_step(3, engine.get_tier("nvme"), engine.get_tier("s3"), codec="zstd")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with tiered.Engine.from_config(cfg) as engine:
        s3 = engine.get_tier("s3")
        assert s3.steps() == [], "a killed migration commits nothing"
        assert s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads"), "it had started uploading"
        assert migrate_step(3, engine.get_tier("nvme"), s3, codec="zstd") is not None  # the restart
        # The killed writer's upload is its own, beside the committed step: `tiered gc` (or the next
        # `tiered migrate`) takes it, as the debris of a process that has exited.
        assert any("an unfinished upload by writer" in line for line in s3.reclaim_debris())
        assert not s3.client.list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
        # Byte-identical to an uninterrupted migration of the same step to the same kind of tier.
        from tiered.tiers.s3 import S3Tier

        clean = S3Tier("clean", s3.bucket, "clean", endpoint_url=s3_server.endpoint_url, region="us-east-1")
        migrate_step(3, engine.get_tier("nvme"), clean, codec="zstd")

        def objects(prefix):  # name -> bytes, the writer's folder left out of the name
            listing = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix + "/")["Contents"]
            return {o["Key"].rpartition("/")[2]: s3.client.get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read()
                    for o in listing}

        restarted, uninterrupted = objects("run-1"), objects("clean")
        assert len(restarted) == 3 and restarted == uninterrupted
        expected = {f"t{i}": t for i, t in enumerate(engine.load(3)[f"t{i}"] for i in range(8))}
        assert_same(expected, engine.load(3, tier="s3"))


def test_corrupted_source_chunk_stops_the_migration(tmp_path):
    with tiered.Engine.from_config(cluster(tmp_path, "zstd")) as engine:
        engine.save(1, {"w": torch.randn(600_000)}).wait()
        data = tmp_path / "nvme" / "step_000000000001" / "rank_00000.data"
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
        with pytest.raises(tiered.CorruptionError, match=r"rank_00000.data: tensor 'w' chunk 0 of 3"):
            migrate_step(1, engine.get_tier("nvme"), engine.get_tier("shared"), codec="zstd")
        assert engine.steps("shared") == [] and not (tmp_path / "shared" / "step_000000000001").exists()


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_a_corrupted_chunk_in_a_later_window_stops_the_copy(tmp_path, codec):
    """Kept chunks are verified on the pool in runs of 2 MiB; recompressed ones are taken one
    window behind their encoding (copy_rank._cpu_chunks): either way the damage stops the copy."""
    with tiered.Engine.from_config(cluster(tmp_path, "none")) as engine:
        engine.save(1, {"w": torch.randn(4 << 20)}).wait()  # 16 chunks of 1 MiB: windows of 4, 8 and 4
        data = tmp_path / "nvme" / "step_000000000001" / "rank_00000.data"
        raw = bytearray(data.read_bytes())
        raw[9 * (1 << 20) + 100] ^= 0xFF  # chunk 9: in the second window
        data.write_bytes(bytes(raw))
        with pytest.raises(tiered.CorruptionError, match=r"rank_00000.data: tensor 'w' chunk 9 of 16"):
            migrate_step(1, engine.get_tier("nvme"), engine.get_tier("shared"), codec=codec)
        assert engine.steps("shared") == [] and not (tmp_path / "shared" / "step_000000000001").exists()


def test_a_missing_source_data_file_fails_the_copy_and_leaves_nothing(tmp_path):
    import threading

    with tiered.Engine.from_config(cluster(tmp_path, "zstd")) as engine:
        engine.save(1, {"w": torch.randn(1000)}).wait()
        (tmp_path / "nvme" / "step_000000000001" / "rank_00000.data").unlink()
        with pytest.raises(tiered.CheckpointNotFoundError, match="rank_00000.data: data file is missing"):
            migrate_step(1, engine.get_tier("nvme"), engine.get_tier("shared"), codec=None)
        assert engine.steps("shared") == [] and not (tmp_path / "shared" / "step_000000000001").exists()
        assert not [t for t in threading.enumerate() if t.name.startswith("tiered-migrate")]  # its pool shut down


def test_unknown_tier_name(tmp_path):
    with tiered.Engine.from_config(cluster(tmp_path, "zstd")) as engine:
        with pytest.raises(KeyError, match="no tier named 'tape'.*tiers: nvme, shared"):
            engine.load(1, tier="tape")


@pytest.mark.gpu
def test_ans_recompressed_to_zstd_restores_without_gpu_codecs(tmp_path):
    from tiered.gpu.device import GpuDevice

    model, opt = trained_model("cuda", steps=5)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with tiered.Engine.from_config(cluster(tmp_path, "ans")) as engine:
        engine.save(1, state).wait()
        device = engine.workers.device(0)
        assert isinstance(device, GpuDevice)
        migrate_step(1, engine.get_tier("nvme"), engine.get_tier("shared"), codec="zstd",
                     gpu=GpuRecoder(device))
        _, index = engine.read_index(1, tier="shared")
        assert {t.codec.name for t in index.tensors if t.chunks} == {"zstd"}
        on_cpu = engine.load(1, tier="shared", device="cpu")   # decoded by the CPU path
    assert_same({k: v.cpu() for k, v in state["model"].items()}, dict(on_cpu["model"]))


@pytest.mark.gpu
def test_a_copy_to_a_codec_only_a_gpu_encodes_restores_exactly(tmp_path):
    """zstd chunks (decoded on the CPU) to ans, which only a GPU encodes: copy_rank.tensor_chunks,
    a window of chunks encoded on the GPU at a time; restored bit-exact."""
    from tiered.gpu.device import GpuDevice
    from tiered.tiers import LocalTier

    g = torch.Generator(device="cuda").manual_seed(7)
    state = {"w": torch.randn(700_000, generator=g, device="cuda"), "b": torch.randn(1000, generator=g, device="cuda")}
    with tiered.Engine.from_config(cluster(tmp_path, "zstd")) as engine:
        engine.save(1, state).wait()
        gpu = GpuRecoder(engine.workers.device(0))
        assert isinstance(gpu.device, GpuDevice)
        nvme, fast = engine.get_tier("nvme"), LocalTier("fast", tmp_path / "fast")
        migrate_step(1, nvme, fast, codec="ans", gpu=gpu)
    with tiered.Engine.from_config({"tiers": [{"name": "fast", "kind": "local", "path": str(tmp_path / "fast")}],
                                    "migration": "external"}) as again:
        _, index = again.read_index(1)
        assert {t.codec.name for t in index.tensors if t.chunks} == {"ans"}
        assert_same({k: v.cpu() for k, v in state.items()}, {k: v.cpu() for k, v in again.load(1).items()})


@pytest.mark.gpu
def test_many_small_ans_tensors_of_mixed_dtypes_recompress_in_windows_across_tensors(tmp_path):
    """Chunks of many tensors decode in one batched call per window (copy_rank.gpu_decoded_chunks):
    odd-sized tensors of 2-, 4- and 8-byte dtypes side by side, a window boundary inside a
    tensor of several chunks; restored bit-exact from the zstd copy on the CPU."""
    from tiered.gpu.device import GpuDevice

    g = torch.Generator(device="cuda").manual_seed(5)
    state = {f"t{i}": torch.randn(n, generator=g, device="cuda").to(dt)
             for i, (n, dt) in enumerate([(7, torch.bfloat16), (1001, torch.float32), (3, torch.float64),
                                          (13, torch.float16), (300_000, torch.float32), (5, torch.bfloat16)] * 40)}
    state["ids"] = torch.arange(999, device="cuda")
    cfg = cluster(tmp_path, "ans")
    cfg["chunk_size"] = "64KiB"  # the 300,000-element tensors span many chunks
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        device = engine.workers.device(0)
        assert isinstance(device, GpuDevice)
        migrate_step(1, engine.get_tier("nvme"), engine.get_tier("shared"), codec="zstd", gpu=GpuRecoder(device))
        _, index = engine.read_index(1, tier="shared")
        assert {t.codec.name for t in index.tensors if t.chunks} == {"zstd"}
        on_cpu = engine.load(1, tier="shared", device="cpu")
    assert_same({k: v.cpu() for k, v in state.items()}, dict(on_cpu))


def test_ans_source_without_gpu_is_a_clear_error(tmp_path, monkeypatch):
    from tiered.config import ZstdSettings
    from tiered.format.manifest import CodecSpec, TensorRecord
    from tiered.migrate.copy_rank import gpu_decoded_chunks, tensor_chunks

    rec = TensorRecord(index=0, name="w", dtype="float32", shape=(10,), device="cuda:0", is_numpy=False,
                       codec=CodecSpec.of("ans", data_type="<f4"),
                       chunks=(tiered.format.manifest.ChunkRecord(0, 30, 40, 0),))

    class Reader:
        path = "/x/rank_00000.data"

    with pytest.raises(tiered.CodecUnavailableError, match="needs a GPU with nvCOMP.*GPU machine"):
        list(tensor_chunks(1, None, types.SimpleNamespace(chunk_size=1 << 20), rec, CodecSpec.of("zstd", shuffle=4),
                           Reader(), ZstdSettings(), None, None))

    class Tier:
        def describe(self, step, name):
            return f"/x/step_{step}/{name}"

    index = types.SimpleNamespace(chunk_size=1 << 20, data_file="rank_00000.data")
    with pytest.raises(tiered.CodecUnavailableError, match="needs a GPU with nvCOMP.*GPU machine"):
        list(gpu_decoded_chunks(1, Tier(), index, [rec], [CodecSpec.of("zstd", shuffle=4)], ZstdSettings(), None, None,
                                None))


def test_engine_migrates_in_the_background_and_resumes(tmp_path, s3_server, s3_bucket):
    cfg = cluster(tmp_path, "none", s3_server, s3_bucket, migration="in_process")
    state = mixed_state("cpu", seed=4)
    with tiered.Engine.from_config(cfg) as engine:
        for step in (10, 20):
            engine.save(step, state)
        engine.wait_migrated(timeout=120)
        assert engine.steps("shared") == [10, 20] and engine.steps("s3") == [10, 20]
        _, index = engine.read_index(20, tier="s3")
        assert {t.codec.name for t in index.tensors if t.chunks} == {"zstd"}  # recompressed on the way
        assert_same(state, engine.load(20, tier="s3"))
    # A step committed while migration was off (or cut short) is picked up by the next engine.
    with tiered.Engine.from_config({**cfg, "migration": "external"}) as engine:
        engine.save(30, state).wait()
        assert engine.steps("s3") == [10, 20]
    with tiered.Engine.from_config(cfg) as engine:
        engine.wait_migrated(timeout=120)
        assert engine.steps("s3") == [10, 20, 30]


def test_migration_failure_keeps_the_step_is_reported_and_retried(tmp_path, monkeypatch, caplog):
    from tiered.migrate import migrator
    from tiered.tiers import posix

    works = posix.PosixTier.open_data_writer

    def broken(self, step, name, device, size_hint=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(posix.PosixTier, "open_data_writer", broken)
    monkeypatch.setattr(migrator, "RETRY_FIRST_S", 0.5)
    caplog.set_level(logging.INFO, logger="tiered")
    w = torch.randn(1000)
    with tiered.Engine.from_config(cluster(tmp_path, "zstd", migration="in_process")) as engine:
        engine.save(1, {"w": w}).wait()
        with pytest.raises(tiered.TieredError, match="migration failed.*No space left"):
            engine.wait_migrated(timeout=60)
        assert engine.steps() == [1] and engine.steps("shared") == []
        assert torch.equal(engine.load(1)["w"], w)
        # The space comes back: the migrator's own retry (no new save, no restart) finishes the step.
        monkeypatch.setattr(posix.PosixTier, "open_data_writer", works)
        engine.wait_migrated(timeout=60)
        assert engine.steps("shared") == [1]
        assert torch.equal(engine.load(1, tier="shared")["w"], w)
    assert "attempt 1" in caplog.text and "step 1 migrated after earlier failures" in caplog.text, caplog.text


def test_retry_delays_double_up_to_the_cap():
    from tiered.migrate.migrator import RETRY_FIRST_S, RETRY_MAX_S, retry_delay

    delays = [retry_delay(n) for n in range(1, 12)]
    assert delays[0] == RETRY_FIRST_S and delays[1] == 2 * RETRY_FIRST_S and delays[-1] == RETRY_MAX_S
    assert delays == sorted(delays)


@pytest.mark.gpu
def test_background_migration_of_ans_steps(tmp_path):
    model, opt = trained_model("cuda", steps=3)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with tiered.Engine.from_config(cluster(tmp_path, "ans", migration="in_process")) as engine:
        engine.save(1, state)
        engine.save(2, state)
        engine.wait_migrated(timeout=300)
        assert engine.steps("shared") == [1, 2]
        _, index = engine.read_index(2, tier="shared")
        assert {t.codec.name for t in index.tensors if t.chunks} == {"zstd"}
        on_cpu = engine.load(2, tier="shared", device="cpu")
    assert_same({k: v.cpu() for k, v in state["model"].items()}, dict(on_cpu["model"]))


def _daemon(config: Path, *extra: str, pause_at: Path | None = None) -> subprocess.Popen:
    """`tiered migrate` in a process of its own. With `pause_at`, the first file-tier data file it
    writes stops before its close (every byte handed to the file, nothing fsynced or committed):
    the process creates `pause_at` and waits there, to be killed."""
    args = ["-m", "tiered.cli"]
    if pause_at is not None:
        args = ["-c", textwrap.dedent(f"""
            import sys, time
            from tiered.cli import main
            from tiered.tiers.local_io import LocalDataWriter
            def close(self):
                self.wait()
                open({str(pause_at)!r}, "w").close()
                time.sleep(3600)
            LocalDataWriter.close = close
            sys.exit(main(sys.argv[1:]))""")]
    return subprocess.Popen([sys.executable, *args, "migrate", "--config", str(config), "-q", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_daemon_killed_mid_copy_restarts_and_finishes_byte_identical(tmp_path, s3_server, s3_bucket):
    import yaml

    cfg = cluster(tmp_path, "none", s3_server, s3_bucket)
    for t in cfg["tiers"][1:]:
        t["codec"] = "zstd"  # pinned: the restarted run must make the very same choice
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(cfg))
    state = {f"t{i}": torch.randn(4_000_000) for i in range(8)}
    with tiered.Engine.from_config(config) as engine:
        engine.save(7, state).wait()
    paused = tmp_path / "paused"
    proc = _daemon(config, pause_at=paused)
    deadline = time.monotonic() + 120
    while not paused.exists():  # (a file that stays once made: no transient state is sampled)
        assert proc.poll() is None, f"the migrator exited before its copy paused: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "the copy did not reach its data file's close within 120 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-copy: the data file written, nothing committed
    proc.wait(30)
    assert list((tmp_path / "shared").glob(".step_000000000007__*.writing/rank_00000.data"))
    with tiered.Engine.from_config(config) as engine:
        assert engine.steps("shared") == [] and engine.steps("s3") == [], "a killed copy commits nothing"
    # Restarted as a daemon: it finishes step 7, then picks up a step saved while it runs.
    proc = _daemon(config, "--follow", "--interval", "0.2")
    try:
        with tiered.Engine.from_config(config) as engine:
            engine.save(8, {"w": torch.randn(1000)}).wait()
            deadline = time.monotonic() + 300
            while engine.steps("s3") != [7, 8]:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
    # Byte-identical to uninterrupted copies of the same step.
    from tiered.tiers import PosixTier

    with tiered.Engine.from_config(config) as engine:
        other = PosixTier("other", tmp_path / "other")
        migrate_step(7, engine.get_tier("nvme"), other, codec="zstd")
        assert files_of(tmp_path / "shared" / "step_000000000007") == files_of(tmp_path / "other" / "step_000000000007")
        from tiered.tiers.s3 import S3Tier

        s3 = engine.get_tier("s3")
        clean = S3Tier("clean", s3.bucket, "clean", endpoint_url=s3_server.endpoint_url, region="us-east-1")
        migrate_step(7, other, clean, codec="zstd")

        def objects(prefix):
            listing = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=f"{prefix}/step_000000000007/")["Contents"]
            return {o["Key"].rsplit("/", 1)[1]: s3.client.get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read()
                    for o in listing}

        got = objects("run-1")
        assert sorted(got) == ["MANIFEST.json", "rank_00000.data", "rank_00000.index.json"]
        assert got == objects("clean")
        assert_same(state, engine.load(7, tier="s3"))


GPU_MIGRATED = Path(__file__).resolve().parent / "data" / "gpu-migrated"


def test_gpu_made_s3_copy_restores_without_a_gpu(tmp_path, s3_server, s3_bucket):
    """tests/data/gpu-migrated holds a step saved on a GPU (ANS) and migrated there to zstd (ANS
    decoded on the GPU, zstd encoded on the CPU; scripts/make_gpu_fixture.py, PROVENANCE.json). Uploaded to S3 byte for byte, it
    restores on this machine, which has no GPU codecs."""
    import json

    from helpers import fixture_state

    from tiered.tiers import PosixTier

    provenance = json.loads((GPU_MIGRATED / "PROVENANCE.json").read_text())
    assert provenance["fast_tier_codecs"] == ["ans", "zstd"] and "kvikio" in provenance["fast_tier_io"]
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "local")},
                     {"name": "s3", "kind": "s3", "bucket": s3_bucket, "endpoint_url": s3_server.endpoint_url,
                      "region": "us-east-1"}]}
    with tiered.Engine.from_config(cfg) as engine:
        s3 = engine.get_tier("s3")
        migrate_step(1, PosixTier("gpu", GPU_MIGRATED), s3, codec=None)  # a plain copy of the GPU's bytes
        reader = s3.open_data_reader(1, "rank_00000.data", device=False)
        assert bytes(reader.read_host(0, reader.size)) == (GPU_MIGRATED / "step_000000000001" / "rank_00000.data").read_bytes()
        assert engine.steps() == [1] and engine.steps("local") == []
        restored = engine.load(1, device="cpu")
    assert_same(fixture_state(), restored)


def test_wait_migrated_covers_every_step_saved_before_it(tmp_path, monkeypatch):
    # The step is queued for migration before its save is reported persisted: wait_migrated()
    # right after a save must never return while that step is still missing below, even when
    # queueing is slow (a slow submit widens the window the old order left open).
    from tiered.migrate.migrator import BackgroundMigrator

    # Each step is queued only once wait_migrated() has been called for it: an engine that reported
    # the save persisted before queueing it would let that wait return with the step missing below.
    entered = threading.Event()
    real_submit, real_wait = BackgroundMigrator.submit, tiered.Engine.wait_migrated

    def submit(self, step):
        assert entered.wait(60), "wait_migrated() was never called"
        real_submit(self, step)

    def wait_migrated(self, *args, **kwargs):
        entered.set()
        try:
            return real_wait(self, *args, **kwargs)
        finally:
            entered.clear()

    monkeypatch.setattr(BackgroundMigrator, "submit", submit)
    monkeypatch.setattr(tiered.Engine, "wait_migrated", wait_migrated)
    with tiered.Engine.from_config(cluster(tmp_path, "zstd", migration="in_process")) as engine:
        for step in range(1, 9):
            engine.save(step, {"w": torch.randn(50_000)})
            engine.wait_migrated(timeout=120)
            assert engine.steps("shared") == list(range(1, step + 1))


def test_wait_migrated_returns_once_the_tiers_retention_has_run(tmp_path, monkeypatch):
    """Retention runs after each migrated step; wait_migrated() returns only after it, so the tiers
    then hold what their rules keep (it returned between the two, and a slower tier's deletion
    could still be ahead: S3's keep_last seen holding one step too many)."""
    from tiered.migrate import migrator

    real, ran = migrator.apply_retention, []

    def slow_retention(*args, **kwargs):
        time.sleep(0.5)  # (a slow tier's deletes)
        ran.append(real(*args, **kwargs))

    monkeypatch.setattr(migrator, "apply_retention", slow_retention)
    cfg = cluster(tmp_path, "zstd", migration="in_process")
    cfg["tiers"][1]["keep_last"] = 1
    with tiered.Engine.from_config(cfg) as engine:
        for step in range(1, 4):
            engine.save(step, {"w": torch.randn(50_000)})
            engine.wait_migrated(timeout=120)
            assert len(ran) == step and engine.steps("shared") == [step]


@pytest.mark.parametrize("codec", ["zstd", "none"])  # kept as they are / recompressed to zstd
def test_many_small_tensors_migrate_in_windows_across_tensors(tmp_path, codec, monkeypatch):
    """Windows of one read cross tensor boundaries: a state of hundreds of tensors (empty ones,
    one-chunk ones, a multi-chunk one, several dtypes) reads its source in a few large reads and
    arrives bit-exact."""
    g = torch.Generator().manual_seed(5)
    state = {f"small{i}": torch.randn(300 + i, generator=g) for i in range(400)}
    state.update(empty=torch.zeros(0), half=torch.randn(5000, generator=g).to(torch.bfloat16),
                 big=torch.randn(3 << 20, generator=g), ints=torch.arange(1000))
    reads = []
    with tiered.Engine.from_config(cluster(tmp_path, codec)) as engine:
        engine.save(1, state).wait()
        src, dst = engine.catalog.get("nvme"), engine.catalog.get("shared")
        opened = src.open_data_reader

        def counting(*args, **kwargs):
            reader = opened(*args, **kwargs)
            read = reader.read_host
            reader.read_host = lambda offset, size: reads.append(size) or read(offset, size)
            return reader

        monkeypatch.setattr(src, "open_data_reader", counting)
        migrate_step(1, src, dst, codec="zstd")
        got = engine.load(1, tier="shared")
    assert len(reads) < 40, f"{len(reads)} reads for {len(state)} tensors"
    assert_same(state, got)


def test_a_copy_writes_zero_padding_whatever_the_source_padding_holds(tmp_path):
    """Kept chunks go down a tier as the window read, without a copy per chunk; the padding after
    each chunk is not under its checksum, so it is zeroed on the way, not copied."""
    state = {f"t{i}": torch.randn(3000 + 7 * i) for i in range(50)}
    with tiered.Engine.from_config(cluster(tmp_path, "zstd")) as engine:
        engine.save(1, state).wait()
        _, index = engine.read_index(1, tier="nvme")
        data = tmp_path / "nvme" / "step_000000000001" / index.data_file
        raw = bytearray(data.read_bytes())
        padded = [c for t in index.tensors for c in t.chunks if c.extent > c.size]
        assert len(padded) >= 40
        for c in padded:  # garbage in every chunk's padding
            raw[c.offset + c.size:c.offset + c.extent] = b"\xa5" * (c.extent - c.size)
        data.write_bytes(bytes(raw))
        migrate_step(1, engine.get_tier("nvme"), engine.get_tier("shared"), codec=None)
        copied = (tmp_path / "shared" / "step_000000000001" / index.data_file).read_bytes()
        for c in padded:
            assert copied[c.offset:c.offset + c.size] == raw[c.offset:c.offset + c.size]
            assert not any(copied[c.offset + c.size:c.offset + c.extent])
        assert_same(state, engine.load(1, tier="shared"))


def test_recompressed_chunks_are_gathered_padded_and_written_bit_exact(tmp_path):
    """Recompressed chunks are copied into 16 MiB gather buffers, reused once written, and padded
    there (copy_rank._Batches): chunks of 64 and 36 MiB take buffers of their own, 120 chunks of
    about 1 MiB fill the shared ones several times over (reused once written: stale bytes would
    show in the padding). Every chunk's padding in the target is zeros, and the step
    loads bit-exact."""
    g = torch.Generator().manual_seed(9)
    state = {"big": torch.randn(25 << 20, generator=g)}  # 100 MiB: chunks of 64 and 36 MiB
    state.update({f"t{i}": torch.randn((1 << 18) + 17 * i, generator=g) for i in range(120)})  # ~7 buffers' worth
    cfg = cluster(tmp_path, "none")
    cfg["chunk_size"] = "64MiB"
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        migrate_step(1, engine.get_tier("nvme"), engine.get_tier("shared"), codec="zstd")
        _, index = engine.read_index(1, tier="shared")
        assert {t.codec.name for t in index.tensors if t.chunks} == {"zstd"}
        data = (tmp_path / "shared" / "step_000000000001" / index.data_file).read_bytes()
        for c in (c for t in index.tensors for c in t.chunks):
            assert not any(data[c.offset + c.size:c.offset + c.extent])
        assert_same(state, engine.load(1, tier="shared"))


def test_a_copy_reads_small_windows_first_then_doubles_them(tmp_path):
    """A migration's first bytes reach the target after one small read, not after 64 MiB read and
    verified: windows start at FIRST_WINDOW_BYTES and double up to WINDOW_BYTES."""
    from tiered.format.manifest import present_ranks
    from tiered.stage.cpu import FIRST_WINDOW_BYTES, WINDOW_BYTES, chunk_windows, file_order

    mib = 1 << 20
    state = {f"t{i}": torch.arange(i, i + 6 * mib // 4, dtype=torch.float32) for i in range(40)}  # 240 MiB
    cfg = {"tiers": [{"name": "nvme", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "none"}],
           "migration": "external", "chunk_size": "1MiB"}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        tier = engine.get_tier("nvme")
        _, (index,) = present_ranks(tier, 1)
        reader = tier.open_data_reader(1, index.data_file, device=False)
        try:
            sizes = [len(data) for _, data, _ in chunk_windows(file_order(index.tensors), reader)]
        finally:
            reader.close()
    assert sum(sizes) == 240 * mib
    assert sizes[:5] == [FIRST_WINDOW_BYTES, 2 * FIRST_WINDOW_BYTES, 4 * FIRST_WINDOW_BYTES, 8 * FIRST_WINDOW_BYTES,
                         min(16 * FIRST_WINDOW_BYTES, WINDOW_BYTES)]
    assert max(sizes) == WINDOW_BYTES


def test_windows_are_read_in_file_order_at_most_the_readers_parallel_reads_at_once(tmp_path):
    """A local file's reader reads two windows at once (`LocalDataReader.parallel_reads`): the next
    one and one ahead, so the first lands alone instead of with the 120 MiB read beside it; a
    shared filesystem's reads more (`SHARED_PARALLEL_READS`), and a reader that does not say,
    `_READERS`. Reads are handed to the reader's threads in file order, so each starts within
    `parallel_reads - 1` places of its place in the file (threads that took two reads in order may
    enter them in the other: that is all a pool of threads promises)."""
    import threading

    from tiered.format.manifest import present_ranks
    from tiered.stage.cpu import WindowBuffers, chunk_windows, file_order
    from tiered.tiers.posix import SHARED_PARALLEL_READS

    class Recorder:
        """Counts the reads in flight. Each read waits until `meet` of them are in flight at once
        (then none waits any more), so that reads overlap as far as the reader lets them, whatever
        the machine's speed; a reader that never has `meet` in flight leaves each read waiting
        `PATIENCE_S`, and the count below says so."""

        PATIENCE_S = 5.0

        def __init__(self, inner, hide=False, meet=2):
            self.inner, self.hide, self.meet = inner, hide, meet
            self.cond, self.now, self.most, self.starts, self.met = threading.Condition(), 0, 0, [], False

        def __getattr__(self, name):
            if name == "parallel_reads" and self.hide:
                raise AttributeError(name)
            return getattr(self.inner, name)

        def read_into(self, offset, out):
            with self.cond:
                self.now += 1
                self.most = max(self.most, self.now)
                self.starts.append(offset)
                self.met = self.met or self.now >= self.meet
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.met, timeout=self.PATIENCE_S)
            self.inner.read_into(offset, out)
            with self.cond:
                self.now -= 1

    mib = 1 << 20
    state = {f"t{i}": torch.arange(i, i + 6 * mib // 4, dtype=torch.float32) for i in range(40)}  # 240 MiB: 7 windows
    cfg = {"tiers": [{"name": "nvme", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "none"},
                     {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "none"}],
           "migration": "external", "chunk_size": "1MiB"}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        tier = engine.get_tier("nvme")
        _, (index,) = present_ranks(tier, 1)
        shared = engine.get_tier("shared")
        migrate_step(1, tier, shared, codec=None)
        shared_reader = shared.open_data_reader(1, index.data_file, device=False)
        assert shared_reader.parallel_reads == SHARED_PARALLEL_READS > 2
        shared_reader.close()
        for hide, most in ((False, 2), (True, None)):
            inner = tier.open_data_reader(1, index.data_file, device=False)
            rec, buffers = Recorder(inner, hide, meet=most or 3), WindowBuffers()
            try:
                got = b"".join(bytes(data) for _, data, _ in chunk_windows(file_order(index.tensors), rec, buffers))
            finally:
                inner.close()
            in_file = sorted(rec.starts)
            places = [abs(i - in_file.index(offset)) for i, offset in enumerate(rec.starts)]
            at_once = most or len(rec.starts)  # (the default's eight threads: any order of the seven)
            assert len(got) == 240 * mib and len(rec.starts) == 7 and max(places) < at_once, (rec.starts, at_once)
            if most is not None:
                assert rec.most == most, rec.most
            else:  # the default (8 threads) with windows of 4-64 MiB in 128 MiB of read-ahead: five at once
                assert rec.most > 2, rec.most
            data = (tmp_path / "nvme" / "step_000000000001" / index.data_file).read_bytes()
            assert got == data[:len(got)]


def test_a_migrator_keeps_its_read_windows_from_one_step_to_the_next(tmp_path):
    from tiered.stage.cpu import WindowBuffers

    state = {f"t{i}": torch.randn(300_000, generator=torch.Generator().manual_seed(i)) for i in range(8)}
    with tiered.Engine.from_config(cluster(tmp_path, "zstd")) as engine:
        engine.save(1, state).wait()
        engine.save(2, state).wait()
        buffers = WindowBuffers()
        for step in (1, 2):
            assert migrate_step(step, engine.get_tier("nvme"), engine.get_tier("shared"), codec=None, buffers=buffers)
            assert buffers.kept_bytes > 0  # the next step reads into this memory, not into fresh pages
        engine.get_tier("nvme").delete(2)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        assert engine.restore(target, step=2) == 2  # from the shared tier: the copy is whole
    assert_same(target, state)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_chunk_stored_as_it_is_is_re_encoded_from_the_bytes_read_and_its_size_checked(tmp_path, codec):
    """`tiered.stage.cpu.decoded`: a `none` chunk's raw bytes are the verified bytes read, handed on
    with no decode and no copy (a recompression to zstd encodes from them); another codec's are
    decoded into new memory. A stored size that is not the raw size is a damaged chunk, named."""
    import dataclasses

    from tiered.codecs import get_codec
    from tiered.config import ZstdSettings
    from tiered.format.manifest import read_manifest, read_rank_index
    from tiered.stage.cpu import decoded

    w = torch.randn(3000, generator=torch.Generator().manual_seed(2))
    with tiered.Engine.from_config(cluster(tmp_path, codec)) as engine:
        engine.save(1, {"w": w}).wait()
        nvme = engine.get_tier("nvme")
        manifest = read_manifest(nvme, 1)
        (rec,) = read_rank_index(nvme, 1, manifest.ranks[0]).tensors
    c = rec.chunks[0]
    data = (tmp_path / "nvme" / "step_000000000001" / manifest.ranks[0].data_file).read_bytes()
    stored = memoryview(data)[c.offset:c.offset + c.size]
    got = decoded(get_codec(rec.codec, ZstdSettings()), rec, 0, stored, "the data file")
    assert bytes(got) == w.numpy().tobytes()
    assert (got is stored) == (codec == "none")
    if codec == "none":
        short = dataclasses.replace(rec, chunks=[c._replace(raw_size=c.raw_size + 4)])
        with pytest.raises(tiered.CorruptionError, match="the data file: tensor 'w' chunk 0 of 1"):
            decoded(get_codec(rec.codec, ZstdSettings()), short, 0, stored, "the data file")


def test_recompression_hands_the_pool_runs_of_small_chunks_and_still_names_a_damaged_one(tmp_path, monkeypatch):
    """none -> zstd of many small tensors: the chunks go to the pool in runs of about
    RECOMPRESS_GROUP_BYTES (one task each, not one per chunk), come back in order (the copy
    restores bit-exact), and a damaged chunk inside a run is still reported by its tensor."""
    from concurrent.futures import ThreadPoolExecutor

    from tiered.format.manifest import read_manifest, read_rank_index
    from tiered.migrate import copy_rank

    class Counting(ThreadPoolExecutor):
        tasks = 0

        def submit(self, *args, **kwargs):
            Counting.tasks += 1
            return super().submit(*args, **kwargs)

    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(5000 + i, generator=g) for i in range(60)}  # ~20 KB each: 60 chunks, ~1.2 MB
    cfg = cluster(tmp_path, "none")
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, state).wait()
        engine.save(2, state).wait()
        nvme, shared = engine.get_tier("nvme"), engine.get_tier("shared")
        with Counting(2) as pool:
            migrate_step(1, nvme, shared, codec="zstd", pool=pool)
        grouped, Counting.tasks = Counting.tasks, 0
        monkeypatch.setattr(copy_rank, "RECOMPRESS_GROUP_BYTES", 0)  # a task per chunk, as before
        with Counting(2) as pool:
            migrate_step(2, nvme, shared, codec="zstd", pool=pool)
        assert grouped <= 4 < 60 <= Counting.tasks, (grouped, Counting.tasks)
        for step in (1, 2):
            assert_same(state, engine.load(step, tier="shared"))

    # A chunk in the middle of a run damaged on the source: the copy fails naming it, and leaves nothing.
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(3, state).wait()
        nvme, shared = engine.get_tier("nvme"), engine.get_tier("shared")
        manifest = read_manifest(nvme, 3)
        index = read_rank_index(nvme, 3, manifest.ranks[0])
        rec = next(t for t in index.tensors if t.name == "t30")
        path = tmp_path / "nvme" / "step_000000000003" / manifest.ranks[0].data_file
        with open(path, "r+b") as f:
            f.seek(rec.chunks[0].offset + 100)
            byte = f.read(1)
            f.seek(rec.chunks[0].offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(tiered.errors.CorruptionError, match="t30"):
            migrate_step(3, nvme, shared, codec="zstd")
        assert not shared.has_step(3)
