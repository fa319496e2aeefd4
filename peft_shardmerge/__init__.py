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
from .inprocess import (  # noqa: E402
    merge_and_save,
    merge_and_unload,
    patch_peft,
    push_to_hub_merged,
    save_pretrained_merged,
)
from .plan import Plan, parse_dtype, parse_size  # noqa: E402
from .report import MergeReport  # noqa: E402

__all__ = [
    "merge_and_save",
    "merge_and_unload",
    "save_pretrained_merged",
    "push_to_hub_merged",
    "patch_peft",
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
