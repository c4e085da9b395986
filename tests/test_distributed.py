"""Multi-rank saves and loads under torchrun (gloo on CPU): tests/dist_worker.py is each rank.

Saved at 4 ranks, loaded at 4, 2 and 1, bit for bit, through Engine.save/restore and through
dcp.save/dcp.load with tiered's storage; and restored from S3 alone after migration.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

WORKER = Path(__file__).with_name("dist_worker.py")


class Rendezvous:
    """The rendezvous of a job of several torchrun launches (nodes) on this machine: a TCPStore this
    test process hosts, on a port the system gave it and holds (never a port found free, released
    and bound again: another process may take it between), which each node's agent joins as a
    client (c10d backend, `is_host=false`). The agents' workers then meet at the store the first
    agent hosts for them, on a port it holds too. Node ranks follow the order in which the agents
    were started (c10d ranks the nodes of one host by their agents' process ids): `nodes()` starts
    them in order."""

    def __init__(self) -> None:
        from torch.distributed import TCPStore

        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
        self.id = f"tiered-test-{os.getpid()}-{id(self)}"

    def args(self) -> list[str]:
        return ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.store.port}", f"--rdzv-id={self.id}",
                "--rdzv-conf=is_host=false"]


def launch(nproc: int, *args: str, nodes: int = 1, rdzv: Rendezvous | None = None) -> subprocess.Popen:
    where = ["--standalone"] if rdzv is None else [f"--nnodes={nodes}", *rdzv.args()]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *where, str(WORKER), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen, what: str) -> None:
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed (exit {proc.returncode}):\n{out[-3000:]}\n{err[-6000:]}")


def torchrun(nproc: int, *args: str) -> None:
    finish(launch(nproc, *args), f"{' '.join(args)} at {nproc} ranks")


def two_nodes(configs: list[str], *args: str) -> None:
    """Two torchrun agents on this machine as nodes 0 and 1 of one job, 2 ranks each, each node
    with its own config (its own node-local directory)."""
    rdzv = Rendezvous()
    procs = [launch(2, *args, "--config", cfg, nodes=2, rdzv=rdzv) for cfg in configs]
    for i, proc in enumerate(procs):
        finish(proc, f"node {i}: {' '.join(args)}")


def write_config(path: Path, tiers: list[dict]) -> str:
    path.write_text(yaml.safe_dump({"version": 1, "chunk_size": "64KiB", "tiers": tiers}))
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 100-102 (Engine.save; 101 and 102 with the cached plan) and 110 (dcp.save) saved at
    4 ranks on one local tier."""
    root = tmp_path_factory.mktemp("dist")
    cfg = write_config(root / "local.yaml", [{"name": "local", "kind": "local", "path": str(root / "nvme"),
                                             "codec": "zstd"}])
    torchrun(4, "save", "--config", cfg, "--step", "100", "--how", "engine", "--repeats", "2")
    torchrun(4, "save", "--config", cfg, "--step", "110", "--how", "dcp")
    return root, cfg


def test_save_at_4_ranks_writes_each_ranks_files_and_one_manifest(saved):
    root, _ = saved
    for step in (100, 101, 102, 110):
        d = root / "nvme" / f"step_{step:012d}"
        manifest = json.loads((d / "MANIFEST.json").read_text())
        assert manifest["world_size"] == 4 and manifest["dcp"]["file"] == "dcp_metadata.json"
        ranks = [r["rank"] for r in manifest["ranks"]]
        assert ranks == [0, 1, 2, 3]  # every rank holds a shard of something
        for r in ranks:
            assert (d / f"rank_{r:05d}.index.json").is_file()
        assert not [p.name for p in d.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("nproc", [4, 3, 2, 1])  # 3: rows split across saved shards, read in part
@pytest.mark.parametrize("how", ["engine", "dcp"])
def test_load_at_any_world_size_is_bit_exact(saved, nproc, how):
    _, cfg = saved
    torchrun(nproc, "load", "--config", cfg, "--step", "102" if how == "engine" else "110", "--how", how)


def test_warm_saves_reuse_the_plan_until_the_state_changes_structure(tmp_path):
    """DCP plans the first save and the first after a tensor is added; the others reuse the plan
    and still save each save's values (tensors and plain values), restored bit-exact."""
    cfg = write_config(tmp_path / "c.yaml", [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"),
                                            "codec": "zstd"}])
    torchrun(2, "save-change", "--config", cfg, "--step", "200")


def test_reserve_plans_with_dcp_so_the_first_save_does_not(tmp_path):
    """Under torchrun, reserve() on every rank plans the saves with DCP (a collective); the first
    save reuses that plan, the rest as above, every step restored bit-exact."""
    cfg = write_config(tmp_path / "c.yaml", [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"),
                                            "codec": "zstd"}])
    torchrun(2, "save-change", "--config", cfg, "--step", "200", "--reserve")


def test_saves_plan_over_a_gloo_group_where_the_default_group_is_nccl(tmp_path):
    """With a default group of no CPU backend (NCCL: the engine is told so), the planning's
    collectives run on a gloo group the engine makes once, never on GPU tensors, whose `.item()`
    would wait for everything training queued on its stream; plans reused and made again, every
    step restored bit-exact. (On this CPU machine a CUDA tensor would fail the save outright;
    with real NCCL on 2 GPUs: scripts/gpu_dist_check.sh.)"""
    cfg = write_config(tmp_path / "c.yaml", [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"),
                                            "codec": "zstd"}])
    torchrun(2, "save-change", "--config", cfg, "--step", "200", "--reserve", "--as-nccl")


@pytest.mark.parametrize("how", [["--as-nccl"], [], ["--as-nccl", "--auto"], ["--as-nccl", "--stage-after", "60000"]],
                         ids=["defer_walk", "defer_walk_on_the_default_group", "default_guard", "stage_after"])
def test_guarded_saves_at_2_ranks_plan_on_the_stager_thread_and_save_the_state_as_it_was(tmp_path, how):
    """With the optimizer guarded with `defer_walk=True`, a distributed save's call after the
    first walks nothing: it clones the unguarded buffer and returns; each rank's stager thread
    plans with DCP (the all-reduce among them, on the gloo group the engine makes where the
    default group is NCCL) and reads the state. Where the planning would run on the default
    group (gloo here), which training's collectives use from their threads, it stays in the
    call; under the default guard too, however long it took (DEFER_AFTER_MS at 0 here). The
    buffer changes and the optimizer steps right after each call: every step restores
    bit-exact to the state at its save. With `stage_after_ms` at 60 s, the optimizer step or the
    handle's `wait()` starts each save's reads (the saves take far less than 30 s)."""
    cfg = write_config(tmp_path / "c.yaml", [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"),
                                            "codec": "zstd"}])
    torchrun(2, "save-guarded", "--config", cfg, "--step", "400", *how)


def test_the_commit_thread_sets_off_no_full_collection(tmp_path):
    """At 2 ranks of 8,320 tensors, six saves: no full pass of Python's collector on the commit
    thread (two a save, 310-420 ms each, before its object bursts ran with the collector paused)."""
    cfg = write_config(tmp_path / "c.yaml", [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"),
                                            "codec": "none"}])
    torchrun(2, "save-gc", "--config", cfg, "--step", "300")


def test_the_cpu_group_is_the_default_one_where_it_has_gloo_and_a_failure_to_make_one_names_the_remedy(monkeypatch):
    from tiered.distributed import saver as distributed
    from tiered.errors import TieredError

    made = []
    monkeypatch.setattr(distributed.dist, "new_group", lambda **k: made.append(k) or "group")
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(distributed, "default_backend", lambda b=backend: b)
        assert distributed.cpu_group(60) is None
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed, "default_backend", lambda: "nccl")
    assert distributed.cpu_group(60) == "group" and made == [{"backend": "gloo", "timeout": timedelta(seconds=60)}]

    def refuse(**k):
        raise RuntimeError("Gloo connectFullMesh failed")

    monkeypatch.setattr(distributed.dist, "new_group", refuse)
    with pytest.raises(TieredError, match=r"'nccl'.*connectFullMesh.*cpu:gloo,cuda:nccl.*GLOO_SOCKET_IFNAME"):
        distributed.cpu_group(60)


def test_dcp_async_save_on_tiered_storage(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme")}])
    torchrun(4, "save", "--config", cfg, "--step", "5", "--how", "async")
    torchrun(2, "load", "--config", cfg, "--step", "5", "--how", "dcp")


def test_a_rank_that_cannot_write_fails_the_step_on_every_rank(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme")}])
    torchrun(4, "save-fail", "--config", cfg, "--step", "40")
    d = tmp_path / "nvme"
    assert not (d / "step_000000000040" / "MANIFEST.json").exists()
    assert (d / "step_000000000041" / "MANIFEST.json").is_file()
    torchrun(2, "load", "--config", cfg, "--step", "41")


def test_a_restore_that_fails_on_one_rank_fails_on_every_rank(saved):
    """Each rank plans and reads its part alone (no plans gathered on rank 0); a failure on one rank
    still fails the restore on all, naming that rank, and the next restore succeeds on all."""
    root, cfg = saved
    torchrun(2, "load-fail", "--config", cfg, "--step", "100")


def test_cli_verifies_a_distributed_step(saved):
    _, cfg = saved
    proc = subprocess.run([sys.executable, "-m", "tiered.cli", "verify", "--config", cfg, "--step", "all"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_restored_from_s3_only(tmp_path, s3_server, s3_bucket):
    nvme = tmp_path / "nvme"
    s3 = {"name": "s3", "kind": "s3", "bucket": s3_bucket, "prefix": "dist", "endpoint_url": s3_server.endpoint_url,
          "region": "us-east-1", "codec": "zstd"}
    cfg = write_config(tmp_path / "tiers.yaml", [{"name": "local", "kind": "local", "path": str(nvme), "codec": "none"},
                                                 s3])
    torchrun(4, "save", "--config", cfg, "--step", "200", "--how", "engine", "--migrate")
    from tiered.tiers.s3 import S3Tier

    tier = S3Tier("s3", s3_bucket, "dist", endpoint_url=s3_server.endpoint_url, region="us-east-1")
    assert tier.steps() == [200]
    shutil.rmtree(nvme)  # the local copies are gone: only S3 has the step
    for nproc in (2, 1):  # (resharded from 4; all 4 ranks' files come from S3 in tiered-restore below)
        torchrun(nproc, "load", "--config", cfg, "--step", "200", "--how", "engine")
    torchrun(2, "load", "--config", cfg, "--step", "200", "--how", "dcp", "--tier", "s3")
    # A cold start: tiered-restore copies every rank's files down to the local tier, verified.
    from tiered.cli import restore_main

    assert restore_main(["--config", cfg, "-q"]) == 0
    manifest = json.loads((nvme / "step_000000000200" / "MANIFEST.json").read_text())
    assert [r["rank"] for r in manifest["ranks"]] == [0, 1, 2, 3] and manifest["dcp"]
    torchrun(3, "load", "--config", cfg, "--step", "200", "--how", "engine", "--tier", "local")


def test_two_nodes_commit_locally_and_each_migrates_its_own_ranks(tmp_path):
    # Nodes with their own NVMe and one shared filesystem: each node's local tier gets the
    # manifest and its own ranks' files; each node migrates its own ranks; the shared tier
    # commits the step once both have. Then node 1's disk is lost and 4 ranks load anyway.
    shared = {"name": "shared", "kind": "posix", "path": str(tmp_path / "lustre"), "codec": "zstd"}
    configs = [write_config(tmp_path / f"node{i}.yaml", [
        {"name": "local", "kind": "local", "path": str(tmp_path / f"nvme{i}"), "codec": "none"}, shared])
        for i in range(2)]
    two_nodes(configs, "save", "--step", "300", "--how", "engine", "--migrate")
    two_nodes(configs, "save", "--step", "301", "--how", "dcp", "--migrate")
    for step in (300, 301):
        for i, ranks in ((0, [0, 1]), (1, [2, 3])):
            d = tmp_path / f"nvme{i}" / f"step_{step:012d}"
            assert json.loads((d / "MANIFEST.json").read_text())["world_size"] == 4
            assert sorted(p.name for p in d.glob("rank_*.index.json")) == [f"rank_{r:05d}.index.json" for r in ranks]
        d = tmp_path / "lustre" / f"step_{step:012d}"
        manifest = json.loads((d / "MANIFEST.json").read_text())
        assert [r["rank"] for r in manifest["ranks"]] == [0, 1, 2, 3]
        assert all((d / r["index_file"]).is_file() for r in manifest["ranks"])
    # Each node's tools see its own ranks on its NVMe, and all of them on the shared tier.
    out = subprocess.run([sys.executable, "-m", "tiered.cli", "verify", "--config", configs[1], "--step", "300"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ranks [2, 3] of 4 here" in out.stdout and out.stdout.count("ok ") == 2
    out = subprocess.run([sys.executable, "-m", "tiered.cli", "ls", "--config", configs[0]], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "(2 of 4 ranks here)" in out.stdout and "UNREADABLE" not in out.stdout, out.stdout
    shutil.rmtree(tmp_path / "nvme1")
    two_nodes(configs, "load", "--step", "300", "--how", "engine")
    torchrun(1, "load", "--config", configs[0], "--step", "301", "--how", "dcp")


@pytest.mark.parametrize("shape,itemsize,chunk", [((37, 11, 5), 4, 64), ((1000,), 2, 96), ((), 8, 64),
                                                  ((6, 300), 4, 4096), ((3, 4, 5, 6), 1, 16)])
def test_box_chunks_marks_exactly_the_chunks_holding_the_box(shape, itemsize, chunk):
    # What a resharding rank decodes: every chunk holding a byte of its box, and no other.

    import numpy as np

    from tiered.dcp import box_chunks

    rng = np.random.default_rng(0)
    numel = int(np.prod(shape)) if shape else 1
    nchunks = -(-numel * itemsize // chunk)
    flat = np.arange(numel).reshape(shape)
    for _ in range(30):
        offsets = [int(rng.integers(0, n)) for n in shape]
        lengths = [int(rng.integers(1, n - o + 1)) for n, o in zip(shape, offsets)]
        box = flat[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] if shape else flat
        want = np.zeros(nchunks, dtype=bool)
        for e in np.asarray(box).ravel():
            want[e * itemsize // chunk:(e * itemsize + itemsize - 1) // chunk + 1] = True
        mark = np.zeros(nchunks, dtype=bool)
        box_chunks(shape, itemsize, offsets, lengths, chunk, mark)
        assert (mark == want).all(), (offsets, lengths)
    mark = np.zeros(nchunks, dtype=bool)
    box_chunks(shape, itemsize, [0] * len(shape), [0] * len(shape), chunk, mark) if shape else None
    assert not mark.any()


def _first_json_line(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """The first JSON line a rank prints (its outcome). Its launcher is then stopped: with a node
    gone, torchrun's agent would wait minutes at its exit barrier for the other agent."""
    import selectors
    import time

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=1.0):
                line = proc.stdout.readline()
                if line.startswith("{"):
                    return json.loads(line)
                if not line and proc.poll() is not None:
                    break
        tail = proc.stderr.read()[-4000:] if proc.poll() is not None else ""
        raise AssertionError(f"no outcome from the surviving rank:\n{tail}")
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("during", ["commit", "restore"])
def test_a_rank_that_dies_ends_the_others_with_its_name_and_no_half_committed_step(tmp_path, during):
    """Two nodes (one rank each, two torchrun launches); rank 1's process dies mid-commit or
    mid-restore. Rank 0 ends, in bounded time, with an error that names rank 1 and what it was
    doing; a save leaves no committed step."""
    cfg = {"version": 1, "chunk_size": "64KiB", "distributed_timeout": "5s",
           "tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"), "codec": "zstd"}]}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    if during == "restore":
        torchrun(2, "save", "--config", str(path), "--step", "7", "--how", "engine")
    rdzv = Rendezvous()
    mode = "save-dies" if during == "commit" else "load-dies"
    procs = [launch(1, mode, "--config", str(path), "--step", "8" if during == "commit" else "7", nodes=2, rdzv=rdzv)
             for _ in (0, 1)]
    try:
        assert procs[1].wait(timeout=300) != 0, "rank 1 was to die"
        out0 = _first_json_line(procs[0])
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert out0["error"] is not None and "rank 1 (last seen: " in out0["error"], out0
    if during == "commit":
        assert "step 8 was not committed" in out0["error"] and "writing its files" in out0["error"], out0
        assert "within 0:00:05 (distributed_timeout)" in out0["error"], out0
        assert out0["committed"] is False and not (tmp_path / "nvme" / "step_000000000008" / "MANIFEST.json").exists()
    else:
        assert "the restore of step 7: agreeing on its outcome" in out0["error"], out0
        assert "reading its part" in out0["error"], out0
        assert out0["committed"] is True  # (the step restored from is untouched)
