"""The CUDA side: layout, waves, the pack-and-checksum kernel, KvikIO writes, GPU decode and recode.

Nothing here is imported by `import tiered`: the save and restore pipelines import these modules on
first GPU use, and cupy, nvCOMP and KvikIO are imported inside them, so a machine without CUDA never
loads them.

- `device`: `GpuDevice`, one per GPU: pack, batched compression into a reused slab, the writer's steps.
- `layout`, `waves`, `pack`, `write`: how a save's rows are laid out, encoded in waves, checksummed
  and written.
- `decode`: reading chunks into GPU memory, verifying and decoding them (restore).
- `recode`: the GPU side of migration and codec measurement.
- `runtime`: what one engine computes with (codec threads, host pool, a `GpuDevice` per GPU).
"""
