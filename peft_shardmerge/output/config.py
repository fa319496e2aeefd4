"""The merged checkpoint's ``config.json``: the base's, without its quantization, with the dtype written and the ties
as merged."""

from __future__ import annotations

import copy

import torch


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
