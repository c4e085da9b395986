"""The on-disk format: manifest, per-rank index, chunk table, checksums and the state's skeleton.

The bottom layer: it imports nothing of tiered's but errors and units, and everything above reads and
writes checkpoints through it. See docs/format.md.

- `tiered.format.manifest`: names, records and their explicit (de)serialisation (`Manifest`,
  `RankIndex`, `TensorRecord`, `read_step`, ...).
- `tiered.format.chunks`: a tensor's chunk records and the byte ranges they cover.
- `tiered.format.checksum`: wsum64, the per-chunk checksum, identical on the CPU and the GPU.
- `tiered.format.tree`: a state_dict flattened into tensor leaves and a JSON skeleton, and back.
"""
