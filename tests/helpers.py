"""Small helpers shared by the test modules: a checkpoint folder's tensors, and comparing a merged checkpoint's logits
with a reference."""

from __future__ import annotations

import os
from importlib.metadata import version

import pytest
import torch
from safetensors import safe_open
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


def folder_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor the ``.safetensors`` files of a checkpoint folder hold, by name."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def add_adapter_refusal() -> str | None:
    """Why transformers' own ``add_adapter`` refuses the installed PEFT (its own version check), or None."""
    from transformers.integrations.peft import MIN_PEFT_VERSION
    from transformers.utils import check_peft_version

    try:
        check_peft_version(min_version=MIN_PEFT_VERSION)
    except ValueError as e:
        return (f"transformers {version('transformers')} refuses PEFT {version('peft')} in its own add_adapter "
                f"integration (it asks for PEFT >= {MIN_PEFT_VERSION}): {e}")
    return None


def add_adapter_or_skip(model, *args, **kwargs) -> None:
    """``model.add_adapter(*args, **kwargs)``, transformers' own; the test skips where transformers refuses PEFT."""
    reason = add_adapter_refusal()
    if reason is not None:
        pytest.skip(reason)
    model.add_adapter(*args, **kwargs)
