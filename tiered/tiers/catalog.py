"""The tier catalog: the configured tiers by name, and which committed steps each one holds.

One catalog per Engine, and one per CLI command; the migrator receives its `get`. Everything that
asks "which steps exist, where, and which copy do I read first" asks here, so the library and the
command line cannot disagree about it:

    catalog.get(name)               -> the tier (created on first use; S3 imports boto3 only then)
    catalog.committed(names)        -> {tier: committed steps, or None where it cannot be listed now}
    catalog.steps() / latest_step() -> every restorable step / the newest (what a restore picks)
    catalog.restore_order(step)     -> (step, the tiers holding it committed, fastest first)

A step is committed on a tier once its manifest is there (tiered.tiers.base); the order of the
config's tiers is the restore order.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

from tiered.config import Config
from tiered.errors import CheckpointNotFoundError, TieredError, UnknownTierError
from tiered.format.manifest import read_manifest
from tiered.policy import latest_restorable
from tiered.tiers import LocalTier, Tier, make_tier

log = logging.getLogger("tiered")


class TierCatalog:
    """The tiers of `config`, fastest first. Thread-safe."""

    def __init__(self, config: Config):
        self.config = config
        cfg = config.fast_tier
        fast = make_tier(cfg)
        assert isinstance(fast, LocalTier)
        self.fast: LocalTier = fast
        """The node-local tier every save is written to first (a memory tier is one too)."""
        self._tiers: dict[str, Tier] = {cfg.name: self.fast}
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        """The tier names, in restore order (fastest first)."""
        return [t.name for t in self.config.tiers]

    def get(self, name: str | None = None) -> Tier:
        """A configured tier by name (default: the fast tier); created on first use."""
        if name is None:
            return self.fast
        with self._lock:  # the migrator thread and the caller may both ask first
            tier = self._tiers.get(name)
            if tier is None:
                cfg = next((t for t in self.config.tiers if t.name == name), None)
                if cfg is None:
                    raise UnknownTierError(f"{self.config.source}: no tier named {name!r} "
                                           f"(tiers: {', '.join(self.names)})")
                tier = self._tiers[name] = make_tier(cfg)
        return tier

    def describe(self, name: str) -> str:
        """``name (kind: root)``, as the CLI prints a tier."""
        cfg = next(t for t in self.config.tiers if t.name == name)
        return f"{name} ({cfg.kind}: {self.get(name).root})"

    def committed(self, names: Sequence[str] | None = None) -> dict[str, list[int] | None]:
        """Committed steps on each tier (or on the tiers `names`), ascending, by tier name; None
        for a tier that cannot be listed now (S3 unreachable, say), which is logged."""
        out: dict[str, list[int] | None] = {}
        for name in names or self.names:
            try:
                out[name] = self.get(name).steps()
            except (TieredError, OSError) as exc:
                log.warning("tiered: cannot list tier %r: %s", name, exc)
                out[name] = None
        return out

    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps on a tier, ascending; default: on any tier that can be listed now
        (every restorable step)."""
        if tier is not None:
            return self.get(tier).steps()
        if len(self.config.tiers) == 1:
            return self.fast.steps()
        return sorted(set().union(*(s for s in self.committed().values() if s is not None)))

    def latest_step(self, tier: str | None = None) -> int | None:
        """The newest committed step on a tier; default: on any tier (what a restore picks)."""
        steps = self.steps(tier)
        return steps[-1] if steps else None

    def restore_order(self, step: int | None, tier: str | None = None, *,
                      committed: dict[str, list[int] | None] | None = None) -> tuple[int, list[Tier]]:
        """The step to read (default: the newest on any tier, or on `tier`) and the tiers that hold
        it committed, fastest first (from `tier` on, when one is named): the first is read, the
        others stand in for its damaged chunks and files (tiered.restore.pipeline). `committed`: a listing
        of every tier the caller already made (`committed()`), so the tiers are not listed twice.
        Raises CheckpointNotFoundError when nothing (or not `step`) is committed there."""
        names = self.names
        if tier is not None:
            self.get(tier)  # names the known tiers when `tier` is not one
            names = names[names.index(tier):]
        if committed is not None:
            committed = {n: committed.get(n) for n in names}
        elif tier is not None and len(names) == 1:
            # A single named tier is listed directly, so that a failure to list it is the error raised.
            committed = {tier: self.get(tier).steps()}
        else:
            committed = self.committed(names)
        held = {n: set(steps) for n, steps in committed.items() if steps is not None}
        where = (f"tier {names[0]!r} ({self.get(names[0]).root})" if len(names) == 1 else
                 "any tier (" + ", ".join(f"{n}: {self.get(n).root}" for n in names) + ")")
        if step is None:
            step = latest_restorable(held) if tier is None else latest_restorable({tier: held.get(tier, set())})
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {where}")
        order = [self.get(n) for n in names if step in held.get(n, ())]
        if not order or (tier is not None and order[0].name != tier):
            summary = summarize(committed.get(names[0]) or []) if len(names) == 1 else \
                "; ".join(f"{n}: {summarize(committed.get(n) or [])}" for n in names)
            raise CheckpointNotFoundError(f"step {step} is not committed in "
                                          f"{where if tier is None else f'tier {tier!r}'}; committed steps: {summary}")
        return step, order


def saved_through_dcp(order: Sequence[Any], step: int) -> bool:
    """Whether `step` was saved through DCP, from the first of `order` whose manifest reads (a
    damaged one is left to the restore's own fallback to report)."""
    for tier in order:
        try:
            return read_manifest(tier, step).dcp is not None
        except (TieredError, OSError):
            continue
    return False


def summarize(items: Sequence[Any], n: int = 8) -> str:
    """The first `n` of `items`, and how many there are in all."""
    if not items:
        return "none"
    shown = ", ".join(str(x) for x in items[:n])
    return shown + (f", ... ({len(items)} in all)" if len(items) > n else "")
