"""Migration throughput on this machine: one 256 MB step copied local -> shared (a POSIX tier),
recompressed to zstd (source codec none, or ans from GPU tensors where a GPU and nvCOMP are
present: decoded on the GPU) or kept (source zstd), as 8 or 2,000 tensors, with the CPU threads a
background migrator uses (or as many as given), beside the zstd encode ceiling of those threads on
the same data, and the same run's O_DIRECT write and read ceilings of the disk under `--dir` (4
threads of 16 MiB requests: issue 15's target for a plain copy is 90% of the write ceiling), and
its rate reading one file while writing another (both tiers of this probe are on that disk, so a
copy reads and writes it at once; not a bound on the copy, see `baselines.disk_ceilings`).

    python3 scripts/migrate_probe.py [THREADS] [--dir D] [--src-dir S] [--mb 256] [--paths none,zstd,ans] [--rounds 1]
                                     [--interleave]

`--interleave` (with `--rounds`): a plain copy is also set against write probes of its own size
taken between its rounds, not only against the one at the start of the run; a recompression,
against zstd's rate on its chunks measured between its rounds (that rate moved 0.995-1.340 GB/s
within minutes on a 16-core GPU host, GPU run 332), not only once after them.

`--src-dir /dev/shm/probe` puts the source (local) tier in memory: a copy then reads no disk, and
a plain copy's rate is set against the destination disk's write ceiling alone.

`--mb 24000 --paths ans` is a 24 GB step of GPU tensors (issue 14's scale) on the default hop.
"""
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from baselines import disk_ceilings, evict  # noqa: E402
import tiered  # noqa: E402
from tiered.codecs import get_codec  # noqa: E402
from tiered.config import ZstdSettings  # noqa: E402
from tiered.cpu import WindowBuffers  # noqa: E402
from tiered.format import CodecSpec  # noqa: E402
from tiered.migrator import background_threads, make_gpu_recoder, migrate_step  # noqa: E402
from tiered.runtime import gpu_stack_available  # noqa: E402


def _opt(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


root = _opt("--dir", "./.tiered/migrate-probe")
total_mb = int(_opt("--mb", "256"))
paths = _opt("--paths", "none,zstd,ans").split(",")
src_root = _opt("--src-dir", f"{root}/local")
rounds = int(_opt("--rounds", "1"))
"""Steady-state migrations after the first; their median is reported. (Each round set against a
write-ceiling probe of its own, taken just before it, was tried and left out: right after a probe
of 1 GB the copies ran 63-99% of it, and the same copies ran 86-93% of the start-of-run probe;
docs/benchmarks.md, session 29.)"""
interleave = "--interleave" in sys.argv
"""Plain copies: a write-ceiling probe of the bytes a copy writes before each steady round, the
probes' median set against the rounds' (a probe and a copy alternate, so each follows the other
as often, and the disk's drift over the run falls on both). The start-of-run probe is one
moment of a disk whose write rate moved by a third within minutes (GPU run 285: 2.13 -> 1.29
GB/s). Recompressions: zstd's rate on the state's chunks (`zstd_ceiling`) before each steady
round, set against the rounds' median the same way."""



BUFFERS = WindowBuffers()
"""Read windows kept from one migration to the next, as a migrator keeps them from step to step
(fresh memory costs a page fault per 4 KiB: ~65,000-97,000 of them, 0.2-0.3 s, for a 256 MB step
on the 2-core CPU machine)."""


def run(src_codec: str, ntensors: int, total_mb: int, threads: int) -> tuple[float, float, float, list[float]]:
    """GB/s of raw state migrated: the step's first migration, and the median of `rounds` more (the
    steady state of a migrator: its buffers kept; the step deleted from the target in between),
    each with the source's data file out of the page cache; the bytes the target's data files
    hold per raw byte (what a disk writes); and, with `--interleave`, the probes taken between
    the rounds (GB/s; see `interleave`): the disk's write ceiling for a plain copy, zstd's rate on
    this state's chunks for a recompression."""
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(src_root, ignore_errors=True)
    cfg = {"migration": "external", "tiers": [{"name": "local", "kind": "local", "path": src_root, "codec": src_codec},
           {"name": "shared", "kind": "posix", "path": f"{root}/shared", "codec": "zstd"}]}
    dev = "cuda" if src_codec == "ans" else "cpu"  # ANS is a GPU codec: a GPU's fast tier
    g = torch.Generator(device=dev).manual_seed(0)
    per = (total_mb << 20) // 4 // ntensors
    state = {f"t{i}": (torch.randn(per, generator=g, device=dev) * 0.02) for i in range(ntensors)}
    with tiered.Engine.from_config(cfg) as e:
        e.save(1, state).wait()
        cat = e.catalog
        raw = sum(t.numel() * 4 for t in state.values())
        os.sync()
        rates, probes = [], []
        with ThreadPoolExecutor(threads) as pool:
            for attempt in range(1 + rounds):
                if attempt:
                    probing = interleave and src_codec == "zstd"
                    written = sum(f.stat().st_size for f in Path(root, "shared").rglob("*.data")) if probing else 0
                    cat.get("shared").delete(1)
                    os.sync()
                    if probing:
                        probes.append(disk_ceilings(Path(root) / "ceiling", written)["write_gbps"])
                        shutil.rmtree(Path(root) / "ceiling", ignore_errors=True)
                    elif interleave:  # recompressed: zstd's own rate on this state's chunks, just before
                        probes.append(zstd_ceiling(chunk_bytes(ntensors)))
                for f in Path(src_root).rglob("*.data"):
                    evict(f)  # (read from the disk, as a fresh step is; a buffered read would find it cached)
                t0 = time.perf_counter()
                migrate_step(1, cat.get("local"), cat.get("shared"), codec="zstd", settings=ZstdSettings(), pool=pool,
                             gpu=gpu, buffers=BUFFERS)
                rates.append(raw / (time.perf_counter() - t0) / 1e9)
        stored = sum(f.stat().st_size for f in Path(root, "shared").rglob("*.data"))
    if probes:
        print(f"    rounds (GB/s of state; each after the {'write' if src_codec == 'zstd' else 'zstd'} probe "
              f"beside it): " + ", ".join(f"{r:.2f} after {p:.2f}" for r, p in zip(rates[1:], probes)), flush=True)
    return rates[0], statistics.median(rates[1:]), stored / raw, probes


threads = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else background_threads()


CEILING_DATA = (torch.randn(64 << 18) * 0.02).numpy().view("uint8")
"""64 MiB of values like the states' (one array for every ceiling measured)."""


def zstd_ceiling(chunk: int) -> float:
    """GB/s of zstd (byte shuffle) encoding `CEILING_DATA` in chunks of `chunk` bytes on
    `threads` threads: the best of three. A state of many small tensors is stored in small chunks
    (one per tensor), which encode slower than 1 MiB ones (on the 2-core CPU machine, 134 KB
    chunks 0.297 GB/s against 0.347), so each state's copy is set against its own chunks' rate."""
    codec = get_codec(CodecSpec.of("zstd", shuffle=4), ZstdSettings())
    x = CEILING_DATA
    chunks = [memoryview(x[i:i + chunk]) for i in range(0, len(x) - chunk + 1, chunk)]
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(codec.encode_chunk, chunks))
            best = max(best, len(chunks) * chunk / (time.perf_counter() - t0) / 1e9)
    return best


def chunk_bytes(ntensors: int) -> int:
    """The chunk size of `run`'s state of `ntensors` fp32 tensors: a tensor, or 1 MiB."""
    return min(1 << 20, (total_mb << 20) // 4 // ntensors * 4)


print(f"threads {threads}: zstd encode ceiling {zstd_ceiling(1 << 20):.3f} GB/s (1 MiB chunks)")
disk = disk_ceilings(Path(root) / "ceiling", min(total_mb << 20, 1 << 30), copy=True)
shutil.rmtree(Path(root) / "ceiling", ignore_errors=True)
print(f"disk under {root}: O_DIRECT write {disk['write_gbps']} GB/s, read {disk['read_gbps']} GB/s, "
      f"reading while writing {disk['read_while_writing_gbps']} GB/s ({disk['threads']} threads, "
      f"{disk['block_mib']} MiB, O_DIRECT {disk['o_direct']})")
gpu = make_gpu_recoder(tiered.config.load_config(None)) if gpu_stack_available() else None
for src in paths:
    if src == "ans" and gpu is None:
        print("   ans -> zstd: skipped (needs a GPU with nvCOMP)")
        continue
    for n in (8, 2000):
        first, steady, ratio, probes = run(src, n, total_mb, threads)
        line = (f"  {src:>4} -> zstd, {n} tensors, {total_mb} MB: {first:.3f} GB/s first, {steady:.3f} GB/s again"
                + (f" (median of {rounds})" if rounds > 1 else ""))
        if src != "zstd":  # recompressed: against the zstd rate on chunks of this state's size
            chunk = chunk_bytes(n)
            ceiling = zstd_ceiling(chunk)
            line += f" ({100 * steady / ceiling:.0f}% of {ceiling:.3f} GB/s, zstd on {chunk} B chunks)"
            if probes:
                ceiling = statistics.median(probes)
                line += (f"; {100 * steady / ceiling:.0f}% of the median of {len(probes)} zstd probes between the "
                         f"rounds ({ceiling:.3f} GB/s; {min(probes):.3f}-{max(probes):.3f})")
        else:  # kept: the bytes written against the disk's write ceiling
            line += (f" of state; it writes {ratio:.3f} B per byte of state: {steady * ratio:.3f} GB/s written, "
                     f"{100 * steady * ratio / disk['write_gbps']:.0f}% of the O_DIRECT write ceiling")
            if probes:
                ceiling = statistics.median(probes)
                line += (f"; {100 * steady * ratio / ceiling:.0f}% of the median of {len(probes)} write probes "
                         f"between the rounds ({ceiling:.3f} GB/s; {min(probes):.3f}-{max(probes):.3f})")
        print(line, flush=True)
shutil.rmtree(root, ignore_errors=True)
shutil.rmtree(src_root, ignore_errors=True)
