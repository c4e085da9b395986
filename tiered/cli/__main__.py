"""`python -m tiered.cli ...`: the same as the `tiered` command."""

import sys

from tiered.cli import main

sys.exit(main())
