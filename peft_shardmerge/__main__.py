"""Entry point for ``python -m peft_shardmerge``."""

import sys

try:
    from .api.cli import run
except KeyboardInterrupt:  # Ctrl-C while the command itself is still loading: nothing has started
    print("peft-shardmerge: interrupted; nothing was written and OUT is unchanged", file=sys.stderr)
    sys.exit(130)

run()
