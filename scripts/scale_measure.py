"""The scale bench's parts that every method shares: ranks under torchrun, the state, and the
measuring (a window of training steps around each save, a row of results, the restore check).
scripts/scale.py says what the scale mode measures; scripts/scale_methods.py runs each method.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from gc_watch import FullCollections
from gil_watch import GilWaits
from gpu_timeline import SAVE_MARK, STEP_MARK, Timeline

# --- ranks (torchrun) -----------------------------------------------------------------------
def dist_group() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = dist_group()
    return d.get_rank() if d else 0


def world() -> int:
    d = dist_group()
    return d.get_world_size() if d else 1


def barrier() -> None:
    d = dist_group()
    if d and d.get_world_size() > 1:
        d.barrier()


def gather(obj: Any) -> list:
    """`obj` of every rank, on every rank."""
    d = dist_group()
    if not d or d.get_world_size() == 1:
        return [obj]
    out: list = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def say(msg: str) -> None:
    """A progress line, marked with the rank under torchrun."""
    print(msg if world() == 1 else f"[rank {rank()}] {msg}", flush=True)


def show_engine_log() -> None:
    """The engine's own choices (budgets, codec, what it pinned) print beside the progress lines."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"#   tiered log{'' if world() == 1 else f' [rank {rank()}]'}: %(message)s"))
    logger = logging.getLogger("tiered")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def lockstep(device: str) -> None:
    """Ranks step together: an all-reduce of one number, as data-parallel training does per step."""
    d = dist_group()
    if d and d.get_world_size() > 1:
        d.all_reduce(torch.ones(1, device=device))


# --- the state -------------------------------------------------------------------------------
def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    return obj


def build_state(live: dict, target_bytes: int) -> dict:
    """{"r0": live, "r1": clone, ...}: as many replicas as reach `target_bytes` (at least one)."""
    one = sum(t.numel() * t.element_size() for t in tensors_of(live))
    replicas = max(1, round(target_bytes / one))
    return {f"r{i}": live if i == 0 else clone_tree(live) for i in range(replicas)}


def fingerprint(state: dict) -> list[tuple[int, int]]:
    """Per tensor: the sum of its 32-bit words (or bytes) and of every other word, on its device."""
    out = []
    for t in tensors_of(state):
        raw = t.detach().reshape(-1).view(torch.uint8)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
        out.append((int(words.sum(dtype=torch.int64)), int(words[1::2].sum(dtype=torch.int64))))
    return out


def zero_(state: dict) -> None:
    for t in tensors_of(state):
        t.zero_()


class Live:
    """`--train one`: replica 0 trains; the others are static clones of its tensors."""

    def __init__(self, state: dict, step_fn: Callable[..., Any], optimizers: list):
        self.state, self.step_fn, self.optimizers = state, step_fn, optimizers

    def build(self, target_bytes: int) -> tuple[dict, Callable[..., Any], list]:
        return build_state(self.state, target_bytes), self.step_fn, self.optimizers

    def release(self) -> None:
        pass


class TrainedReplicas:
    """`--train all`: every replica is a model with its own AdamW, copied from the trained ones."""

    def __init__(self, model, opt, make_model: Callable[[], Any], forward_backward: Callable[[Any], Any]):
        self.model, self.opt, self.make_model, self.forward_backward = model, opt, make_model, forward_backward
        self._extra: list = []

    def build(self, target_bytes: int) -> tuple[dict, Callable[..., Any], list]:
        one = sum(t.numel() * t.element_size()
                  for t in tensors_of({"m": self.model.state_dict(), "o": self.opt.state_dict()}))
        models, opts = [self.model], [self.opt]
        for _ in range(max(1, round(target_bytes / one)) - 1):
            m = self.make_model()
            m.load_state_dict(self.model.state_dict())
            o = torch.optim.AdamW(m.parameters())
            o.load_state_dict(clone_tree(self.opt.state_dict()))  # (loading alone would share the tensors)
            models.append(m)
            opts.append(o)
        self._extra = [models[1:], opts[1:]]

        def step_fn(before_update=None) -> None:
            for o in opts:
                o.zero_grad(set_to_none=True)
            for m in models:
                self.forward_backward(m)
            if before_update is not None:
                before_update()
            for o in opts:
                o.step()

        state = {f"r{i}": {"model": m.state_dict(), "optim": o.state_dict()} for i, (m, o) in enumerate(zip(models, opts))}
        return state, step_fn, opts

    def release(self) -> None:
        self._extra = []


# --- measuring -------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def gpu_free(device: str) -> int:
    return torch.cuda.mem_get_info()[0] if device == "cuda" else 0


ALLOCATOR_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
"""torch's CUDA caching allocator's counters that a window should not move once warm: a retry
frees the cache (synchronizing the device), a device alloc or free is a cudaMalloc or cudaFree
(a cudaFree waits for the whole GPU), all under the allocator's lock, which every free of a
tensor on that GPU takes (a training thread's `p.grad = None` too)."""


def allocator_counts(device: str) -> dict[str, int]:
    """The caching allocators' counters now (the CUDA one's `ALLOCATOR_KEYS`, the pinned host
    one's allocations and frees); {} on the CPU."""
    if device != "cuda":
        return {}
    d = torch.cuda.memory_stats()
    h = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}  # (torch >= 2.6)
    return {**{k: int(d.get(k, 0)) for k in ALLOCATOR_KEYS},
            "num_host_alloc": int(h.get("num_host_alloc", 0)), "num_host_free": int(h.get("num_host_free", 0))}


def counted(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that moved between two `allocator_counts`."""
    return {k: after[k] - before[k] for k in after if after[k] != before.get(k, 0)}


def rss() -> int:
    """The process's resident set (pinned host buffers count once touched)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def forward_backward_ms(step_fn: Callable[..., Any], device: str, steps: int = 3) -> float:
    """The median time of a training step's forward and backward alone (ms): each of `steps` steps
    timed from a synced start to just before its optimizer update, synced there too. What a
    guarded save's reads overlap before the optimizer step waits for them (the floor's part)."""
    times = []
    for _ in range(steps):
        sync(device)
        t0, box = time.perf_counter(), []
        step_fn(before_update=lambda: (sync(device), box.append(time.perf_counter())))
        sync(device)
        times.append(box[0] - t0)
    return round(1e3 * statistics.median(times), 1)


class Window:
    """Runs `steps` training steps; a save may be started before one of them."""

    def __init__(self, step_fn: Callable[..., Any], device: str, steps: int):
        self.step_fn, self.device, self.steps = step_fn, device, steps
        self.last_steps_ms: list[float] = []
        """The last window's steps, each from its start to the end of its lockstep, then the wait
        for the GPU to finish (ms): which steps a save slows, the one it overlaps or later ones,
        and whether it slows the host (launching) or the GPU."""

    def run(self, save: Callable[[], Any] | None = None,
            before_update: Callable[[Any], Any] | None = None) -> tuple[float, float, Any]:
        """(window seconds, save call seconds, what `save` returned). The save starts the window;
        `before_update(result)`, if given, runs before the first step's optimizer update."""
        sync(self.device)
        t0 = time.perf_counter()
        call, result, hook = 0.0, None, None
        if save is not None:
            with torch.profiler.record_function(SAVE_MARK):  # (marks for --trace; near free untraced)
                result = save()
            call = time.perf_counter() - t0
            if before_update is not None:
                hook = lambda r=result: before_update(r)  # noqa: E731
        marks = [time.perf_counter()]
        for i in range(self.steps):
            with torch.profiler.record_function(f"{STEP_MARK}{i + 1}"):
                self.step_fn(before_update=hook)
                lockstep(self.device)
            hook = None
            marks.append(time.perf_counter())
        sync(self.device)
        self.last_steps_ms = [round(1e3 * (b - a), 1) for a, b in zip(marks, marks[1:])]
        self.last_steps_ms.append(round(1e3 * (time.perf_counter() - marks[-1]), 1))  # the GPU's backlog
        return time.perf_counter() - t0, call, result

    def baseline(self, n: int = 3) -> float:
        return statistics.median(self.run()[0] for _ in range(n))


class Row:
    """What one method measured, summarised like the rest of docs/benchmarks.md."""

    def __init__(self, name: str, note: str = ""):
        self.name, self.note = name, note
        self.saves: list[dict] = []
        self.gpu_taken = self.host_taken = 0
        self.stored = 0
        self.restore_s: float | None = None
        self.exact: bool | None = None
        self.error: str | None = None
        self.extra: dict = {}

    def add(self, base: float, window: float, call: float, durable: float, gpu_min_free: int, gpu_free0: int,
            rss_now: int, rss0: int) -> None:
        self.saves.append({"stall_ms": round(1e3 * (window - base), 1), "call_ms": round(1e3 * call, 1),
                           "durable_s": round(durable, 2)})
        self.gpu_taken = max(self.gpu_taken, gpu_free0 - gpu_min_free)
        self.host_taken = max(self.host_taken, rss_now - rss0)

    def summary(self) -> dict:
        warm = self.saves[1:] or self.saves

        def stats(key: str, saves: list[dict] = warm) -> dict | None:
            vals = [s[key] for s in saves]
            return None if not vals else {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals)}

        # Saves from the third on, apart: the second save of a run has stalled more than later ones
        # at 24 GB (453-885 ms against 107-524), with codec: auto's measurement
        # beside it and, less, without; the warm median the targets use still counts it.
        extra = [s["extra_steps_ms"] for s in warm if s.get("extra_steps_ms")]
        return {"name": self.name, "note": self.note, "error": self.error, "saves": self.saves,
                "warm_extra_steps_ms": [round(statistics.median(col), 1) for col in zip(*extra)] if extra else None,
                "first": self.saves[0] if self.saves else None, "warm_stall_ms": stats("stall_ms"),
                "later_stall_ms": stats("stall_ms", self.saves[2:]),
                # (`--settle-ms`: the warm saves that came right after the window without a save, and
                # those after a pause)
                **({"unpaused_stall_ms": stats("stall_ms", [s for s in warm if not s["settle_ms"]]),
                    "paused_stall_ms": stats("stall_ms", [s for s in warm if s["settle_ms"]])}
                   if any("settle_ms" in s for s in warm) else {}),
                "warm_call_ms": stats("call_ms"), "warm_durable_s": stats("durable_s"),
                "baseline_window_ms": stats("base_ms", [s for s in self.saves if "base_ms" in s]),
                "stored_bytes": self.stored,
                "gpu_taken_bytes": self.gpu_taken, "host_taken_bytes": self.host_taken,
                "restore_s": self.restore_s, "restore_bit_exact": self.exact, **self.extra}


def combine(rows: list[dict]) -> dict:
    """One row for all ranks (`Row.summary()` of each): every save's slowest rank, the GPU memory of
    the rank that took most, the host memory of all; stored bytes of all where each rank wrote its
    own file (else every rank reports the step's); the slowest restore, bit-exact on every rank."""
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    row = Row(first["name"], first["note"])
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(rows) if r["error"]]
    row.error = "; ".join(errors) or None
    n = min(len(r["saves"]) for r in rows)
    row.saves = [_slowest([r["saves"][j] for r in rows]) for j in range(n)]
    row.gpu_taken = max(r["gpu_taken_bytes"] for r in rows)
    row.host_taken = sum(r["host_taken_bytes"] for r in rows)
    row.stored = sum(r["stored_bytes"] for r in rows) if first.get("stored_per_rank") else first["stored_bytes"]
    restores = [r["restore_s"] for r in rows]
    row.restore_s = None if None in restores else max(restores)
    exact = [r["restore_bit_exact"] for r in rows]
    row.exact = None if None in exact else all(exact)
    known = set(Row("", "").summary())
    row.extra = {k: v for k, v in first.items() if k not in known}
    return row.summary()


def _slowest(saves: list[dict]) -> dict:
    """One save as every rank measured it: each number the largest of the ranks' (its slowest
    rank), each list (its steps) or dict (its allocator counters) the one of the rank whose stall
    was largest, so that a save's steps and its baseline window's come from one rank."""
    worst = max(saves, key=lambda s: s.get("stall_ms") or 0.0)
    return {k: worst[k] if isinstance(v, (list, dict)) or v is None else max(s[k] for s in saves)
            for k, v in saves[0].items()}


def done_at(fut: Any) -> list[float]:
    """A one-element list that receives the time `fut` completes (a concurrent or torch future)."""
    box: list[float] = []
    fut.add_done_callback(lambda _: box.append(time.perf_counter()))
    return box


def agreed_lead_in(run: "Run", base: float) -> int:
    """The lead-in windows every rank runs before a save's window (`Run.lead_in_windows` of its
    baseline `base`): the most any rank's own window time asks for. Each step is a collective
    under torchrun; ranks that each counted their own, their windows on either side of a whole
    number, deadlocked, one in a step's all-reduce, the other at the next barrier."""
    return max(gather(run.lead_in_windows(base)))


def measure(row: Row, run: "Run", base: float, save: Callable[[int], Any], durable: Callable[[Any], float],
            drop: Callable[[int], None], before_update: Callable[[Any], Any] | None = None,
            gpu_free0: int | None = None) -> list[tuple[int, int]]:
    """`run.saves` windows, one save each, and one more kept apart (`Run.windows`) in the row's
    "last_save" ("traced_save" with `run.trace`), each save at its window's start: stall, call,
    durable (`durable(result)` waits for it and returns when it completed), memory. Each save's
    stall is its window against a window without a save run just before it, after the lead-in
    (`Run.lead_in_s`) (`base_ms`; against the size's first baseline,
    `base`: `stall_vs_start_ms`): over a run the same steps drifted ~5-10 ms faster each (batch 192: 1,865 -> 1,857 ms), which a baseline taken once put to the later saves'
    credit (up to ~40 ms in a window of six). `drop(step)` deletes an older step once the
    next one is durable, outside every timed span (deleting a 24 GB file takes seconds, which
    no method's stall should carry), so one copy at a time is kept on the disk; where the disk
    cannot hold two (`run.one_copy`), before the next save starts. Returns the
    fingerprint of the state the last save was handed (taken just before its window: training
    then changes the state while the save runs, so a restore that matches it shows the snapshot held).
    `gpu_free0`: the free GPU memory the row's "GPU taken" counts down from (default: now)."""
    state, window, device = run.state, run.window, run.device
    saves = run.windows
    free0, rss0 = gpu_free(device) if gpu_free0 is None else gpu_free0, rss()
    low = gpu_free(device)
    lead_in = row.extra["lead_in_windows"] = agreed_lead_in(run, base)
    for k in range(saves):
        if k and run.one_copy:
            barrier()
            drop(k)
        t_call, started = [0.0], []

        def start(k=k):
            t_call[0] = time.perf_counter()
            started.append(save(k + 1))
            return started[-1]

        barrier()
        # (with --gil-watch the window without a save is watched too: where the training thread
        # stands in its first 100 ms when no save runs is what the save's window is read against)
        for _ in range(lead_in):  # (not measured: see Run.lead_in_s)
            window.run()
        near_gil = GilWaits() if run.gil_watch else contextlib.nullcontext()
        counts0 = allocator_counts(device)
        with near_gil:
            near = window.run()[0]  # the window without a save, now (see above); it trains the state on
        near_counts = counted(counts0, allocator_counts(device))
        near_steps = window.last_steps_ms
        last = k == saves - 1  # (not counted: see Run.windows)
        if last:
            prints = fingerprint(state)  # (about 2 syncs a tensor: a pause before this save's window)
        settle = run.settle_ms if k % 2 and not last else 0.0
        if settle:
            time.sleep(settle / 1e3)
        barrier()
        gil = GilWaits() if run.gil_watch else contextlib.nullcontext()
        traced = bool(run.trace) and last
        tl = Timeline(device, keep=f"{run.trace}-{row.name}.json" if run.trace != "summary" else None) \
            if traced else contextlib.nullcontext()
        oom = None
        # Also from the call until the step is durable: the commit's work comes after the window
        # (~25 s after the call at 24 GB), beside the training that goes on.
        with FullCollections() as whole:
            counts0 = allocator_counts(device)
            with FullCollections() as full, gil, tl:  # (a full pass of Python's collector in the window shows as stall)
                try:
                    secs, call, result = window.run(start, before_update)
                except torch.OutOfMemoryError as exc:
                    # The profiler's own GPU memory (CUPTI's buffers) took training's last headroom once
                    # (24 GB, 6 GiB free). The traced save is extra: the row keeps its
                    # measured saves and restores this one, started before the failure (one rank only:
                    # under torchrun the ranks' collectives would part ways).
                    if not (traced and started and world() == 1):
                        raise
                    oom, secs, call, result = f"{type(exc).__name__}: {exc}"[:200], 0.0, 0.0, started[0]
            save_counts = counted(counts0, allocator_counts(device))
            if oom:
                torch.cuda.empty_cache()
            low = min(low, gpu_free(device))
            done = durable(result)
            low = min(low, gpu_free(device))
        if last:  # after a pause (the fingerprint), and the profiler's cost where traced: not counted
            rec = row.extra["traced_save" if traced else "last_save"] = {
                "stall_ms": None if oom else round(1e3 * (secs - near), 1),
                "call_ms": None if oom else round(1e3 * call, 1),
                **({"timeline": tl.summary} if traced else {}), **({"error": oom} if oom else {})}
        else:
            row.add(near, secs, call, done - t_call[0], low, free0, rss(), rss0)
            rec = row.saves[-1]
        rec.update(**({"settle_ms": settle} if run.settle_ms else {}),
                   base_ms=round(1e3 * near, 1), stall_vs_start_ms=None if oom else round(1e3 * (secs - base), 1),
                   steps_ms=None if oom else window.last_steps_ms, base_steps_ms=near_steps,
                   # Where the stall lands: each step of the save's window against the same step of
                   # the window just before it (the last entry: the wait for the GPU's backlog).
                   extra_steps_ms=None if oom else [round(a - b, 1) for a, b in zip(window.last_steps_ms, near_steps)],
                   full_gc_ms=full.ms, engine_full_gc_ms=full.engine_ms,
                   full_gc_to_durable_ms=whole.ms, engine_full_gc_to_durable_ms=whole.engine_ms,
                   # the caching allocators' counters that moved in the save's window / the one before
                   allocator=save_counts, base_allocator=near_counts,
                   **(gil.summary() if run.gil_watch else {}),
                   **({"base_main_where": near_gil.summary(4)["main_where"]} if run.gil_watch else {}))
        if k and not run.one_copy:
            barrier()  # every rank's save k + 1 is durable before save k goes
            drop(k)
        gc_note = (f", full collections in the window {full.ms} ms ({full.engine_ms} on the engine's threads)"
                   if full.runs else "") + (f", until durable {whole.ms} ms ({whole.engine_ms} on the engine's threads)"
                                            if whole.runs else "")
        where = ", ".join(gil.summary(3)["gil_where"]) if run.gil_watch else ""
        gil_note = f", GIL waits {gil.ms} ms (longest {gil.max_ms}{'; ' + where if where else ''}); the training " \
            f"thread in the first {gil.main_ms:g} ms: {', '.join(gil.summary(4)['main_where'])} (without a save: " \
            f"{', '.join(rec['base_main_where'])})" if run.gil_watch else ""
        if save_counts or near_counts:
            gil_note += f"; allocator counters moved: {save_counts or 'none'} (without a save: {near_counts or 'none'})"
        apart = (" (not counted, traced)" if traced else " (not counted)") if last else ""
        say(f"#   {row.name} save {k + 1}{apart}: stall {rec['stall_ms']} ms "
            f"(call {rec['call_ms']} ms), durable {round(done - t_call[0], 2)} s{gc_note}{gil_note}")
        if traced:
            say(f"#   {row.name} save {k + 1}'s timeline{' (its window failed: ' + oom + ')' if oom else ''}: "
                f"{json.dumps(tl.summary)}")
    return prints


def restore_check(row: Row, state: dict, prints: list, device: str, drop_caches: Callable[[], bool],
                  load: Callable[[], None], probe_root: Path | None = None) -> None:
    """Zero the state, drop the page cache, time `load()` and check the state bit-exact. With
    `probe_root`, first probe the disk's read rate there, every rank at once (`disk_together`,
    2 GiB a rank, less for a smaller state or a nearly full disk): `read_gbps_at_restore`. The
    ceilings taken before the saves are minutes and three saves' worth of writes earlier, and
    these virtual disks' rates moved by up to 40% within a run, which left a
    restore bound that the disk itself may no longer reach."""
    if probe_root is not None:  # (at most the state, and a quarter of the disk's free space: a 60 GB
        # state leaves ~13 GB of 64)
        state_bytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
        free = shutil.disk_usage(probe_root.parent).free // max(1, world())
        row.extra["read_gbps_at_restore"] = disk_together(probe_root, min(2 << 30, state_bytes, free // 4))["read_gbps"]
    zero_(state)
    drop_caches()
    sync(device)
    barrier()
    t0 = time.perf_counter()
    load()
    sync(device)
    row.restore_s = round(time.perf_counter() - t0, 2)
    row.exact = fingerprint(state) == prints


def disk_together(root: Path, nbytes: int) -> dict:
    """The disk's O_DIRECT write and read rates with every rank probing it at once, each on a
    file of its own of `nbytes` (at least 256 MiB): the disk the ranks' saves and restores share.
    A rank's rate is its bytes over its own time; together, all bytes over the slowest rank's
    time (the ranks start at a barrier; one may start reading while another still writes)."""
    import baselines

    mine = root / f"rank{rank()}"
    barrier()
    got = gather(baselines.disk_ceilings(mine, max(256 << 20, nbytes)))
    shutil.rmtree(mine, ignore_errors=True)
    total = sum(g["bytes"] for g in got)
    rate = {k: round(total / max(g["bytes"] / g[k] for g in got), 3) for k in ("write_gbps", "read_gbps")}
    return {**rate, "ranks": len(got), "bytes_per_rank": got[0]["bytes"], "o_direct": all(g["o_direct"] for g in got),
            "per_rank": [{k: g[k] for k in ("write_gbps", "read_gbps")} for g in got]}


@dataclass
class Run:
    """What every method of one size gets. `save(n)` and `drop(n)` of a method take the save's
    number, 1.. (see measure)."""

    state: dict
    window: Window
    saves: int
    root: Path
    device: str
    drop_caches: Callable[[], bool]
    optimizers: list
    one_copy: bool = False
    """The disk cannot hold two copies of the state: a step is deleted before the next save."""
    gil_watch: bool = False
    """Record each save's waits for the GIL (`--gil-watch`, scripts/gil_watch.py)."""
    trace: str | None = None
    """Trace the save after the measured ones (`--trace`, scripts/gpu_timeline.py; `windows`):
    "summary" keeps its summary in the row, a path prefix also writes each row's chrome trace there."""
    codec: str = "auto"
    """The tiered rows' fast-tier codec: the default config's `auto`, or one pinned (`--codec`)."""
    pack_buffer: int | None = None
    """The tiered row's `budgets.pack_buffer` where its name pins one (`ROW/SIZE`), else the default."""
    load: str = ""
    """A row that saves nothing: its load, the ":" part of its name (`gil_load:100x0.5x500`)."""
    stage_after_ms: float | str = "auto"
    """An overlapped row's `guard(stage_after_ms=...)`: the default, or what its name sets (`ROW+MS`)."""
    lead_in_s: float = 2.0
    """Each save's window without a save comes after at least this long of training that is not
    measured (whole windows, one at least), as the save's window comes right after it: the GPU's
    clock follows its recent power. On an H200 (power capped at batch 192) a window right after
    another ran ~25 ms slower than one after the ~1 s the bench waits for a save to be durable,
    and ~11 ms faster than one after a single 0.5 s window, with nothing saved.
    0: none (`--lead-in-s 0`)."""
    settle_ms: float = 0.0
    """Before every second save's window (saves 2, 4, ...), a pause this long after the window
    without a save (`--settle-ms`): whether a pause just before a save changes its cost."""
    shared_root: Path | None = None
    """The migration row's shared tier (`--shared-dir`); None: `root / "migration-shared"`."""
    shared: dict = field(default_factory=dict)
    """The tiered engine of this size, made once for both tiered rows (pinning its host memory
    takes seconds, as it does once per training job), and what making it took."""

    @property
    def windows(self) -> int:
        """Saves made, the last one's number: one more after the measured ones, handed the state
        whose fingerprint the restore is checked against. Taking it pauses training just before
        that save's window (0.1-1 s of host syncs), which left the last save the cheapest of every
        2.4 GB run, so it is not counted; with `--trace` it is the traced one."""
        return self.saves + 1

    def lead_in_windows(self, window_s: float) -> int:
        """How many windows of `window_s` seconds lead each window without a save in."""
        if self.lead_in_s <= 0:
            return 0
        return max(1, math.ceil(self.lead_in_s / window_s)) if window_s > 0 else 1
