"""reserve() at 7,880 tensors of a 24 GB state, after the page cache is dropped (as on a fresh
machine) and with Triton's cache empty: the save's kernels compiled in this process (AHEAD off)
against in a child process (AHEAD on); a last run with both caches warm. Each run a process of
its own; at every wake-up of a 1 ms ticker more than 20 ms late, where each thread was.

    sudo-capable: python3 reserve_probe2.py --out results.jsonl       # ~3 min on an H200
"""
import argparse, json, os, subprocess, sys, tempfile, threading, time, traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def where(frame, n=2):
    st = traceback.extract_stack(frame)[-n:]
    return " < ".join(f"{Path(f.filename).name}:{f.name}:{f.lineno}" for f in reversed(st))


def one(mode: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import logging
    import torch
    t_imp = time.perf_counter()
    import tiered
    from tiered.gpu import precompile
    precompile.AHEAD = mode == "child"
    msgs = []

    class Keep(logging.Handler):
        def emit(self, rec):
            msgs.append(rec.getMessage())
    logging.getLogger("tiered").addHandler(Keep())
    logging.getLogger("tiered").setLevel(logging.INFO)
    torch.manual_seed(0)
    state = {"model": {f"m{m}.p{j}": torch.empty(770_000, device="cuda").normal_(0, 0.02)
                       for m in range(10) for j in range(788)}}
    torch.cuda.synchronize()
    main = threading.get_ident()
    late, stop, holders = [], threading.Event(), []
    span = {"in_call": False}

    def watch():
        me = threading.get_ident()
        while not stop.is_set():
            t = time.perf_counter(); time.sleep(0.001); d = time.perf_counter() - t - 0.001
            if d > 0.005:
                late.append((d, span["in_call"]))
            if d > 0.02:
                names = {th.ident: th.name for th in threading.enumerate()}
                fr = sys._current_frames()
                holders.append({"ms": round(1e3 * d, 1), "in_call": span["in_call"],
                                "threads": {names.get(i, str(i)): where(f) for i, f in fr.items() if i != me}})
    w = threading.Thread(target=watch, daemon=True, name="probe-watch")
    root = Path(tempfile.mkdtemp(prefix="probe-"))
    w.start()
    t_made = time.perf_counter()
    engine = tiered.Engine.from_config({"version": 1, "tiers": [{"name": "local", "kind": "local",
                                                                "path": str(root / "local"), "keep_last": 1}]})
    made = time.perf_counter() - t_made
    time.sleep(0.3)
    span["in_call"] = True
    t0 = time.perf_counter()
    engine.reserve(state)
    call = time.perf_counter() - t0
    span["in_call"] = False
    engine.workers.wait_warm(600)
    warm = time.perf_counter() - t_made
    engine.wait_pinned(600)
    ready = time.perf_counter() - t_made
    stop.set()
    engine.close()
    in_call = [d for d, c in late if c]
    return {"mode": mode, "tensors": len(state["model"]), "gb": round(sum(t.numel() * 4 for t in state["model"].values()) / 1e9, 2),
            "engine_made_ms": round(1e3 * made, 1), "reserve_call_ms": round(1e3 * call, 1),
            "warm_after_s": round(warm, 2), "ready_after_s": round(ready, 2),
            "gil_late_in_call_ms": [round(1e3 * d, 1) for d in in_call if d > 0.01],
            "gil_late_max_ms": round(1e3 * max((d for d, _ in late), default=0), 1),
            "gil_late_total_ms": round(1e3 * sum(d for d, _ in late), 1),
            "holders": sorted(holders, key=lambda h: -h["ms"])[:8],
            "log": [m for m in msgs if "kernel" in m or "child" in m or "pinned" in m][:6]}


def drop() -> str:
    os.sync()
    for cmd in (["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], ["sudo", "-n", "sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"]):
        try:
            if subprocess.run(cmd, capture_output=True).returncode == 0:
                return "dropped"
        except OSError:
            pass
    return "not dropped"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--one")
    ap.add_argument("--out")
    ap.add_argument("--runs", default="inproc,child,inproc,child,warm")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one)))
        sys.exit(0)
    rows, last = [], None
    for mode in a.runs.split(","):
        cache = last if mode == "warm" else tempfile.mkdtemp(prefix=f"triton-{mode}-")
        last = cache
        dropped = drop() if mode != "warm" else "kept"
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--one", mode], env=env, capture_output=True, text=True)
        try:
            row = json.loads(p.stdout.strip().splitlines()[-1])
        except Exception:
            row = {"mode": mode, "rc": p.returncode, "err": p.stderr[-1500:]}
        row.update(page_cache=dropped, run_s=round(time.perf_counter() - t0, 1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
