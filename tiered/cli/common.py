"""What the commands share: exit codes, the progress line, step arguments, reading and verifying
a step where it is, the common options, and running a command with clean errors."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from typing import Any, Callable, Sequence, TextIO

from tiered.config import load_config
from tiered.errors import ConfigError, TieredError
from tiered.format.manifest import present_ranks, read_pinned, read_step
from tiered.restore.pipeline import verify_step
from tiered.tiers.catalog import TierCatalog
from tiered.units import format_rate, format_size

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


def parse_step(text: str) -> int | None:
    if text == "latest":
        return None
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number or 'latest', got {text!r}") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"steps are non-negative, got {step}")
    return step


def read_here(catalog: TierCatalog, name: str, step: int) -> tuple[Any, list[Any]]:
    """The step's manifest and indexes on tier `name`. The fast tier is node-local: of a step
    saved by several nodes it holds this node's ranks only. Every other tier must hold them all."""
    tier = catalog.get(name)
    return present_ranks(tier, step) if name == catalog.names[0] else read_step(tier, step)


def verify_steps(catalog: TierCatalog, work: list[tuple[str, int]], *, quick: bool, show: bool) -> int:
    """Read every chunk of each (tier, step), check its checksum and, unless `quick`, decode it
    where this machine can (CPU codecs always; ans needs a GPU and gets its checksums checked)."""
    from concurrent.futures import ThreadPoolExecutor

    bad = 0
    with ThreadPoolExecutor(thread_name_prefix="tiered-verify") as pool:
        for name, step in work:
            tier = catalog.get(name)
            try:
                manifest, indexes = read_here(catalog, name, step)
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


_CONFIG_HELP = "catalog YAML (default: the embedded configs/local.yaml: one local tier under ./.tiered)"


def common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="C", help=_CONFIG_HELP)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines; warnings and errors only")


def run(parser: argparse.ArgumentParser, fn: Callable[..., int] | None, argv: Sequence[str] | None) -> int:
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
