"""--base-precision nf4: merging into the 4-bit weights transformers + bitsandbytes give a QLoRA run."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

bnb = pytest.importorskip("bitsandbytes")

from peft_shardmerge import merge_checkpoint


def _quantized_reference(base: str, adapter: str, quant_type: str, double_quant: bool) -> dict[str, torch.Tensor]:
    """Load base in 4-bit with transformers, attach the adapter with PEFT, and return per weight
    dequant(W4) (+ PEFT's get_delta_weight where LoRA applies), in fp32, before any forward pass."""
    import bitsandbytes.functional as F
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, device_map="cpu")
    peft_model = PeftModel.from_pretrained(model, adapter)
    out = {}
    for name, module in peft_model.base_model.model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w = module.weight
            assert not getattr(w.quant_state, "packing_format_for_cpu", False)
            out[f"{name.replace('.base_layer', '')}.weight"] = F.dequantize_4bit(w.data, w.quant_state).float()
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            with torch.no_grad():
                out[f"{name}.weight"] = out[f"{name}.weight"] + module.get_delta_weight("default").float()
    return out


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("base_name", ["llama_bf16", "gpt2"])
def test_nf4_base_equals_bitsandbytes_dequantized(
    base_name, quant_type, double_quant, make_base, make_adapter, tmp_path
):
    base = make_base(base_name)
    kwargs = dict(fan_in_fan_out=True) if base_name == "gpt2" else {}
    adapter = make_adapter(base_name, "default", **kwargs)
    out = str(tmp_path / "m")
    report = merge_checkpoint(
        base,
        adapter,
        out,
        dtype="float32",
        base_precision="nf4",
        nf4_quant_type=quant_type,
        nf4_double_quant=double_quant,
        progress=False,
    )
    assert report.base_precision == "nf4"
    assert any("4-bit base" in n for n in report.notes)
    ref = _quantized_reference(base, adapter, quant_type, double_quant)
    assert ref
    got = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(out, f), framework="pt") as h:
                got.update({k: h.get_tensor(k) for k in h.keys()})
    for name, want in ref.items():
        have = got[name]
        if base_name == "gpt2":  # Conv1D stores [in, out]; bitsandbytes holds [out, in]
            have = have.T
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # bitsandbytes leaves embeddings and the output head alone, and so does the nf4 base
    assert not any("embed" in k or "wte" in k or "lm_head" in k for k in ref)


def test_conv1d_weights_the_adapter_leaves_alone_are_quantized_as_bitsandbytes_holds_them(
    make_base, make_adapter, tmp_path
):
    """A QLoRA adapter on GPT-2's c_attn only (PEFT's default there): the Conv1D weights it does not target
    (c_proj, c_fc) are 4-bit in training too, quantized as bitsandbytes holds them, [out, in]."""
    base = make_base("gpt2")
    adapter = make_adapter("gpt2", "c_attn", fan_in_fan_out=True, target_modules=["c_attn"])
    out = str(tmp_path / "m")
    merge_checkpoint(base, adapter, out, dtype="float32", base_precision="nf4", progress=False)
    ref = _quantized_reference(base, adapter, "nf4", True)
    untargeted = [n for n in ref if "c_attn" not in n]
    assert untargeted and any("c_proj" in n for n in untargeted)
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as h:
        for name, want in ref.items():
            torch.testing.assert_close(h.get_tensor(name).T, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_original_and_nf4_differ_by_quantization_error(make_base, make_adapter, tmp_path):
    base = make_base("llama_bf16")
    adapter = make_adapter("llama_bf16", "default")
    a, b = str(tmp_path / "orig"), str(tmp_path / "nf4")
    merge_checkpoint(base, adapter, a, dtype="float32", progress=False)
    merge_checkpoint(base, adapter, b, dtype="float32", base_precision="nf4", progress=False)
    name = "model.layers.0.mlp.up_proj.weight"
    with (
        safe_open(os.path.join(a, "model.safetensors"), framework="pt") as ha,
        safe_open(os.path.join(b, "model.safetensors"), framework="pt") as hb,
    ):
        wa, wb = ha.get_tensor(name), hb.get_tensor(name)
        ea, eb = ha.get_tensor("model.embed_tokens.weight"), hb.get_tensor("model.embed_tokens.weight")
    rel = float((wa - wb).norm() / wa.norm())
    assert 0.01 < rel < 0.2, rel  # 4-bit quantization error, nothing more
    assert torch.equal(ea, eb)


def test_dora_merged_into_the_nf4_base_matches_the_4bit_adapter_model(make_base, make_adapter, tmp_path):
    """DoRA's norms are taken on the base chosen: with --base-precision nf4, on dequant(NF4(W)) + dW, as the
    4-bit adapter model (loaded in the checkpoint's bf16) computes them; checked against the in-process merge
    of that model, whose DoRA merge is checked against its logits elsewhere."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from peft_shardmerge.api.inprocess import merge_and_save

    base = make_base("llama_bf16")
    adapter = make_adapter("llama_bf16", "dora", use_dora=True, target_modules=["q_proj", "v_proj", "up_proj"])
    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, device_map="cpu")
    peft_model = PeftModel.from_pretrained(model, adapter)
    merge_and_save(
        peft_model,
        str(tmp_path / "live"),
        base_precision="dequantized",
        dtype="float32",
        max_shard_size="1GB",
        progress=False,
    )
    merge_checkpoint(
        base,
        adapter,
        str(tmp_path / "disk"),
        dtype="float32",
        base_precision="nf4",
        max_shard_size="1GB",
        progress=False,
    )
    live = load_file(str(tmp_path / "live" / "model.safetensors"))
    disk = load_file(str(tmp_path / "disk" / "model.safetensors"))
    assert live.keys() == disk.keys()
    for name in live:
        torch.testing.assert_close(disk[name], live[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_quantizing_the_original_weights_again_gives_the_bytes_the_model_was_loaded_with(make_base):
    """What the repacking note tells a user: bitsandbytes' quantize_4bit of the checkpoint's own 16-bit weight gives
    the very packed bytes and scales transformers loaded, so the exact 4-bit base can be rebuilt from the original."""
    import bitsandbytes.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = make_base("llama_bf16")
    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, device_map="cpu")
    stored = {}
    for f in os.listdir(base):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(base, f)))
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            packed, state = F.quantize_4bit(
                stored[f"{name}.weight"],
                blocksize=64,
                compress_statistics=True,
                quant_type="nf4",
                quant_storage=module.weight.dtype,
            )
            loaded = module.weight.quant_state
            assert torch.equal(packed, module.weight.data), name
            assert torch.equal(state.absmax, loaded.absmax) and torch.equal(state.state2.absmax, loaded.state2.absmax)
            checked += 1
    assert checked == 14
