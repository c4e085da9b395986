"""reserve() of a CPU state of 7,920 tensors (ten models), unguarded then guarded: its call, and
the collections (generation, ms, thread) during the call and until its background work is done.
JUNK=N adds N small objects to the process. Run with PYTHONPATH at the tree to measure.

    JUNK=0 python3 2026-12-03-cpu-collector-reserve-probe.py         # ~10 s on the CPU machine
"""
import gc, os, sys, threading, time, tempfile, torch, tiered
from pathlib import Path
torch.manual_seed(0)
JUNK = [{"a": [i]} for i in range(int(os.environ.get("JUNK", "0")))]
models = [torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(99)]) for _ in range(10)]
opts = [torch.optim.AdamW(m.parameters()) for m in models]
for m, o in zip(models, opts):
    m(torch.randn(2, 16)).sum().backward(); o.step()
s = {f"m{i}": {"model": m.state_dict(), "optim": o.state_dict()} for i, (m, o) in enumerate(zip(models, opts))}
cols, t = [], {}
def cb(phase, info):
    if phase == "start": t[threading.get_ident()] = time.perf_counter()
    else: cols.append((info["generation"], round(1e3 * (time.perf_counter() - t.pop(threading.get_ident(), time.perf_counter())), 1), threading.current_thread().name))
gc.callbacks.append(cb)
root = Path(tempfile.mkdtemp())
e = tiered.Engine.from_config({"version": 1, "tiers": [{"name": "local", "kind": "local", "path": str(root), "keep_last": 1}]})
for n in (1, 2):
    if n == 2 and os.environ.get("GUARD", "1") == "1":
        gs = [e.guard(o) for o in opts]
    cols.clear()
    t0 = time.perf_counter(); e.reserve(s); call = round(1e3*(time.perf_counter()-t0), 1)
    during = list(cols)
    e.wait_pinned()
    print(f"reserve {n}: {call} ms; collections during the call {[c for c in during if c[1] > 1]}; by the end of its work {[c for c in cols if c[1] > 1]}")
e.close()
