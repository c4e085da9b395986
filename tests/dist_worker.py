"""One rank of a multi-rank save or load, run under torchrun by tests/test_distributed.py (CPU,
gloo) and scripts/gpu_dist_check.py (GPUs, NCCL, FSDP2).

    torchrun --nproc_per_node N tests/dist_worker.py save|load --config C --step S --how engine|dcp
        [--tier NAME] [--migrate] [--fsdp REF]

The state is built the same way at every world size from fixed seeds: DTensors sharded by rows
(uneven over 4 ranks), by columns, a replicated plain tensor and plain values. `load` fills a
state of zeros laid out for its own world size and checks every value bit for bit against the
full tensors. With --fsdp, the state is an FSDP2 model and its AdamW optimizer instead (CUDA);
`save` writes the full state to REF with torch.save for `load` to compare against.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import exit_without_teardown  # (this script's folder is first on sys.path)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tiered.dcp import GpuStager, SafeLoadPlanner, TieredStorageReader, TieredStorageWriter
from tiered.engine import Engine


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "rows": torch.randn(1000, 300, generator=g),                          # Shard(0)
        "cols": torch.randn(64, 2048, generator=g).to(torch.bfloat16),         # Shard(1)
        "odd": torch.randint(-2**40, 2**40, (13, 7), generator=g),             # Shard(0), uneven
        "rep": torch.randn(5000, generator=g),                                 # replicated on every rank
        "scalar": torch.tensor(3.5, dtype=torch.float64),
    }


PLACEMENT = {"rows": Shard(0), "cols": Shard(1), "odd": Shard(0)}


def build(mesh, zeros: bool) -> dict:
    state: dict = {"extra": {"epoch": 0 if zeros else 7, "name": "" if zeros else "run-a"}, "tensors": {}}
    for name, t in full_tensors().items():
        t = torch.zeros_like(t) if zeros else t
        state["tensors"][name] = distribute_tensor(t, mesh, [PLACEMENT[name]]) if name in PLACEMENT else t
    return state


def check(state: dict) -> None:
    for name, want in full_tensors().items():
        got = state["tensors"][name]
        got = got.full_tensor() if isinstance(got, DTensor) else got
        if got.dtype != want.dtype or not torch.equal(got.cpu(), want):
            raise SystemExit(f"rank {dist.get_rank()}: {name} differs after load")
    if state["extra"] != {"epoch": 7, "name": "run-a"}:
        raise SystemExit(f"rank {dist.get_rank()}: extra is {state['extra']}")


def fsdp_state(zeros: bool, width: int, layers: int):
    """An FSDP2 model (`layers` linear layers of `width`) with AdamW after two steps (zeros:
    freshly built, one step so the optimizer state exists), and its sharded state_dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)],
                                torch.nn.Linear(width, 10)).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(1 if zeros else 2):
        torch.manual_seed(100 + i)
        model(torch.randn(8, width, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    if zeros:
        for t in list(msd.values()) + [v for s in osd["state"].values() for v in s.values()]:
            if isinstance(t, torch.Tensor):
                t.detach().zero_()
    return {"model": msd, "optim": osd}


def full_of(state) -> dict:
    """Every tensor of a (sharded) state gathered whole onto the CPU, by key path."""
    out = {}

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
        elif isinstance(node, torch.Tensor):
            out[path] = (node.full_tensor() if isinstance(node, DTensor) else node).detach().cpu()
        else:
            out[path] = node

    walk(state, "")
    return out


def count_decoded_chunks() -> dict[str, int]:
    """Chunks this rank decodes, by tensor name (wraps tiered.restore.pipeline.decode_rank)."""
    import tiered.restore.pipeline

    counts: dict[str, int] = {}
    real = tiered.restore.pipeline.decode_rank

    def counting(step, index, *a, **k):
        for rec in index.tensors:
            counts[rec.name] = counts.get(rec.name, 0) + len(rec.chunks)
        return real(step, index, *a, **k)

    tiered.restore.pipeline.decode_rank = counting
    return counts


def chunks_needed_for_rows(world: int, rank: int, chunk: int) -> int:
    """Chunks of the stored 4 row shards of "rows" that hold this rank's rows at `world` ranks,
    computed here from the layout (not by tiered's code): shard s holds rows [250 s, 250 s + 250),
    stored in C order, 1200 bytes a row."""
    rows, row_bytes, per_saved = 1000, 300 * 4, 250
    per = -(-rows // world)
    lo, hi = rank * per, min(rows, rank * per + per)
    n = 0
    for s in range(4):
        a, b = max(lo, s * per_saved) - s * per_saved, min(hi, s * per_saved + per_saved) - s * per_saved
        if a < b:
            n += (b * row_bytes - 1) // chunk - a * row_bytes // chunk + 1
    return n


def warm_saves(engine, state, step: int, repeats: int, cuda: bool) -> None:
    """Save steps step+1..step+repeats; rank 0 prints each save's stall (the call, plus the GPU
    work the current stream waits for) and the DCP planning part of it. On CUDA, one more save is
    called with ~2 s of work queued on the training stream (a loop whose host runs ahead of its
    GPU): it must return with that work still queued, whatever the default group's backend (the
    planning's all-reduce runs on the CPU: tiered.distributed.saver.cpu_group)."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(4_000_000_000)  # (GPU cycles: ~2 s on an H100)
        handle = engine.save(step + repeats + 1, state)
        if torch.cuda.current_stream().query():
            raise SystemExit(f"rank {dist.get_rank()}: save() waited for the work queued on the training stream")
        handle.wait()
    rows = []
    for i in range(1, repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = engine.save(step + i, state)
        if cuda:
            torch.cuda.current_stream().synchronize()
        rows.append((1e3 * (time.perf_counter() - t0), handle.timings["dcp_plan_ms"]))
        t = handle.timings  # the call's parts: the plan (its walk and all-reduce), then staging
        if not (t["dcp_walk_ms"] + t["dcp_agree_ms"] <= t["dcp_plan_ms"] and
                t["dcp_plan_ms"] + t["dcp_stage_ms"] <= rows[-1][0]):
            raise SystemExit(f"rank {dist.get_rank()}: the call's parts do not add up within it: {t}, call {rows[-1][0]} ms")
        handle.wait()
    if rows and dist.get_rank() == 0:
        print("warm saves at %d ranks: stall ms %s; of which DCP planning ms %s" % (
            dist.get_world_size(), [round(a, 1) for a, _ in rows], [round(b, 1) for _, b in rows]), file=sys.stderr)


def saves_without_full_collections(engine, step: int) -> None:
    """Six saves of a state of 8,320 small tensors a rank: Python's collector makes no full pass
    on the engine's commit thread (its results and metadata are several objects an item; made
    with the collector on, they set off two full passes a save there, each holding the GIL)."""
    import gc
    import threading

    state = {f"r{k}": {"model": {f"layers.{i}.w{j}": torch.full((4,), float(i)) for i in range(16) for j in range(13)},
                       "optim": {"state": {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4),
                                               "exp_avg_sq": torch.zeros(4)} for i in range(208)},
                                 "param_groups": [{"lr": 1e-3, "params": list(range(208))}]}} for k in range(10)}
    engine.reserve(state)
    full: list[str] = []

    def watch(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(threading.current_thread().name)

    gc.callbacks.append(watch)
    try:
        for n in range(6):
            engine.save(step + n, state).wait()
    finally:
        gc.callbacks.remove(watch)
    if "tiered-commit" in full:
        raise SystemExit(f"rank {dist.get_rank()}: {full.count('tiered-commit')} full collections on the commit "
                         f"thread in 6 saves (all: {full})")


def count_new_groups() -> list:
    """The gloo process groups made from now on (`dist.new_group`), in a list (a device mesh
    makes groups of the default backend; tiered makes only gloo ones)."""
    made: list = []
    real = dist.new_group

    def counting(*a, **k):
        if k.get("backend") == "gloo":
            made.append(k["backend"])
        return real(*a, **k)

    dist.new_group = counting
    return made


def rank_1_dies(engine, state, step: int, during: str) -> None:
    """Rank 1's process dies (os._exit) `during` "commit" (its files written, before it reports
    them) or "restore" (while it reads its part). The other ranks end with a CollectiveError or
    BackgroundSaveError naming rank 1 and what it was doing, within distributed_timeout; the
    save leaves no committed step. Prints the survivors' outcome as one JSON line, then exits
    without the group's teardown (a peer is gone)."""
    import json
    import time

    import tiered.distributed.saver as saver
    from tiered.errors import BackgroundSaveError, CollectiveError

    rank = dist.get_rank()
    if rank == 1 and during == "commit":
        saver.results_of = lambda *a, **k: os._exit(17)
    if rank == 1 and during == "restore":
        import tiered.distributed.storage as storage
        real_read = storage.StepReader.read_data

        def dying(self, *a, **k):
            os._exit(17)
            return real_read(self, *a, **k)
        storage.StepReader.read_data = dying
    t0 = time.monotonic()
    out = {"rank": rank}
    try:
        if during == "commit":
            engine.save(step, state).wait()
        else:
            engine.restore(state, step)
        out["error"] = None
    except (BackgroundSaveError, CollectiveError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["committed"] = engine.tier.has_step(step)
    print(json.dumps(out), flush=True)
    os._exit(0)


def save_fails_on_rank_1(engine, state, step: int) -> None:
    """Rank 1's disk is full: every rank's save of `step` fails, nothing is committed, and the
    next save (disk space back) commits."""
    from tiered.errors import BackgroundSaveError

    real = engine.tier.open_data_writer

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    if dist.get_rank() == 1:
        engine.tier.open_data_writer = full
    handle = engine.save(step, state)
    try:
        handle.wait()
    except BackgroundSaveError as exc:
        if "No space left on device" not in str(exc) and "rank 1" not in str(exc):
            raise SystemExit(f"rank {dist.get_rank()}: unexpected error {exc}")
    else:
        raise SystemExit(f"rank {dist.get_rank()}: step {step} was saved although rank 1 failed")
    try:
        engine.wait()
    except BackgroundSaveError:
        pass  # the same failure, raised once more by the engine (as a next save() would)
    if engine.tier.has_step(step):
        raise SystemExit(f"rank {dist.get_rank()}: step {step} is committed without rank 1's files")
    engine.tier.open_data_writer = real
    dist.barrier()
    engine.save(step + 1, state).wait()


def load_fails_on_rank_1(engine, state, step: int) -> None:
    """Rank 1's state has a tensor that the step lacks (a strict restore refuses it): every rank's
    restore raises, rank 1 its own error, the others one that names rank 1 and why; then a restore
    of a state that every rank can load succeeds everywhere."""
    from tiered.errors import TieredError

    if dist.get_rank() == 1:
        state["tensors"]["missing"] = torch.zeros(3)
    try:
        engine.restore(state, step)
    except TieredError as exc:
        if dist.get_rank() == 1 or "rank 1" not in str(exc) or "missing" not in str(exc):
            raise SystemExit(f"rank {dist.get_rank()}: unexpected error {exc}")
    except Exception as exc:  # noqa: BLE001
        if dist.get_rank() != 1 or "missing" not in str(exc):
            raise SystemExit(f"rank {dist.get_rank()}: unexpected error {type(exc).__name__}: {exc}")
    else:
        raise SystemExit(f"rank {dist.get_rank()}: step {step} restored although rank 1 could not")
    state["tensors"].pop("missing", None)
    assert engine.restore(state, step) == step
    check(state)


LONG_NAME = "run-a, resumed with a longer name " * 40


def save_while_changing(engine, mesh, step: int, reserve: bool) -> None:
    """Saves that reuse the last plan (tiered.distributed.reuse) save each save's values; a state that
    changes structure is planned again by DCP. Every step is restored and checked. `reserve`:
    `engine.reserve(state)` first, which plans, so that the first save does not."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    planned: list[int] = []
    plan = DefaultSavePlanner.create_local_plan
    DefaultSavePlanner.create_local_plan = lambda self: (planned.append(1), plan(self))[1]
    state = build(mesh, zeros=False)
    serialized: list[int] = []  # torch.save calls: each plain value's bytes (DCP's BYTE_IO items)
    real_save = torch.save
    torch.save = lambda *a, **k: (serialized.append(1), real_save(*a, **k))[1]
    if reserve:
        engine.reserve(state)
        if len(planned) != 1:
            raise SystemExit(f"rank {dist.get_rank()}: reserve() planned {len(planned)} times, expected once")
        serialized.clear()
    engine.save(step, state).wait()                       # DCP plans (after reserve(): the plan is reused)
    if reserve and len(planned) != 1:
        raise SystemExit(f"rank {dist.get_rank()}: the first save after reserve() planned again")
    if reserve and serialized:  # (reserve() serialized them; they have not changed)
        raise SystemExit(f"rank {dist.get_rank()}: the first save after reserve() serialized {len(serialized)} values")
    torch.save = real_save
    state["extra"]["epoch"] = 8
    state["extra"]["name"] = LONG_NAME  # (a serialized value of another size: the plan is reused, its size is not)
    for t in state["tensors"].values():
        (t.to_local() if isinstance(t, DTensor) else t).add_(1)
    engine.save(step + 1, state).wait()                   # the same structure: the plan is reused
    state["tensors"]["new"] = torch.arange(10.0)
    engine.save(step + 2, state).wait()                   # a tensor more: planned again
    engine.save(step + 3, state).wait()                   # reused again
    DefaultSavePlanner.create_local_plan = plan
    if len(planned) != 2:
        raise SystemExit(f"rank {dist.get_rank()}: DCP planned {len(planned)} of 4 saves, expected 2")
    for s, epoch, run_name, plus, new in ((step, 7, "run-a", 0, False), (step + 1, 8, LONG_NAME, 1, False),
                                          (step + 3, 8, LONG_NAME, 1, True)):
        out = build(mesh, zeros=True)
        if new:
            out["tensors"]["new"] = torch.zeros(10)
        engine.restore(out, s)
        for name, want in full_tensors().items():
            got = out["tensors"][name]
            got = got.full_tensor() if isinstance(got, DTensor) else got
            if not torch.equal(got, want + plus):
                raise SystemExit(f"rank {dist.get_rank()}: step {s}: {name} differs after load")
        if out["extra"] != {"epoch": epoch, "name": run_name} or (
                new and not torch.equal(out["tensors"]["new"], torch.arange(10.0))):
            raise SystemExit(f"rank {dist.get_rank()}: step {s}: {out['extra']} or 'new' differs after load")


def guarded_saves(engine, step: int, auto: bool, device: str, own_group: bool,
                  stage_after_ms: float | str = "auto") -> None:
    """Guarded saves at N ranks (`Engine.guard`). With `defer_walk=True`, from the second save
    on each call clones what is unguarded and returns, and the stager thread plans with DCP (the
    walk, the all-reduce) and reads the state; `auto`: the default guard, with every walk long
    enough to defer one process's saves (DEFER_AFTER_MS = 0; rank 0 saves once with
    `local=True` first, which learns the state), whose distributed saves still plan in the call. Right after each call an unguarded buffer changes (cloned in the call) and
    the optimizer steps (it waits for the reads): every step restores bit-exact to the state at
    its save. A rank's own names, so that DCP keeps every rank's tensors. `device`: where the
    state lies (cuda: each rank's GPU, with scripts/gpu_dist_check.sh). `own_group`: the engine
    plans on a gloo group of its own (an NCCL default group); on a CPU default group, which
    training's collectives use too, it plans in the call even with `defer_walk=True`.
    `stage_after_ms` (a long number): each save's reads start only when something waits for
    them: the optimizer step, or (every other save) the handle's `wait()` before it; by default
    the guard's "auto"."""
    long_wait = stage_after_ms != "auto" and stage_after_ms > 0
    defers = own_group and not auto
    import tiered.save.pipeline

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    params = {f"w{rank}.{i}": torch.nn.Parameter(torch.randn(64, 33, device=device)) for i in range(6)}
    buf = torch.zeros(17, device=device)
    opt = torch.optim.AdamW(params.values(), lr=0.01)
    if auto:
        tiered.save.pipeline.DEFER_AFTER_MS = 0.0
    engine.guard(opt, defer_walk=None if auto else True, stage_after_ms=stage_after_ms)

    epoch = [0]

    def state() -> dict:  # new dicts every save, as model.state_dict() and optimizer.state_dict() make
        return {"model": {k: p.detach() for k, p in params.items()}, "buf": {f"b{rank}": buf},
                "optim": {f"r{rank}": opt.state_dict()}, "extra": {"epoch": epoch[0]}}

    def one_step() -> None:
        sum((p * p).sum() for p in params.values()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()
    if auto and rank == 0:  # a guarded save of this rank alone learns the state: distributed saves still plan in the call
        engine.save(step - 1, state(), local=True).wait()
    want = {}
    t0 = time.perf_counter()
    for s in range(step, step + 5):
        epoch[0] = s
        st = state()
        want[s] = {k: v.clone() for k, v in st["model"].items()}, buf.clone(), \
            {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        handle = engine.save(s, st)
        buf.add_(1.0)  # (unguarded: the call cloned it)
        if long_wait and s % 2:
            handle.wait()  # (starts the reads: stage_after_ms)
        one_step()  # (waits for the reads: the guard)
        handle.wait()
        timed = handle.timings
        if s > step and defers and not ("stager_plan_ms" in timed and "dcp_walk_ms" in timed and "call_ms" in timed):
            raise SystemExit(f"rank {rank}: save {s} was not deferred to the stager thread: {sorted(timed)}")
        if (s == step or not defers) and "stager_plan_ms" in timed:
            raise SystemExit(f"rank {rank}: save {s} was deferred ({'the first' if defers else 'auto' if auto else 'on the default group'})")
    if long_wait and time.perf_counter() - t0 > stage_after_ms / 2e3:
        raise SystemExit(f"rank {rank}: the saves waited out stage_after_ms ({time.perf_counter() - t0:.1f} s)")
    for s, (model, b, adam) in want.items():
        params_out = {k: torch.zeros(64, 33, device=device) for k in params}
        out = {"model": params_out, "buf": {f"b{rank}": torch.zeros(17, device=device)},
               "optim": {f"r{rank}": {"state": {0: {k: torch.zeros_like(v) for k, v in adam.items()}}}},
               "extra": {"epoch": -1}}
        engine.restore(out, s)
        bad = [k for k in model if not torch.equal(out["model"][k], model[k])]
        bad += [] if torch.equal(out["buf"][f"b{rank}"], b) else ["buf"]
        bad += [k for k in adam if not torch.equal(out["optim"][f"r{rank}"]["state"][0][k], adam[k])]
        if bad or out["extra"]["epoch"] != s:
            raise SystemExit(f"rank {rank}: step {s} differs after restore: {bad}, epoch {out['extra']['epoch']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "load", "load-fail", "save-fail", "save-change", "save-gc", "save-guarded",
                                     "save-dies", "load-dies"])
    ap.add_argument("--config", required=True)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--how", choices=["engine", "dcp", "async"], default="engine")
    ap.add_argument("--tier", default=None)
    ap.add_argument("--reserve", action="store_true", help="save (--how engine), save-change: engine.reserve(state) "
                    "first")
    ap.add_argument("--migrate", action="store_true", help="after saving, wait until the step is on every tier")
    ap.add_argument("--fsdp", default=None, help="FSDP2 on CUDA; the full reference state goes to this file")
    ap.add_argument("--width", type=int, default=512, help="--fsdp model width")
    ap.add_argument("--layers", type=int, default=4, help="--fsdp model depth")
    ap.add_argument("--backend", default=None, help="the default group's backend (default: gloo on CPU, "
                    "cpu:gloo,cuda:nccl with --fsdp)")
    ap.add_argument("--as-nccl", action="store_true", help="the engine takes the default group for one without a "
                    "CPU backend (tiered.distributed.saver.default_backend says nccl): it must plan over a gloo group "
                    "of its own, made once")
    ap.add_argument("--auto", action="store_true", help="save-guarded: the default guard (defer_walk=None)")
    ap.add_argument("--cuda", action="store_true", help="save-guarded: the state on each rank's GPU (NCCL)")
    ap.add_argument("--stage-after", type=float, default=None, help="save-guarded: guard(stage_after_ms=...), "
                    "not auto")
    ap.add_argument("--repeats", type=int, default=0,
                    help="after the save of --step, save steps step+1..step+N (warm: the cached plan) and print "
                         "how long each blocked the training loop")
    args = ap.parse_args()
    cuda = args.fsdp is not None or args.cuda
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(args.backend or ("cpu:gloo,cuda:nccl" if cuda else "gloo"))
    mesh = None if cuda else init_device_mesh("cpu", (dist.get_world_size(),))
    groups = count_new_groups()
    if args.as_nccl:
        import tiered.distributed.saver

        tiered.distributed.saver.default_backend = lambda: "nccl"
    engine = Engine.from_config(args.config)
    try:
        state = None if args.mode == "save-guarded" else fsdp_state(args.mode == "load", args.width, args.layers) \
            if cuda else build(mesh, args.mode.startswith("load"))
        if args.mode in ("save-dies", "load-dies"):
            rank_1_dies(engine, state, args.step, "commit" if args.mode == "save-dies" else "restore")
        if args.mode == "load-fail":
            load_fails_on_rank_1(engine, state, args.step)
        elif args.mode == "save-fail":
            save_fails_on_rank_1(engine, state, args.step)
        elif args.mode == "save-change":
            save_while_changing(engine, mesh, args.step, args.reserve)
        elif args.mode == "save-gc":
            saves_without_full_collections(engine, args.step)
        elif args.mode == "save-guarded":
            guarded_saves(engine, args.step, args.auto, "cuda" if cuda else "cpu",
                          own_group=args.as_nccl or "gloo" not in dist.get_backend(),
                          stage_after_ms="auto" if args.stage_after is None else args.stage_after)
        elif args.mode == "save":
            if args.how == "engine":
                if args.reserve:
                    engine.reserve(state)
                handle = engine.save(args.step, state)
                manifest = handle.wait()
                assert manifest.world_size == dist.get_world_size(), manifest
                warm_saves(engine, state, args.step, args.repeats, cuda)
            elif args.how == "dcp":
                dcp.save(state, storage_writer=TieredStorageWriter(engine, args.step))
            else:  # DCP's background save; staged with tiered's GpuStager (copies on the device)
                dcp.async_save(state, storage_writer=TieredStorageWriter(engine, args.step),
                               async_stager=GpuStager()).result()
            if args.migrate:
                engine.wait_migrated()
            if cuda:
                full = full_of(state)
                if dist.get_rank() == 0:
                    torch.save(full, args.fsdp)
        else:
            counts = count_decoded_chunks()
            if args.how == "engine":
                assert engine.restore(state, args.step, tier=args.tier) == args.step
            else:
                dcp.load(state, storage_reader=TieredStorageReader(engine, args.step, tier=args.tier),
                         planner=SafeLoadPlanner())
            if cuda:
                want, got = torch.load(args.fsdp, weights_only=True), full_of(state)
                bad = [k for k in want if not (torch.equal(want[k], got[k]) if isinstance(want[k], torch.Tensor)
                                               else want[k] == got[k])]
                if bad or set(want) != set(got):
                    raise SystemExit(f"rank {dist.get_rank()}: differs after load: {bad[:5]}")
            else:
                check(state)
                # Resharding decodes only the chunks holding this rank's part of each stored shard.
                decoded = sum(n for name, n in counts.items() if name.startswith("tensors.rows@"))
                want = chunks_needed_for_rows(dist.get_world_size(), dist.get_rank(), engine.config.chunk_size)
                if decoded != want:
                    raise SystemExit(f"rank {dist.get_rank()}: decoded {decoded} chunks of 'rows', needs {want}")
        want = 1 if args.as_nccl or "gloo" not in dist.get_backend() else 0
        if len(groups) != want:
            raise SystemExit(f"rank {dist.get_rank()}: the engine made {len(groups)} process groups, expected {want}")
        dist.barrier()
    finally:
        engine.close()
        rank = dist.get_rank()
        dist.destroy_process_group()
    print(f"rank {rank} ok", file=sys.stderr)


if __name__ == "__main__":
    main()
    exit_without_teardown()  # (everything is checked and the process group destroyed)
