"""Format v1: manifests and indexes from disk are validated before anything is opened or sized."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiered
from tiered.errors import FormatError
from tiered.format.manifest import MANIFEST_VERSION, Manifest, RankIndex, seal_manifest


@pytest.fixture
def saved(tmp_path, tier_config):
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, {"w": torch.randn(300_000), "b": torch.ones(3), "meta": {"step": 1}}).wait()
    d = tmp_path / "local" / "step_000000000001"
    return d, json.loads((d / "rank_00000.index.json").read_bytes()), json.loads((d / "MANIFEST.json").read_bytes())


def _index(doc) -> RankIndex:
    return RankIndex.from_json(json.dumps(doc).encode(), "idx")


def test_index_and_manifest_round_trip(saved):
    _, index, manifest = saved
    idx = _index(index)
    assert json.loads(idx.to_json()) == index
    m = Manifest.from_json(seal_manifest(manifest), "m")
    assert json.loads(m.to_json()) == manifest


def test_every_flipped_bit_of_a_manifest_is_caught(saved):
    d, _, manifest = saved
    raw = (d / "MANIFEST.json").read_bytes()
    assert Manifest.from_json(raw, "m").step == 1 and json.loads(raw)["version"] == MANIFEST_VERSION
    for pos in range(len(raw)):
        for bit in range(8):
            bad = bytearray(raw)
            bad[pos] ^= 1 << bit
            with pytest.raises(FormatError):
                Manifest.from_json(bytes(bad), f"flip {pos}.{bit}")


def test_version_1_manifests_without_a_checksum_are_still_read(saved):
    _, _, manifest = saved
    old = {k: v for k, v in manifest.items() if k != "manifest_checksum"}
    assert Manifest.from_json(json.dumps({**old, "version": 1}).encode(), "v1").step == 1
    with pytest.raises(FormatError, match="does not match its own checksum"):
        Manifest.from_json(json.dumps(old).encode(), "v2 without its checksum")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=3), "format version 3 is not supported"),
    (lambda d: d.update(format="zip"), "not a tiered-index"),
    (lambda d: d.update(data_file="../../etc/passwd"), "not a plain file name"),
    (lambda d: d.update(data_file="/etc/passwd"), "not a plain file name"),
    (lambda d: d.update(data_file=".."), "not a plain file name"),
    (lambda d: d.update(chunk_size=-1), "chunk_size"),
    (lambda d: d.update(data_bytes=2**60), "data_bytes"),
    (lambda d: d.update(checksum="md5"), "unknown checksum"),
    (lambda d: d["tensors"][-1].update(dtype="object"), "unknown dtype 'object'"),
    (lambda d: d["tensors"][-1].update(shape=[-1]), "bad shape"),
    (lambda d: d["tensors"][-1].update(shape=[2**47, 2**47]), "chunks do not cover"),
    (lambda d: d["tensors"][-1].update(codec={"name": "lzma"}), "unknown codec 'lzma'"),
    (lambda d: d["tensors"][-1]["chunks"].pop(), "chunks do not cover"),
    (lambda d: d["tensors"][0].update(codec={"name": "zstd", "configuration": {"shuffle": 3}}), "bad zstd configuration"),
    (lambda d: d["tensors"][0].update(codec={"name": "ans", "configuration": {"data_type": "<f8"}}), "bad ans configuration"),
    (lambda d: d["tensors"][0].update(codec={"name": "zstd", "configuration": {"shuffle": [1]}}), "bad codec description"),
    (lambda d: d["tensors"][0].update(codec={"name": ["zstd"]}), "bad codec description"),
    (lambda d: d["tensors"][0].update(codec={"name": 5}), "bad codec description"),
    (lambda d: d["tensors"][0].update(index=True), r"index = True is not an integer"),
    # A description checked once is not taken for an equal one of another type (True == 1).
    (lambda d: (d["tensors"][0].update(codec={"name": "zstd", "configuration": {"shuffle": 1}}),
                d["tensors"][-1].update(codec={"name": "zstd", "configuration": {"shuffle": True}})),
     "bad zstd configuration"),
    (lambda d: d["tensors"][-1]["chunks"][0].__setitem__(0, 4097), "outside the data file .* or overlaps"),
    (lambda d: d["tensors"][-1]["chunks"][0].__setitem__(1, 2**50), "outside the data file"),
    (lambda d: d["tensors"][-1]["chunks"][0].__setitem__(1, -5), "outside the data file"),
    (lambda d: d["tensors"][-1]["chunks"][0].__setitem__(2, 10**9), "raw size"),
    (lambda d: d["tensors"][-1]["chunks"][0].__setitem__(3, "zz"), "64-bit hex checksum"),
    (lambda d: d["tensors"][-1]["chunks"][0].append(1), "malformed"),
    (lambda d: d["tensors"][-1].update(index=7), "tensor indices"),
    (lambda d: d.update(skeleton={"$dict": []}), "skeleton refers to tensors"),
])
def test_hostile_index_is_rejected(saved, mutate, message):
    _, index, _ = saved
    mutate(index)
    with pytest.raises(FormatError, match=message):
        _index(index)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["ranks"][0].update(index_file="../x.json"), "not a plain file name"),
    (lambda d: d["ranks"][0].update(data_file="/abs"), "not a plain file name"),
    (lambda d: d.update(world_size=2), "lists ranks"),
    (lambda d: d["ranks"][0].update(index_bytes=2**40), "index_bytes"),
    (lambda d: d.update(version="1"), "format version"),
])
def test_hostile_manifest_is_rejected(saved, mutate, message):
    _, _, manifest = saved
    mutate(manifest)
    with pytest.raises(FormatError, match=message):
        Manifest.from_json(seal_manifest(manifest), "m")


def test_deeply_nested_json_is_a_format_error():
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(FormatError, match="not valid JSON"):
        RankIndex.from_json(deep, "deep")


def test_skeleton_numpy_scalars_must_be_plain(saved, tmp_path, tier_config):
    d, index, manifest = saved
    index["skeleton"]["$dict"][2][1] = {"$np": "V100000000", "v": 1}
    raw = json.dumps(index).encode()
    (d / "rank_00000.index.json").write_bytes(raw)
    from tiered.format.checksum import wsum64

    manifest["ranks"][0].update(index_bytes=len(raw), index_checksum=f"{wsum64(raw):016x}")
    (d / "MANIFEST.json").write_bytes(seal_manifest(manifest))
    with tiered.Engine.from_config(tier_config()) as engine:
        with pytest.raises(FormatError, match="not plain data"):
            engine.load(1)


def test_engine_refuses_traversal_in_manifest(saved, tmp_path, tier_config):
    d, _, manifest = saved
    manifest["ranks"][0]["index_file"] = "../../../../etc/passwd"
    (d / "MANIFEST.json").write_bytes(seal_manifest(manifest))
    with tiered.Engine.from_config(tier_config()) as engine:
        with pytest.raises(FormatError, match="not a plain file name"):
            engine.restore({"w": torch.zeros(300_000), "b": torch.zeros(3)})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)


FUZZ = int(os.environ.get("TIERED_FUZZ_EXAMPLES", "300"))
"""Examples per fuzz test: TIERED_FUZZ_EXAMPLES=20000 is the soak run."""


@settings(max_examples=FUZZ, deadline=None)
@given(doc=json_values)
def test_parsers_refuse_garbage_and_only_with_format_error(doc):
    """A random JSON document is never an index or a manifest: both parsers refuse it, with a
    FormatError and nothing else."""
    raw = json.dumps(doc).encode()
    for parse in (RankIndex.from_json, Manifest.from_json):
        with pytest.raises(FormatError):
            parse(raw, "fuzz")


@settings(max_examples=max(1, FUZZ * 2 // 3), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_real_index_is_refused_with_format_error_unless_still_valid(saved, data):
    _, index, _ = saved
    doc = json.loads(json.dumps(index))
    t = doc["tensors"][data.draw(st.integers(0, len(doc["tensors"]) - 1))]
    key = data.draw(st.sampled_from(["dtype", "shape", "chunks", "codec", "index", "name"]))
    before, t[key] = t[key], data.draw(json_values)
    try:
        _index(doc)
    except FormatError:
        return
    # Parsed: only a value the format allows there may pass (a name is any string).
    assert t[key] == before or (key == "name" and isinstance(t[key], str)), (key, before, t[key])


def test_an_index_is_the_json_of_its_records_and_its_chunks_are_no_objects_for_the_collector(saved):
    """to_json writes chunk tables as text: the same JSON as json.dumps of the records. A tensor's
    chunks are one table of machine integers, not an object per chunk: a save of a large state
    places tens of thousands, and as objects they set off full collections of the training
    process, which hold every thread."""
    import gc

    from tiered.format.manifest import ChunkRecord, ChunkTable

    _, index, _ = saved
    doc = dict(index, tensors=[dict(t, name=f'{t["name"]}"\\é') for t in index["tensors"]])
    idx = _index(doc)
    assert idx.to_json() == json.dumps(doc, separators=(",", ":")).encode()
    table = next(t.chunks for t in idx.tensors if len(t.chunks) > 1)
    assert isinstance(table, ChunkTable)
    c = table[0]
    assert type(c) is ChunkRecord and c == (c.offset, c.size, c.raw_size, c.checksum) and c.extent % 4096 == 0
    assert list(table[1:]) == list(table)[1:] and table == list(table) and table[-1] == list(table)[-1]
    assert idx.tensors[0].stored_bytes == sum(c.size for c in idx.tensors[0].chunks)

    gc.collect()
    before = len(gc.get_objects())
    rows = bytearray()  # (as a save's writer packs them)
    for j in range(20_000):
        rows += ChunkTable.ROW.pack(j * 4096, 4000, 1 << 20, (1 << 64) - 1 - j)
    big = ChunkTable.packed(rows)
    gc.collect()
    assert len(gc.get_objects()) - before < 100  # (not one per chunk)
    assert big[-1] == ChunkRecord(19_999 * 4096, 4000, 1 << 20, (1 << 64) - 20_000)


@pytest.mark.parametrize("n", [0, 1, 3, 255, 256, 257, 600])
def test_packed_chunk_rows_make_the_same_json_as_their_records(n):
    """A save's writer formats packed rows a block at a time (`ChunkTable.packed_json`): the text
    is the records' JSON, checksums over 2**63 included."""
    from tiered.format.manifest import ChunkRecord, ChunkTable

    records = [ChunkRecord(j * 4096, 4000 + j, 1 << 20, (1 << 64) - 1 - 7 * j) for j in range(n)]
    rows = bytearray(b"".join(ChunkTable.ROW.pack(*r) for r in records))
    expected = json.dumps([[r.offset, r.size, r.raw_size, f"{r.checksum:016x}"] for r in records],
                          separators=(",", ":"))
    assert ChunkTable.packed_json(rows) == ChunkTable.packed(rows).to_json() == ChunkTable(records).to_json() == expected


def test_a_save_writes_its_index_with_no_record_object_per_tensor(tmp_path, monkeypatch):
    """A save's writer makes the index text from its plans and packed rows (`format.index_json`):
    records made per tensor lived long enough to be promoted into the collector's oldest
    generation and set off full passes over the training process every few saves.
    The index reads back as the same records."""
    import tiered
    from tiered.format import chunks
    from tiered.format import manifest as fmt

    made = []

    def counted(real):
        def init(self, *args, **kwargs):
            made.append(type(self).__name__)
            real(self, *args, **kwargs)
        return init

    for cls in (fmt.TensorRecord, chunks.ChunkTable):
        monkeypatch.setattr(cls, "__init__", counted(cls.__init__))
    state = {f"layer{i}": torch.full((20_000 + 9_000 * i,), float(i)) for i in range(50)}  # 1-28 chunks each
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "local"), "codec": "none"}],
           "chunk_size": "64KiB"}
    with tiered.Engine.from_config(cfg) as engine:
        made.clear()
        engine.save(1, state).wait()
        assert made == []
        monkeypatch.undo()
        _, indexes = fmt.read_step(engine.saves.tier, 1)
        assert sorted(t.name for t in indexes[0].tensors) == sorted(state)
        assert all(len(t.chunks) == -(-t.nbytes // (64 << 10)) for t in indexes[0].tensors)
        out = engine.load(1)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_an_index_is_parsed_with_the_collector_paused(tmp_path):
    """Parsing an index makes thousands of objects at once; with the collector on they set off
    collections, and in a process of many objects a full one (76-93 ms every other migration of
    2,000 tensors: docs/benchmarks.md). It runs paused, as a save's walk does."""
    import gc

    state = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}
    with tiered.Engine.from_config({"tiers": [{"name": "local", "kind": "local", "path": str(tmp_path),
                                               "codec": "none"}]}) as engine:
        engine.save(1, state).wait()
    raw = next(tmp_path.rglob("rank_00000.index*")).read_bytes()
    runs: list[int] = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    old = gc.get_threshold()
    gc.collect()  # (what the save left young is collected first: the count is the parse's own)
    gc.callbacks.append(count)
    gc.set_threshold(50)  # a collection every 50 allocations, where the collector runs
    try:
        index = RankIndex.from_json(raw, "idx")
        paused = len(runs)
        json.loads(raw)  # the same document's objects, collector on: the count does see collections
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*old)
    assert len(index.tensors) == 3000 and gc.isenabled()
    # (at most one, at the pause's edges: its context manager allocates as it is entered and left)
    assert paused <= 1 and len(runs) - paused > 100, (paused, len(runs))


def test_the_collector_stays_paused_until_the_last_of_overlapping_pauses_ends():
    """`reserve()`'s call and its thread's plan (a save's call and the stager's) pause the
    collector in blocks that overlap: it goes back on when the last ends, and stays off where it
    was off before any of them."""
    import gc
    import threading

    from tiered.format.tree import collector_paused

    def overlap() -> dict[str, bool]:
        inside, release, seen = threading.Event(), threading.Event(), {}

        def other() -> None:
            with collector_paused():
                inside.set()
                release.wait(10)
                seen["the other's end"] = gc.isenabled()

        thread = threading.Thread(target=other)
        with collector_paused():
            thread.start()
            assert inside.wait(10)
        seen["the first ended"] = gc.isenabled()
        release.set()
        thread.join()
        seen["both ended"] = gc.isenabled()
        return seen

    assert gc.isenabled()
    assert overlap() == {"the first ended": False, "the other's end": False, "both ended": True}
    gc.disable()
    try:
        assert overlap() == {"the first ended": False, "the other's end": False, "both ended": False}
    finally:
        gc.enable()
