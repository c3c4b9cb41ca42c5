"""`python -m fsdp2_strategy.cli ...`: the same as the `fsdp2-strategy` command."""

import sys

from .main import main

sys.exit(main())
