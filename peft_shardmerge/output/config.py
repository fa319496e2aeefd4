"""The merged checkpoint's ``config.json``: the base's, without its quantization, with the dtype written and the ties
as merged."""

from __future__ import annotations

import copy
import os

import torch

from .side_files import candidate_folders


def output_config(config: dict, dtype: torch.dtype, *, untie: bool) -> dict:
    """The ``config.json`` of the merged checkpoint.

    Removes ``quantization_config`` (also inside ``text_config``/``vision_config``), records the dtype
    written, and turns weight tying off when tied weights were written separately.

    Args:
        config: the base config.
        dtype: the dtype written.
        untie: set ``tie_word_embeddings`` to False.

    Returns:
        A new dict.

    Example:
        >>> output_config({"quantization_config": {}, "dtype": "float32"}, torch.bfloat16, untie=False)
        {'dtype': 'bfloat16'}
    """
    out = copy.deepcopy(config)
    name = str(dtype).removeprefix("torch.")
    for sub in (out, out.get("text_config"), out.get("vision_config")):
        if isinstance(sub, dict):
            sub.pop("quantization_config", None)
            if sub is out or "dtype" in sub or "torch_dtype" in sub:
                sub["dtype"] = name
            sub.pop("torch_dtype", None)
            if untie and sub is out:
                sub["tie_word_embeddings"] = False
            elif untie and "tie_word_embeddings" in sub:
                sub["tie_word_embeddings"] = False
    return out


#: config values the model in memory may have changed in a way the merged weights follow (a resized vocabulary)
_SHAPE_KEYS = ("vocab_size",)


#: values transformers adds to a config in memory that a checkpoint's config.json does not need
_MEMORY_ONLY_KEYS = ("_name_or_path", "transformers_version", "use_cache", "_attn_implementation_autoset")


def base_config(inner: torch.nn.Module) -> dict:
    """The config to write beside merged weights from a model in memory: the checkpoint's own ``config.json``
    with only the values that shape the weights taken from memory (a resized ``vocab_size``), as the disk path
    writes it; without a checkpoint, the model's config without its local path and training-time settings.

    Args:
        inner: the transformers model.

    Returns:
        A config dict (``output_config`` then sets the dtype and drops ``quantization_config``).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = base_config(LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=64,
        ...     intermediate_size=64, num_attention_heads=2, vocab_size=32)))
        >>> "_name_or_path" in cfg, cfg["vocab_size"]
        (False, 32)
    """
    import json

    memory = inner.config.to_dict()
    for folder in candidate_folders(memory.get("_name_or_path") or "")[:1]:
        try:
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                disk = json.load(f)
        except (OSError, ValueError):
            break
        if not isinstance(disk, dict) or disk.get("model_type") != memory.get("model_type"):
            break
        for sub in ("", "text_config"):
            have, want = (disk, memory) if not sub else (disk.get(sub), memory.get(sub))
            if isinstance(have, dict) and isinstance(want, dict):
                have.update({k: want[k] for k in _SHAPE_KEYS if k in have and k in want})
        return disk
    out = inner.config.to_diff_dict()
    for key in _MEMORY_ONLY_KEYS:
        out.pop(key, None)
    return out
