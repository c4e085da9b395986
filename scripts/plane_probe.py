#!/usr/bin/env python3
"""What the save's ANS encode would cost if it encoded only the bytes that compress: a GPU probe.

At 24 GB on a busy GPU, what a save costs training is mostly the GPU time of its own work, ANS
first (docs/benchmarks.md, sessions 25-35). The savings of lossless fp32 compression come from the
sign/exponent byte: on a trained model's weights and AdamW moments (CPU, session 35) the order-0
entropy of the four byte planes, lowest first, was 8.0 / 8.0 / 7.95-7.98 / 2.4-3.0 bits, so the
top plane alone holds 15.7-17.5% of the 15.9-17.8% to be saved. This probe measures, on one GPU
and on the state of a GPT trained here for a few steps (weights, exp_avg, exp_avg_sq):

  - `ans <f4, all bytes`: nvCOMP ANS typed for fp32 on every byte (the engine's codec today);
  - `ans |u1, all bytes`: untyped, for reference;
  - `ans |u1, top plane`: the top byte of each value gathered (a strided torch copy, timed on its
    own) and encoded, the three low planes stored as they are;
  - `ans <f2, high halves`: the high 16 bits of each value (a bf16's bits) gathered and encoded
    typed as bf16, the low halves stored as they are;

each in 1 MiB chunks (the engine's default), timed with CUDA events alone on the GPU (median of
`--repeats`), its bytes saved of the whole state, and a decode checked bit-exact.

    python scripts/plane_probe.py [--mb 1024] [--repeats 5] [--steps 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gptmodel import GPT, batch, stdlib_corpus  # noqa: E402
from tiered.codecs import _nvcomp  # noqa: E402

CHUNK = 1 << 20


def trained_state(steps: int, mb: int) -> torch.Tensor:
    """`mb` MiB of fp32: a GPT's weights, exp_avg and exp_avg_sq after `steps` AdamW steps, end to
    end (tiled where the model is smaller)."""
    torch.manual_seed(0)
    model = GPT(512, 8, 8, 256).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = stdlib_corpus(8 << 20).cuda()
    for _ in range(steps):
        x, y = batch(data, 256, 32)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).view(-1, 256).float(), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    parts = [p.detach().reshape(-1) for p in model.parameters()]
    parts += [opt.state[p][k].reshape(-1) for k in ("exp_avg", "exp_avg_sq") for p in model.parameters()]
    one = torch.cat(parts)
    n = (mb << 20) // 4
    print(f"trained {steps} steps (loss {loss.item():.3f}); {one.numel() * 4 / 2**20:.0f} MiB of state, tiled to {mb} MiB",
          flush=True)
    return one.repeat(n // one.numel() + 1)[:n].contiguous()


def timed(fn, repeats: int, stream: torch.cuda.Stream) -> tuple[float, object]:
    """(median ms on the GPU, the last result) of `fn()` issued on `stream`."""
    times, out = [], None
    for _ in range(repeats + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record(stream)
            out = fn()
            b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[1:]), out


def ans(src: torch.Tensor, data_type: str, stream: torch.cuda.Stream, repeats: int) -> tuple[float, int, bool]:
    """(median encode ms, stored bytes, decoded bit-exact) of `src` (uint8, on the GPU) in CHUNK chunks."""
    n = src.numel()
    offsets = list(range(0, n, CHUNK))
    sizes = [min(CHUNK, n - o) for o in offsets]
    cap = _nvcomp.max_compressed("ANS", CHUNK, data_type)
    slab = torch.empty(len(offsets) * cap, dtype=torch.uint8, device=src.device)
    rows = [i * cap for i in range(len(offsets))]
    ms, pending = timed(lambda: _nvcomp.encode("ANS", data_type, stream, CHUNK, src, offsets, sizes, slab, rows, cap),
                        repeats, stream)
    stored = pending.sizes()
    back = torch.empty_like(src)
    _nvcomp.decode("ANS", data_type, stream, CHUNK, slab, rows, stored, back, offsets, sizes)
    stream.synchronize()
    return ms, sum(stored), bool(torch.equal(back, src))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="MiB of fp32 state encoded")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60, help="training steps before the state is taken")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("plane_probe: needs a GPU with nvCOMP", file=sys.stderr)
        return 2
    x = trained_state(args.steps, args.mb)
    total = x.numel() * 4
    stream = torch.cuda.Stream()
    by_byte = x.view(torch.uint8).view(-1, 4)
    by_half = x.view(torch.int16).view(-1, 2)
    print(f"{torch.cuda.get_device_name()}; {total / 1e9:.3f} GB of fp32 state, {CHUNK >> 10} KiB chunks, "
          f"median of {args.repeats}", flush=True)
    print("| variant | gather ms | encode ms | GPU ms in all | GB/s of state | saved % of the state | decode bit-exact |")
    print("|---|---|---|---|---|---|---|")

    def row(name: str, gather_ms: float, src: torch.Tensor, data_type: str, kept_raw: int) -> None:
        try:
            ms, stored, ok = ans(src, data_type, stream, args.repeats)
        except Exception as exc:  # noqa: BLE001 - a probe: report the failure and go on
            print(f"| {name} | {gather_ms:.2f} | failed: {type(exc).__name__}: {exc} | | | | |", flush=True)
            return
        whole = gather_ms + ms
        print(f"| {name} | {gather_ms:.2f} | {ms:.2f} | {whole:.2f} | {total / whole / 1e6:.0f} | "
              f"{100 * (1 - (stored + kept_raw) / total):.2f} | {ok} |", flush=True)

    flat = x.view(torch.uint8)
    row("ans <f4, all bytes", 0.0, flat, "<f4", 0)
    row("ans |u1, all bytes", 0.0, flat, "|u1", 0)
    top = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    low = torch.empty(x.numel(), 3, dtype=torch.uint8, device=x.device)
    g_top, _ = timed(lambda: top.copy_(by_byte[:, 3]), args.repeats, stream)
    g_low, _ = timed(lambda: low.copy_(by_byte[:, :3]), args.repeats, stream)
    print(f"gathers (torch strided copies): top plane {g_top:.2f} ms, the three low planes {g_low:.2f} ms", flush=True)
    row("ans |u1, top plane (+ low planes gathered)", g_top + g_low, top, "|u1", 3 * x.numel())
    high = torch.empty(x.numel(), dtype=torch.int16, device=x.device)
    lows = torch.empty(x.numel(), dtype=torch.int16, device=x.device)
    g_high, _ = timed(lambda: high.copy_(by_half[:, 1]), args.repeats, stream)
    g_lows, _ = timed(lambda: lows.copy_(by_half[:, 0]), args.repeats, stream)
    print(f"gathers: high halves {g_high:.2f} ms, low halves {g_lows:.2f} ms", flush=True)
    row("ans <f2, high halves (+ low halves gathered)", g_high + g_lows, high.view(torch.uint8), "<f2", 2 * x.numel())
    return 0


if __name__ == "__main__":
    sys.exit(main())
