"""On-disk format v1: names, records and their explicit (de)serialisation. See docs/format.md.

Per step a directory ``step_<12 digits>/`` holding, per rank, one data file of chunks
(``rank_00000.data``) and an index (``rank_00000.index.json``); ``MANIFEST.json`` is written
last, by atomic rename. A step without a manifest does not exist for any reader.

Everything read back from disk is validated here before any file is opened or any buffer sized
from it: names must be plain file names inside the step directory, sizes and offsets must be
consistent with each other and with the data file, and unknown versions are refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from tiered.errors import CorruptionError, FormatError, TieredError
from tiered.format import checksum
from tiered.format.chunks import ALIGNMENT, ChunkRecord, ChunkTable
from tiered.format.tree import collector_paused, decode, shares, walk_leaves

FORMAT_VERSION = 1
INDEX_VERSIONS = (1, 2)
"""Rank index versions this tiered reads. An index is written as version 2 only where its skeleton
refers to one tensor from several places (tensors that shared memory when saved: tied weights),
which a version-1 reader would refuse; otherwise as version 1, readable by every release."""
MANIFEST_VERSION = 2
"""Manifests since version 2 end with their own checksum (`manifest_checksum`); version 1
manifests, which lack it, are still read."""
_MANIFEST_TRAILER = re.compile(rb',\n "manifest_checksum": "([0-9a-f]{16})"\n}\n?\Z')
MANIFEST_NAME = "MANIFEST.json"
MAX_INDEX_BYTES = 1 << 30
MAX_MANIFEST_BYTES = 64 << 20
_STEP_DIR = re.compile(r"^step_(\d{12})$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")

_HEX64 = re.compile(r"[0-9a-f]{16}")
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8",
                 "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
                 "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise FormatError(f"dtype {dtype} is not supported by format v{FORMAT_VERSION}")
    return name


MAX_STEP = 10**12 - 1
"""The largest step number the format lists: step directories are named with 12 digits."""


def step_dir_name(step: int) -> str:
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step {step} is outside 0..{MAX_STEP}: the format names steps with 12 digits")
    return f"step_{step:012d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def data_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.data"


def index_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.index.json"


def rank_file_names(rank: int) -> tuple[str, str]:
    """The data file and the index of one rank."""
    return data_file_name(rank), index_file_name(rank)


def safe_name(name: object, source: str, what: str) -> str:
    """A plain file name inside the step directory: no separators, no '..', no absolute paths."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise FormatError(f"{source}: {what} {name!r} is not a plain file name inside the step directory")
    return name


@dataclass(frozen=True)
class CodecSpec:
    """Self-describing codec: exactly how to decode a tensor's chunks, stored in the index."""

    name: str
    configuration: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name: str, **configuration: Any) -> "CodecSpec":
        return cls(name, tuple(sorted(configuration.items())))

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.configuration)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": self.params}


CODEC_PARAMETERS: dict[str, dict[str, tuple[Any, ...]]] = {
    "none": {},
    "zstd": {"shuffle": (1, 2, 4, 8, 16)},
    "ans": {"data_type": ("<f4", "<f2", "|u1")},
}
"""Every codec a stored index may name, and the values each configuration key may take: plain
data, so that the format validates a stored `CodecSpec` without importing the codecs (which sit
above it). A codec module registers only under a name listed here (`tiered.codecs.base.register`)."""


MAX_RATIO = {"none": 1, "zstd": 1 << 16, "ans": 1 << 20}
"""Raw bytes per stored byte a chunk of each codec may claim (checked before any allocation a
restore makes for it): zstd's own format tops out near 32,768 (a 64 MiB chunk of zeros stores in
2,067 bytes); nvCOMP's ANS is given a wider margin. A codec not listed: 1."""


def check_codec_spec(spec: CodecSpec) -> None:
    """Raise KeyError for a codec name not in CODEC_PARAMETERS, ValueError for a configuration
    value it does not allow (keys it does not list are ignored, as the codecs ignore them)."""
    allowed = CODEC_PARAMETERS[spec.name]
    for key, value in spec.configuration:
        if key in allowed and (type(value) is bool or value not in allowed[key]):
            raise ValueError(f"{spec.name}: unsupported {key} {value!r} (supported: "
                             f"{', '.join(map(repr, allowed[key]))})")


@dataclass(frozen=True)
class TensorRecord:
    index: int
    """Leaf number the skeleton refers to as {"$tensor": index}."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    device: str
    """Device it was saved from; a restore that must create the tensor puts it there if it can."""
    is_numpy: bool
    codec: CodecSpec
    chunks: ChunkTable
    """(Any sequence of ChunkRecord given is made a ChunkTable.)"""

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, ChunkTable):
            object.__setattr__(self, "chunks", ChunkTable(self.chunks))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.torch_dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def stored_bytes(self) -> int:
        return self.chunks.stored_bytes


@dataclass(frozen=True)
class RankIndex:
    rank: int
    data_file: str
    data_bytes: int
    chunk_size: int
    skeleton: Any
    tensors: tuple[TensorRecord, ...]
    io: str = ""
    """How the data file was written (e.g. "kvikio-gds", "kvikio-compat", "posix-odirect")."""
    version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        return index_json(rank=self.rank, data_file=self.data_file, data_bytes=self.data_bytes,
                          chunk_size=self.chunk_size, skeleton=self.skeleton, io=self.io,
                          tensors=((t.index, t.name, t.dtype, t.shape, t.device, t.is_numpy, t.codec, t.chunks.to_json())
                                   for t in self.tensors))

    @classmethod
    def from_json(cls, raw: bytes, source: str) -> "RankIndex":
        with collector_paused():
            return cls._from_json(raw, source)

    @classmethod
    def _from_json(cls, raw: bytes, source: str) -> "RankIndex":
        doc = _load_json(raw, source, "tiered-index", INDEX_VERSIONS)
        v = _Validator(source)
        chunk_size = v.int(doc, "chunk_size", 1, 1 << 30)
        data_bytes = v.int(doc, "data_bytes", 0, 1 << 50)
        if v.int(doc, "alignment", 1, 1 << 30) != ALIGNMENT:
            raise FormatError(f"{source}: alignment {doc['alignment']} is not {ALIGNMENT}")
        if doc.get("checksum") != checksum.NAME:
            raise FormatError(f"{source}: unknown checksum algorithm {doc.get('checksum')!r}")
        raw_tensors = v.list(doc, "tensors")
        tensors = []
        end = 0
        for i, t in enumerate(raw_tensors):
            rec, end = v.tensor(t, i, chunk_size, data_bytes, end)
            tensors.append(rec)
        indices = [t.index for t in tensors]
        if sorted(indices) != list(range(len(tensors))):
            raise FormatError(f"{source}: tensor indices are not 0..{len(tensors) - 1}")
        try:
            refs = sorted(walk_leaves(doc.get("skeleton")))
            # Every value decodes: a tampered one fails here, where the reader falls back to another
            # tier and `verify` reports it, not while a restore rebuilds the state.
            decode(doc.get("skeleton"), lambda i: None)
        except TieredError:
            raise
        except Exception as exc:  # noqa: BLE001 - numpy, torch and base64 raise their own kinds
            raise FormatError(f"{source}: skeleton: {type(exc).__name__}: {str(exc)[:200]}") from None
        if doc["version"] >= 2:  # a tensor stored once may be referred to from several places
            refs = sorted(set(refs))
        if refs != list(range(len(tensors))):
            raise FormatError(f"{source}: the skeleton refers to tensors {refs[:5]}... but the index lists {len(tensors)}")
        return cls(rank=v.int(doc, "rank", 0, 1 << 24), data_file=safe_name(doc.get("data_file"), source, "data_file"),
                   data_bytes=data_bytes, chunk_size=chunk_size, skeleton=doc.get("skeleton"),
                   tensors=tuple(sorted(tensors, key=lambda t: t.index)), io=str(doc.get("io", "")),
                   version=doc["version"])


IndexTensor = tuple[int, str, str, Sequence[int], str, bool, CodecSpec, str]
"""One tensor of `index_json`: index, name, dtype, shape, device, is_numpy, codec, its chunk
table's JSON."""


def index_json(*, rank: int, data_file: str, data_bytes: int, chunk_size: int, skeleton: Any, io: str,
               tensors: Iterable[IndexTensor]) -> bytes:
    """A rank's index (`RankIndex.to_json`) from its fields, the tensors given one at a time: a
    save's writer makes its index this way, with no record kept per tensor. A state of thousands
    of tensors made as many TensorRecords and ChunkTables, which lived long enough to be promoted
    into the collector's oldest generation and set off its full passes over the training process
    every few saves (see ChunkTable)."""
    doc = {
        "format": "tiered-index", "version": 2 if shares(skeleton) else 1, "rank": rank,
        "data_file": data_file, "data_bytes": data_bytes, "chunk_size": chunk_size,
        "alignment": ALIGNMENT, "checksum": checksum.NAME, "io": io, "skeleton": skeleton,
        "tensors": [],
    }
    head = _dumps(doc)
    # Chunk tables are written as text rather than built as lists for json: an index of tens of
    # thousands of chunks made as many lists (see ChunkTable). Each tensor's object is assembled
    # as text too (json.dumps of a dict per tensor was most of the time), the strings through
    # json.dumps; the bytes are the same as json.dumps would make.
    codecs: dict[CodecSpec, str] = {}
    names: dict[str, str] = {}  # (dtypes and devices: a few distinct values)

    def one(index: int, name: str, dtype: str, shape: Sequence[int], device: str, is_numpy: bool, codec: CodecSpec,
            chunks: str) -> str:
        text = codecs.get(codec)
        if text is None:
            text = codecs[codec] = _dumps(codec.to_json())
        dtype_text = names.get(dtype) or names.setdefault(dtype, _string(dtype))
        device_text = names.get(device) or names.setdefault(device, _string(device))
        return (f'{{"index":{index},"name":{_string(name)},"dtype":{dtype_text},'
                f'"shape":[{",".join(map(str, shape))}],"device":{device_text},'
                f'"numpy":{"true" if is_numpy else "false"},"codec":{text},"chunks":{chunks}}}')

    body = ",".join([one(*t) for t in tensors])
    return (head[:-len('[]}')] + "[" + body + "]}").encode()


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
"""Made once: json.dumps with options builds an encoder per call (~1 us; an index calls it per tensor)."""


_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
"""A str as `_ENCODER` writes it (it calls this for a str), without the encoder's dispatch."""


def _dumps(doc: Any) -> str:
    return _ENCODER.encode(doc)


@dataclass(frozen=True)
class RankEntry:
    rank: int
    index_file: str
    index_bytes: int
    index_checksum: int
    data_file: str
    data_bytes: int


@dataclass(frozen=True)
class FileEntry:
    """A small file of the step pinned by the manifest (the DCP metadata)."""

    name: str
    size: int
    checksum: int


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    ranks: tuple[RankEntry, ...]
    """One entry per rank that stored anything (a rank DCP's planner gave nothing to write has none)."""
    raw_bytes: int
    stored_bytes: int
    created: str
    writer: str = ""
    dcp: FileEntry | None = None
    """Saved through torch.distributed.checkpoint: its metadata (tiered.dcp) is in this file."""
    version: int = FORMAT_VERSION

    @property
    def saved_fraction(self) -> float:
        return 1.0 - self.stored_bytes / self.raw_bytes if self.raw_bytes else 0.0

    def to_json(self) -> bytes:
        doc = {
            "format": "tiered-manifest", "version": MANIFEST_VERSION, "step": self.step, "created": self.created,
            "writer": self.writer, "world_size": self.world_size, "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "ranks": [{"rank": r.rank, "index_file": r.index_file, "index_bytes": r.index_bytes,
                       "index_checksum": f"{r.index_checksum:016x}", "data_file": r.data_file,
                       "data_bytes": r.data_bytes} for r in self.ranks],
        }
        if self.dcp is not None:
            doc["dcp"] = {"file": self.dcp.name, "bytes": self.dcp.size, "checksum": f"{self.dcp.checksum:016x}"}
        return seal_manifest(doc)

    @classmethod
    def from_json(cls, raw: bytes, source: str) -> "Manifest":
        doc = _load_json(raw, source, "tiered-manifest", (1, MANIFEST_VERSION))
        if doc["version"] >= 2:
            end = _MANIFEST_TRAILER.search(raw)
            if end is None or "manifest_checksum" not in doc \
                    or checksum.wsum64(raw[:end.start()]) != int(end.group(1), 16):
                raise FormatError(f"{source}: manifest does not match its own checksum (corrupted)")
        v = _Validator(source)
        world = v.int(doc, "world_size", 1, 1 << 24)
        ranks = []
        for i, r in enumerate(v.list(doc, "ranks")):
            if not isinstance(r, dict):
                raise FormatError(f"{source}: ranks[{i}] is not an object")
            ranks.append(RankEntry(
                rank=v.int(r, "rank", 0, world - 1), index_file=safe_name(r.get("index_file"), source, "index_file"),
                index_bytes=v.int(r, "index_bytes", 1, MAX_INDEX_BYTES), index_checksum=v.hex64(r, "index_checksum"),
                data_file=safe_name(r.get("data_file"), source, "data_file"),
                data_bytes=v.int(r, "data_bytes", 0, 1 << 50)))
        dcp = None
        if doc.get("dcp") is not None:
            d = doc["dcp"]
            if not isinstance(d, dict):
                raise FormatError(f"{source}: dcp is not an object")
            dcp = FileEntry(safe_name(d.get("file"), source, "dcp file"), v.int(d, "bytes", 1, MAX_MANIFEST_BYTES, "dcp."),
                            v.hex64(d, "checksum", "dcp."))
        numbers = sorted(r.rank for r in ranks)
        # A step saved by one process lists its one rank; one saved through DCP lists each rank
        # that stored anything (DCP's planner may give a rank nothing to write).
        if len(set(numbers)) != len(numbers) or (dcp is None and numbers != list(range(world))) or not numbers:
            raise FormatError(f"{source}: manifest lists ranks {numbers} for world_size {world}")
        return cls(step=v.int(doc, "step", 0, 1 << 62), world_size=world, ranks=tuple(ranks),
                   raw_bytes=v.int(doc, "raw_bytes", 0, 1 << 62), stored_bytes=v.int(doc, "stored_bytes", 0, 1 << 62),
                   created=str(doc.get("created", "")), writer=str(doc.get("writer", "")), dcp=dcp,
                   version=doc["version"])

    def entry(self, rank: int) -> RankEntry | None:
        return next((r for r in self.ranks if r.rank == rank), None)


def seal_manifest(doc: Mapping[str, Any]) -> bytes:
    """A manifest document as written, ending with `manifest_checksum`,
    the wsum64 of every byte before it, so that any flipped bit is caught, even one that leaves
    valid JSON with another value (a size, a date)."""
    body = {k: v for k, v in doc.items() if k != "manifest_checksum"}
    head = json.dumps(body, indent=1, allow_nan=False).encode()[:-2]
    return head + b',\n "manifest_checksum": "%016x"\n}' % checksum.wsum64(head)


def chunk_corruption(path: str, rec: TensorRecord, j: int, what: str) -> CorruptionError:
    """The error for a damaged chunk: names the file, the tensor and the chunk."""
    c = rec.chunks[j]
    return CorruptionError(f"{path}: tensor {rec.name!r} chunk {j} of {len(rec.chunks)} (file bytes "
                           f"{c.offset}..{c.offset + c.size}): corrupted: {what}")


def _load_json(raw: bytes, source: str, kind: str, versions: tuple[int, ...] = (FORMAT_VERSION,)) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FormatError(f"{source}: not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != kind:
        raise FormatError(f"{source}: not a {kind} document")
    version = doc.get("version")
    if isinstance(version, bool) or version not in versions:
        raise FormatError(f"{source}: format version {version!r} is not supported "
                          f"(this tiered reads {kind} version {' and '.join(map(str, versions))}); "
                          "upgrade tiered to read it")
    return doc


class _Validator:
    def __init__(self, source: str):
        self.source = source
        self._codecs: dict[tuple[str, tuple[tuple[str, type, Any], ...]], CodecSpec] = {}
        """Codec descriptions already checked: an index of thousands of tensors has a few."""

    def int(self, doc: Mapping[str, Any], key: str, lo: int, hi: int, where: str = "") -> int:
        # (type() first: isinstance of typing.Mapping costs ~2 us, and this runs per tensor)
        val = doc.get(key) if type(doc) is dict or isinstance(doc, Mapping) else None
        if type(val) is not int or not lo <= val <= hi:  # (not a bool, nor an int subclass)
            raise FormatError(f"{self.source}: {where}{key} = {val!r} is not an integer in [{lo}, {hi}]")
        return val

    def list(self, doc: Mapping[str, Any], key: str, where: str = "") -> list[Any]:
        val = doc.get(key)
        if not isinstance(val, list):
            raise FormatError(f"{self.source}: {where}{key} is not a list")
        return val

    def hex64(self, doc: Mapping[str, Any], key: str, where: str = "") -> int:
        return self.hex64_value(doc.get(key), f"{where}{key}")

    def hex64_value(self, val: Any, what: str) -> int:
        if not isinstance(val, str) or not _HEX64.fullmatch(val):
            raise FormatError(f"{self.source}: {what} = {val!r} is not a 64-bit hex checksum")
        return int(val, 16)

    def tensor(self, t: Any, i: int, chunk_size: int, data_bytes: int, end: int) -> tuple[TensorRecord, int]:
        where = f"tensors[{i}]."
        if not isinstance(t, dict):
            raise FormatError(f"{self.source}: tensors[{i}] is not an object")
        name = t.get("name")
        if not isinstance(name, str):
            raise FormatError(f"{self.source}: {where}name is not a string")
        where = f"tensor {name!r}: "
        dtype = t.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FormatError(f"{self.source}: {where}unknown dtype {dtype!r}")
        shape = t.get("shape")
        # type() rather than isinstance(): bool is not an int here (this runs per tensor).
        if type(shape) is not list or len(shape) > 64 or not all(type(d) is int and 0 <= d < 1 << 48 for d in shape):
            raise FormatError(f"{self.source}: {where}bad shape {str(shape)[:80]}")
        spec = self.codec(t.get("codec"), where)
        max_ratio = MAX_RATIO.get(spec.name, 1)
        chunks_raw = self.list(t, "chunks", where)
        chunks: list[ChunkRecord] = []
        for j, c in enumerate(chunks_raw):
            # type() rather than isinstance(): bool is not an int here, and this loop runs per chunk.
            if type(c) is not list or len(c) != 4:
                raise FormatError(f"{self.source}: {where}chunk {j} is malformed")
            off, size, raw_size, crc = c
            if type(off) is not int or type(size) is not int or type(raw_size) is not int or type(crc) is not str:
                raise FormatError(f"{self.source}: {where}chunk {j} is malformed")
            crc_value = self.hex64_value(crc, f"{where}chunk {j} c")
            extent = -(-size // ALIGNMENT) * ALIGNMENT
            if off % ALIGNMENT or off < end or size < 0 or off + extent > data_bytes:
                raise FormatError(f"{self.source}: {where}chunk {j} at offset {off} size {size} lies outside "
                                  f"the data file ({data_bytes} bytes) or overlaps the previous chunk")
            if not 0 < raw_size <= chunk_size:
                raise FormatError(f"{self.source}: {where}chunk {j} raw size {raw_size} not in (0, {chunk_size}]")
            if raw_size > size * max_ratio:
                raise FormatError(f"{self.source}: {where}chunk {j} claims {raw_size} bytes from {size} stored, more "
                                  f"than {spec.name} ever expands ({max_ratio}x)")
            end = off + extent
            chunks.append(ChunkRecord(off, size, raw_size, crc_value))
        rec = TensorRecord(index=self.int(t, "index", 0, 1 << 31), name=name, dtype=dtype, shape=tuple(shape),
                           device=str(t.get("device", "cpu")), is_numpy=bool(t.get("numpy", False)), codec=spec,
                           chunks=ChunkTable(chunks))
        nbytes = rec.nbytes
        expected = -(-nbytes // chunk_size)
        # Every chunk but the last is whole, and the last holds the rest.
        if len(chunks) != expected or (expected and chunks[-1].raw_size != nbytes - (expected - 1) * chunk_size) or (
                expected > 1 and any(c.raw_size != chunk_size for c in chunks[:-1])):
            raise FormatError(f"{self.source}: {where}{len(chunks)} chunks do not cover {nbytes} bytes "
                              f"in chunks of {chunk_size} (expected {expected})")
        return rec, end

    def codec(self, codec: Any, where: str) -> CodecSpec:
        """A tensor's codec description, checked against CODEC_PARAMETERS (each distinct one once)."""
        conf = codec.get("configuration", {}) if type(codec) is dict else None
        if type(conf) is not dict:
            raise FormatError(f"{self.source}: {where}bad codec description {str(codec)[:80]}")
        # The type of each value is in the key: True == 1 and 1 == 1.0, yet only an int is allowed.
        # Keys in the order written (an index writes them in one order): a description seen
        # before, checked then, is not checked again (an index of thousands of tensors has a few).
        key = (codec.get("name"), tuple([(k, type(v), v) for k, v in conf.items()]))
        try:
            spec = self._codecs.get(key)
        except TypeError:  # an unhashable name or value (a list, an object): refused below
            spec = None
        if spec is None:
            if not isinstance(codec.get("name"), str) or not all(
                    isinstance(k, str) and isinstance(v, (str, int, float, bool)) for k, v in conf.items()):
                raise FormatError(f"{self.source}: {where}bad codec description {str(codec)[:80]}")
            try:
                spec = CodecSpec.of(codec["name"], **conf)
                check_codec_spec(spec)
            except KeyError:
                raise FormatError(f"{self.source}: {where}unknown codec {codec['name']!r}") from None
            except (TypeError, ValueError) as exc:
                raise FormatError(f"{self.source}: {where}bad {codec['name']} configuration: {exc}") from None
            self._codecs[key] = spec
        return spec


def read_manifest(tier: Any, step: int) -> Manifest:
    """A committed step's manifest, validated."""
    source = tier.describe(step, MANIFEST_NAME)
    manifest = Manifest.from_json(tier.read_manifest(step), source)
    if manifest.step != step:
        raise FormatError(f"{source}: manifest says step {manifest.step}")
    return manifest


def read_rank_index(tier: Any, step: int, entry: RankEntry) -> RankIndex:
    """One rank's index, checked against its manifest entry."""
    raw = tier.read_file(step, entry.index_file, MAX_INDEX_BYTES)
    where = tier.describe(step, entry.index_file)
    if len(raw) != entry.index_bytes or checksum.wsum64(raw) != entry.index_checksum:
        raise FormatError(f"{where}: index does not match the manifest's size/checksum (corrupted)")
    index = RankIndex.from_json(raw, where)
    if index.data_file != entry.data_file or index.data_bytes != entry.data_bytes or index.rank != entry.rank:
        raise FormatError(f"{where}: index and manifest disagree about the rank or its data file")
    return index


def read_pinned(tier: Any, step: int, entry: FileEntry) -> bytes:
    """A small file the manifest pins by size and checksum."""
    raw = tier.read_file(step, entry.name, MAX_MANIFEST_BYTES)
    if len(raw) != entry.size or checksum.wsum64(raw) != entry.checksum:
        raise FormatError(f"{tier.describe(step, entry.name)}: does not match the manifest's size/checksum (corrupted)")
    return raw


def read_step(tier: Any, step: int) -> tuple[Manifest, list[RankIndex]]:
    """The manifest and every rank's index of a committed step, validated and cross-checked."""
    manifest = read_manifest(tier, step)
    return manifest, [read_rank_index(tier, step, entry) for entry in manifest.ranks]


def present_ranks(src: Any, step: int) -> tuple[Manifest, list[RankIndex]]:
    """A committed step's manifest and the indexes of the ranks whose files `src` holds. A step
    saved by several nodes is committed on each node's local tier with that node's ranks only."""
    manifest = read_manifest(src, step)
    entries = manifest.ranks if manifest.dcp is None else \
        [e for e in manifest.ranks if src.file_size(step, e.index_file) is not None]
    return manifest, [read_rank_index(src, step, e) for e in entries]
