"""`tiered report --out DIR`: a chart (PNG) and a page (Markdown and HTML) of what the records
show: stall and time to durable per save, bytes per tier, migration lag per step.

Needs matplotlib (``pip install 'tiered[report]'``).
"""

from __future__ import annotations

import html
import statistics
from pathlib import Path
from typing import Any, Sequence

from tiered.observe.stats import format_summary, lag_s, saved_times, summarize

CHART = "checkpoints.png"


def write_report(records: Sequence[dict], out: Path, title: str) -> list[Path]:
    """Write the chart and the pages under `out`; return their paths."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("tiered report draws with matplotlib: pip install 'tiered[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    saves = [r for r in records if r["kind"] == "save"]
    hops = [r for r in records if r["kind"] == "migrate"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    _per_save(axes[0], saves)
    _bytes(axes[1], saves, hops)
    _lag(axes[2], hops, saved_times(records))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    chart = out / CHART
    fig.savefig(chart, dpi=110)
    plt.close(fig)
    text = format_summary(summary)
    md = out / "report.md"
    md.write_text(f"# {title}\n\n![checkpoints]({CHART})\n\n```\n{text}\n```\n")
    page = out / "report.html"
    page.write_text(f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>"
                    f"<h1>{html.escape(title)}</h1><img src={CHART} alt='checkpoint chart' style='max-width:100%'>"
                    f"<pre>{html.escape(text)}</pre>\n")
    return [chart, md, page]


def _per_save(ax: Any, saves: Sequence[dict]) -> None:
    ax.set_title("per save", fontsize=10)
    if not saves:
        ax.text(0.5, 0.5, "no saves recorded", ha="center", transform=ax.transAxes)
        return
    steps = [r["step"] for r in saves]
    ax.plot(steps, [1e3 * r["stall_s"] for r in saves], marker="o", label="training stall (save() blocked), ms")
    ax.set_xlabel("step")
    ax.set_ylabel("stall, ms")
    twin = ax.twinx()
    twin.plot(steps, [r["durable_s"] for r in saves], marker="s", color="tab:orange", label="durable after, s")
    twin.set_ylabel("durable after, s")
    lines = ax.get_legend_handles_labels(), twin.get_legend_handles_labels()
    ax.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)


def _bytes(ax: Any, saves: Sequence[dict], hops: Sequence[dict]) -> None:
    ax.set_title("bytes per step (median)", fontsize=10)
    if not saves:
        return
    names = ["raw"] + sorted({r["tier"] for r in saves})
    values = [statistics.median(r["raw_bytes"] for r in saves) / 1e9]
    values += [statistics.median(r["stored_bytes"] for r in saves if r["tier"] == n) / 1e9 for n in names[1:]]
    for dst in dict.fromkeys(r["dst"] for r in hops):
        names.append(dst)
        values.append(statistics.median(r["stored_bytes"] for r in hops if r["dst"] == dst) / 1e9)
    scale, unit = (1, "GB") if max(values) >= 1 else (1e3, "MB")
    ax.bar(names, [v * scale for v in values], color=["tab:gray"] + ["tab:green"] * (len(names) - 1))
    ax.set_ylabel(unit)
    ax.grid(True, axis="y", alpha=0.3)


def _lag(ax: Any, hops: Sequence[dict], saved: dict[int, str]) -> None:
    ax.set_title("migration lag after the save", fontsize=10)
    if not hops:
        ax.text(0.5, 0.5, "no migrations recorded", ha="center", transform=ax.transAxes)
        return
    for key in dict.fromkeys((r["src"], r["dst"]) for r in hops):
        points = [(r["step"], lag_s(r, saved)) for r in hops if (r["src"], r["dst"]) == key]
        points = [(x, y) for x, y in points if y is not None]
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=f"{key[0]} -> {key[1]}")
    ax.set_xlabel("step")
    ax.set_ylabel("s")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
