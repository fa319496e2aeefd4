"""Entry point for ``python -m peft_shardmerge``."""

import sys

from .cli import main

sys.exit(main())
