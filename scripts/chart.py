#!/usr/bin/env python3
"""Chart of a bench.py result: training stall and time to durable for every way of saving.

    pip install 'tiered[bench]'   # matplotlib
    python scripts/chart.py docs/bench/RESULT.json docs/bench/RESULT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(results: dict) -> list[tuple[str, float, float, float]]:
    """(label, stall ms, durable s, saved %) per method, tiered's rows as warm medians."""
    out = [(name.replace("_", " "), r["stall_ms"], r["durable_s"], r["saved_pct"])
           for name, r in results.get("baselines", {}).items()]
    for codec in ("ans", "zstd"):
        r = results.get(codec)
        if r:
            warm = r["saves"][1:] or r["saves"]
            med = lambda key: sorted(x[key] for x in warm)[len(warm) // 2]  # noqa: E731
            out.append((f"tiered {codec}", med("stall_ms"), med("durable_s"), r["ratios"]["all"]))
    return out


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - used through matplotlib.ticker

    results = json.loads(Path(sys.argv[1]).read_text())
    data = rows(results)
    info = results["info"]
    labels = [d[0] for d in data]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = ["#999999" if not d[0].startswith("tiered") else "#76b900" for d in data]
    ax1.barh(labels, [d[1] for d in data], color=colors)
    ax1.set_xscale("log")
    ax1.set_xlabel("training stall per save, ms (log scale)")
    ax1.axvline(25, color="black", linestyle=":", linewidth=1)
    ax1.text(25, len(data) - 0.55, " 25 ms target", fontsize=8)
    ax1.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for i, d in enumerate(data):
        ax1.text(d[1], i, f" {d[1]:g}", va="center", fontsize=8)
    ax2.barh(labels, [d[2] for d in data], color=colors)
    ax2.set_xlabel("time until durable on local disk, s")
    for i, d in enumerate(data):
        ax2.text(d[2], i, f" {d[2]:g} s, {d[3]:.1f}% saved", va="center", fontsize=8)
    ax2.set_yticklabels([])
    disk = results.get("ceilings", {}).get("disk", {})
    fig.suptitle(f"{info['state_gb']} GB state ({info['params'] / 1e6:.0f}M-param GPT, fp32 + AdamW) on {info['device']}, "
                 f"{info['date']}; disk {disk.get('write_gbps')} GB/s write", fontsize=10)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)
    print(f"wrote {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
