"""Staging a save: the plan (flatten, group by dtype, chunk), bounded host memory, and the CPU side.

- `plan`: state_dict -> `SavePlan` (each tensor's codec, chunks and runs), cached across saves.
- `budgets`: memory budgets from the config or sized from what is free.
- `pools`: bounded, reused staging memory (row rings, the pinned host pool).
- `cpu`: snapshot copies and the multi-threaded CPU chunk codecs, for save and restore.
- `host_copy`: the copy-engine path for tensors stored as they are.
- `overlap`, `stage_after`: which tensors an optimizer guards, and when the stager starts reading.

The GPU side (`tiered.gpu`) builds on these; the save pipeline (`tiered.save`) drives both.
"""
