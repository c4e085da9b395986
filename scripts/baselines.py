"""What scripts/bench.py measures tiered against, on the same state and the same disk, in one run.

- ceilings: multi-threaded O_DIRECT write and read bandwidth of the benchmark's disk, pinned
  device-to-host copy bandwidth, each GPU codec's standalone encode throughput;
- rows: `torch.save`, DCP `save`, DCP `async_save`, and the NVIDIA blog's pipeline (compress each
  tensor separately with nvCOMP ANS, copy it to the host, write).

Every row reports the training stall (how long the call blocks the loop, GPU work included),
time to durable (fsync'd), bytes written, and where it applies a cold restore into the state's
tensors. Timings are taken here and printed; nothing here asserts a time.
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def fsync_file(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            fsync_file(os.path.join(d, f))


def dir_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


# --- ceilings ------------------------------------------------------------------------------
def disk_ceilings(root: Path, nbytes: int, threads: int = 4, block: int = 16 << 20, copy: bool = False) -> dict:
    """O_DIRECT write (then fsync) and read bandwidth of the disk under `root`, `threads` threads
    each on its own range of one file, `block`-sized requests. Buffered I/O where O_DIRECT is
    refused (reported). With `copy`, also `read_while_writing_gbps`: the file read while as many
    bytes are written to a second one (`_copy_time`), with `threads` readers and writers and with
    twice as many, the faster. A copy between two tiers on one disk both reads and writes it; but
    this is no bound on one: on the lent H100 machines' virtual disk tiered's own copy went faster
    (0.9-1.2 GB/s against 0.87-0.95)."""
    import mmap

    root.mkdir(parents=True, exist_ok=True)
    path = root / "ceiling.bin"
    unit = (2 if copy else 1) * threads * block  # whole blocks per thread, at least one
    nbytes = max(unit, nbytes - nbytes % unit)
    per = nbytes // threads
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]
    for b in bufs:
        b.write(os.urandom(block))
    direct = bool(_O_DIRECT)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
    except OSError:
        fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), False
    os.ftruncate(fd, nbytes)

    def run(fn: Callable[[int, memoryview, int], Any], fd: int) -> float:
        def worker(i: int) -> None:
            view = memoryview(bufs[i])
            for off in range(i * per, (i + 1) * per, block):
                fn(fd, view, off)

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - t0

    try:
        t_write = run(lambda fd, v, off: os.pwrite(fd, v, off), fd)
        t0 = time.perf_counter()
        os.fsync(fd)
        t_write += time.perf_counter() - t0
    finally:
        os.close(fd)
    rflags = os.O_RDONLY | (_O_DIRECT if direct else 0)
    fd = os.open(path, rflags)
    t_copy = None
    try:
        t_read = run(lambda fd, v, off: os.preadv(fd, [v], off), fd)
        if copy:
            t_copy = min(_copy_time(fd, root / "copy.bin", nbytes, n, block, direct) for n in (threads, 2 * threads))
    finally:
        os.close(fd)
        path.unlink()
        for b in bufs:
            b.close()
    out = {"write_gbps": round(nbytes / t_write / 1e9, 3), "read_gbps": round(nbytes / t_read / 1e9, 3),
           "bytes": nbytes, "threads": threads, "block_mib": block >> 20, "o_direct": direct}
    if t_copy is not None:
        out["read_while_writing_gbps"] = round(nbytes / t_copy / 1e9, 3)
    return out


def _copy_time(src: int, dst_path: Path, nbytes: int, threads: int, block: int, direct: bool) -> float:
    """Seconds to read `nbytes` of file `src` while writing as many to a new file on the same
    disk, `threads` threads reading and as many writing at once, `block`-sized requests, then
    fsync."""
    import mmap

    dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (_O_DIRECT if direct else 0), 0o644)
    bufs = [mmap.mmap(-1, block) for _ in range(2 * threads)]
    per = nbytes // threads

    def reader(i: int) -> None:
        view = memoryview(bufs[i])
        for off in range(i * per, (i + 1) * per, block):
            os.preadv(src, [view], off)

    def writer(i: int) -> None:
        view = memoryview(bufs[threads + i])
        for off in range(i * per, (i + 1) * per, block):
            os.pwrite(dst, view, off)

    try:
        ts = [threading.Thread(target=fn, args=(i,)) for fn in (reader, writer) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        os.fsync(dst)
        return time.perf_counter() - t0
    finally:
        os.close(dst)
        dst_path.unlink()
        for b in bufs:
            b.close()


def d2h_pinned_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return round(nbytes / (time.perf_counter() - t0) / 1e9, 2)


def gpu_codec_gbps(state_tensors: list[torch.Tensor], chunk_size: int = 1 << 20, chunks: int = 256) -> dict:
    """Each GPU codec's encode throughput on one batch of `chunks` chunks of the state's own fp32
    tensors (tiered's batched path, timed with CUDA events)."""
    from tiered.codecs import get_codec_class
    from tiered.config import Budgets, ZstdSettings
    from tiered.gpu.device import GpuDevice
    from tiered.gpu.recode import GpuRecoder
    from tiered.stage.pools import HostPool

    pieces = []
    for t in state_tensors:
        if t.is_cuda and t.dtype == torch.float32 and t.numel() * 4 >= chunk_size:
            flat = t.reshape(-1).view(torch.uint8)
            pieces += [flat[k:k + chunk_size] for k in range(0, flat.numel() - chunk_size + 1, chunk_size)]
        if len(pieces) >= chunks:
            break
    pieces = pieces[:chunks]
    dev = GpuRecoder(GpuDevice(torch.cuda.current_device(), chunk_size, Budgets(pack_buffer=chunks * chunk_size),
                               ZstdSettings(), HostPool(64 << 20, 4096)))
    out = {}
    for name in ("ans", "zstd"):
        seconds, stored = dev.measure_encode(pieces, get_codec_class(name).spec_for(torch.float32))
        out[name] = {"encode_gbps": round(len(pieces) * chunk_size / seconds / 1e9, 1),
                     "saved_pct": round(100 * (1 - stored / (len(pieces) * chunk_size)), 2)}
    return out


# --- rows ----------------------------------------------------------------------------------
def _row(stall: float, durable: float, stored: int, raw: int, restore_s: float | None, exact: bool | None,
         note: str = "") -> dict:
    return {"stall_ms": round(1e3 * stall, 1), "durable_s": round(durable, 3), "stored_bytes": stored,
            "saved_pct": round(100 * (1 - stored / raw), 2), "restore_s": None if restore_s is None else round(restore_s, 3),
            "restore_bit_exact": exact, "note": note}


def torch_save_row(state: dict, template: dict, root: Path, device: str, raw: int, drop_caches, same) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "state.pt"
    _sync(device)
    t0 = time.perf_counter()
    torch.save(state, path)
    fsync_tree(root)
    elapsed = time.perf_counter() - t0
    drop_caches()
    t0 = time.perf_counter()
    loaded = torch.load(path, map_location=device, weights_only=True)
    _sync(device)
    restore = time.perf_counter() - t0
    row = _row(elapsed, elapsed, path.stat().st_size, raw, restore, same(state["model"], loaded["model"]),
               "synchronous: the call is the stall")
    shutil.rmtree(root, ignore_errors=True)
    return row


def dcp_rows(state: dict, template: Callable[[], dict], root: Path, device: str, raw: int, drop_caches, same) -> dict:
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    rows = {}
    _sync(device)
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(root / "sync"))
    elapsed = time.perf_counter() - t0
    target = template()
    drop_caches()
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=str(root / "sync"))
    _sync(device)
    restore = time.perf_counter() - t0
    rows["dcp_save"] = _row(elapsed, elapsed, dir_bytes(root / "sync"), raw, restore, same(state["model"], target["model"]),
                            "synchronous")
    _sync(device)
    t0 = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=str(root / "async"))
    stall = time.perf_counter() - t0
    fut.result()
    durable = time.perf_counter() - t0
    rows["dcp_async_save"] = _row(stall, durable, dir_bytes(root / "async"), raw, None, None,
                                  "stall: copy to host memory (allocated per call) before returning")
    shutil.rmtree(root, ignore_errors=True)
    return rows


def blog_row(state_tensors: list[torch.Tensor], root: Path, raw: int) -> dict:
    """The blog pipeline: per tensor, nvCOMP ANS (default settings) on the GPU, copy the compressed
    buffer to the host, write; fsync at the end. All synchronous."""
    import numpy as np
    from nvidia import nvcomp

    root.mkdir(parents=True, exist_ok=True)
    codec = nvcomp.Codec(algorithm="ANS")
    path = root / "blog.bin"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stored = 0
    with open(path, "wb") as f:
        for t in state_tensors:
            if not t.is_cuda or t.numel() == 0:
                continue
            enc = codec.encode(nvcomp.as_array(t.reshape(-1).view(torch.uint8)))
            host = np.asarray(enc.cpu())
            f.write(memoryview(host).cast("B"))
            stored += host.nbytes
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    return _row(elapsed, elapsed, stored, raw, None, None, "per-tensor ANS (nvCOMP defaults), synchronous; restore not built")


# --- S3 ------------------------------------------------------------------------------------
def evict(path: Path) -> None:
    """Drop a file's pages from the page cache (clean pages: no privileges needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _client_cpu() -> tuple[float, float, int]:
    """(user s, system s, minor page faults) of this process so far: what a transfer costs the
    client's CPU (on a small machine, the server shares it)."""
    import resource

    t, r = os.times(), resource.getrusage(resource.RUSAGE_SELF)
    return t.user, t.system, r.ru_minflt


def _cpu_since(start: tuple[float, float, int]) -> dict:
    now = _client_cpu()
    return {"user_s": round(now[0] - start[0], 2), "system_s": round(now[1] - start[1], 2),
            "page_faults": now[2] - start[2]}


def s3_vs_boto3(state: dict, root: Path, codec: str = "zstd", rounds: int = 2) -> dict | None:
    """Upload and download throughput of tiered's S3 tier against plain boto3 moving the same
    bytes to and from the same server (a local SeaweedFS): the state saved with zstd on a local
    tier, then migrated (copied as it is) to S3, and its data file uploaded with `boto3
    upload_file` (64 MiB parts, 8 in flight, as tiered's defaults); back, tiered's copy from S3 to
    a local tier against `download_file`. None where SeaweedFS or boto3 is missing.

    `rounds` pairs of transfers, each of its own step, the order swapped from one pair to the next:
    on the 2-core CPU machine a transfer that went second in a pair ran ~10% faster than the one
    before it, whichever client it was (the server shares the client's cores), so a fixed order
    credited the second client. The rates returned are medians over the rounds, with each pair's
    ratio. `codec`: the local tier's (none where zstandard is not installed: the bytes moved
    differ, the comparison does not)."""
    try:
        import boto3  # noqa: F401 - checked here, used in _s3_transfers
    except ImportError:
        return None
    if shutil.which("weed") is None:
        return None
    from tiered.testing import start_s3

    server = start_s3(root / "seaweedfs")
    try:
        with server.environment():  # the standard AWS chain finds its keys, for tiered and for boto3
            return _s3_transfers(state, root, server.endpoint_url, codec, max(1, rounds))
    finally:
        gc.unfreeze()  # (frozen in _s3_transfers)
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _s3_transfers(state: dict, root: Path, endpoint_url: str, codec: str, rounds: int) -> dict:
    import statistics

    import boto3
    from boto3.s3.transfer import TransferConfig

    import tiered
    from tiered.stage.cpu import WindowBuffers
    from tiered.migrate.migrator import migrate_step
    from tiered.tiers import LocalTier
    from tiered.tiers.s3 import READ_PIECE

    # A session of its own: boto3's default session keeps the first keys it read, and each call
    # of s3_vs_boto3 starts a server with new ones.
    client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    up_cfg = TransferConfig(multipart_chunksize=64 << 20, max_concurrency=8)
    down_cfg = TransferConfig(multipart_chunksize=READ_PIECE, max_concurrency=8)  # as tiered's ranged GETs
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(root / "local"), "codec": codec},
                     {"name": "s3", "kind": "s3", "bucket": "bench", "prefix": "tiered",
                      "endpoint_url": endpoint_url, "region": "us-east-1", "codec": codec}],
           "migration": "external"}
    steps = range(2, 2 + rounds)

    def in_turn(r: int, first: tuple, second: tuple) -> tuple:
        """Round r's pair of (name, transfer) in the order it runs: swapped every other round."""
        return (first, second) if r % 2 == 0 else (second, first)

    def data(step: int) -> Path:
        return root / "local" / f"step_{step:012d}" / "rank_00000.data"

    times: dict[str, list[float]] = {k: [] for k in ("up", "boto3_up", "down", "boto3_down", "boto3_down_fsync")}
    cpu: dict[str, list[dict]] = {"up": [], "boto3_up": []}
    with tiered.Engine.from_config(cfg) as engine:
        manifest = engine.save(1, state).wait()
        for step in steps:
            engine.save(step, state).wait()
        # The objects alive now (torch's and botocore's modules, the state) are kept out of Python's
        # full collections, as the migrator's own process keeps its start-up objects: a full pass
        # over them took 100-230 ms on the 2-core machine, inside whichever transfer it fell in.
        gc.freeze()
        # Step 1 warms both clients up (botocore loads its service model and opens connections on
        # the first calls). Read windows' memory is kept from step to step, as a migrator keeps it.
        local, s3 = engine.get_tier("local"), engine.get_tier("s3")
        buffers = WindowBuffers()
        migrate_step(1, local, s3, codec=None, buffers=buffers)
        client.upload_file(str(data(1)), "bench", "plain/1", Config=up_cfg)

        def tiered_up(step: int) -> None:
            migrate_step(step, local, s3, codec=None, buffers=buffers)

        def boto3_up(step: int) -> None:
            client.upload_file(str(data(step)), "bench", f"plain/{step}", Config=up_cfg)

        for r, step in enumerate(steps):
            for name, fn in in_turn(r, ("up", tiered_up), ("boto3_up", boto3_up)):
                evict(data(step))  # both read the file from the disk, as a migration of a fresh step does
                os.sync()  # (what the last transfer left to write back, the server's writes too, is not this one's)
                cpu0, t0 = _client_cpu(), time.perf_counter()
                fn(step)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(_cpu_since(cpu0))
    # Downloads: tiered-restore's copy S3 -> a local tier (verified, O_DIRECT, fsync'd) against
    # boto3's download_file with the same piece size and concurrency as tiered's ranged GETs, and
    # with an fsync after it (tiered's copy is durable when it returns).
    with tiered.Engine.from_config(cfg) as engine:
        s3 = engine.get_tier("s3")
        back = LocalTier("back", root / "back")
        buffers = WindowBuffers()
        migrate_step(1, s3, back, codec=None, buffers=buffers)
        client.download_file("bench", "plain/1", str(root / "plain-1.data"), Config=down_cfg)

        def tiered_down(step: int) -> None:
            migrate_step(step, s3, back, codec=None, buffers=buffers)

        def boto3_down(step: int) -> None:
            start = time.perf_counter()
            client.download_file("bench", f"plain/{step}", str(root / f"plain-{step}.data"), Config=down_cfg)
            times["boto3_down"].append(time.perf_counter() - start)
            fsync_file(root / f"plain-{step}.data")

        for r, step in enumerate(steps):
            for name, fn in in_turn(r, ("down", tiered_down), ("boto3_down_fsync", boto3_down)):
                os.sync()  # (the warm-up's download is not fsync'd: its write-back is no round's)
                t0 = time.perf_counter()
                fn(step)
                times[name].append(time.perf_counter() - t0)
    n = data(1).stat().st_size

    def mbps(key: str) -> float:
        return round(n / statistics.median(times[key]) / 1e6, 1)

    def pairs(mine: str, theirs: str) -> list[float]:
        return [round(100 * b / a, 1) for a, b in zip(times[mine], times[theirs])]  # tiered's rate as % of boto3's

    return {"bytes": n, "rounds": rounds, "tiered_mbps": mbps("up"), "boto3_mbps": mbps("boto3_up"),
            "tiered_down_mbps": mbps("down"), "boto3_down_mbps": mbps("boto3_down"),
            "boto3_down_fsync_mbps": mbps("boto3_down_fsync"),
            "up_pct_by_round": pairs("up", "boto3_up"), "down_pct_by_round": pairs("down", "boto3_down"),
            "down_fsync_pct_by_round": pairs("down", "boto3_down_fsync"),
            "stored_bytes": manifest.stored_bytes, "tiered_up_cpu": cpu["up"], "boto3_up_cpu": cpu["boto3_up"],
            "note": f"medians of {rounds} rounds, the order swapped each round; tiered: the whole step (data, "
                    "index, manifest, checksums verified); boto3: the data file"}
