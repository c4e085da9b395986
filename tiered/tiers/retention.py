"""Retention across the tiers: `keep_last` / `keep_every` applied to every tier, the last one too.

The decision is `tiered.policy.eviction_reasons` (pure); this module lists what each tier holds,
what is in use (`tiered.tiers.leases`), deletes, and logs each deletion with its reason. The
engine runs it after each save where it has no migrator (one tier), the migrator after each step
it copies, and `tiered gc` by hand: the same rule everywhere.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from tiered.errors import TieredError
from tiered.policy import Retention, eviction_reasons
from tiered.tiers.catalog import summarize
from tiered.tiers.leases import held_steps
from tiered.units import format_size

log = logging.getLogger("tiered")


def rules_of(config: Any) -> dict[str, Retention]:
    return {t.name: Retention(keep_last=t.keep_last, keep_every=t.keep_every) for t in config.tiers}


def apply_retention(config: Any, get_tier: Callable[[str], Any], *, dry_run: bool = False) -> dict[str, dict[int, str]]:
    """Delete, per tier, the steps its rules let go (`tiered.policy.eviction_reasons`: never the newest
    step, never one in use, above the last tier only once a slower tier holds it or no slower tier
    would keep it). Returns {tier: {step: why}} of what was deleted (or, with `dry_run`, would be).
    A step whose deletion fails is logged and left; the others still go."""
    if not any(t.retention for t in config.tiers):
        return {}  # (after every save of a config without rules: no listing)
    order = [t.name for t in config.tiers]
    rules = rules_of(config)
    committed = {name: set(get_tier(name).steps()) for name in order}
    out: dict[str, dict[int, str]] = {}
    for t in config.tiers:
        if not t.retention:
            continue
        tier = get_tier(t.name)
        doomed = eviction_reasons(t.name, committed, order, rules, held_steps(tier))
        if not doomed:
            continue
        out[t.name] = doomed
        if dry_run:
            continue
        for step, why in doomed.items():
            try:
                tier.delete(step)
            except Exception as exc:  # noqa: BLE001 - one step that cannot go keeps the others going
                log.error("tiered: retention: cannot delete step %d from tier %r: %s", step, t.name, exc)
                continue
            committed[t.name].discard(step)
            log.info("tiered: retention: deleted step %d from tier %r (%s)", step, t.name, why)
    return out


def retain_without_migrator(config: Any, get_tier: Callable[[str], Any]) -> None:
    """After a save, where no migrator applies retention (one tier): by the node's first local
    rank only, so that ranks sharing a tier do not race; a failure is logged, never raised."""
    if len(config.tiers) != 1 or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        apply_retention(config, get_tier)
    except Exception as exc:  # noqa: BLE001 - a save is never failed by its cleanup
        log.error("tiered: retention failed (tried again after the next save): %s", exc)


def reclaim_debris(config: Any, get_tier: Callable[[str], Any], *, dry_run: bool = False) -> dict[str, list[str]]:
    """On every tier, remove what writers that stopped left (uncommitted copies, unfinished
    deletions and uploads): {tier: one line per removal}. A tier that cannot be listed is logged
    and skipped."""
    out: dict[str, list[str]] = {}
    for t in config.tiers:
        try:
            out[t.name] = get_tier(t.name).reclaim_debris(dry_run=dry_run)
        except (TieredError, OSError) as exc:
            log.error("tiered: tier %r: cannot look for debris: %s", t.name, exc)
    return out


def reclaim_debris_in_background(tier: Any) -> threading.Event:
    """Remove what stopped writers left on `tier` (`LocalTier.reclaim_debris`: uncommitted copies,
    unfinished deletions) on a thread of its own, once, by the first local rank of a node; the
    event is set when done (at once where there is nothing to do). Deleting gigabytes takes seconds,
    never on the training thread."""
    done = threading.Event()
    reclaim = getattr(tier, "reclaim_debris", None)
    if reclaim is None or os.environ.get("LOCAL_RANK", "0") != "0":
        done.set()
        return done

    def run() -> None:
        try:
            reclaim()
        except OSError as exc:
            log.warning("tiered: %s: could not remove what stopped writers left: %s", tier.root, exc)
        finally:
            done.set()

    threading.Thread(target=run, name="tiered-reclaim", daemon=True).start()
    return done


def make_room(config: Any, get_tier: Callable[[str], Any], tier: Any, need: int) -> None:
    """Fit `need` more bytes into `tier`'s size budget (a memory tier's): delete its oldest steps
    that a slower tier holds committed, never the newest, never one in use, until they fit.
    TieredError, saying what the tier holds, where they cannot."""
    over = tier.used_bytes() + need - tier.size
    if over <= 0:
        return
    names = [t.name for t in config.tiers]
    below = [get_tier(n) for n in names[names.index(tier.name) + 1:]]
    held, steps = held_steps(tier), tier.steps()
    for step in steps[:-1]:
        if step in held or not any(t.has_step(step) for t in below):
            continue
        freed = tier.step_bytes(step)
        tier.delete(step)
        log.info("tiered: deleted step %d from tier %r: its size budget (%s) needed %s more for the next step, "
                 "and tier %r holds it", step, tier.name, format_size(tier.size), format_size(over),
                 next(t.name for t in below if t.has_step(step)))
        over -= freed
        if over <= 0:
            return
    shed = getattr(tier, "shed_replicas", None)  # (a memory tier's replicas of other nodes' ranks go next)
    if shed is not None and shed(over) >= over:
        return
    raise TieredError(f"tier {tier.name!r} ({tier.root}) holds {format_size(tier.used_bytes())} of its "
                      f"{format_size(tier.size)} and the step may need {format_size(need)}: none of its steps "
                      f"{summarize(steps)} can make room (the newest stays; the others are in use or on no slower "
                      "tier yet)")
