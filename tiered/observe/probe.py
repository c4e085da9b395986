"""Measurements behind the codec policy (`tiered.policy` stays pure; this module feeds it).

- **Tier bandwidth**: the tier's configured ``bandwidth``, else a probe that writes
  `PROBE_BYTES` through the tier the way a data file is written (O_DIRECT + fsync, or a
  multipart upload), once per tier location, cached in ``bandwidth.json`` under
  ``$TIERED_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tiered``, i.e. ``~/.cache/tiered``). Delete
  the entry, or the file, to probe again. On the fast tier, a first save that stored at least
  `tiered.save.fast_codec.OBSERVE_BYTES` caps it with its own rate (stored bytes over save() to durable): 64 MiB can
  land in a device's write cache and read as a rate the disk does not keep at scale.
- **Codec samples**: up to `SAMPLE_CHUNKS` chunks spread over a checkpoint's tensors (weighted by
  size), encoded with each candidate codec the way the caller would encode them (CPU codecs on
  the codec thread pool; GPU codecs through `GpuDevice.encode`). Throughput is raw bytes over wall
  time, ratio is stored bytes over raw bytes.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch

from tiered.codecs import get_codec, get_codec_class
from tiered.config import LocalTierConfig, PosixTierConfig, S3TierConfig, TierConfig, ZstdSettings
from tiered.policy import CodecSample
from tiered.units import format_rate

log = logging.getLogger("tiered")
PROBE_BYTES = 64 << 20
SAMPLE_CHUNKS = 16
"""Chunks sampled per checkpoint: 16 MiB at the default chunk size, a fraction of a second to
encode with every candidate on a CPU, a few milliseconds on a GPU."""
_INSTANT = 1e15  # bytes/s of an encode that costs nothing (a plain copy of chunks kept as they are)
_cache_lock = threading.Lock()


def cache_dir() -> Path:
    if os.environ.get("TIERED_CACHE_DIR"):
        return Path(os.environ["TIERED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiered"


def tier_location(cfg: TierConfig) -> str:
    """What identifies a tier's storage across runs and configs (the bandwidth cache key)."""
    if isinstance(cfg, (LocalTierConfig, PosixTierConfig)):
        return f"{cfg.kind}:{os.path.realpath(cfg.path)}"
    if isinstance(cfg, S3TierConfig):
        return f"s3:{cfg.endpoint_url or 'aws'}/{cfg.bucket}/{cfg.prefix}"
    raise TypeError(f"unknown tier config {type(cfg).__name__}")


def tier_bandwidth(cfg: TierConfig, tier: Any, nbytes: int = PROBE_BYTES) -> float:
    """Bytes/s the policy assumes for a tier: configured, cached, or probed now (and cached)."""
    if cfg.bandwidth:
        return cfg.bandwidth
    key, path = tier_location(cfg), cache_dir() / "bandwidth.json"
    with _cache_lock:
        cached = _read_cache(path).get(key)
        if isinstance(cached, dict) and isinstance(cached.get("bytes_per_s"), (int, float)) and cached["bytes_per_s"] > 0:
            return float(cached["bytes_per_s"])
        bandwidth = tier.probe_bandwidth(nbytes)
        log.info("tiered: tier %r writes at %s (probed with %d MiB; cached in %s)", cfg.name,
                 format_rate(bandwidth), nbytes >> 20, path)
        entries = _read_cache(path)
        entries[key] = {"bytes_per_s": bandwidth, "probed": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:  # a read-only home: probe again next run
            log.warning("tiered: cannot cache the probed bandwidth in %s: %s", path, exc.strerror)
    return bandwidth


def cached_bandwidth(cfg: TierConfig) -> float | None:
    """The tier's configured bandwidth, or the one probed and cached earlier; None: never probed."""
    if cfg.bandwidth:
        return cfg.bandwidth
    entry = _read_cache(cache_dir() / "bandwidth.json").get(tier_location(cfg))
    rate = entry.get("bytes_per_s") if isinstance(entry, dict) else None
    return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def sample_positions(sizes: Sequence[int], chunk_size: int, n: int = SAMPLE_CHUNKS) -> list[tuple[int, int]]:
    """(tensor number, chunk number) of up to `n` chunks spread evenly over all tensors' bytes, so
    big tensors get proportionally more samples. Deterministic."""
    counts = [-(-s // chunk_size) for s in sizes]
    total = sum(counts)
    if not total:
        return []
    picks = sorted({int((k + 0.5) * total / min(n, total)) for k in range(min(n, total))})
    out, base, t = [], 0, 0
    for p in picks:
        while p >= base + counts[t]:
            base += counts[t]
            t += 1
        out.append((t, p - base))
    return out


Raw = Union[np.ndarray, torch.Tensor]
"""A chunk's raw bytes: a uint8 numpy array, or a 1-D uint8 tensor (kept on its GPU)."""


class Sample:
    """Raw sample chunks of one checkpoint, with what each one is stored as now (if stored)."""

    def __init__(self) -> None:
        self.chunks: list[tuple[torch.dtype, Raw]] = []
        self.stored: list[tuple[str, int] | None] = []
        """(codec name, stored size) of each chunk where it comes from a stored checkpoint."""

    def add(self, dtype: torch.dtype, raw: Raw, stored: tuple[str, int] | None = None) -> None:
        self.chunks.append((dtype, raw))
        self.stored.append(stored)

    @property
    def raw_bytes(self) -> int:
        return sum(_nbytes(raw) for _, raw in self.chunks)


def _nbytes(raw: Raw) -> int:
    return raw.numel() if isinstance(raw, torch.Tensor) else len(raw)


def measure(sample: Sample, names: Sequence[str], *, pool: ThreadPoolExecutor, settings: ZstdSettings,
            gpu: Any = None, cpu_first: bool = False, slots: int | None = None, stream: Any = None,
            rates: Mapping[str, float] | None = None) -> list[CodecSample]:
    """Each codec in `names` on `sample`: encoded on the GPU (`gpu`: a GpuRecoder) when the codec
    runs there and a GPU is given, else on the CPU pool; with `cpu_first`, codecs that have a CPU
    encoder are measured on the CPU (where the migrator runs them). Chunks already stored with a
    codec are kept as they are (no encode time, their stored size).

    GPU encodes run on `stream` (default the device's own), the sample repeated to `slots`
    chunks (default a full batch: `GpuRecoder.measure_encode`). `rates` (bytes/s of GPU encode,
    by codec name, as a save measured them: `tiered.gpu.waves.EncodeClock`) stand for the
    sample's throughput of those codecs; the sample still gives their ratio."""
    out = []
    raw = max(sample.raw_bytes, 1)
    for name in names:
        cls = get_codec_class(name)
        todo = [i for i, s in enumerate(sample.stored) if s is None or s[0] != name]
        kept = sum(s[1] for i, s in enumerate(sample.stored) if s is not None and i not in todo)
        on_gpu = gpu is not None and cls.gpu_capable and not (cpu_first and cls.cpu_capable)
        if not todo or name == "none":  # (kept as it is: no encode; on a GPU the copy engines move it: tiered.stage.host_copy)
            seconds, stored = 0.0, sum(_nbytes(sample.chunks[i][1]) for i in todo)
        elif on_gpu:
            seconds, stored = _encode_gpu(gpu, [sample.chunks[i] for i in todo], name, slots, stream)
            if rates and rates.get(name):
                seconds = sum(_nbytes(sample.chunks[i][1]) for i in todo) / rates[name]
        elif cls.cpu_capable:
            seconds, stored = _timed(lambda: _encode_cpu([sample.chunks[i] for i in todo], name, pool, settings))
        else:
            continue
        out.append(CodecSample(name=name, throughput=raw / seconds if seconds > 0 else _INSTANT,
                               ratio=(kept + stored) / raw, cpu_decodable=cls.cpu_capable))
    return out


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    fn()  # warm-up: first calls set up codec state (nvCOMP managers, zstd contexts)
    t0 = time.perf_counter()
    stored = fn()
    return time.perf_counter() - t0, stored


def _encode_cpu(chunks: list[tuple[torch.dtype, Raw]], name: str, pool: ThreadPoolExecutor,
                settings: ZstdSettings) -> int:
    cls = get_codec_class(name)
    host = [(dtype, raw.cpu().numpy() if isinstance(raw, torch.Tensor) else raw) for dtype, raw in chunks]

    def one(item: tuple[torch.dtype, np.ndarray]) -> int:
        dtype, raw = item
        return len(get_codec(cls.spec_for(dtype), settings).encode_chunk(memoryview(raw)))

    return sum(pool.map(one, host))


def _encode_gpu(gpu: Any, chunks: list[tuple[torch.dtype, Raw]], name: str, slots: int | None = None,
                stream: Any = None) -> tuple[float, int]:
    """(seconds, stored bytes): one batched encode per dtype on the GPU (`gpu.measure_encode`)."""
    cls = get_codec_class(name)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for dtype, raw in chunks:
        by_dtype.setdefault(dtype, []).append(raw if isinstance(raw, torch.Tensor) else torch.from_numpy(raw))
    seconds, stored = 0.0, 0
    for dtype, raws in by_dtype.items():
        s, n = gpu.measure_encode(raws, cls.spec_for(dtype), slots=slots, stream=stream)
        seconds, stored = seconds + s, stored + n
    return seconds, stored


def describe_samples(samples: Sequence[CodecSample]) -> str:
    return ", ".join(f"{s.name} {format_rate(s.throughput) if s.throughput < _INSTANT / 10 else 'free'} "
                     f"{100 * (1 - s.ratio):.1f}% saved" for s in samples)
