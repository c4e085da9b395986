"""``codec: auto`` on the fast tier: which codec a save uses, measured on the state being saved.

The measurements are `tiered.observe.probe`'s and the decision `tiered.policy.choose_codec`'s; this
module decides when to measure (at `Engine.reserve`, or after the first save is durable) so that
measuring neither competes with a save nor delays one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from tiered import threads
from tiered.codecs import get_codec_class
from tiered.config import AUTO, CODEC_NAMES
from tiered.gpu.recode import GpuRecoder
from tiered.observe.probe import Raw, Sample, describe_samples, measure, sample_positions, tier_bandwidth
from tiered.policy import CodecSample, choose_codec
from tiered.units import format_rate

log = logging.getLogger("tiered")
OBSERVE_BYTES = 1 << 30
"""A first save that stores this much caps the fast tier's probed rate with its own."""
FULL_BATCH_ROOM = 8
"""A state smaller than a full batch is measured at a full batch where the GPU has this many
times its memory free; else at its own size (`FastTierCodec`)."""


class FastTierCodec:
    """``codec: auto`` on the fast tier. Until measured, saves use ans where GPU codecs exist and
    zstd elsewhere; `after_save` copies a sample of the first save (GPU tensors when there are
    any: they decide; a few MiB, copied on the training stream after the snapshot) and a thread
    decides from it once that save is durable, so the measurement neither competes with the
    save nor delays it. The decision applies from the next save on. A pinned codec is used as is.

    On a GPU the measurement runs beside training, so it takes little. A state of at least one
    full batch of chunks gives the save codec's throughput from the first save itself (its waves
    timed on the GPU: `tiered.gpu.waves.EncodeClock`); every GPU codec's ratio, and the other
    codecs' throughput, come from the sample encoded as one batch of its own on a stream of its
    own (~2 × the sample's bytes of GPU memory). That throughput is a lower bound (16 chunks keep
    fewer of the GPU's units busy than a save's hundreds), so the policy leans toward the codec
    the saves already run; pin `codec` where a full batch should decide (`scripts/bench.py`
    prints each GPU codec's full-batch throughput). A smaller state is measured at a full batch
    where `FULL_BATCH_ROOM` times its memory is free, else at the batch its own saves run.
    Before, a 256-chunk batch of every codec took ~530 MiB of new GPU memory and ~300 ms of the
    step beside it.

    `Engine.reserve` decides at start-up instead (`at_reserve`), where every codec is measured at
    a full batch if the GPU has `FULL_BATCH_ROOM` times its memory free (its memory is given
    back before training's); the first save then measures nothing, which had made one training
    step 11-26 ms longer where that save became durable. A first save that stores
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
