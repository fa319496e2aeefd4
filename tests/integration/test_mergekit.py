"""Our merge against MergeKit's: a ``BASE+ADAPTER`` model reference merged by MergeKit (passthrough) is the same
checkpoint, byte for byte, as ours."""

from __future__ import annotations

import glob
import os

import pytest
import torch

mergekit = pytest.importorskip("mergekit")

from mergekit.config import MergeConfiguration  # noqa: E402
from mergekit.merge import run_merge  # noqa: E402
from mergekit.options import MergeOptions  # noqa: E402
from safetensors import safe_open  # noqa: E402

from peft_shardmerge import merge_checkpoint  # noqa: E402
from peft_shardmerge.testing import build_adapter, build_base  # noqa: E402


def tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by name."""
    out = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def mergekit_passthrough(base: str, adapter: str, out: str, cache: str, dtype: str) -> str:
    """MergeKit's merge of ``base+adapter`` (it merges the adapter with PEFT into its cache, then copies)."""
    config = {"merge_method": "passthrough", "dtype": dtype, "models": [{"model": f"{base}+{adapter}"}]}
    options = MergeOptions(lora_merge_cache=cache, copy_tokenizer=False, write_model_card=False, quiet=True)
    run_merge(MergeConfiguration.model_validate(config), out, options)
    return out


@pytest.mark.parametrize(
    "arch,dtype,lora",
    [
        ("llama", torch.bfloat16, dict(r=8, lora_alpha=16)),
        ("qwen2", torch.bfloat16, dict(r=4, lora_alpha=8, use_rslora=True)),  # tied embeddings
        ("gpt2", torch.float16, dict(r=8, lora_alpha=32, fan_in_fan_out=True)),  # Conv1D, stored [in, out]
    ],
)
def test_same_bytes_as_mergekit_passthrough(tmp_path, arch, dtype, lora):
    base = build_base(str(tmp_path / "base"), arch, dtype=dtype)
    adapter = build_adapter(base, str(tmp_path / "adapter"), **lora)
    theirs = mergekit_passthrough(
        base, adapter, str(tmp_path / "mergekit"), str(tmp_path / "cache"), str(dtype).removeprefix("torch.")
    )
    ours = merge_checkpoint(base, adapter, str(tmp_path / "ours"), progress=False)
    a, b = tensors(theirs), tensors(ours.out_dir)
    assert sorted(a) == sorted(b)
    differing = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert differing == []
    base_tensors = tensors(base)
    changed = [k for k in a if not torch.equal(a[k], base_tensors[k])]
    assert len(changed) >= 4  # the adapter changed the projections: the comparison is not of two copies of the base
