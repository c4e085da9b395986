#!/usr/bin/env python3
"""Benchmark tiered on a realistic checkpoint: a GPT-style model trained with AdamW.

The model (default ~200M parameters on a GPU) is trained for a few hundred steps on the Python
standard library's own source files (byte-level tokens), with bf16 autocast on the GPU and fp32
master weights, so weights and Adam moments have real statistics. (CPU mode, a smoke test, computes
in fp32: on a CPU without native bf16 matrix units, autocast's bf16 products fall back to a scalar
path, and a training step of the 3M-parameter model took 13.8 s instead of 0.35 s.) Then it measures, on that state:

  - save(): the call's duration and the training stall (the call plus the GPU work the
    training stream must wait for), cold (first save) and warm;
  - time until durable (fsync'd and committed on the local tier), bytes written, saved %
    per category (fp32 weights, Adam exp_avg, exp_avg_sq) and for bf16 weights;
  - restore into the model's GPU tensors (page cache dropped where permitted), bit-exact;
  - CPU-written zstd restored on the GPU, GPU-written zstd restored on the CPU;
  - training step time and save() stall while the background migrator recompresses a step to a
    shared tier, against the same with the migrator idle.

    python scripts/bench.py                  # GPU, ~200M parameters
    python scripts/bench.py --device cpu     # CPU mode: small model, smoke test
    python scripts/bench.py --scale 24 --free-gb 6   # scale mode (scripts/scale.py): a 24 GB state,
                                                     # 6 GiB of GPU memory left free, side by side

Results print as a table and go to --out as JSON. Numbers belong here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiered  # noqa: E402
from gptmodel import GPT, batch as batch_of, shape_for, stdlib_corpus  # noqa: E402
import scale_args  # noqa: E402


def train(device: str, params: float, steps: int, ctx: int, batch: int, seed: int = 0):
    """Train a fresh model `steps` steps; returns (model, optimizer, info, step function, kit):
    `kit["make_model"]()` builds another model of the same shape, `kit["forward_backward"](m)`
    runs one forward and backward of model `m` on the same data (scale mode's replicas)."""
    torch.manual_seed(seed)
    d, layers, heads = shape_for(params)
    model = GPT(d, layers, heads, ctx).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    data = stdlib_corpus(64 << 20 if device == "cuda" else 4 << 20).to(device)

    def forward_backward(m) -> torch.Tensor:
        x, y = batch_of(data, ctx, batch)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = F.cross_entropy(m(x).float().view(-1, 256), y.view(-1))
        loss.backward()
        return loss

    def step_fn(before_update=None) -> torch.Tensor:
        """One training step; `before_update()`, if given, runs between backward and optimizer.step
        (where a checkpointer that overlaps the step must have finished reading the state)."""
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(model)
        if before_update is not None:
            before_update()
        opt.step()
        return loss

    t0 = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        loss = step_fn()
    if device == "cuda":
        torch.cuda.synchronize()
    n = sum(p.numel() for p in model.parameters())
    kit = {"make_model": lambda: GPT(d, layers, heads, ctx).to(device), "forward_backward": forward_backward}
    return model, opt, dict(params=n, width=d, layers=layers, ctx=ctx, batch=batch, train_steps=steps,
                            final_loss=round(loss.item(), 3),
                            train_s=round(time.perf_counter() - t0, 1)), step_fn, kit


def measure_migration(state, step_fn, device: str, root: Path, codec: str, mode: str, rounds: int = 3) -> dict:
    """Training while a migrator copies steps down to a shared tier (recompressing to zstd): the
    engine's child process (`process`, the default), its own thread (`in_process`) or a `tiered
    migrate --follow` daemon (`daemon`). Training step time and save() stall with the migrator
    busy, against the same with it idle.

    Step times come from `rounds` alternating rounds: every training step from a save until
    that step is on the shared tier (the migration as training feels it, whole), then as many
    steps with the migrator idle. The medians, quartiles and counts of all of them are
    reported: five steps, as this measured before, could not tell a 3% slowdown from drift.
    save() stalls likewise: per round one save while a step migrates and one with the migrator
    idle (besides the first pair), and their medians; one save each could not tell 2 ms apart."""
    import statistics
    import subprocess

    import yaml

    cfg = {"migration": {"daemon": "external"}.get(mode, mode), "tiers": [
        {"name": "local", "kind": "local", "path": str(root / "local"), "codec": codec},
        {"name": "shared", "kind": "posix", "path": str(root / "shared"), "codec": "zstd"}]}
    root.mkdir(parents=True, exist_ok=True)
    (root / "cluster.yaml").write_text(yaml.safe_dump(cfg))
    daemon = None
    if mode == "daemon":
        daemon = subprocess.Popen([sys.executable, "-m", "tiered.cli", "migrate", "--config", str(root / "cluster.yaml"),
                                   "--follow", "--interval", "0.2", "-q"])

    def steps_until(done, at_least: int, at_most: int = 2000) -> list[float]:
        """Times (ms) of training steps run until `done()`, at least `at_least` of them."""
        times: list[float] = []
        while len(times) < at_least or (len(times) < at_most and not done()):
            sync(device)
            t0 = time.perf_counter()
            step_fn()
            sync(device)
            times.append(1e3 * (time.perf_counter() - t0))
        return times

    def migrated(engine, steps) -> None:
        if daemon is None:
            engine.wait_migrated()
            return
        while not set(steps) <= set(engine.steps("shared")):
            assert daemon.poll() is None, "the migrate daemon exited"
            time.sleep(0.05)

    def quartiles(times: list[float]) -> list[float]:
        q = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
        return [round(q[0], 2), round(q[2], 2)]

    try:
        with tiered.Engine.from_config(root / "cluster.yaml") as engine:
            engine.save(1, state).wait()                    # warm-up: slabs, codecs; step 1 migrates
            migrated(engine, [1])
            idle_stall = measure_saves(engine, state, device, 1, first_step=2)[0]["stall_ms"]
            migrated(engine, [1, 2])
            t0 = time.perf_counter()
            engine.save(3, state).wait()                    # step 3 now migrates in the background
            time.sleep(0.3)                                 # (the daemon scans every 0.2 s)
            busy_stall = measure_saves(engine, state, device, 1, first_step=4)[0]["stall_ms"]
            migrated(engine, [3, 4])
            migrated_s = time.perf_counter() - t0
            manifest, index = engine.read_index(3, tier="shared")
            idle_rounds: list[list[float]] = []
            busy_rounds: list[list[float]] = []
            idle_stalls, busy_stalls = [idle_stall], [busy_stall]
            for r in range(rounds):
                step = 10 + 3 * r
                engine.save(step, state).wait()             # step migrates from here
                t1 = time.perf_counter()
                got = steps_until(lambda: mode != "daemon" or time.perf_counter() - t1 > 0.3, at_least=1)  # (its scan)
                if step not in engine.steps("shared"):      # a save while it migrates
                    busy_stalls.append(measure_saves(engine, state, device, 1, first_step=step + 1)[0]["stall_ms"])
                else:
                    engine.save(step + 1, state).wait()
                got += steps_until(lambda s=step: {s, s + 1} <= set(engine.steps("shared")), at_least=5)
                busy_rounds.append(got)
                migrated(engine, [step, step + 1])
                idle_rounds.append(steps_until(lambda: True, at_least=len(got)))
                idle_stalls.append(measure_saves(engine, state, device, 1, first_step=step + 2)[0]["stall_ms"])
                migrated(engine, [step + 2])
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(60)
    idle, busy = [t for r in idle_rounds for t in r], [t for r in busy_rounds for t in r]
    idle_step, busy_step = statistics.median(idle), statistics.median(busy)
    shutil.rmtree(root, ignore_errors=True)
    return {"mode": mode, "fast_codec": codec, "train_step_ms_idle": round(idle_step, 2), "train_step_ms_migrating": round(busy_step, 2),
            "train_step_slowdown_pct": round(100 * (busy_step / idle_step - 1), 1),
            "train_step_ms_idle_quartiles": quartiles(idle), "train_step_ms_migrating_quartiles": quartiles(busy),
            "train_steps_measured": {"idle": len(idle), "migrating": len(busy), "rounds": rounds},
            "steps_ms": {"idle": [[round(t, 1) for t in r] for r in idle_rounds],
                         "migrating": [[round(t, 1) for t in r] for r in busy_rounds]},
            "save_stall_ms_idle": round(statistics.median(idle_stalls), 2),
            "save_stall_ms_migrating": round(statistics.median(busy_stalls), 2),
            "save_stalls_ms": {"idle": idle_stalls, "migrating": busy_stalls},
            "seconds_to_shared_after_save": round(migrated_s, 2), "shared_codec": sorted({t.codec.name for t in index.tensors if t.chunks}),
            "shared_saved_pct": round(100 * manifest.saved_fraction, 2)}


# --- measurements ----------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def category(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    if name.startswith("optim."):
        return last if last in ("exp_avg", "exp_avg_sq") else "optim-other"
    return "weights"


def ratios(engine: tiered.Engine, step: int) -> dict[str, float]:
    _, index = engine.read_index(step)
    raw: dict[str, int] = {}
    stored: dict[str, int] = {}
    for t in index.tensors:
        c = category(t.name)
        raw[c] = raw.get(c, 0) + t.nbytes
        stored[c] = stored.get(c, 0) + t.stored_bytes
    out = {c: round(100 * (1 - stored[c] / raw[c]), 2) for c in raw if raw[c]}
    out["all"] = round(100 * (1 - sum(stored.values()) / sum(raw.values())), 2)
    return out


def bit_exact(a: dict, b: dict) -> bool:
    for k, v in a.items():
        w = b[k]
        if isinstance(v, dict):
            if not bit_exact(v, w):
                return False
        elif isinstance(v, torch.Tensor):
            if v.dtype != w.dtype or v.shape != w.shape or not torch.equal(
                    v.reshape(-1).view(torch.uint8).cpu(), w.reshape(-1).view(torch.uint8).cpu()):
                return False
    return True


def measure_saves(engine, state, device, repeats, first_step):
    rows = []
    for r in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        handle = engine.save(first_step + r, state)
        t_call = time.perf_counter() - t0
        sync(device)  # the training stream: it waits for compression to have read the tensors
        t_stall = time.perf_counter() - t0
        manifest = handle.wait()
        t_durable = time.perf_counter() - t0
        rows.append(dict(step=first_step + r, call_ms=round(1e3 * t_call, 2), stall_ms=round(1e3 * t_stall, 2),
                         durable_s=round(t_durable, 3), raw_bytes=manifest.raw_bytes,
                         stored_bytes=manifest.stored_bytes, saved_pct=round(100 * manifest.saved_fraction, 2),
                         phases_ms={k: round(v, 2) for k, v in handle.timings.items()}))
        print(f"# save step {first_step + r}: call {1e3 * t_call:.1f} ms, stall {1e3 * t_stall:.1f} ms, phases "
              + ", ".join(f"{k} {v:.1f}" for k, v in handle.timings.items()), flush=True)
    return rows


def profile_save(engine, state, device, step) -> None:
    import cProfile
    import pstats

    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    handle = engine.save(step, state)
    prof.disable()
    handle.wait()
    print(f"# profile of save(step={step}): top 12 by cumulative time", flush=True)
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(12)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--params", type=float, default=None, help="model size (default 200e6 GPU, 3e6 CPU)")
    ap.add_argument("--train-steps", type=int, default=None, help="default 200 GPU, 20 CPU")
    ap.add_argument("--repeats", type=int, default=3, help="warm saves measured after the first (cold) one")
    ap.add_argument("--dir", default="./.tiered/bench", help="local tier root (wiped)")
    ap.add_argument("--out", default=None, help="write results JSON here")
    ap.add_argument("--profile", action="store_true", help="print where the last warm save() call spent its time")
    ap.add_argument("--scale", default=None, metavar="GB[,GB...]",
                    help="scale mode (scripts/scale.py): per-GPU state sizes in GB, built from replicas of the "
                         "trained state; runs instead of the usual bench")
    scale_args.add_arguments(ap)
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per training step (default 16 GPU, 8 CPU; 256 tokens each on the GPU): larger "
                         "makes a step GPU-bound rather than bound by launching its kernels")
    ap.add_argument("--only-migration", action="store_true",
                    help="standard mode: only the migration rows (training while a step migrates to a shared tier)")
    ap.add_argument("--migration-codecs", default=None, metavar="CODEC[,CODEC...]",
                    help="standard mode: the fast tier's codec for the migration rows, one set of rows each "
                         "(default ans on a GPU, zstd on a CPU); none: the GPU never decodes for the migrator")
    ap.add_argument("--migration-modes", default="process,in_process,daemon", help="standard mode: migration modes")
    args = ap.parse_args()
    if args.scale:
        from scale_methods import row_spec
        for name in args.methods.split(","):  # (checked before the model trains)
            try:
                row_spec(name)
            except ValueError as exc:
                ap.error(f"--methods: {exc}")
    dev = args.device
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: the scale mode, every rank one GPU
        if not args.scale:
            ap.error("under torchrun only the scale mode runs (--scale)")
        import torch.distributed as dist

        if dev == "cuda":  # (a rank started seeing its own GPU alone, CUDA_VISIBLE_DEVICES=$LOCAL_RANK: GPU 0)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    params = args.params or (200e6 if dev == "cuda" else 3e6)
    steps = args.train_steps if args.train_steps is not None else (200 if dev == "cuda" else 20)
    ctx, batch = (256, 16) if dev == "cuda" else (128, 8)
    batch = args.batch or batch

    model, opt, info, step_fn, kit = train(dev, params, steps, ctx, batch)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    info.update(device=torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
                state_gb=round(state_bytes / 1e9, 3), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                tiered=tiered.__version__)
    print(f"# state: {info['params'] / 1e6:.0f}M parameters, {state_bytes / 1e9:.2f} GB (fp32 weights + AdamW), "
          f"trained {steps} steps in {info['train_s']} s, loss {info['final_loss']}", flush=True)
    results: dict = {"info": info}
    root = Path(args.dir)
    if not args.scale or int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(root, ignore_errors=True)

    import baselines

    if args.scale:
        return scale_mode(args, scale_live(args, model, opt, step_fn, kit), dev, root, results)

    codecs = ["ans", "zstd"] if dev == "cuda" else ["zstd"]
    moved = args.migration_codecs.split(",") if args.migration_codecs else codecs[:1]
    modes = args.migration_modes.split(",")
    if args.only_migration:
        results["migration"] = [measure_migration(state, step_fn, dev, root / "migration", codec, mode)
                                for codec in moved for mode in modes]
        print_table(results)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return 0

    results["ceilings"] = {"disk": baselines.disk_ceilings(root / "ceiling", (2 << 30) if dev == "cuda" else (256 << 20))}
    if dev == "cuda":
        results["ceilings"]["d2h_pinned_gbps"] = baselines.d2h_pinned_gbps()
        results["ceilings"]["gpu_codecs"] = baselines.gpu_codec_gbps(list(_tensors(state)))
    print(f"# ceilings: {results['ceilings']}", flush=True)
    rows = {"torch_save": baselines.torch_save_row(state, None, root / "torch_save", dev, state_bytes, drop_caches,
                                                  bit_exact)}
    rows.update(baselines.dcp_rows(state, lambda: zeros_like_tree(state), root / "dcp", dev, state_bytes, drop_caches,
                                   bit_exact))
    if dev == "cuda":
        rows["blog_pipeline"] = baselines.blog_row(list(_tensors(state)), root / "blog", state_bytes)
    results["baselines"] = rows
    print(f"# baselines: {rows}", flush=True)
    results["s3"] = baselines.s3_vs_boto3(state, root / "s3")

    for codec in codecs:
        cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(root / codec), "codec": codec}]}
        with tiered.Engine.from_config(cfg) as engine:
            saves = measure_saves(engine, state, dev, 1 + args.repeats, first_step=1)
            if args.profile:
                profile_save(engine, state, dev, step=50)
            r = {"saves": saves, "ratios": ratios(engine, 1), "io": engine.read_index(1)[1].io}
            bf16 = {"model": {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                              for k, v in state["model"].items()}}
            engine.save(100, bf16).wait()
            r["bf16_weights_saved_pct"] = ratios(engine, 100)["weights"]
            target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                      "optim": opt.state_dict()}
            dropped = drop_caches()
            sync(dev)
            t0 = time.perf_counter()
            engine.restore(target, step=1)
            sync(dev)
            r["restore_s"] = round(time.perf_counter() - t0, 3)
            r["restore_cold_cache"] = dropped
            r["restore_bit_exact"] = bit_exact(state["model"], target["model"])
            results[codec] = r
        shutil.rmtree(root / codec, ignore_errors=True)

    if dev == "cuda":
        results["interop"] = interop(state, root / "interop")
    results["migration"] = [measure_migration(state, step_fn, dev, root / "migration", codec, mode)
                            for codec in moved for mode in modes]
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    ok = all(results[c]["restore_bit_exact"] for c in codecs) and results.get("interop", {}).get("ok", True)
    return 0 if ok else 1


def scale_live(args, model, opt, step_fn, kit):
    """The live replica(s) scale mode builds its state from (scripts/scale.py)."""
    import scale_measure

    if args.train == "one":
        return scale_measure.Live({"model": model.state_dict(), "optim": opt.state_dict()}, step_fn, [opt])
    return scale_measure.TrainedReplicas(model, opt, kit["make_model"], kit["forward_backward"])


def scale_mode(args, live, dev: str, root: Path, results: dict) -> int:
    """Each size of --scale in turn (scripts/scale.py), then the tables; JSON to --out."""
    import baselines
    import scale
    import scale_measure

    def ceilings(nbytes: int, tensors: list) -> dict:
        out = {"disk": baselines.disk_ceilings(root / "ceiling", max(256 << 20, min(nbytes, 4 << 30)))}
        shutil.rmtree(root / "ceiling", ignore_errors=True)
        if dev == "cuda":
            out["d2h_pinned_gbps"] = baselines.d2h_pinned_gbps()
            out["gpu_codecs"] = baselines.gpu_codec_gbps(tensors)
            torch.cuda.empty_cache()  # (its buffers: the engines size their GPU budgets from what is free)
        return out

    lead = scale_measure.rank() == 0  # under torchrun, rank 0 reports for all ranks (scripts/scale.py)
    scale_measure.show_engine_log()
    results["scale"] = []
    results["info"]["ranks"] = scale_measure.world()
    for size in (float(x) for x in args.scale.split(",")):
        out = scale.run_size(size, live, dev, root, free_gb=args.free_gb, saves=args.saves,
                             window_steps=args.window_steps, methods=args.methods.split(","),
                             drop_caches=drop_caches, ceilings=ceilings, gil_watch=args.gil_watch, trace=args.trace,
                             settle_ms=args.settle_ms, lead_in_s=args.lead_in_s, codec=args.codec,
                             shared_dir=Path(args.shared_dir) if args.shared_dir else None,
                             progress=lambda partial: lead and args.out and Path(args.out).write_text(
                                 json.dumps({**results, "scale": results["scale"] + [partial]}, indent=1)))
        results["scale"].append(out)
        if lead:
            scale.print_size(out)
        if args.out and lead:  # after each size: a later size that dies keeps the earlier ones
            Path(args.out).write_text(json.dumps(results, indent=1))
        if dev == "cuda":
            torch.cuda.empty_cache()
    scale_measure.barrier()
    if lead:
        shutil.rmtree(root, ignore_errors=True)
    from scale_methods import LOAD_SPECS

    ran = [r for out in results["scale"] for r in out["rows"] if not r["error"]]
    exact = [r["restore_bit_exact"] for r in ran if not r["name"].startswith(tuple(LOAD_SPECS))]  # (no save)
    return 0 if ran and all(exact) else 1


def interop(state, root: Path) -> dict:
    """CPU-written zstd restored on the GPU; GPU-written zstd restored on the CPU."""
    cfg = {"tiers": [{"name": "local", "kind": "local", "path": str(root), "codec": "zstd"}]}
    model = state["model"]
    with tiered.Engine.from_config(cfg) as engine:
        engine.save(1, {"model": {k: v.cpu() for k, v in model.items()}}).wait()
        engine.save(2, {"model": model}).wait()
        on_gpu = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
        engine.restore(on_gpu, step=1)
        cpu_to_gpu = bit_exact(model, on_gpu["model"])
        gpu_to_cpu = bit_exact(model, engine.load(2, device="cpu")["model"])
        ios = (engine.read_index(1)[1].io, engine.read_index(2)[1].io)
    shutil.rmtree(root, ignore_errors=True)
    return {"cpu_written_restored_on_gpu": cpu_to_gpu, "gpu_written_restored_on_cpu": gpu_to_cpu,
            "writers": ios, "ok": cpu_to_gpu and gpu_to_cpu}


def zeros_like_tree(obj):
    """The same structure with every tensor zeroed (a restore target); other values as they are."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: zeros_like_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [zeros_like_tree(v) for v in obj]
    return obj


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def print_table(results: dict) -> None:
    info = results["info"]
    print(f"\n## {info['device']}, {info['date']}: {info['params'] / 1e6:.0f}M params, {info['state_gb']} GB state")
    print("| codec | save() call ms (cold / warm median) | stall ms (cold / warm median) | durable s (warm) | "
          "stored GB | saved % all / weights / exp_avg / exp_avg_sq | bf16 weights saved % | restore s | bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for codec in ("ans", "zstd"):
        r = results.get(codec)
        if not r:
            continue
        s = r["saves"]
        warm = s[1:] or s
        med = lambda key: sorted(x[key] for x in warm)[len(warm) // 2]  # noqa: E731
        ra = r["ratios"]
        print(f"| {codec} | {s[0]['call_ms']} / {med('call_ms')} | {s[0]['stall_ms']} / {med('stall_ms')} | "
              f"{med('durable_s')} | {s[0]['stored_bytes'] / 1e9:.3f} | {ra['all']} / {ra.get('weights')} / "
              f"{ra.get('exp_avg')} / {ra.get('exp_avg_sq')} | {r['bf16_weights_saved_pct']} | {r['restore_s']}"
              f"{'' if r['restore_cold_cache'] else ' (warm cache)'} | {r['restore_bit_exact']} |")
    if "interop" in results:
        i = results["interop"]
        print(f"\nzstd interop: CPU-written -> GPU restore bit-exact: {i['cpu_written_restored_on_gpu']}; "
              f"GPU-written -> CPU restore bit-exact: {i['gpu_written_restored_on_cpu']} (writers: {i['writers']})")
    print_side_by_side(results)
    if results.get("s3"):
        x = results["s3"]
        print(f"\nS3 upload, same bytes, same server (local SeaweedFS): tiered {x['tiered_mbps']} MB/s, "
              f"plain boto3 multipart {x['boto3_mbps']} MB/s; download: tiered {x['tiered_down_mbps']} MB/s, boto3 "
              f"{x['boto3_down_mbps']} MB/s ({x['bytes'] / 1e6:.1f} MB; {x['note']})")
    elif "s3" in results:
        print("\nS3 upload comparison skipped: needs boto3 and SeaweedFS's `weed` (pip install 'tiered[demo]')")
    for m in results.get("migration", ()):
        print(f"\nmigration ({m['mode']}, fast tier {m.get('fast_codec', 'ans')}) to a shared tier ({'+'.join(m['shared_codec'])}, {m['shared_saved_pct']}% saved): "
              f"training step {m['train_step_ms_idle']} ms idle / {m['train_step_ms_migrating']} ms while migrating "
              f"({m['train_step_slowdown_pct']:+}%; medians of {m['train_steps_measured']['idle']} / "
              f"{m['train_steps_measured']['migrating']} steps, quartiles {m['train_step_ms_idle_quartiles']} / "
              f"{m['train_step_ms_migrating_quartiles']}); "
              f"save() stall {m['save_stall_ms_idle']} ms idle / {m['save_stall_ms_migrating']} ms while migrating "
              f"(medians of {len(m['save_stalls_ms']['idle'])} / {len(m['save_stalls_ms']['migrating'])} saves: "
              f"{m['save_stalls_ms']['idle']} / {m['save_stalls_ms']['migrating']}); "
              f"steps 3 and 4 on the shared tier {m['seconds_to_shared_after_save']} s after step 3's save()")


def print_side_by_side(results: dict) -> None:
    """Every way of saving this state, on the same disk, with the run's ceilings and the targets."""
    ceil = results.get("ceilings", {})
    disk = ceil.get("disk", {})
    print(f"\nceilings (same run): disk write {disk.get('write_gbps')} GB/s, read {disk.get('read_gbps')} GB/s "
          f"({disk.get('threads')} threads, {disk.get('block_mib')} MiB, O_DIRECT {disk.get('o_direct')})"
          + (f"; pinned D2H {ceil['d2h_pinned_gbps']} GB/s" if "d2h_pinned_gbps" in ceil else "")
          + "".join(f"; GPU {k} encode {v['encode_gbps']} GB/s" for k, v in ceil.get("gpu_codecs", {}).items()))
    print("| method | training stall ms | durable s | written GB | saved % | cold restore s | bit-exact | note |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.get("baselines", {}).items():
        print(f"| {name} | {r['stall_ms']} | {r['durable_s']} | {r['stored_bytes'] / 1e9:.3f} | {r['saved_pct']} | "
              f"{r['restore_s'] if r['restore_s'] is not None else 'n/m'} | "
              f"{r['restore_bit_exact'] if r['restore_bit_exact'] is not None else 'n/m'} | {r['note']} |")
    for codec in ("ans", "zstd"):
        r = results.get(codec)
        if not r:
            continue
        warm = r["saves"][1:] or r["saves"]
        med = lambda key: sorted(x[key] for x in warm)[len(warm) // 2]  # noqa: E731
        print(f"| tiered {codec} | {med('stall_ms')} | {med('durable_s')} | {r['saves'][0]['stored_bytes'] / 1e9:.3f} | "
              f"{r['ratios']['all']} | {r['restore_s']} | {r['restore_bit_exact']} | warm median |")
    r = results.get("ans")
    if not r or not disk:
        return
    warm = r["saves"][1:] or r["saves"]
    stall = sorted(x["stall_ms"] for x in warm)[len(warm) // 2]
    durable = sorted(x["durable_s"] for x in warm)[len(warm) // 2]
    stored = r["saves"][0]["stored_bytes"]
    durable_bound = 1.15 * stored / (disk["write_gbps"] * 1e9)
    restore_bound = 1.15 * stored / (disk["read_gbps"] * 1e9)
    checks = [("stall <= 25 ms", stall <= 25, f"{stall} ms"),
              ("durable <= 1.15 x stored / disk write", durable <= durable_bound, f"{durable} s vs {durable_bound:.3f} s"),
              ("cold restore <= 1.15 x stored / disk read (+ decode, not counted)", r["restore_s"] <= restore_bound,
               f"{r['restore_s']} s vs {restore_bound:.3f} s"),
              ("saved >= 16% (fp32 + Adam)", r["ratios"]["all"] >= 16, f"{r['ratios']['all']} %"),
              ("saved >= 33% (bf16 weights)", r["bf16_weights_saved_pct"] >= 33, f"{r['bf16_weights_saved_pct']} %")]
    print("\n| target (ans) | met | measured |\n|---|---|---|")
    for name, ok, got in checks:
        print(f"| {name} | {'yes' if ok else 'MISSED'} | {got} |")
    results["targets"] = {name: {"met": ok, "measured": got} for name, ok, got in checks}


if __name__ == "__main__":
    sys.exit(main())
