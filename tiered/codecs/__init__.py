"""Codecs, registered by name. See `tiered.codecs.base` for the protocol and call order."""

from tiered.codecs import ans, none, zstd  # noqa: F401  (registration)
from tiered.codecs.base import Codec, codec_names, get_codec, get_codec_class, register

__all__ = ["Codec", "codec_names", "get_codec", "get_codec_class", "register"]
