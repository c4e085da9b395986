"""Records of every save and migration, and what `tiered stats`, `tiered report` and `tiered cost`
make of them, on a real engine run with a real migration."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

import tiered
from tiered.cli import main
from tiered.observe.records import RECORDS_DIR, read_records
from tiered.observe.stats import summarize


def _config(tmp_path, **fast) -> dict:
    return {"migration": "in_process", "tiers": [
        {"name": "local", "kind": "local", "path": str(tmp_path / "local"), "codec": "zstd",
         "price_per_gb_month": 0.10, **fast},
        {"name": "shared", "kind": "posix", "path": str(tmp_path / "shared"), "codec": "zstd", "keep_last": 2,
         "price_per_gb_month": 0.02, "egress_per_gb": 0.01}]}


def _run(tmp_path, steps=(1, 2, 3)) -> tuple[str, list[dict]]:
    cfg = _config(tmp_path)
    path = tmp_path / "tiered.yaml"
    path.write_text(yaml.safe_dump(cfg))
    g = torch.Generator().manual_seed(0)
    with tiered.Engine.from_config(path) as engine:
        for step in steps:
            state = {"w": torch.randn(1 << 18, generator=g), "m": torch.zeros(1 << 16), "step": step}
            engine.save(step, state).wait()
        engine.wait_migrated(120)
        manifests = {s: engine.read_index(s)[0] for s in steps}
        records = engine.stats()
    return str(path), records, manifests


def test_every_save_and_migration_leaves_a_record(tmp_path):
    _, records, manifests = _run(tmp_path)
    saves = [r for r in records if r["kind"] == "save"]
    hops = [r for r in records if r["kind"] == "migrate"]
    assert [r["step"] for r in saves] == [1, 2, 3] and sorted(r["step"] for r in hops) == [1, 2, 3]
    for r in saves:
        m = manifests[r["step"]]
        assert (r["raw_bytes"], r["stored_bytes"], r["tier"], r["codecs"]) == (m.raw_bytes, m.stored_bytes, "local",
                                                                                ["zstd"])
        assert 0 <= r["stall_s"] <= r["durable_s"] and r["staged_s"] is not None
    for r in hops:
        assert (r["src"], r["dst"], r["codecs"]) == ("local", "shared", ["zstd"]) and r["seconds"] > 0
    assert all(r["source"] == f"{os.uname().nodename}-{os.getpid()}.jsonl" for r in records)


def test_a_torn_record_line_is_skipped_and_an_unwritable_log_never_fails_a_save(tmp_path, caplog):
    _, records, _ = _run(tmp_path)
    root = tmp_path / "local" / RECORDS_DIR
    with open(next(root.glob("*.jsonl")), "a") as f:
        f.write('{"v":1,"kind":"save","step":9,"ti')  # a crash cut the last line short
    assert read_records(root) == [{k: v for k, v in r.items()} for r in records]
    # the records directory cannot be made: saves go on, one warning
    other = tmp_path / "other"
    (other / "local").mkdir(parents=True)
    (other / "local" / RECORDS_DIR).write_text("not a directory")
    with tiered.Engine.from_config(_config(other)) as engine:
        engine.save(1, {"w": torch.ones(10)}).wait()
        engine.save(2, {"w": torch.ones(10)}).wait()
        assert engine.steps("local") == [1, 2]
    assert caplog.text.count("cannot write the save and migration records") == 1


def test_stats_command(tmp_path, capsys):
    path, records, _ = _run(tmp_path)
    assert main(["stats", "-q", "-c", path]) == 0
    text = capsys.readouterr().out
    assert "saves: 3 to tier local" in text and "migration local -> shared: 3 step(s)" in text
    assert main(["stats", "-q", "-c", path, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == json.loads(json.dumps(summarize(records)))
    assert got["saves"]["stall_s"]["n"] == 3 and got["hops"][0]["count"] == 3
    prom = tmp_path / "tiered.prom"
    assert main(["stats", "-q", "-c", path, "--prometheus", str(prom)]) == 0
    text = prom.read_text()
    assert "tiered_saves_total 3\n" in text and "tiered_last_save_step 3\n" in text
    assert 'tiered_migrations_total{src="local",dst="shared"} 3' in text
    assert 'tiered_save_stall_seconds{quantile="0.5"}' in text and "# TYPE tiered_migration_lag_seconds summary" in text


def test_cost_command_turns_the_records_into_a_bill(tmp_path, capsys):
    path, records, _ = _run(tmp_path)
    assert main(["cost", "-q", "-c", path, "--gpus", "128", "--gpu-hour", "4.40", "--interval", "30",
                 "--disk-gbps", "5", "--json"]) == 0
    cost = json.loads(capsys.readouterr().out)
    saves = [r for r in records if r["kind"] == "save"]
    stall = sorted(r["stall_s"] for r in saves)[1]
    raw = sorted(r["raw_bytes"] for r in saves)[1]
    stored = sorted(r["stored_bytes"] for r in saves)[1]
    lines = {x["item"]: x for x in cost["lines"]}
    assert cost["saves_per_month"] == 1440
    assert lines["GPU idle during saves"]["usd"] == pytest.approx(1440 * stall * 128 / 3600 * 4.40)
    assert lines["GPU idle during saves"]["baseline_usd"] == pytest.approx(1440 * raw / 5e9 * 128 / 3600 * 4.40)
    assert lines["storage on local"]["usd"] == pytest.approx(1440 * stored * 128 / 1e9 * 0.10)
    assert lines["storage on shared"]["usd"] == pytest.approx(2 * stored * 128 / 1e9 * 0.02)  # keep_last: 2
    assert "transfer into shared" in lines and "transfer into local" not in lines
    assert all(x["from"].startswith("3 records (steps 1-3;") for x in cost["lines"])
    assert cost["total_usd"] == pytest.approx(sum(x["usd"] for x in cost["lines"]))
    assert main(["cost", "-q", "-c", path, "--gpus", "8", "--gpu-hour", "2", "--interval", "30"]) == 0  # disk rate found
    out = capsys.readouterr().out
    assert "every 30 min (--interval)" in out and ("saving: $" in out or "no saving: " in out)


def _respaced(path: str, seconds: float, copies: int) -> None:
    """The run's save records repeated `copies` times, `seconds` apart (the records' own format)."""
    import datetime as dt
    cfg = yaml.safe_load(open(path))
    root = os.path.join(cfg["tiers"][0]["path"], RECORDS_DIR)
    saves = [r for r in read_records(Path(root)) if r["kind"] == "save"]
    start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    for name in os.listdir(root):
        os.remove(os.path.join(root, name))
    with open(os.path.join(root, "respaced.jsonl"), "w") as f:
        for i in range(copies):
            rec = {**saves[i % len(saves)], "step": i + 1, "time": (start + dt.timedelta(seconds=i * seconds)).isoformat()}
            rec.pop("source", None)
            f.write(json.dumps(rec) + "\n")


def test_cost_asks_for_the_interval_where_the_records_cannot_tell_it(tmp_path, capsys):
    path, _, _ = _run(tmp_path)
    # three saves: too few to stand for a job's cadence
    assert main(["cost", "-q", "-c", path, "--gpus", "8", "--gpu-hour", "2"]) == 1
    err = capsys.readouterr().err
    assert "3 save(s) recorded, fewer than 5" in err and "--interval MIN" in err
    # enough saves, but a fraction of a second apart (a test or a demo): never "92,571,429 saves"
    _respaced(path, 0.03, 8)
    assert main(["cost", "-q", "-c", path, "--gpus", "8", "--gpu-hour", "2"]) == 1
    err = capsys.readouterr().err
    assert "0.03 s apart (median of 8), under a minute" in err and "--interval MIN" in err
    # enough saves, 20 minutes apart: the records' own interval, and the output says so
    _respaced(path, 1200, 8)
    assert main(["cost", "-q", "-c", path, "--gpus", "8", "--gpu-hour", "2", "--disk-gbps", "5"]) == 0
    out = capsys.readouterr().out
    assert "every 20 min (the recorded saves' median interval)" in out and "(2,160 saves)" in out


def test_cost_says_why_when_there_is_no_saving(tmp_path, capsys):
    path, _, _ = _run(tmp_path)
    # a disk so fast that writing the raw bytes synchronously stalls less than these CPU saves did
    assert main(["cost", "-q", "-c", path, "--gpus", "8", "--gpu-hour", "10000", "--interval", "30",
                 "--disk-gbps", "1000000"]) == 0
    out = capsys.readouterr().out
    assert "saving: $-" not in out and "no saving: tiered costs $" in out
    assert "no less than writing the raw bytes at the disk rate would" in out
    assert main(["cost", "-q", "-c", path, "--gpus", "8", "--gpu-hour", "10000", "--interval", "30",
                 "--disk-gbps", "1000000", "--json"]) == 0
    cost = json.loads(capsys.readouterr().out)
    assert cost["saving_usd"] < 0 and "stalled training" in cost["why_no_saving"]


def test_report_writes_a_chart_and_a_page(tmp_path):
    pytest.importorskip("matplotlib")
    path, _, _ = _run(tmp_path)
    out = tmp_path / "report"
    assert main(["report", "-q", "-c", path, "--out", str(out)]) == 0
    png = (out / "checkpoints.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    md = (out / "report.md").read_text()
    assert "![checkpoints](checkpoints.png)" in md and "saves: 3 to tier local" in md
    assert "<img src=checkpoints.png" in (out / "report.html").read_text()


def test_no_records_and_bad_prices_are_clear_errors(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path)))
    assert main(["stats", "-q", "-c", str(path)]) == 1
    assert "no records under" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["cost", "-q", "-c", str(path), "--gpus", "0", "--gpu-hour", "1"])
    assert exit_.value.code == 2 and "--gpus: must be > 0, got 0" in capsys.readouterr().err
    bad = _config(tmp_path)
    bad["tiers"][1]["price_per_gb_month"] = "cheap"
    with pytest.raises(tiered.errors.ConfigError, match=r"tiers\[1\].price_per_gb_month: must be a number"):
        tiered.load_config(bad)


def test_a_subscriber_gets_each_record_and_its_failure_never_fails_a_save(tmp_path, caplog):
    from tiered.observe.records import subscribe

    got = []
    stop_good = subscribe(got.append)
    stop_bad = subscribe(lambda r: 1 / 0)
    try:
        with tiered.Engine.from_config(_config(tmp_path)) as engine:
            engine.save(1, {"w": torch.ones(1000)}).wait()
            engine.wait_migrated(60)
    finally:
        stop_good()
        stop_bad()
    assert [(r["kind"], r["step"]) for r in got] == [("save", 1), ("migrate", 1)]
    assert "a records listener failed" in caplog.text
    with tiered.Engine.from_config(_config(tmp_path / "again")) as engine:
        engine.save(2, {"w": torch.ones(10)}).wait()
    assert len(got) == 2, "unsubscribed"
