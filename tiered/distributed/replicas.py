"""Replicas: each rank's committed step also kept in the memory tier of ranks on other nodes.

With ``replicas: k`` on the memory tier, once a distributed step is committed on this rank's
node, a thread of its own sends this rank's files of it to the k ranks that keep its replicas
(tiered.distributed.nodes: the same local rank on each of the next k nodes), over a gloo group
of the engine's own (tiered.distributed.transfer). Each holder writes them under its memory tier,
in a tier of their own per source rank::

    <memory tier>/.replicas/rank_00002/step_000000000100/   rank 2's files of step 100, committed
                                                             as any step is (manifest last)

A replica is checked chunk by chunk against its index before it is committed; one half received
(a node lost mid-way) stays an uncommitted work directory, never used, removed as debris.

Training never waits for it: the sender works after the commit, in the background, one step at a
time; where steps are committed faster than they can be sent, it sends the newest and skips the
older (each skip logged). A holder keeps the newest `keep_last` replicas of each source (the
memory tier's `keep_last`, 2 where unset) and, under the tier's size budget, drops its oldest
replicas first, then refuses a replica that would not fit (logged: that step has no replica;
the next may). Memory on each side: one piece of the data file in flight (`transfer.PIECE`).

A holder hears of a replica through the job's key-value store (the c10d store): the sender posts
a numbered note for each, then sends; the holder looks for the next note (every 20 ms, growing to
0.5 s) and only then receives, so it never waits on the group's timeout between saves. At close,
each sender posts a last note, and each holder stops once it has received every source's last one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

from tiered import threads
from tiered.distributed.roll import store
from tiered.distributed.transfer import receive_rank, send_rank
from tiered.errors import TieredError
from tiered.tiers.leases import hold
from tiered.units import format_size

log = logging.getLogger("tiered")

END = "end"
POLL_MAX_S = 0.5


class Replicator:
    """Sends this rank's committed steps to its holders and keeps the replicas of its sources.
    Made on every rank at once (its group is made collectively)."""

    def __init__(self, saves: Any, holders: list[int], sources: list[int], job: str, timeout_s: float):
        import torch.distributed as dist

        self.saves = saves
        self.rank = saves.rank
        self.memory = saves.tier
        self.holders, self.sources = holders, sources
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.prefix = f"tiered/{job}/replica"
        self.keep = max(1, saves.config.fast_tier.keep_last or 2)
        self.sent: dict[int, float] = {}
        """Steps sent to every holder -> seconds it took (the last few)."""
        self._busy = False
        self._queue: deque[int] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._seq = {h: 0 for h in holders}
        self._sender = threads.start(self._send_loop, name="tiered-replica-send")
        self._receivers = [threads.start(self._receive_loop, s, name=f"tiered-replica-recv-{s}") for s in sources]
        log.info("tiered: rank %d: replicas of its steps go to rank%s %s; it keeps those of rank%s %s",
                 self.rank, "s" if len(holders) > 1 else "", ", ".join(map(str, holders)) or "none",
                 "s" if len(sources) > 1 else "", ", ".join(map(str, sources)) or "none")

    # --- sending ---------------------------------------------------------------------------
    def committed(self, step: int) -> None:
        """`step` is committed on this node: send it (the newest waiting replaces older ones)."""
        with self._cond:
            if self._closing:
                return
            skipped = list(self._queue)
            self._queue.clear()
            self._queue.append(step)
            self._cond.notify_all()
        if skipped:
            log.info("tiered: rank %d: no replica of step%s %s: step %d is newer and replicas were still being sent",
                     self.rank, "s" if len(skipped) > 1 else "", ", ".join(map(str, skipped)), step)

    def _note(self, holder: int, seq: int) -> str:
        return f"{self.prefix}/{self.rank}/{holder}/{seq}"

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    break
                step = self._queue.popleft()
                self._busy = True
            self._send(step)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        for h in self.holders:
            try:
                store().set(self._note(h, self._seq[h]), END)
            except Exception as exc:  # noqa: BLE001 - at close: the holder stops on its own
                log.warning("tiered: rank %d: cannot tell rank %d that no more replicas come: %s", self.rank, h, exc)

    def _send(self, step: int) -> None:
        t0 = time.perf_counter()
        sent = 0
        try:
            with hold([self.memory], step):  # (retention leaves it while it is read)
                if not self.memory.has_step(step):
                    log.warning("tiered: rank %d: step %d is no longer in tier %r: no replica of it", self.rank, step,
                                self.memory.name)
                    return
                for h in self.holders:
                    store().set(self._note(h, self._seq[h]), str(step))
                    self._seq[h] += 1
                    try:
                        sent = send_rank(self.memory, step, self.rank, h, self.group)
                    except (TieredError, OSError) as exc:
                        log.error("tiered: rank %d: no replica of step %d on rank %d: %s", self.rank, step, h, exc)
        except Exception as exc:  # noqa: BLE001 - a replica never fails training: logged
            log.error("tiered: rank %d: sending the replicas of step %d failed: %s", self.rank, step, exc)
            return
        dt = time.perf_counter() - t0
        self.sent[step] = dt
        while len(self.sent) > 8:
            del self.sent[min(self.sent)]
        log.info("tiered: rank %d: step %d's replica%s sent to rank%s %s: %s in %.2f s", self.rank, step,
                 "s" if len(self.holders) > 1 else "", "s" if len(self.holders) > 1 else "",
                 ", ".join(map(str, self.holders)), format_size(sent), dt)

    # --- keeping ---------------------------------------------------------------------------
    def _receive_loop(self, source: int) -> None:
        tier = self.memory.replica_tier(source)
        tier.root.mkdir(parents=True, exist_ok=True)
        seq = 0
        while True:
            key = f"{self.prefix}/{source}/{self.rank}/{seq}"
            note = self._wait_note(key, source)
            if note is None or note == END:
                return
            outcome = "not kept (see its log)"
            try:
                store().delete_key(key)
                got = receive_rank(source, self.group, tier, into_step=False,
                                   room=lambda n: self._room(n, source))
                if got is not None:
                    self._retain(tier)
                    outcome = "ok"
                    log.info("tiered: rank %d keeps rank %d's replica of step %d (%s, %.2f s)", self.rank, source,
                             got.step, format_size(got.stored_bytes), got.seconds)
            except Exception as exc:  # noqa: BLE001 - logged; the next replica may come
                log.error("tiered: rank %d: rank %d's replica of step %s was not kept: %s", self.rank, source, note, exc)
                outcome = f"not kept: {exc}"[:500]
                if "stream is lost" in str(exc):
                    return
            finally:
                with contextlib.suppress(Exception):  # (one key a source and holder: the last step's outcome)
                    store().set(self._kept(source, self.rank), f"{note} {outcome}")
            seq += 1

    def _wait_note(self, key: str, source: int) -> str | None:
        delay = 0.02
        closing_since: float | None = None
        while True:
            try:
                if store().check([key]):
                    return store().get(key).decode()
            except Exception as exc:  # noqa: BLE001 - the store is gone: the job ends
                log.debug("tiered: rank %d stops keeping rank %d's replicas: %s", self.rank, source, exc)
                return None
            with self._cond:
                closing = self._closing
            if closing:
                closing_since = closing_since or time.monotonic()
                if time.monotonic() - closing_since > self.saves.config.distributed_timeout:
                    log.warning("tiered: rank %d: rank %d did not say it sent its last replica: stopped waiting",
                                self.rank, source)
                    return None
            time.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX_S)

    def _room(self, need: int, source: int) -> bool:
        """Whether `need` more bytes fit the memory tier's size budget, dropping the oldest
        replicas (never a source's newest) to make it; False (logged) where they cannot."""
        budget = getattr(self.memory, "size", None)
        if budget is None:
            return True
        over = self.memory.used_bytes() + need - budget
        if over > 0:
            over -= self.memory.shed_replicas(over)
        if over > 0:
            log.warning("tiered: rank %d: no room for rank %d's replica (%s) in tier %r's %s: not kept", self.rank,
                        source, format_size(need), self.memory.name, format_size(budget))
            return False
        return True

    def _retain(self, tier: Any) -> None:
        for step in tier.steps()[:-self.keep]:
            tier.delete(step)

    def _kept(self, source: int, holder: int) -> str:
        return f"{self.prefix}/kept/{source}/{holder}"

    def wait(self, timeout: float) -> dict[int, str]:
        """Wait until the steps committed so far are sent and every holder has said whether it
        keeps the newest (at most `timeout` seconds); returns {holder: why not} for those that do
        not, or did not say."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {h: f"step {self._queue[-1] if self._queue else '?'} was still being sent"
                            for h in self.holders}
                self._cond.wait(left)
        if not self.sent:
            return {}
        step = max(self.sent)
        said: dict[int, str] = {}
        delay = 0.02
        while True:
            for h in self.holders:
                if h in said:
                    continue
                with contextlib.suppress(Exception):
                    if store().check([self._kept(self.rank, h)]):
                        answer = store().get(self._kept(self.rank, h)).decode()
                        got, _, outcome = answer.partition(" ")
                        if got.isdigit() and int(got) >= step:
                            said[h] = outcome
            if len(said) == len(self.holders) or time.monotonic() > deadline:
                break
            time.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX_S)
        return {h: said.get(h, f"did not say whether it keeps step {step}") for h in self.holders
                if said.get(h) != "ok"}

    def close(self) -> None:
        """Send what is queued, tell the holders that no more comes, and keep receiving until the
        sources have said so too."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._sender.join()
        for t in self._receivers:
            t.join()
