"""peft-shardmerge: merge LoRA adapters into clean 16-bit checkpoints, one row block at a time."""

from __future__ import annotations

import importlib

from .errors import (  # light: no torch, so that `peft-shardmerge --help` starts at once
    CorruptFileError,
    FileSystemError,
    HubUploadError,
    InputError,
    MergeCheckError,
    MissingDependencyError,
    NotFoundError,
    OutputChangedError,
    OutputLockedError,
    PeerFailedError,
    PeerLostError,
    ShardMergeError,
    UnsupportedError,
)
from .version import __version__  # noqa: F401 - re-exported: peft_shardmerge.__version__

#: public names imported on first use (PEP 562), each from the module that owns it: importing torch,
#: transformers and peft takes seconds, which the command line's --help and error paths should not pay
_LAZY = {
    "merge_and_save": "api.inprocess",
    "merge_and_unload": "api.dropins",
    "save_pretrained_merged": "api.dropins",
    "push_to_hub_merged": "api.dropins",
    "patch_peft": "api.dropins",
    "save_pretrained_gguf": "api.gguf",
    "push_to_hub_gguf": "api.gguf",
    "merge_checkpoint": "api.disk",
    "plan_checkpoint_merge": "api.disk",
    "plan_model_merge": "api.model_plan",
    "check_out_dir": "output.out_dir",
    "MergeReport": "engine.report",
    "MergeOptions": "options",
    "Plan": "engine.plan",
    "parse_size": "options",
    "parse_dtype": "options",
}

__all__ = [
    "merge_and_save",
    "merge_and_unload",
    "save_pretrained_merged",
    "push_to_hub_merged",
    "patch_peft",
    "save_pretrained_gguf",
    "push_to_hub_gguf",
    "merge_checkpoint",
    "plan_checkpoint_merge",
    "plan_model_merge",
    "check_out_dir",
    "MergeReport",
    "MergeOptions",
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
    "OutputLockedError",
    "OutputChangedError",
    "FileSystemError",
    "HubUploadError",
    "PeerFailedError",
    "PeerLostError",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
