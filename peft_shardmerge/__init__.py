"""peft-shardmerge: merge LoRA adapters into clean 16-bit checkpoints, one row block at a time."""

__version__ = "0.1.0"

from .api import check_out_dir, merge_checkpoint, plan_checkpoint_merge  # noqa: E402
from .errors import (  # noqa: E402
    CorruptFileError,
    InputError,
    MergeCheckError,
    MissingDependencyError,
    NotFoundError,
    ShardMergeError,
    UnsupportedError,
)
from .plan import Plan, parse_dtype, parse_size  # noqa: E402
from .report import MergeReport  # noqa: E402

__all__ = [
    "merge_checkpoint",
    "plan_checkpoint_merge",
    "check_out_dir",
    "MergeReport",
    "Plan",
    "parse_size",
    "parse_dtype",
    "ShardMergeError",
    "InputError",
    "NotFoundError",
    "UnsupportedError",
    "CorruptFileError",
    "MissingDependencyError",
    "MergeCheckError",
]
