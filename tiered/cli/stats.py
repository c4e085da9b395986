"""`tiered stats`, `tiered report` and `tiered cost`: what checkpointing cost, from the records
the engine and the migrators leave next to the checkpoints (`tiered.observe.records`, `tiered.observe.stats`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from tiered.errors import TieredError
from tiered.observe.probe import cached_bandwidth
from tiered.observe.records import read_records, records_root
from tiered.observe.stats import format_cost, format_prometheus, format_summary, monthly_cost, summarize
from tiered.tiers.catalog import TierCatalog
from tiered.tiers.local import replace_durably

EXIT_OK = 0


def _records(catalog: TierCatalog) -> list[dict]:
    root = records_root(catalog.config)
    records = read_records(root)
    if not records:
        raise TieredError(f"no records under {root}: they are written by saves and migrations of this tiered "
                          "version, next to the fast tier's checkpoints")
    return records


def cmd_stats(args: argparse.Namespace, catalog: TierCatalog) -> int:
    records = _records(catalog)
    summary = summarize(records)
    if args.prometheus:
        # whole files only: a scraper never reads half of one
        replace_durably(Path(args.prometheus), format_prometheus(summary, records).encode())
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return EXIT_OK


def cmd_report(args: argparse.Namespace, catalog: TierCatalog) -> int:
    from tiered.observe.report import write_report  # matplotlib: only here

    try:
        paths = write_report(_records(catalog), Path(args.out), f"tiered checkpoints: {catalog.config.source}")
    except RuntimeError as exc:
        raise TieredError(str(exc)) from None
    for p in paths:
        print(p)
    return EXIT_OK


def cmd_cost(args: argparse.Namespace, catalog: TierCatalog) -> int:
    records = _records(catalog)
    summary = summarize(records)
    if summary["saves"] is None:
        raise TieredError("no saves recorded (only migrations): the bill is made from saves")
    fast = catalog.config.fast_tier
    saves = [r for r in records if r["kind"] == "save" and r["durable_s"] > 0]
    if args.disk_gbps:
        rate = (args.disk_gbps * 1e9, "--disk-gbps")
    elif cached_bandwidth(fast):
        rate = (cached_bandwidth(fast), f"tier {fast.name!r}'s configured or probed write bandwidth")
    elif saves:
        per_gpu = max(r["stored_bytes"] / r.get("ranks", 1) / r["durable_s"] for r in saves)
        rate = (per_gpu, "the fastest recorded save: stored bytes per rank over its time to durable (a lower bound)")
    else:
        raise TieredError("no disk rate: give --disk-gbps")
    interval = (args.interval, "--interval") if args.interval else (_interval_min(summary),
                                                                     "the recorded saves' median interval")
    cost = monthly_cost(summary, catalog.config.tiers, gpus=args.gpus, gpu_hour=args.gpu_hour,
                        interval_min=interval[0], interval_from=interval[1], disk_rate=rate)
    print(json.dumps(cost, indent=1) if args.json else format_cost(cost))
    return EXIT_OK


MIN_SAVES_FOR_INTERVAL = 5
"""Fewer recorded saves than this do not stand for a job's interval between saves."""
MIN_INTERVAL_MIN = 1.0
"""A recorded interval under a minute is a test or a demo, not a training job's checkpoint cadence."""


def _interval_min(summary: dict[str, Any]) -> float:
    """The recorded saves' median interval, where enough saves far enough apart were recorded to
    stand for the job's cadence; else an error that asks for ``--interval``."""
    count, gaps = summary["saves"]["count"], summary["saves"]["interval_s"]
    ask = "give the interval between the job's saves with --interval MIN (e.g. --interval 30)"
    if gaps is None or count < MIN_SAVES_FOR_INTERVAL:
        raise TieredError(f"{count} save(s) recorded, fewer than {MIN_SAVES_FOR_INTERVAL}: too few to tell how "
                          f"often the job saves; {ask}")
    minutes = gaps["median"] / 60
    if minutes < MIN_INTERVAL_MIN:
        raise TieredError(f"the recorded saves are {gaps['median']:.3g} s apart (median of {count}), under a minute: "
                          f"a test or a demo, not a training job's cadence; {ask}")
    return minutes


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def add_parsers(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    st = sub.add_parser("stats", help="summary of the recorded saves and migrations",
                        description="Summarise the records every save and migration leaves next to the fast tier "
                                    "(.tiered-records/): training stall, time to staged and to durable, bytes and "
                                    "codecs per save; copies, rate and lag of each migration hop.")
    common(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--prometheus", metavar="FILE",
                    help="also write the figures in Prometheus' text format to FILE (for node_exporter's textfile "
                         "collector: run this from cron or a timer)")
    st.set_defaults(fn=cmd_stats)
    rp = sub.add_parser("report", help="a PNG chart and a Markdown/HTML page of the records",
                        description="Draw stall and durable per save, bytes per tier and migration lag "
                                    "(needs matplotlib: pip install 'tiered[report]').")
    common(rp)
    rp.add_argument("--out", required=True, metavar="DIR", help="directory for checkpoints.png, report.md, report.html")
    rp.set_defaults(fn=cmd_report)
    co = sub.add_parser("cost", help="the recorded saves as a monthly bill, beside uncompressed synchronous saves",
                        description="Turn the recorded saves into a month's cost: GPU idle time from the measured "
                                    "stalls, storage from the stored bytes and each tier's retention "
                                    "(price_per_gb_month in the config), transfer where a tier sets egress_per_gb; "
                                    "beside the same saves written uncompressed with torch.save at the disk's rate. "
                                    "Per-GPU bytes are scaled to --gpus. Every line names its records.")
    common(co)
    co.add_argument("--gpus", type=_positive(int), required=True, metavar="N", help="GPUs of the training job")
    co.add_argument("--gpu-hour", type=_positive(float), required=True, metavar="USD", help="price of a GPU-hour")
    co.add_argument("--interval", type=_positive(float), metavar="MIN",
                    help="minutes between saves (default: the recorded saves' median interval, where at least "
                         f"{MIN_SAVES_FOR_INTERVAL} saves a minute or more apart were recorded)")
    co.add_argument("--disk-gbps", type=_positive(float), metavar="GB/S",
                    help="disk rate for the uncompressed synchronous baseline (default: the fast tier's probed "
                         "bandwidth, else the fastest recorded save)")
    co.add_argument("--json", action="store_true", help="machine-readable output")
    co.set_defaults(fn=cmd_cost)
