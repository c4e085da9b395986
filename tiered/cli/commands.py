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
import time
from typing import Any, Callable, Sequence, TextIO

from tiered.cli.stats import add_parsers as add_stats_parsers
from tiered.config import load_config
from tiered.errors import CheckpointNotFoundError, ConfigError, TieredError
from tiered.format.manifest import present_ranks, read_pinned, read_step
from tiered.restore.pipeline import verify_step
from tiered.tiers.catalog import TierCatalog
from tiered.units import format_rate, format_size

log = logging.getLogger("tiered")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class Progress:
    """A progress line on stderr: bytes done of total, rate, time left. Redrawn in place on a
    terminal (at most 10 times a second); elsewhere (logs, CI) one line every 5 seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, enabled: bool = True):
        self.label, self.total, self.done = label, max(total, 0), 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.t0 = self._last = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.enabled and now - self._last >= (0.1 if self.tty else 5.0):
                self._last = now
                self._draw(now)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.t0, 1e-9)
        rate = self.done / elapsed
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        left = (self.total - self.done) / rate if rate > 0 and self.total > self.done else 0.0
        return (f"{self.label} [{bar}] {format_size(self.done)} / {format_size(self.total)}  "
                f"{format_rate(rate)}  {_clock(left)} left")

    def _draw(self, now: float) -> None:
        text = self.line(now)
        self.stream.write(f"\r{text}\x1b[K" if self.tty else text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _parse_step(text: str) -> int | None:
    if text == "latest":
        return None
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number or 'latest', got {text!r}") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"steps are non-negative, got {step}")
    return step


# --- tiered-restore ------------------------------------------------------------------------
def cmd_restore(args: argparse.Namespace, catalog: TierCatalog) -> int:
    from tiered.migrate.migrator import migrate_step

    committed = catalog.committed()
    listing = "\n".join(f"  {catalog.describe(n)}: "
                        f"{'unreachable' if s is None else (', '.join(map(str, s[-8:])) or 'no steps')}"
                        for n, s in committed.items())
    try:
        step, order = catalog.restore_order(args.step, committed=committed)
    except CheckpointNotFoundError:
        why = "nothing restorable: no tier holds a committed checkpoint" if args.step is None else \
            f"step {args.step} is not committed on any tier"
        print(f"tiered-restore: {why}\n{listing}", file=sys.stderr)
        return EXIT_FAILED
    sources = [t.name for t in order]
    if args.verify_only:
        return verify_steps(catalog, [(sources[0], step)], quick=False, show=not args.quiet)
    to = args.to or catalog.names[0]
    dst = catalog.get(to)
    if to in sources:
        if verify_steps(catalog, [(to, step)], quick=False, show=not args.quiet) == EXIT_OK:
            print(f"step {step} is already on tier {to!r} ({dst.root}), verified: nothing to copy")
            return EXIT_OK
        others = [n for n in sources if n != to]
        # The damaged copy goes only once another tier's copy has verified whole: where every copy
        # is damaged in places, each may still hold the chunks the others lack (Engine.load and
        # Engine.restore read chunk by chunk across tiers), and none is deleted.
        intact = next((n for n in others if verify_steps(catalog, [(n, step)], quick=False, show=False) == EXIT_OK),
                      None)
        if intact is None:
            held = f"tiers {', '.join(repr(n) for n in others)} hold" if others else "no other tier holds"
            print(f"tiered-restore: step {step} on tier {to!r} is damaged and {held} no intact copy of it: nothing "
                  f"was deleted. Engine.restore and Engine.load still read it chunk by chunk from every tier that "
                  f"holds it", file=sys.stderr)
            return EXIT_FAILED
        print(f"step {step} on tier {to!r} is damaged: replacing it from tier {intact!r} (verified whole)",
              file=sys.stderr)
        dst.delete(step)
        sources = [intact]
    for name in sources:
        if name == to:
            continue
        src = catalog.get(name)
        manifest, _ = read_step(src, step)
        bar = Progress(f"step {step} {name} -> {to}", manifest.raw_bytes, enabled=not args.quiet)
        t0 = time.perf_counter()
        try:
            # Chunks keep their codec (zstd from a portable tier stays zstd: restorable with or
            # without a GPU); every chunk's checksum is verified on the way.
            m = migrate_step(step, src, dst, codec=None, settings=catalog.config.zstd, progress=bar)
        except (TieredError, OSError) as exc:
            bar.finish()
            print(f"tiered-restore: copying step {step} from tier {name!r} failed: {exc}", file=sys.stderr)
            continue
        bar.finish()
        seconds = time.perf_counter() - t0
        stored = m.stored_bytes if m is not None else manifest.stored_bytes
        print(f"restored step {step} from tier {name!r} to tier {to!r} ({dst.root}): {format_size(stored)} "
              f"stored for {format_size(manifest.raw_bytes)} of state in {seconds:.2f} s "
              f"({format_rate(manifest.raw_bytes / max(seconds, 1e-9))})")
        return EXIT_OK
    print(f"tiered-restore: no tier could supply step {step} intact", file=sys.stderr)
    return EXIT_FAILED


# --- tiered ls -----------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace, catalog: TierCatalog) -> int:
    committed = catalog.committed()
    steps = sorted(set().union(*(set(s) for s in committed.values() if s is not None)))
    cells: dict[tuple[int, str], dict[str, Any]] = {}
    for name, held in committed.items():
        for step in held or ():
            try:
                manifest, indexes = _read_here(catalog, name, step)
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


def _read_here(catalog: TierCatalog, name: str, step: int) -> tuple[Any, list[Any]]:
    """The step's manifest and indexes on tier `name`. The fast tier is node-local: of a step
    saved by several nodes it holds this node's ranks only. Every other tier must hold them all."""
    tier = catalog.get(name)
    return present_ranks(tier, step) if name == catalog.names[0] else read_step(tier, step)


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


def verify_steps(catalog: TierCatalog, work: list[tuple[str, int]], *, quick: bool, show: bool) -> int:
    """Read every chunk of each (tier, step), check its checksum and, unless `quick`, decode it
    where this machine can (CPU codecs always; ans needs a GPU and gets its checksums checked)."""
    from concurrent.futures import ThreadPoolExecutor

    bad = 0
    with ThreadPoolExecutor(thread_name_prefix="tiered-verify") as pool:
        for name, step in work:
            tier = catalog.get(name)
            try:
                manifest, indexes = _read_here(catalog, name, step)
                if manifest.dcp is not None:
                    read_pinned(tier, step, manifest.dcp)  # size and checksum against the manifest
                bar = Progress(f"verify {name} step {step}", manifest.raw_bytes, enabled=show)
                notes = verify_step(tier, step, indexes, pool, catalog.config.zstd, quick=quick, progress=bar)
                bar.finish()
            except (TieredError, OSError) as exc:
                bad += 1
                print(f"DAMAGED  tier {name!r} step {step}: {exc}")
                continue
            if len(indexes) < len(manifest.ranks):
                # A node-local tier of a multi-node save holds this node's ranks only.
                notes += (f"; ranks {[ix.rank for ix in indexes]} of {manifest.world_size} here (the others are "
                          "on their own nodes' tiers)")
            print(f"ok       tier {name!r} step {step}: {format_size(manifest.stored_bytes)}, "
                  f"{sum(len(t.chunks) for ix in indexes for t in ix.tensors)} chunks{notes}")
    return EXIT_FAILED if bad else EXIT_OK


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
_CONFIG_HELP = "catalog YAML (default: the embedded configs/local.yaml: one local tier under ./.tiered)"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="C", help=_CONFIG_HELP)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines; warnings and errors only")


def _restore_parser(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--step", type=_parse_step, default=None, metavar="N|latest",
                   help="step to restore (default: latest, the newest step committed on any tier)")
    p.add_argument("--to", metavar="TIER", help="tier to restore into (default: the first tier, node-local)")
    p.add_argument("--verify-only", action="store_true",
                   help="read and check the step where it is (the fastest tier holding it); copy nothing")


RESTORE_DESCRIPTION = """\
Cold start: bring a committed checkpoint step onto this node's local tier.

Finds the fastest tier that holds the step (local, then the shared filesystem, then S3, in the
order of the config), copies it into --to (default: the first, node-local tier) and checks every
chunk's checksum on the way; a damaged source falls back to the next tier. The training script's
`engine.restore(state)` then reads it from local disk. Chunks keep their codec, so a copy from a
portable tier (zstd) restores on machines with or without a GPU.

Exit status: 0 restored (or already there and verified), 1 nothing restorable or every copy
failed, 2 bad usage or config.
"""

RESTORE_EPILOG = """\
examples:
  tiered-restore --config cluster.yaml                  # newest step, into the local tier
  tiered-restore --config cluster.yaml --step 12000
  tiered-restore --config cluster.yaml --verify-only    # check the newest step where it is
"""


def restore_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tiered-restore", description=RESTORE_DESCRIPTION, epilog=RESTORE_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _restore_parser(p)
    return _run(p, cmd_restore, argv)


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
    _common(ls)
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_ls)
    ve = sub.add_parser("verify", help="read every chunk of committed steps and check it",
                        description="Read every chunk of the chosen steps, check its checksum and decode it where "
                                    "this machine can (CPU codecs; ans needs a GPU and gets its checksum checked). "
                                    "Prints one line per tier and step; exit status 1 when anything is damaged.")
    _common(ve)
    ve.add_argument("--step", default="latest", metavar="N|latest|all",
                    type=lambda s: s if s in ("all", "latest") else _parse_step(s),
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
    _common(gc)
    gc.add_argument("--dry-run", "-n", action="store_true", help="print what would be deleted; delete nothing")
    gc.set_defaults(fn=cmd_gc)
    mi = sub.add_parser("migrate", help="copy committed steps down the tiers (a daemon with --follow)",
                        description="Copy every committed step down the configured tiers, recompressing where a "
                                    "tier's codec differs (on the GPU when there is one), then apply retention. "
                                    "Resumable: a killed run leaves nothing half-committed and the next run "
                                    "finishes the work. Set `migration: external` in the config so that the "
                                    "training process leaves migration to this daemon; one migrator per local "
                                    "tier runs at a time (a lock file in it).")
    _common(mi)
    mi.add_argument("--follow", "-f", action="store_true",
                    help="keep running: look for new steps every --interval seconds until SIGTERM/SIGINT")
    mi.add_argument("--interval", type=float, default=10.0, metavar="S", help="seconds between scans (default 10)")
    mi.add_argument("--full-speed", action="store_true",
                    help="use every core at normal priority (default: a quarter of the cores, niced, so that "
                         "training on the same node keeps the machine)")
    mi.set_defaults(fn=cmd_migrate)
    add_stats_parsers(sub, _common)
    re_ = sub.add_parser("restore", help="the same as tiered-restore", description=RESTORE_DESCRIPTION,
                         epilog=RESTORE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _restore_parser(re_)
    re_.set_defaults(fn=cmd_restore)
    return _run(p, None, argv)


def _run(parser: argparse.ArgumentParser, fn: Callable[..., int] | None, argv: Sequence[str] | None) -> int:
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("botocore").setLevel(logging.WARNING)
    try:
        catalog = TierCatalog(load_config(args.config))
        return (fn or args.fn)(args, catalog)
    except ConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TieredError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130

