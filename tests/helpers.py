"""Small helpers shared by the test modules: comparing a merged checkpoint's logits with a reference."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|."""
    return float((got - ref).abs().max() / ref.abs().max())


def logits_of(folder: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a merged checkpoint reloaded in fp32, which must load with no missing or unexpected keys."""
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits
