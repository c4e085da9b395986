"""A wave's compressed rows made ready to leave the GPU: padding zeroed, wsum64 computed, packed.

Before a compressed chunk leaves the GPU, the bytes between the chunk's end and its 4 KiB-aligned
extent must be zero (they are written to the file, and the checksum covers them), and the row's
wsum64 (tiered.format.checksum) is computed. One Triton kernel does both, `SLICES` programs per row, reading
each row's extent once; it either zeroes the padding in place
(`pad_and_checksum`) or writes each extent, padding zeroed, end to end into a staging buffer
(`pack_and_checksum`), so that a run of rows crosses PCIe as one large copy instead of one copy
per row. Measured on an H100 with the GPU nearly full (docs/architecture.md,
"Why rows are packed by a kernel"): with torch elementwise operations (the fallback, `tiered.format.checksum.wsum64_rows_torch`)
a wave of 256 rows took ~5 ms of launches and int64 temporaries, and a copy per row ~6 us of host
work each; both held up the drain of a state larger than the slab more than PCIe did. Each
program leaves its part of a row's checksum in a small int64 tensor; a second kernel adds the
parts up, once per wave.

Imported only when CUDA is in use. Where Triton is missing or the kernel does not compile
(`warm_up` finds out, in the background, when a GPU device is set up), `available()` is False and
callers take the torch path.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger("tiered")

try:
    import triton
    import triton.language as tl
except ImportError:  # (torch's CUDA wheels bring Triton; a build without it takes the fallback)
    triton = None

_BLOCK = 2048
_state = {"ok": triton is not None, "why": "Triton is not installed", "lock": threading.Lock(),
          "deliver": triton is not None}

if triton is not None:
    def _jit(no_align: list[str]):
        """Triton compiles a variant per "specialization" of each integer argument (equal to 1,
        divisible by 16, other) and of each pointer's 16-byte alignment. `first` (a run's first
        row) takes every kind of value, and the rows of a wave's (3, n) sizes / sums / offsets
        tensor are aligned only for even n: the first saves compiled up to four more variants,
        each during a save, after `warm_up` (a first save's stall 1.47 s against
        0.11-0.22 s warm). One variant per PACK and STORE serves every value now. (`rows`, `dst` and `parts`
        keep their alignment specialization: they are 4 KiB-aligned or fresh allocations, and it
        vectorizes their loads.)"""
        def wrap(fn):
            values = [name for name in ("row_words", "first", "n") if name in fn.__code__.co_varnames[:fn.__code__.co_argcount]]
            try:
                return triton.jit(do_not_specialize=values, do_not_specialize_on_alignment=no_align)(fn)
            except TypeError:  # a Triton without alignment control: those still compile on first use
                return triton.jit(do_not_specialize=values)(fn)
        return wrap

    @_jit(["sizes", "dst_words"])
    def _rows_kernel(rows, row_words, sizes, parts, dst, dst_words, first, PACK: tl.constexpr, STORE: tl.constexpr,
                     BLOCK: tl.constexpr, SLICES: tl.constexpr):
        # Program (i, s) takes slice s of row first + i: whole BLOCKs of its extent, so that a
        # run of ~70 rows is ~560 programs, not 70 (one program per row kept most of the GPU's
        # SMs idle: ~190 GB/s, 103 ms of a 24 GB save's GPU time beside training).
        r = first + tl.program_id(0)
        s = tl.program_id(1)
        size = tl.load(sizes + r)
        extent_words = (size + 4095) // 4096 * 1024
        full = size // 4  # words wholly inside the chunk
        keep = (tl.full((), 1, tl.int64) << (size % 4 * 8)) - 1  # the chunk's bytes of word `full`
        per = (extent_words + SLICES * BLOCK - 1) // (SLICES * BLOCK) * BLOCK  # words per slice
        lo = s * per
        hi = tl.minimum(lo + per, extent_words)
        src = rows + r.to(tl.int64) * row_words
        if PACK:
            out = dst + tl.load(dst_words + r)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < hi
            w = tl.load(src + offs, mask=inside, other=0).to(tl.int64)
            w = tl.where(w < 0, w + 4294967296, w)  # the word as unsigned
            w = tl.where(offs < full, w, tl.where(offs == full, w & keep, 0))
            if PACK:
                tl.store(out + offs, w.to(tl.int32), mask=inside)
            elif STORE:
                tl.store(src + offs, w.to(tl.int32), mask=inside & (offs >= full))
            acc += w * (2 * offs.to(tl.int64) + 1)  # (wraps mod 2**64, as wsum64 is defined)
        tl.store(parts + r * SLICES + s, tl.sum(acc, axis=0))

    @triton.jit
    def _deliver_kernel(sizes, statuses, out, n, BLOCK: tl.constexpr):
        # One batch's compressed sizes and statuses, stored by the SMs into pinned host memory:
        # no copy engine, so no wait behind a drain's copies to the host.
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        tl.store(out + i, tl.load(sizes + i, mask=inside), mask=inside)
        tl.store(out + n + i, tl.load(statuses + i, mask=inside).to(tl.int64), mask=inside)

    @_jit(["sums"])
    def _sum_kernel(parts, sums, n, SLICES: tl.constexpr, ROWS: tl.constexpr):
        # ROWS rows a program: a wave's ~3,000 rows as one program each took 7.4 ms of GPU time
        # beside training, against 37 ms for packing them.
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        p = tl.load(parts + r[:, None] * SLICES + tl.arange(0, SLICES)[None, :], mask=(r < n)[:, None], other=0)
        tl.store(sums + r, tl.sum(p, axis=1), mask=r < n)


def available() -> bool:
    """The kernel runs here (Triton present, and it compiled where `warm_up` has run)."""
    return _state["ok"]


SLICES = 8
"""Programs per row: each takes whole BLOCKs of its row's extent and leaves its part of the
row's wsum64 (a sum mod 2**64, so the parts add up to it) in a (rows, SLICES) int64 tensor."""


_SUM_ROWS = 256


def partials(rows: int, device: torch.device) -> torch.Tensor:
    """Room for the parts of `rows` rows' checksums (`pack_and_checksum`, then `sum_partials`),
    on the current stream."""
    return torch.empty((rows, SLICES), dtype=torch.int64, device=device)


def _guarded(launch) -> None:
    try:
        launch()
    except Exception as exc:  # a compiler or driver problem: later waves take the torch path
        with _state["lock"]:
            if _state["ok"]:
                _state.update(ok=False, why=str(exc))
                log.warning("tiered: the fused checksum kernel (Triton) cannot run here (%s); checksums and the "
                            "drain use torch operations, which is slower", exc)
        raise


def _launch(rows: torch.Tensor, sizes: torch.Tensor, parts: torch.Tensor, dst: torch.Tensor, offsets: torch.Tensor,
            first: int, end: int, pack: bool, store: bool = True) -> None:
    _guarded(lambda: _rows_kernel[(end - first, SLICES)](
        rows.view(torch.int32), rows.shape[1] // 4, sizes, parts, dst.view(torch.int32), offsets, first,
        PACK=pack, STORE=store, BLOCK=_BLOCK, SLICES=SLICES, num_warps=8))


def sum_partials(parts: torch.Tensor, sums: torch.Tensor) -> None:
    """On the current stream: each row's wsum64 from its parts, into `sums` (int64, one per row)."""
    if parts.shape[0]:
        n = parts.shape[0]
        _guarded(lambda: _sum_kernel[(-(-n // _SUM_ROWS),)](parts, sums, n, SLICES=SLICES, ROWS=_SUM_ROWS, num_warps=4))


def pad_and_checksum(rows: torch.Tensor, sizes: torch.Tensor, sums: torch.Tensor) -> None:
    """On the current stream: zero each row of `rows` ((k, stride) uint8, stride a multiple of
    4 KiB) from `sizes[r]` (int64, on the GPU) up to its 4 KiB-aligned extent, and write each row's
    wsum64 over that extent into `sums[r]` (int64; reinterpret as uint64)."""
    _sum_rows(rows, sizes, sums, store=True)


def checksum_rows(rows: torch.Tensor, sizes: torch.Tensor, sums: torch.Tensor) -> None:
    """On the current stream: each row's wsum64 over its 4 KiB-aligned extent, its bytes from
    `sizes[r]` on counted as zero, into `sums[r]`, as `pad_and_checksum` gives it; the rows are
    only read, so copies may read them at the same time (a drain's copies straight from the
    rows: tiered.gpu.drain)."""
    _sum_rows(rows, sizes, sums, store=False)


def _sum_rows(rows: torch.Tensor, sizes: torch.Tensor, sums: torch.Tensor, store: bool) -> None:
    """Each row's wsum64 into `sums`, its padding zeroed in place where `store`."""
    if rows.shape[0]:
        parts = partials(rows.shape[0], rows.device)
        _launch(rows, sizes, parts, rows, sizes, 0, rows.shape[0], False, store=store)
        sum_partials(parts, sums)


def pack_and_checksum(rows: torch.Tensor, sizes: torch.Tensor, parts: torch.Tensor, dst: torch.Tensor,
                      offsets: torch.Tensor, first: int, end: int) -> None:
    """On the current stream: for rows first..end-1, write each row's aligned extent, padding
    zeroed, into `dst` (uint8, on the GPU) at byte offset 4 * `offsets[r]` (int64 words), and the
    parts of its wsum64 into `parts[r]` (`partials`; `sum_partials` adds them up once every run of
    the rows is packed: one launch per wave, not per run). The rows themselves are not changed."""
    if end > first:
        _launch(rows, sizes, parts, dst, offsets, first, end, True)


def can_deliver() -> bool:
    """`deliver` runs here (Triton present, and its kernel stored into pinned memory at `warm_up`)."""
    return _state["deliver"]


def deliver(device_sizes: torch.Tensor, statuses: torch.Tensor, out: torch.Tensor) -> None:
    """On the current stream: a batch's compressed sizes (int64) and statuses (int32), on the GPU,
    into `out`, pinned host memory of int64 (2, n): the sizes, then the statuses. The GPU's SMs
    store them across PCIe, so they arrive as soon as the batch is encoded, while the copy engine
    is busy with a drain (tiered.gpu.waves.WaveSizes)."""
    n = device_sizes.numel()
    if n:
        try:
            _deliver_kernel[(-(-n // 1024),)](device_sizes, statuses, out, n, BLOCK=1024, num_warps=4)
        except Exception as exc:  # a driver or Triton that will not store to host memory: copies serve
            _no_delivery(exc)
            raise


def _no_delivery(exc: Exception) -> None:
    with _state["lock"]:
        if _state["deliver"]:
            _state["deliver"] = False
            log.warning("tiered: compressed sizes cannot be stored to pinned memory by a kernel here (%s); they "
                        "are copied to the host after the drain's copies", exc)


def warm_up(device: int) -> None:
    """Compile the kernels for `device` now (on a side stream), so that no save waits for them; a
    kernel that does not compile here turns `available()` (or `can_deliver()`) False (logged)."""
    _warm_rows(device)
    _warm_deliver(device)


def _warm_rows(device: int) -> None:
    if not _state["ok"]:
        return
    try:
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            rows = torch.zeros((1, 4096), dtype=torch.uint8, device=f"cuda:{device}")
            sizes = torch.tensor([5], dtype=torch.int64, device=f"cuda:{device}")
            sums = torch.empty(1, dtype=torch.int64, device=f"cuda:{device}")
            pad_and_checksum(rows, sizes, sums)
            checksum_rows(rows, sizes, sums)
            pack_and_checksum(rows, sizes, partials(1, rows.device), torch.empty(4096, dtype=torch.uint8,
                              device=f"cuda:{device}"), torch.zeros(1, dtype=torch.int64, device=f"cuda:{device}"), 0, 1)
            torch.cuda.current_stream().synchronize()
    except Exception:  # noqa: BLE001 - logged by _launch; the torch path serves
        pass


def _warm_deliver(device: int) -> None:
    if not _state["deliver"]:
        return
    try:
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            sizes = torch.tensor([7, 9], dtype=torch.int64, device=f"cuda:{device}")
            out = torch.zeros((2, 2), dtype=torch.int64, pin_memory=True)
            deliver(sizes, torch.tensor([0, 3], dtype=torch.int32, device=f"cuda:{device}"), out)
            torch.cuda.current_stream().synchronize()
        if out.tolist() != [[7, 9], [0, 3]]:
            raise RuntimeError(f"stored {out.tolist()}")
    except Exception as exc:  # noqa: BLE001 - sizes are copied to the host then
        _no_delivery(exc)
