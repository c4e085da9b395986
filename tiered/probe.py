"""Measurements behind the codec policy (`tiered.policy` stays pure; this module feeds it).

- **Tier bandwidth**: the tier's configured ``bandwidth``, else a probe that writes
  `PROBE_BYTES` through the tier the way a data file is written (O_DIRECT + fsync, or a
  multipart upload), once per tier location, cached in ``bandwidth.json`` under
  ``$TIERED_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tiered``, i.e. ``~/.cache/tiered``). Delete
  the entry, or the file, to probe again. On the fast tier, a first save that stored at least
  `OBSERVE_BYTES` caps it with its own rate (stored bytes over save() to durable): 64 MiB can
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

from tiered import threads
from tiered.codecs import get_codec, get_codec_class
from tiered.config import AUTO, CODEC_NAMES, LocalTierConfig, PosixTierConfig, S3TierConfig, TierConfig, ZstdSettings
from tiered.gpu_recode import GpuRecoder
from tiered.policy import CodecSample, choose_codec
from tiered.units import format_rate

log = logging.getLogger("tiered")
PROBE_BYTES = 64 << 20
OBSERVE_BYTES = 1 << 30
SAMPLE_CHUNKS = 16
"""Chunks sampled per checkpoint: 16 MiB at the default chunk size, a fraction of a second to
encode with every candidate on a CPU, a few milliseconds on a GPU."""
FULL_BATCH_ROOM = 8
"""A state smaller than a full batch is measured at a full batch where the GPU has this many
times its memory free; else at its own size (`FastTierCodec`)."""
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
    by codec name, as a save measured them: `tiered.gpu_waves.EncodeClock`) stand for the
    sample's throughput of those codecs; the sample still gives their ratio."""
    out = []
    raw = max(sample.raw_bytes, 1)
    for name in names:
        cls = get_codec_class(name)
        todo = [i for i, s in enumerate(sample.stored) if s is None or s[0] != name]
        kept = sum(s[1] for i, s in enumerate(sample.stored) if s is not None and i not in todo)
        on_gpu = gpu is not None and cls.gpu_capable and not (cpu_first and cls.cpu_capable)
        if not todo or name == "none":  # (kept as it is: no encode; on a GPU the copy engines move it: tiered.host_copy)
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


class FastTierCodec:
    """``codec: auto`` on the fast tier. Until measured, saves use ans where GPU codecs exist and
    zstd elsewhere; `after_save` copies a sample of the first save (GPU tensors when there are
    any: they decide; a few MiB, copied on the training stream after the snapshot) and a thread
    decides from it once that save is durable, so the measurement neither competes with the
    save nor delays it. The decision applies from the next save on. A pinned codec is used as is.

    On a GPU the measurement runs beside training, so it takes little. A state of at least one
    full batch of chunks gives the save codec's throughput from the first save itself (its waves
    timed on the GPU: `tiered.gpu_waves.EncodeClock`); every GPU codec's ratio, and the other
    codecs' throughput, come from the sample encoded as one batch of its own on a stream of its
    own (~2 × the sample's bytes of GPU memory). That throughput is a lower bound (16 chunks keep
    fewer of the GPU's units busy than a save's hundreds), so the policy leans toward the codec
    the saves already run; pin `codec` where a full batch should decide (`scripts/bench.py`
    prints each GPU codec's full-batch throughput). A smaller state is measured at a full batch
    where `FULL_BATCH_ROOM` times its memory is free, else at the batch its own saves run.
    Before, a 256-chunk batch of every codec took ~530 MiB of new GPU memory and ~300 ms of the
    step beside it (runs 142-149).

    `Engine.reserve` decides at start-up instead (`at_reserve`), where every codec is measured at
    a full batch if the GPU has `FULL_BATCH_ROOM` times its memory free (its memory is given
    back before training's); the first save then measures nothing, which had made one training
    step 11-26 ms longer where that save became durable (GPU run 273). A first save that stores
    `OBSERVE_BYTES` or more still caps the tier's probed rate with its own, deciding again from
    the same sample without encoding it again.
    """

    def __init__(self, config: Any, tier: Any, workers: Any):
        self.config, self.tier, self.workers = config, tier, workers
        self.pool = workers.pool
        pinned = config.fast_tier.codec
        self.codec = pinned if pinned != AUTO else ("ans" if workers.gpu_ready else "zstd")
        """The codec for the next save."""
        self.pending = pinned == AUTO
        """No decision yet: the next save is sampled."""
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._reserved: tuple[list[CodecSample], float, bool] | None = None
        """What `at_reserve` decided from (its samples, the tier's rate, whether saves pipeline
        encode and write: CPU ones), for the first save to cap that rate with its own (`_recheck`)."""

    def at_reserve(self, plan: Any) -> None:
        """Decide now, at start-up, from a sample of `plan`'s state (what `Engine.reserve` will
        save), where the GPU the sample would be measured on has room for a full batch (else the
        first save is sampled, as without `reserve`)."""
        if not self.pending or self._thread is not None:
            return
        copies, gpu_index, nchunks = self._copies(plan)
        if not copies:
            return
        if gpu_index is not None:
            gpu = self.workers.device(gpu_index)
            if not self._room(gpu):
                return
            torch.cuda.current_stream(gpu_index).synchronize()  # (the copies are made)
        self._decide(copies, None, gpu_index, nchunks, None, None)
        if gpu_index is not None:
            torch.cuda.synchronize(gpu_index)
            torch.cuda.empty_cache()  # the full batch's blocks, cached for its stream, go back to training

    def after_save(self, plan: Any, handle: Any) -> None:
        if self._reserved is not None and not self.config.fast_tier.bandwidth and self._thread is None:
            self._started = time.monotonic()
            self._thread = threads.start(self._recheck, handle, name="tiered-codec-policy")
            return
        if not self.pending or self._thread is not None:
            return
        self._started = time.monotonic()
        copies, gpu_index, nchunks = self._copies(plan)
        if not copies:  # no tensor bytes in this save: sample the next one
            return
        ready = clock = None
        if gpu_index is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(gpu_index))
            device = self.workers.device(gpu_index)
            if nchunks >= device.batch_chunks:
                clock = device.clock_next_stage()
        self._thread = threads.start(self._decide, copies, ready, gpu_index, nchunks, clock, handle,
                                     name="tiered-codec-policy")

    def _copies(self, plan: Any) -> tuple[list[tuple[torch.dtype, Raw]], int | None, int]:
        """(copies of the sample's chunks, the GPU they are on or None, the chunks of the part of
        `plan` sampled): GPU tensors when there are any (they decide), else the CPU ones."""
        chunk_size = self.config.chunk_size
        gpu_index = next(iter(plan.gpu), None)
        plans = plan.gpu[gpu_index] if gpu_index is not None else plan.cpu
        copies = []
        for t, j in sample_positions([p.nbytes for p in plans], chunk_size):
            p = plans[t]
            tensor = plan.tensors[p.index]
            tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
            piece = tensor.reshape(-1).view(torch.uint8)[j * chunk_size:j * chunk_size + p.raw_size(j)]
            copies.append((p.dtype, piece.clone() if piece.is_cuda else piece.numpy().copy()))
        return copies, gpu_index, sum(p.nchunks for p in plans)

    def _recheck(self, handle: Any) -> None:
        """After `at_reserve`'s decision: cap the tier's rate with the first large save's own, and
        decide again from the same samples where that lowers it (no encoding)."""
        reserved, self._reserved = self._reserved, None
        samples, bandwidth, overlap = reserved  # type: ignore[misc]
        try:
            if handle.persisted.exception() is not None:
                self._reserved = reserved  # that save failed: the next one tells
                self._thread = None
                return
            observed = self._observed(handle)
            if observed is None or observed >= bandwidth:
                return
            choice = choose_codec(bandwidth=observed, samples=samples, portable=self.config.fast_tier.portable,
                                  overlap=overlap)
        except Exception as exc:  # noqa: BLE001 - the policy is an optimisation: keep the codec chosen
            log.warning("tiered: codec: auto for tier %r: checking against the first save failed (%r); keeping %s",
                        self.config.fast_tier.name, exc, self.codec)
            return
        if choice != self.codec:
            log.info("tiered: tier %r codec: %s for the next saves (the first save wrote at %s, below the probe's "
                     "%s; %s)", self.config.fast_tier.name, choice, format_rate(observed), format_rate(bandwidth),
                     describe_samples(samples))
            self.codec = choice

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _observed(self, handle: Any) -> float | None:
        """Bytes/s the sampled save reached from save() to durable on this tier, where it stored
        at least OBSERVE_BYTES: a lower bound on the tier's rate (staging is inside it) measured at
        the checkpoint's own scale, where the probe's 64 MiB may have met only a write cache."""
        manifest = handle.persisted.result()
        if handle.tier != self.config.fast_tier.name or manifest.stored_bytes < OBSERVE_BYTES:
            return None
        # (_started is taken after planning: add the planning back)
        elapsed = time.monotonic() - self._started + handle.timings.get("plan_ms", 0.0) / 1e3
        return manifest.stored_bytes / max(elapsed, 1e-9)

    def _room(self, gpu: Any) -> bool:
        """The GPU has room for a full batch's measurement many times over."""
        need = 2 * gpu.batch_chunks * self.config.chunk_size  # (its pack and slab, about)
        return torch.cuda.mem_get_info(gpu.index)[0] >= FULL_BATCH_ROOM * need

    def _small_state_slots(self, gpu: Any, nchunks: int) -> int | None:
        """The batch a state smaller than a full batch is measured at: a full one (None) where
        GPU memory has room for it many times over, else the state's own chunk count."""
        return None if self._room(gpu) else nchunks

    def _decide(self, copies: list[tuple[torch.dtype, Raw]], ready: Any, gpu_index: int | None, nchunks: int,
                clock: Any, handle: Any) -> None:
        cfg = self.config.fast_tier
        try:
            if handle is not None and handle.persisted.exception() is not None:
                self._thread = None  # that save failed: sample the next one
                return
            if ready is not None:
                ready.synchronize()
            sample = Sample()
            for dtype, raw in copies:
                sample.add(dtype, raw)
            gpu = self.workers.device(gpu_index) if gpu_index is not None else None
            names = [n for n in CODEC_NAMES if gpu is not None or get_codec_class(n).cpu_capable]
            stream = torch.cuda.Stream(gpu_index) if gpu_index is not None else None
            slots = None
            if gpu is not None:
                slots = len(copies) if clock is not None else self._small_state_slots(gpu, nchunks)
            samples = measure(sample, names, pool=self.pool, settings=self.config.zstd,
                              gpu=GpuRecoder(gpu) if gpu is not None else None, slots=slots,
                              stream=stream, rates=clock.rates() if clock is not None else None)
            bandwidth = tier_bandwidth(cfg, self.tier)
            if not cfg.bandwidth and handle is not None:  # a configured bandwidth wins
                bandwidth = min(bandwidth, self._observed(handle) or bandwidth)
            # GPU saves: compression is the snapshot (encode, then write); CPU saves pipeline them.
            choice = choose_codec(bandwidth=bandwidth, samples=samples, portable=cfg.portable, overlap=gpu is None)
        except Exception as exc:  # noqa: BLE001 - the policy is an optimisation: keep the usual codec
            log.warning("tiered: codec: auto for tier %r: measuring failed (%r); keeping %s", cfg.name, exc,
                        self.codec)
            self.pending = False
            return
        log.info("tiered: tier %r codec: %s for the next saves (policy: tier writes %s; %s)%s", cfg.name, choice,
                 format_rate(bandwidth), describe_samples(samples), "" if handle is not None else "; at reserve()")
        if handle is None:
            self._reserved = samples, bandwidth, gpu is None
        self.codec, self.pending = choice, False


def describe_samples(samples: Sequence[CodecSample]) -> str:
    return ", ".join(f"{s.name} {format_rate(s.throughput) if s.throughput < _INSTANT / 10 else 'free'} "
                     f"{100 * (1 - s.ratio):.1f}% saved" for s in samples)
