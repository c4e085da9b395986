"""A save's GPU waves between the stager and the writer (`tiered.gpu.device`, `tiered.gpu.write`): the
compressed rows of each wave with their sizes, a drained wave's host copies, the GPU time of a
save's encodes, and the batched encode into rows that encodes outside a save use (`encode_slots`).
Imported only when CUDA is in use.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tiered.codecs.base import Codec, PendingSizes, checked_sizes
from tiered.format.checksum import unsigned
from tiered.gpu import pack as gpu_pack
from tiered.stage.plan import ChunkRef


def encode_slots(codec: Any, srcs: Sequence[torch.Tensor], pack: torch.Tensor, slab: torch.Tensor, stride: int,
                 stream: torch.cuda.Stream, chunk_size: int, packed: bool = False) -> PendingSizes:
    """Pack `srcs` (1-D uint8 on the GPU, at most `chunk_size` bytes each) one per chunk slot of
    `pack` and encode them in one batched call into rows of `stride` bytes of `slab`, on `stream`,
    as a save's wave does; `packed`: `pack` holds them already. For encodes outside a save's waves
    (a device's first run, migration, codec measurement: tiered.gpu.recode)."""
    cs = chunk_size
    for src in srcs:
        if src.numel() > cs:
            raise ValueError(f"chunk of {src.numel()} bytes exceeds chunk_size {cs}")
    if not packed and type(codec).pack is Codec.pack:
        torch._foreach_copy_([pack[k * cs:k * cs + src.numel()] for k, src in enumerate(srcs)], list(srcs))
    elif not packed:
        for k, src in enumerate(srcs):
            codec.pack(pack[k * cs:k * cs + src.numel()], src, cs)
    return codec.encode_batch(stream, cs, pack, [k * cs for k in range(len(srcs))], [src.numel() for src in srcs],
                              slab, [k * stride for k in range(len(srcs))], stride)


class WaveSizes:
    """A wave's compressed sizes, read once, by whichever thread asks first: the writer, or the
    stager before it queues more work on the wave's encode stream.

    nvCOMP reads a batch's sizes after waiting for its whole codec stream, holding the GIL: with
    later waves queued behind it on that stream, every Python thread (training's too) stood still
    until they had run as well (H100: 125 ms behind 150 ms of queued work). So each
    wave is encoded on one of `ENCODE_STREAMS` streams in turn, and a stream gets a new wave only
    once the sizes of its last one are read: nvCOMP never finds work queued behind the batch it
    reads. The wait for the wave's GPU work goes through torch first, which lets the GIL go.

    nvCOMP's read of the sizes is itself a small device-to-host copy, which a GPU's copy engine
    runs after every copy to the host queued before it, and nvCOMP waits for it holding the GIL:
    behind a drain's copies of a large state, 39 ms for 2 GiB queued, ~100 ms of
    a 24 GB save in all (py-spy). So `quiet` (the device's copies issued so far) is
    waited for first, through torch, and the read finds the copy engine free.

    Where the encode left its sizes on the GPU (nvCOMP's C API) and a kernel stored them into
    pinned memory before `ready` (`delivered`: one int64 (2, n) of sizes and statuses per batch,
    `tiered.gpu.pack.deliver`), none of that applies: reading them is waiting for `ready` with
    the GIL let go, whatever the copy engine is doing, and nothing need wait for the read."""

    def __init__(self, pendings: list[tuple[PendingSizes, int]], ready: torch.cuda.Event, device_index: int,
                 quiet: Callable[[], None] | None = None, delivered: list[torch.Tensor] | None = None):
        self._pendings: list[tuple[PendingSizes, int]] | None = pendings
        self.ready = ready
        self._quiet = quiet
        self._delivered = delivered
        self.delivers = delivered is not None
        """The sizes come through pinned memory: no read holds the GIL or waits for the copy engine."""
        self._index = device_index
        self._sizes: list[int] | None = None
        self._error: Exception | None = None
        self._lock = threading.Lock()

    @property
    def read(self) -> bool:
        """The sizes have been read, or reading them failed (nothing queued behind the batch may
        wait for them now)."""
        return self._pendings is None

    def get(self) -> list[int]:
        """The sizes; raises what reading them raised (to every caller)."""
        self.settle()
        if self._error is not None:
            raise self._error
        assert self._sizes is not None
        return self._sizes

    def settle(self) -> None:
        """Read the sizes if no one has; a failure is kept for `get` (the stager settles the
        waves of earlier saves, whose writers report their own failures)."""
        with self._lock:
            if self._pendings is None:
                return
            try:
                self.ready.synchronize()
                if self._delivered is not None:
                    self._sizes = self._read_delivered(self._pendings, self._delivered)
                    return
                if self._quiet is not None:
                    self._quiet()
                out: list[int] = []
                for pending, n in self._pendings:
                    # On the writer thread, whose current device is cuda:0 whatever GPU this rank
                    # uses: nvCOMP's batch must be read on its own device.
                    with torch.cuda.device(self._index):
                        got = pending.sizes()
                    if len(got) != n:
                        raise RuntimeError(f"codec returned {len(got)} sizes for {n} chunks")
                    out.extend(got)
                self._sizes = out
            except Exception as exc:  # noqa: BLE001 - kept for the wave's own writer (`get`)
                self._error = exc
            finally:  # (the batches hold the slab and pack buffers: let them go once read)
                self._pendings = self._delivered = None

    @staticmethod
    def _read_delivered(pendings: list[tuple[PendingSizes, int]], delivered: list[torch.Tensor]) -> list[int]:
        out: list[int] = []
        for (_, n), host in zip(pendings, delivered):
            got = host.numpy()
            if got.shape != (2, n):
                raise RuntimeError(f"codec delivered {got.shape[1]} sizes for {n} chunks")
            out.extend(checked_sizes(got[0], got[1]))
        return out


def deliver_sizes(pendings: Sequence[tuple[Any, int]]) -> list[torch.Tensor] | None:
    """On the current stream, after a wave's encode: where every batch left its sizes on the GPU,
    a kernel stores them into pinned memory (`WaveSizes`); None where they are read otherwise."""
    if not gpu_pack.can_deliver() or not all(hasattr(p, "device_sizes") for p, _ in pendings):
        return None
    out = []
    try:
        for p, n in pendings:
            host = torch.empty((2, n), dtype=torch.int64, pin_memory=True)
            gpu_pack.deliver(p.device_sizes, p.statuses, host)
            out.append(host)
    except Exception:  # noqa: BLE001 - logged once by deliver; this wave's sizes are copied instead
        torch.cuda.current_stream().synchronize()  # (no kernel launched before may still store into `out`)
        return None
    return out


ENCODE_STREAMS = 4
"""Streams a device's waves are encoded on in turn (`WaveSizes`): the stager runs at most this many
waves ahead of the GPU's compression."""


@dataclass
class RowsSegment:
    """A wave of compressed chunks, one per row of the GPU slab."""

    chunks: list[ChunkRef]
    wave: WaveSizes
    rows: torch.Tensor
    release: Callable[[], None]
    device: Any
    """The `tiered.gpu.device.GpuDevice` whose slab holds the rows."""
    drain: bool = False
    """The save needs these rows again: the writer drains them through pinned host memory."""

    @property
    def ready(self) -> torch.cuda.Event:
        """Recorded after the wave's compression."""
        return self.wave.ready

    def sizes(self) -> list[int]:
        return self.wave.get()


class EncodeClock:
    """GPU time of one save's batched encodes: CUDA events around each wave's encode calls, read
    once the save is done. `codec: auto` takes the save codec's throughput from it: full batches,
    on the save's encode streams, beside the training that the save really ran with, and no memory or GPU
    work of its own (a measurement repeated to a full batch took ~530 MiB and ~300 ms of the
    step it ran beside)."""

    def __init__(self) -> None:
        self._waves: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def stop(self, stream: torch.cuda.Stream, start: torch.cuda.Event, names: set[str], raw_bytes: int) -> None:
        """Close a wave opened with `start`; a wave of more than one codec is not attributed."""
        if len(names) == 1:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self._waves.append((next(iter(names)), raw_bytes, start, end))

    def rates(self) -> dict[str, float]:
        """Raw bytes per second of GPU encode time, per codec name (waits for the events)."""
        raw: dict[str, int] = {}
        ms: dict[str, float] = {}
        for name, n, start, end in self._waves:
            end.synchronize()
            raw[name] = raw.get(name, 0) + n
            ms[name] = ms.get(name, 0.0) + start.elapsed_time(end)
        return {name: raw[name] / (ms[name] / 1e3) for name in raw if ms[name] > 0}


@dataclass
class DrainedRows:
    """A wave whose drain `GpuDevice.issue_drain` has issued: once `done` has fired, each run of
    rows lies in its host extent, and once `sums` has, the rows' checksums are in `io[1]`."""

    sizes: list[int]
    io: torch.Tensor
    """Pinned int64 (3, rows): the sizes, the checksums once `done` has fired, the packed offsets."""
    runs: list[tuple[int, int, torch.Tensor, Callable[[], None]]]
    """(first row, end row, the host extent, its release) per run."""
    done: torch.cuda.Event
    sums: torch.cuda.Event

    def wait(self) -> list[int]:
        """Wait for the copies (the GIL is released meanwhile); the rows' wsum64 checksums."""
        self.done.synchronize()
        self.sums.synchronize()
        return unsigned(self.io[1])

    def copied(self) -> bool:
        """Whether the copies and the checksums are done, without waiting: nothing reads the
        slab's rows any more."""
        return self.done.query() and self.sums.query()

    def release_hosts(self) -> None:
        """After a failure: give the host pages back (once nothing copies into them any more, and
        no kernel stores into `io`)."""
        self.done.synchronize()
        self.sums.synchronize()
        for _, _, _, release in self.runs:
            release()
