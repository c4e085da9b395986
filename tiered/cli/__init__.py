"""Command line: `tiered ls | verify | gc | migrate | restore | stats | report | cost`, `tiered-restore`."""

from tiered.cli.commands import main, restore_main

__all__ = ["main", "restore_main"]
