"""Command line: `tiered-restore` for cold starts, `tiered ls | verify | gc | migrate | restore`.

Every command reads the cluster YAML given with --config (default: the embedded configs/local.yaml)
and works on its tiers through the same `TierCatalog` as `Engine.steps()`; none of them needs a
GPU unless a step must be recompressed from a GPU-only codec (ans). Exit status: 0 success, 1 the
work failed (nothing restorable, damage found, a copy failed), 2 bad usage or config.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any, Sequence

from tiered.cli.common import (EXIT_FAILED, EXIT_OK, EXIT_USAGE, Progress, common_options, parse_step, read_here, run,
                               verify_steps)
from tiered.cli.restore import RESTORE_DESCRIPTION, RESTORE_EPILOG, cmd_restore, restore_main, restore_parser
from tiered.cli.stats import add_parsers as add_stats_parsers
from tiered.errors import TieredError
from tiered.format.manifest import read_step
from tiered.tiers.catalog import TierCatalog
from tiered.units import format_size

__all__ = ["main", "restore_main", "verify_steps"]

log = logging.getLogger("tiered")


# --- tiered ls -----------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace, catalog: TierCatalog) -> int:
    committed = catalog.committed()
    steps = sorted(set().union(*(set(s) for s in committed.values() if s is not None)))
    cells: dict[tuple[int, str], dict[str, Any]] = {}
    for name, held in committed.items():
        for step in held or ():
            try:
                manifest, indexes = read_here(catalog, name, step)
            except (TieredError, OSError) as exc:
                cells[step, name] = {"error": str(exc)}
                continue
            codecs = sorted({t.codec.name for ix in indexes for t in ix.tensors if t.chunks})
            cells[step, name] = {"raw_bytes": manifest.raw_bytes, "stored_bytes": manifest.stored_bytes,
                                 "saved": manifest.saved_fraction, "codecs": codecs, "created": manifest.created,
                                 "ranks": manifest.world_size, "ranks_listed": len(manifest.ranks),
                                 "ranks_here": [ix.rank for ix in indexes]}
    if args.json:
        print(json.dumps({"tiers": {n: (None if s is None else s) for n, s in committed.items()},
                          "steps": [{"step": st, **{n: cells.get((st, n)) for n in catalog.names}} for st in steps]},
                         indent=1))
        return EXIT_OK
    for name in catalog.names:
        state = "unreachable" if committed[name] is None else f"{len(committed[name])} steps"
        print(f"# {catalog.describe(name)}: {state}")
    if not steps:
        print("no committed steps")
        return EXIT_OK
    header = ["step", "state"] + catalog.names
    rows = []
    for st in steps:
        raw = next((c["raw_bytes"] for n in catalog.names if (c := cells.get((st, n))) and "raw_bytes" in c), 0)
        row = [str(st), format_size(raw)]
        for n in catalog.names:
            c = cells.get((st, n))
            if c is None:
                row.append("-")
            elif "error" in c:
                row.append("UNREADABLE")
            else:
                here = "" if len(c["ranks_here"]) == c["ranks_listed"] else \
                    f" ({len(c['ranks_here'])} of {c['ranks']} ranks here)"
                row.append(f"{format_size(c['stored_bytes'])} {'+'.join(c['codecs']) or 'empty'} "
                           f"{100 * c['saved']:.1f}%{here}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(c.rjust(w) if i < 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    print("cells: stored size, codecs, % saved against the raw state")
    return EXIT_OK


# --- tiered verify -------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace, catalog: TierCatalog) -> int:
    names = [args.tier] if args.tier else catalog.names
    for n in names:
        catalog.get(n)
    committed = catalog.committed(names)
    work = []
    for name, held in committed.items():
        if held is None:
            continue
        if args.step == "all":
            picked = held
        elif args.step == "latest":
            picked = held[-1:]
        else:
            picked = [s for s in held if s == args.step]
        work.extend((name, s) for s in picked)
    if not work:
        print("tiered verify: no committed step matches", file=sys.stderr)
        return EXIT_FAILED
    failed = verify_steps(catalog, work, quick=args.quick, show=not args.quiet)
    return EXIT_FAILED if failed or any(v is None for v in committed.values()) else EXIT_OK


# --- tiered gc -----------------------------------------------------------------------------
def cmd_gc(args: argparse.Namespace, catalog: TierCatalog) -> int:
    from tiered.tiers.retention import apply_retention, reclaim_debris

    verb = "would remove" if args.dry_run else "removed"
    for name, lines in reclaim_debris(catalog.config, catalog.get, dry_run=args.dry_run).items():
        print(f"tier {name!r}: {verb} {len(lines) or 'no'} leftover{'s' if len(lines) != 1 else ''} of writers "
              "that stopped")
        for line in lines:
            print(f"  {line}")
    rules = {t.name: t for t in catalog.config.tiers if t.retention}
    if not rules:
        print("no tier has keep_last or keep_every: no step to collect")
        return EXIT_OK
    done = apply_retention(catalog.config, catalog.get, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for name, t in rules.items():
        steps = done.get(name, {})
        rule = ", ".join(f"{k} {getattr(t, k)}" for k in ("keep_last", "keep_every") if getattr(t, k) is not None)
        print(f"tier {name!r} ({rule}): {verb} {', '.join(map(str, steps)) if steps else 'nothing'}")
        for step, why in steps.items():
            print(f"  step {step}: {why}")
    return EXIT_OK


# --- tiered migrate ------------------------------------------------------------------------
def cmd_migrate(args: argparse.Namespace, catalog: TierCatalog) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from tiered.migrate.migrator import (MigrationLock, background_threads, lower_process_priority, make_gpu_recoder,
                                         migrate_down, pending_steps)
    from tiered.stage.cpu import WindowBuffers
    from tiered.tiers.retention import apply_retention, reclaim_debris

    config = catalog.config
    if len(config.tiers) < 2:
        print(f"tiered migrate: {config.source} has one tier: nothing to migrate to", file=sys.stderr)
        return EXIT_USAGE
    lock = MigrationLock(config.fast_tier.path)
    if not lock.acquire():
        print(f"tiered migrate: another migrator (pid {lock.holder()}) holds {lock.path}", file=sys.stderr)
        return EXIT_FAILED
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: (log.info("tiered: stopping after the current step"), stop.set()))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    failures = 0
    try:
        if not args.full_speed:
            lower_process_priority()  # (before any thread starts: they inherit it)
        reclaim_debris(config, catalog.get)  # what an earlier, killed run left (each removal is logged)
        gpu = make_gpu_recoder(config)
        log.info("tiered: migrating %s%s (%s)", " -> ".join(catalog.names), ", following" if args.follow else "",
                 "GPU recompression" if gpu is not None else "CPU recompression")
        threads = (config.zstd.threads or None) if args.full_speed else background_threads()
        buffers = WindowBuffers()  # read windows kept from one step to the next
        if args.follow:
            # A daemon's start-up objects (torch's and botocore's modules) never become garbage: kept
            # out of Python's full collections, as the engine's migrator process keeps its own
            # (tiered.migrate.process). Parsing a step's index set one off every other step in a
            # process like it: 76-93 ms each (docs/benchmarks.md).
            import gc

            gc.freeze()
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiered-codec") as pool:
            while True:
                try:
                    todo = pending_steps(config, catalog.get)
                except (TieredError, OSError) as exc:
                    log.error("tiered: cannot list the tiers: %s", exc)
                    todo = []
                    failures += 1
                for step in todo:
                    if stop.is_set():
                        break
                    try:
                        manifest, _ = read_step(catalog.get(next(n for n in catalog.names
                                                                  if catalog.get(n).has_step(step))), step)
                        bar = Progress(f"step {step}", manifest.raw_bytes * (len(catalog.names) - 1),
                                       enabled=not args.quiet)
                        migrate_down(step, config, catalog.get, pool=pool, gpu=gpu, progress=bar, buffers=buffers)
                        bar.finish()
                    except (TieredError, OSError) as exc:
                        failures += 1
                        log.error("tiered: migration of step %d failed (it stays on the faster tiers): %s", step, exc)
                try:
                    apply_retention(config, catalog.get)
                except (TieredError, OSError) as exc:
                    log.error("tiered: retention failed: %s", exc)
                if not args.follow or stop.wait(args.interval):
                    break
    finally:
        lock.release()
        for sig, handler in previous.items():  # called as a function (tests, a host program): leave no handler behind
            signal.signal(sig, handler)
    return EXIT_FAILED if failures and not args.follow else EXIT_OK


# --- argument parsing ----------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tiered", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="tiered: GPU-direct tiered checkpoints. Inspect, verify, migrate and prune the "
                    "checkpoints a catalog config describes.",
        epilog="Run `tiered COMMAND --help` for each command. Cold starts: `tiered-restore --help`.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = sub.add_parser("ls", help="steps x tiers: stored size, codecs and %% saved of every committed step",
                        description="List every committed step on every tier as a table: rows are steps, columns "
                                    "are tiers; each cell shows the stored size, the codecs and the percentage saved "
                                    "against the raw state ('-': not on that tier).")
    common_options(ls)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_ls)
    ve = sub.add_parser("verify", help="read every chunk of committed steps and check it",
                        description="Read every chunk of the chosen steps, check its checksum and decode it where "
                                    "this machine can (CPU codecs; ans needs a GPU and gets its checksum checked). "
                                    "Prints one line per tier and step; exit status 1 when anything is damaged.")
    common_options(ve)
    ve.add_argument("--step", default="latest", metavar="N|latest|all",
                    type=lambda s: s if s in ("all", "latest") else parse_step(s),
                    help="which steps (default: latest on each tier)")
    ve.add_argument("--tier", metavar="TIER", help="only this tier (default: every tier)")
    ve.add_argument("--quick", action="store_true", help="checksums only, no decoding")
    ve.set_defaults(fn=cmd_verify)
    gc = sub.add_parser("gc", help="remove stopped writers' leftovers; apply the retention rules (keep_last, "
                                   "keep_every)",
                        description="Remove what writers that stopped left on every tier (uncommitted copies, "
                                    "unfinished deletions and uploads: a process of this host that has exited, "
                                    "or files of another host unchanged for 6 hours), then delete the steps each "
                                    "tier's keep_last / keep_every rules let go. Never the "
                                    "newest step, never one a restore or a migration is reading; above the last "
                                    "tier, only once a slower tier holds the step or no slower tier would keep it. "
                                    "The last tier (or the only one) is bounded by its rules too. The engine and "
                                    "the migrator apply the same rule after each save or copy; run it by hand "
                                    "after changing the rules.")
    common_options(gc)
    gc.add_argument("--dry-run", "-n", action="store_true", help="print what would be deleted; delete nothing")
    gc.set_defaults(fn=cmd_gc)
    mi = sub.add_parser("migrate", help="copy committed steps down the tiers (a daemon with --follow)",
                        description="Copy every committed step down the configured tiers, recompressing where a "
                                    "tier's codec differs (on the GPU when there is one), then apply retention. "
                                    "Resumable: a killed run leaves nothing half-committed and the next run "
                                    "finishes the work. Set `migration: external` in the config so that the "
                                    "training process leaves migration to this daemon; one migrator per local "
                                    "tier runs at a time (a lock file in it).")
    common_options(mi)
    mi.add_argument("--follow", "-f", action="store_true",
                    help="keep running: look for new steps every --interval seconds until SIGTERM/SIGINT")
    mi.add_argument("--interval", type=float, default=10.0, metavar="S", help="seconds between scans (default 10)")
    mi.add_argument("--full-speed", action="store_true",
                    help="use every core at normal priority (default: a quarter of the cores, niced, so that "
                         "training on the same node keeps the machine)")
    mi.set_defaults(fn=cmd_migrate)
    add_stats_parsers(sub, common_options)
    re_ = sub.add_parser("restore", help="the same as tiered-restore", description=RESTORE_DESCRIPTION,
                         epilog=RESTORE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    restore_parser(re_)
    re_.set_defaults(fn=cmd_restore)
    return run(p, None, argv)
