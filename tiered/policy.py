"""Pure decisions: codec per tier, retention per tier, restore source. Data in, decision out.

No I/O happens here: callers measure (codec throughput and ratio on a sample of the
checkpoint's own data, tier bandwidth) and list (which steps each tier holds), then ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True, kw_only=True)
class CodecSample:
    """One codec measured on a sample of this checkpoint's data."""

    name: str
    throughput: float
    """Uncompressed bytes per second the codec encodes here (GPU or CPU implementation)."""
    ratio: float
    """Stored bytes / raw bytes, in (0, ~1.01]."""
    cpu_decodable: bool


TIE = 0.05
"""Durable times within 5% of the best count as a tie (below what a sample measures reliably);
the smallest output among the tied codecs wins."""


def time_to_durable(raw_bytes: float, sample: CodecSample, bandwidth: float, *, overlap: bool = True) -> float:
    """Seconds until `raw_bytes` are stored with `sample`'s codec on a tier of `bandwidth` B/s.

    `overlap`: encoding and writing are pipelined chunk by chunk (migrations, CPU saves), so the
    slower stage bounds the time. Without it the encode comes first and adds: the GPU snapshot on
    the fast tier, where training waits for compression (all but the last pack buffer of it).
    """
    encode, write = raw_bytes / sample.throughput, raw_bytes * sample.ratio / bandwidth
    return max(encode, write) if overlap else encode + write


def choose_codec(*, bandwidth: float, samples: Sequence[CodecSample], portable: bool = False,
                 pinned: str | None = None, raw_bytes: float = 1e9, overlap: bool = True) -> str:
    """The codec that makes a checkpoint durable soonest on a tier; near-ties (`TIE`) go to the
    smaller output.

    `pinned` (the tier's configured codec) wins; `portable` tiers only get codecs a CPU decodes.
    """
    allowed = [s for s in samples if s.cpu_decodable or not portable]
    if pinned is not None:
        if not any(s.name == pinned for s in allowed):
            raise ValueError(f"codec {pinned!r} is not available for this tier"
                             + (" (portable tiers need a CPU-decodable codec)" if portable else ""))
        return pinned
    if not allowed:
        raise ValueError("no codec is available for this tier")
    times = {s.name: time_to_durable(raw_bytes, s, bandwidth, overlap=overlap) for s in allowed}
    best = min(times.values())
    tied = [s for s in allowed if times[s.name] <= best * (1 + TIE)]
    return min(tied, key=lambda s: (s.ratio, times[s.name])).name


def keep_by_rules(steps: Sequence[int], *, keep_last: int | None, keep_every: int | None) -> set[int]:
    """Steps a tier keeps by its own rules: the newest `keep_last`, and every multiple of
    `keep_every`. No rule configured means keep everything."""
    if keep_last is None and keep_every is None:
        return set(steps)
    ordered = sorted(steps)
    keep = set(ordered[-keep_last:]) if keep_last else set()
    if keep_every:
        keep |= {s for s in ordered if s % keep_every == 0}
    return keep


@dataclass(frozen=True)
class Retention:
    """A tier's retention rules (no rule: keep everything)."""

    keep_last: int | None = None
    keep_every: int | None = None

    def keeps(self, steps: Iterable[int]) -> set[int]:
        return keep_by_rules(sorted(set(steps)), keep_last=self.keep_last, keep_every=self.keep_every)


def eviction_reasons(tier: str, committed: Mapping[str, set[int]], order: Sequence[str],
                     rules: Mapping[str, Retention], protected: Iterable[int] = ()) -> dict[int, str]:
    """The steps `tier` may delete now, each with the reason it may go (for the log and `tiered gc`).

    A step beyond the tier's own rules goes, except:
    - the newest step committed on any tier, and the `protected` ones (read by a restore, being
      copied by a migration), never go;
    - above the last tier, a step goes only once a *slower* tier (later in `order`) holds it
      committed, or once no slower tier would keep it by its own rules (so a step every tier below
      has let go does not stay on this one for ever). On the last tier the rules alone decide.
    Tiers missing from `rules` keep everything.
    """
    mine = committed.get(tier, set())
    rule = rules.get(tier, Retention())
    everywhere = set().union(*committed.values()) if committed else set()
    newest = max(everywhere) if everywhere else None
    held = set(protected)
    slower = order[order.index(tier) + 1:]
    out: dict[int, str] = {}
    for step in sorted(mine - rule.keeps(mine)):
        if step == newest or step in held:
            continue
        if not slower:
            out[step] = "beyond this tier's rules; the last tier"
            continue
        holder = next((t for t in slower if step in committed.get(t, set())), None)
        if holder is not None:
            out[step] = f"beyond this tier's rules; kept on tier {holder!r}"
        elif not any(step in rules.get(t, Retention()).keeps(committed.get(t, set()) | {step}) for t in slower):
            out[step] = "beyond the rules of this tier and of every tier below it"
    return out


def restore_source(step: int, committed: Mapping[str, set[int]], order: Sequence[str],
                   exclude: Sequence[str] = ()) -> str | None:
    """The fastest tier (first in `order`) holding a committed copy of `step`, skipping `exclude`
    (tiers already found damaged); None when no tier has it."""
    for tier in order:
        if tier not in exclude and step in committed.get(tier, set()):
            return tier
    return None


def latest_restorable(committed: Mapping[str, set[int]]) -> int | None:
    """The newest step committed on any tier."""
    steps = set().union(*committed.values()) if committed else set()
    return max(steps) if steps else None


@dataclass(frozen=True)
class Holdings:
    """What one rank holds of the job's steps on its node (what it reports at a restore)."""

    own: Mapping[int, tuple[int, tuple[int, ...]]]
    """Steps whose files of this rank are on its node's tiers (or that it stored nothing of) ->
    (the world size that saved the step, the ranks the manifest lists)."""
    replicas: Mapping[int, Mapping[int, tuple[int, tuple[int, ...]]]]
    """Steps -> {rank whose replica it keeps: (world size, listed ranks)}."""
    slow: tuple[int, ...] = ()
    """Steps committed on the tiers every node shares (rank 0 reports them)."""


@dataclass(frozen=True)
class PeerPlan:
    step: int | None
    """The step to restore; None where no tier holds one."""
    sends: Mapping[int, tuple[int, ...]]
    """Rank lacking its files -> the ranks keeping its replica, the nearest first."""
    slow: tuple[int, ...]
    """Ranks lacking their files that no peer keeps: read from the slower tiers."""
    resharded: bool = False
    """The step was saved at another world size: each rank reads what its shards need from the
    tiers holding the whole step (no peer sends)."""


def peer_restore_plan(reports: Sequence[Holdings], step: int | None = None,
                      node_of: Sequence[int] | None = None) -> PeerPlan:
    """Which step a job restores and who sends what, from every rank's holdings: the newest step
    that every rank it lists can have, from its own node, from a rank keeping its replica, or
    from the shared tiers (or `step`, where asked). `node_of[r]`: rank r's node; the ranks keeping
    a replica are asked nearest node first, in the order replicas are placed (default: by rank)."""
    world = len(reports)
    slow_steps = set().union(*(r.slow for r in reports))
    known: dict[int, tuple[int, tuple[int, ...]]] = {}
    kept: dict[tuple[int, int], list[int]] = {}
    """(step, rank) -> the ranks keeping that rank's replica of the step."""
    for holder, r in enumerate(reports):
        for s, info in r.own.items():
            known.setdefault(s, info)
        for s, sources in r.replicas.items():
            for source, info in sources.items():
                known.setdefault(s, info)
                kept.setdefault((s, source), []).append(holder)
    nodes = max(node_of) + 1 if node_of else 1

    def keepers(s: int, rank: int) -> tuple[int, ...]:
        holders = kept.get((s, rank), [])
        if node_of:
            return tuple(sorted(holders, key=lambda h: ((node_of[h] - node_of[rank]) % nodes, h)))
        return tuple(holders)

    def complete(s: int) -> bool:
        if s in slow_steps:
            return True
        saved_world, listed = known[s]
        return saved_world == world and all(s in reports[r].own or keepers(s, r) for r in listed)

    if step is None:
        candidates = sorted(set(known) | slow_steps, reverse=True)
        step = next((s for s in candidates if complete(s)), None)
        if step is None:
            return PeerPlan(None, {}, ())
    if step not in known:
        return PeerPlan(step, {}, ())
    saved_world, listed = known[step]
    if saved_world != world:
        return PeerPlan(step, {}, (), resharded=True)
    lacking = [r for r in listed if step not in reports[r].own]
    sends = {r: keepers(step, r) for r in lacking if keepers(step, r)}
    return PeerPlan(step, sends, tuple(r for r in lacking if r not in sends))
