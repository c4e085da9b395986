"""How the scale bench measures a stall (scripts/scale_measure.py), run on the CPU: `--settle-ms`
(a pause before every second save's window, recorded per save, the warm saves' stalls summarised
apart, paused and not), the save after the restore's fingerprint kept apart, `--lead-in-s`, and
the `no_save` control row with the summary's stalls net of it."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import cpu_scale_bench

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_the_scale_bench_pauses_before_every_second_save_and_says_which(tmp_path):
    size, _ = cpu_scale_bench(tmp_path, "--saves", "5", "--methods", "tiered_overlap", "--settle-ms", "40")
    [got] = size["rows"]
    assert got["error"] is None and got["restore_bit_exact"] is True
    saves = got["saves"]
    assert [s["settle_ms"] for s in saves] == [0.0, 40.0, 0.0, 40.0, 0.0], "the sixth, after the fingerprint, apart"
    assert got["last_save"]["stall_ms"] is not None and got["last_save"]["settle_ms"] == 0, "paused by the fingerprint"
    assert got["unpaused_stall_ms"]["median"] == round((saves[2]["stall_ms"] + saves[4]["stall_ms"]) / 2, 3)
    assert got["paused_stall_ms"]["median"] == round((saves[1]["stall_ms"] + saves[3]["stall_ms"]) / 2, 3)
    assert all("staged_ms" in s["timings_ms"] for s in saves), [s.get("timings_ms") for s in saves]


def test_the_scale_bench_leaves_the_paused_summary_out_without_settle_ms():
    sys.path.insert(0, str(SCRIPTS))
    try:
        from scale_measure import Row
    finally:
        sys.path.remove(str(SCRIPTS))
    row = Row("tiered_overlap")
    for _ in range(3):
        row.add(1.0, 1.02, 0.003, 1.0, 0, 0, 0, 0)
    summary = row.summary()
    assert "paused_stall_ms" not in summary and "unpaused_stall_ms" not in summary


def test_the_scale_bench_leads_each_window_without_a_save_in_with_training_not_measured(tmp_path):
    """Both windows a stall compares follow training: the one without a save comes after
    `Run.lead_in_s` of training that is not measured, in whole windows, unless it is 0."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import scale_measure
    finally:
        sys.path.remove(str(SCRIPTS))
    runs: list[str] = []

    class Window:
        last_steps_ms = [1.0, 0.0]

        def run(self, save=None, before_update=None):
            runs.append("save" if save else "plain")
            return 0.5, 0.0, save() if save else None

    def measured(lead_in_s: float) -> tuple[list[str], int]:
        runs.clear()
        run = scale_measure.Run({"w": scale_measure.torch.zeros(4)}, Window(), 2, tmp_path, "cpu", lambda: False, [],
                                lead_in_s=lead_in_s)
        row = scale_measure.Row("r")
        scale_measure.measure(row, run, 0.5, lambda n: n, lambda n: 0.0, lambda n: None)
        return list(runs), row.summary()["lead_in_windows"]

    assert measured(2.0) == ((["plain"] * 4 + ["plain", "save"]) * 3, 4), "2 s of 0.5 s windows; 2 saves and the last"
    assert measured(0.1) == (["plain", "plain", "save"] * 3, 1), "one window at least"
    assert measured(0) == (["plain", "save"] * 3, 0)


def test_the_scale_benchs_control_row_saves_nothing_and_the_summary_nets_the_rows_of_it(tmp_path):
    size, printed = cpu_scale_bench(tmp_path, "--saves", "3", "--lead-in-s", "0.05", "--methods",
                                    "no_save:0.2,tiered_overlap")
    control, tiered = size["rows"]
    assert control["name"] == "no_save:0.2" and control["stored_bytes"] == 0 and control["restore_s"] is None
    assert all(s["durable_s"] >= 0.2 for s in control["saves"]), control["saves"]  # (its 0.2 s "save" is a sleep)
    net = tiered["warm_stall_ms"]["median"] - control["warm_stall_ms"]["median"]
    assert f"no_save:0.2 (nothing saved) measured {control['warm_stall_ms']['median']} ms" in printed
    assert f"tiered_overlap {net:+.1f} ms" in printed, printed[-2000:]
    n = tiered["lead_in_windows"]
    assert n >= 1 and f"(one just before each save, itself right after {n} not measured," in printed


def _lead_in_of_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(SCRIPTS))
    from scale_measure import Run, agreed_lead_in

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        class Lead:  # (a Run's lead-in alone: 2 s of windows of this rank's own baseline)
            lead_in_s = 2.0
            lead_in_windows = Run.lead_in_windows

        own = Lead().lead_in_windows([0.9, 1.1][rank])
        Path(out, f"rank{rank}").write_text(f"{own} {agreed_lead_in(Lead(), [0.9, 1.1][rank])}")
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_lead_in_their_own_windows_would_count_differently(tmp_path):
    """Under torchrun every step of a window is a collective: two ranks whose baselines ask for 3
    and 2 lead-in windows both run 3 (counting their own deadlocked the 2-rank scale bench)."""
    import torch.multiprocessing as mp

    mp.spawn(_lead_in_of_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    got = [(tmp_path / f"rank{r}").read_text().split() for r in (0, 1)]
    assert got == [["3", "3"], ["2", "3"]]
