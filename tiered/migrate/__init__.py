"""Moving committed steps down the tiers, recompressing where a tier takes another codec.

- `migrator`: `BackgroundMigrator` and `migrate_step`: what to copy, when, and retention after it.
- `copy_rank`: one rank's data file copied down a tier, chunk by chunk, kept or recompressed.
- `process`: ``migration: process`` (the default): the migrator in a child process of its own.
"""
