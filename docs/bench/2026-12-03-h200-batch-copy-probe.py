"""A probe kept beside its output (2026-12-03-h200-batch-copy-probe.json): 40 waves of 256 rows
(1 MiB slab rows holding 0.78-0.9 MiB each) to pinned host memory, three ways, each alone and
beside a loop of bf16 8192 x 8192 matmuls on another stream: one contiguous copy per 64 MiB run
(the link's ceiling), packed by tiered.gpu.pack's kernel into staging buffers then copied (the
drain before 2026-12-03), and copied where they lie in one cuMemcpyBatchAsync call per wave
(tiered.gpu.batch_copy). From the repository root, on a GPU machine:

    OUT=. python3 docs/bench/2026-12-03-h200-batch-copy-probe.py
"""
import json, os, sys, time
import numpy as np
import torch
from tiered.gpu import pack as gp
from tiered.gpu import batch_copy as bc

dev = torch.device("cuda", 0)
torch.cuda.set_device(0)
ROW = 1 << 20
ROWS = 256
RUN = 64 << 20
WAVES = int(os.environ.get("WAVES", "40"))
rng = np.random.default_rng(0)
rows = torch.randint(0, 255, (ROWS, ROW), dtype=torch.uint8, device=dev)
sizes = rng.integers(int(0.78 * ROW), int(0.9 * ROW), ROWS).astype(np.int64)
ext = (sizes + 4095) // 4096 * 4096
ends = np.cumsum(ext); starts = ends - ext
# runs of at most RUN bytes
bounds = []; i = 0
while i < ROWS:
    k = i; tot = 0
    while k < ROWS and tot + ext[k] <= RUN:
        tot += ext[k]; k += 1
    bounds.append((i, k, int(tot))); i = k
offs = np.empty(ROWS, np.int64)
for i, k, t in bounds:
    offs[i:k] = starts[i:k] - starts[i]
host = torch.empty(int(ends[-1]) * 2, dtype=torch.uint8, pin_memory=True)
sizes_d = torch.tensor(sizes, device=dev); offs_d = torch.tensor(offs // 4, device=dev)
staging = [torch.empty(RUN, dtype=torch.uint8, device=dev) for _ in range(2)]
pr = -5
pack_s = torch.cuda.Stream(dev, priority=pr); copy_s = torch.cuda.Stream(dev, priority=pr); side_s = torch.cuda.Stream(dev, priority=pr)
contig = torch.empty(RUN, dtype=torch.uint8, device=dev)
gp.warm_up(0)
print("batch available:", bc.available(), bc.why_not(), flush=True)

drained = [None, None]
def wave_pack(w):
    parts = gp.partials(ROWS, dev)
    base = host.data_ptr() + (w % 2) * int(ends[-1])
    slot = 0
    for i, k, tot in bounds:
        with torch.cuda.stream(pack_s):
            if drained[slot] is not None:
                pack_s.wait_event(drained[slot])
            gp.pack_and_checksum(rows, sizes_d, parts, staging[slot], offs_d, i, k)
            e = torch.cuda.Event(); e.record(pack_s); copy_s.wait_event(e)
        dst = host[(w % 2) * int(ends[-1]) + int(starts[i]):][:tot]
        with torch.cuda.stream(copy_s):
            dst.copy_(staging[slot][:tot], non_blocking=True)
            drained[slot] = torch.cuda.Event(); drained[slot].record(copy_s)
        slot ^= 1

def wave_batch(w):
    base = host.data_ptr() + (w % 2) * int(ends[-1])
    with torch.cuda.stream(side_s):
        sums = torch.empty(ROWS, dtype=torch.int64, device=dev)
        gp.pad_and_checksum(rows, sizes_d, sums)   # (a row's tail only; beside the copies)
    bc.copy_batch([base + int(s) for s in starts], [rows.data_ptr() + r * ROW for r in range(ROWS)],
                  sizes.tolist(), copy_s)

def wave_contig(w):
    for i, k, tot in bounds:
        dst = host[(w % 2) * int(ends[-1]) + int(starts[i]):][:tot]
        with torch.cuda.stream(copy_s):
            dst.copy_(contig[:tot], non_blocking=True)

def matmuls(n):
    s = torch.cuda.Stream(dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    with torch.cuda.stream(s):
        for _ in range(n):
            a = (a @ a).clamp_(-1, 1)
    return s

def run(fn, busy):
    torch.cuda.synchronize()
    bs = matmuls(400) if busy else None
    t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
    copy_s.wait_stream(torch.cuda.current_stream())
    t0.record(copy_s)
    h0 = time.perf_counter()
    for w in range(WAVES):
        fn(w)
    host_ms = (time.perf_counter() - h0) * 1e3
    t1.record(copy_s)
    t1.synchronize()
    ms = t0.elapsed_time(t1)
    torch.cuda.synchronize()
    gb = WAVES * int(sizes.sum() if fn is not wave_contig else sum(b[2] for b in bounds)) / 1e9
    return {"ms": round(ms, 2), "gbps": round(gb / ms * 1e3, 2), "host_ms": round(host_ms, 2), "gb": round(gb, 3)}

res = {}
for busy in (False, True):
    for name, fn in (("contig", wave_contig), ("pack", wave_pack), ("batch", wave_batch)):
        out = [run(fn, busy) for _ in range(3)]
        res[f"{name}{'+matmul' if busy else ''}"] = out
        print(name, "busy" if busy else "alone", out, flush=True)
# correctness of the batch
host.zero_()
wave_batch(0); torch.cuda.synchronize()
ok = all(torch.equal(host[int(starts[r]):int(starts[r]) + int(sizes[r])], rows[r, :int(sizes[r])].cpu()) for r in range(0, ROWS, 17))
print("batch bytes equal:", ok)
res["ok"] = ok
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "batch_probe.json"), "w"), indent=1)
