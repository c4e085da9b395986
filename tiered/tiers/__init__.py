"""Tiers: where checkpoint files live. See `tiered.tiers.base` for the protocol."""

from __future__ import annotations

from tiered.config import LocalTierConfig, MemoryTierConfig, PosixTierConfig, S3TierConfig, TierConfig
from tiered.tiers.base import DataReader, DataWriter, HostStagedReader, Tier, device_reader
from tiered.tiers.local import LocalTier
from tiered.tiers.memory import MemoryTier
from tiered.tiers.posix import PosixTier


def make_tier(config: TierConfig) -> Tier:
    """The tier a config entry describes (S3 tiers import boto3 here, on first use)."""
    if isinstance(config, MemoryTierConfig):
        return MemoryTier(config.name, config.path, config.direct_io, config.size, config.memory_only)
    if isinstance(config, LocalTierConfig):
        return LocalTier(config.name, config.path, config.direct_io)
    if isinstance(config, PosixTierConfig):
        return PosixTier(config.name, config.path)
    if isinstance(config, S3TierConfig):
        from tiered.tiers.s3 import S3Tier

        return S3Tier(config.name, config.bucket, config.prefix, endpoint_url=config.endpoint_url,
                      region=config.region, profile=config.profile, part_size=config.part_size,
                      max_attempts=config.max_attempts, timeout=config.timeout)
    raise TypeError(f"unknown tier config {type(config).__name__}")


__all__ = ["DataReader", "DataWriter", "HostStagedReader", "LocalTier", "MemoryTier", "PosixTier", "Tier",
           "device_reader", "make_tier"]
