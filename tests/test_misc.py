"""Checksum agreement between CPU and torch, lazy GPU imports, the tree encoding."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch

from tiered.errors import StateDictError
from tiered.format import tree
from tiered.format.checksum import to_u64, wsum64, wsum64_each, wsum64_extents, wsum64_rows_torch
from tiered.stage.pools import RowRing


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 4095, 4096, 100_003])
def test_wsum64_cpu_matches_torch_rows_and_padding(size):
    rng = np.random.default_rng(size)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    stride = 4096 * (1 + size // 4096)
    row = torch.zeros(1, stride, dtype=torch.uint8)
    row[0, :size] = torch.from_numpy(data)
    assert to_u64(int(wsum64_rows_torch(row)[0])) == wsum64(data)
    assert wsum64(np.concatenate([data, np.zeros(4096, np.uint8)])) == wsum64(data), "zero padding adds nothing"


def _wsum64_by_definition(data) -> int:
    """sum_i (2i + 1) * w_i mod 2**64 over little-endian uint32 words, zero-padded: term by term."""
    buf = bytes(data) + b"\0" * (-len(data) % 4)
    return sum((2 * i + 1) * w for i, w in enumerate(np.frombuffer(buf, dtype="<u4").tolist())) % (1 << 64)


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 5, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 3,
                                  (3 << 20) + 6])
def test_wsum64_blocked_equals_the_definition(size):
    """Slices of 1 MiB with their offsets added back, a partial last word; all-ones words (the
    largest terms) as well as random ones; wrapping mod 2**64 without a warning."""
    import warnings

    rng = np.random.default_rng(size)
    for data in (rng.integers(0, 256, size, dtype=np.uint8), np.full(size, 255, dtype=np.uint8)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert wsum64(data) == _wsum64_by_definition(data.tobytes())
        assert wsum64(data.tobytes()) == wsum64(memoryview(bytearray(data.tobytes()))) == wsum64(data)


@pytest.mark.parametrize("block_words", [1000, 1 << 14, 1 << 20])
def test_wsum64_of_laid_out_chunks_equals_each_chunks_own(block_words):
    """`wsum64_extents` over chunks laid out as a data file lays them out (each at the next 4 KiB
    offset, zeros between), in blocks that cut chunks anywhere: the sums of `wsum64` chunk by
    chunk, all-ones chunks too; the caller's offsets are left as they were."""
    rng = np.random.default_rng(block_words)
    for trial in range(20):
        n = int(rng.integers(1, 30))
        sizes = rng.integers(1, 150_000 if block_words > 1000 else 20_000, n)
        sizes[rng.random(n) < 0.3] = 1 << 16
        extents = (sizes + 4095) // 4096 * 4096
        offsets = np.concatenate([[0], np.cumsum(extents)[:-1]]).astype(np.int64)
        buf = np.zeros(int(extents.sum()), np.uint8)
        for k, (o, size) in enumerate(zip(offsets, sizes)):
            buf[o:o + size] = 255 if k % 5 == 0 else rng.integers(0, 256, size, dtype=np.uint8)
        kept = offsets.copy()
        want = [wsum64(buf[o:o + size]) for o, size in zip(offsets, sizes)]
        assert wsum64_extents(buf, offsets, sizes, block_words=block_words) == want, trial
        assert (offsets == kept).all()
        if n > 2:  # a subset of the chunks, as the checksum pool's tasks take them
            assert wsum64_extents(buf, offsets[1:-1], sizes[1:-1], block_words=block_words) == want[1:-1]
    assert wsum64_extents(b"", [], []) == []
    with pytest.raises(ValueError, match="multiples of 4"):
        wsum64_extents(bytes(8192), [2], [10])


def test_wsum64_of_many_small_buffers_at_once_equals_each_ones_own():
    """`wsum64_each` (an optimizer's `step` scalars: thousands of chunks of a few bytes, summed in
    one pass): the sums of `wsum64` buffer by buffer, for every size mod 4, all-ones bytes, bytes,
    bytearrays and memoryviews; an empty buffer among them; none at all."""
    rng = np.random.default_rng(7)
    bufs = [bytes(rng.integers(0, 256, int(n), dtype=np.uint8)) for n in rng.integers(1, 5000, 300)]
    bufs += [b"\xff" * n for n in range(1, 9)] + [b"\x01", b"\x00\x00\x00\x80\x01"]
    bufs += [bytearray(bufs[0]), memoryview(bufs[1])]
    assert wsum64_each(bufs) == [wsum64(b) for b in bufs]
    assert wsum64_each(bufs[:3] + [b""] + bufs[3:6]) == [wsum64(b) for b in bufs[:3] + [b""] + bufs[3:6]]
    assert wsum64_each([]) == []


def test_wsum64_detects_flips_and_swaps():
    data = bytearray(np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8).tobytes())
    base = wsum64(data)
    for pos in (0, 1, 4095, 65535):
        for bit in range(8):
            data[pos] ^= 1 << bit
            assert wsum64(data) != base
            data[pos] ^= 1 << bit
    swapped = bytearray(data)
    swapped[0:4], swapped[8:12] = data[8:12], data[0:4]
    assert data[0:4] == data[8:12] or wsum64(swapped) != base


@pytest.mark.gpu
@pytest.mark.parametrize("stride", [3 * 4096, (1 << 20) + 8192])
def test_fused_padding_packing_and_checksum_match_the_cpu_definition(stride):
    """The drain's Triton kernel. In place: each row's chunk is kept, its padding up to the 4 KiB
    extent zeroed, the bytes past the extent left alone. Packed: each extent lands, padding
    zeroed, at its offset of the staging buffer, the rows unchanged. Both give each row's wsum64
    as the CPU computes it (wrapping mod 2**64 on the 1 MiB rows), from parts taken over slices of
    each row: rows of one 4 KiB extent leave most slices empty, the 1 MiB rows fill all of them."""
    from tiered.gpu import pack as gpu_checksum

    assert gpu_checksum.available()
    g = torch.Generator(device="cuda").manual_seed(stride)
    sizes = [0, 1, 3, 4, 5, 4095, 4096, 4097, 8191, 2 * 4096 + 7, stride - 4096, stride - 1, stride]
    extents = [-(-n // 4096) * 4096 for n in sizes]
    rows = torch.randint(0, 256, (len(sizes), stride), dtype=torch.uint8, device="cuda", generator=g)
    before = rows.cpu().numpy()
    want = [wsum64(before[r, :n]) for r, n in enumerate(sizes)]
    sizes_t = torch.tensor(sizes, device="cuda")

    sums = torch.empty(len(sizes), dtype=torch.int64, device="cuda")
    offsets = np.cumsum([0] + extents[:-1])
    dst = torch.full((sum(extents) + 4096,), 7, dtype=torch.uint8, device="cuda")
    parts = gpu_checksum.partials(len(sizes), rows.device)
    parts[:2] = 0  # (rows 0 and 1 are not packed: their parts are not written)
    words = torch.tensor(offsets // 4, device="cuda")
    gpu_checksum.pack_and_checksum(rows, sizes_t, parts, dst, words, 2, 6)  # two runs of rows, as a drain packs
    gpu_checksum.pack_and_checksum(rows, sizes_t, parts, dst, words, 6, len(sizes))
    gpu_checksum.sum_partials(parts, sums)
    packed, after = dst.cpu().numpy(), rows.cpu().numpy()
    assert (after == before).all(), "packing changed the rows"
    assert (packed[:offsets[2]] == 7).all() and (packed[sum(extents):] == 7).all(), "wrote outside its rows' extents"
    for r in range(2, len(sizes)):
        o, n = offsets[r], sizes[r]
        assert (packed[o:o + n] == before[r, :n]).all() and not packed[o + n:o + extents[r]].any(), f"row {r}"
        assert to_u64(int(sums[r])) == want[r], f"packed row {r} of {n} bytes"

    sums.fill_(0)
    gpu_checksum.pad_and_checksum(rows, sizes_t, sums)
    got = rows.cpu().numpy()
    for r, (n, extent) in enumerate(zip(sizes, extents)):
        assert (got[r, :n] == before[r, :n]).all(), f"row {r}: the chunk changed"
        assert not got[r, n:extent].any(), f"row {r}: padding not zeroed"
        assert (got[r, extent:] == before[r, extent:]).all(), f"row {r}: bytes past the extent changed"
        assert to_u64(int(sums[r])) == want[r], f"row {r} of {n} bytes"


def test_import_tiered_needs_no_cuda_libraries():
    code = ("import sys, tiered, tiered.engine, tiered.gpu.device; "
            "bad = [m for m in sys.modules if m.startswith(('kvikio', 'nvidia.nvcomp', 'cupy'))]; "
            "assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_tree_round_trip_and_types():
    state = OrderedDict(a=[1, (2.5, None)], b={1: "x", (1, 2): b"\x00"}, c=float("-inf"), d=torch.float16,
                        e=torch.Size([2, 3]), f=np.float32(1.5), g=torch.device("cpu"), h=torch.ones(2))
    skeleton, leaves = tree.flatten(state)
    import json

    skeleton = json.loads(json.dumps(skeleton, allow_nan=False))
    back = tree.decode(skeleton, lambda i: leaves[i].tensor)
    assert type(back) is OrderedDict and back["b"][(1, 2)] == b"\x00" and back["c"] == float("-inf")
    assert back["d"] is torch.float16 and back["e"] == torch.Size([2, 3]) and back["f"].dtype == np.float32
    assert tree.path_str(leaves[0].path) == "h"


def test_decode_takes_plain_lists_and_tuples_whole_and_tagged_values_inside_them_still():
    """Lists, tuples and dict values of plain JSON values decode as they are, in one pass (DCP's
    planner data: a tuple of names per tensor); a tagged value among them still decodes."""
    node = {"$dict": [["a", {"$tuple": ["r0", "model", 3, None, True, 1.5]}], ["b", [1, "x", False]],
                      ["c", [1, {"$float": "nan"}]], ["d", {"$tuple": [{"$bytes": "AA=="}, 2]}], [7, "seven"]]}
    got = tree.decode(node, lambda i: None)
    assert got["a"] == ("r0", "model", 3, None, True, 1.5) and type(got["a"]) is tuple
    assert got["b"] == [1, "x", False] and got["b"] is not node["$dict"][1][1], "a new list, not the node"
    assert got["c"][0] == 1 and math.isnan(got["c"][1]) and got["d"] == (b"\x00", 2) and got[7] == "seven"


def test_the_plan_cache_keeps_a_plan_while_paths_dtypes_shapes_and_devices_stay():
    """The cached plan is reused (its groups are the same objects: a GPU keeps its layout on them)
    only while every leaf keeps its path, dtype, shape, device and kind; each change plans anew."""
    from tiered.stage.plan import PlanCache

    cache = PlanCache()

    def plan(state):
        return cache.plan(tree.flatten(state)[1], "zstd", 1 << 20, False)

    base = {"w": torch.ones(4, 3), "b": torch.ones(3), "n": np.ones(2, dtype=np.float32)}
    first = plan(base)
    again = plan({"w": torch.zeros(4, 3), "b": torch.zeros(3), "n": np.zeros(2, dtype=np.float32)})
    assert again.cpu is first.cpu and again.raw_bytes == first.raw_bytes == 4 * (12 + 3 + 2)
    assert torch.equal(again.tensors[0], torch.zeros(4, 3)), "the plan carries this save's tensors"
    for changed in ({**base, "w": torch.ones(4, 3, dtype=torch.float64)},   # dtype
                    {**base, "w": torch.ones(3, 4)},                        # shape
                    {"v": base["w"], "b": base["b"], "n": base["n"]},       # path
                    {**base, "n": torch.ones(2)}):                          # numpy -> tensor
        assert plan(changed).cpu is not first.cpu, changed
        back = plan(base)
        assert back.cpu == first.cpu and back.cpu is not first.cpu, "back to the first structure: planned again"
        first = back
    # Another device plans anew too (tests/test_devices.py, with GPUs); a meta tensor is refused.
    with pytest.raises(StateDictError, match="w: a tensor on the meta device"):
        plan({**base, "w": torch.ones(4, 3, device="meta")})


def test_the_plan_cache_keys_a_flat_state_on_its_structure_where_it_has_one():
    """A flat state that carries a structure (a reused DCP plan's token with its serialized
    items' sizes) is planned once per structure: the leaves are not compared one by one, and a
    structure that differs (another token, or a serialized item of another size) plans anew."""
    from tiered.stage.plan import PlanCache

    cache, names, token = PlanCache(), tree.FlatNames(["w", "b", "obj"]), object()

    def plan(n_obj, structure):
        flat = names.flatten([torch.ones(4, 3), torch.ones(3), torch.zeros(n_obj, dtype=torch.uint8)], structure)
        assert flat.structure is structure
        return cache.plan(flat.leaves, "zstd", 1 << 20, False, flat.structure)

    first = plan(5, (token, (5,)))
    again = plan(5, (token, (5,)))
    assert again.cpu is first.cpu, "the same structure: the plan is reused"
    longer = plan(9, (token, (9,)))
    assert longer.cpu is not first.cpu and longer.raw_bytes == first.raw_bytes + 4, "a serialized item grew"
    other = plan(9, (object(), (9,)))
    assert other.cpu is not longer.cpu and other.cpu == longer.cpu, "another token: planned anew"
    unmarked = plan(9, None)
    assert unmarked.cpu is not other.cpu and unmarked.cpu == other.cpu, "no structure: the leaves' key"
    assert plan(9, None).cpu is unmarked.cpu


class _MyParameter(torch.nn.Parameter):
    pass


class _MyTensor(torch.Tensor):
    pass


def test_a_skeleton_of_the_same_structure_is_made_of_the_nodes_made_before():
    """A save's skeleton lives until its index is written: new containers for every tensor each
    save would reach the collector's oldest generation and set off full collections. Flattening
    a state of the structure flattened before (new dicts, as state_dict() makes) reuses the
    earlier nodes wherever everything under them is a tensor; nodes with other values are new;
    the JSON is the same as ever; a changed structure gets its own nodes."""
    import gc
    import json

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()

    def state(epoch):
        return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": epoch, "keys": [1, "a"]}

    def tracked(node, out):
        if gc.is_tracked(node):
            out[id(node)] = node
        if isinstance(node, dict):
            for v in node.values():
                tracked(v, out)
        elif isinstance(node, (list, tuple)):
            for v in node:
                tracked(v, out)
        return out

    first, leaves1 = tree.flatten(state(1), share=True)
    second, leaves2 = tree.flatten(state(2), share=True)
    assert [p for p, _, _ in leaves1] == [p for p, _, _ in leaves2]
    before = tracked(first, {})
    new = [v for k, v in tracked(second, {}).items() if k not in before]
    assert first["$dict"][0] is second["$dict"][0], "the model's node and pair are the ones made before"
    states = [v for _, v in second["$dict"][1][1]["$dict"]][0]
    assert states is [v for _, v in first["$dict"][1][1]["$dict"]][0], "the optimizer's per-parameter state too"
    assert not [v for v in new if isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[1], dict)
                and "$tensor" in v[1]], "no new (key, tensor) pair"
    plain = json.loads(json.dumps(second))
    assert plain["$dict"][2] == ["epoch", 2] and plain["$dict"][0][1]["$odict"][0] == ["0.weight", {"$tensor": 0}]
    assert json.dumps(first).replace('"epoch", 1', '"epoch", 2') == json.dumps(second)
    other, _ = tree.flatten({"model": {"0.weight": model[0].weight.detach(), "bias": model[0].bias.detach()}})
    assert json.loads(json.dumps(other)) == {"$dict": [["model", {"$dict": [["0.weight", {"$tensor": 0}],
                                                                            ["bias", {"$tensor": 1}]]}]]}
    assert tree.decode(second, lambda i: i)["model"]["1.bias"] == 3


def test_a_dict_of_tensors_is_flattened_in_one_pass_and_its_node_kept_by_the_leaves_it_refers_to():
    """A dict whose every value is a tensor (a model's state_dict, one parameter's optimizer
    state) is flattened in one pass (`tree._tensor_dict`): the same skeleton and leaves as ever,
    tied tensors referring to their first leaf, and its node kept for the next save of the same
    keys and leaves; other sharing, or none, gets a node of its own."""
    import json

    w, b = torch.randn(4, 8), torch.zeros(3)

    def state(tied):
        return {"m": OrderedDict(a=w, b=b, tied=tied, rows=w.view(8, 4)),
                "o": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(2)}}}

    first, leaves = tree.flatten(state(w), share=True)
    ref = [{"$tensor": i} for i in range(5)]
    assert json.loads(json.dumps(first)) == {"$dict": [
        ["m", {"$odict": [["a", ref[0]], ["b", ref[1]], ["tied", ref[0]], ["rows", ref[2]]]}],
        ["o", {"$dict": [[0, {"$dict": [["step", ref[3]], ["exp_avg", ref[4]]]}]]}]]}
    assert [tree.path_str(leaf.path) for leaf in leaves] == ["m.a", "m.b", "m.rows", "o[0].step", "o[0].exp_avg"]
    assert leaves[2].tensor.shape == (8, 4) and leaves[0].tensor is w
    again, _ = tree.flatten(state(w), share=True)
    assert again["$dict"][0] is first["$dict"][0], "the same keys and leaves: the node and its pair made before"
    own, leaves = tree.flatten(state(w.clone()), share=True)
    assert own["$dict"][0][1] is not first["$dict"][0][1] and len(leaves) == 6
    assert [r["$tensor"] for _, r in own["$dict"][0][1]["$odict"]] == [0, 1, 2, 3]
    unshared, leaves = tree.flatten(state(w))
    assert [r["$tensor"] for _, r in unshared["$dict"][0][1]["$odict"]] == [0, 1, 2, 3] and len(leaves) == 6
    assert unshared["$dict"][0][1] is own["$dict"][0][1], "kept by the leaves it refers to, however they came"
    with pytest.raises(StateDictError, match=r"o\[0\]\.exp_avg: torch.sparse_coo"):
        tree.flatten({"o": {0: {"step": torch.tensor(1.0), "exp_avg": torch.ones(2).to_sparse()}}})


def test_an_optimizers_state_is_flattened_in_one_pass_as_node_by_node():
    """A dict of dicts of tensors (an optimizer's state, `tree._tensor_dicts`) gives the skeleton and
    leaves that the walk node by node gives: tensors shared inside and across its dicts refer to
    their first leaf; its node is kept for the next save of the same keys and leaves. Where some
    inner value is not a tensor, nothing of the one-pass attempt is left: not a leaf, not a note
    of an address (a tensor seen there again is still shared)."""
    import json

    w = torch.randn(4, 8)
    p0, p1 = torch.zeros(3), torch.ones(2)

    def state(extra=None):
        inner1 = {"step": torch.tensor(2.0), "exp_avg": p1, "same": p1}
        if extra is not None:
            inner1["lr"] = extra
        return {"w": w, "o": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": p0, "tied": w},
                                        1: inner1}, "param_groups": [{"params": [0, 1], "lr": 0.1}]}}

    def node_by_node(obj):  # the general walk's result, with this fast path taken away
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tree, "_DICT", set())
            tree._kept.tensor_nodes.clear()
            return tree.flatten(obj, share=True)

    s = state()
    first, leaves = tree.flatten(s, share=True)
    want, want_leaves = node_by_node(s)
    assert json.dumps(first) == json.dumps(want)
    assert [(lf.path, lf.tensor.data_ptr()) for lf in leaves] == [(lf.path, lf.tensor.data_ptr()) for lf in want_leaves]
    st = json.loads(json.dumps(first))["$dict"][1][1]["$dict"][0][1]["$dict"]
    assert st == [[0, {"$dict": [["step", {"$tensor": 1}], ["exp_avg", {"$tensor": 2}], ["tied", {"$tensor": 0}]]}],
                  [1, {"$dict": [["step", {"$tensor": 3}], ["exp_avg", {"$tensor": 4}], ["same", {"$tensor": 4}]]}]]
    a, b = tree.flatten(state(), share=True)[0], tree.flatten(state(), share=True)[0]
    assert a["$dict"][1][1]["$dict"][0][1] is b["$dict"][1][1]["$dict"][0][1], "the state's node kept"
    s = state(extra=0.5)
    mixed, leaves = tree.flatten(s, share=True)
    want, want_leaves = node_by_node(s)
    assert json.dumps(mixed) == json.dumps(want) and len(leaves) == len(want_leaves) == 5
    assert [(lf.path, lf.tensor.data_ptr()) for lf in leaves] == [(lf.path, lf.tensor.data_ptr()) for lf in want_leaves]
    assert tree.decode(mixed, lambda i: leaves[i].tensor)["o"]["state"][1]["lr"] == 0.5
    with pytest.raises(StateDictError, match=r"o\.state\[1\]\.exp_avg: torch.sparse_coo"):
        tree.flatten({"o": {"state": {0: {"step": torch.tensor(1.0)}, 1: {"exp_avg": torch.ones(2).to_sparse()}}}})


def test_flat_items_flatten_as_their_dict_would_without_a_walk():
    """A distributed save's items ({name: tensor}) are handed on already flattened: the same
    skeleton JSON and leaves as a walk of that dict gives, the skeleton made once per list of
    names; what is not a plain strided tensor is refused, naming the item."""
    import json

    names = ["a.w", "a.b@0,4", "opt.state.0.exp_avg"]
    tensors = [torch.randn(3), torch.zeros(2, dtype=torch.bfloat16), torch.ones(4)]
    layout = tree.FlatNames(names)
    flat = layout.flatten(tensors)
    skeleton, leaves = tree.flatten(flat)
    want_skeleton, want_leaves = tree.flatten(dict(zip(names, tensors)))
    assert json.dumps(skeleton) == json.dumps(want_skeleton)
    assert [(p, n) for p, _, n in leaves] == [(p, n) for p, _, n in want_leaves]
    assert all(a.tensor is b.tensor for a, b in zip(leaves, want_leaves))
    again = layout.flatten([t.clone() for t in tensors])
    assert again.skeleton is flat.skeleton and again.leaves[0].tensor is not tensors[0]
    assert json.dumps(tree.FlatNames(names[:2]).flatten(tensors[:2]).skeleton) == json.dumps(
        tree.flatten(dict(zip(names[:2], tensors[:2])))[0]), "other names: their own skeleton"
    with pytest.raises(StateDictError, match="a.b@0,4"):
        layout.flatten([tensors[0], torch.zeros(2, 2).to_sparse(), tensors[2]])
    with pytest.raises(StateDictError, match="not a plain tensor"):
        tree.FlatNames(names[:1]).flatten([_MyTensor(torch.zeros(1))])
    with pytest.raises(ValueError, match="2 tensors for 3 names"):
        layout.flatten(tensors[:2])


def test_skeletons_flattened_on_several_threads_at_once_refer_to_their_own_leaves(monkeypatch):
    """The kept nodes (`tree._Kept`) are shared by every thread that flattens: threads that grow
    them at once (first saves of large states on two engines, a restore beside a save) each get a
    skeleton whose every reference names the leaf at that place."""
    import threading

    monkeypatch.setattr(tree, "_kept", tree._Kept())
    tensors = [torch.zeros(1) for _ in range(3000)]
    errors = []

    def work(n: int) -> None:
        for _ in range(3):
            state = {"a": {f"t{i}": t for i, t in enumerate(tensors[:n])}, "b": {"x": tensors[n - 1], "lr": 0.1}}
            skeleton, leaves = tree.flatten(state)
            got = tree.decode(skeleton, lambda i: leaves[i].tensor)
            if [id(t) for t in got["a"].values()] != [id(t) for t in tensors[:n]] or got["b"]["x"] is not tensors[n - 1]:
                errors.append(n)

    threads = [threading.Thread(target=work, args=(n,)) for n in (2999, 2500, 1700, 3000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [r["$tensor"] for r in tree._kept.refs] == list(range(len(tree._kept.refs)))


def test_tree_takes_tensors_and_parameters_and_refuses_other_tensor_kinds():
    """flatten tests plain tensors and Parameters by exact type first (a save's hot path); a
    Parameter's subclass is still a leaf, other tensor kinds are refused by name."""
    p, sub = torch.nn.Parameter(torch.ones(3)), _MyParameter(torch.ones(2))
    skeleton, leaves = tree.flatten({"p": p, "sub": sub, "t": torch.zeros(1), 3: [torch.ones(1)]}, share=True)
    assert [tree.path_str(leaf.path) for leaf in leaves] == ["p", "sub", "t", "[3][0]"]
    assert not leaves[0].tensor.requires_grad and leaves[0].tensor.data_ptr() == p.data_ptr(), "detached, not copied"
    assert [k for k, _ in skeleton["$dict"]] == ["p", "sub", "t", 3]
    for bad, message in [(torch.ones(2).to_sparse(), "sparse_coo"),
                         (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
                         (torch.ones(2).as_subclass(_MyTensor), "tensor subclass _MyTensor")]:
        with pytest.raises(TypeError, match=message):
            tree.flatten({"x": {"y": bad}})


def test_tree_shares_a_view_seen_again_after_another_view_at_its_address():
    w = torch.randn(4, 8)
    state = {"a": w, "rows": w.view(8, 4), "b": w, "rows2": w.view(8, 4), "own": w.clone()}
    skeleton, leaves = tree.flatten(state, share=True)
    refs = {k: v["$tensor"] for k, v in skeleton["$dict"]}
    assert refs == {"a": 0, "rows": 1, "b": 0, "rows2": 1, "own": 2} and len(leaves) == 3


def test_tree_lists_of_ints_and_strs_are_copied_whole_and_others_encoded_each():
    """An optimizer's parameter ids are a list of ints per group: flatten copies such a list in
    one call. The copy, not the caller's list, is in the skeleton (written later, on the writer's
    thread); lists with anything else are encoded element by element as before."""
    ids, names = list(range(300)), ["a", "b"]
    state = {"ids": ids, "names": names, "flags": [True, 2], "mixed": [1, 2.5, float("inf"), None],
             "nested": [1, [2, torch.ones(1)]]}
    skeleton, leaves = tree.flatten(state)
    got = dict(skeleton["$dict"])
    ids.append(300)
    names[0] = "z"
    assert got["ids"] == list(range(300)) and got["ids"] is not ids and got["names"] == ["a", "b"]
    assert got["flags"] == [True, 2] and type(got["flags"][0]) is bool
    assert got["mixed"] == [1, 2.5, {"$float": "inf"}, None]
    assert got["nested"] == [1, [2, {"$tensor": 0}]] and len(leaves) == 1
    assert tree.decode(skeleton, lambda i: leaves[i].tensor)["ids"] == list(range(300))


@pytest.mark.parametrize("bad, message", [
    ({"s": {1, 2}}, "s: cannot checkpoint an object of type builtins.set"),
    ({"x": [lambda: 0]}, r"x\[0\]: cannot checkpoint"),
    ({frozenset(): 1}, "dict key"),
    ({"o": np.array([object()])}, "without pickling"),
])
def test_tree_refuses(bad, message):
    with pytest.raises(TypeError, match=message):
        tree.flatten(bad)


@pytest.mark.parametrize("node", [{"$tensor": -1}, {"$weird": 1}, {"$dtype": "os"}, {"$float": "1e9"},
                                  {"$bytes": "!!"}, {"$dict": [[1, 2], 3]}])
def test_tree_decode_rejects_malformed(node):
    with pytest.raises((ValueError, TypeError)):
        tree.decode(node, lambda i: None)


def test_row_ring_fifo_wraps_and_blocks():
    import threading

    ring = RowRing(10)
    a = ring.acquire(6)
    b = ring.acquire(4)
    assert (a, b) == (0, 6) and ring.try_acquire(1) is None
    got = []
    t = threading.Thread(target=lambda: got.append(ring.acquire(5)))
    t.start()
    t.join(0.1)
    assert not got, "must block while the rows are held"
    ring.release(a)
    t.join(2)
    assert got == [0]
    with pytest.raises(ValueError):
        ring.acquire(11)


@pytest.mark.parametrize("case", [
    dict(sizes=[1 << 20] * 5, pack=2 << 20, rows=10, expected=[(0, 2), (2, 4), (4, 5)]),
    dict(sizes=[1 << 20] * 5, pack=100 << 20, rows=2, expected=[(0, 2), (2, 4), (4, 5)]),
    dict(sizes=[300, 300, 300], pack=512, rows=10, expected=[(0, 1), (1, 2), (2, 3)]),  # 256-byte aligned slots
    dict(sizes=[100, 100, 100], pack=768, rows=10, expected=[(0, 3)]),
    dict(sizes=[4 << 20], pack=1 << 20, rows=1, expected=[(0, 1)]),  # a chunk larger than the buffer still goes alone
    dict(sizes=[], pack=1, rows=1, expected=[]),
])
def test_wave_bounds(case):
    from tiered.gpu.layout import wave_bounds

    assert wave_bounds(case["sizes"], case["pack"], case["rows"]) == case["expected"]


def test_a_layout_packs_every_chunk_where_its_offsets_say():
    """`Layout.build` (a GPU save's waves, built once per structure of state: per run of a
    tensor's chunks, not per chunk), on the CPU: every chunk is in exactly one wave, in order;
    waves keep to the pack buffer and the slab's rows; each codec group is one spec; and packing a
    wave puts every chunk's bytes (shuffled, for zstd) at its offset in the pack buffer."""
    from tiered.codecs import get_codec_class
    from tiered.codecs.base import Codec
    from tiered.config import ZstdSettings
    from tiered.gpu.layout import PACK_ALIGN, Layout, bytes_of
    from tiered.stage.plan import TensorPlan, chunk_refs
    from tiered.units import round_up

    cs, rows = 64 << 10, 12
    g = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8]
    tensors, plans = [], []
    for i in range(80):
        dt = dtypes[i % 4]
        numel = (i * 7919 * 61) % (3 * cs) // dt.itemsize + 1
        tensors.append(torch.randint(0, 256, (numel * dt.itemsize,), dtype=torch.uint8, generator=g).view(dt))
        spec = get_codec_class("zstd" if i % 3 else "none").spec_for(dt)
        plans.append(TensorPlan(i, f"t{i}", spec, False, cs, numel * dt.itemsize, dt, (numel,), "cuda:0"))
    plans.sort(key=lambda p: (p.spec.name, str(p.spec.configuration)))  # (as make_plan groups them)
    pack = torch.zeros(6 * cs + 4096, dtype=torch.uint8)
    layout = Layout.build(plans, pack, rows, cs + 8192, cs, ZstdSettings())
    assert [c for w in layout.waves for c in w.chunks] == chunk_refs(plans)
    assert len(layout.waves) > 5
    for wave in layout.waves:
        assert len(wave.chunks) <= rows
        assert len(wave.chunks) == 1 or sum(round_up(n, PACK_ALIGN) for n in wave.raw_sizes) <= pack.numel()
        assert wave.raw_sizes == [c.raw_size for c in wave.chunks]
        assert [m for _, a, b in wave.groups for m in range(a, b)] == list(range(len(wave.chunks)))
        codec_of = {}
        for codec, a, b in wave.groups:
            assert {c.plan.spec for c in wave.chunks[a:b]} == {codec.spec}
            codec_of.update((m, codec) for m in range(a, b))
        pack.zero_()
        wave.sources(tensors, {}, cs)
        for m, c in enumerate(wave.chunks):
            got = pack[wave.offsets[m]:wave.offsets[m] + c.raw_size]
            want = bytes_of(tensors[c.plan.index])[c.j * cs:c.j * cs + c.raw_size]
            if type(codec_of[m]).pack is not Codec.pack:  # (zstd shuffles bytes as it packs)
                out = torch.empty_like(got)
                codec_of[m].unpack(out, got, cs)
                got = out
            assert torch.equal(got, want), (m, c.plan.name, c.j)


def test_a_layout_reads_contiguous_aligned_tensors_in_place_and_packs_the_rest():
    """With a codec that reads in place (ans), a wave's chunks are addressed in their tensors'
    own memory and nothing of them is packed, except where the tensor is strided, at an address
    that is not a multiple of 16 bytes, or of a size that is not: those are packed into their
    places, whole or in pieces (a tensor split between waves), and addressed there. Every chunk's
    address holds its bytes. (On the CPU: the layout does no device work.)"""
    from tiered.codecs import get_codec_class
    from tiered.config import ZstdSettings
    from tiered.gpu.layout import IN_PLACE_ALIGN, Layout, bytes_of
    from tiered.stage.plan import TensorPlan

    cs = 4096
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1 << 16, generator=g)
    tensors = [
        torch.randn(3 * cs // 4, generator=g),            # 0: whole chunks, in place
        torch.randn(2 * cs // 4 + 8, generator=g),        # 1: a short last chunk, in place
        torch.randn(40, 60, generator=g).t(),             # 2: strided: packed
        base[1:1 + cs // 2],                             # 3: 4 bytes past an aligned address: packed
        torch.randn(5, generator=g),                      # 4: 20 bytes: packed
        torch.randn(9 * cs // 2, generator=g).to(torch.bfloat16),  # 5: split between waves, in place
        torch.randn(60, 40, generator=g).t(),             # 6: strided and split between waves: packed
        base[4:4 + 3 * cs // 4],                          # 7: a view 16 bytes in: in place
    ]
    plans = tuple(TensorPlan(i, f"t{i}", get_codec_class("ans").spec_for(t.dtype), False, cs,
                             t.numel() * t.element_size(), t.dtype, tuple(t.shape), "cuda:0")
                  for i, t in enumerate(tensors))
    pack = torch.zeros(5 * cs, dtype=torch.uint8)
    layout = Layout.build(plans, pack, 64, cs + 512, cs, ZstdSettings())
    assert len(layout.waves) > 3
    in_place = set()
    for wave in layout.waves:
        pack.zero_()
        addresses = wave.sources(tensors, {}, cs)
        assert len(addresses) == len(wave.chunks)
        for m, c in enumerate(wave.chunks):
            t = tensors[c.plan.index]
            want = bytes_of(t.contiguous())[c.j * cs:c.j * cs + c.raw_size]
            at = int(addresses[m])
            if at == t.data_ptr() + c.j * cs:
                in_place.add(c.plan.index)
                assert t.is_contiguous() and at % IN_PLACE_ALIGN == 0
                got = bytes_of(t)[c.j * cs:c.j * cs + c.raw_size]
            else:
                assert at == pack.data_ptr() + wave.offsets[m], (c.plan.name, c.j)
                got = pack[wave.offsets[m]:wave.offsets[m] + c.raw_size]
            assert torch.equal(got, want), (c.plan.name, c.j)
    assert in_place == {0, 1, 5, 7}
    assert layout.waves[0].sources(tensors, {}, cs) is not layout.waves[0].addresses, "a save's addresses are its own"


def test_a_layout_built_before_the_slab_is_kept_where_its_waves_would_be_the_same():
    """`GpuDevice.prepare` lays saves out at start-up for the fewest rows the slab can have; the
    first save keeps that layout for a larger slab only where no wave was cut at that count."""
    from tiered.codecs import get_codec_class
    from tiered.config import ZstdSettings
    from tiered.gpu.layout import Layout
    from tiered.stage.plan import TensorPlan

    cs = 64 << 10
    spec = get_codec_class("none").spec_for(torch.float32)

    def plans(sizes):
        return tuple(TensorPlan(i, f"t{i}", spec, False, cs, n, torch.float32, (n // 4,), "cuda:0")
                     for i, n in enumerate(sizes))

    pack = torch.zeros(4 * cs, dtype=torch.uint8)
    whole = plans([cs] * 12)  # full chunks: the pack buffer cuts every wave at 4
    layout = Layout.build(whole, pack, 10, cs + 4096, cs, ZstdSettings())
    assert not layout.capped and [len(w.chunks) for w in layout.waves] == [4, 4, 4]
    assert layout.fits(whole, pack, 10, cs + 4096) and layout.fits(whole, pack, 500, cs + 4096)
    assert not layout.fits(whole, pack, 8, cs + 4096), "fewer rows than it was built for"
    assert not layout.fits(whole, pack, 500, cs + 8192), "another row stride"
    assert not layout.fits(plans([cs] * 12), pack, 10, cs + 4096), "plans of another save structure"
    assert not layout.fits(whole, torch.zeros(4 * cs, dtype=torch.uint8), 10, cs + 4096), "another pack buffer"
    tiny = plans([256] * 30)  # many small tensors: the rows cut the waves
    layout = Layout.build(tiny, pack, 10, cs + 4096, cs, ZstdSettings())
    assert layout.capped and [len(w.chunks) for w in layout.waves] == [10, 10, 10]
    assert layout.fits(tiny, pack, 10, cs + 4096) and not layout.fits(tiny, pack, 500, cs + 4096)


def test_row_ring_on_block_called_only_when_waiting():
    import threading

    ring = RowRing(4)
    calls = []
    a = ring.acquire(3, on_block=lambda: calls.append("blocked"))
    assert a == 0 and calls == []
    blocked = threading.Event()
    releaser = threading.Thread(target=lambda: blocked.wait(60) and ring.release(a))  # once it has said so
    releaser.start()
    assert ring.acquire(3, on_block=lambda: (calls.append("blocked"), blocked.set())) == 0
    releaser.join()
    assert calls == ["blocked"]


def test_file_runs_group_chunks_that_lie_end_to_end():
    from tiered.format.manifest import ChunkRecord
    from tiered.gpu.layout import file_runs

    c = [ChunkRecord(0, 5000, 1 << 20, 0), ChunkRecord(8192, 100, 1 << 20, 0), ChunkRecord(12288, 4096, 1 << 20, 0),
         ChunkRecord(40960, 1, 10, 0), ChunkRecord(0, 5000, 1 << 20, 0)]
    # extents are 4 KiB aligned: 8192, 4096, 4096, 4096, 8192
    assert file_runs(c) == [(0, 16384, [0, 1, 2]), (40960, 4096, [3]), (0, 8192, [4])]
    assert file_runs([]) == []


def test_extent_runs_fill_each_run_up_to_the_limit_with_whole_aligned_extents():
    import random

    from tiered.format.chunks import extent_runs

    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.randint(1, 1 << 20) for _ in range(rng.randint(0, 200))]
        limit = rng.choice([4096, 1 << 20, 3 << 20, 64 << 20])
        extents, bounds, offsets = extent_runs(sizes, limit)
        assert extents == [-(-n // 4096) * 4096 for n in sizes]
        assert [r for i, k, _ in bounds for r in range(i, k)] == list(range(len(sizes)))  # every row once, in order
        for n, (i, k, total) in enumerate(bounds):
            assert total == sum(extents[i:k]) and (k == i + 1 or total <= limit)
            assert offsets[i:k].tolist() == [sum(extents[i:r]) for r in range(i, k)]
            if n + 1 < len(bounds):  # greedy: the next row would not have fitted
                assert total + extents[k] > limit


def test_joined_extents_write_consecutive_extents_as_few_buffers():
    from tiered.stage.cpu import joined_extents

    parts = [memoryview(bytes([i]) * n) for i, n in enumerate([4096, 8192, 4096, 40960, 4096])]
    got = list(joined_extents(parts, 16384))
    assert [at for at, _ in got] == [0, 16384, 57344]
    assert b"".join(bytes(b) for _, b in got) == b"".join(bytes(p) for p in parts)
    assert [len(b) for _, b in got] == [16384, 40960, 4096]  # (the large one alone, as it is)
    assert list(joined_extents([], 16384)) == []


def test_the_writer_reads_queued_waves_sizes_only_while_the_copy_engine_is_idle():
    """`RowsWriter._read_ahead` (on the CPU, with stand-ins for a device's waves): once the
    device's copies are done, the sizes of the queued drained waves whose compression is done are
    read, in order, up to the first that is not done; waves of another device, waves that do not
    drain and CPU segments are skipped; nothing is taken from the queue; with copies in flight,
    nothing is read (nvCOMP's read would wait behind them)."""
    import queue
    from types import SimpleNamespace

    from tiered.gpu.write import RowsWriter

    class Wave:
        def __init__(self, done):
            self.ready = SimpleNamespace(query=lambda: done)
            self.read = False

        def settle(self):
            self.read = True

    idle = [False]
    dev, other = SimpleNamespace(copies_idle=lambda: idle[0]), SimpleNamespace(copies_idle=lambda: True)
    seg = lambda done, drain=True, device=dev: SimpleNamespace(wave=Wave(done), drain=drain, device=device)  # noqa: E731
    items = [seg(True), "cpu segment", seg(True, device=other), seg(True, drain=False), seg(True), seg(False),
             seg(True)]
    q: queue.Queue = queue.Queue()
    for item in ["the wave being written"] + items:
        q.put(item)
    writer = RowsWriter(None, None, {})
    assert writer.take(q) == "the wave being written"  # (the queue it reads ahead in)
    writer._read_ahead(dev)
    assert not any(getattr(i, "wave", None) and i.wave.read for i in items), "copies in flight: nothing read"
    idle[0] = True
    writer._read_ahead(dev)
    assert [getattr(i, "wave", None) and i.wave.read for i in items] == [True, None, False, False, False, False,
                                                                         False], "READ_AHEAD bounds the look"
    assert list(q.queue) == items
    q.get()
    writer._read_ahead(dev)
    assert [getattr(i, "wave", None) and i.wave.read for i in items] == [True, None, False, False, True, False,
                                                                         False], "up to the first not compressed"


def test_the_writer_gives_slab_rows_back_once_copied_and_each_wave_once(monkeypatch):
    """`RowsWriter` (on the CPU, with stand-ins for a device's drained waves): before each wave it
    issues, the rows of the oldest issued waves whose copies are done go back, in order, up to the
    first not done, before those waves are finished; finishing or aborting a wave gives its rows
    back only if that did not, so every wave's rows go back exactly once."""
    from types import SimpleNamespace

    from tiered.gpu import write

    monkeypatch.setattr(write, "DRAIN_DEPTH", 3)
    released: list[int] = []

    class Drained:
        def __init__(self):
            self.done, self.sizes, self.runs = False, [], []

        def copied(self):
            return self.done

        def wait(self):
            self.done = True
            return []

        def release_hosts(self):
            self.done = True

    device = SimpleNamespace(issue_drain=lambda seg, sizes, acquire: seg.drained)

    def seg(n):
        return SimpleNamespace(drain=True, device=device, sizes=lambda: [], drained=Drained(),
                               release=lambda: released.append(n))

    waves = [seg(n) for n in range(6)]
    writer = write.RowsWriter(None, None, {})
    for w in waves[:3]:
        writer.add(w)
    assert released == [], "nothing copied yet"
    waves[0].drained.done = waves[2].drained.done = True
    writer.add(waves[3])  # (four issued: the oldest is finished, its rows already back)
    assert released == [0], "only up to the first wave not copied"
    waves[1].drained.done = True
    writer.add(waves[4])  # (1 and 2 go back before 4 is issued; 1 is then finished)
    assert released == [0, 1, 2]
    writer.flush()
    assert released == [0, 1, 2, 3, 4]
    writer.add(waves[5])
    writer.abort()
    assert released == [0, 1, 2, 3, 4, 5]


def _script(name: str):
    """scripts/NAME.py as a module, loaded with the scripts' folder on sys.path (they import one
    another) and, while it loads, in sys.modules (its dataclasses look their module up there)."""
    import importlib.util
    from pathlib import Path

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", scripts / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(scripts))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(scripts))
        sys.modules.pop(spec.name, None)
    return module


def test_the_bench_counts_full_collections_by_thread():
    """scripts/gc_watch.py (the scale bench's per-save record): full collections inside the block,
    all threads and the engine's (named tiered-*); younger generations and collections outside
    the block are not counted."""
    import gc
    import threading

    gc_watch = _script("gc_watch")
    gc.collect()
    with gc_watch.FullCollections() as full:
        gc.collect(0)
        gc.collect(1)
        assert full.runs == []
        gc.collect()
        worker = threading.Thread(target=gc.collect, name="tiered-writer")
        worker.start()
        worker.join()
    gc.collect()
    assert [name for name, _ in full.runs] == [threading.current_thread().name, "tiered-writer"]
    assert full.ms >= full.engine_ms > 0 and full.engine_ms == round(full.runs[1][1], 1)


def test_the_scale_chart_names_a_failed_row_and_colours_every_row_apart(tmp_path):
    """scripts/chart_scale.py: a failed row is no point but is named in its file's caption; rows it
    has no colour for (variants) get colours of their own, none shared with another row."""
    import json

    chart = _script("chart_scale")
    row = {"warm_stall_ms": {"median": 20.0}, "warm_durable_s": {"median": 1.0}, "restore_s": 1.1, "error": None}
    run = {"info": {"device": "GPU", "date": "2026-11-29"},
           "scale": [{"state_gb": 2.43, "rows": [dict(row, name="tiered_overlap"),
                                                 dict(row, name="tiered_overlap_deferred"),
                                                 dict(row, name="tiered_overlap+0"), dict(row, name="dcp_pinned"),
                                                 {"name": "dcp_stager", "error": "KeyError: <class 'type'>"}]}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    series, captions = chart.points([tmp_path / "run.json"])
    assert sorted(series) == ["dcp_pinned", "tiered_overlap", "tiered_overlap+0", "tiered_overlap_deferred"]
    assert "dcp_stager failed at 2.43 GB (KeyError" in captions[0], captions
    colours = chart.colors(sorted(series))
    assert len(set(colours.values())) == len(colours) and None not in colours.values(), colours

    # the control row is one line whatever its rest, stall only; rows that save nothing else are left out
    run["scale"] = [{"state_gb": gb, "rows": [dict(row, name=f"no_save:{rest}"), dict(row, name="gil_load:100"),
                                              dict(row, name="migration:in_process"), dict(row, name="tiered_overlap")]}
                    for gb, rest in ((2.43, 1.1), (24.28, 11))]
    (tmp_path / "run.json").write_text(json.dumps(run))
    series, _ = chart.points([tmp_path / "run.json"])
    assert sorted(series) == [chart.CONTROL, "tiered_overlap"]
    assert sorted(series[chart.CONTROL]) == [2.43, 24.28]
    assert all(v["durable_s"] is None and v["restore_s"] is None for v in series[chart.CONTROL].values())


def test_the_scale_bench_judges_every_tiered_row_the_overlapped_one_run_alone_too():
    """`bench.py --scale --methods tiered_overlap` runs no strict row: the durable and restore
    targets come from the overlapped one (they used to be left out). Every tiered row is judged
    on its own, a row with its codec pinned (`tiered_overlap:none`) too: each stores and restores
    its own steps."""
    scale = _script("scale")

    def row(name, stall, durable, restore):
        return {"name": name, "error": None, "warm_stall_ms": {"median": stall}, "first": {"stall_ms": stall},
                "warm_durable_s": {"median": durable}, "restore_s": restore, "stored_bytes": 10**10}

    out = {"ceilings": {"disk": {"write_gbps": 1.0, "read_gbps": 0.5}},
           "rows": [row("tiered_overlap", 120.0, 12.0, 25.0), row("dcp_pinned", 1300.0, 40.0, None)]}
    got = scale.targets(out)
    assert got["tiered_overlap: durable <= 1.15 x stored / write ceiling"] == {"met": False,
                                                                               "measured": "12.0 s vs 11.50 s"}
    assert got["tiered_overlap: restore <= 1.15 x stored / read ceiling"]["met"] is False
    assert got["tiered_overlap: stall <= DCP pinned / 10"] == {"met": True, "measured": "120.0 vs 1300.0 ms"}
    out["rows"].insert(0, row("tiered", 500.0, 11.0, 22.0))
    out["rows"].append(row("tiered_overlap:none", 130.0, 14.0, 30.0))  # (a row with its codec pinned)
    got = scale.targets(out)
    assert got["tiered: durable <= 1.15 x stored / write ceiling"]["met"] is True, "the strict row, where it ran"
    assert got["tiered_overlap: durable <= 1.15 x stored / write ceiling"]["met"] is False, "each row on its own"
    assert got["tiered_overlap:none: stall <= 50 ms"] == {"met": False, "measured": "130.0 ms"}
    assert got["tiered_overlap:none: restore <= 1.15 x stored / read ceiling"]["met"] is False
    assert not any(k.startswith("dcp_pinned") for k in got)


def test_the_scale_bench_holds_several_ranks_to_the_faster_of_the_disk_alone_and_shared():
    """Under torchrun the disk is probed by one rank alone and by every rank at once; durable and
    restore are held to whichever was faster (the stricter bound), each rate on its own."""
    scale = _script("scale")
    assert scale.disk_bounds({"disk": {"write_gbps": 2.4, "read_gbps": 2.1}}) == {"write_gbps": 2.4, "read_gbps": 2.1}
    assert scale.disk_bounds({"disk": {"write_gbps": 2.4, "read_gbps": 2.1},
                              "disk_together": {"write_gbps": 1.8, "read_gbps": 2.6}}) == {"write_gbps": 2.4,
                                                                                          "read_gbps": 2.6}
    row = {"name": "tiered_overlap", "error": None, "warm_stall_ms": {"median": 100.0}, "first": {"stall_ms": 90.0},
           "warm_durable_s": {"median": 9.0}, "restore_s": 9.0, "stored_bytes": 10**10}
    got = scale.targets({"ceilings": {"disk": {"write_gbps": 1.0, "read_gbps": 1.0},
                                      "disk_together": {"write_gbps": 2.0, "read_gbps": 0.5}}, "rows": [row]})
    assert got["tiered_overlap: durable <= 1.15 x stored / write ceiling"] == {"met": False, "measured": "9.0 s vs 5.75 s"}
    assert got["tiered_overlap: restore <= 1.15 x stored / read ceiling"] == {"met": True, "measured": "9.0 s vs 11.50 s"}


def test_the_scale_bench_also_judges_a_restore_by_the_disk_probed_just_before_it():
    """The read ceiling probed just before a restore is a second restore target beside the
    start-of-run one, which stays as it was: the disk may have slowed in between."""
    scale = _script("scale")
    row = {"name": "tiered_overlap", "error": None, "warm_stall_ms": {"median": 100.0}, "first": {"stall_ms": 90.0},
           "warm_durable_s": {"median": 9.0}, "restore_s": 16.0, "stored_bytes": 2 * 10**10,
           "read_gbps_at_restore": 1.5}
    got = scale.targets({"ceilings": {"disk": {"write_gbps": 3.0, "read_gbps": 2.0}}, "rows": [row]})
    assert got["tiered_overlap: restore <= 1.15 x stored / read ceiling"] == {"met": False,
                                                                             "measured": "16.0 s vs 11.50 s"}
    at = got["tiered_overlap: restore <= 1.15 x stored / read ceiling probed just before it"]
    assert at["measured"] == "16.0 s vs 15.33 s (1.5 GB/s)" and at["met"] is False
    row["restore_s"] = 15.0
    got = scale.targets({"ceilings": {"disk": {"write_gbps": 3.0, "read_gbps": 2.0}}, "rows": [row]})
    assert got["tiered_overlap: restore <= 1.15 x stored / read ceiling probed just before it"]["met"] is True
    assert got["tiered_overlap: restore <= 1.15 x stored / read ceiling"]["met"] is False
    del row["read_gbps_at_restore"]
    assert not any("just before" in k for k in scale.targets({"ceilings": {"disk": {"write_gbps": 3.0,
                                                                                   "read_gbps": 2.0}}, "rows": [row]}))


def test_the_scale_bench_prints_a_gpu_runs_result_on_a_machine_without_one(capsys):
    """The summary of a size prints a GPU run's ceilings (the GPU codecs' rates, a branch only a GPU
    run reaches) and its rows from that run's recorded result (committed)."""
    import json
    from pathlib import Path

    scale = _script("scale")
    recorded = Path(__file__).resolve().parent.parent / "docs/bench/2026-11-28-h200-scale24-side.json"
    scale.print_size(json.loads(recorded.read_text())["scale"][0])
    out = capsys.readouterr().out
    assert "GPU ANS encode 384.2 GB/s alone on one batch of up to 256 chunks (this state at that rate: 63 ms" in out, out
    assert "| tiered_overlap | 81.6 (76.1–87.1) |" in out and "| dcp_pinned | 827.6 (807.0–848.2) |" in out, out


def test_the_scale_bench_says_which_steps_of_a_window_a_warm_save_slowed():
    """Each save's steps are set against the same steps of the window just before it; the row
    keeps the median of each step's extra over the warm saves (the first, cold, save left out)."""
    measure = _script("scale_measure")
    row = measure.Row("tiered_overlap")
    for extra in ([500.0, 9.0, 1.0, 0.0], [40.0, 3.0, -1.0, 0.0], [60.0, 5.0, 1.0, 2.0], [50.0, 4.0, 3.0, 0.0]):
        row.add(1.0, 1.1, 0.02, 5.0, 0, 0, 0, 0)
        row.saves[-1]["extra_steps_ms"] = extra
    assert row.summary()["warm_extra_steps_ms"] == [50.0, 4.0, 1.0, 0.0]
    assert measure.Row("none").summary()["warm_extra_steps_ms"] is None


def test_the_scale_bench_takes_a_saves_steps_from_its_slowest_rank():
    """Under torchrun a save's numbers are its slowest rank's, and its per-step lists all come from
    the one rank whose stall was largest (not each list from whichever rank sorts last)."""
    measure = _script("scale_measure")
    rows = []
    for stall, call, steps, extra, counts in ((120.0, 30.0, [1900.0, 1860.0], [60.0, 5.0], {"num_device_free": 2}),
                                              (110.0, 45.0, [1950.0, 1850.0], [90.0, -20.0], {})):
        row = measure.Row("tiered_overlap")
        row.add(1.0, 1.0 + stall / 1e3, call / 1e3, 5.0, 0, 0, 0, 0)
        row.saves[-1].update(steps_ms=steps, extra_steps_ms=extra, full_gc_ms=0, allocator=counts)
        rows.append(row.summary())
    save = measure.combine(rows)["saves"][0]
    assert save["stall_ms"] == 120.0 and save["call_ms"] == 45.0, "each number: its slowest rank"
    assert save["steps_ms"] == [1900.0, 1860.0] and save["extra_steps_ms"] == [60.0, 5.0], "lists: one rank's"
    assert save["allocator"] == {"num_device_free": 2}, "dicts (the allocator's counters): that rank's too"


def test_the_bench_finds_where_the_engines_threads_held_the_gil():
    """scripts/gil_watch.py (`bench.py --scale ... --gil-watch`): a thread that asks for the GIL
    every millisecond waits while an engine thread holds it in a long C call (a sort), and notes
    that thread's place; an engine thread parked in a wait, which holds no GIL, is not noted."""
    import random
    import threading

    gil_watch = _script("gil_watch")
    values = [random.random() for _ in range(1_000_000)]

    def hog() -> None:
        for _ in range(3):
            sorted(values)  # one C call each, holding the GIL throughout

    parked = threading.Event()
    idle = threading.Thread(target=parked.wait, name="tiered-stager")
    idle.start()
    try:
        with gil_watch.GilWaits() as gil:
            worker = threading.Thread(target=hog, name="tiered-writer")
            worker.start()
            worker.join()
    finally:
        parked.set()
        idle.join()
    got = gil.summary()
    assert got["gil_late_count"] >= 1 and got["gil_late_ms"] >= got["gil_late_max_ms"] >= gil.long_ms
    assert any("tiered-writer: " in w and " hog" in w for w in got["gil_where"]), got
    assert not any("tiered-stager" in w for w in got["gil_where"]), got


def test_the_bench_samples_where_the_training_thread_stood_in_a_call_that_let_the_gil_go():
    """scripts/gil_watch.py: in the span's first `main_ms`, every wake-up notes where the thread
    that entered the span was: a thread standing in a C call that lets the GIL go (here a sleep,
    on a GPU host a kernel launch waiting on a lock) shows at that line; its waits inside the
    span's own start and end do not."""
    import time

    gil_watch = _script("gil_watch")

    def seen_here(gil) -> int:
        return sum(n for place, n in list(gil.main_where.items()) if "stands_in_a_call" in place)

    def stands_in_a_call(gil) -> None:
        deadline = time.monotonic() + 60
        while seen_here(gil) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)  # (a C call that lets the GIL go, until the watcher has seen it there)

    with gil_watch.GilWaits(main_ms=60_000.0) as gil:
        stands_in_a_call(gil)
    got = gil.summary()
    (top, n), = gil.main_where.most_common(1)
    assert "stands_in_a_call" in top and n >= 3, got["main_where"]
    assert got["main_first_ms"] == 60_000.0 and got["main_where"][0].endswith(top)
    # Never the span's own start or end (the watcher's start, its join): those are not the loop's.
    assert not any("threading.py" in place or "gil_watch.py" in place for place in gil.main_where), got


def test_the_bench_timeline_splits_a_steps_gpu_time_into_busy_idle_and_the_saves_work():
    """scripts/gpu_timeline.py (`bench.py --scale ... --trace`): the busiest stream is training's,
    each of its operations in the step that launched it (by correlation id), giving each step's
    busy and idle time; other streams are the save's, and the link's idle time between the drain's
    copies (on two streams here) is split into late (issued after the copies before ended) and
    GPU-side; a CPU trace of a real window carries the marks."""
    tl = _script("gpu_timeline")

    def x(cat, name, ts, dur, tid=1, **args):  # (ts and dur below in units of 10 µs)
        return {"ph": "X", "cat": cat, "name": name, "ts": 10 * ts, "dur": 10 * dur, "tid": tid, "pid": 1,
                "args": args}

    trace = {"traceEvents": [
        x("user_annotation", "bench.save", 1000, 50),
        x("user_annotation", "bench.step1", 1050, 2000),
        x("user_annotation", "Optimizer.step#AdamW.step", 1500, 900),
        x("user_annotation", "bench.step2", 3050, 1000),
        x("cuda_runtime", "cudaLaunchKernel", 1100, 5, correlation=1),
        x("cuda_runtime", "cudaLaunchKernel", 1200, 5, correlation=2),
        x("cuda_runtime", "cudaLaunchKernel", 3100, 5, correlation=3),
        x("cuda_driver", "cuLaunchKernel", 1060, 5, tid=2, correlation=4),
        x("cuda_runtime", "cudaMemcpyAsync", 1070, 5, tid=2, correlation=5),
        x("kernel", "fwd", 1200, 300, stream=7, correlation=1),  # step 1: 300 + 200 busy over a 900 span
        x("kernel", "bwd", 1900, 200, stream=7, correlation=2),
        x("kernel", "fwd", 3200, 400, stream=7, correlation=3),
        x("kernel", "ans_encode", 1300, 400, stream=9, correlation=4),  # 200 of it beside "fwd"
        x("gpu_memcpy", "Memcpy DtoH", 1800, 100, stream=10, correlation=5, bytes=2_000_000_000),
        # two more copies on the drain's stream: one issued before the last ended and started 30
        # later (GPU-side), one whose call ended 20 after the copy before it had (late), then 10 more
        x("cuda_runtime", "cudaMemcpyAsync", 1850, 5, tid=2, correlation=6),
        x("gpu_memcpy", "Memcpy DtoH", 1930, 50, stream=10, correlation=6, bytes=1_000_000_000),
        x("cuda_runtime", "cudaMemcpyAsync", 1995, 5, tid=2, correlation=7),
        x("gpu_memcpy", "Memcpy DtoH", 2010, 50, stream=10, correlation=7, bytes=1_000_000_000),
        # a second lane: its copy runs beside the last one and 5 past it, then 10 idle before it
        x("cuda_runtime", "cudaMemcpyAsync", 1996, 5, tid=2, correlation=9),
        x("gpu_memcpy", "Memcpy DtoH", 2040, 25, stream=12, correlation=9, bytes=500_000_000),
        x("cuda_runtime", "cudaMemcpyAsync", 2000, 5, tid=2, correlation=10),
        x("gpu_memcpy", "Memcpy DtoH", 2075, 5, stream=12, correlation=10, bytes=100_000_000),
        x("gpu_memcpy", "Memcpy DtoH", 2085, 1, stream=13, correlation=11, bytes=1_000),  # (a wave's sizes)
        x("gpu_memcpy", "Memcpy HtoD", 1000, 1, stream=11, correlation=8, bytes=1_000),
    ]}
    got = tl.summarize(trace)
    assert got["train_stream"] == 7
    assert got["steps"][0] == {"cpu": [0.5, 20.5], "gpu": [2.0, 11.0], "busy_ms": 5.0, "idle_ms": 4.0}
    assert got["steps"][1]["busy_ms"] == 4.0 and got["steps"][1]["idle_ms"] == 0.0
    assert got["save"]["stream 9 kernel"] == {"n": 1, "busy_ms": 4.0, "from_ms": 3.0, "to_ms": 7.0}
    assert got["save"]["stream 10 gpu_memcpy"]["gb"] == 4.0
    assert got["drain_copy_gaps"] == {"from_ms": 8.0, "to_ms": 10.8, "copies": 5, "streams": 2, "busy_ms": 2.1,
                                      "late_ms": 0.2, "late_gaps": 1, "gpu_ms": 0.5, "gpu_gaps": 3}
    assert got["kernels_at_once_ms"] == 2.0
    assert got["first_optimizer_step"] == [5.0, 9.0]
    assert tl.union_ms([(0, 2), (1, 3), (5, 6)]) == 4

    with tl.Timeline("cpu") as real:
        with torch.profiler.record_function(tl.SAVE_MARK):
            torch.ones(8).sum()
        for i in (1, 2):
            with torch.profiler.record_function(f"{tl.STEP_MARK}{i}"):
                torch.ones(64, 64) @ torch.ones(64, 64)
    assert len(real.summary["steps"]) == 2 and real.summary["steps"][0]["cpu"][0] >= 0


def test_drain_timing_puts_the_idle_link_down_to_the_writer_or_the_packing():
    """scripts/drain_timing.py: each drained run's packing and copy times (from CUDA events)
    become the copies' span and rate, and the link's idle between two copies is put down to the
    writer where the run's packing began after the link went idle, else to the packing; the part
    at a wave's first run is shown apart, and set against when the wave was encoded and issued."""
    dt = _script("drain_timing")

    def run(pack_start, pack_end, copy_start, copy_end, first):
        return {"pack_start": pack_start, "pack_end": pack_end, "copy_start": copy_start, "copy_end": copy_end,
                "bytes": 55_000_000, "first": first}

    got = dt.summary([run(10.0, 10.1, 10.1, 11.1, True), run(10.5, 10.6, 11.1, 12.1, False),
                      run(12.6, 12.7, 12.7, 13.7, True), run(13.0, 14.0, 14.0, 15.0, False)], [2.0, 3.0])
    assert got == {"runs": 4, "waves": 2, "gb": 0.22, "first_ms": 10.1, "last_ms": 15.0, "span_ms": 4.9,
                   "copies_gbps": 55.0, "idle_ms": 0.9, "idle_writer_ms": 0.5, "idle_packing_ms": 0.4,
                   "at_wave_start_writer_ms": 0.5, "at_wave_start_packing_ms": 0.1, "packing_ms_median": 0.1,
                   "packing_ms_p90": 0.1, "packing_ms_max": 1.0, "issue_ms": 5.0, "issue_ms_median": 2.5,
                   "issue_ms_max": 3.0}
    assert dt.summary([]) == {"runs": 0}
    assert [dt.variant_of(n) for n in range(4)] == ["B", "A", "B", "A"]
    # The second wave's first copy came 0.6 ms after the copy before it ended; its drain was
    # issued 0.3 ms after that end, its compression had ended 4.1 ms before it.
    runs = [run(10.0, 10.1, 10.1, 11.1, True), run(10.5, 10.6, 11.1, 12.1, False), run(12.6, 12.7, 12.7, 13.7, True)]
    got = dt.summary(runs, starts=[{"issued": 9.0, "encoded": 5.0}, {"issued": 12.4, "encoded": 8.0}])
    assert {k: got[k] for k in got if k.startswith(("at_wave_start_idle", "issued", "encoded"))} == {
        "at_wave_start_idle_ms": 0.6, "issued_late_ms": 0.3, "encoded_late_ms": 0.0, "issued_ahead_ms_median": -0.3,
        "encoded_ahead_ms_median": 4.1}
    assert "issued_late_ms" not in dt.summary(runs, starts=[{"issued": 9.0, "encoded": 5.0}])  # (a wave unmatched)


def test_a_traced_window_out_of_gpu_memory_costs_the_row_nothing(tmp_path):
    """`--trace`: the profiler's GPU memory once left training none. Training
    running out of memory in the traced window, which comes after the measured ones, leaves the
    row its measured saves, notes the error, and still hands back the traced save's step (started
    before the failure) for the restore; out of memory in a measured window still fails the row."""
    sm = _script("scale_measure")
    traced_now = [False]

    def step_fn(before_update=None):
        if traced_now[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB (test)")

    def save(n):
        traced_now[0] = n == 3
        return n

    durable_of = []
    run = sm.Run({"w": torch.ones(4)}, sm.Window(step_fn, "cpu", 2), 2, tmp_path, "cpu", lambda: False, [],
                 trace="summary")
    row = sm.Row("tiered")
    sm.measure(row, run, 0.0, save, lambda step: durable_of.append(step) or time.perf_counter(), lambda n: None)
    assert len(row.saves) == 2 and all(s["stall_ms"] is not None for s in row.saves)
    traced = row.extra["traced_save"]
    assert traced["error"].startswith("OutOfMemoryError") and traced["stall_ms"] is None, traced
    assert durable_of == [1, 2, 3] and run.windows == 3
    untraced = sm.Run({"w": torch.ones(4)}, sm.Window(lambda before_update=None: None, "cpu", 1), 2, tmp_path, "cpu",
                      lambda: False, [])
    row = sm.Row("tiered")
    sm.measure(row, untraced, 0.0, lambda n: n, lambda step: time.perf_counter(), lambda n: None)
    assert untraced.windows == 3 and len(row.saves) == 2, "the save handed the fingerprinted state is not counted"
    assert row.extra["last_save"]["stall_ms"] is not None and "timeline" not in row.extra["last_save"]

    save_one = lambda n: (traced_now.__setitem__(0, True), n)[1]  # noqa: E731 - out of memory in save 1's window
    with pytest.raises(torch.OutOfMemoryError):
        sm.measure(sm.Row("tiered"), run, 0.0, save_one, lambda step: time.perf_counter(), lambda n: None)


def test_the_scale_benchs_load_rows_read_their_load_and_gil_load_holds_the_gil_that_long():
    """`gil_load:TOTALxBURSTxSPAN` and `d2h_load:GBxSPAN` (no save: one part of a save's work
    alone): their specs are checked when the row is named, and gil_load's burn takes its total
    of the thread's CPU time over about its span. (d2h_load needs a GPU: GPU runs.)"""
    methods = _script("scale_methods")
    assert methods.row_spec("gil_load:50x1x200") == ("gil_load", "50x1x200", None, None, "auto")
    assert methods.gil_load_spec("") == (100.0, 0.5, 500.0)
    assert methods.gil_load_spec("40") == (40.0, 0.5, 500.0)
    assert methods.gil_load_spec("40x2") == (40.0, 2.0, 500.0)
    for bad in ("gil_load:x", "gil_load:0", "gil_load:10x20", "gil_load:1x2x3x4", "gil_load:10x0"):
        with pytest.raises(ValueError, match="gil_load:"):
            methods.row_spec(bad)
    assert methods.row_spec("d2h_load:8x300") == ("d2h_load", "8x300", None, None, "auto")
    assert methods.d2h_load_spec("") == (20.0, 0.0) and methods.d2h_load_spec("4") == (4.0, 0.0)
    for bad in ("d2h_load:0", "d2h_load:4x-1", "d2h_load:1x2x3", "d2h_load:lots"):
        with pytest.raises(ValueError, match="d2h_load:"):
            methods.row_spec(bad)
    c0, t0 = time.thread_time(), time.perf_counter()
    methods.gil_burn(30, 5, 120)
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    assert cpu >= 0.030 and wall >= 0.115, (cpu, wall)  # (what it burns and spans, by construction)


def test_the_scale_bench_reads_a_rows_codec_switch_interval_pack_buffer_and_stage_after_from_its_name():
    methods = _script("scale_methods")
    assert methods.row_spec("tiered_overlap") == ("tiered_overlap", "", None, None, "auto")
    assert methods.row_spec("tiered_overlap:none@0.1/1GiB") == ("tiered_overlap", "none", 0.1, 1 << 30, "auto")
    assert methods.row_spec("tiered/512MiB") == ("tiered", "", None, 512 << 20, "auto")
    assert methods.row_spec("tiered_overlap+250") == ("tiered_overlap", "", None, None, 250.0)
    assert methods.row_spec("tiered_overlap+0") == ("tiered_overlap", "", None, None, 0.0)
    assert methods.row_spec("tiered_overlap+auto") == ("tiered_overlap", "", None, None, "auto")
    assert methods.row_spec("tiered_overlap_deferred:ans/1GiB+0.5") == ("tiered_overlap_deferred", "ans", None,
                                                                          1 << 30, 0.5)
    for bad in ("tiered_overlap+", "tiered_overlap+-5", "tiered_overlap+soon", "tiered_overlap+inf",
                "tiered_overlap+nan"):
        with pytest.raises(ValueError, match="not a stage_after_ms"):
            methods.row_spec(bad)
    with pytest.raises(ValueError, match="tiered has none"):
        methods.row_spec("tiered+250")
    with pytest.raises(ValueError, match="dcp_pinned has none"):
        methods.row_spec("dcp_pinned/1GiB")
    with pytest.raises(ValueError, match="not a size"):
        methods.row_spec("tiered_overlap/lots")
    with pytest.raises(ValueError, match="switch interval"):
        methods.row_spec("tiered_overlap@0/1GiB")


def test_first_save_script_times_a_first_and_a_warm_save_and_sums_the_registrations(tmp_path, capsys):
    """scripts/first_save.py: a first strict save and a warm one, each a JSON line (on the CPU a
    smoke run); the registrations it waited beside summed from (start, seconds) pairs."""
    import json

    fs = _script("first_save")
    out = tmp_path / "first.jsonl"
    assert fs.main(["--gb", "0.02", "--wait-s", "0", "--pin-first", "--ready", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line.get("save") for line in lines] == [None, 1, 2], lines
    assert lines[0]["kernels_ready"] and lines[0]["gb"] == 0.02
    assert all(line["stall_ms"] >= line["call_ms"] > 0 and line["timings_ms"]["staged_ms"] > 0 for line in lines[1:])
    assert capsys.readouterr().out.count("\n") == 3
    got = fs.pins([(10.0, 0.015), (10.02, 0.013), (10.04, 0.131)], 9.99)
    assert got == {"registrations": 3, "register_s": 0.159, "register_ms_median": 15.0, "register_ms_max": 131.0,
                   "last_register_end_ms": 181.0}, got


def test_first_save_script_sets_the_pinners_block_and_touching_threads(tmp_path, monkeypatch, capsys):
    """scripts/first_save.py --pin-block-mib / --touch-threads: the engine it makes registers
    blocks of that size with at most that many touching threads, and its lines say so; a size
    that is not positive is refused by name."""
    import json

    from tiered.gpu import runtime
    from tiered.stage import pools

    monkeypatch.setattr(runtime, "HostPool", runtime.HostPool)  # (restored after the test)
    monkeypatch.setattr(pools, "TOUCH_THREADS", pools.TOUCH_THREADS)
    fs = _script("first_save")
    out = tmp_path / "first.jsonl"
    assert fs.main(["--gb", "0.02", "--wait-s", "0", "--pin-block-mib", "64", "--touch-threads", "1",
                    "--out", str(out)]) == 0
    head = json.loads(out.read_text().splitlines()[0])
    assert head["pin_block_mib"] == 64 and head["touch_threads"] == 1, head
    pool = runtime.HostPool(256 << 20, pin=lambda addr, n: True, unpin=lambda addr: None)
    assert pool.max_run_bytes == 64 << 20 and pools.touch_workers() == 1
    pool.close()
    with pytest.raises(SystemExit, match="--pin-block-mib must be positive, not 0"):
        fs.main(["--pin-block-mib", "0"])
    capsys.readouterr()
