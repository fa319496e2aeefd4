"""FP8 and LLM.int8 bases merged from disk: the stored bytes dequantized by the format's definition in float32, PEFT's
float32 delta added, one cast to the output dtype; and how far that is from transformers' dequantize() + PEFT."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from helpers import folder_tensors
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, FineGrainedFP8Config

from peft_shardmerge import merge_and_save, merge_checkpoint
from peft_shardmerge.testing import build_base, tiny_config

#: q/o [256, 256] and v [64, 256] fill their 128 x 128 blocks (or sit inside one); down [256, 200] ends mid-block
SHAPES = {
    "hidden_size": 256,
    "intermediate_size": 200,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
BLOCK = 128


def dyadic_adapter(base: str, folder: str, targets: list[str]) -> dict[str, torch.Tensor]:
    """A LoRA adapter made by PEFT on the base in float32, every factor a multiple of 1/256 up to 8/256 and scaling 2,
    so that PEFT's float32 delta is exact whatever the order of its sums; returns PEFT's delta of each weight."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randint(-8, 9, p.shape, generator=gen).float() / 256)
    peft_model.save_pretrained(folder)
    return {
        f"{name.removeprefix('base_model.model.')}.weight": m.get_delta_weight("default").detach().float()
        for name, m in peft_model.named_modules()
        if hasattr(m, "lora_A") and "default" in m.lora_A
    }


def one_rounding(exact_base: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor], dtype) -> dict:
    """The reference: each float32 base weight plus PEFT's float32 delta, cast once."""
    return {k: (w + deltas[k]).to(dtype) if k in deltas else w.to(dtype) for k, w in exact_base.items()}


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at each ``|x|`` (8 significant bits)."""
    _, exponent = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def within_one_step(got: torch.Tensor, other: torch.Tensor, base: torch.Tensor) -> bool:
    """Every element of ``got`` and ``other`` (bf16) apart by at most one bfloat16 step at the larger of the base
    weight and the results: where the base weight is rounded to bf16 before the delta is added, that rounding (at
    most half a step of the base) moves the sum, which is then rounded again."""
    larger = torch.maximum(base.float().abs(), torch.maximum(got.float().abs(), other.float().abs()))
    return bool(((got.float() - other.float()).abs() <= bf16_step(larger)).all())


def int8_definition(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """LLM.int8 by its definition: W = CB * SCB[row] / 127 (the product is exact in float64), rounded to float32."""
    codes, scb = stored[name], stored[name.removesuffix("weight") + "SCB"]
    return (codes.double() * scb.double()[:, None] / 127).float()


def test_int8_base_is_dequantized_in_float32_and_cast_once(tmp_path):
    pytest.importorskip("bitsandbytes")
    base = build_base(str(tmp_path / "base"), dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu"
    )
    model.save_pretrained(str(tmp_path / "int8"))
    deltas = dyadic_adapter(base, str(tmp_path / "adapter"), TARGETS)
    stored = load_file(str(tmp_path / "int8" / "model.safetensors"))
    exact = {
        k: int8_definition(stored, k) if v.dtype == torch.int8 else v.float()
        for k, v in stored.items()
        if not k.endswith((".SCB", ".weight_format"))
    }
    merge_checkpoint(str(tmp_path / "int8"), str(tmp_path / "adapter"), str(tmp_path / "out"), progress=False)
    ours = folder_tensors(str(tmp_path / "out"))
    want = one_rounding(exact, deltas, torch.bfloat16)
    assert set(ours) == set(want) and len(deltas) == 2 * len(TARGETS)
    for k in want:
        assert ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], want[k]), k
    # in process, the int8 model loaded from that folder: the same dequantization, the same bytes
    live = AutoModelForCausalLM.from_pretrained(str(tmp_path / "int8"), device_map="cpu")
    merge_and_save(
        PeftModel.from_pretrained(live, str(tmp_path / "adapter")),
        str(tmp_path / "live"),
        dtype="bfloat16",
        base_precision="dequantized",
        progress=False,
    )
    in_process = folder_tensors(str(tmp_path / "live"))
    assert all(torch.equal(in_process[k], want[k]) for k in deltas)
    # transformers' dequantize() (cast to bf16) then PEFT's float32 merge: one bf16 step away, in some elements
    deq = AutoModelForCausalLM.from_pretrained(str(tmp_path / "int8"), device_map="cpu").dequantize().float()
    theirs = PeftModel.from_pretrained(deq, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    moved = 0
    for k in deltas:
        other = theirs[k].to(torch.bfloat16)
        assert within_one_step(ours[k], other, exact[k]), k
        moved += int((ours[k] != other).sum())
    assert moved > 0


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn codes and float32 ``weight_scale_inv`` of ``w``, one scale per 128 x 128 block (partial last
    blocks), as DeepSeek's and Qwen's FP8 releases store them."""
    rows, cols = w.shape
    grid = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    q, s = torch.empty(rows, cols, dtype=torch.float8_e4m3fn), torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            piece = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            s[i, j] = piece.abs().max().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (piece / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def fp8_definition(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Fine-grained FP8 by its definition: each code in float32 times its block's ``weight_scale_inv``."""
    rows, cols = codes.shape
    per_element = scale_inv.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return codes.to(torch.float32) * per_element


def test_fp8_base_is_dequantized_in_float32_and_cast_once(tmp_path):
    torch.manual_seed(0)
    config = tiny_config("llama", **SHAPES)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(tmp_path / "base"))  # the float32 model the adapter is made on
    stored = {}
    for name, w in model.state_dict().items():
        if name.endswith("_proj.weight"):
            stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8(w)
        else:
            stored[name] = w.to(torch.bfloat16).contiguous()
    folder = tmp_path / "fp8"
    os.makedirs(folder)
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg.update(
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
        quantization_config={
            "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK],
            "activation_scheme": "dynamic",
            "modules_to_not_convert": ["model.embed_tokens", "lm_head"],
        },
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    deltas = dyadic_adapter(str(tmp_path / "base"), str(tmp_path / "adapter"), TARGETS)
    exact = {
        k: fp8_definition(v, stored[k.removesuffix("weight") + "weight_scale_inv"])
        if v.dtype == torch.float8_e4m3fn
        else v.float()
        for k, v in stored.items()
        if not k.endswith("weight_scale_inv")
    }
    merge_checkpoint(str(folder), str(tmp_path / "adapter"), str(tmp_path / "out"), progress=False)
    ours = folder_tensors(str(tmp_path / "out"))
    want = one_rounding(exact, deltas, torch.bfloat16)
    assert set(ours) == set(want) and len(deltas) == 2 * len(TARGETS)
    for k in want:
        assert ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], want[k]), k
    # transformers' dequantized loading (bf16) then PEFT's float32 merge: one bf16 step away, in some elements
    deq = AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=(BLOCK, BLOCK))
    ).float()
    theirs = PeftModel.from_pretrained(deq, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    moved = 0
    for k in deltas:
        if "down_proj" in k:  # transformers' CPU loader reads partial blocks with another block (docs)
            continue
        other = theirs[k].to(torch.bfloat16)
        assert within_one_step(ours[k], other, exact[k]), k
        moved += int((ours[k] != other).sum())
    assert moved > 0
