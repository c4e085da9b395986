"""The scale mode of scripts/bench.py: a per-GPU state of 10-100 GB, GPU memory nearly full.

    python scripts/bench.py --scale 24 --free-gb 6          # one size
    python scripts/bench.py --scale 2.4,12,24 --free-gb 6   # how each cost grows with the state

The state is built from the benchmark's trained GPT and its AdamW state: replica 0 is the live
model and optimizer, replicas 1.. copies of them (real statistics, not random data) up to the
requested size. With `--train all` (the default) every replica is a model with its optimizer and
a training step runs every forward and backward, then every optimizer step: the compute and the
update order of one model whose state is that large. With `--train one` only replica 0 trains
and the others are static clones (runs 51-53). A GPU memory ballast then leaves `--free-gb`
free. Side by side, one method after another on the same state and disk:

  tiered       Engine.save with the embedded default config (only the tier's path changed);
               the engine is made before the row's windows with `engine.reserve(state)`, its
               start-up line, and pinning its host staging memory in the background is waited
               for before the first save and reported (`pin_s`)
  tiered_overlap  the same engine with `engine.guard(optimizer)` for every optimizer: save()
               returns at once, the state is read beside the next forward and backward, and
               the optimizer step waits for it
  dcp_pinned   DCP async_save, one FileSystemWriter(cache_staged_state_dict=True) reused
               (TorchTitan's pinned-memory mode; the copy to host happens inside the call)
  dcp_stager   DCP async_save with DefaultStager(StagingOptions(use_async_staging=True)):
               staging overlaps the next forward and backward and is waited for before the
               optimizer step (a failure, e.g. on torch versions where it crashes, is reported)
  torch_save   torch.save + fsync (synchronous)

Under torchrun (`torchrun --nproc-per-node 2 scripts/bench.py --scale 24 ...`) every rank builds
its own state of that size on its own GPU, all ranks write to one disk, each training step ends
with an all-reduce (ranks step together, as data-parallel training does), tiered saves through
`Engine.save` (its distributed path) and DCP through its process group; rank 0 reports each
save's slowest rank (stall, call, durable, restore), the GPU memory of the rank that took most,
and the host memory and stored bytes of all ranks together.

For each: the training stall as the loop feels it (the wall time of a window of real training
steps, forward + backward + optimizer step, that contains one save, minus the median of the same
window without a save), next to the save call's own time; time to durable (from the call until
committed and fsync'd); stored bytes; GPU memory the method took (free GPU memory before its
first save minus the least seen after; for tiered, from before the engine was made, so its
`reserve` and a second row on the same engine count too) and host memory (growth of the
process's resident set, pinned buffers included); the cold restore into the zeroed state, page
cache dropped where permitted, checked bit-exact by a fingerprint of every tensor taken before
zeroing. Same-run ceilings: O_DIRECT write and read of the disk, pinned device-to-host copy, and
the GPU codecs' encode rate alone on a batch of the state's own tensors (what compressing the
state takes of a GPU that training keeps busy). Per save, also the full passes of Python's
collector that ran inside its window, on any thread and on the engine's (`scripts/gc_watch.py`):
one holds the GIL for ~0.2 s here, and shows as stall whoever set it off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import tiered
from baselines import dir_bytes
from gc_watch import FullCollections
from gil_watch import GilWaits

GiB = 1 << 30


# --- ranks (torchrun) -----------------------------------------------------------------------
def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def world() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def barrier() -> None:
    d = _dist()
    if d and d.get_world_size() > 1:
        d.barrier()


def gather(obj: Any) -> list:
    """`obj` of every rank, on every rank."""
    d = _dist()
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
    d = _dist()
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


def rss() -> int:
    """The process's resident set (pinned host buffers count once touched)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


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
            result = save()
            call = time.perf_counter() - t0
            if before_update is not None:
                hook = lambda r=result: before_update(r)  # noqa: E731
        marks = [time.perf_counter()]
        for _ in range(self.steps):
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
        # at 24 GB (GPU runs 165-166: 453-885 ms against 107-524), with codec: auto's measurement
        # beside it and, less, without; the warm median the targets use still counts it.
        return {"name": self.name, "note": self.note, "error": self.error, "saves": self.saves,
                "first": self.saves[0] if self.saves else None, "warm_stall_ms": stats("stall_ms"),
                "later_stall_ms": stats("stall_ms", self.saves[2:]),
                "warm_call_ms": stats("call_ms"), "warm_durable_s": stats("durable_s"), "stored_bytes": self.stored,
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
    row.saves = [{k: max(r["saves"][j][k] for r in rows) for k in first["saves"][j]} for j in range(n)]
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


def _done_at(fut: Any) -> list[float]:
    """A one-element list that receives the time `fut` completes (a concurrent or torch future)."""
    box: list[float] = []
    fut.add_done_callback(lambda _: box.append(time.perf_counter()))
    return box


def measure(row: Row, run: "Run", base: float, save: Callable[[int], Any], durable: Callable[[Any], float],
            drop: Callable[[int], None], before_update: Callable[[Any], Any] | None = None,
            gpu_free0: int | None = None) -> list[tuple[int, int]]:
    """`saves` windows, one save each, at the window's start: stall, call, durable (`durable(result)`
    waits for it and returns when it completed), memory. `drop(step)` deletes an older step once
    the next one is durable, outside every timed span (deleting a 24 GB file takes seconds, which
    no method's stall should carry), so one copy at a time is kept on the disk; where the disk
    cannot hold two (`run.one_copy`), before the next save starts. Returns the
    fingerprint of the state the last save was handed (taken just before its window: training
    then changes the state while the save runs, so a restore that matches it shows the snapshot held).
    `gpu_free0`: the free GPU memory the row's "GPU taken" counts down from (default: now)."""
    state, window, saves, device = run.state, run.window, run.saves, run.device
    free0, rss0 = gpu_free(device) if gpu_free0 is None else gpu_free0, rss()
    low = gpu_free(device)
    for k in range(saves):
        if k and run.one_copy:
            barrier()
            drop(k)
        t_call = [0.0]

        def start(k=k):
            t_call[0] = time.perf_counter()
            return save(k + 1)

        if k == saves - 1:
            prints = fingerprint(state)
        barrier()
        gil = GilWaits() if run.gil_watch else contextlib.nullcontext()
        with FullCollections() as full, gil:  # (a full pass of Python's collector in the window shows as stall)
            secs, call, result = window.run(start, before_update)
        low = min(low, gpu_free(device))
        done = durable(result)
        low = min(low, gpu_free(device))
        row.add(base, secs, call, done - t_call[0], low, free0, rss(), rss0)
        row.saves[-1].update(steps_ms=window.last_steps_ms, full_gc_ms=full.ms, engine_full_gc_ms=full.engine_ms,
                             **(gil.summary() if run.gil_watch else {}))
        if k and not run.one_copy:
            barrier()  # every rank's save k + 1 is durable before save k goes
            drop(k)
        gc_note = f", full collections in the window {full.ms} ms ({full.engine_ms} on the engine's threads)" \
            if full.runs else ""
        gil_note = f", GIL waits {gil.ms} ms (longest {gil.max_ms}; {', '.join(gil.summary(3)['gil_where'])})" \
            if run.gil_watch else ""
        say(f"#   {row.name} save {k + 1}: stall {row.saves[-1]['stall_ms']} ms (call "
            f"{row.saves[-1]['call_ms']} ms), durable {row.saves[-1]['durable_s']} s{gc_note}{gil_note}")
    return prints


def restore_check(row: Row, state: dict, prints: list, device: str, drop_caches: Callable[[], bool],
                  load: Callable[[], None]) -> None:
    zero_(state)
    drop_caches()
    sync(device)
    barrier()
    t0 = time.perf_counter()
    load()
    sync(device)
    row.restore_s = round(time.perf_counter() - t0, 2)
    row.exact = fingerprint(state) == prints


# --- the methods ---------------------------------------------------------------------------
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
    shared: dict = field(default_factory=dict)
    """The tiered engine of this size, made once for both tiered rows (pinning its host memory
    takes seconds, as it does once per training job), and what making it took."""


def _engine(run: Run) -> Any:
    engine = run.shared.get("engine")
    if engine is None:
        cfg = tiered.load_config(None)
        doc = {"tiers": [{"name": cfg.fast_tier.name, "kind": "local", "path": str(run.root / "tiered")}]}
        rss0, gpu0, t0 = rss(), gpu_free(run.device), time.perf_counter()
        engine = run.shared["engine"] = tiered.Engine.from_config(doc)
        engine.reserve(run.state)  # the start-up line that keeps pinning and laying out off the first save
        engine.wait_pinned()
        run.shared.update(pin_s=round(time.perf_counter() - t0, 1), pin_rss=rss() - rss0, gpu_free0=gpu0)
        say(f"#   tiered engine: host staging memory pinned in {run.shared['pin_s']} s")
    return engine


def close_shared(run: Run) -> None:
    engine = run.shared.pop("engine", None)
    if engine is not None:
        engine.close()
        barrier()
        if rank() == 0:
            shutil.rmtree(run.root / "tiered", ignore_errors=True)


def _tiered_row(row: Row, run: Run, base: float, first_step: int) -> None:
    engine = _engine(run)
    handles: dict[int, Any] = {}

    def save(n: int):
        step = first_step + n
        h = engine.save(step, run.state)
        handles[step] = (h, _done_at(h.persisted))
        return step

    def durable(step: int) -> float:
        h, box = handles[step]
        h.wait()
        while not box:
            time.sleep(0.001)
        return box[0]

    prints = measure(row, run, base, save, durable,
                     lambda n: rank() == 0 and engine.catalog.fast.delete(first_step + n),
                     gpu_free0=run.shared["gpu_free0"])  # (all the engine holds, from before it was made)
    row.host_taken += run.shared["pin_rss"]  # the pinned pool, made before the windows
    row.extra["pin_s"] = run.shared["pin_s"]
    row.extra["codec"] = engine.fast_codec  # the policy's choice for the warm saves (codec: auto)
    timings = [h.timings for step, (h, _) in sorted(handles.items())]
    warm = timings[1:]
    row.extra["save_timings_ms"] = {k: round(statistics.median(t.get(k, 0.0) for t in warm), 1)
                                    for k in (warm[0] if warm else {})}
    row.extra["first_save_timings_ms"] = {k: round(v, 1) for k, v in timings[0].items()} if timings else {}
    say(f"#   {row.name} save() phases, warm median ms: {row.extra['save_timings_ms']}")
    say(f"#   {row.name} save() phases, first save ms: {row.extra['first_save_timings_ms']}")
    last = first_step + run.saves
    row.stored = engine.read_index(last)[0].stored_bytes
    restore_check(row, run.state, prints, run.device, run.drop_caches, lambda: engine.restore(run.state, step=last))
    barrier()
    if rank() == 0:
        engine.catalog.fast.delete(last)


def run_tiered(row: Row, run: Run, base: float) -> None:
    _tiered_row(row, run, base, 0)


def run_tiered_overlap(row: Row, run: Run, base: float) -> None:
    engine = _engine(run)
    guards = [engine.guard(opt) for opt in run.optimizers]
    try:
        _tiered_row(row, run, base, 100)
    finally:
        for g in guards:
            g.remove()


def _dcp_row(row: Row, run: Run, base: float, stager: Any) -> None:
    import torch.distributed.checkpoint as dcp

    root, device = run.root / row.name, run.device
    # The pinned cache needs an accelerator: CPU mode (a smoke test) stages into plain memory.
    writer = dcp.FileSystemWriter(str(root / "0"), cache_staged_state_dict=stager is None and device == "cuda")
    pending: dict[int, Any] = {}

    kwargs: dict = {"async_stager": stager} if stager is not None else {}
    d = _dist()
    if d and d.get_world_size() > 1:
        # The background save's collectives get a gloo group of their own, as TorchTitan does: on
        # the default group they would interleave with training's and deadlock.
        if "ckpt_group" not in run.shared:
            run.shared["ckpt_group"] = d.new_group(backend="gloo")
        kwargs["process_group"] = run.shared["ckpt_group"]

    def save(n: int):
        resp = dcp.async_save(run.state, checkpoint_id=str(root / str(n)), storage_writer=writer, **kwargs)
        fut = getattr(resp, "upload_completion", resp)
        pending[n] = (fut, _done_at(fut))
        return (n, resp)

    def durable(result) -> float:
        fut, box = pending[result[0]]
        fut.result()
        while not box:
            time.sleep(0.001)
        return box[0]

    def staged(result) -> None:  # the optimizer step waits for the stager to have copied the state
        resp = result[1]
        if hasattr(resp, "staging_completion"):
            resp.staging_completion.result()

    prints = measure(row, run, base, save, durable,
                     lambda n: rank() == 0 and shutil.rmtree(root / str(n), ignore_errors=True),
                     staged if stager is not None else None)
    last = root / str(run.saves)
    barrier()
    row.stored = dir_bytes(last)
    restore_check(row, run.state, prints, device, run.drop_caches, lambda: dcp.load(run.state, checkpoint_id=str(last)))
    barrier()
    if rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def run_dcp_pinned(row: Row, run: Run, base: float) -> None:
    _dcp_row(row, run, base, None)


def run_dcp_stager(row: Row, run: Run, base: float) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = run.device == "cuda"
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=cuda))
    try:
        _dcp_row(row, run, base, stager)
    finally:
        stager.close()


def run_torch_save(row: Row, run: Run, base: float) -> None:
    root = run.root / row.name
    root.mkdir(parents=True, exist_ok=True)

    def save(n: int):
        path = root / f"{n}.rank{rank()}.pt"
        torch.save(run.state, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter()

    prints = measure(row, run, base, save, lambda done: done,
                     lambda n: (root / f"{n}.rank{rank()}.pt").unlink(missing_ok=True))
    path = root / f"{run.saves}.rank{rank()}.pt"
    row.stored = path.stat().st_size
    row.extra["stored_per_rank"] = True  # each rank its own file

    def load() -> None:
        loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        for dst, src in zip(tensors_of(run.state), tensors_of(loaded)):
            dst.copy_(src)

    restore_check(row, run.state, prints, run.device, run.drop_caches, load)
    barrier()
    if rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


METHODS = {
    "tiered": (run_tiered, "Engine.save, embedded default config"),
    "tiered_overlap": (run_tiered_overlap, "the same engine with engine.guard(optimizer): the state is read beside "
                                           "the next forward and backward; the optimizer step waits for it"),
    "dcp_pinned": (run_dcp_pinned, "async_save, one FileSystemWriter(cache_staged_state_dict=True) reused"),
    "dcp_stager": (run_dcp_stager, "async_save + DefaultStager(use_async_staging=True), waited for before optimizer.step"),
    "torch_save": (run_torch_save, "torch.save + fsync: synchronous"),
}


# --- one size --------------------------------------------------------------------------------
def run_size(size_gb: float, live: Any, device: str, root: Path, *, free_gb: float, saves: int,
             window_steps: int, methods: list[str], drop_caches, ceilings: Callable[[int], dict],
             progress: Callable[[dict], None] = lambda out: None, gil_watch: bool = False) -> dict:
    """Every method at one size; `progress(out)` after each row (a run cut off keeps the rows done)."""
    state, step_fn, optimizers = live.build(int(size_gb * 1e9))
    replicas = len(state)
    if world() > 1:  # each rank's own shard, as under FSDP: DCP would otherwise save replicated keys once
        state = {f"rank{rank()}": state}
    state_bytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    ballast = None
    step_fn()  # activations and gradients allocated before the ballast is sized
    sync(device)
    if device == "cuda":
        free = gpu_free(device)
        want = free - int(free_gb * GiB)
        if want > 0:
            ballast = torch.empty(want, dtype=torch.uint8, device=device)
    out: dict = {"state_gb": round(state_bytes / 1e9, 2), "tensors": len(tensors_of(state)),
                 "replicas": replicas, "gpu_free_gb": round(gpu_free(device) / GiB, 2)}
    say(f"# scale {size_gb} GB: {out}")
    out["ranks"] = world()
    barrier()  # one rank measures the disk's ceilings, alone on it
    out["ceilings"] = gather(ceilings(min(state_bytes, 8 << 30), tensors_of(state)) if rank() == 0 else None)[0]
    if rank() == 0:
        say(f"# ceilings: {out['ceilings']}")
    window = Window(step_fn, device, window_steps)
    out["window_ms"] = round(1e3 * window.baseline(), 1)
    out["window_steps_ms"] = window.last_steps_ms  # the last baseline window's steps
    root.mkdir(parents=True, exist_ok=True)
    one_copy = shutil.disk_usage(root).free < 2.2 * state_bytes * world()
    if one_copy:
        say("#   the disk holds less than two copies of the state: each step is deleted before the next save")
    run = Run(state, window, saves, root, device, drop_caches, optimizers, one_copy, gil_watch=gil_watch)
    rows = []
    try:
        for k, name in enumerate(methods):
            fn, note = METHODS[name]
            row = Row(name, note)
            try:
                if name.startswith("tiered"):
                    _engine(run)  # made, and its memory pinned, before the baseline windows
                fn(row, run, window.baseline())
            except Exception as exc:  # noqa: BLE001 - reported as the row's result (with the saves it made), honestly
                row.error = f"{type(exc).__name__}: {exc}"[:400]
                say(f"#   {name} FAILED: {row.error}")
                shutil.rmtree(root / name, ignore_errors=True)
            rows.append(combine(gather(row.summary())))
            out["rows"] = rows
            progress(out)
            if not any(m.startswith("tiered") for m in methods[k + 1:]):
                close_shared(run)  # its pinned memory goes before the other methods run
    finally:
        close_shared(run)
    out["targets"] = targets(out)
    del ballast, state, run, step_fn, optimizers
    live.release()
    return out


def targets(out: dict) -> dict:
    """Issue 14's targets, from this size's rows: the stall for each tiered row (strict and
    overlapped), the rest from the default (strict) row, or the overlapped one where it ran alone
    (both write and restore the same way)."""
    rows = {r["name"]: r for r in out["rows"]}
    disk = out["ceilings"].get("disk", {})
    usable = [r for r in (rows.get("tiered"), rows.get("tiered_overlap"))
              if r and not r["error"] and r["warm_stall_ms"]]
    if not usable:
        return {}
    t = usable[0]
    dcp = rows.get("dcp_pinned")
    res = {}
    for name in ("tiered", "tiered_overlap"):
        r = rows.get(name)
        if not r or r["error"] or not r["warm_stall_ms"]:
            continue
        stall = r["warm_stall_ms"]["median"]
        res[f"{name}: stall <= 50 ms"] = (stall <= 50, f"{stall} ms")
        if dcp and dcp["warm_stall_ms"]:
            res[f"{name}: stall <= DCP pinned / 10"] = (stall <= dcp["warm_stall_ms"]["median"] / 10,
                                                        f"{stall} vs {dcp['warm_stall_ms']['median']} ms")
        if r["first"]:
            res[f"{name}: first save stalls no more than a warm one"] = (
                r["first"]["stall_ms"] <= max(1.2 * stall, stall + 20), f"{r['first']['stall_ms']} vs {stall} ms")
    if disk.get("write_gbps") and disk.get("read_gbps"):
        bound = 1.15 * t["stored_bytes"] / (disk["write_gbps"] * 1e9)
        res[f"{t['name']}: durable <= 1.15 x stored / write ceiling"] = (
            t["warm_durable_s"]["median"] <= bound, f"{t['warm_durable_s']['median']} s vs {bound:.2f} s")
        if t["restore_s"] is not None:
            bound = 1.15 * t["stored_bytes"] / (disk["read_gbps"] * 1e9)
            res[f"{t['name']}: restore <= 1.15 x stored / read ceiling"] = (
                t["restore_s"] <= bound, f"{t['restore_s']} s vs {bound:.2f} s")
    return {k: {"met": bool(ok), "measured": got} for k, (ok, got) in res.items()}


def print_size(out: dict) -> None:
    print(f"\n## scale: {out['state_gb']} GB state{' per rank, %d ranks' % out['ranks'] if out.get('ranks', 1) > 1 else ''} "
          f"({out['tensors']} tensors, {out['replicas']} replicas), "
          f"{out['gpu_free_gb']} GiB GPU memory free, window of training steps {out['window_ms']} ms")
    c = out["ceilings"]
    disk = c.get("disk", {})
    ans = c.get("gpu_codecs", {}).get("ans", {}).get("encode_gbps")
    print(f"ceilings: O_DIRECT write {disk.get('write_gbps')} GB/s, read {disk.get('read_gbps')} GB/s"
          + (f", pinned D2H {c['d2h_pinned_gbps']} GB/s" if "d2h_pinned_gbps" in c else "")
          + (f", GPU ANS encode {ans} GB/s alone (this state: {1e3 * out['state_gb'] / ans:.0f} ms of the whole GPU, "
             "which a GPU-bound training loop gives up)" if ans else ""))
    print("| method | stall ms warm median (range) | first save stall ms | saves 3+: stall ms median (range) | call ms "
          "warm median | durable s warm median (range) | stored GB | GPU taken GB | host taken GB | cold restore s | "
          "bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        if r["error"]:
            done = "; ".join(f"save {i + 1}: stall {x['stall_ms']} ms, durable {x['durable_s']} s"
                             for i, x in enumerate(r["saves"]))
            print(f"| {r['name']} | FAILED: {r['error']}{f' (after {done})' if done else ''} | | | | | | | | | |")
            continue
        s, d, cm, later = r["warm_stall_ms"], r["warm_durable_s"], r["warm_call_ms"], r.get("later_stall_ms")
        later = f"{later['median']} ({later['min']}–{later['max']})" if later else "—"
        print(f"| {r['name']} | {s['median']} ({s['min']}–{s['max']}) | {r['first']['stall_ms']} | {later} | "
              f"{cm['median']} | "
              f"{d['median']} ({d['min']}–{d['max']}) | {r['stored_bytes'] / 1e9:.2f} | {r['gpu_taken_bytes'] / 1e9:.2f} | "
              f"{r['host_taken_bytes'] / 1e9:.2f} | {r['restore_s']} | {r['restore_bit_exact']} |")
    if out["targets"]:
        print("\n| target (tiered, default config) | met | measured |\n|---|---|---|")
        for k, v in out["targets"].items():
            print(f"| {k} | {'yes' if v['met'] else 'MISSED'} | {v['measured']} |")
