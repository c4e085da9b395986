"""Trial (not committed): the scale bench with one more row, `tiered_lowprio`: the shared engine's
save streams swapped for streams of priority 0 (training's) for that row, then back."""
import runpy
import sys

import torch

sys.path.insert(0, "scripts")
import scale_methods  # noqa: E402


def run_lowprio(row, run, base):
    eng = scale_methods.tiered_engine(run)
    dev = eng.workers.device(torch.cuda.current_device())
    old = (dev.stream, dev.writer_stream, list(dev.encode_streams))
    print("# lowprio: old priorities", [s.priority for s in (old[0], old[1], *old[2])], flush=True)
    torch.cuda.synchronize()
    mk = lambda: torch.cuda.Stream(dev.device, priority=0)  # noqa: E731
    dev.stream, dev.writer_stream, dev.encode_streams = mk(), mk(), [mk() for _ in old[2]]
    print("# lowprio: new priorities", [s.priority for s in (dev.stream, dev.writer_stream, *dev.encode_streams)], flush=True)
    try:
        scale_methods.run_tiered_overlap(row, run, base)
    finally:
        torch.cuda.synchronize()
        dev.stream, dev.writer_stream, dev.encode_streams = old[0], old[1], old[2]


scale_methods.METHODS["tiered_lowprio"] = (run_lowprio, "tiered_overlap with the save's streams at priority 0")
sys.argv = ["scripts/bench.py"] + sys.argv[1:]
runpy.run_path("scripts/bench.py", run_name="__main__")
