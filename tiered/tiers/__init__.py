"""Tiers: where checkpoint files live. See `tiered.tiers.base` for the protocol."""

from tiered.tiers.base import DataReader, DataWriter, Tier
from tiered.tiers.local import LocalTier

__all__ = ["DataReader", "DataWriter", "LocalTier", "Tier"]
