"""What a save hands back: `SaveHandle`, the two moments of one save (staged, persisted), and
`RankFiles`, one rank's durable files of a step that a distributed save commits later.

Produced by tiered.save.pipeline (and tiered.distributed.saver); read by the caller, the engine and DCP's commit.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tiered.errors import BackgroundSaveError
from tiered.format.manifest import Manifest, RankEntry


@dataclass
class SaveHandle:
    """What `save()` returns. Two moments, two futures:

    - ``staged``: the state may change again (GPU: compression has read the tensors).
    - ``persisted``: the step is durable and committed on the fast tier, or on the next tier where
      ``on_fast_tier_error: next_tier`` sent it there (result: its Manifest; ``tier``: where).
    """

    step: int
    staged: Future = field(default_factory=Future)
    persisted: Future = field(default_factory=Future)
    stall_s: float = 0.0
    """Time `save()` blocked the caller."""
    raw_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    """Milliseconds spent in each phase of `save()` (plan, per-GPU stage phases, CPU snapshot)."""
    tier: str = ""
    """The name of the tier the step is written to."""
    _reported: Any = None
    """Called with the failure this handle raised: the engine then does not raise it again."""
    on_wait: Any = None
    """Called as `wait()` begins: an overlapped save's stager starts it now (`guard`'s `stage_after_ms`)."""

    def wait(self, timeout: float | None = None) -> Manifest:
        """Block until persisted; return the committed manifest or raise the failure (once raised
        here, the next `save()` or `Engine.wait()` does not raise it again)."""
        if self.on_wait is not None:
            self.on_wait()
        try:
            return self.persisted.result(timeout)
        except BackgroundSaveError as exc:
            if self._reported is not None:
                self._reported(exc)
            raise

    def done(self) -> bool:
        return self.persisted.done()

    @property
    def manifest(self) -> Manifest:
        return self.persisted.result()


@dataclass(frozen=True)
class RankFiles:
    """One rank's durable files of a step, before the step is committed."""

    entry: RankEntry
    io: str
    """How the data file was written (`RankIndex.io`)."""
    codecs: list[str]
    tensor_stored: dict[int, int]
    """Stored bytes per tensor, by index."""
    raw_bytes: int
    stored_bytes: int
