"""Where a drained save's time goes: a state larger than the GPU slab, GPU memory nearly full.

    python3 scripts/drain_probe.py --gb 12 --free-gb 6 --saves 3 [--dir /tmp/drain] [--out r.json]

Builds a GPU state of `--gb` GB of fp32 tensors shaped and distributed like a trained model's
weights and Adam moments (3,000 tensors per 24 GB, 64 KiB to 24 MiB), fills the GPU with a ballast
leaving `--free-gb` free, makes an engine with the embedded default config (auto budgets) and
`engine.reserve(state)`, then saves strictly `--saves` times: the call, its stall (the call plus
waiting for the GPU to have read the state), time to durable, and the save's phases
(`handle.timings`: the stager's wait for slab rows, packing and encoding; the writer's wait for
each wave's compression, issuing its checksums and copies, waiting for host pages and for the
copies). The drain's rate is the bytes that had to leave the slab over the time the stager waited
for them. Same-run ceilings beside it: one large pinned device-to-host copy, and the same bytes as
1 MiB copies, one per row, as the drain issues them. No timing is asserted; docs/benchmarks.md
quotes what it printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tiered  # noqa: E402

GiB = 1 << 30
SIZES_MIB = [16, 4, 0.0625, 24, 1, 12, 0.25, 8, 2, 16]
"""Tensor sizes cycled through (MiB): the mix of a transformer's matrices, embeddings and norms."""


def build_state(total: int, gen: torch.Generator) -> dict:
    state, used, i = {}, 0, 0
    while used < total:
        n = int(SIZES_MIB[i % len(SIZES_MIB)] * (1 << 20)) // 4
        kind = i % 3
        t = torch.randn(n, device="cuda", generator=gen)
        if kind == 0:
            t.mul_(0.02)  # weights
        elif kind == 1:
            t.mul_(1e-3)  # Adam exp_avg
        else:
            t.square_().mul_(1e-6)  # Adam exp_avg_sq
        state[f"t{i}"] = t
        used += 4 * n
        i += 1
    return state


def fingerprint(state: dict) -> list[tuple[int, int]]:
    """Per tensor: the sum of its 32-bit words and of every other word (computed on the GPU)."""
    out = []
    for t in state.values():
        words = t.view(torch.int32)
        out.append((int(words.sum(dtype=torch.int64)), int(words[1::2].sum(dtype=torch.int64))))
    return out


def ceilings(nbytes: int = GiB) -> dict:
    """Pinned device-to-host copy rates: one copy of `nbytes`, and the same bytes as 1 MiB copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, srcs, dsts in (("one_copy", [src], [dst]), ("per_1MiB", list(src.split(1 << 20)), list(dst.split(1 << 20)))):
        rates = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            torch.cuda.synchronize()
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        out[f"d2h_{name}_gbps"] = round(statistics.median(rates), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=12)
    ap.add_argument("--free-gb", type=float, default=6)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/tiered-drain-probe")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    import logging

    logging.basicConfig(format="#   tiered log: %(message)s")
    logging.getLogger("tiered").setLevel(logging.INFO)
    out: dict = {"ceilings": ceilings()}
    torch.cuda.empty_cache()
    state = build_state(int(args.gb * 1e9), torch.Generator(device="cuda").manual_seed(0))
    raw = sum(t.numel() * 4 for t in state.values())
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    ballast = torch.empty(max(0, free - int(args.free_gb * GiB)), dtype=torch.uint8, device="cuda")
    out.update(state_gb=round(raw / 1e9, 2), tensors=len(state), free_gb=round(torch.cuda.mem_get_info()[0] / GiB, 2))
    print(f"# state {out['state_gb']} GB in {len(state)} tensors, {out['free_gb']} GiB free; {out['ceilings']}", flush=True)
    engine = tiered.Engine.from_config({"tiers": [{"name": "local", "kind": "local", "path": str(root)}]})
    t0 = time.perf_counter()
    engine.reserve(state)
    engine.wait_pinned()
    out["pin_s"] = round(time.perf_counter() - t0, 1)
    saves = []
    for step in range(1, args.saves + 1):
        if step > 2:
            engine.tier.delete(step - 2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = engine.save(step, state)
        call = time.perf_counter() - t0
        torch.cuda.current_stream().synchronize()
        stall = time.perf_counter() - t0
        h.wait()
        durable = time.perf_counter() - t0
        stored = h.manifest.stored_bytes
        t = {k: round(v, 1) for k, v in h.timings.items() if isinstance(v, float)}
        waited = sum(v for k, v in t.items() if k.endswith("wait_rows_ms")) / 1e3
        row = {"step": step, "call_s": round(call, 3), "stall_s": round(stall, 3), "durable_s": round(durable, 2),
               "stored_gb": round(stored / 1e9, 2), "timings_ms": t}
        saves.append(row)
        print(f"save {step}: call {row['call_s']} s, stall {row['stall_s']} s, durable {row['durable_s']} s, "
              f"stored {row['stored_gb']} GB, waited for slab rows {waited:.2f} s; phases {t}", flush=True)
    prints = fingerprint(state)  # the last step restored into the zeroed state must match it
    for t in state.values():
        t.zero_()
    t0 = time.perf_counter()
    engine.restore(state, step=args.saves)
    torch.cuda.synchronize()
    out["restore_s"] = round(time.perf_counter() - t0, 2)
    out["restore_bit_exact"] = fingerprint(state) == prints
    print(f"# restore (page cache warm): {out['restore_s']} s, bit-exact: {out['restore_bit_exact']}", flush=True)
    engine.close()
    shutil.rmtree(root, ignore_errors=True)
    out["saves"] = saves
    warm = saves[1:] or saves
    out["warm_median"] = {k: statistics.median(s[k] for s in warm) for k in ("call_s", "stall_s", "durable_s")}
    print(f"# warm median: {out['warm_median']}", flush=True)
    del ballast
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
