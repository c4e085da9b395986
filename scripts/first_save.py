"""What a first save without `Engine.reserve` waits for, in a process of its own: one strict save
(no `guard`) of a synthetic state, then a second, warm one.

    python3 scripts/first_save.py --gb 24 --free-gb 6 --wait-s 3 --out first.jsonl    # ~40 s on an H200

The state is `--gb` of fp32 tensors of 120 MB (random, 0.02 wide: compressible like weights);
on a GPU, memory is taken until `--free-gb` is left, as training leaves it. The engine is made
after the state exists (as the README's loop makes it), the process waits `--wait-s` (the steps
before a first save), and then:

- `--pin-first`: the host staging memory is pinned first (`engine.reserve(nbytes)`, waited for);
- `--ready`: the save kernels are waited for (`engine.workers.wait_warm()`);
- `--pin-block-mib N`, `--touch-threads N`: the pinner registers blocks of N MiB (default
  `tiered.stage.pools.PIN_BLOCK`) and at most N threads touch their pages first (default
  `TOUCH_THREADS`): to weigh them against each other, a process each.

Each save prints one JSON line: its call and stall (until the training stream may go on), the
host memory registrations it waited beside (`cuMemHostRegister`, each timed: their count, median,
largest and total, and when the last ended), the engine's phases (`handle.timings`), and the
first calls of the steps that load or wait on a first save: nvCOMP's encode, the kernel that
stores a wave's sizes into pinned memory (`deliver`). `--pool-only` pins `--gb` of host staging
memory alone (the engine's pool, no save) and prints its rate: on a virtual machine, memory
pinned for the first time since the machine started registered 2-9x slower than memory it had
pinned before (docs/benchmarks.md, "The first save without reserve"). Without CUDA the state is
on the CPU (a smoke run: no registration, no GPU phases).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GB = 1e9
TENSOR = 30_000_000
"""fp32 elements per tensor (120 MB)."""


def timed(owner: Any, name: str, into: dict[str, list[float]], key: str) -> None:
    """Wrap `owner.name` so that each call's seconds are appended to `into[key]`."""
    real = getattr(owner, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into.setdefault(key, []).append(time.perf_counter() - t0)

    setattr(owner, name, call)


def registrations(log: list[tuple[float, float]]) -> Callable[[], Any]:
    """A stand-in for tiered.gpu.runtime.host_registration that logs (start, seconds) of each pin."""
    from tiered.gpu import runtime

    real = runtime.host_registration

    def make() -> Any:
        pin, unpin = real()

        def logged(addr: int, n: int) -> bool:
            t0 = time.perf_counter()
            ok = pin(addr, n)
            log.append((t0, time.perf_counter() - t0))
            return ok

        return logged, unpin

    return make


def pins(log: list[tuple[float, float]], t0: float) -> dict:
    took = [s for _, s in log]
    return {"registrations": len(took), "register_s": round(sum(took), 3),
            "register_ms_median": round(1e3 * statistics.median(took), 1) if took else None,
            "register_ms_max": round(1e3 * max(took), 1) if took else None,
            "last_register_end_ms": round(1e3 * (max(a + s for a, s in log) - t0), 1) if log else None}


def first_calls(spans: dict[str, list[float]]) -> dict:
    return {k: {"total_ms": round(1e3 * sum(v), 1), "calls": len(v), "first_ms": round(1e3 * v[0], 1),
                "largest_ms": round(1e3 * max(v), 1)} for k, v in spans.items()}


def pool_only(nbytes: int) -> dict:
    """Pin `nbytes` of the engine's host pool alone, as a first save would have it pinned."""
    from tiered.gpu import runtime

    pin, unpin = runtime.host_registration()
    pool = runtime.HostPool(nbytes, pin=pin, unpin=unpin)
    t0 = time.perf_counter()
    pool.want(nbytes)
    pool.wait_pinned()
    took = time.perf_counter() - t0
    pinned = pool.pinned_bytes
    pool.close()
    return {"pool_gb": round(pinned / GB, 2), "seconds": round(took, 3), "gbps": round(pinned / GB / took, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=24.0, help="the state's size (default 24)")
    ap.add_argument("--free-gb", type=float, default=6.0, help="GPU memory left free (default 6)")
    ap.add_argument("--wait-s", type=float, default=3.0, help="seconds between the engine and its first save")
    ap.add_argument("--pin-first", action="store_true", help="pin the host staging memory before the save")
    ap.add_argument("--ready", action="store_true", help="wait for the save kernels before the save")
    ap.add_argument("--pool-only", action="store_true", help="only pin --gb of host staging memory, timed")
    ap.add_argument("--pin-block-mib", type=int, help="bytes registered per call, in MiB (default: the engine's)")
    ap.add_argument("--touch-threads", type=int, help="most threads touching pages ahead of the pinner")
    ap.add_argument("--dir", help="the local tier's directory (default: a temporary one, removed)")
    ap.add_argument("--out", help="append the JSON lines to this file too")
    args = ap.parse_args(argv)
    settings = pinner(args.pin_block_mib, args.touch_threads)
    cuda = torch.cuda.is_available()
    log: list[tuple[float, float]] = []
    spans: dict[str, list[float]] = {}
    if cuda:
        from tiered.gpu import runtime

        runtime.host_registration = registrations(log)
    if args.pool_only:
        lines = [{"pool_only": True, **settings,
                  **(pool_only(int(args.gb * GB)) if cuda else {"skipped": "no CUDA"})}]
        return emit(lines, args.out)
    import tiered

    if cuda:
        from tiered.codecs.ans import AnsCodec
        from tiered.gpu import pack

        timed(AnsCodec, "encode_batch", spans, "encode_batch")
        timed(pack, "deliver", spans, "deliver")
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    count = max(1, round(args.gb * GB / (4 * TENSOR)))
    size = TENSOR if args.gb * GB >= 4 * TENSOR else max(1, int(args.gb * GB / 4))
    state = {f"t{i}": torch.randn(size, device=device) * 0.02 for i in range(count)}
    filler = None
    if cuda:
        free = torch.cuda.mem_get_info()[0]
        filler = torch.empty(max(0, free - int(args.free_gb * (1 << 30))), dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
    root = Path(args.dir or tempfile.mkdtemp(prefix="tiered-first-save-"))
    engine = tiered.Engine.from_config({"version": 1, "tiers": [{"name": "local", "kind": "local",
                                                                "path": str(root / "local"), "keep_last": 1}]})
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    head = {"gb": round(nbytes / GB, 2), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "readied_at_construction": engine.workers.devices(), **settings}
    if args.pin_first:
        t0 = time.perf_counter()
        engine.reserve(nbytes)
        engine.wait_pinned()
        head["pin_first_s"] = round(time.perf_counter() - t0, 3)
        head.update(pins(log, t0))
    time.sleep(args.wait_s)
    if args.ready:
        t0 = time.perf_counter()
        head["kernels_ready"] = engine.workers.wait_warm(600)
        head["ready_wait_s"] = round(time.perf_counter() - t0, 3)
    else:
        head["kernels_ready"] = engine.workers.wait_warm(0)
    lines = [head]
    try:
        for step in (1, 2):
            log.clear()
            spans.clear()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = engine.save(step, state)
            call = time.perf_counter() - t0
            if cuda:
                torch.cuda.synchronize()  # (a strict save makes the training stream wait for its reads)
            stall = time.perf_counter() - t0
            lines.append({"save": step, "call_ms": round(1e3 * call, 1), "stall_ms": round(1e3 * stall, 1),
                          **pins(log, t0), "first_calls": first_calls(spans),
                          "pinned_gb": round(engine.workers.host.pinned_bytes / GB, 2),
                          "timings_ms": {k: round(v, 1) for k, v in handle.timings.items()}})
            handle.wait()
    finally:
        engine.close()
        del filler
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return emit(lines, args.out)


def pinner(block_mib: int | None, touch_threads: int | None) -> dict:
    """Set the pinner's block size and its touching threads for this process (None: as the engine
    has them); what they are now, for the JSON lines."""
    from functools import partial

    from tiered.gpu import runtime
    from tiered.stage import pools

    block = pools.PIN_BLOCK
    if block_mib is not None:
        if block_mib <= 0:
            raise SystemExit(f"--pin-block-mib must be positive, not {block_mib}")
        block = block_mib << 20
        runtime.HostPool = partial(pools.HostPool, block=block)
    if touch_threads is not None:
        if touch_threads <= 0:
            raise SystemExit(f"--touch-threads must be positive, not {touch_threads}")
        pools.TOUCH_THREADS = touch_threads
    return {"pin_block_mib": block >> 20, "touch_threads": pools.touch_workers()}


def emit(lines: list[dict], out: str | None) -> int:
    text = "\n".join(json.dumps(line) for line in lines)
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
