"""The scale bench's short-step parts (scripts/scale.py, scripts/scale_methods.py), run on the CPU:
the floor of an overlapped save's stall from the run's measured parts, the README's first snippet
as a row of its own (`tiered_plain`: no guard, no reserve), `reserve()`'s call time, and the
targets they feed."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import cpu_scale_bench

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _scale():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import scale
    finally:
        sys.path.remove(str(SCRIPTS))
    return scale


def test_the_floor_is_what_must_cross_pcie_less_what_the_forward_and_backward_hide():
    scale = _scale()
    out = {"state_gb": 24.0, "forward_backward_ms": 265.0,
           "ceilings": {"d2h_pinned_gbps": 55.0, "gpu_codecs": {"ans": {"encode_gbps": 400.0}}}}
    row = {"slab_bytes": int(2.7e9), "wave_bytes": int(0.4e9), "stored_bytes": int(20.5e9)}
    got = scale.floor_of(out, row)
    # 17.8 GB past the slab at 55 GB/s: 323.6 ms, less 265 ms of forward and backward, plus 1 ms of
    # the first wave's encode (0.4 GB at 400 GB/s)
    assert got["must_cross_gb"] == 17.8 and got["link_ms"] == 323.6 and got["first_wave_encode_ms"] == 1.0
    assert got["floor_ms"] == 59.6 and got["encode_ms"] == 60.0
    assert scale.floor_of({**out, "forward_backward_ms": 400.0}, row)["floor_ms"] == 1.0, "hidden: the encode alone"
    assert scale.floor_of(out, {**row, "stored_bytes": int(2e9)})["floor_ms"] == 1.0, "all of it fits the slab"
    assert scale.floor_of({**out, "ceilings": {}}, row) is None, "a part not measured (no GPU): no floor"
    assert scale.floor_of(out, {**row, "slab_bytes": 0}) is None


def test_short_step_targets_say_floor_dcp_first_save_and_reserve():
    scale = _scale()

    def row(name, stall, first, **extra):
        return {"name": name, "error": None, "warm_stall_ms": {"median": stall}, "first": {"stall_ms": first},
                "stored_bytes": 1, "warm_durable_s": {"median": 1.0}, "restore_s": None, **extra}

    out = {"ceilings": {}, "rows": [
        row("tiered_overlap", 70.0, 75.0, floor={"floor_ms": 60.0}, reserve_call_ms=[40.0, 120.0]),
        row("tiered_plain", 400.0, 790.0),
        row("dcp_pinned", 720.0, 12000.0)]}
    got = {k: v["met"] for k, v in scale.targets(out).items()}
    assert got["tiered_overlap: stall <= 1.3 x the floor"] is True
    assert got["tiered_overlap: stall <= DCP pinned / 7"] is True
    assert got["tiered_overlap: reserve() returns within 100 ms"] is False, "the slower of its calls counts"
    assert got["tiered_plain: first save (no reserve) <= 2 x a warm strict one"] is True
    out["rows"][1]["first"]["stall_ms"] = 801.0
    assert scale.targets(out)["tiered_plain: first save (no reserve) <= 2 x a warm strict one"]["met"] is False
    assert not any(k.startswith("dcp_pinned") for k in got)


def test_the_plain_row_saves_without_reserve_on_an_engine_of_its_own(tmp_path):
    size, _ = cpu_scale_bench(tmp_path, "--saves", "2", "--lead-in-s", "0", "--methods", "tiered_overlap,tiered_plain")
    overlap, plain = size["rows"]
    assert size["forward_backward_ms"] > 0
    assert overlap["error"] is None and len(overlap["reserve_call_ms"]) == 2, "reserve() timed, before and after guard"
    assert plain["error"] is None and plain["restore_bit_exact"] is True and len(plain["saves"]) == 2
    assert "reserve_call_ms" not in plain and "pin_s" not in plain, "its engine was never reserved"
    assert "tiered_plain: first save (no reserve) <= 2 x a warm strict one" in size["targets"]
    assert "no guard, no reserve" in plain["note"]
    assert not (tmp_path / "bench" / "tiered-plain").exists(), "its tier goes with the row"
