"""Entry point for ``python -m peft_shardmerge``."""

from .api.entry import run

run()
