"""`tiered-restore` (and `tiered restore`): bring a committed step onto a tier, for a cold start.

The copy is built aside and committed whole; a chunk that fails its checksum on the source is
taken from another tier's copy of the step (`tiered.stage.repair`), the damaged copy on the target
included, so that copies damaged in different places still make one whole copy. A damaged copy
on the target is replaced only once the new one is committed, never deleted first. A source whose
manifest or index cannot be read gives way to the next tier. Restores of one step into one
filesystem tier run one at a time (a lock beside the steps): the others wait, then find it there.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from tiered.cli.common import (EXIT_FAILED, EXIT_OK, EXIT_USAGE, Progress, common_options, parse_step, run,
                               verify_steps)
from tiered.errors import CheckpointNotFoundError, TieredError
from tiered.format.manifest import read_step, step_dir_name
from tiered.tiers import make_tier
from tiered.tiers.catalog import TierCatalog
from tiered.units import format_rate, format_size

log = logging.getLogger("tiered")


@contextlib.contextmanager
def restore_lock(tier: Any, step: int, quiet: bool) -> Iterator[None]:
    """One restore of `step` into a filesystem tier at a time, across processes (flock on a file
    beside the steps); a tier that cannot hold the file (read-only, S3) goes without: its commit
    never replaces another's either way."""
    root = getattr(tier, "root", None)
    fd = -1
    if isinstance(root, Path):
        path = root / f".{step_dir_name(step)}.restore-lock"
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            log.debug("tiered: no restore lock on %s: %s", root, exc)
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not quiet:
                    print(f"step {step}: another restore into tier {tier.name!r} is running; waiting for it",
                          file=sys.stderr)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd >= 0:
            # Removed before it is released: a restore that waited on it then holds a file no new
            # restore takes, and both may copy. Harmless: neither commit replaces the other's, and the
            # second finds the step there. The lock only spares the work; the commit is the guarantee.
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)


def cmd_restore(args: argparse.Namespace, catalog: TierCatalog) -> int:
    from tiered.cli.peers import restore_from_peers, under_torchrun
    from tiered.migrate.migrator import migrate_step

    if under_torchrun() and args.source is None and args.to is None and not args.verify_only:
        return restore_from_peers(args, catalog)

    if args.source is not None:
        catalog.get(args.source)  # an unknown name: a usage error naming the tiers
    committed = catalog.committed()
    listing = "\n".join(f"  {catalog.describe(n)}: "
                        f"{'unreachable' if s is None else (', '.join(map(str, s[-8:])) or 'no steps')}"
                        for n, s in committed.items())
    try:
        step, order = catalog.restore_order(args.step, tier=args.source, committed=committed)
    except CheckpointNotFoundError:
        what = f"on tier {args.source!r}" if args.source else "on any tier"
        why = f"nothing restorable: no committed checkpoint {what}" if args.step is None else \
            f"step {args.step} is not committed {what}"
        print(f"tiered-restore: {why}\n{listing}", file=sys.stderr)
        return EXIT_FAILED
    holders = [n for n in catalog.names if step in (committed.get(n) or ())]
    if args.verify_only:
        return verify_steps(catalog, [(order[0].name, step)], quick=False, show=not args.quiet)
    to = args.to or catalog.names[0]
    catalog.get(to)
    with restore_lock(catalog.get(to), step, args.quiet):
        damaged = False
        if catalog.get(to).has_step(step):  # (also where another restore brought it while this one waited)
            if verify_steps(catalog, [(to, step)], quick=False, show=not args.quiet) == EXIT_OK:
                print(f"step {step} is on tier {to!r} ({catalog.get(to).root}), verified: nothing to copy")
                return EXIT_OK
            damaged = True
            holders = list(dict.fromkeys([*holders, to]))
        sources = [args.source] if args.source else [n for n in holders if n != to] + ([to] if damaged else [])
        for name in sources:
            if _copy(catalog, step, name, to, holders, damaged, args.quiet, migrate_step):
                return EXIT_OK
    print(f"tiered-restore: no tier could supply step {step} whole (tried {', '.join(map(repr, sources))}"
          f"{'; the damaged copy on ' + repr(to) + ' is left as it was' if damaged else ''})", file=sys.stderr)
    return EXIT_FAILED


def _copy(catalog: TierCatalog, step: int, name: str, to: str, holders: list[str], damaged: bool, quiet: bool,
          migrate_step: Any) -> bool:
    """Copy `step` from tier `name` to tier `to`, chunks repaired from the other `holders`; True
    once committed there."""
    src = catalog.get(name)
    try:
        manifest, _ = read_step(src, step)
    except (TieredError, OSError) as exc:
        print(f"tiered-restore: tier {name!r} cannot serve step {step} ({exc}); trying the next", file=sys.stderr)
        return False
    # Written through a tier object of its own: the source may be the very copy being replaced.
    dst = make_tier(next(t for t in catalog.config.tiers if t.name == to))
    others = [catalog.get(n) for n in holders if n != name]
    verb = "repairing" if damaged else "restoring"
    if damaged:
        print(f"step {step} on tier {to!r} is damaged: building a whole copy aside from tier {name!r}"
              f"{' (chunks it lacks from ' + ', '.join(repr(t.name) for t in others) + ')' if others else ''}; the "
              "damaged copy is replaced once the new one is committed", file=sys.stderr)
    bar = Progress(f"step {step} {name} -> {to}", manifest.raw_bytes, enabled=not quiet)
    t0 = time.perf_counter()
    try:
        # Chunks keep their codec (zstd from a portable tier stays zstd: restorable with or without
        # a GPU); every chunk's checksum is verified on the way.
        m = migrate_step(step, src, dst, codec=None, settings=catalog.config.zstd, progress=bar, repair_from=others,
                         replace=damaged)
    except (TieredError, OSError) as exc:
        bar.finish()
        if not damaged and catalog.get(to).has_step(step):
            print(f"step {step} was committed on tier {to!r} by another process meanwhile; verifying it",
                  file=sys.stderr)
            return verify_steps(catalog, [(to, step)], quick=False, show=not quiet) == EXIT_OK
        print(f"tiered-restore: {verb} step {step} from tier {name!r} failed: {exc}", file=sys.stderr)
        return False
    bar.finish()
    seconds = time.perf_counter() - t0
    stored = m.stored_bytes if m is not None else manifest.stored_bytes
    print(f"{'repaired' if damaged else 'restored'} step {step} from tier {name!r} to tier {to!r} ({dst.root}): "
          f"{format_size(stored)} stored for {format_size(manifest.raw_bytes)} of state in {seconds:.2f} s "
          f"({format_rate(manifest.raw_bytes / max(seconds, 1e-9))})")
    return True


def restore_parser(p: argparse.ArgumentParser) -> None:
    common_options(p)
    p.add_argument("--step", type=parse_step, default=None, metavar="N|latest",
                   help="step to restore (default: latest, the newest step committed on any tier, or on --from)")
    p.add_argument("--to", metavar="TIER", help="tier to restore into (default: the first tier, node-local)")
    p.add_argument("--from", dest="source", metavar="TIER",
                   help="tier to copy from (default: the fastest other tier holding the step, then the next); "
                        "chunks it holds damaged still come from the other tiers")
    p.add_argument("--verify-only", action="store_true",
                   help="read and check the step where it is (the fastest tier holding it, or --from); copy nothing")


RESTORE_DESCRIPTION = """\
Cold start: bring a committed checkpoint step onto this node's local tier.

Finds the fastest tier that holds the step (local, then the shared filesystem, then S3, in the
order of the config; or --from), copies it into --to (default: the first, node-local tier) and
checks every chunk's checksum on the way. A chunk damaged on the source is taken from another
tier's copy; a source whose manifest or index cannot be read gives way to the next tier. The copy
is built aside and committed whole: a damaged copy already on --to is replaced only then, never
deleted first. Concurrent restores of one step into one tier wait for each other. The training
script's `engine.restore(state)` then reads it from local disk. Chunks keep their codec, so a copy
from a portable tier (zstd) restores on machines with or without a GPU.

Under torchrun (one rank per training rank, each node with its config): each rank's files of
the step are brought onto its node's first tier from the ranks on other nodes that keep its
replicas (a memory tier's `replicas`), checked chunk by chunk; what no peer keeps is left to the
job's restore, which reads it from the shared tiers.

Exit status: 0 restored (or already there and verified), 1 nothing restorable or every copy
failed, 2 bad usage or config.
"""

RESTORE_EPILOG = """\
examples:
  tiered-restore --config cluster.yaml                  # newest step, into the local tier
  tiered-restore --config cluster.yaml --step 12000
  tiered-restore --config cluster.yaml --from s3        # copy from S3 even where the shared tier has it
  tiered-restore --config cluster.yaml --verify-only    # check the newest step where it is
  torchrun --nnodes 2 --nproc_per_node 8 ... -m tiered.cli.restore --config cluster.yaml  # from peers
"""


def restore_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tiered-restore", description=RESTORE_DESCRIPTION, epilog=RESTORE_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    restore_parser(p)
    return run(p, cmd_restore, argv)


__all__ = ["RESTORE_DESCRIPTION", "RESTORE_EPILOG", "EXIT_USAGE", "cmd_restore", "restore_main", "restore_parser"]


if __name__ == "__main__":  # (python -m tiered.cli.restore: as torchrun -m runs it)
    sys.exit(restore_main())
