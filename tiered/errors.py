"""Exceptions raised by tiered. Every message names what is wrong and where."""

from __future__ import annotations


class TieredError(Exception):
    """Base class of every error tiered raises on purpose."""


class ConfigError(TieredError, ValueError):
    """A configuration file or dict is invalid; the message names the file and the field."""


class UnknownTierError(ConfigError, KeyError):
    """A tier name the configuration does not define (a KeyError too: a lookup by name that failed)."""

    __str__ = Exception.__str__  # the message as written, not KeyError's quoted repr


class FormatError(TieredError):
    """A manifest or index is malformed, of an unknown version, or unsafe to follow."""


class CorruptionError(TieredError):
    """Stored bytes do not match their checksum; names the file, the tensor and the chunk."""


class CheckpointNotFoundError(TieredError, LookupError):
    """No committed checkpoint matches the request."""


class CodecUnavailableError(TieredError):
    """A codec cannot run here (for example `ans` without a GPU and nvCOMP)."""


class StateDictError(TieredError, TypeError):
    """A state_dict holds something that cannot be saved, or does not match the checkpoint."""


class BackgroundSaveError(TieredError):
    """A save failed (in the background, or refused by its tier): raised by its handle's `wait()`,
    and by the next `save()` or `wait()` as ``on_save_failure`` says."""

    def __init__(self, step: int, cause: BaseException):
        # Our own errors are written to be read; anything else keeps its type name.
        why = str(cause) if isinstance(cause, TieredError) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"background work of save(step={step}) failed: {why}")
        self.step = step
        self.__cause__ = cause


class SaveFailuresExceeded(BackgroundSaveError):
    """Saves kept failing under ``on_save_failure: warn`` (``max_failed_saves`` in a row, or none
    committed for ``max_time_without_commit``): raised by the next ``save()`` or ``wait()``."""

    def __init__(self, why: str, last: BackgroundSaveError):
        TieredError.__init__(self, f"{why}; the last: {last}")
        self.step = last.step
        self.__cause__ = last


class CollectiveError(TieredError):
    """A collective of a distributed save, commit or restore failed; the message names the ranks
    that did not answer and what they were last doing."""
