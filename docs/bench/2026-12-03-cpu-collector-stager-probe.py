"""Full passes of Python's collector while a guarded CPU state of 7,920 tensors (ten models) is
saved N times (SAVE=1) or only made into state dicts (SAVE=0), and the thread each ran on;
STACK=1 prints where the first full pass began. Run with PYTHONPATH at the tree to measure.

    SAVE=1 N=16 python3 2026-12-03-cpu-collector-stager-probe.py    # ~20 s on the CPU machine
"""
import gc, os, sys, threading, time, tempfile, torch, tiered
from pathlib import Path
torch.manual_seed(0)
JUNK = [{"a": [i]} for i in range(int(os.environ.get("JUNK", "0")))]
models = [torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(99)]) for _ in range(10)]
opts = [torch.optim.AdamW(m.parameters()) for m in models]
def step():
    for m, o in zip(models, opts):
        m(torch.randn(2, 16)).sum().backward(); o.step(); o.zero_grad()
step()
cols, t, STACKS = [], {}, []
def cb(phase, info):
    if phase == "start":
        t[threading.get_ident()] = time.perf_counter()
        if info["generation"] == 2:
            import traceback; STACKS.append("".join(traceback.format_stack(limit=9)[:-1]))
    else: cols.append((info["generation"], round(1e3 * (time.perf_counter() - t.pop(threading.get_ident(), time.perf_counter())), 1), threading.current_thread().name))
gc.callbacks.append(cb)
root = Path(tempfile.mkdtemp())
e = tiered.Engine.from_config({"version": 1, "tiers": [{"name": "local", "kind": "local", "path": str(root), "keep_last": 1, "codec": "none"}]})
gs = [e.guard(o) for o in opts]
s = lambda: {f"m{i}": {"model": m.state_dict(), "optim": o.state_dict()} for i, (m, o) in enumerate(zip(models, opts))}
e.reserve(s()); e.wait_pinned()
cols.clear()
for k in range(int(os.environ.get("N", "8"))):
    st = s(); h = e.save(k + 1, st) if os.environ.get("SAVE", "1") == "1" else None; step(); h and h.wait()
big = [c for c in cols if c[0] == 2]
print("full collections:", big, " on threads:", sorted(set(c[2] for c in cols if c[1] > 1)))
e.close()
if os.environ.get("STACK"):
    print(STACKS[0] if STACKS else "")
