"""The scale mode's command-line options (scripts/scale.py), added to scripts/bench.py's parser."""

from __future__ import annotations

import argparse


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options only `--scale` reads, as one group of `ap`'s."""
    g = ap.add_argument_group("scale mode (--scale)")
    g.add_argument("--free-gb", type=float, default=6.0, help="scale mode: GPU memory left free by the ballast")
    g.add_argument("--saves", type=int, default=3,
                   help="scale mode: saves per method (the first one cold), and one more, not counted, handed the "
                        "state the restore is checked against")
    g.add_argument("--window-steps", type=int, default=6, help="scale mode: training steps per measured window")
    g.add_argument("--methods", default="tiered,tiered_overlap,dcp_pinned,dcp_stager,torch_save",
                   help="scale mode: which rows, in order; a tiered row may pin its codec (tiered_overlap:none); "
                        "ROW@MS runs a row with Python's switch interval at MS ms (sys.setswitchinterval); "
                        "a tiered ROW/SIZE with that budgets.pack_buffer (tiered_overlap/1GiB); an overlapped "
                        "ROW+MS with guard(stage_after_ms=MS) (tiered_overlap+250; +0: none; default auto); "
                        "no_save:S saves nothing (the control: what the bench measures then; durable S s later); "
                        "rows that save nothing price one part of a save alone: gil_load:TOTALxBURSTxSPAN "
                        "(ms of Python on another thread) and d2h_load:GBxSPAN (copies to pinned host memory; "
                        "a GPU)")
    g.add_argument("--gil-watch", action="store_true",
                   help="scale mode: record, per save, how late a thread that asks for the GIL every ms got it, "
                        "and where the engine's threads were then, and where the training thread was in the "
                        "first 100 ms of the save's window and of the window without a save before it "
                        "(scripts/gil_watch.py; it costs a little GIL)")
    g.add_argument("--trace", nargs="?", const="summary", default=None, metavar="PREFIX",
                   help="scale mode: the save after the measured ones (not counted), its window profiled "
                        "(scripts/gpu_timeline.py): where its steps' GPU time went; with PREFIX, also write "
                        "PREFIX-ROW.json traces. The profiler takes GPU memory of its own (its window ran out of "
                        "it once at 24 GB with 6 GiB free; the row keeps its measured saves then)")
    g.add_argument("--lead-in-s", type=float, default=2.0, metavar="S",
                   help="scale mode: train at least S seconds (whole windows, one at least), not measured, "
                        "before each save's window without a save, as its window follows training (the GPU's "
                        "clock follows its recent power); 0: none")
    g.add_argument("--settle-ms", type=float, default=0.0, metavar="MS",
                   help="scale mode: before every second save's window (saves 2, 4, ...) wait MS ms after the "
                        "window without a save, the GPU idle: whether a pause just before a save changes what it "
                        "costs (as the fingerprint before the save not counted does); each save's record says "
                        "its pause")
    g.add_argument("--codec", default="auto", choices=("auto", "ans", "zstd", "none"),
                   help="scale mode: the tiered rows' fast-tier codec (default auto, as the embedded config; a "
                        "pinned one skips the policy's one-off measurement after the first save)")
    g.add_argument("--train", choices=("all", "one"), default="all",
                   help="scale mode: every replica is a model that trains (a step of the compute such a state "
                        "implies: all forwards and backwards, then all optimizer steps), or only replica 0 does "
                        "and the others are static clones")
    g.add_argument("--shared-dir", default=None, metavar="DIR",
                   help="scale mode: the migration row's shared tier, a directory (wiped; default: under --dir, on "
                        "the local tier's disk, which must then hold three stored copies of the state)")
