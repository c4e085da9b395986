"""The save pipeline: plan -> stage -> write extents -> fsync -> index -> commit.

- `pipeline`: `SavePipeline`, what `Engine.save` runs: the call, the stager, the writer thread.
- `write`: the writer's half: one save in flight (`Job`), written rank file by rank file.
- `handle`: `SaveHandle`, the two moments of one save (staged, persisted).
- `placement`: which tier a step begins on (the fast tier, or the next one on error).
- `fast_codec`: the fast tier's codec when the config says ``auto``, measured on the state.
"""
