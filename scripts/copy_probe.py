"""How the copy-engine path's copies behave on this machine (tiered.host_copy): many GPU tensors
copied into registered (pinned) host memory with one `torch._foreach_copy_(..., non_blocking=True)`
against a copy per tensor from Python; how long issuing takes, how long until the copies are
done, and whether the issuing thread holds the GIL meanwhile (a ticker thread's longest wait).

    python scripts/copy_probe.py [--tensors 2000] [--mib 2]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--mib", type=float, default=2.0)
    args = ap.parse_args()
    n, size = args.tensors, int(args.mib * (1 << 20)) // 4096 * 4096
    srcs = [torch.randn(size // 4, device="cuda") for _ in range(n)]
    host = torch.empty(n * size, dtype=torch.uint8)
    t0 = time.perf_counter()
    assert int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 1)) == 0
    print(f"registered {n * size / 1e9:.2f} GB in {time.perf_counter() - t0:.2f} s")
    dsts = [host[k * size:(k + 1) * size].view(torch.float32) for k in range(n)]
    stream = torch.cuda.Stream()
    gaps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    for how in ("foreach", "loop", "foreach", "loop"):
        torch.cuda.synchronize()
        gaps.clear()
        stop.clear()
        tick = threading.Thread(target=ticker)
        tick.start()
        time.sleep(0.01)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            if how == "foreach":
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
            else:
                for d, s in zip(dsts, srcs):
                    d.copy_(s, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        t1 = time.perf_counter()
        ev.synchronize()
        t2 = time.perf_counter()
        stop.set()
        tick.join()
        ok = all(torch.equal(dsts[k], srcs[k].cpu()) for k in (0, n // 2, n - 1))
        print(f"{how:8s}: issued in {1e3 * (t1 - t0):7.1f} ms, done after {1e3 * (t2 - t0):7.1f} ms "
              f"({n * size / (t2 - t0) / 1e9:5.1f} GB/s); the ticker's longest wait {1e3 * max(gaps):6.1f} ms; "
              f"copied right: {ok}")


if __name__ == "__main__":
    main()
