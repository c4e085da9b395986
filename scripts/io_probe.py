"""Measure the ways of moving a GPU-resident compressed checkpoint to and from the local disk.

Run on a GPU machine: `python3 scripts/io_probe.py [--dir D] [--gb 2] [--out result.json]`.
It answers which write and read paths the local tier should use, on the machine at hand:

- KvikIO as the engine used it up to run 27: one request per 1 MiB chunk, default settings;
- KvikIO with chunks coalesced into large requests, with its default pool and with more threads;
- pinned device-to-host copies and O_DIRECT pwrite/pread from a few threads (what the disk
  ceiling in `scripts/bench.py` measures, with the device copy added).

Every write is followed by fsync; every read starts with the page cache dropped (root only;
the JSON says whether it was). Results are figures for docs/benchmarks.md, not assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import drop_caches  # noqa: E402

MiB = 1 << 20


def kvikio_io(path: Path, buf: torch.Tensor, request: int, threads: int | None, task: int | None,
              direct: bool | None, write: bool) -> float:
    """Seconds to write `buf` to `path` (then fsync) or read it back, in `request`-sized KvikIO
    calls issued at once, with the given KvikIO settings (None: KvikIO's default)."""
    import kvikio
    import kvikio.defaults

    settings = {}
    if threads is not None:
        settings["num_threads"] = threads
    if task is not None:
        settings["task_size"] = task
    if direct is not None:
        settings["auto_direct_io_write" if write else "auto_direct_io_read"] = direct
    with kvikio.defaults.set(settings) if settings else _null():
        t0 = time.perf_counter()
        f = kvikio.CuFile(str(path), "w" if write else "r")
        call = f.pwrite if write else f.pread
        futs = [call(buf[o:o + request], size=min(request, buf.numel() - o), file_offset=o)
                for o in range(0, buf.numel(), request)]
        for fut in futs:
            fut.get()
        f.close()
        if write:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        else:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def staged_write(path: Path, buf: torch.Tensor, block: int, threads: int, slots: int) -> float:
    """Device -> pinned slot (async copy on a side stream) -> O_DIRECT pwrite on a thread pool."""
    stream = torch.cuda.Stream()
    pinned = [torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    n = buf.numel()
    with ThreadPoolExecutor(threads) as pool:
        pending: list = [None] * slots
        for k, o in enumerate(range(0, n, block)):
            s = k % slots
            if pending[s] is not None:
                pending[s].result()
            size = min(block, n - o)
            with torch.cuda.stream(stream):
                pinned[s][:size].copy_(buf[o:o + size], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)

            def write(s=s, size=size, o=o, ev=ev):
                ev.synchronize()
                mv = memoryview(pinned[s].numpy())[:size]
                done = 0
                while done < size:
                    done += os.pwrite(fd, mv[done:], o + done)

            pending[s] = pool.submit(write)
        for p in pending:
            if p is not None:
                p.result()
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def staged_read(path: Path, buf: torch.Tensor, block: int, threads: int, slots: int) -> float:
    """O_DIRECT pread into pinned slots on a thread pool -> async copy to the device."""
    stream = torch.cuda.Stream()
    pinned = [torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    n = buf.numel()
    copied: list = [None] * slots

    def read(s: int, o: int, size: int) -> None:
        mv = memoryview(pinned[s].numpy())
        done = 0
        while done < size:
            got = os.preadv(fd, [mv[done:block]], o + done)
            if got == 0:
                raise EOFError(o + done)
            done += got

    with ThreadPoolExecutor(threads) as pool:
        blocks = list(range(0, n, block))
        futs: dict[int, object] = {}
        for k in range(min(slots, len(blocks))):
            futs[k] = pool.submit(read, k % slots, blocks[k], min(block, n - blocks[k]))
        for k, o in enumerate(blocks):
            s = k % slots
            futs.pop(k).result()
            size = min(block, n - o)
            with torch.cuda.stream(stream):
                buf[o:o + size].copy_(pinned[s][:size], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            copied[s] = ev
            nxt = k + slots
            if nxt < len(blocks):
                ev.synchronize()  # the slot is reused by the next read
                futs[nxt] = pool.submit(read, s, blocks[nxt], min(block, n - blocks[nxt]))
    stream.synchronize()
    os.close(fd)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/tiered-io-probe")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    import kvikio
    import kvikio.defaults

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    n = int(args.gb * 1e9) // (16 * MiB) * (16 * MiB)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    back = torch.empty_like(buf)
    info = {"bytes": n, "kvikio": kvikio.__version__, "compat_mode_preferred": kvikio.defaults.is_compat_mode_preferred(),
            "kvikio_threads_default": kvikio.defaults.get("num_threads"),
            "kvikio_task_size_default": kvikio.defaults.get("task_size"),
            "device": torch.cuda.get_device_name()}
    for key in ("auto_direct_io_write", "auto_direct_io_read", "bounce_buffer_size"):
        try:
            info[key] = kvikio.defaults.get(key)
        except Exception as exc:  # noqa: BLE001 - a probe: record what this version has
            info[key] = f"n/a ({exc})"
    print(json.dumps(info), flush=True)
    path = root / "probe.bin"
    writes = {
        "kvikio 1MiB requests, defaults": lambda: kvikio_io(path, buf, MiB, None, None, None, True),
        "kvikio 256MiB requests, defaults": lambda: kvikio_io(path, buf, 256 * MiB, None, None, None, True),
        "kvikio 256MiB requests, 4 threads 16MiB tasks": lambda: kvikio_io(path, buf, 256 * MiB, 4, 16 * MiB, None, True),
        "kvikio 256MiB requests, 4 threads 16MiB tasks, direct": lambda: kvikio_io(path, buf, 256 * MiB, 4, 16 * MiB, True, True),
        "pinned D2H + O_DIRECT, 16MiB blocks, 4 threads": lambda: staged_write(path, buf, 16 * MiB, 4, 8),
        "pinned D2H + O_DIRECT, 64MiB blocks, 4 threads": lambda: staged_write(path, buf, 64 * MiB, 4, 8),
    }
    reads = {
        "kvikio 1MiB requests, defaults": lambda: kvikio_io(path, back, MiB, None, None, None, False),
        "kvikio 256MiB requests, defaults": lambda: kvikio_io(path, back, 256 * MiB, None, None, None, False),
        "kvikio 256MiB requests, 4 threads 16MiB tasks": lambda: kvikio_io(path, back, 256 * MiB, 4, 16 * MiB, None, False),
        "kvikio 256MiB requests, 4 threads 16MiB tasks, direct": lambda: kvikio_io(path, back, 256 * MiB, 4, 16 * MiB, True, False),
        "O_DIRECT + pinned H2D, 16MiB blocks, 4 threads": lambda: staged_read(path, back, 16 * MiB, 4, 8),
        "O_DIRECT + pinned H2D, 64MiB blocks, 4 threads": lambda: staged_read(path, back, 64 * MiB, 4, 8),
    }
    result = {"info": info, "write_gbps": {}, "read_gbps": {}, "cache_dropped": True}
    for rep in range(2):
        for name, fn in writes.items():
            try:
                gbps = n / fn() / 1e9
            except Exception as exc:  # noqa: BLE001
                gbps = f"failed: {exc!r}"
            result["write_gbps"].setdefault(name, []).append(gbps if isinstance(gbps, str) else round(gbps, 3))
            print(f"write {name}: {gbps}", flush=True)
        for name, fn in reads.items():
            result["cache_dropped"] &= drop_caches()
            back.zero_()
            try:
                gbps = n / fn() / 1e9
                ok = bool(torch.equal(back, buf))
            except Exception as exc:  # noqa: BLE001
                gbps, ok = f"failed: {exc!r}", False
            result["read_gbps"].setdefault(name, []).append(gbps if isinstance(gbps, str) else round(gbps, 3))
            print(f"read {name}: {gbps} (equal: {ok})", flush=True)
    path.unlink(missing_ok=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
