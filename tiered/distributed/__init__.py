"""torch.distributed: DCP's StorageWriter/Reader on tiered's format, and `Engine.save` across ranks.

- `saver`: `Engine.save` / `Engine.restore` under a process group: one call on every rank, via DCP.
- `storage`: DCP's `StorageWriter` and `StorageReader` over tiered's save and restore pipelines.
- `commit`: what a distributed save stores beside the ranks' files, and how it is committed.
- `reuse`: warm saves of a state of the same structure reuse the last DCP plan.

The public DCP names live in `tiered.dcp`.
"""
