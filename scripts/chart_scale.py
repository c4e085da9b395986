#!/usr/bin/env python3
"""Chart of scale-mode results (`bench.py --scale`): how the training stall, the time to durable
and the cold restore grow with the state, one line per method, one point per state size.

    pip install 'tiered[bench]'   # matplotlib
    python scripts/chart_scale.py OUT.png RUN.json [RUN.json ...]

Every size of every file given is a point; where two files hold the same method at the same
size, the later file wins. Warm medians; a failed row is left out of the panels and named in its
file's caption. The control row (`no_save:S`, whatever its S) is one line, "nothing saved
(control)", in the stall panel alone; the rows that price a load without saving (`gil_load`,
`d2h_load`) and the `migration` row are left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONTROL = "nothing saved (control)"
COLORS = {"tiered": "#76b900", "tiered_overlap": "#2f6b00", "dcp_pinned": "#1f77b4", "dcp_stager": "#9467bd",
          "torch_save": "#999999", CONTROL: "#000000"}
LEFT_OUT = ("gil_load", "d2h_load", "migration")
"""Rows that are not a way to save: not charted."""
OTHER_COLORS = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
"""For rows COLORS does not name (variants such as tiered_overlap_deferred), in the order met."""


def colors(names: list[str]) -> dict[str, str]:
    """A colour per row name, no two alike (up to COLORS and OTHER_COLORS' length)."""
    others = iter(OTHER_COLORS)
    return {n: COLORS[n] if n in COLORS else next(others, None) for n in names}


def points(files: list[Path]) -> tuple[dict[str, dict[float, dict]], list[str]]:
    """({method: {state GB: {stall_ms, durable_s, restore_s}}}, a caption per file)."""
    series: dict[str, dict[float, dict]] = {}
    captions = []
    for path in files:
        results = json.loads(path.read_text())
        info = results.get("info", {})
        sizes, failed = [], []
        for out in results.get("scale", []):
            sizes.append(out["state_gb"])
            for r in out.get("rows", []):
                if r.get("error"):
                    failed.append(f"{r['name']} failed at {out['state_gb']:g} GB ({str(r['error'])[:60]})")
                method = r["name"].partition(":")[0]
                if r.get("error") or not r.get("warm_stall_ms") or method in LEFT_OUT:
                    continue
                control = method == "no_save"
                series.setdefault(CONTROL if control else r["name"], {})[out["state_gb"]] = {
                    "stall_ms": r["warm_stall_ms"]["median"],
                    "durable_s": None if control else r["warm_durable_s"]["median"],
                    "restore_s": None if control else r.get("restore_s")}
        ranks = info.get("ranks", 1)
        captions.append(f"{path.stem}: {info.get('device', '?')}, {info.get('date', '?')}, "
                        f"{', '.join(f'{s:g}' for s in sizes)} GB{f' x {ranks} ranks' if ranks > 1 else ''}"
                        + "".join(f"; {f}" for f in failed))
    return series, captions


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, captions = points([Path(p) for p in sys.argv[2:]])
    if not series:
        print("no scale rows in the files given", file=sys.stderr)
        return 1
    panels = [("stall_ms", "training stall per save, ms (warm median)", True),
              ("durable_s", "time to durable, s (warm median)", False),
              ("restore_s", "cold restore, s", False)]
    color = colors(sorted(series))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4 + 0.25 * len(captions)))
    for ax, (key, title, log) in zip(axes, panels):
        for name, by_size in sorted(series.items()):
            xs = sorted(s for s, v in by_size.items() if v[key] is not None)
            if not xs:
                continue
            ys = [by_size[s][key] for s in xs]
            ax.plot(xs, ys, marker="o", label=name.replace("_", " "), color=color[name],
                    linestyle=":" if name == CONTROL else "-")
        ax.set_xlabel("state per GPU, GB")
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
            ax.axhline(50, color="black", linestyle=":", linewidth=1)
            ax.text(ax.get_xlim()[0], 50, " 50 ms target", fontsize=8, va="bottom")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("\n".join(captions), fontsize=9)  # one line per run
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=120)
    print(f"wrote {sys.argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
