"""DCP's StorageWriter and StorageReader over tiered's save and restore pipelines.

`StepWriter` hands a rank's planned items to a `SavePipeline` (rank_only: its data file and
index); the coordinator commits the step once every rank's files are durable (tiered.distributed.commit).
`StepReader` reads the chunk ranges a rank's load plan needs through a `Restorer`. Both sit below
the Engine: the distributed `Engine.save` / `Engine.restore` (tiered.distributed.saver) use them
directly, and the public `tiered.dcp.TieredStorageWriter` / `TieredStorageReader` wrap them for
an Engine or a config.

StorageWriter call order (DCP's): reset(step) -> set_up_storage_writer -> prepare_local_plan ->
(coordinator) prepare_global_plan -> write_data -> (coordinator) finish.
StorageReader call order: reset(step) -> read_metadata -> set_up_storage_reader ->
prepare_local_plan -> (coordinator) prepare_global_plan -> read_data.

The DCP metadata is stored as JSON (``dcp_metadata.json``, pinned by the manifest), never pickled.
Loading with `SafeLoadPlanner` reads non-tensor values with torch.load(weights_only=True): no arbitrary objects.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tiered import threads
from tiered.distributed.commit import (StoredItem, adopt_in_background, commit_step, metadata_from_json, multi_rank,
                                       post_commit, post_failure, results_of)
from tiered.errors import CheckpointNotFoundError, FormatError, TieredError
from tiered.format import tree
from tiered.format.manifest import (Manifest, RankEntry, RankIndex, TensorRecord, read_manifest, read_pinned,
                                    read_rank_index)
from tiered.restore.pipeline import STAGED_BYTES
from tiered.stage.repair import ChunkRepair

log = logging.getLogger("tiered")


def _step_of(checkpoint_id: Any) -> int:
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    if isinstance(text, str) and text.isdigit():
        return int(text)
    raise ValueError(f"tiered checkpoint_id must be a step number (a non-negative int), got {checkpoint_id!r}")


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def item_name(index: MetadataIndex) -> str:
    """The tensor name an item gets in a rank's index: its fqn, and the shard's offsets."""
    return index.fqn if index.offset is None else f"{index.fqn}@{','.join(map(str, index.offset))}"


_layout: tuple[Any, "tree.FlatNames | None"] = (None, None)
"""The last plan whose items were laid out, and their layout (`tree.FlatNames` of the item
names): a distributed save reuses its plan while the state keeps its structure
(tiered.distributed.reuse), so the names, paths and skeleton are made once, not per save."""


def _bytes_tensor(data: io.BytesIO) -> tuple[torch.Tensor, int]:
    """A serialized value (a BYTE_IO item's data) as a uint8 tensor of its bytes, and their count."""
    n = data.getbuffer().nbytes
    if not n:
        return torch.empty(0, dtype=torch.uint8), 0
    return torch.frombuffer(bytearray(data.getbuffer()), dtype=torch.uint8), n


def _flat_names(plan: SavePlan) -> tree.FlatNames:
    global _layout
    last, layout = _layout
    if last is not plan or layout is None:  # (the tuple holds the plan, so no other can have its id meanwhile)
        layout = tree.FlatNames([item_name(item.index) for item in plan.items])
        _layout = (plan, layout)
    return layout


# --- writing ---------------------------------------------------------------------------------

class StepWriter(StorageWriter):
    """A DCP StorageWriter writing `step` through `saves` (a SavePipeline). The checkpoint_id
    given to dcp.save, if any, is the step."""

    def __init__(self, saves: Any, step: int | None = None):
        self.saves = saves
        self.step = None if step is None else _step_of(step)
        self.is_coordinator = False
        self.rank, self.world_size = 0, 1
        self.save_id: str | None = None
        """Set by the coordinator's prepare_global_plan; every rank gets it with its plan."""

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
        self.save_id = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            _step_of(checkpoint_id)
        except ValueError:
            return False
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise ValueError("TieredStorageWriter needs a step: TieredStorageWriter(engine, step) or "
                             "dcp.save(..., checkpoint_id=step)")
        self.is_coordinator = is_coordinator
        rank, self.world_size = _rank_world()
        self.rank = kwargs.get("rank", rank)
        self.saves.bind_rank(self.rank, self.world_size)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # One id for this save, sent to every rank with its plan: the key under which the ranks
        # and the coordinator exchange the commit (paths may differ from node to node).
        save_id = uuid.uuid4().hex
        return [dataclasses.replace(p, storage_data=save_id) for p in plans]

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self.step is None else str(self.step))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Stage this rank's items (GPU tensors: compressed on their GPU) and return a future of
        their WriteResults that completes when the rank's files are durable."""
        fut: Future = Future()
        self.save_id = plan.storage_data
        handle = self.stage_items(plan, lambda i, item: planner.resolve_data(item))
        if not self.is_coordinator and isinstance(self.save_id, str) and multi_rank():
            # dcp.save gives no rank but the coordinator a hook after the commit: a thread waits
            # for the coordinator's post and commits the step on this node's tier as well.
            t = threads.start(adopt_in_background, self.saves, self.step, self.save_id, name="tiered-adopt")
            self.saves.track(t)  # Engine.wait() and close() join it
        if handle is None:
            fut.set_result([])
            return fut
        items = list(plan.items)

        def done(f: Any) -> None:
            try:
                fut.set_result(results_of(items, f.result(), self.rank))
            except BaseException as exc:  # noqa: BLE001 - handed to DCP through the future
                fut.set_exception(exc)

        handle.persisted.add_done_callback(done)
        return fut

    def stage_items(self, plan: SavePlan, resolve: Callable[[int, WriteItem], Any], structure: Any = None,
                    deferrable: bool = False) -> Any:
        """Hand this rank's items to the save pipeline; return its SaveHandle (None: nothing to
        write). `resolve(i, item)` gives item i's data (a planner's `resolve_data`, or a reused
        plan's: tiered.distributed.reuse, whose `token` is `structure`). `deferrable`: the distributed
        save's, whose later saves may plan on the stager thread (`SavePipeline.save_later`)."""
        if not plan.items:
            return None
        return self.saves.save(self.step, self.items(plan, resolve, structure), rank_only=True, deferrable=deferrable)

    @staticmethod
    def items(plan: SavePlan, resolve: Callable[[int, WriteItem], Any], structure: Any = None) -> tree.Flat:
        """This rank's items as the flat state of tensors the save pipeline stages (objects
        serialized into uint8 tensors, projections made contiguous), already flattened: the
        state {item name: tensor}, without a walk of it per save. `structure`: a reused plan's
        token (`PlanReuse.token`), which stands for its tensor items' dtypes, shapes and devices;
        with the serialized items' sizes it is the flat state's `structure`. With it, `resolve`
        (a reused plan's: tiered.distributed.reuse.Resolve) gives every item's data at once, and the
        per-item work here is a few passes over them (item by item, ~1.6 µs an item: 8.6 ms of a
        distributed call of 5,240 items on the CPU machine)."""
        batch = getattr(resolve, "batch", None) if structure is not None else None
        if batch is not None:
            tensors, serialized = batch()
            sizes = []
            for j in serialized:
                tensors[j], n = _bytes_tensor(tensors[j])
                sizes.append(n)
            for j in [j for j, t in enumerate(tensors) if t.requires_grad]:
                tensors[j] = tensors[j].detach()  # (the others stay the very tensors: see the loop below)
            for j in [j for j, t in enumerate(tensors) if not t.is_contiguous()]:
                tensors[j] = tensors[j].contiguous()
            return _flat_names(plan).flatten(tensors, (structure, tuple(sizes)))
        tensors = []
        sizes = []
        for i, item in enumerate(plan.items):
            data = resolve(i, item)
            if item.type == WriteItemType.BYTE_IO:
                data, n = _bytes_tensor(data)
                sizes.append(n)
            elif not isinstance(data, torch.Tensor):
                raise TypeError(f"{item_name(item.index)}: the planner resolved a {type(data).__name__}, not a tensor")
            else:
                if data.requires_grad:  # (otherwise the very tensor: a guarded save finds optimizer state by identity)
                    data = data.detach()
                if not data.is_contiguous():  # a projection of a larger tensor: store just that
                    data = data.contiguous()
            tensors.append(data)
        return _flat_names(plan).flatten(tensors, None if structure is None else (structure, tuple(sizes)))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write the DCP metadata and commit the step on this node's fast tier;
        then post the manifest for the other nodes."""
        save_id = self.save_id
        try:
            manifest = commit_step(self.saves.tier, self.step, metadata, [r for rank in results for r in rank],
                                   self.world_size)
        except BaseException as exc:
            if isinstance(save_id, str) and multi_rank():
                post_failure(save_id, repr(exc))
            raise
        if isinstance(save_id, str) and multi_rank():
            post_commit(self.saves.tier, save_id, manifest)
        self.saves.notify_committed(self.step)



# --- reading ---------------------------------------------------------------------------------

class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are loaded with
    ``torch.load(weights_only=True)``: loading a checkpoint runs no code from it."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: F401 - DCP's own helper

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class StepReader(StorageReader):
    """A DCP StorageReader of `step` (default: the newest step on any tier) through `restorer` (a
    Restorer). Reads the fastest tier holding the step; a rank's files missing there (another
    node's local disk) are read from the next tier holding them. Each rank reads and decodes only
    the chunks covering what it loads."""

    def __init__(self, restorer: Any, step: int | None = None, *, tier: str | None = None):
        self.restorer = restorer
        self.step = None if step is None else _step_of(step)
        self.tier_name = tier
        self.sources: list[Any] = []
        """The tiers holding the step, fastest first: found by read_metadata unless set before."""
        self._manifest: Manifest | None = None
        self._manifests: dict[str, Manifest] = {}
        self.metadata: Metadata | None = None
        self.node_ranks: set[int] | None = None
        """The ranks on this rank's node, where known: of an item stored on several nodes
        (tiered.distributed.node_plan), the copy of one of them is read. Otherwise the copy whose
        rank's files the fastest tier holds."""
        self._here: dict[int, bool] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.step = _step_of(checkpoint_id)
            self.sources = []  # another step: its tiers are looked up again
        self._manifest = self.metadata = None
        self._manifests = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return StepWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            return self._read_metadata()
        except BaseException as exc:
            # Some DCP versions (2.11) swallow this error and raise "metadata is None": say why here.
            log.error("tiered: cannot load step %s through DCP: %s", self.step, exc)
            raise

    def _read_metadata(self) -> Metadata:
        if not self.sources:
            self.step, self.sources = self.restorer.catalog.restore_order(self.step, self.tier_name)
        errors: list[BaseException] = []
        for tier in self.sources:
            try:
                manifest = read_manifest(tier, self.step)
                if manifest.dcp is None:
                    raise NotSavedThroughDcp(
                        f"{tier.describe(self.step, 'MANIFEST.json')}: step {self.step} was not saved through "
                        "torch.distributed.checkpoint; load it with Engine.restore / Engine.load")
                self.metadata = metadata_from_json(read_pinned(tier, self.step, manifest.dcp),
                                                   tier.describe(self.step, manifest.dcp.name))
                self._manifest = manifest
                return self.metadata
            except NotSavedThroughDcp:
                raise
            except (TieredError, OSError) as exc:
                errors.append(exc)
            log.warning("tiered: step %d: cannot read its DCP metadata on tier %r: %s", self.step, tier.name,
                        errors[-1])
        raise errors[-1]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        fut: Future = Future()
        try:
            self._read(plan, planner)
            fut.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - DCP waits on the future and raises
            fut.set_exception(exc)
        return fut

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        if self._manifest is None or self.metadata is None:
            self.read_metadata()
        storage = self.metadata.storage_data
        by_rank: dict[int, list[tuple[ReadItem, StoredItem]]] = {}
        for item in plan.items:
            loc = storage.get(item.storage_index)
            if loc is None:
                raise FormatError(f"step {self.step}: the metadata has no storage for {item_name(item.storage_index)}")
            if loc.copies and not self._near(loc.rank):
                rank, tensor = next(((r, t) for r, t in loc.copies if self._near(r)), (loc.rank, loc.tensor))
                loc = StoredItem(rank, tensor)
            by_rank.setdefault(loc.rank, []).append((item, loc))
        for rank, items in sorted(by_rank.items()):
            entry = self._manifest.entry(rank)
            if entry is None:
                raise FormatError(f"step {self.step}: items are stored by rank {rank}, which the manifest does not list")
            tier, index = self._rank_index(entry)
            _read_rank(self.restorer, self.step, tier, self.sources[self.sources.index(tier) + 1:], index, items, planner)

    def _near(self, rank: int) -> bool:
        """Whether `rank`'s files are on this node: by `node_ranks`, else by the fastest tier."""
        if self.node_ranks is not None:
            return rank in self.node_ranks
        if rank not in self._here:
            entry = self._manifest.entry(rank) if self._manifest is not None else None
            try:
                self._here[rank] = entry is not None and self.sources[0].file_size(self.step, entry.index_file) is not None
            except (TieredError, OSError):
                self._here[rank] = False
        return self._here[rank]

    def _rank_index(self, entry: RankEntry) -> tuple[Any, RankIndex]:
        """The first tier (fastest first) holding the rank's index, and the index, checked
        against that tier's own manifest (a migration may have recompressed the rank there)."""
        last: BaseException | None = None
        for tier in self.sources:
            try:
                if tier.name not in self._manifests:
                    self._manifests[tier.name] = read_manifest(tier, self.step)
                own = self._manifests[tier.name].entry(entry.rank)
                if own is None:
                    raise FormatError(f"{tier.describe(self.step, 'MANIFEST.json')}: no entry for rank {entry.rank}")
                if tier.file_size(self.step, own.index_file) is None:
                    continue  # another node's rank: not on this node's local tier
                return tier, read_rank_index(tier, self.step, own)
            except (TieredError, OSError) as exc:
                last = exc
                log.warning("tiered: step %d: cannot read rank %d's index on tier %r: %s", self.step, entry.rank,
                            tier.name, exc)
        if last is None:
            raise CheckpointNotFoundError(f"step {self.step}: no tier holds rank {entry.rank}'s files "
                                          f"(tried {', '.join(t.name for t in self.sources)})")
        raise last

class NotSavedThroughDcp(FormatError):
    """The step was saved by one process (Engine.save without torch.distributed)."""


def _strides(shape: Sequence[int]) -> list[int]:
    out, n = [1] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        out[i], n = n, n * shape[i]
    return out


def box_chunks(shape: Sequence[int], itemsize: int, offsets: Sequence[int], lengths: Sequence[int],
               chunk_size: int, mark: np.ndarray) -> None:
    """Mark (in `mark`, one bool per chunk) the chunks of a C-order tensor of `shape` that hold
    any byte of the box `offsets` + `lengths`."""
    if any(n == 0 for n in lengths):
        return
    d, strides = len(shape), _strides(shape)
    k = d - 1  # the box is runs of dims k.. (dims after k taken whole), one per index of dims ..k
    while k > 0 and lengths[k] == shape[k]:
        k -= 1
    k = max(k, 0)
    run = (lengths[k] * strides[k]) if d else 1
    starts = np.array([(offsets[k] * strides[k]) if d else 0], dtype=np.int64)
    for i in range(k):
        starts = (starts[None, :] + ((offsets[i] + np.arange(lengths[i], dtype=np.int64)) * strides[i])[:, None]).ravel()
    first = starts * itemsize // chunk_size
    last = ((starts + run) * itemsize - 1) // chunk_size
    diff = np.zeros(len(mark) + 1, dtype=np.int64)
    np.add.at(diff, first, 1)
    np.add.at(diff, last + 1, -1)
    mark |= np.cumsum(diff[:-1]) > 0


def _groups(ids: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of consecutive chunk ids."""
    out: list[tuple[int, int]] = []
    for j in ids.tolist():
        if out and out[-1][1] == j:
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


class _SubRepair:
    """A ChunkRepair for chunk groups cut out of records."""

    def __init__(self, repair: Any, parts: dict[int, tuple[TensorRecord, int]]):
        self.repair, self.parts = repair, parts

    def __bool__(self) -> bool:
        return bool(self.repair)

    def __call__(self, rec: TensorRecord, j: int, why: str) -> Any:
        orig, a = self.parts[id(rec)]
        return self.repair(orig, a + j, why)


SPAN_BYTES = STAGED_BYTES
"""At most this many bytes decoded at a time into buffers of their own, for the items that cannot be
decoded in place (parts of a stored tensor, another dtype or layout): the restore's bound. A rank's
whole state, on a GPU that training has nearly filled, must not be decoded into a second copy of
itself (a 24 GB state per rank ran out of memory so)."""


def _read_rank(restorer: Any, step: int, tier: Any, slower: list[Any], index: RankIndex,
               items: list[tuple[ReadItem, StoredItem]], planner: LoadPlanner) -> None:
    """Decode the chunks of `index`'s tensors that `items` need, then copy each item's box out.
    An item that is a whole stored tensor, whose destination is contiguous and of its dtype, is
    decoded straight into the destination; the others through buffers of at most `SPAN_BYTES` at
    a time. A chunk failing its checksum is read from the `slower` tiers instead."""
    by_tensor: dict[int, list[ReadItem]] = {}
    for item, loc in items:
        if not 0 <= loc.tensor < len(index.tensors):
            raise FormatError(f"{tier.describe(step, index.data_file)}: no tensor {loc.tensor} for "
                              f"{item_name(item.storage_index)}")
        by_tensor.setdefault(loc.tensor, []).append(item)
    repair = ChunkRepair(step, index.rank, tier.name, slower, restorer.config.zstd, index.chunk_size)
    try:
        batch: list[_Wanted] = []
        staged = 0
        for t, its in by_tensor.items():
            want = _Wanted(index.tensors[t], its, planner, index.chunk_size)
            if batch and staged + want.staged > SPAN_BYTES:
                _decode_batch(restorer, step, tier, index, batch, repair, planner)
                batch, staged = [], 0
            batch.append(want)
            staged += want.staged
        if batch:
            _decode_batch(restorer, step, tier, index, batch, repair, planner)
    finally:
        repair.close()


class _Wanted:
    """What one stored tensor's items need: the run of its chunks [first, end) that holds them, and
    where that run is decoded (`direct`: the one item's own destination)."""

    def __init__(self, rec: TensorRecord, items: list[ReadItem], planner: LoadPlanner, chunk_size: int):
        self.rec, self.items = rec, items
        self.dests = [None if it.type == LoadItemType.BYTE_IO else planner.resolve_tensor(it).detach() for it in items]
        dst = self.dests[0]
        whole = (len(items) == 1 and dst is not None and not any(items[0].storage_offsets)
                 and list(items[0].lengths) == list(rec.shape))
        self.groups: list[tuple[int, int]]
        """The runs [a, b) of consecutive chunks to decode."""
        if whole:  # (the common case, a tensor loaded as it was saved: every chunk, no box to find)
            n = len(rec.chunks)
            self.ids, self.first, self.nbytes = np.arange(n), 0, rec.nbytes if n else 0
            self.groups = [(0, n)] if n else []
        else:
            mark = np.zeros(len(rec.chunks), dtype=bool)
            for item in items:
                if item.type == LoadItemType.BYTE_IO:
                    mark[:] = True
                else:
                    box_chunks(rec.shape, rec.torch_dtype.itemsize, item.storage_offsets, item.lengths, chunk_size,
                               mark)
            self.ids = np.flatnonzero(mark)
            self.first = int(self.ids[0]) if len(self.ids) else 0
            self.nbytes = sum(c.raw_size for c in rec.chunks[self.first:int(self.ids[-1]) + 1]) if len(self.ids) else 0
            self.groups = _groups(self.ids)
        self.direct = (whole and dst.dtype == rec.torch_dtype and tuple(dst.shape) == tuple(rec.shape)
                       and dst.is_contiguous() and dst.numel() * dst.element_size() == self.nbytes)
        self.staged = 0 if self.direct else self.nbytes
        """Bytes of a buffer of its own that decoding it takes."""

    def span(self) -> torch.Tensor:
        """Where the chunk run is decoded: the destination itself, or a new buffer on its device."""
        if self.direct:
            return self.dests[0].reshape(-1).view(torch.uint8)
        device = next((d.device for d in self.dests if d is not None), torch.device("cpu"))
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)


def _decode_batch(restorer: Any, step: int, tier: Any, index: RankIndex, batch: list[_Wanted], repair: ChunkRepair,
                  planner: LoadPlanner) -> None:
    """Decode the chunk runs of `batch` (one decode call), then copy each item out and commit it."""
    cs = index.chunk_size
    records: list[TensorRecord] = []
    dests: dict[int, torch.Tensor] = {}
    parts: dict[int, tuple[TensorRecord, int]] = {}
    spans: list[torch.Tensor] = []
    for want in batch:
        rec = want.rec
        span = want.span() if len(want.ids) else torch.empty(0, dtype=torch.uint8)
        spans.append(span)
        for a, b in want.groups:
            chunks = rec.chunks if a == 0 and b == len(rec.chunks) else rec.chunks[a:b]
            sub = TensorRecord(index=len(records), name=rec.name, dtype="uint8",
                               shape=(rec.nbytes if chunks is rec.chunks else sum(c.raw_size for c in chunks),),
                               device=rec.device, is_numpy=False, codec=rec.codec, chunks=chunks)
            records.append(sub)
            parts[id(sub)] = (rec, a)
            start = (a - want.first) * cs
            dests[sub.index] = span[start:start + sub.shape[0]]
    if records:
        sub_index = RankIndex(rank=index.rank, data_file=index.data_file, data_bytes=index.data_bytes, chunk_size=cs,
                              skeleton=None, tensors=tuple(records), io=index.io)
        restorer.decode(step, sub_index, dests, tier, _SubRepair(repair, parts) if repair else None)
    for want, span in zip(batch, spans):
        rec = want.rec
        for item, dst in zip(want.items, want.dests):
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(span.cpu().numpy().tobytes()))
                continue
            if not want.direct and dst.numel():
                strides = _strides(rec.shape)
                offset = sum(o * s for o, s in zip(item.storage_offsets, strides))
                offset -= want.first * cs // rec.torch_dtype.itemsize  # the span starts at chunk `first`
                dst.copy_(torch.as_strided(span.view(rec.torch_dtype), tuple(item.lengths), tuple(strides), offset))
            planner.commit_tensor(item, dst)

