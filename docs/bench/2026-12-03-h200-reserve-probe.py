"""reserve() at 7,880 tensors on a cold Triton cache: the kernels compiled in this process
(AHEAD off) against a child process (AHEAD on), and a warm cache; each mode a process of its own.

    python3 reserve_probe.py --out results.jsonl      # ~1 min on an H200
"""
import argparse, json, os, subprocess, sys, tempfile, threading, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one(mode: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import logging
    import torch
    import tiered
    from tiered.gpu import precompile
    precompile.AHEAD = mode != "inproc"
    msgs = []

    class Keep(logging.Handler):
        def emit(self, rec):
            msgs.append(rec.getMessage())
    logging.getLogger("tiered").addHandler(Keep())
    logging.getLogger("tiered").setLevel(logging.INFO)
    torch.manual_seed(0)
    # ten models of 788 tensors (as the scale bench's), small ones: the walk costs per tensor
    state = {"model": {f"m{m}.p{j}": torch.randn(65536, device="cuda") * 0.02 for m in range(10) for j in range(788)}}
    torch.cuda.synchronize()
    late, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            t = time.perf_counter(); time.sleep(0.001); d = time.perf_counter() - t - 0.001
            if d > 0.005:
                late.append(d)
    w = threading.Thread(target=watch, daemon=True)
    root = Path(tempfile.mkdtemp(prefix="probe-"))
    t_made = time.perf_counter()
    w.start()
    engine = tiered.Engine.from_config({"version": 1, "tiers": [{"name": "local", "kind": "local",
                                                                "path": str(root / "local"), "keep_last": 1}]})
    made = time.perf_counter() - t_made
    time.sleep(0.3)  # (the loop's set-up between the engine and reserve)
    t0 = time.perf_counter()
    engine.reserve(state)
    call = time.perf_counter() - t0
    engine.workers.wait_warm(600)
    warm = time.perf_counter() - t_made
    engine.wait_pinned(600)
    ready = time.perf_counter() - t_made
    stop.set()
    h = engine.save(1, state); h.wait()
    engine.close()
    cache = precompile.cache_dir()
    return {"mode": mode, "tensors": len(state["model"]), "engine_made_ms": round(1e3 * made, 1),
            "reserve_call_ms": round(1e3 * call, 1), "warm_after_s": round(warm, 2), "ready_after_s": round(ready, 2),
            "gil_late_max_ms": round(1e3 * max(late, default=0), 1), "gil_late_over_20ms": sum(d > 0.02 for d in late),
            "gil_late_total_ms": round(1e3 * sum(late), 1),
            "cubins": sum(1 for _ in cache.rglob("*.cubin")), "cache": str(cache),
            "log": [m for m in msgs if "kernel" in m or "child" in m][:5]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--one")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one)))
        sys.exit(0)
    rows = []
    cold_child = tempfile.mkdtemp(prefix="triton-child-")
    for mode, cache in (("inproc", tempfile.mkdtemp(prefix="triton-inproc-")), ("child", cold_child),
                        ("warm", cold_child), ("inproc", tempfile.mkdtemp(prefix="triton-inproc2-")),
                        ("child", tempfile.mkdtemp(prefix="triton-child2-"))):
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--one", mode], env=env, capture_output=True, text=True)
        line = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else json.dumps(
            {"mode": mode, "rc": p.returncode, "err": p.stderr[-2000:]})
        print(line, f"({time.perf_counter() - t0:.1f} s)", flush=True)
        rows.append(line)
    if a.out:
        Path(a.out).write_text("\n".join(rows) + "\n")
