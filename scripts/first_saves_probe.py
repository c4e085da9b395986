"""Where the first guarded saves of a run go (issue 14: the first save should stall no more than a
warm one): the scale bench's 202M-parameter GPT with AdamW (2.4 GB of state), GPU-bound steps
(batch 64), a ballast leaving 6 GiB of GPU memory free, `engine.reserve` + `wait_pinned` first,
then windows of six training steps, each synchronized, with one guarded save each.

    python3 scripts/first_saves_probe.py [--saves 5] [--trace 2]

Prints, for each save: the window's extra time over a window without a save (the stall), each
step's time, the save's phases, and what the CUDA caching allocator and the pinned host allocator
did during the window (`num_device_alloc`: cudaMalloc calls, which can wait for the whole
device). For the first `--trace` saves it also lists every new CUDA memory segment with the
Python frames (tiered's, this script's) that asked for it. Needs a GPU and the GPU stack.
"""

import argparse
import pathlib
import shutil
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from gptmodel import GPT, batch, stdlib_corpus  # noqa: E402
from scale_measure import allocator_counts  # noqa: E402
import tiered  # noqa: E402

GiB = 1 << 30
def new_segments(snapshot: dict) -> list[str]:
    lines = []
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
                frames = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in e.get("frames", ())
                          if "/tiered/" in f["filename"] or f["filename"].endswith(("first_saves_probe.py",))][:6]
                lines.append(f"{e['action']} {e['size'] / 2**20:.1f} MiB, stream {e.get('stream')}: {frames}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--trace", type=int, default=2, help="list new memory segments for the first N saves")
    ap.add_argument("--dir", default="/tmp/tiered-first-saves")
    args = ap.parse_args()
    torch.manual_seed(0)
    data = stdlib_corpus(32 << 20).cuda()
    model = GPT(1024, 16, 16, 256).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        x, y = batch(data, 256, 64)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        F.cross_entropy(logits.float().view(-1, 256), y.view(-1)).backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    ballast = torch.empty(max(0, torch.cuda.mem_get_info()[0] - 6 * GiB), dtype=torch.uint8, device="cuda")
    root = pathlib.Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    engine = tiered.Engine.from_config({"tiers": [{"name": "local", "kind": "local", "path": str(root)}]})
    t = time.perf_counter()
    engine.reserve(state)
    engine.wait_pinned()
    print(f"reserve + wait_pinned: {1e3 * (time.perf_counter() - t):.0f} ms", flush=True)
    guard = engine.guard(opt)
    count = [0]

    def window(save: bool) -> float:
        count[0] += 1
        torch.cuda.synchronize()
        before = allocator_counts("cuda")
        t0 = time.perf_counter()
        handle = engine.save(count[0], state) if save else None
        call = 1e3 * (time.perf_counter() - t0)
        marks = []
        for _ in range(6):
            step()
            torch.cuda.current_stream().synchronize()
            marks.append(time.perf_counter())
        wall = 1e3 * (time.perf_counter() - t0)
        if handle is not None:
            handle.wait()
            after = allocator_counts("cuda")
            print(f"save {count[0]}: window {wall:.0f} ms, call {call:.1f} ms, steps "
                  f"{[round(1e3 * (b - a)) for a, b in zip([t0] + marks, marks)]}", flush=True)
            print(f"  phases {({k: round(v, 1) for k, v in handle.timings.items()})}", flush=True)
            print(f"  allocator {({k: after[k] - before[k] for k in after})}", flush=True)
        return wall

    base = statistics.median(window(False) for _ in range(3))
    print(f"window without a save: {base:.0f} ms", flush=True)
    for i in range(args.saves):
        if i < args.trace:
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        wall = window(True)
        print(f"  stall {wall - base:.0f} ms", flush=True)
        if i < args.trace:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            for line in new_segments(snapshot):
                print(f"  {line}", flush=True)
    guard.remove()
    engine.close()
    del ballast
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
