"""What a save through torch.distributed.checkpoint stores beside the ranks' files, and how it
is committed (used by tiered.dcp and tiered.distributed.saver):

- DCP's Metadata as JSON (``dcp_metadata.json``, pinned by the manifest; never pickled), with
  where each stored item is (`StoredItem`: a rank and a tensor of its index);
- `commit_step`: the coordinator writes that file, then the manifest, once every rank's files
  are durable;
- the commit across nodes, through the c10d store: the coordinator posts the manifest, and every
  other node's local rank 0 commits the same manifest on its node-local tier (`adopt_commit`).
"""

from __future__ import annotations

import base64
import datetime as _dt
import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.storage import WriteResult

from tiered.distributed.roll import last_doing, store
from tiered.errors import FormatError, TieredError
from tiered.format import checksum, tree
from tiered.format.manifest import DTYPES, FileEntry, Manifest, RankEntry, dtype_name
from tiered.units import format_size
from tiered.version import __version__

log = logging.getLogger("tiered")

DCP_METADATA = "dcp_metadata.json"
_KIND = "tiered-dcp-metadata"


@dataclass(frozen=True)
class RankSummary:
    """What the manifest needs of one rank's durable files."""

    entry: RankEntry
    raw_bytes: int
    stored_bytes: int


@dataclass(frozen=True)
class StoredItem:
    """Where DCP's item lives: tensor `tensor` of rank `rank`'s index (WriteResult.storage_data)."""

    rank: int
    tensor: int
    files: RankSummary | None = None
    """On one result per rank (its first): that rank's files, for the manifest."""
    copies: tuple[tuple[int, int], ...] = ()
    """Other (rank, tensor) holding the same item: a replicated item's copy on each other node
    (tiered.distributed.node_plan)."""



def results_of(items: Sequence[Any], files: Any, rank: int) -> list[WriteResult]:
    """DCP's WriteResults for `items` (WriteItems, in the order they were staged) once the rank's
    files (a RankFiles) are durable: item i is tensor i of the rank's index."""
    stored = files.tensor_stored
    summary = RankSummary(files.entry, files.raw_bytes, files.stored_bytes)
    return [WriteResult(index=item.index, size_in_bytes=stored[i],
                        storage_data=StoredItem(rank, i, summary if i == 0 else None))
            for i, item in enumerate(items)]


def commit_step(tier: Any, step: int, metadata: Metadata, results: Sequence[WriteResult], world_size: int) -> Manifest:
    """Write `metadata` (with where each item is stored) and the manifest listing every rank
    that stored anything on `tier` (the coordinator's fast tier): the commit. Every rank's files
    must be durable already."""
    locations = locations_of(results)
    files = sorted((r.storage_data.files for r in results if r.storage_data.files is not None),
                   key=lambda f: f.entry.rank)
    if not files:
        raise TieredError(f"step {step}: no rank stored anything")
    raw = metadata_to_json(metadata, locations)
    tier.write_file(step, DCP_METADATA, raw)
    manifest = Manifest(step=step, world_size=world_size, ranks=tuple(f.entry for f in files),
                        raw_bytes=sum(f.raw_bytes for f in files), stored_bytes=sum(f.stored_bytes for f in files),
                        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                        writer=f"tiered {__version__}", dcp=FileEntry(DCP_METADATA, len(raw), checksum.wsum64(raw)))
    tier.commit(step, manifest.to_json())
    log.info("tiered: step %d committed by %d of %d ranks: %s -> %s (%.1f%% saved)", step, len(files), world_size,
             format_size(manifest.raw_bytes), format_size(manifest.stored_bytes), 100 * manifest.saved_fraction)
    return manifest


def locations_of(results: Sequence[WriteResult]) -> dict[MetadataIndex, StoredItem]:
    """Where each item is stored: its lowest rank's copy, with the others as its `copies`."""
    out: dict[MetadataIndex, StoredItem] = {}
    for r in sorted(results, key=lambda r: r.storage_data.rank):
        s: StoredItem = r.storage_data
        first = out.get(r.index)
        if first is None:
            out[r.index] = StoredItem(s.rank, s.tensor)
        elif first.rank != s.rank:
            out[r.index] = StoredItem(first.rank, first.tensor, copies=first.copies + ((s.rank, s.tensor),))
    return out


# --- the commit across nodes (through the c10d store) ----------------------------------------



def multi_rank() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


POLL_S = 0.02
"""How soon a wait for another rank's post looks at the store again, at first."""


def wait_for_keys(keys: Sequence[str], timeout: timedelta, missing: Any) -> None:
    """Wait until every key is in the store, looking at once and then less often (20 ms, growing
    to 1 s: one request a look, however many ranks). Not `Store.wait`: a TCPStore client serves
    one request at a time, so a blocking wait on one thread holds every other thread's `set`
    behind it; two saves in flight (an `Engine.save` committing while `dcp.save` adopts another
    step) then wait on each other across ranks for ever. On timeout, a `TieredError` whose
    message is `missing(keys not posted)`."""
    s = store()
    deadline = time.monotonic() + timeout.total_seconds()
    delay = POLL_S
    while not s.check(list(keys)):
        if time.monotonic() > deadline:
            raise TieredError(missing([k for k in keys if not s.check([k])]))
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)


def commit_key(save_id: str) -> str:
    return f"tiered/{save_id}/commit"


def post_commit(tier: Any, save_id: str, manifest: Manifest) -> None:
    """Coordinator: post the committed manifest (and DCP metadata) of `tier` for the other nodes."""
    dcp_raw = tier.read_file(manifest.step, manifest.dcp.name, manifest.dcp.size)
    store().set(commit_key(save_id), json.dumps({"manifest": base64.b64encode(manifest.to_json()).decode(),
                                                 "dcp": base64.b64encode(dcp_raw).decode()}))


def post_failure(save_id: str, why: str) -> None:
    store().set(commit_key(save_id), json.dumps({"error": why}))


def adopt_commit(saves: Any, step: int, save_id: str) -> Manifest:
    """Wait for the coordinator's commit of `step`; on a node other than the coordinator's, its
    local rank 0 commits the same manifest (and DCP metadata) on this node's tier, where this
    node's ranks' files are; the other local ranks wait until it has. `saves`: this rank's
    SavePipeline (its fast tier and rank)."""
    s = store()
    timeout = timedelta(seconds=saves.config.distributed_timeout)
    wait_for_keys([commit_key(save_id)], timeout, lambda _: (
        f"step {step}: the coordinator, {last_doing([0])}, posted no commit within {timeout} "
        "(distributed_timeout): it stopped, or its save failed without a word"))
    posted = json.loads(s.get(commit_key(save_id)))
    if "error" in posted:
        raise TieredError(f"step {step} was not committed: the coordinator failed: {posted['error']}")
    raw = base64.b64decode(posted["manifest"])
    manifest = Manifest.from_json(raw, f"step {step}'s manifest from rank 0")
    tier = saves.tier
    if int(os.environ.get("LOCAL_RANK", saves.rank)) == 0:
        if not tier.has_step(step):
            tier.write_file(step, manifest.dcp.name, base64.b64decode(posted["dcp"]))
            tier.commit(step, raw)
    else:
        deadline = time.monotonic() + timeout.total_seconds()
        while not tier.has_step(step):
            if time.monotonic() > deadline:
                raise TieredError(f"step {step}: local rank 0 did not commit it on {tier.root}")
            time.sleep(0.02)
    return manifest


def adopt_in_background(saves: Any, step: int, save_id: str) -> None:
    """`adopt_commit` on a thread of its own (dcp.save gives no rank but the coordinator a hook
    after the commit); failures are logged, and the step is handed on once committed here."""
    try:
        adopt_commit(saves, step, save_id)
    except BaseException as exc:  # noqa: BLE001 - a thread of its own: logged
        log.error("tiered: step %d: this node did not commit it: %s", step, exc)
        return
    saves.notify_committed(step)


# --- the metadata as JSON --------------------------------------------------------------------

def metadata_to_json(md: Metadata, locations: dict[MetadataIndex, StoredItem]) -> bytes:
    """DCP's Metadata (and where each item is stored) as JSON: what `metadata_from_json` reads."""
    entries = {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            entries[fqn] = {"type": "bytes"}
        elif isinstance(meta, TensorStorageMetadata):
            p = meta.properties
            if p.layout != torch.strided:
                raise TieredError(f"{fqn}: layout {p.layout} is not supported (strided tensors only)")
            entries[fqn] = {"type": "tensor", "dtype": dtype_name(p.dtype), "size": list(meta.size),
                            "requires_grad": bool(p.requires_grad),
                            "chunks": [[list(c.offsets), list(c.sizes)] for c in meta.chunks]}
        else:
            raise TieredError(f"{fqn}: unknown DCP storage metadata {type(meta).__name__}")
    items = [[idx.fqn, None if idx.offset is None else list(idx.offset), idx.index, loc.rank, loc.tensor]
             for idx, loc in locations.items()]
    copies = [[i, rank, tensor] for i, loc in enumerate(locations.values()) for rank, tensor in loc.copies]
    sm = md.storage_meta
    skeleton, leaves = tree.flatten(md.planner_data)
    if leaves:
        raise TieredError("the planner's data holds tensors; tiered stores planner data as plain JSON only")
    doc = {"format": _KIND, "version": 1, "dcp_version": md.version, "state_dict_metadata": entries,
           "items": items, "planner_data": skeleton, **({"copies": copies} if copies else {}),
           "storage_meta": None if sm is None else {
               "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
               "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules)}}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


_INT = {int}


def metadata_from_json(raw: bytes, source: str) -> Metadata:
    """The Metadata `metadata_to_json` wrote, validated; storage_data maps items to StoredItems."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FormatError(f"{source}: not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != _KIND:
        raise FormatError(f"{source}: not a {_KIND} document")
    if doc.get("version") != 1:
        raise FormatError(f"{source}: version {doc.get('version')!r} is not supported; upgrade tiered to read it")

    def ints(val: Any, what: str) -> list[int]:  # (per item and chunk: type and range checked in C)
        if type(val) is not list or (val and (set(map(type, val)) != _INT or min(val) < 0 or max(val) >= 1 << 62)):
            raise FormatError(f"{source}: {what} is not a list of non-negative integers")
        return val

    entries: dict[str, Any] = {}
    sd = doc.get("state_dict_metadata")
    if not isinstance(sd, dict):
        raise FormatError(f"{source}: state_dict_metadata is not an object")
    for fqn, e in sd.items():
        if not isinstance(e, dict) or e.get("type") not in ("bytes", "tensor"):
            raise FormatError(f"{source}: {fqn}: bad entry")
        if e["type"] == "bytes":
            entries[fqn] = BytesStorageMetadata()
            continue
        if e.get("dtype") not in DTYPES:
            raise FormatError(f"{source}: {fqn}: unknown dtype {e.get('dtype')!r}")
        size = ints(e.get("size"), f"{fqn}: size")
        chunks = []
        for c in e.get("chunks") if isinstance(e.get("chunks"), list) else [None]:
            if not isinstance(c, list) or len(c) != 2:
                raise FormatError(f"{source}: {fqn}: bad chunk {c!r}")
            off, sizes = ints(c[0], f"{fqn}: chunk offsets"), ints(c[1], f"{fqn}: chunk sizes")
            if len(off) != len(size) or len(sizes) != len(size) or any(
                    o + n > s for o, n, s in zip(off, sizes, size)):
                raise FormatError(f"{source}: {fqn}: chunk {c} lies outside the tensor's size {size}")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sizes)))
        entries[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=DTYPES[e["dtype"]], requires_grad=bool(e.get("requires_grad"))),
            size=torch.Size(size), chunks=chunks)
    locations = {}
    if not isinstance(doc.get("items"), list):
        raise FormatError(f"{source}: items is not a list")
    for it in doc["items"]:
        if not isinstance(it, list) or len(it) != 5 or not isinstance(it[0], str) or it[0] not in entries \
                or not (it[2] is None or type(it[2]) is int) or type(it[3]) is not int or type(it[4]) is not int:
            raise FormatError(f"{source}: bad item {str(it)[:120]}")
        offset = None if it[1] is None else torch.Size(ints(it[1], f"{it[0]}: offset"))
        locations[MetadataIndex(it[0], offset, it[2])] = StoredItem(it[3], it[4])
    copies = doc.get("copies", [])
    if type(copies) is not list:
        raise FormatError(f"{source}: copies is not a list")
    keys = list(locations)
    for c in copies:
        if type(c) is not list or len(c) != 3 or any(type(v) is not int or v < 0 for v in c) or c[0] >= len(keys):
            raise FormatError(f"{source}: bad copy {str(c)[:120]} (item number, rank, tensor)")
        first = locations[keys[c[0]]]
        locations[keys[c[0]]] = StoredItem(first.rank, first.tensor, copies=first.copies + ((c[1], c[2]),))
    try:
        planner_data = tree.decode(doc.get("planner_data"), lambda i: None)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise FormatError(f"{source}: planner_data: {exc}") from None
    sm = doc.get("storage_meta")
    storage_meta = None
    if isinstance(sm, dict):
        storage_meta = StorageMeta(checkpoint_id=sm.get("checkpoint_id"), save_id=sm.get("save_id"),
                                   load_id=sm.get("load_id"), modules=list(sm.get("modules") or []))
    return Metadata(state_dict_metadata=entries, planner_data=planner_data, storage_data=locations,
                    storage_meta=storage_meta, version=doc.get("dcp_version"))
