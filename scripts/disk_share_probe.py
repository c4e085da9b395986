"""How one disk shares its write and read bandwidth between processes: the question behind
several ranks per node saving to one local tier.

Run where the local tier lives: `python3 scripts/disk_share_probe.py --dir D [--gb 8]
[--rounds 2] [--configs 1x4,1x8,2x2,2x4]`. Each config `PxT` is P processes at once (as P ranks
of a node), each writing a file of its own as the engine's writer does (one advancing extent, its
16 MiB O_DIRECT pieces taken in turn by T threads; then fsync), then reading it back the same way.
A config `PxTl` (lanes) has each thread move a contiguous range of its own instead (T far-apart
sequential streams, as `scripts/baselines.disk_ceilings` probes the disk).
`--gb` is the bytes of one config, split between its processes. Configs run in rounds, in a
rotated order each round, so that a disk whose speed drifts is not credited to one config. The
page cache is dropped before each read where the probe runs as root.

Prints one line per trial and a JSON summary (median aggregate GB/s per config: all bytes over the
slowest process's time). Figures for docs/benchmarks.md, not assertions.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import re
import shutil
import statistics
import threading
import time
from pathlib import Path

BLOCK = 16 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _drop_caches() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def _advance(fd: int, nbytes: int, threads: int, write: bool, lanes: bool = False) -> None:
    """Move `nbytes` at offsets 0.. of `fd` in BLOCK pieces, each thread taking the next piece
    (with `lanes`: each thread the pieces of its own contiguous range, in order)."""
    lock, nxt = threading.Lock(), [0]
    errors: list[BaseException] = []
    per = -(-nbytes // threads // BLOCK) * BLOCK

    def worker(i: int) -> None:
        buf = mmap.mmap(-1, BLOCK)
        if write:
            buf.write(os.urandom(BLOCK))
        view = memoryview(buf)
        try:
            mine = iter(range(i * per, min(nbytes, (i + 1) * per), BLOCK))
            while True:
                if lanes:
                    off = next(mine, nbytes)
                else:
                    with lock:
                        off = nxt[0]
                        nxt[0] += BLOCK
                if off >= nbytes:
                    return
                (os.pwrite(fd, view, off) if write else os.preadv(fd, [view], off))
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        finally:
            view.release()
            buf.close()

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def _process(path: str, nbytes: int, threads: int, lanes: bool, barrier, results) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
    barrier.wait()
    t0 = time.perf_counter()
    _advance(fd, nbytes, threads, write=True, lanes=lanes)
    os.fsync(fd)
    t_write = time.perf_counter() - t0
    os.close(fd)
    barrier.wait()  # every process has written before the page cache goes
    barrier.wait()
    fd = os.open(path, os.O_RDONLY | _O_DIRECT)
    t0 = time.perf_counter()
    _advance(fd, nbytes, threads, write=False, lanes=lanes)
    t_read = time.perf_counter() - t0
    os.close(fd)
    results.put((t_write, t_read))


def trial(root: Path, procs: int, threads: int, lanes: bool, total: int) -> dict:
    ctx = mp.get_context("fork")
    per = max(BLOCK, total // procs // BLOCK * BLOCK)
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()
    root.mkdir(parents=True, exist_ok=True)
    ps = [ctx.Process(target=_process, args=(str(root / f"p{i}.bin"), per, threads, lanes, barrier, results))
          for i in range(procs)]
    for p in ps:
        p.start()
    barrier.wait()  # files open
    barrier.wait()  # written
    _drop_caches()
    barrier.wait()
    got = [results.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    for f in root.glob("p*.bin"):
        f.unlink()
    if any(p.exitcode for p in ps):
        raise RuntimeError(f"a probe process failed ({[p.exitcode for p in ps]})")
    nbytes = per * procs
    return {"write_gbps": round(nbytes / max(w for w, _ in got) / 1e9, 3),
            "read_gbps": round(nbytes / max(r for _, r in got) / 1e9, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--gb", type=float, default=8.0, help="bytes of one config's trial, split between its processes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="1x4,1x8,2x2,2x4", help="PxT: P processes of T threads")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not _O_DIRECT:
        raise SystemExit("O_DIRECT is not available here")
    configs = [c.strip() for c in args.configs.split(",")]
    for c in configs:
        if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*l?", c):
            raise SystemExit(f"--configs: {c!r} is not PxT or PxTl (e.g. 2x4, 2x4l)")
    trials: dict[str, list[dict]] = {c: [] for c in configs}
    total = int(args.gb * 1e9)
    try:
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for c in order:
                p, t = (int(x) for x in c.rstrip("l").split("x"))
                got = trial(args.dir, p, t, c.endswith("l"), total)
                trials[c].append(got)
                print(f"round {r} {p} process(es) x {t} thread(s){' in lanes' if c.endswith('l') else ''}: "
                      f"write {got['write_gbps']} GB/s, read {got['read_gbps']} GB/s", flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    summary = {k: {m: statistics.median(g[m] for g in v) for m in ("write_gbps", "read_gbps")} | {"trials": v}
               for k, v in trials.items()}
    text = json.dumps({"gb": args.gb, "block_mib": BLOCK >> 20, "configs": summary}, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
