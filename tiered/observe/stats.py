"""What checkpointing cost, from the records (`tiered.observe.records`): a summary and a monthly bill.

Pure functions over record dicts; `tiered stats`, `tiered report` and `tiered cost` print them.
Every figure names the records it came from (``from``).
"""

from __future__ import annotations

import datetime as _dt
import statistics
from typing import Any, Sequence

from tiered.units import format_size

MONTH_S = 30 * 24 * 3600


def record_time(iso: str) -> _dt.datetime:
    t = _dt.datetime.fromisoformat(iso)
    return t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)


def lag_s(record: dict, saved: dict[int, str]) -> float | None:
    """Seconds from a step's save being durable (its save record; else its manifest's commit time,
    to the second) to a migration record's copy being committed."""
    start = saved.get(record["step"]) or record.get("committed")
    return None if start is None else (record_time(record["time"]) - record_time(start)).total_seconds()


def saved_times(records: Sequence[dict]) -> dict[int, str]:
    return {r["step"]: r["time"] for r in records if r["kind"] == "save"}


def _spread(xs: Sequence[float]) -> dict[str, float] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    s = sorted(xs)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "min": s[0], "max": s[-1],
            "n": len(s)}


def _origin(recs: Sequence[dict]) -> str:
    steps = sorted({r["step"] for r in recs})
    files = sorted({r.get("source", "?") for r in recs})
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    return f"{len(recs)} record{'s' if len(recs) != 1 else ''} ({span}; {', '.join(files)})"


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Saves: stall, staged, durable, bytes, codecs. Each hop: copies, time, rate, lag."""
    saves = [r for r in records if r["kind"] == "save"]
    failed = [r for r in records if r["kind"] == "save_failed"]
    out: dict[str, Any] = {"saves": None, "hops": [], "failures": {
        "count": len(failed), "last": None if not failed else {k: failed[-1][k] for k in ("step", "time", "error")}}}
    if saves:
        raw, stored = sum(r["raw_bytes"] for r in saves), sum(r["stored_bytes"] for r in saves)
        gaps = [(record_time(b["time"]) - record_time(a["time"])).total_seconds() for a, b in zip(saves, saves[1:])]
        out["saves"] = {
            "count": len(saves), "stall_s": _spread([r["stall_s"] for r in saves]),
            "staged_s": _spread([r.get("staged_s") for r in saves]),
            "durable_s": _spread([r["durable_s"] for r in saves]),
            "raw_bytes": _spread([r["raw_bytes"] for r in saves]),
            "stored_bytes": _spread([r["stored_bytes"] for r in saves]),
            "saved_fraction": 1 - stored / raw if raw else 0.0, "ranks": max(r.get("ranks", 1) for r in saves),
            "codecs": sorted({c for r in saves for c in r.get("codecs", [])}),
            "tiers": sorted({r["tier"] for r in saves}), "interval_s": _spread(gaps), "from": _origin(saves)}
    hops: dict[tuple[str, str], list[dict]] = {}
    saved = saved_times(records)
    for r in records:
        if r["kind"] == "migrate":
            hops.setdefault((r["src"], r["dst"]), []).append(r)
    for (src, dst), recs in hops.items():
        out["hops"].append({
            "src": src, "dst": dst, "count": len(recs), "seconds": _spread([r["seconds"] for r in recs]),
            "gb_per_s": _spread([r["raw_bytes"] / 1e9 / r["seconds"] for r in recs if r["seconds"] > 0]),
            "stored_bytes": _spread([r["stored_bytes"] for r in recs]),
            "codecs": sorted({c for r in recs for c in r.get("codecs", [])}),
            "lag_s": _spread([lag_s(r, saved) for r in recs]),
            "from": _origin(recs)})
    return out


def _ms(s: dict | None) -> str:
    return "n/a" if s is None else f"{1e3 * s['median']:.1f} ms (p90 {1e3 * s['p90']:.1f}, max {1e3 * s['max']:.1f})"


def _sec(s: dict | None) -> str:
    return "n/a" if s is None else f"{s['median']:.2f} s (p90 {s['p90']:.2f}, max {s['max']:.2f})"


def format_summary(summary: dict[str, Any]) -> str:
    s = summary["saves"]
    failures = summary.get("failures") or {"count": 0}
    failed = ([f"failed saves: {failures['count']} (not committed); the last, step {failures['last']['step']} at "
               f"{failures['last']['time']}: {failures['last']['error']}"] if failures["count"] else [])
    if s is None:
        return "\n".join(["no saves recorded yet"] + failed)
    lines = [f"saves: {s['count']} to tier {', '.join(s['tiers'])}, {s['ranks']} rank(s), "
             f"codecs {', '.join(s['codecs']) or '-'}",
             f"  training stall (save() blocked): {_ms(s['stall_s'])}",
             f"  staged (state may change):       {_ms(s['staged_s'])}",
             f"  durable:                         {_sec(s['durable_s'])}",
             f"  size per save: {format_size(s['raw_bytes']['median'])} -> {format_size(s['stored_bytes']['median'])} "
             f"({100 * s['saved_fraction']:.1f}% saved)"]
    if s["interval_s"] is not None:
        lines.append(f"  interval between saves: {s['interval_s']['median']:.1f} s (median)")
    lines.append(f"  from {s['from']}")
    lines += failed
    for h in summary["hops"]:
        rate = "n/a" if h["gb_per_s"] is None else f"{h['gb_per_s']['median']:.2f} GB/s"
        lines += [f"migration {h['src']} -> {h['dst']}: {h['count']} step(s), {_sec(h['seconds'])} each, "
                  f"{rate} of state, stored {format_size(h['stored_bytes']['median'])} "
                  f"({', '.join(h['codecs']) or 'codecs kept'})",
                  f"  lag after the save was committed: {_sec(h['lag_s'])}",
                  f"  from {h['from']}"]
    return "\n".join(lines)


def monthly_cost(summary: dict[str, Any], tiers: Sequence[Any], *, gpus: int, gpu_hour: float, interval_min: float,
                 disk_rate: tuple[float, str], interval_from: str) -> dict[str, Any]:
    """A month of saves every `interval_min` on `gpus` GPUs at `gpu_hour` USD per GPU-hour, from
    the recorded saves (per-GPU bytes scaled to `gpus`), beside the same saves uncompressed and
    synchronous (``torch.save`` of the raw bytes at `disk_rate` (bytes/s, where it came from)).
    `tiers`: the config's tiers (``price_per_gb_month``, ``egress_per_gb``, ``keep_last``)."""
    s = summary["saves"]
    if s is None:
        raise ValueError("no saves recorded: run training with tiered first")
    saves = MONTH_S / (60 * interval_min)
    per_gpu_raw, per_gpu_stored = s["raw_bytes"]["median"] / s["ranks"], s["stored_bytes"]["median"] / s["ranks"]
    stall = s["stall_s"]["median"]
    rate, rate_from = disk_rate
    base_stall = per_gpu_raw / rate
    lines: list[dict[str, Any]] = []

    def line(item: str, usd: float, baseline: float, how: str, origin: str) -> None:
        lines.append({"item": item, "usd": usd, "baseline_usd": baseline, "how": how, "from": origin})

    idle_h, base_h = saves * stall * gpus / 3600, saves * base_stall * gpus / 3600
    line("GPU idle during saves", idle_h * gpu_hour, base_h * gpu_hour,
         f"{saves:.0f} saves x {1e3 * stall:.1f} ms median stall x {gpus} GPUs = {idle_h:.1f} GPU-h "
         f"(baseline: {format_size(per_gpu_raw)} per GPU / {rate / 1e9:.2f} GB/s = {base_stall:.1f} s a save, "
         f"{base_h:.1f} GPU-h)", f"{s['from']}; disk rate: {rate_from}")
    hops = {h["dst"]: h for h in summary["hops"]}
    for i, t in enumerate(tiers):
        if i == 0:
            stored, origin = per_gpu_stored, s["from"]
        elif t.name in hops:
            h = hops[t.name]
            stored, origin = h["stored_bytes"]["median"] / s["ranks"], h["from"]
        else:
            stored, origin = per_gpu_stored, f"{s['from']} (no migration to {t.name!r} recorded: the fast tier's size)"
        held = min(t.keep_last, saves) if t.keep_last else saves
        keep = f"keep_last {t.keep_last}" if t.keep_last else "keeps every step: a month's saves, growing after"
        if t.price_per_gb_month is not None:
            gb, base_gb = held * stored * gpus / 1e9, held * per_gpu_raw * gpus / 1e9
            line(f"storage on {t.name}", gb * t.price_per_gb_month, base_gb * t.price_per_gb_month,
                 f"{held:.0f} steps ({keep}) x {format_size(stored * gpus)} = {gb:,.0f} GB x "
                 f"${t.price_per_gb_month}/GB-month (baseline: raw, {base_gb:,.0f} GB)", origin)
        if i > 0 and t.egress_per_gb is not None:
            gb, base_gb = saves * stored * gpus / 1e9, saves * per_gpu_raw * gpus / 1e9
            line(f"transfer into {t.name}", gb * t.egress_per_gb, base_gb * t.egress_per_gb,
                 f"{saves:.0f} steps x {format_size(stored * gpus)} = {gb:,.0f} GB x ${t.egress_per_gb}/GB", origin)
    total, base = sum(x["usd"] for x in lines), sum(x["baseline_usd"] for x in lines)
    return {"saves_per_month": saves, "gpus": gpus, "gpu_hour": gpu_hour, "interval_min": interval_min,
            "interval_from": interval_from, "lines": lines, "total_usd": total, "baseline_usd": base,
            "saving_usd": base - total,
            "why_no_saving": _why_no_saving(stall, base_stall, per_gpu_stored, per_gpu_raw) if base < total else None}


def _why_no_saving(stall: float, base_stall: float, stored: float, raw: float) -> str:
    """Why these records cost more than uncompressed synchronous saves: said, not left as a
    negative number."""
    why = []
    if stall >= base_stall:
        why.append(f"the recorded saves stalled training {1e3 * stall:.1f} ms (median), no less than writing the raw "
                   f"bytes at the disk rate would ({1e3 * base_stall:.1f} ms)")
    if stored >= raw * 0.99:
        why.append(f"they stored {100 * stored / raw:.0f}% of the raw bytes: this state hardly compresses with the "
                   f"codecs used (a CPU run with `codec: none` or random data is like this)")
    if not why:
        why.append("storage and transfer at these prices outweigh the GPU time saved at this interval")
    return "; ".join(why)


def _usd(x: float) -> str:
    return f"${x:,.0f}"


def format_cost(cost: dict[str, Any]) -> str:
    out = [f"a month of saves every {cost['interval_min']:g} min ({cost['interval_from']}) on "
           f"{cost['gpus']} GPUs at ${cost['gpu_hour']}/GPU-hour ({cost['saves_per_month']:,.0f} saves):", "",
           f"{'item':<28} {'tiered':>14} {'uncompressed, synchronous':>27}"]
    for x in cost["lines"]:
        out.append(f"{x['item']:<28} {_usd(x['usd']):>14} {_usd(x['baseline_usd']):>27}")
        out.append(f"    {x['how']}")
        out.append(f"    from {x['from']}")
    out.append(f"{'total':<28} {_usd(cost['total_usd']):>14} {_usd(cost['baseline_usd']):>27}")
    if cost["why_no_saving"]:
        out.append(f"no saving: tiered costs ${-cost['saving_usd']:,.0f} a month more than the baseline here, because "
                   f"{cost['why_no_saving']}")
    else:
        out.append(f"saving: ${cost['saving_usd']:,.0f} a month")
    return "\n".join(out)


def format_prometheus(summary: dict[str, Any], records: Sequence[dict]) -> str:
    """The summary in Prometheus' text format, for node_exporter's textfile collector (or any
    scraper of a file): counters, last values and quantiles of stall, durable and lag."""
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
        out.extend([f"# HELP tiered_{name} {help_}", f"# TYPE tiered_{name} {kind}"])
        for labels, value in samples:
            text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            out.append(f"tiered_{name}{{{text}}} {value:.9g}" if text else f"tiered_{name} {value:.9g}")

    def quantiles(spread: dict | None, labels: dict[str, str]) -> list[tuple[dict[str, str], float]]:
        if spread is None:
            return []
        return [({**labels, "quantile": q}, spread[k]) for q, k in (("0.5", "median"), ("0.9", "p90"), ("1", "max"))]

    s = summary["saves"]
    saves = [r for r in records if r["kind"] == "save"]
    metric("save_failures_total", "counter", "Saves that failed in the background (not committed).",
           [({}, (summary.get("failures") or {"count": 0})["count"])])
    if s is not None:
        last = saves[-1]
        metric("saves_total", "counter", "Saves recorded.", [({}, s["count"])])
        metric("save_stall_seconds", "summary", "Training stall per save (save() blocked).", quantiles(s["stall_s"], {}))
        metric("save_durable_seconds", "summary", "Time from save() to durable.", quantiles(s["durable_s"], {}))
        metric("last_save_step", "gauge", "Step of the newest recorded save.", [({}, last["step"])])
        metric("last_save_timestamp_seconds", "gauge", "When the newest save was durable.",
               [({}, record_time(last["time"]).timestamp())])
        metric("last_save_bytes", "gauge", "Raw and stored bytes of the newest save.",
               [({"kind": "raw"}, last["raw_bytes"]), ({"kind": "stored"}, last["stored_bytes"])])
    hops = summary["hops"]
    if hops:
        metric("migrations_total", "counter", "Steps copied down a hop.",
               [({"src": h["src"], "dst": h["dst"]}, h["count"]) for h in hops])
        metric("migration_lag_seconds", "summary", "From a save being durable to its copy committed on a lower tier.",
               [x for h in hops for x in quantiles(h["lag_s"], {"src": h["src"], "dst": h["dst"]})])
    return "\n".join(out) + "\n"
