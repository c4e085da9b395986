"""YAML -> frozen, validated configuration.

Parsed once at the edge: every later component reads typed attributes, never strings by key.
Any unknown key, wrong type or impossible value raises ConfigError naming the file and the
field path, e.g. ``cluster.yaml: tiers[1].bandwidth: expected a bandwidth such as '12GB/s'``.

Relative paths in a config are resolved against the current working directory, so the
embedded default (``./.tiered/...``) lands beside the training script.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any, Mapping, Union

import yaml

from tiered.errors import ConfigError
from tiered.units import parse_bandwidth, parse_duration, parse_size

CONFIG_VERSION = 1
CODEC_NAMES = ("ans", "zstd", "none")
AUTO = "auto"
"""A tier's codec chosen by `tiered.policy.choose_codec` from measurements (the default)."""
CPU_DECODABLE_CODECS = ("zstd", "none")
_MIN_CHUNK = 64 * 1024
_MAX_CHUNK = 64 * 1024 * 1024
ANS_MAX_CHUNK = 16 * 1024 * 1024
"""The largest chunk nvCOMP's ANS compresses."""


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """Memory the engine may hold between `save()` returning and the bytes being durable."""

    gpu_buffer: int | None = None
    """Compressed chunks held on each GPU until written (one slab, reused across saves).
    None (``auto``): sized at the first save from free GPU memory (tiered.stage.budgets)."""
    pack_buffer: int = 256 * 1024**2
    """GPU buffer in which tensors are packed for one batched codec call (reused)."""
    host_buffer: int | None = None
    """Host memory: compressed GPU chunks drained off the GPU plus snapshots of CPU tensors.
    None (``auto``): sized from the host's available memory at start-up (tiered.stage.budgets)."""


@dataclass(frozen=True, kw_only=True)
class ZstdSettings:
    level: int = 3
    threads: int = 0
    """CPU threads for the CPU zstd implementation; 0 means one per core."""


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    name: str
    kind: str
    codec: str = AUTO
    """A codec name pins it; "auto" lets the policy choose from measured bandwidth and codec speed."""
    portable: bool = False
    """Only codecs that a CPU can decode are allowed (restorable without a GPU)."""
    bandwidth: float | None = None
    """Bytes/s the policy assumes for this tier; probed once and cached when absent."""
    keep_last: int | None = None
    """Retention: keep the newest `keep_last` steps here (None: no limit from this rule)."""
    keep_every: int | None = None
    """Retention: also keep every step that is a multiple of `keep_every`."""
    price_per_gb_month: float | None = None
    """USD per GB stored for a month here (`tiered cost`); None: not priced."""
    egress_per_gb: float | None = None
    """USD per GB copied into this tier (`tiered cost`: a cloud's transfer or request charges); None: free."""

    @property
    def retention(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None


@dataclass(frozen=True, kw_only=True)
class LocalTierConfig(TierConfig):
    """Node-local NVMe: GPU buffers go through KvikIO (GDS or its compat mode)."""

    path: Path
    direct_io: str = "auto"
    """O_DIRECT for host-buffer writes: "auto" (when the filesystem supports it), "on", "off"."""


@dataclass(frozen=True, kw_only=True)
class MemoryTierConfig(LocalTierConfig):
    """Host RAM on the node that outlives the training process: a tmpfs (default /dev/shm/tiered),
    written and read as the local tier is; the fast tier, above local NVMe, or alone."""

    size: int | None = None
    """Bytes of steps the tier may hold (oldest steps a slower tier holds make room); None: half
    of its filesystem, measured when the tier is opened."""
    memory_only: bool = True
    """Refuse a path whose filesystem is not memory-backed (tmpfs, ramfs)."""
    replicas: int = 0
    """Under torch.distributed across nodes: each rank's committed step is also kept in the memory
    tier of this many ranks on other nodes (tiered.distributed.replicas), for a restore after a node
    loss (tiered.distributed.peers)."""


@dataclass(frozen=True, kw_only=True)
class PosixTierConfig(TierConfig):
    """A shared POSIX filesystem (Lustre, GPFS, NFS)."""

    path: Path


@dataclass(frozen=True, kw_only=True)
class S3TierConfig(TierConfig):
    """An S3 bucket. Credentials come only from the standard AWS chain, never from YAML."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    part_size: int = 64 * 1024**2
    """Bytes per part of a data file's multipart upload (5 MiB to 5 GiB; smaller files are one PUT)."""
    max_attempts: int = 10
    """Attempts per S3 request (botocore's adaptive retry mode: throttling, 5xx answers and lost
    connections are retried with exponential backoff and jitter; 4xx answers fail at once)."""
    timeout: float = 60.0
    """Seconds to connect, and to wait on a connection that has gone silent, before the attempt counts as failed."""


@dataclass(frozen=True, kw_only=True)
class Config:
    source: str
    chunk_size: int = 1024 * 1024
    budgets: Budgets = Budgets()
    zstd: ZstdSettings = ZstdSettings()
    migration: str = "process"
    """"process": a child process of the engine copies each committed step down the tiers
    (tiered.migrate.process); "in_process": a background thread of the training process does;
    "external": another process does (the engine only writes the fast tier)."""
    on_fast_tier_error: str = "fail"
    """"fail": a save the fast tier cannot take fails with an error naming the cause. "next_tier":
    it is written to the next tier instead (see Engine.save)."""
    on_save_failure: str = "warn"
    """"warn": a save that fails in the background is logged at ERROR, recorded and not committed,
    and training goes on; the next `save()` or `wait()` raises only once `max_failed_saves` saves
    in a row have failed, or when a save fails and none has committed for
    `max_time_without_commit`. "raise": the next `save()` or `wait()` raises every failure."""
    max_failed_saves: int = 3
    """With ``on_save_failure: warn``: this many failed saves in a row stop training."""
    distributed_timeout: float = 1800.0
    """Seconds a rank waits for the others in a distributed save, commit or restore (their files
    durable, the coordinator's commit, the engine's own collectives) before it fails, naming the
    ranks that did not answer and what they were doing."""
    max_time_without_commit: float | None = None
    """With ``on_save_failure: warn``: seconds without a committed save after which a failed save
    stops training (None: no time bound)."""
    tiers: tuple[TierConfig, ...]
    document: Any = field(default=None, compare=False, repr=False)
    """The parsed YAML (or dict) this config was read from: what a child process reads it from."""

    @property
    def fast_tier(self) -> LocalTierConfig:
        tier = self.tiers[0]
        assert isinstance(tier, LocalTierConfig)
        return tier


ConfigInput = Union[str, os.PathLike, Mapping[str, Any], None]


def default_config_text() -> str:
    """The embedded default (configs/local.yaml in the repository)."""
    return resources.files("tiered").joinpath("configs/local.yaml").read_text()


def load_config(source: ConfigInput = None) -> Config:
    """Config from a YAML path, an already-parsed dict, or None for the embedded default."""
    if source is None:
        return _parse(yaml.safe_load(default_config_text()), "<embedded configs/local.yaml>")
    if isinstance(source, Mapping):
        return _parse(source, "<dict>")
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        loc = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        raise ConfigError(f"{path}: invalid YAML{loc}: {getattr(exc, 'problem', exc)}") from None
    return _parse(data, str(path))


class _Fields:
    """Reads one mapping, remembering which keys were consumed, so leftovers are errors."""

    def __init__(self, data: object, source: str, where: str):
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: {where or 'top level'}: expected a mapping, got {_kind(data)}")
        self.data, self.source, self.where, self.seen = data, source, where, set()

    def field(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def error(self, key: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.field(key)}: {msg}")

    def get(self, key: str, default: Any = ..., *, required: bool = False) -> Any:
        self.seen.add(key)
        if key not in self.data:
            if required:
                raise self.error(key, "is required")
            return default
        return self.data[key]

    def typed(self, key: str, types: type | tuple[type, ...], default: Any = ..., **kw: Any) -> Any:
        value = self.get(key, default, **kw)
        if value is default:
            return value
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise self.error(key, f"expected {_names(types)}, got a boolean")
        if not isinstance(value, types):
            raise self.error(key, f"expected {_names(types)}, got {_kind(value)} {value!r}")
        return value

    def size(self, key: str, default: int) -> int:
        value = self.get(key, default)
        try:
            return parse_size(value)
        except ValueError as exc:
            raise self.error(key, str(exc)) from None

    def size_or_auto(self, key: str) -> int | None:
        """A size, or None for ``auto`` (the default)."""
        if self.get(key, AUTO) == AUTO:
            return None
        return self.size(key, 0)

    def finish(self) -> None:
        unknown = sorted(str(k) for k in self.data if k not in self.seen)
        if unknown:
            raise self.error(unknown[0], f"unknown field (known here: {', '.join(sorted(self.seen))})")


def _kind(value: object) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", int: "an integer",
            float: "a number", bool: "a boolean", type(None): "nothing"}.get(type(value), type(value).__name__)


def _names(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join({str: "a string", int: "an integer", float: "a number", bool: "true/false",
                        list: "a list", dict: "a mapping"}.get(t, t.__name__) for t in types)


def _parse(data: object, source: str) -> Config:
    if data is None:
        raise ConfigError(f"{source}: the config is empty")
    top = _Fields(data, source, "")
    version = top.typed("version", int, CONFIG_VERSION)
    if version != CONFIG_VERSION:
        raise top.error("version", f"unsupported config version {version} (this tiered reads {CONFIG_VERSION})")
    chunk_size = top.size("chunk_size", 1024 * 1024)
    if not (_MIN_CHUNK <= chunk_size <= _MAX_CHUNK) or chunk_size % 4096:
        raise top.error("chunk_size", f"must be a multiple of 4KiB between 64KiB and 64MiB, got {chunk_size}")
    budgets = _parse_budgets(top.get("budgets", {}), source, chunk_size)
    zstd = _parse_codecs(top.get("codecs", {}), source)
    migration = top.typed("migration", str, "process")
    if migration not in ("process", "in_process", "external"):
        raise top.error("migration", f"expected process, in_process or external, got {migration!r}")
    on_error = top.typed("on_fast_tier_error", str, "fail")
    if on_error not in ("fail", "next_tier"):
        raise top.error("on_fast_tier_error", f"expected fail or next_tier, got {on_error!r}")
    on_failure = top.typed("on_save_failure", str, "warn")
    if on_failure not in ("warn", "raise"):
        raise top.error("on_save_failure", f"expected warn or raise, got {on_failure!r}")
    max_failed = top.typed("max_failed_saves", int, 3)
    if not 1 <= max_failed <= 1000:
        raise top.error("max_failed_saves", f"must be 1..1000 (failed saves in a row), got {max_failed}")
    unprotected = top.get("max_time_without_commit", None)
    if unprotected is not None:
        try:
            unprotected = parse_duration(unprotected)
        except ValueError as exc:
            raise top.error("max_time_without_commit", str(exc)) from None
    try:
        dist_timeout = parse_duration(top.get("distributed_timeout", "30min"))
    except ValueError as exc:
        raise top.error("distributed_timeout", str(exc)) from None
    raw_tiers = top.typed("tiers", list, required=True)
    top.finish()
    if not raw_tiers:
        raise top.error("tiers", "needs at least one tier (the first is the fast, node-local tier)")
    if on_error == "next_tier" and len(raw_tiers) < 2:
        raise top.error("on_fast_tier_error", "next_tier needs a second tier to fall back to")
    tiers = tuple(_parse_tier(t, source, f"tiers[{i}]") for i, t in enumerate(raw_tiers))
    if not isinstance(tiers[0], LocalTierConfig):
        raise ConfigError(f"{source}: tiers[0].kind: the first tier must be kind 'memory' or 'local' (on this node)")
    for i, t in enumerate(tiers[1:], 1):
        if isinstance(t, MemoryTierConfig):
            raise ConfigError(f"{source}: tiers[{i}].kind: a memory tier can only be the first tier (the fastest)")
    names = [t.name for t in tiers]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"{source}: tiers[{i}].name: duplicate tier name {name!r}")
    _refuse_shared_storage(tiers, source)
    gpu_only = [t.name for t in tiers if t.codec in ("ans", AUTO)]
    if chunk_size > ANS_MAX_CHUNK and gpu_only:
        raise top.error("chunk_size", f"at most 16MiB where a tier may store with ans (nvCOMP's ANS takes chunks "
                                      f"of up to 16 MiB; tier {gpu_only[0]!r} has codec {tiers[names.index(gpu_only[0])].codec}), "
                                      f"got {chunk_size}")
    return Config(source=source, chunk_size=chunk_size, budgets=budgets, zstd=zstd, migration=migration,
                  on_fast_tier_error=on_error, on_save_failure=on_failure, max_failed_saves=max_failed,
                  max_time_without_commit=unprotected, distributed_timeout=dist_timeout, tiers=tiers,
                  document=data)


def storage_of(tier: TierConfig) -> tuple[str, str]:
    """Where a tier keeps its steps, as (store, path within it): a filesystem tier's directory
    with symlinks and `..` resolved; an S3 tier's endpoint and bucket, and its prefix."""
    if isinstance(tier, (LocalTierConfig, PosixTierConfig)):
        return "file", os.path.realpath(os.path.abspath(tier.path))
    assert isinstance(tier, S3TierConfig)
    endpoint = (tier.endpoint_url or "aws").rstrip("/").lower()
    return f"s3 {endpoint} {tier.bucket}", tier.prefix.strip("/")


def _refuse_shared_storage(tiers: tuple[TierConfig, ...], source: str) -> None:
    """Two tiers on one storage lose steps: one tier's retention deletes what the other counts
    as its copy. Refuse the same or nested directories, and one bucket with overlapping prefixes."""
    for i, a in enumerate(tiers):
        for j in range(i):
            b = tiers[j]
            (store_a, path_a), (store_b, path_b) = storage_of(a), storage_of(b)
            if store_a != store_b:
                continue
            if store_a == "file":
                show_a, show_b, sep = path_a, path_b, os.sep
            else:
                _, endpoint, bucket = store_a.split(" ", 2)
                at = "" if endpoint == "aws" else f" at {endpoint}"
                show_a, show_b, sep = f"s3://{bucket}/{path_a}{at}", f"s3://{bucket}/{path_b}{at}", "/"
            if path_a == path_b:
                why = f"both use {show_a}"
            elif not path_b or path_a.startswith(path_b + sep):
                why = f"{show_a} lies inside {show_b}"
            elif not path_a or path_b.startswith(path_a + sep):
                why = f"{show_b} lies inside {show_a}"
            else:
                continue
            raise ConfigError(f"{source}: tiers[{i}] ({a.name!r}) and tiers[{j}] ({b.name!r}) share one storage: "
                              f"{why}. Give each tier a location of its own, neither inside the other: one tier's "
                              "retention would delete the steps the other counts as its copy")


def _parse_budgets(data: object, source: str, chunk_size: int) -> Budgets:
    f = _Fields(data, source, "budgets")
    d = Budgets()
    b = Budgets(gpu_buffer=f.size_or_auto("gpu_buffer"),
                pack_buffer=f.size("pack_buffer", d.pack_buffer),
                host_buffer=f.size_or_auto("host_buffer"))
    f.finish()
    for name in ("gpu_buffer", "pack_buffer", "host_buffer"):
        # Smallest workable budget: a few chunks, so that waves still make progress.
        if getattr(b, name) is not None and getattr(b, name) < 4 * chunk_size:
            raise f.error(name, f"must hold at least 4 chunks ({4 * chunk_size} bytes), got {getattr(b, name)}")
    return b


def _parse_codecs(data: object, source: str) -> ZstdSettings:
    f = _Fields(data, source, "codecs")
    zf = _Fields(f.get("zstd", {}), source, "codecs.zstd")
    f.finish()
    level = zf.typed("level", int, 3)
    threads = zf.typed("threads", int, 0)
    zf.finish()
    if not 1 <= level <= 19:
        raise zf.error("level", f"must be 1..19 (levels GPU nvCOMP decodes too), got {level}")
    if threads < 0:
        raise zf.error("threads", f"must be >= 0 (0 = one per core), got {threads}")
    return ZstdSettings(level=level, threads=threads)


_TIER_KINDS = ("memory", "local", "posix", "s3")
MEMORY_DEFAULT_PATH = "/dev/shm/tiered"
MAX_REPLICAS = 7


def _parse_tier(data: object, source: str, where: str) -> TierConfig:
    f = _Fields(data, source, where)
    name = f.typed("name", str, required=True)
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise f.error("name", f"use letters, digits, '-' and '_' only, got {name!r}")
    kind = f.typed("kind", str, required=True)
    if kind not in _TIER_KINDS:
        raise f.error("kind", f"unknown tier kind {kind!r} (known: {', '.join(_TIER_KINDS)})")
    portable = f.typed("portable", bool, kind not in ("local", "memory"))
    codec = f.typed("codec", str, AUTO)
    if codec not in CODEC_NAMES + (AUTO,):
        raise f.error("codec", f"unknown codec {codec!r} (known: {AUTO}, {', '.join(CODEC_NAMES)})")
    if portable and codec not in CPU_DECODABLE_CODECS + (AUTO,):
        raise f.error("codec", f"tier is portable: true, but {codec!r} needs a GPU to decode "
                               f"(use one of {', '.join(CPU_DECODABLE_CODECS)})")
    bandwidth = f.get("bandwidth", None)
    if bandwidth is not None:
        try:
            bandwidth = parse_bandwidth(bandwidth)
        except ValueError as exc:
            raise f.error("bandwidth", str(exc)) from None
    retention = {}
    for key in ("keep_last", "keep_every"):
        value = f.typed(key, int, None)
        if value is not None and value < 1:
            raise f.error(key, f"must be at least 1 (leave it out to keep every step), got {value}")
        retention[key] = value
    for key in ("price_per_gb_month", "egress_per_gb"):
        value = f.get(key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise f.error(key, f"must be a number of US dollars >= 0, got {value!r}")
        retention[key] = None if value is None else float(value)
    common = dict(name=name, kind=kind, codec=codec, portable=portable, bandwidth=bandwidth, **retention)
    if kind in ("local", "posix", "memory"):
        path = f.typed("path", str, MEMORY_DEFAULT_PATH) if kind == "memory" else f.typed("path", str, required=True)
        if not path.strip():
            raise f.error("path", "must not be empty")
        if kind == "memory":
            size = None if f.get("size", None) is None else f.size("size", 0)
            if size is not None and size < 1 << 20:
                raise f.error("size", f"must be at least 1MiB (or left out: half of the memory filesystem), got {size}")
            replicas = f.typed("replicas", int, 0)
            if not 0 <= replicas <= MAX_REPLICAS:
                raise f.error("replicas", f"must be 0 (none) to {MAX_REPLICAS}: the ranks on other nodes keeping a copy "
                                          f"of each rank's step, got {replicas}")
            tier: TierConfig = MemoryTierConfig(path=Path(path).expanduser(), direct_io=_direct_io(f), size=size,
                                    memory_only=f.typed("memory_only", bool, True), replicas=replicas, **common)
        elif kind == "local":
            tier = LocalTierConfig(path=Path(path).expanduser(), direct_io=_direct_io(f), **common)
        else:
            tier = PosixTierConfig(path=Path(path).expanduser(), **common)
    else:
        for secret in ("aws_access_key_id", "aws_secret_access_key", "access_key", "secret_key",
                       "aws_session_token", "credentials"):
            if secret in f.data:
                raise f.error(secret, "credentials are never read from YAML: use the standard AWS chain "
                                      "(environment, ~/.aws/credentials with `profile`, instance role)")
        bucket = f.typed("bucket", str, required=True)
        if not bucket:
            raise f.error("bucket", "must not be empty")
        part_size = f.size("part_size", 64 * 1024**2)
        if not 5 * 1024**2 <= part_size <= 5 * 1024**3:
            raise f.error("part_size", f"must be 5MiB..5GiB (S3's limits for a part), got {part_size}")
        max_attempts = f.typed("max_attempts", int, 10)
        if not 1 <= max_attempts <= 100:
            raise f.error("max_attempts", f"must be 1..100 (attempts per request, the first included), got {max_attempts}")
        timeout = f.typed("timeout", (int, float), 60.0)
        if not 0 < timeout <= 3600:
            raise f.error("timeout", f"must be more than 0 and at most 3600 seconds, got {timeout}")
        tier = S3TierConfig(bucket=bucket, prefix=f.typed("prefix", str, "").strip("/"),
                            endpoint_url=_endpoint(f, f.typed("endpoint_url", str, None)),
                            region=f.typed("region", str, None), profile=f.typed("profile", str, None),
                            part_size=part_size, max_attempts=max_attempts, timeout=float(timeout), **common)
    f.finish()
    return tier


def _direct_io(f: _Fields) -> str:
    direct_io = f.typed("direct_io", str, "auto")
    if direct_io not in ("auto", "on", "off"):
        raise f.error("direct_io", f"expected auto, on or off, got {direct_io!r}")
    return direct_io


def _endpoint(f: _Fields, url: str | None) -> str | None:
    """An S3 endpoint: scheme://host[:port][/path], no credentials in it (refused without
    echoing them), no query string (a presigned URL's signature is a credential too)."""
    if url is None:
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        raise f.error("endpoint_url", "is not a URL (expected http(s)://host[:port])") from None
    if "@" in parts.netloc:
        shown = f"{parts.scheme}://<credentials>@{parts.netloc.rpartition('@')[2]}"
        raise f.error("endpoint_url", f"carries credentials ({shown}): they are never read from YAML; use the "
                                      "standard AWS chain (environment, ~/.aws/credentials with `profile`, "
                                      "instance role) and give the endpoint as scheme://host[:port]")
    if parts.query or parts.fragment:
        raise f.error("endpoint_url", "takes no query string or fragment (a presigned URL's signature is a "
                                      "credential): give it as scheme://host[:port]")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise f.error("endpoint_url", f"expected http(s)://host[:port], got {url!r}")
    return url
