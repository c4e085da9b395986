"""A node lost and restored from its peers' replicas (tests/node_worker.py is each rank).

Two torchrun launches on this machine are the two nodes of one job, 2 ranks each, each with its
own config and directories: a memory tier (a real tmpfs, /dev/shm) keeping one replica of each
rank on the other node, and a shared filesystem below. Node 1's ranks are lost with the job;
its memory is wiped; the job restarts and restores from node 0's replicas, bit for bit, and
trains on with the losses of a run that never stopped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from test_distributed import Rendezvous

WORKER = Path(__file__).with_name("node_worker.py")


def launch(nproc: int, args: list[str], nodes: int, rdzv: Rendezvous) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nodes}",
           *rdzv.args(), str(WORKER), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def job(configs: list[str], *args: str, nproc: int = 2) -> list[str]:
    """Run one job of len(configs) nodes (one launch each, in node order); each node's output."""
    rdzv = Rendezvous()
    procs = [launch(nproc, [*args, "--config", cfg], len(configs), rdzv) for cfg in configs]
    outs = []
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise AssertionError(f"node {i}: {' '.join(args)} failed (exit {proc.returncode}):\n{out[-3000:]}\n"
                                 f"{err[-6000:]}")
        outs.append(out + err)
    return outs


def losses(text: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^loss (\d+) (\S+)$", text, re.M)}


def memory_only(tmp_path: Path, nodes: int, replicas: int) -> tuple[Path, list[str]]:
    """Per node a config of one memory tier under /dev/shm (tmpfs) keeping `replicas`; the folder
    holding them (removed by the caller) and the configs."""
    shm = Path("/dev/shm") / f"tiered-test-{uuid.uuid4().hex[:8]}"
    configs = []
    for i in range(nodes):
        path = tmp_path / f"node{i}.yaml"
        path.write_text(yaml.safe_dump({"version": 1, "chunk_size": "64KiB", "tiers": [
            {"name": "mem", "kind": "memory", "path": str(shm / f"node{i}"), "replicas": replicas, "codec": "zstd"}]}))
        configs.append(str(path))
    return shm, configs


@pytest.fixture
def cluster(tmp_path):
    """Per node: a memory tier under /dev/shm (tmpfs) keeping 1 replica, and the shared tier."""
    shm = Path("/dev/shm") / f"tiered-test-{uuid.uuid4().hex[:8]}"
    memory = [shm / f"node{i}" for i in range(2)]
    configs = []
    for i in range(2):
        path = tmp_path / f"node{i}.yaml"
        path.write_text(yaml.safe_dump({"version": 1, "chunk_size": "64KiB", "migration": "in_process", "tiers": [
            {"name": "mem", "kind": "memory", "path": str(memory[i]), "replicas": 1, "keep_last": 2, "codec": "zstd"},
            {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd"}]}))
        configs.append(str(path))
    yield configs, memory, tmp_path
    shutil.rmtree(shm, ignore_errors=True)


def test_a_lost_node_is_restored_from_its_peers_and_training_goes_on_as_if_it_never_stopped(cluster):
    configs, memory, tmp = cluster
    reference = losses(job(configs, "train", "--steps", "10")[0])
    shutil.rmtree(memory[0].parent)
    shutil.rmtree(tmp / "shared")
    shards = str(tmp / "shards")
    job(configs, "train", "--steps", "10", "--die-after", "6", "--shards", shards)
    # Node 1 is lost: its memory is gone. Node 0 keeps its own steps and node 1's replicas.
    assert sorted(p.name for p in (memory[0] / ".replicas").iterdir()) == ["rank_00002", "rank_00003"]
    assert (memory[0] / ".replicas" / "rank_00002" / "step_000000000006" / "MANIFEST.json").is_file()
    # Replicas are kept as the tier keeps its steps (keep_last 2), and are none of the node's steps.
    for source in ("rank_00002", "rank_00003"):
        assert sorted(p.name for p in (memory[0] / ".replicas" / source).glob("step_*")) == \
            ["step_000000000004", "step_000000000006"]
    assert not list((memory[0] / "step_000000000006").glob("rank_00002*"))
    shutil.rmtree(memory[1])
    shutil.rmtree(tmp / "shared", ignore_errors=True)  # (no slower tier to fall back on)
    outs = job(configs, "resume", "--steps", "10", "--shards", shards, "--expect", "6")
    assert "restored 6" in outs[0] and "restored 6" in outs[1]
    text = "\n".join(outs)
    assert re.search(r"rank 2's files came from rank 0's replica \(.* in .* s, .*/s; every chunk checked", text), text[-3000:]
    assert re.search(r"rank 3's files came from rank 1's replica", text), text[-3000:]
    resumed = losses(outs[0])
    assert sorted(resumed) == [7, 8, 9, 10]
    assert all(resumed[s] == reference[s] for s in resumed), (resumed, reference)
    # Node 1 holds its own ranks' files of step 6 again.
    d = memory[1] / "step_000000000006"
    assert sorted(p.name for p in d.glob("rank_*.index.json")) == ["rank_00002.index.json", "rank_00003.index.json"]


def corrupt_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("replica", ["corrupted", "lost"])
def test_a_replica_that_fails_its_check_or_is_gone_gives_way_to_the_shared_tier(cluster, replica):
    configs, memory, tmp = cluster
    shards = str(tmp / "shards")
    job(configs, "train", "--steps", "6", "--die-after", "6", "--migrate", "--shards", shards)
    shutil.rmtree(memory[1])
    kept = memory[0] / ".replicas" / "rank_00002" / "step_000000000006"
    if replica == "corrupted":
        corrupt_middle(kept / "rank_00002.data")
    else:
        shutil.rmtree(memory[0] / ".replicas")
    outs = job(configs, "resume", "--steps", "6", "--shards", shards, "--expect", "6")
    text = "\n".join(outs)
    assert "restored 6" in outs[0] and "restored 6" in outs[1]
    if replica == "corrupted":  # rank 2 read the shared tier; rank 3's replica was sound
        assert re.search(r"rank 2's files from the slower tiers \(rank 0's replica failed: .*corrupted", text), text[-3000:]
        assert "rank 3's files came from rank 1's replica" in text
    else:
        assert "rank 2's files from the slower tiers (no peer keeps them)" in text, text[-3000:]


def test_a_damaged_replica_is_asked_of_the_next_node_keeping_one(tmp_path):
    # Three nodes of one rank, two replicas each: rank 2's are on nodes 0 and 1.
    shm, configs = memory_only(tmp_path, nodes=3, replicas=2)
    try:
        shards = str(tmp_path / "shards")
        job(configs, "train", "--steps", "4", "--die-after", "4", "--shards", shards, nproc=1)
        for holder in (0, 1):
            assert (shm / f"node{holder}" / ".replicas" / "rank_00002" / "step_000000000004").is_dir()
        shutil.rmtree(shm / "node2")
        corrupt_middle(shm / "node0" / ".replicas" / "rank_00002" / "step_000000000004" / "rank_00002.data")
        outs = job(configs, "resume", "--steps", "6", "--shards", shards, "--expect", "4", nproc=1)
        text = "\n".join(outs)
        assert all("restored 4" in o for o in outs)
        assert "rank 2's replica (its files) from rank 0 failed" in text, text[-3000:]
        assert "rank 2's files came from rank 1's replica" in text, text[-3000:]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_tiered_restore_under_torchrun_brings_a_replaced_nodes_files_from_its_peers(cluster):
    configs, memory, tmp = cluster
    shards = str(tmp / "shards")
    job(configs, "train", "--steps", "4", "--die-after", "4", "--shards", shards)
    shutil.rmtree(memory[1])
    rdzv = Rendezvous()
    procs = []
    for cfg in configs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=2", *rdzv.args(),
               "-m", "tiered.cli.restore", "--config", cfg]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert "rank 0: step 4: its files are on this node (mem)" in outs[0], outs[0]
    assert re.search(r"rank 2: step 4: its files came from rank 0's replica \(.*\), onto tier 'mem'", outs[1]), outs[1]
    d = memory[1] / "step_000000000004"
    assert sorted(p.name for p in d.glob("rank_*.index.json")) == ["rank_00002.index.json", "rank_00003.index.json"]
    out = subprocess.run([sys.executable, "-m", "tiered.cli", "verify", "--config", configs[1], "--step", "4"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ranks [2, 3] of 4 here" in out.stdout, out.stdout + out.stderr
    outs = job(configs, "resume", "--steps", "5", "--shards", shards, "--expect", "4")
    assert "came from" not in "\n".join(outs)  # (every rank's files were on its node)


def test_a_job_of_node_local_tiers_restores_each_rank_from_its_own_node(tmp_path):
    # No replicas and no shared tier: each node holds its own ranks' files and a copy of every
    # replicated item (the step, the optimizer's step counts), so each restores alone.
    shm, configs = memory_only(tmp_path, nodes=2, replicas=0)
    try:
        shards = str(tmp_path / "shards")
        job(configs, "train", "--steps", "4", "--die-after", "4", "--shards", shards)
        for i, ranks in ((0, ["rank_00000", "rank_00001"]), (1, ["rank_00002", "rank_00003"])):
            d = shm / f"node{i}" / "step_000000000004"
            assert sorted(p.name.split(".")[0] for p in d.glob("rank_*.index.json")) == ranks
        outs = job(configs, "resume", "--steps", "5", "--shards", shards, "--expect", "4")
        assert all("restored 4" in o for o in outs)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_replicas_kept_by_an_earlier_run_serve_a_restart_that_keeps_none(cluster):
    configs, memory, tmp = cluster
    shards = str(tmp / "shards")
    job(configs, "train", "--steps", "4", "--die-after", "4", "--shards", shards)
    shutil.rmtree(memory[1])
    for cfg in configs:  # the restarted job asks for no replicas
        doc = yaml.safe_load(Path(cfg).read_text())
        doc["tiers"][0]["replicas"] = 0
        Path(cfg).write_text(yaml.safe_dump(doc))
    outs = job(configs, "resume", "--steps", "5", "--shards", shards, "--expect", "4")
    assert "rank 2's files came from rank 0's replica" in "\n".join(outs)
