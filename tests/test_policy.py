"""Policy decisions, table-tested: pure functions, no I/O."""

from __future__ import annotations

import pytest

from tiered.policy import (CodecSample, Retention, choose_codec, eviction_reasons, keep_by_rules,
                           latest_restorable, restore_source, time_to_durable)

GB = 1e9
# Illustrative figures: ANS speed from the design brief, ratios and GPU zstd speed in the range of
# docs/benchmarks.md; the CPU zstd speed is an assumption for the table, not a measurement.
ANS = CodecSample(name="ans", throughput=250 * GB, ratio=0.83, cpu_decodable=False)
ZSTD = CodecSample(name="zstd", throughput=3 * GB, ratio=0.835, cpu_decodable=True)
ZSTD_CPU = CodecSample(name="zstd", throughput=1.5 * GB, ratio=0.835, cpu_decodable=True)
NONE = CodecSample(name="none", throughput=1e15, ratio=1.0, cpu_decodable=True)
GPU = [ANS, ZSTD, NONE]
ZSTD_GPU_BETTER = CodecSample(name="zstd", throughput=10 * GB, ratio=0.81, cpu_decodable=True)


@pytest.mark.parametrize("case", [
    dict(bandwidth=6 * GB, samples=GPU, portable=False, expected="ans"),      # fast local NVMe
    dict(bandwidth=2 * GB, samples=GPU, portable=False, expected="ans"),
    dict(bandwidth=1.5 * GB, samples=GPU, portable=True, expected="zstd"),    # shared FS
    dict(bandwidth=0.8 * GB, samples=GPU, portable=True, expected="zstd"),    # S3
    dict(bandwidth=100 * GB, samples=[ZSTD_CPU, NONE], portable=True, expected="none"),  # codec slower than the disk
    dict(bandwidth=1 * GB, samples=[ZSTD_CPU, NONE], portable=True, expected="zstd"),
    dict(bandwidth=1 * GB, samples=GPU, portable=True, pinned="none", expected="none"),
    dict(bandwidth=1 * GB, samples=GPU, portable=False, pinned="ans", expected="ans"),
    # The GPU snapshot on the fast tier: encode time adds to the write (overlap=False).
    dict(bandwidth=2 * GB, samples=[ANS, ZSTD_GPU_BETTER, NONE], overlap=False, expected="ans"),
    # ... whereas pipelined, the slightly smaller zstd output hides its encode behind the disk.
    dict(bandwidth=2 * GB, samples=[ANS, ZSTD_GPU_BETTER, NONE], overlap=True, expected="zstd"),
    # Near-ties (within 5%) go to the smaller output; a real gap does not.
    dict(bandwidth=25 * GB, samples=[ANS, NONE], overlap=False, expected="ans"),
    dict(bandwidth=60 * GB, samples=[ANS, NONE], overlap=False, expected="none"),
])
def test_choose_codec(case):
    expected = case.pop("expected")
    assert choose_codec(**case) == expected


@pytest.mark.parametrize("case", [
    dict(bandwidth=GB, samples=GPU, portable=True, pinned="ans", error="portable tiers need"),
    dict(bandwidth=GB, samples=[ANS], portable=True, error="no codec"),
    dict(bandwidth=GB, samples=[ZSTD], pinned="lz4", error="'lz4' is not available"),
])
def test_choose_codec_refuses(case):
    error = case.pop("error")
    with pytest.raises(ValueError, match=error):
        choose_codec(**case)


def test_time_to_durable_is_the_slower_stage():
    assert time_to_durable(2 * GB, ZSTD, 10 * GB) == pytest.approx(2 / 3)          # encode-bound
    assert time_to_durable(2 * GB, ANS, 1 * GB) == pytest.approx(2 * 0.83)         # write-bound
    assert time_to_durable(2 * GB, ZSTD, 10 * GB, overlap=False) == pytest.approx(2 / 3 + 2 * 0.835 / 10)


@pytest.mark.parametrize("case", [
    dict(steps=[1, 2, 3, 4, 5], keep_last=2, keep_every=None, expected={4, 5}),
    dict(steps=[100, 200, 300, 400, 500], keep_last=1, keep_every=200, expected={200, 400, 500}),
    dict(steps=[10, 20, 30], keep_last=None, keep_every=None, expected={10, 20, 30}),
    dict(steps=[10, 20, 30], keep_last=None, keep_every=20, expected={20}),
    dict(steps=[], keep_last=3, keep_every=None, expected=set()),
    dict(steps=[5, 1, 3], keep_last=2, keep_every=None, expected={3, 5}),
])
def test_keep_by_rules(case):
    expected = case.pop("expected")
    assert keep_by_rules(case.pop("steps"), **case) == expected


ORDER = ["nvme", "lustre", "s3"]


@pytest.mark.parametrize("case", [
    # Beyond keep_last, but only steps already committed on a slower tier go.
    dict(tier="nvme", committed={"nvme": {1, 2, 3, 4}, "lustre": {1, 2}, "s3": set()}, keep_last=2, expected={1, 2}),
    dict(tier="nvme", committed={"nvme": {1, 2, 3, 4}, "lustre": set(), "s3": {1}}, keep_last=2, expected={1}),
    # Not yet migrated anywhere, and the tiers below keep everything: nothing goes.
    dict(tier="nvme", committed={"nvme": {1, 2, 3}, "lustre": set(), "s3": set()}, keep_last=1, expected=set()),
    # The last tier is bounded by its rules too; its newest step stays.
    dict(tier="s3", committed={"nvme": {3}, "lustre": set(), "s3": {1, 2, 3}}, keep_last=1, expected={1, 2}),
    # ... but never the newest step committed anywhere, even where the rules alone would let it go.
    dict(tier="s3", committed={"nvme": set(), "lustre": set(), "s3": {4, 5}}, keep_last=None, keep_every=4,
         expected=set()),
    dict(tier="s3", committed={"nvme": set(), "lustre": set(), "s3": {3, 4, 5}}, keep_last=None, keep_every=4,
         expected={3}),
    # A copy on a *faster* tier does not count: it may be evicted next.
    dict(tier="lustre", committed={"nvme": {1, 2}, "lustre": {1, 2}, "s3": set()}, keep_last=1, expected=set()),
    dict(tier="lustre", committed={"nvme": set(), "lustre": {1, 2, 3}, "s3": {1, 2, 3}}, keep_last=1, expected={1, 2}),
    # Protected steps (a restore reads them, a migration copies them) never go.
    dict(tier="lustre", committed={"nvme": set(), "lustre": {1, 2, 3}, "s3": {1, 2, 3}}, keep_last=1, protected={1},
         expected={2}),
    # One tier alone: its rules bound it.
    dict(tier="nvme", committed={"nvme": {1, 2, 3, 4, 5}}, order=["nvme"], keep_last=2, expected={1, 2, 3}),
])
def test_eviction_reasons_decide_which_steps_go(case):
    expected = case.pop("expected")
    tier, committed = case.pop("tier"), case.pop("committed")
    order = case.pop("order", ORDER)
    rules = {tier: Retention(keep_last=case.pop("keep_last"), keep_every=case.pop("keep_every", None))}
    assert set(eviction_reasons(tier, committed, order, rules, case.pop("protected", ()))) == expected


@pytest.mark.parametrize("case", [
    # A step beyond this tier's rules that every slower tier has let go does not stay here for ever.
    dict(rules={"nvme": Retention(keep_last=2), "s3": Retention(keep_last=2)},
         committed={"nvme": {3, 4, 5}, "s3": {4, 5}}, expected={3: "beyond the rules of this tier and of every tier "
                                                                   "below it"}),
    # ... but one a slower tier would still keep (its keep_every) waits until it holds it.
    dict(rules={"nvme": Retention(keep_last=2), "s3": Retention(keep_last=2, keep_every=3)},
         committed={"nvme": {3, 4, 5}, "s3": {4, 5}}, expected={}),
    dict(rules={"nvme": Retention(keep_last=2), "s3": Retention(keep_last=2, keep_every=3)},
         committed={"nvme": {3, 4, 5}, "s3": {3, 4, 5}}, expected={3: "beyond this tier's rules; kept on tier 's3'"}),
])
def test_eviction_reasons(case):
    assert eviction_reasons("nvme", case["committed"], ["nvme", "s3"], case["rules"]) == case["expected"]


@pytest.mark.parametrize("case", [
    dict(step=3, committed={"nvme": {3}, "lustre": {3}, "s3": {3}}, exclude=(), expected="nvme"),
    dict(step=3, committed={"nvme": {4}, "lustre": {3}, "s3": {3}}, exclude=(), expected="lustre"),
    dict(step=3, committed={"nvme": {3}, "lustre": {3}, "s3": {3}}, exclude=("nvme",), expected="lustre"),
    dict(step=3, committed={"nvme": set(), "lustre": set(), "s3": {3}}, exclude=(), expected="s3"),
    dict(step=9, committed={"nvme": {3}, "lustre": {3}, "s3": {3}}, exclude=(), expected=None),
])
def test_restore_source(case):
    expected = case.pop("expected")
    assert restore_source(case.pop("step"), case.pop("committed"), ORDER, **case) == expected


def test_latest_restorable():
    assert latest_restorable({"nvme": {1, 2}, "s3": {5}}) == 5
    assert latest_restorable({"nvme": set()}) is None and latest_restorable({}) is None
