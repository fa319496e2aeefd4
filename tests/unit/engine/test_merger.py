"""The one per-tensor merge: both paths give the same bytes and the same rounding counts (the out-of-memory retry
of each path is tested in tests/unit/engine/test_execute.py and tests/integration/test_inprocess.py)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.api.inprocess import merge_and_save

#: the DoRA adapters of tests/unit/engine/test_engine.py (same bases, tags and settings: built once per session)
DORA_LAYOUTS = {
    "embedding": ("llama", "dora-embedding", ["q_proj", "embed_tokens"], {}),
    "conv1d": ("gpt2", "dora-conv1d", ["c_attn", "c_fc"], {"fan_in_fan_out": True}),
    "linear": ("llama_sharded", "dora", ["q_proj", "v_proj", "up_proj"], {}),
}


def read_all(folder) -> dict[str, torch.Tensor]:
    import glob
    import os

    out = {}
    for f in sorted(glob.glob(os.path.join(str(folder), "*.safetensors"))):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def live_model(base: str, adapter: str):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)


@pytest.mark.parametrize("layout", list(DORA_LAYOUTS))
def test_dora_rounding_count_is_the_same_on_both_paths(layout, make_base, make_adapter, tmp_path):
    """DoRA on Conv1D / embeddings rescales columns, on linear layers rows: the 'update lost to rounding' count is
    taken on the values written (after the rescale) on both paths, so both report the same fractions, tensor by
    tensor."""
    name, tag, targets, extra = DORA_LAYOUTS[layout]
    base = make_base(name)
    adapter = make_adapter(name, tag, use_dora=True, target_modules=targets, **extra)
    disk = merge_checkpoint(base, adapter, str(tmp_path / "disk"), dtype="bfloat16", progress=False)
    live = merge_and_save(
        live_model(base, adapter),
        str(tmp_path / "live"),
        dtype="bfloat16",
        base_precision="dequantized",
        progress=False,
    )
    assert disk.swallowed and any(v > 0 for v in disk.swallowed.values())
    assert live.swallowed == disk.swallowed
    got_disk, got_live = read_all(tmp_path / "disk"), read_all(tmp_path / "live")
    for name in disk.swallowed:
        assert torch.equal(got_disk[name], got_live[name]), name


@pytest.mark.parametrize("layout", ["embedding", "conv1d"])
def test_dora_by_column_in_float32_is_peft_merge_bit_for_bit_on_both_paths(layout, make_base, make_adapter, tmp_path):
    """DoRA's column norms of a tensor that fits one row block are PEFT's own float32 norms: both paths write
    exactly PEFT's merge on an fp32 base (the block-wise float64 sum serves tensors larger than a block)."""
    name, tag, targets, extra = DORA_LAYOUTS[layout]
    base = make_base(name)
    adapter = make_adapter(name, tag, use_dora=True, target_modules=targets, **extra)
    merge_checkpoint(base, adapter, str(tmp_path / "disk"), dtype="float32", progress=False)
    merge_and_save(
        live_model(base, adapter),
        str(tmp_path / "live"),
        dtype="float32",
        base_precision="dequantized",
        progress=False,
    )
    reference = live_model(base, adapter).merge_and_unload().state_dict()
    for folder in ("disk", "live"):
        got = read_all(tmp_path / folder)
        changed = [k for k in got if any(t in k for t in ("c_attn", "c_fc", "embed_tokens"))]
        assert changed
        for k in changed:
            assert torch.equal(got[k], reference[k]), (folder, k)


def test_lora_bf16_is_byte_identical_on_both_paths(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    disk = merge_checkpoint(base, adapter, str(tmp_path / "disk"), dtype="bfloat16", progress=False)
    live = merge_and_save(
        live_model(base, adapter),
        str(tmp_path / "live"),
        dtype="bfloat16",
        base_precision="dequantized",
        progress=False,
    )
    got_disk, got_live = read_all(tmp_path / "disk"), read_all(tmp_path / "live")
    assert sorted(got_disk) == sorted(got_live)
    for name, t in got_disk.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, got_live[name]), name
    assert live.swallowed == disk.swallowed and disk.swallowed
    assert live.self_check_max_rel_err == disk.self_check_max_rel_err
