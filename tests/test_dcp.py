"""tiered.dcp in one process (no process group): DCP's save and load on tiered storage, the
metadata as JSON, and the errors users meet. Multi-rank runs are in test_distributed.py."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tiered import Engine
from tiered.dcp import SafeLoadPlanner, TieredStorageReader, TieredStorageWriter
from tiered.distributed.commit import DCP_METADATA, metadata_from_json
from tiered.errors import FormatError


def small_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 500, generator=g), "b": torch.randn(500, generator=g).bfloat16()},
            "step": torch.tensor(12), "meta": {"epoch": 3, "lr": 0.5, "name": "a"}}


def zeros(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": torch.tensor(0),
            "meta": {"epoch": 0, "lr": 0.0, "name": ""}}


@pytest.fixture
def engine(tier_config):
    with Engine.from_config(tier_config("zstd")) as e:
        yield e


def test_dcp_save_and_load_round_trip(engine):
    state = small_state()
    dcp.save(state, storage_writer=TieredStorageWriter(engine, 5))
    out = zeros(state)
    dcp.load(out, storage_reader=TieredStorageReader(engine, 5), planner=SafeLoadPlanner())
    for k, v in state["model"].items():
        assert torch.equal(out["model"][k], v)
    assert out["step"].item() == 12 and out["meta"] == state["meta"]
    assert engine.steps() == [5]


def test_checkpoint_id_is_the_step(engine):
    dcp.save(small_state(), storage_writer=TieredStorageWriter(engine), checkpoint_id=7)
    out = zeros(small_state())
    dcp.load(out, storage_reader=TieredStorageReader(engine), checkpoint_id="7", planner=SafeLoadPlanner())
    assert torch.equal(out["model"]["w"], small_state()["model"]["w"])


def test_engine_restore_reads_a_dcp_step_and_load_points_to_restore(engine):
    state = small_state(1)
    dcp.save(state, storage_writer=TieredStorageWriter(engine, 9))
    out = zeros(state)
    assert engine.restore(out) == 9
    assert torch.equal(out["model"]["b"], state["model"]["b"]) and out["meta"] == state["meta"]
    with pytest.raises(FormatError, match="saved through torch.distributed.checkpoint"):
        engine.load(9)


def raises_dcp(match: str, caplog, call) -> None:
    """DCP wraps a storage error in its CheckpointException (a BaseException). torch 2.13 puts
    our message in its text; 2.11 raises "metadata is None" and logs ours with the traceback."""
    with pytest.raises(BaseException) as info:
        call()
    assert re.search(match, str(info.value)) or re.search(match, caplog.text), (str(info.value), caplog.text)


def test_reader_refuses_a_step_saved_by_one_process(engine, caplog):
    engine.save(3, small_state()).wait()
    raises_dcp("not saved through torch.distributed.checkpoint", caplog, lambda: dcp.load(
        zeros(small_state()), storage_reader=TieredStorageReader(engine, 3), planner=SafeLoadPlanner()))


def test_bad_step_ids_are_clear_errors(engine):
    with pytest.raises(BaseException, match="needs a step"):
        dcp.save(small_state(), storage_writer=TieredStorageWriter(engine))
    with pytest.raises(ValueError, match="must be a step number"):
        TieredStorageWriter(engine, "/ckpt/last")
    assert not TieredStorageWriter.validate_checkpoint_id("s3://bucket/x")
    assert TieredStorageReader.validate_checkpoint_id(12)


class Custom:
    """A class a pickle would have to import and build."""


def test_safe_load_planner_refuses_pickled_objects(engine):
    state = small_state()
    state["meta"] = {"obj": Custom()}
    dcp.save(state, storage_writer=TieredStorageWriter(engine, 4))
    out = zeros(small_state())
    out["meta"] = {"obj": None}
    with pytest.raises(BaseException, match="[Ww]eights only load failed|Unsupported global"):
        dcp.load(out, storage_reader=TieredStorageReader(engine, 4), planner=SafeLoadPlanner())


def test_metadata_json_round_trip_and_hostile_input(engine):
    dcp.save(small_state(), storage_writer=TieredStorageWriter(engine, 6))
    raw = (engine.tier.step_dir(6) / DCP_METADATA).read_bytes()
    md = metadata_from_json(raw, "m")
    assert set(md.state_dict_metadata) >= {"model.w", "model.b", "step"}
    assert md.state_dict_metadata["model.w"].size == torch.Size([300, 500])
    doc = json.loads(raw)

    def bad(change, match):
        d = json.loads(raw)
        change(d)
        with pytest.raises(FormatError, match=match):
            metadata_from_json(json.dumps(d).encode(), "m")

    bad(lambda d: d.update(version=2), "version 2 is not supported")
    bad(lambda d: d["state_dict_metadata"]["model.w"].update(dtype="float128"), "unknown dtype")
    bad(lambda d: d["state_dict_metadata"]["model.w"]["chunks"][0].__setitem__(1, [301, 500]), "lies outside")
    bad(lambda d: d["items"].append(["nope", None, None, 0, 0]), "bad item")
    bad(lambda d: d["items"][0].__setitem__(3, "0"), "bad item")
    with pytest.raises(FormatError, match="not valid JSON"):
        metadata_from_json(b"{", "m")
    assert doc["format"] == "tiered-dcp-metadata"


def test_tampered_metadata_is_caught_by_the_manifest(engine, caplog):
    dcp.save(small_state(), storage_writer=TieredStorageWriter(engine, 8))
    path = engine.tier.step_dir(8) / DCP_METADATA
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"300")] = ord("4")  # same size, other content
    path.write_bytes(bytes(raw))
    raises_dcp("does not match the manifest", caplog, lambda: dcp.load(
        zeros(small_state()), storage_reader=TieredStorageReader(engine, 8), planner=SafeLoadPlanner()))


def test_load_decodes_whole_tensors_in_place_and_the_rest_through_bounded_buffers(tier_config, device, monkeypatch):
    """A rank's state must not be decoded into a second copy of itself (a 24 GB state
    per rank ran out of GPU memory so): whole tensors with a contiguous destination of their dtype
    are decoded into it; the others into buffers of at most SPAN_BYTES per decode call."""
    import tiered.distributed.storage as storage
    from tiered.restore.pipeline import Restorer

    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(128, 96, generator=g).to(device) for i in range(6)}
    monkeypatch.setattr(storage, "SPAN_BYTES", 2 * 128 * 96 * 4, raising=False)  # two tensors' worth
    calls: list[tuple[int, int]] = []  # per decode call: (bytes decoded in place, bytes into own buffers)
    decode = Restorer.decode

    def spy(self, step, index, dests, tier, repair):
        ours = {t.untyped_storage().data_ptr() for t in out.values()}
        own = [d.numel() for d in dests.values() if d.untyped_storage().data_ptr() not in ours]
        calls.append((sum(d.numel() for d in dests.values()) - sum(own), sum(own)))
        return decode(self, step, index, dests, tier, repair)

    monkeypatch.setattr(Restorer, "decode", spy)
    with Engine.from_config(tier_config("zstd")) as engine:
        dcp.save(state, storage_writer=TieredStorageWriter(engine, 1))
        # t0..t2: contiguous destinations; t3..t5: transposed (non-contiguous) views
        out = {k: torch.zeros_like(v) if i < 3 else torch.zeros(96, 128, device=device).t()
               for i, (k, v) in enumerate(state.items())}
        dcp.load(out, storage_reader=TieredStorageReader(engine, 1))
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    assert sum(p for p, _ in calls) == 3 * 128 * 96 * 4  # the contiguous three, in place
    assert sum(o for _, o in calls) == 3 * 128 * 96 * 4 and all(o <= storage.SPAN_BYTES for _, o in calls)
    assert len(calls) >= 2
