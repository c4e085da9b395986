"""The copy-engine path of a GPU save: tensors stored as they are (`codec: none`) go from their own
memory straight into pinned host pages, by the GPU's copy engines alone; the writer checksums the
pages on the CPU and writes them as they lie.

Why a path of its own: where training keeps its GPU busy, what a save costs a step is the work it
puts on the GPU's SMs. A 24 GB save through the slab path took ANS's 50-57 ms and the pack and
checksum kernel's 26-37 ms from training, and a `none` save through the same path stalled no less
(133 ms against ANS's 89 on one H100): it still copied every byte into slab rows and
packed them with kernels. Here no kernel runs. The host pages hold the chunks exactly as the data
file lays them out (each chunk at the next 4 KiB-aligned offset: a tensor's bytes, then zeros to
the next 4 KiB), so each tensor is one copy, each run of pages one write, and the checksums
(tiered.format.checksum's wsum64, summed a run at a time on two low-priority threads:
`tiered.gpu.runtime.Workers.checksums`) read the pages once. What it costs instead: the fast tier
stores the state uncompressed (a trained model's fp32 state is ~20% larger than with ANS), the
copies need pinned host memory for the state (as the slab path's drain does), and the checksums
take CPU time (~2-3 GB/s a thread) beside the disk's writes, off the training thread.

Measured at 24 GB beside a GPU-bound loop (docs/benchmarks.md):
it stalls training about as much as ANS does, not less, so `codec: auto` keeps ANS; this path is
for a GPU with no memory to spare for the save slab, with the optimizer guarded: a strict save
waits for the copies to cross PCIe (~50 GB/s; 57 ms at 2.4 GB against ANS's 20). From
such a tier the migrator decodes nothing on the GPU.

    HostLayout.build(plans, chunk_size, run_bytes)   once per structure of state: runs of chunks,
                                                     each a range of host pages
    stage(layout, tensors, host, stream, emit, ...)  per save: per run, its pages, one copy per
                                                     tensor (a tensor larger than a run: per piece),
                                                     an event; a HostSegment emitted
    write_segment(seg, writer, place, pool)          the writer: wait for the copies, zero each
                                                     tensor's padding, checksum, place, write

Used by tiered.gpu.device (`GpuDevice.stage` sends `none` plans here) and tiered.save.pipeline (the writer). The
staging half runs without CUDA too (CPU tensors, no stream), which is how the CPU tests drive it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from tiered.format.checksum import wsum64_extents
from tiered.format.chunks import ALIGNMENT, greedy_runs
from tiered.stage.plan import ChunkRef, Runs, TensorPlan, chunk_refs
from tiered.stage.pools import HostPool
from tiered.units import format_size, round_up

log = logging.getLogger("tiered")

CODEC = "none"
"""The codec whose GPU tensors take this path."""
RUN_BYTES = 256 << 20
"""The most bytes of one run (one segment, one event, one write): large enough that a 24 GB state
is ~100 runs, small enough that the writer starts on the first while later ones are copied."""
VIEW_PLACES = 8
"""Places in the host pool whose views a run keeps (`HostRun.views`)."""
CHECKSUM_TASK_BYTES = 32 << 20
"""Bytes of chunks checksummed per task of the checksum pool (`tiered.gpu.runtime.Workers.checksums`)."""


def copies_to_host(plan: TensorPlan) -> bool:
    """This GPU tensor's chunks are copied to the host as they are (`stage`), not encoded into slab rows."""
    return plan.spec.name == CODEC and plan.chunk_size % ALIGNMENT == 0


@dataclass
class HostRun:
    """One run of a save's chunks, laid out in host pages as in the data file."""

    first: int
    end: int
    """The run's chunks: [first, end) of the layout's `refs`."""
    nbytes: int
    """Their aligned extents end to end: the pages the run takes and the bytes it writes."""
    whole: list[tuple[TensorPlan, int]]
    """(plan, byte offset in the run) of each tensor copied whole."""
    pieces: list[tuple[int, int, int, int]]
    """(leaf index, byte lo, byte hi, byte offset in the run) of each part of a tensor that spans runs."""
    tails: list[tuple[int, int]]
    """(byte offset, bytes) of the zeros after each tensor's (or piece's) last chunk."""
    sizes: list[int]
    """Each chunk's bytes (stored as they are)."""
    offsets: np.ndarray
    """Each chunk's byte offset in the run."""
    leaves: list[int] = field(default_factory=list)
    """The leaf index of each tensor in `whole`."""
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Per first page the run was given: the views of those pages that the whole tensors are
    copied into, typed and shaped like them (saves of one structure cycle through a few places
    of the host pool, so a warm save makes none)."""

    def destinations(self, raw: torch.Tensor, page: int, keep: bool = True) -> list[torch.Tensor]:
        """The views of `raw` (the run's pages from `page` on) that the whole tensors are copied
        into; with `keep`, kept for the next save given the same pages."""
        dsts = self.views.get(page)
        if dsts is None:
            dsts = [raw[at:at + p.nbytes].view(p.dtype).view(p.shape) for p, at in self.whole]
            if keep:
                if len(self.views) >= VIEW_PLACES:
                    self.views.clear()
                self.views[page] = dsts
        return dsts


@dataclass
class HostLayout:
    """A save's runs for one structure of state (the plans of one GPU); reused while it holds."""

    plans: Sequence[TensorPlan]
    run_bytes: int
    refs: list[ChunkRef]
    runs: list[HostRun]

    @property
    def nbytes(self) -> int:
        """Host bytes (and data file bytes) of a save: every run's pages."""
        return sum(r.nbytes for r in self.runs)

    def fits(self, plans: Sequence[TensorPlan], run_bytes: int) -> bool:
        return self.plans is plans and self.run_bytes == run_bytes

    @classmethod
    def build(cls, plans: Sequence[TensorPlan], chunk_size: int, run_bytes: int) -> "HostLayout":
        """Runs of at most `run_bytes` (one chunk at least), per run of a tensor's chunks, not per
        chunk: built on the stager thread, whose Python a training loop sharing the GIL pays for."""
        if chunk_size % ALIGNMENT:
            raise ValueError(f"chunk_size {chunk_size} is not a multiple of {ALIGNMENT}")
        refs = chunk_refs(plans)
        sizes = np.fromiter((c.raw_size for c in refs), np.int64, len(refs))
        extents = (sizes + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT
        ends = np.cumsum(extents)
        runs = Runs(plans)
        out = []
        for i, k in greedy_runs(ends, run_bytes):
            whole: list[tuple[TensorPlan, int]] = []
            pieces: list[tuple[int, int, int, int]] = []
            tails: list[tuple[int, int]] = []
            pos = 0
            for plan, j0, n in runs.within(i, k):
                lo, hi = j0 * chunk_size, min(plan.nbytes, (j0 + n) * chunk_size)
                if lo == 0 and hi == plan.nbytes:
                    whole.append((plan, pos))
                else:
                    pieces.append((plan.index, lo, hi, pos))
                extent = round_up(hi - lo, ALIGNMENT)  # (whole chunks are aligned: only the last pads)
                if extent > hi - lo:
                    tails.append((pos + hi - lo, extent - (hi - lo)))
                pos += extent
            base = int(ends[i - 1]) if i else 0
            out.append(HostRun(i, k, pos, whole, pieces, tails, sizes[i:k].tolist(),
                               ends[i:k] - extents[i:k] - base, [p.index for p, _ in whole]))
            assert pos == int(ends[k - 1]) - base
        return cls(plans, run_bytes, refs, out)


@dataclass
class HostSegment:
    """A run of a save's chunks in host pages, copied there from the GPU (or the CPU) as they are.
    `release()` gives the pages back once the copies into them are done."""

    chunks: list[ChunkRef]
    raw: torch.Tensor
    """The run's host pages (uint8)."""
    run: HostRun
    ready: Any
    """A CUDA event recorded after the run's copies (None: copied already)."""
    give_back: Callable[[], None]

    def release(self) -> None:
        """Give the pages back; before `checksums`, wait for the copies first (a failed save lets
        pages go that the copy engine may still fill). After it, no CUDA call is made: the host
        writes' threads call this, and a CUDA call on a thread of no GPU opens a context on GPU 0."""
        if self.ready is not None:
            self.ready.synchronize()
        self.give_back()

    def checksums(self, pool: ThreadPoolExecutor) -> list[int]:
        """Wait for the copies (the GIL let go), zero the padding after each tensor's last chunk
        (the pages are reused: they hold an earlier save's bytes) and return each chunk's wsum64,
        computed on `pool` in tasks of about CHECKSUM_TASK_BYTES (`wsum64_extents`: a few numpy
        calls per MiB, whatever the chunks' sizes)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None  # (copied: `release` waits for nothing now)
        buf = self.raw.numpy()
        for at, n in self.run.tails:
            buf[at:at + n] = 0
        offsets, sizes = self.run.offsets, self.run.sizes
        tasks = greedy_runs(np.cumsum(sizes), CHECKSUM_TASK_BYTES)

        def one(task: tuple[int, int]) -> list[int]:
            i, k = task
            return wsum64_extents(buf, offsets[i:k], sizes[i:k])

        return [s for part in pool.map(one, tasks) for s in part]


def stage(layout: HostLayout, tensors: Sequence[torch.Tensor], host: HostPool, stream: Any,
          emit: Callable[[HostSegment], None], on_block: Callable[[], None], timings: dict[str, float],
          keep_views: bool = True) -> None:
    """Copy every run of `layout` into host pages, on `stream` (None: copies on the CPU), and emit
    each as a HostSegment. Waits for pages while the writer still holds them (`on_block` first).
    Whole tensors are copied into views shaped like them (a strided one is made contiguous by the
    copy itself, on `stream`), kept from save to save with `keep_views`; parts of a tensor larger
    than a run, as bytes."""
    clock = time.perf_counter
    flat: dict[int, torch.Tensor] = {}
    for run in layout.runs:
        t0 = clock()
        page = host.ring.acquire(host.pages(run.nbytes), on_block)
        t1 = clock()
        try:
            raw = host.view(page, run.nbytes)
            dsts = run.destinations(raw, page, keep_views)
            srcs = [tensors[i] for i in run.leaves]
            with torch.cuda.stream(stream):  # (None: no stream, on a machine without CUDA too)
                if run.pieces:
                    dsts = list(dsts)
                    for i, lo, hi, at in run.pieces:
                        if i not in flat:  # (made contiguous on `stream`, once per save)
                            t = tensors[i]
                            flat[i] = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
                        dsts.append(raw[at:at + hi - lo])
                        srcs.append(flat[i][lo:hi])
                ready = None
                if stream is None:
                    torch._foreach_copy_(dsts, srcs)
                else:  # (CUDA sources, host destinations: one cudaMemcpyAsync per tensor, no kernel)
                    torch._foreach_copy_(dsts, srcs, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(stream)
        except BaseException:
            if stream is not None:
                stream.synchronize()
            host.ring.release(page)
            raise
        timings["wait_pages_ms"] = timings.get("wait_pages_ms", 0.0) + 1e3 * (t1 - t0)
        timings["copy_ms"] = timings.get("copy_ms", 0.0) + 1e3 * (clock() - t1)
        emit(HostSegment(layout.refs[run.first:run.end], raw, run, ready, lambda p=page: host.ring.release(p)))


def write_segment(seg: HostSegment, writer: Any, place: Callable[[Sequence[Any], Sequence[int], Sequence[int]], int],
                  pool: ThreadPoolExecutor, timings: dict[str, float]) -> None:
    """The writer's side: checksum the run, place its chunks end to end in the data file (they lie
    so in the pages) and write the pages as one extent (in parallel O_DIRECT pieces where the tier
    writes host extents asynchronously); the pages go back once written."""
    t0 = time.perf_counter()
    try:
        sums = seg.checksums(pool)
    except BaseException:
        seg.release()
        raise
    timings["write.checksum_ms"] = timings.get("write.checksum_ms", 0.0) + 1e3 * (time.perf_counter() - t0)
    offset = place(seg.chunks, seg.run.sizes, sums)
    view = memoryview(seg.raw.numpy())
    write = getattr(writer, "write_host_async", None)
    if write is not None:
        write(offset, view, seg.release)
        return
    try:
        writer.write_host(offset, view)
    finally:
        seg.release()


class HostCopier:
    """The copy path of one GPU (`GpuDevice.stage` hands it the `none` plans), or (`index` None) of
    the CPU tensors stored as they are (`SavePipeline` hands it those: copied where the save is
    staged, then written as the GPU's are, in place, with no copy per chunk): a stream of its own on a GPU
    (the copies do not queue behind, or hold up, the slab path's kernels), the layout of the last
    structure saved, and the host pool it copies into."""

    def __init__(self, index: int | None, host: HostPool, chunk_size: int, priority: int = 0):
        self.index, self.host, self.chunk_size = index, host, chunk_size
        self._priority = priority
        self._stream: Any = None
        self.where = "CPU tensors" if index is None else f"cuda:{index}"
        self._layout: HostLayout | None = None
        self._split: tuple[Any, Any, Any] | None = None
        self._warned: set[str] = set()

    @property
    def stream(self) -> Any:
        """The copies' CUDA stream (None for the CPU's), made at the first GPU copy: a GPU whose
        saves copy nothing as it is makes none."""
        if self._stream is None and self.index is not None:
            self._stream = torch.cuda.Stream(torch.device("cuda", self.index), priority=self._priority)
        return self._stream

    def split(self, plans: Sequence[TensorPlan]) -> tuple[Sequence[TensorPlan], Sequence[TensorPlan]]:
        """(plans copied as they are, the others); the same objects while `plans` is (the layouts
        are cached on their identity)."""
        if self._split is None or self._split[0] is not plans:
            copied = tuple(p for p in plans if copies_to_host(p))
            self._split = (plans, copied, tuple(p for p in plans if not copies_to_host(p)) if copied else plans)
        return self._split[1], self._split[2]

    def _run_bytes(self) -> int:
        """Bytes per run: RUN_BYTES, within one pinned block, and at most a quarter of the pool, so
        copies and writes overlap (a run holds one chunk at least)."""
        host = self.host
        return max(self.chunk_size, min(RUN_BYTES, host.max_run_bytes, host.capacity // 4) // ALIGNMENT * ALIGNMENT)

    def layout(self, plans: Sequence[TensorPlan]) -> HostLayout:
        """The layout of saves of `plans` (built once per structure: `GpuDevice.prepare` at start-up)."""
        run_bytes = self._run_bytes()
        if self._layout is None or not self._layout.fits(plans, run_bytes):
            self._layout = HostLayout.build(plans, self.chunk_size, run_bytes)
        return self._layout

    def stage(self, plans: Sequence[TensorPlan], tensors: Sequence[torch.Tensor], emit: Callable[[Any], None],
              on_block: Callable[[], None], after: Any, timings: dict[str, float]) -> Any:
        """Copy `plans`' tensors into host pages (`stage`); the event after the last copy (None
        for the CPU's: copied when this returns). Without `after` the copies follow the current
        stream, which then waits for them (as `GpuDevice.stage`); with it they follow `after` and
        nothing waits. On a failure this waits for the copies issued, so the caller may let the
        tensors go."""
        layout = self.layout(plans)
        self.host.want_for_save(layout.nbytes, self._warned, self.where,
                                f"copies {format_size(layout.nbytes)} of tensors stored as they are (codec: none)",
                                "Raise budgets.host_buffer")
        if self.index is None:  # (no views kept: a CPU state's thousands of step counters would be as many
            stage(layout, tensors, self.host, None, emit, on_block, timings, keep_views=False)  # tensors the
            return None  # collector walks in its oldest generation: tree._Kept)
        current = torch.cuda.current_stream(self.index)
        if after is None:
            self.stream.wait_stream(current)
        else:
            self.stream.wait_event(after)
        stage(layout, tensors, self.host, self.stream, emit, on_block, timings)
        done = torch.cuda.Event()
        done.record(self.stream)
        if after is None:
            current.wait_event(done)
        return done
