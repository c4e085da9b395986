"""Which tier a save's step begins on: the fast tier or, with ``on_fast_tier_error: next_tier``,
the next tier where the fast one cannot take it (tiered.save.pipeline, after the walk of the state)."""

from __future__ import annotations

import logging
import shutil
from typing import Any, Sequence

from tiered.config import Config
from tiered.errors import TieredError
from tiered.format.manifest import ALIGNMENT
from tiered.tiers.catalog import TierCatalog
from tiered.tiers.retention import make_room
from tiered.units import format_size

log = logging.getLogger("tiered")


class StepTier:
    """Begins steps on the tier that takes them, and logs when saves leave the fast tier and
    when they come back to it."""

    def __init__(self, config: Config, catalog: TierCatalog):
        self.config, self.catalog = config, catalog
        self._falling_back = False
        """The last save went to the next tier."""

    def begin(self, step: int, leaves: Sequence[Any], rank: int | None = None) -> Any:
        """Start `step` on the tier that takes it and return that tier: the fast tier; with
        ``on_fast_tier_error: next_tier``, the next tier where the fast one cannot take the step
        (its step directory cannot be made: permission denied, read-only or missing filesystem;
        or it has less free space than the step may need). With `rank`, that rank's part of a
        distributed step, on the fast tier."""
        fast = self.catalog.fast
        budget = getattr(fast, "size", None)  # (a memory tier's)
        if rank is not None:
            fast.begin_rank(step, rank)
            if budget is not None:
                make_room(self.config, self.catalog.get, fast, self._need(leaves))
            return fast
        if self.config.on_fast_tier_error == "fail" or fast.has_step(step):
            fast.begin_step(step)  # (a committed step is refused here, whatever the setting)
            if budget is not None:
                self._fits(fast, step, self._need(leaves))
            return fast
        try:
            fast.begin_step(step)
            need = self._need(leaves)
            if budget is not None:
                self._fits(fast, step, need)
            free = shutil.disk_usage(fast.root).free
            if free < need:
                fast.discard(step)
                raise TieredError(f"{fast.root}: {format_size(free)} free, and the step may need up to "
                                  f"{format_size(need)}")
        except (TieredError, OSError) as exc:
            other = self.catalog.get(self.config.tiers[1].name)
            try:
                other.begin_step(step)
            except (TieredError, OSError) as exc2:
                raise TieredError(f"step {step}: the fast tier {fast.name!r} cannot take it ({exc}), and neither can "
                                  f"tier {other.name!r} ({exc2})") from None
            if not self._falling_back:
                log.warning("tiered: the fast tier %r cannot take step %d (%s): on_fast_tier_error is next_tier, so "
                            "it and the next saves go to tier %r, through host memory, until the fast tier takes "
                            "them again", fast.name, step, exc, other.name)
            self._falling_back = True
            return other
        if self._falling_back:
            log.warning("tiered: the fast tier %r takes saves again (from step %d)", fast.name, step)
            self._falling_back = False
        return fast

    def _need(self, leaves: Sequence[Any]) -> int:
        """The most bytes a step of these leaves may take on a tier (every chunk stored whole)."""
        return sum(-(-n // self.config.chunk_size) * ALIGNMENT + n
                   for n in (leaf.tensor.numel() * leaf.tensor.element_size() for leaf in leaves)) + (1 << 20)

    def _fits(self, tier: Any, step: int, need: int) -> None:
        """Make room for the step in a tier's size budget, or discard it there and raise."""
        try:
            make_room(self.config, self.catalog.get, tier, need)
        except TieredError:
            tier.discard(step)
            raise
