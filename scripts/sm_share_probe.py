"""Can a save's GPU work run on a share of the SMs, and does a training step lose less? (issue 14)

    python3 scripts/sm_share_probe.py [--gb 2.4] [--sms 16,32,66] [--batch 192] [--rounds 4] [--split]
        [--batches 256,1024] [--out F]

At scale a save's GPU work is ANS compression of the state into slab rows, then the drain's kernel
that zeroes each row's padding, checksums it and packs it (`tiered.gpu_checksum`). Beside a
GPU-bound training step they share the SMs, and training loses what they take: the first step
after a 24 GB save ran 40-70 ms long (runs 266, 272). A CUDA green context
(`torch.cuda.green_contexts`, CUDA 12.4+) confines the kernels of its streams to N SMs; training's
kernels, in the primary context, still use them all. This probe:

1. says which green-context API the installed torch has;
2. runs that work on `--gb` of fp32 values (scaled like trained weights) on an ordinary stream of
   priority -5 (as a save's streams are) and on a green context's stream of N SMs, each alone,
   checks that both give the same bytes and checksums, and times each on the GPU;
3. trains the bench's GPT (one replica, `--batch` sequences of 256 tokens) and times steps that
   start with that work queued on one of those streams against steps with none, rounds alternating
   between them so that the machine's drift falls on every kind alike.

Prints a line per measurement and writes them to --out as JSON. No timing is asserted anywhere.

With `--split`, steps are also timed with ANS alone and with the pack kernel alone; with
`--batches`, with ANS in calls of that many chunks each (a save's waves: 256 with the default
pack buffer), and ANS alone is timed in such calls too.

Run 277 (H100, docs/benchmarks.md session 29): the step lost about what the work takes of the
whole GPU alone (+4.0 to +5.0 ms against 5.2 ms), on 16, 32, 66 or all 132 SMs; the green
contexts' output differed from the ordinary stream's. Nothing of it went into the engine.
Runs 308-309 (H200, session 36; 19,073 MiB, `--sms ""`): ANS 20.0 ms alone in one call, the pack
9.8 ms; a step lost +17.7 and +8.6 ms for them, +27.3 together; ANS in calls of 256 / 1,024 /
4,096 chunks took 29.5 / 20.7 / 19.1 ms alone and cost a step +26.0 / +17.4 / +18.6 ms. Waves
of 1,024 chunks in the engine did not lower the scale bench's stall (runs 310-311): not adopted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

MiB = 1 << 20


def api() -> dict:
    from torch.cuda import green_contexts as g
    names = [n for n in ("create", "Stream", "set_context", "pop_context") if hasattr(g.GreenContext, n)]
    return {"torch": torch.__version__, "supported": bool(getattr(g, "SUPPORTED", False)), "methods": names,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count}


def green_stream(sms: int) -> tuple[object, torch.cuda.Stream]:
    from torch.cuda.green_contexts import GreenContext
    ctx = GreenContext.create(num_sms=sms, device_id=0)
    return ctx, ctx.Stream()


class Work:
    """A save's GPU work on `gb` of fp32 values: ANS into 4 KiB-aligned slab rows, then the drain's
    pad-checksum-pack kernel into a pack buffer, on whatever stream is current."""

    def __init__(self, gb: float):
        from tiered import gpu_checksum
        from tiered.codecs.ans import AnsCodec
        from tiered.codecs.base import get_codec
        self.gpu_checksum = gpu_checksum
        self.codec = get_codec(AnsCodec.spec_for(torch.float32))
        self.n = int(gb * 1e9) // MiB
        g = torch.Generator("cuda").manual_seed(1)
        self.src = (torch.randn(self.n * MiB // 4, device="cuda", generator=g) * 0.02).view(torch.uint8)
        self.stride = -(-self.codec.max_stored_size(MiB) // 4096) * 4096
        self.slab = torch.empty((self.n, self.stride), dtype=torch.uint8, device="cuda")
        self.pack = torch.empty(self.n * self.stride, dtype=torch.uint8, device="cuda")
        self.parts = gpu_checksum.partials(self.n, self.src.device)
        self.sums = torch.empty(self.n, dtype=torch.int64, device="cuda")
        self.sizes_gpu = None
        self.offsets = None

    def encode(self, stream: torch.cuda.Stream, batch: int = 0):
        """ANS of every chunk: one batched call, or (`batch`) calls of `batch` chunks each, as a
        save's waves make them (the last call's pending sizes returned)."""
        batch = batch or self.n
        with torch.cuda.stream(stream):
            for a in range(0, self.n, batch):
                b = min(a + batch, self.n)
                pending = self.codec.encode_batch(stream, MiB, self.src, [k * MiB for k in range(a, b)], [MiB] * (b - a),
                                                  self.slab.view(-1), [k * self.stride for k in range(a, b)], self.stride)
        return pending

    def settle(self, pending) -> None:
        """The sizes nvCOMP wrote, on the GPU, and each row's offset in the pack buffer (words)."""
        sizes = pending.sizes()
        self.sizes_gpu = torch.tensor(sizes, dtype=torch.int64, device="cuda")
        extents = [(s + 4095) // 4096 * 4096 for s in sizes]
        starts, at = [], 0
        for e in extents:
            starts.append(at // 4)
            at += e
        self.offsets = torch.tensor(starts, dtype=torch.int64, device="cuda")
        self.packed_bytes = at

    def drain(self, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            self.gpu_checksum.pack_and_checksum(self.slab, self.sizes_gpu, self.parts, self.pack, self.offsets, 0, self.n)
            self.gpu_checksum.sum_partials(self.parts, self.sums)

    def run(self, stream: torch.cuda.Stream) -> None:
        """Both kernels queued on `stream` (the sizes of the first encode are reused: the drain's
        work depends only on them, and the data is the same every time)."""
        self.encode(stream)
        self.drain(stream)

    def result(self, stream: torch.cuda.Stream) -> tuple[bytes, list[int]]:
        stream.synchronize()  # (a device synchronize waits for the primary context's streams only)
        return (self.pack[:min(self.packed_bytes, 1 << 24)].cpu().numpy().tobytes(), self.sums.cpu().tolist())


def gpu_ms(stream: torch.cuda.Stream, fn) -> float:
    stream.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    fn()
    b.record(stream)
    b.synchronize()
    return a.elapsed_time(b)


def trainer(batch: int):
    from gptmodel import GPT, batch as make_batch, stdlib_corpus
    model = GPT(1024, 16, 16, 256).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = stdlib_corpus(8 << 20).cuda()
    gen = torch.Generator("cuda").manual_seed(0)

    def step(before_optimizer=None) -> None:
        x, y = make_batch(data, 256, batch, gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        if before_optimizer is not None:
            before_optimizer()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.4)
    ap.add_argument("--sms", default="16,32,66")
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--split", action="store_true",
                    help="also time steps with ANS alone and with the pad-checksum-pack kernel alone, on the "
                         "ordinary stream: what each part of a save's GPU work costs a step")
    ap.add_argument("--batches", default="",
                    help="comma-separated chunks per ANS call (a save's waves: 256 with the default pack buffer): "
                         "time ANS alone in calls of each size, and steps with it")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out: dict = {"api": api(), "gb": args.gb}
    print("api", out["api"], flush=True)

    work = Work(args.gb)
    normal = torch.cuda.Stream(priority=-5)
    work.settle(work.encode(normal))
    work.drain(normal)
    reference = work.result(normal)
    streams = {"normal -5": normal}
    contexts = []
    for n in [int(x) for x in args.sms.split(",") if x]:
        try:
            ctx, s = green_stream(n)
        except Exception as exc:  # noqa: BLE001 - reported: this is what the probe is for
            print(f"green {n}: cannot create ({type(exc).__name__}: {exc})", flush=True)
            out.setdefault("errors", {})[f"green {n}"] = repr(exc)
            continue
        streams[f"green {n}"] = s
        contexts.append(ctx)  # (a context collected takes its streams with it)
        try:
            work.run(s)
            same = work.result(s) == reference
        except Exception as exc:  # noqa: BLE001
            print(f"green {n}: work failed ({type(exc).__name__}: {exc})", flush=True)
            out.setdefault("errors", {})[f"green {n}"] = repr(exc)
            del streams[f"green {n}"]
            continue
        print(f"green {n}: same bytes and checksums as the ordinary stream: {same}", flush=True)
        out.setdefault("same", {})[f"green {n}"] = same

    alone = {}
    for name, s in streams.items():
        enc = [gpu_ms(s, lambda: work.encode(s)) for _ in range(3)]
        dr = [gpu_ms(s, lambda: work.drain(s)) for _ in range(3)]
        alone[name] = {"encode_ms": statistics.median(enc), "drain_ms": statistics.median(dr)}
        print(f"alone, {name}: ANS {alone[name]['encode_ms']:.1f} ms, pad-checksum-pack {alone[name]['drain_ms']:.1f} ms "
              f"for {work.n} MiB", flush=True)
    batches = [int(x) for x in args.batches.split(",") if x]
    for b in batches:
        enc = [gpu_ms(normal, lambda: work.encode(normal, b)) for _ in range(3)]
        alone[f"ans/{b}"] = {"encode_ms": statistics.median(enc)}
        print(f"alone, ANS in calls of {b} chunks: {alone[f'ans/{b}']['encode_ms']:.1f} ms for {work.n} MiB", flush=True)
    out["alone"] = alone

    step = trainer(args.batch)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    kinds = ["none"] + list(streams)
    parts: dict = {k: None for k in streams}  # (None: both kernels; "encode" or "drain": that one alone;
    #  an int: ANS alone in calls of that many chunks)
    if args.split:
        for part in ("encode", "drain"):
            parts[f"normal -5 {part}"] = part
            kinds.append(f"normal -5 {part}")
    for b in batches:
        parts[f"ans/{b}"] = b
        kinds.append(f"ans/{b}")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if k == "none":
                    step()
                else:  # the optimizer step waits for the save's work, as `Engine.guard` makes it
                    s = streams.get(k, normal)
                    if isinstance(parts[k], int):
                        work.encode(s, parts[k])
                    else:
                        if parts[k] != "drain":
                            work.encode(s)
                        if parts[k] != "encode":
                            work.drain(s)
                    step(lambda: torch.cuda.current_stream().wait_stream(s))
                torch.cuda.synchronize()
                times[k].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(times["none"])
    out["steps"] = {}
    for k in kinds:
        med = statistics.median(times[k])
        out["steps"][k] = {"median_ms": med, "extra_ms": med - base, "all_ms": times[k]}
        print(f"step with {k:10s}: median {med:.1f} ms ({min(times[k]):.1f}-{max(times[k]):.1f}), "
              f"extra {med - base:+.1f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
