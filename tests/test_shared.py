"""Tensors that share memory (tied weights, one tensor put in a state twice) are stored once and
load as one tensor in every place; other overlapping views stay separate."""

from __future__ import annotations

import json

import pytest
import torch

import tiered
from tiered.errors import FormatError
from tiered.format.manifest import RankIndex, index_file_name


class Tied(torch.nn.Module):
    """An embedding and an output layer holding one Parameter, as GPT-2 and Llama do."""

    def __init__(self, vocab: int = 1000, dim: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mid = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight


def _trained(device: str, seed: int = 0) -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tied().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randint(0, 1000, (8, 16), device=device)
        loss = model.head(model.mid(model.emb(x))).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def test_tied_weights_are_stored_once_and_load_tied(tier_config, device):
    model, opt = _trained(device)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, state).wait()
        manifest, index = engine.read_index(1)
        names = [t.name for t in index.tensors]
        assert "model.emb.weight" in names and "model.head.weight" not in names
        assert json.loads(engine.catalog.fast.read_file(1, index_file_name(0), 1 << 30))["version"] == 2
        assert manifest.raw_bytes == sum(t.nbytes for t in index.tensors), "the tied weight counts once"
        got = engine.load(1)
    assert got["model"]["emb.weight"] is got["model"]["head.weight"]
    assert torch.equal(got["model"]["head.weight"], model.head.weight.detach())
    assert torch.equal(got["model"]["mid.weight"], model.mid.weight.detach())


def test_restore_into_a_tied_model_keeps_it_tied(tier_config, device):
    model, opt = _trained(device)
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, {"model": model.state_dict()}).wait()
        fresh = Tied().to(device)
        sd = {"model": fresh.state_dict()}
        engine.restore(sd)
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, model.emb.weight) and torch.equal(fresh.mid.bias, model.mid.bias)


def test_restore_into_untied_tensors_fills_each(tier_config, device):
    model, _ = _trained(device)
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, {"model": model.state_dict()}).wait()
        target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
        head = target["model"]["head.weight"]
        engine.restore(target)
    assert target["model"]["head.weight"] is head, "filled in place, not replaced by the other tensor"
    assert torch.equal(head, model.emb.weight.detach())
    assert torch.equal(target["model"]["emb.weight"], model.emb.weight.detach())


def test_other_overlapping_views_stay_separate_and_unshared_states_stay_version_1(tier_config, device):
    w = torch.randn(64, 128, device=device)
    state = {"w": w, "row": w[3], "cols": w[:, :8], "same": w, "again": w.view(64, 128)}
    with tiered.Engine.from_config(tier_config()) as engine:
        engine.save(1, state).wait()
        names = sorted(t.name for t in engine.read_index(1)[1].tensors)
        got = engine.load(1)
        engine.save(2, {"a": torch.randn(10, device=device), "b": torch.randn(10, device=device)}).wait()
        assert json.loads(engine.catalog.fast.read_file(2, index_file_name(0), 1 << 30))["version"] == 1
    assert names == ["cols", "row", "w"], "w, w itself again and an identical view are one tensor"
    assert got["w"] is got["same"] is got["again"]
    assert torch.equal(got["row"], w[3]) and torch.equal(got["cols"], w[:, :8])
    assert got["row"].data_ptr() != got["w"].data_ptr()


def test_views_at_one_address_are_shared_only_where_the_whole_view_is_the_same():
    """flatten looks tensors up by address first: views that start at one address but differ in
    shape, stride or dtype, and empty views there, stay leaves of their own."""
    from tiered.format import tree
    w = torch.randn(4, 8)
    state = {"tail": w[2:], "tail2": w[2:], "empty": w[2:2], "empty2": w[2:2], "col": w[2:, :1],
             "bytes": w[2:].view(torch.uint8), "t": w[2:].t()}
    skeleton, leaves = tree.flatten(state, share=True)
    refs = dict(skeleton["$dict"])
    assert refs["tail"] == refs["tail2"], "the same view twice is one leaf"
    others = [refs[k]["$tensor"] for k in ("tail", "empty", "empty2", "col", "bytes", "t")]
    assert len(set(others)) == 6 and len(leaves) == 6


def test_shared_tensors_survive_migration(tmp_path):
    model, _ = _trained("cpu")
    cfg = {"migration": "in_process",
           "tiers": [{"name": "local", "kind": "local", "path": str(tmp_path / "local")},
                     {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd"}]}
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, {"model": model.state_dict()}).wait()
        engine.wait_migrated()
        got = engine.load(1, tier="shared")
    assert got["model"]["emb.weight"] is got["model"]["head.weight"]
    assert torch.equal(got["model"]["emb.weight"], model.emb.weight.detach())


def _index_doc(version: int, skeleton) -> bytes:
    rec = {"index": 0, "name": "w", "dtype": "float32", "shape": [0], "device": "cpu", "numpy": False,
           "codec": {"name": "none", "configuration": {}}, "chunks": []}
    return json.dumps({"format": "tiered-index", "version": version, "rank": 0, "data_file": "rank_0.data",
                       "data_bytes": 0, "chunk_size": 1 << 20, "alignment": 4096, "checksum": "wsum64", "io": "",
                       "skeleton": skeleton, "tensors": [rec]}).encode()


@pytest.mark.parametrize("case", [
    dict(version=2, skeleton={"$dict": [["a", {"$tensor": 0}], ["b", {"$tensor": 0}]]}, ok=True),
    dict(version=1, skeleton={"$dict": [["a", {"$tensor": 0}]]}, ok=True),
    # a version-1 index refers to each tensor once
    dict(version=1, skeleton={"$dict": [["a", {"$tensor": 0}], ["b", {"$tensor": 0}]]}, ok=False),
    # any version: every listed tensor is referred to, and nothing else
    dict(version=2, skeleton={"$dict": [["a", {"$tensor": 0}], ["b", {"$tensor": 1}]]}, ok=False),
    dict(version=3, skeleton={"$dict": [["a", {"$tensor": 0}]]}, ok=False),
])
def test_index_versions(case):
    raw = _index_doc(case["version"], case["skeleton"])
    if case["ok"]:
        assert RankIndex.from_json(raw, "x").tensors[0].name == "w"
    else:
        with pytest.raises(FormatError):
            RankIndex.from_json(raw, "x")
