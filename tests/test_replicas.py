"""The pieces of replicas and peer restores that need no job: placement, the restore decision,
replicated items once a node, the metadata's copies, replicas under a memory tier's budget, and a
replica whose sender is lost mid-way."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from tiered.distributed.commit import StoredItem, locations_of, metadata_from_json, metadata_to_json
from tiered.distributed.node_plan import with_node_copies
from tiered.distributed.nodes import Nodes, replicas_to_keep
from tiered.errors import FormatError
from tiered.policy import Holdings, peer_restore_plan
from tiered.tiers.memory import MemoryTier


def test_replicas_go_to_the_same_local_rank_on_the_next_nodes():
    nodes = Nodes.from_keys(["a", "a", "b", "b", "c", "c"])
    assert nodes.count == 3 and nodes.local_ranks(3) == [2, 3]
    assert nodes.holders(0, 1) == [2] and nodes.holders(5, 1) == [1]
    assert nodes.holders(1, 2) == [3, 5] and nodes.holders(1, 7) == [3, 5]  # (no more nodes than there are)
    assert nodes.sources(2, 1) == [0] and sorted(nodes.sources(2, 2)) == [0, 4]
    uneven = Nodes.from_keys(["a", "a", "a", "b"])
    assert uneven.holders(2, 1) == [3] and uneven.holders(3, 1) == [0]
    assert replicas_to_keep([1, 1, 1, 1, 1, 1], nodes, 0) == 1
    assert replicas_to_keep([3, 3, 3, 3, 3, 3], nodes, 0) == 2  # (three nodes: two others)
    assert replicas_to_keep([2, 2, 0, 2, 2, 2], nodes, 0) == 0  # (the fewest any config asks)


def own(*steps, world=4, listed=(0, 1, 2, 3)):
    return {s: (world, tuple(listed)) for s in steps}


@pytest.mark.parametrize("case,reports,step,want", [
    ("nothing lost", [Holdings(own(4, 6), {}) for _ in range(4)], None, (6, {}, ())),
    ("node 1 lost, replicas on node 0", [Holdings(own(4, 6), {6: {2: (4, (0, 1, 2, 3))}}),
                                         Holdings(own(4, 6), {6: {3: (4, (0, 1, 2, 3))}}),
                                         Holdings({}, {}), Holdings({}, {})], None, (6, {2: (0,), 3: (1,)}, ())),
    ("an older step complete only on the shared tier", [Holdings(own(6), {}), Holdings(own(6), {}),
                                                        Holdings({}, {}), Holdings({}, {}, slow=(4,))], None,
     (4, {}, ())),
    ("the newest step lacks rank 3: no replica, no shared copy", [Holdings(own(6), {6: {2: (4, (0, 1, 2, 3))}}),
                                                                 Holdings(own(6), {}), Holdings({}, {}),
                                                                 Holdings({}, {})], None, (None, {}, ())),
    ("asked for: what no peer keeps comes from slower tiers", [Holdings(own(6), {6: {2: (4, (0, 1, 2, 3))}}),
                                                              Holdings(own(6), {}), Holdings({}, {}),
                                                              Holdings({}, {}, slow=(6,))], 6, (6, {2: (0,)}, (3,))),
    ("a rank that stored nothing needs nothing", [Holdings(own(6, listed=(0, 1, 2)), {6: {2: (4, (0, 1, 2))}}),
                                                  Holdings(own(6, listed=(0, 1, 2)), {}), Holdings({}, {}),
                                                  Holdings({}, {})], None, (6, {2: (0,)}, ())),
])
def test_the_restore_step_and_who_sends_what(case, reports, step, want):
    plan = peer_restore_plan(reports, step)
    assert (plan.step, dict(plan.sends), tuple(plan.slow)) == want, case
    assert not plan.resharded


def test_a_step_of_another_world_size_is_resharded_from_the_shared_tier():
    reports = [Holdings(own(6, world=8), {}, slow=(6,)), Holdings(own(6, world=8), {})]
    plan = peer_restore_plan(reports)
    assert plan.step == 6 and plan.resharded and not plan.sends
    # Held on the nodes only, at another world size: not restorable from them.
    assert peer_restore_plan([Holdings(own(6, world=8), {}), Holdings(own(6, world=8), {})]).step is None


def test_holders_are_asked_nearest_first():
    kept = {6: {0: (3, (0, 1, 2))}}
    reports = [Holdings({}, {}), Holdings(own(6, world=3, listed=(0, 1, 2)), kept),
               Holdings(own(6, world=3, listed=(0, 1, 2)), kept)]
    assert peer_restore_plan(reports, node_of=[0, 2, 1]).sends == {0: (2, 1)}  # (node 1 is next to node 0)


def _item(fqn: str, kind=WriteItemType.BYTE_IO) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=kind)


def test_a_replicated_item_is_stored_once_a_node_by_its_least_loaded_rank():
    local = [SavePlan([_item("step"), _item(f"shard{r}")]) for r in range(4)]
    final = [SavePlan([_item("step"), _item("shard0")])] + [SavePlan([_item(f"shard{r}")]) for r in (1, 2, 3)]
    out = with_node_copies(local, final, [0, 0, 1, 1])
    assert [[i.index.fqn for i in p.items] for p in out] == [["step", "shard0"], ["shard1"], ["shard2", "step"],
                                                             ["shard3"]]
    assert with_node_copies(local, final, [0, 0, 0, 0]) == final  # (one node: DCP's plan as it is)


def test_the_metadata_records_each_nodes_copy_and_refuses_a_bad_one():
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
    from torch.distributed.checkpoint.storage import WriteResult

    md = Metadata(state_dict_metadata={"step": BytesStorageMetadata()})
    results = [WriteResult(MetadataIndex("step"), 8, StoredItem(2, 5)), WriteResult(MetadataIndex("step"), 8,
                                                                                     StoredItem(0, 1))]
    locations = locations_of(results)
    assert locations[MetadataIndex("step")] == StoredItem(0, 1, copies=((2, 5),))
    raw = metadata_to_json(md, locations)
    back = metadata_from_json(raw, "test")
    assert back.storage_data[MetadataIndex("step")] == StoredItem(0, 1, copies=((2, 5),))
    doc = json.loads(raw)
    for bad in ([[9, 1, 1]], [[0, -1, 1]], [["0", 1, 1]], "x"):
        with pytest.raises(FormatError, match="cop"):
            metadata_from_json(json.dumps(dict(doc, copies=bad)).encode(), "test")


def _replica(memory: MemoryTier, source: int, step: int, nbytes: int) -> None:
    tier = memory.replica_tier(source)
    tier.begin_step(step)
    tier.file_path(step, "rank.data").write_bytes(os.urandom(nbytes))
    tier.commit(step, b"{}")


def test_replicas_are_no_steps_of_the_tier_and_give_way_to_its_own_saves(tmp_path):
    memory = MemoryTier("mem", tmp_path / "shm", size=64 << 20, memory_only=False)
    for step in (2, 4, 6):
        _replica(memory, 3, step, 4 << 20)
    _replica(memory, 5, 6, 4 << 20)
    assert memory.steps() == [] and memory.replica_sources() == [3, 5]
    assert memory.used_bytes() >= 16 << 20
    freed = memory.shed_replicas(6 << 20)  # the oldest go first; never a source's newest
    assert freed >= 6 << 20 and memory.replica_tier(3).steps() == [6] and memory.replica_tier(5).steps() == [6]
    assert memory.shed_replicas(1 << 30) == 0


def _sender_dies_midway(rank: int, path: str, saved: str, root: str) -> None:
    import torch.distributed as dist

    from tiered.distributed import transfer
    from tiered.tiers.local import LocalTier

    store = dist.FileStore(path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    transfer.PIECE = 1 << 20
    if rank == 0:  # a real step's files, cut off after its header, small files and 3 MiB of data
        send, isend, sent = dist.send, dist.isend, []

        def dying(fn):
            def call(tensor, dst, group=None):
                if len(sent) == 6:
                    os._exit(0)
                sent.append(tensor.numel())
                return fn(tensor, dst, group=group)
            return call

        dist.send, dist.isend = dying(send), dying(isend)
        transfer.send_rank(LocalTier("local", Path(saved)), 6, 0, 1, None)
        os._exit(1)
    memory = MemoryTier("mem", Path(root), size=64 << 20, memory_only=False)
    try:
        transfer.receive_rank(0, None, memory.replica_tier(0), into_step=False)
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        Path(root, "outcome").write_text(f"{type(exc).__name__}: {exc}")
    else:
        Path(root, "outcome").write_text("received")
    os._exit(0)


def _pair(fn, tmp_path: Path, floats: int) -> Path:
    """Step 6 of `floats` random floats saved on a local tier; then `fn(rank, store, saved, root)`
    as ranks 0 and 1 of a gloo job; returns `root` (the receiver's memory tier, where it writes
    its outcome)."""
    from tiered import Engine

    with Engine.from_config({"version": 1, "tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "nvme"),
                                                      "codec": "none"}]}) as engine:
        engine.save(6, {"w": torch.randn(floats)}).wait()
    root = tmp_path / "shm"
    root.mkdir()
    ctx = mp.start_processes(fn, args=(str(tmp_path / "store"), str(tmp_path / "nvme"), str(root)), nprocs=2,
                             join=False, start_method="spawn")
    while not ctx.join(timeout=120):  # (returns as each process ends)
        pass
    return root


def test_a_replica_whose_sender_is_lost_mid_way_is_never_committed(tmp_path):
    root = _pair(_sender_dies_midway, tmp_path, 4 << 20)
    outcome = (root / "outcome").read_text()
    assert outcome != "received" and "Error" in outcome and "corrupted" not in outcome, outcome
    tier = MemoryTier("mem", root, size=64 << 20, memory_only=False).replica_tier(0)
    assert tier.steps() == [] and not list(tier.root.glob(".step_*"))


@pytest.mark.parametrize("tier,error", [
    ({"kind": "memory", "replicas": 8}, "replicas: must be 0 \\(none\\) to 7"),
    ({"kind": "memory", "replicas": -1}, "replicas: must be 0"),
    ({"kind": "memory", "replicas": "two"}, "replicas: expected an integer"),
    ({"kind": "local", "path": "/tmp/x", "replicas": 1}, "replicas: unknown field"),
])
def test_replicas_in_the_config_are_checked(tier, error):
    from tiered.config import load_config
    from tiered.errors import ConfigError

    with pytest.raises(ConfigError, match=error):
        load_config({"version": 1, "tiers": [{"name": "fast", **tier}]})


def test_replicas_are_read_from_the_memory_tier():
    from tiered.config import load_config

    config = load_config({"version": 1, "tiers": [{"name": "mem", "kind": "memory", "replicas": 2}]})
    assert config.fast_tier.replicas == 2


def _sent_twice(rank: int, path: str, saved: str) -> Any:
    """A gloo job of two: rank 0 sends rank 0's files of step 6 on the tier at `saved` twice, in
    1 MiB pieces, and ends; rank 1 gets the transfer module back, to receive them."""
    import torch.distributed as dist

    from tiered.distributed import transfer
    from tiered.tiers.local import LocalTier

    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    transfer.PIECE = 1 << 20
    if rank == 0:
        for _ in range(2):
            transfer.send_rank(LocalTier("local", Path(saved)), 6, 0, 1, None)
        os._exit(0)
    return transfer


def _one_unwritable_then_one_kept(rank: int, path: str, saved: str, root: str) -> None:
    from tiered.tiers.local import LocalTier

    transfer = _sent_twice(rank, path, saved)
    Path(root, "a-file").write_text("in the way")
    try:  # a tier whose directory cannot be made (a file is in the way)
        transfer.receive_rank(0, None, LocalTier("bad", Path(root, "a-file", "tier")), into_step=False)
        first = "received"
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        first = type(exc).__name__
    tier = MemoryTier("mem", Path(root), size=64 << 20, memory_only=False).replica_tier(0)
    second = transfer.receive_rank(0, None, tier, into_step=False)
    Path(root, "outcome").write_text(f"{first} {tier.steps()} {second.stored_bytes if second else None}")
    os._exit(0)


def test_a_replica_that_cannot_be_written_is_taken_off_the_wire_and_the_next_one_kept(tmp_path):
    root = _pair(_one_unwritable_then_one_kept, tmp_path, 1 << 20)
    text = (root / "outcome").read_text()  # (the first's error, the steps kept after both, bytes of the second)
    assert text.startswith("TieredError [6] ") and int(text.rsplit(" ", 1)[1]) > 4 << 20, text


def _one_refused_then_one_kept(rank: int, path: str, saved: str, root: str) -> None:
    transfer = _sent_twice(rank, path, saved)
    tier = MemoryTier("mem", Path(root), size=64 << 20, memory_only=False).replica_tier(0)
    first = transfer.receive_rank(0, None, tier, into_step=False, room=lambda n: False)
    second = transfer.receive_rank(0, None, tier, into_step=False, room=lambda n: True)
    Path(root, "outcome").write_text(f"{first is None} {tier.steps()} {second.stored_bytes if second else None}")
    os._exit(0)


def test_a_replica_without_room_is_received_and_dropped_and_the_next_one_kept(tmp_path):
    root = _pair(_one_refused_then_one_kept, tmp_path, 1 << 20)
    text = (root / "outcome").read_text()  # (dropped, the steps kept after both, bytes of the second)
    assert text.startswith("True [6] ") and int(text.rsplit(" ", 1)[1]) > 4 << 20, text
