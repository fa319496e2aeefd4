"""verify of merges from a fine-grained FP8 base whose weights have 320 rows (not a multiple of the 128-row block):
the logits reference is the base dequantized by the format's definition, checked here against the definition
written in the test; where no reference can be built, the verdict is UNCHECKED with the reason, never FAILED."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from test_quantized_fp8 import quantize
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.testing import tiny_config
from peft_shardmerge.verify.logits import model_inputs
from peft_shardmerge.verify.report import verify_checkpoint

BLOCK = (128, 128)
#: gate/up are [320, 256]: 320 rows end in a partial 64-row block; down is [256, 320]
SHAPES = {
    "hidden_size": 256,
    "intermediate_size": 320,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The format's definition: each FP8 value times the float32 scale of its 128x128 block (the last blocks
    partial), in float32."""
    rows, cols = q.shape
    scales = scale_inv.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    return q.to(torch.float32) * scales


def write_base(folder: str) -> tuple[str, dict[str, torch.Tensor]]:
    """A tiny Llama stored as a fine-grained FP8 release (linear weights FP8 + weight_scale_inv, the rest bf16),
    and its float32 state dict dequantized by the definition."""
    torch.manual_seed(0)
    config = tiny_config("llama", **SHAPES)
    stored, exact = {}, {}
    for name, w in AutoModelForCausalLM.from_config(config).state_dict().items():
        if name.endswith("_proj.weight"):
            q, s = quantize(w, BLOCK)
            stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            exact[name] = dequantize(q, s)
        else:
            stored[name] = w.to(torch.bfloat16).contiguous()
            exact[name] = stored[name].float()
    os.makedirs(folder)
    save_file(stored, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg.update(
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
        quantization_config={
            "quant_method": "fp8",
            "weight_block_size": list(BLOCK),
            "activation_scheme": "dynamic",
            "modules_to_not_convert": ["model.embed_tokens", "lm_head"],
        },
    )
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder, exact


@pytest.fixture(scope="module")
def fp8_320(tmp_path_factory):
    """The FP8 base, a LoRA adapter made by PEFT on its exact float32 dequantization, PeftModel's logits on verify's
    inputs, and the merge."""
    root = tmp_path_factory.mktemp("fp8-320")
    base, exact = write_base(str(root / "base"))
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **SHAPES)).float()
    model.load_state_dict(exact)
    torch.manual_seed(1)
    peft_model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    ).eval()
    adapter = str(root / "adapter")
    peft_model.save_pretrained(adapter)
    inputs = [model_inputs(model.config, seed=s) for s in range(2)]  # the inputs verify draws
    with torch.no_grad():
        reference = [peft_model(**x).logits for x in inputs]
    out = str(root / "merged")
    merge_checkpoint(base, adapter, out, dtype="bfloat16", progress=False)
    return {"root": root, "base": base, "adapter": adapter, "out": out, "inputs": inputs, "reference": reference}


def logits_error(folder: str, fp8_320: dict) -> float:
    """max |logits(folder) - logits(PeftModel over the exact base)| / max |reference| over verify's inputs."""
    merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return max(
            float((merged(**x).logits - want).abs().max() / want.abs().max())
            for x, want in zip(fp8_320["inputs"], fp8_320["reference"])
        )


def test_correct_merge_is_ok_with_logits_against_the_format_definition(fp8_320):
    report = verify_checkpoint(fp8_320["out"], base=fp8_320["base"], adapter=fp8_320["adapter"])
    text = report.summary()
    assert report.status == "OK" and report.recomputed, text
    assert "checked: logits vs base + adapter on 2 random inputs" in text, text
    independent = logits_error(fp8_320["out"], fp8_320)
    print(f"logits error: verify {report.logits_max_rel_err:.6g}, against the definition {independent:.6g}")
    # verify's reference is PeftModel over the base dequantized by the definition: the same error
    assert report.logits_max_rel_err == pytest.approx(independent, rel=1e-4, abs=1e-7)


def test_damaged_merge_fails(fp8_320):
    damaged = str(fp8_320["root"] / "damaged")
    shutil.copytree(fp8_320["out"], damaged)
    path = os.path.join(damaged, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.mlp.gate_proj.weight"
    tensors[name] = (tensors[name].float() * -4).to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    os.remove(os.path.join(damaged, "merge_manifest.json"))  # only base + adapter can tell now
    assert logits_error(damaged, fp8_320) > 3e-2  # the damage shows in the logits against the definition
    report = verify_checkpoint(damaged, base=fp8_320["base"], adapter=fp8_320["adapter"])
    text = report.summary()
    assert report.status == "FAILED", text
    assert any(p.startswith(f"{name}:") for p in report.problems), text
    assert any(p.startswith("logits differ from base + adapter") for p in report.problems), text


def test_a_reference_transformers_cannot_build_is_unchecked_not_failed(fp8_320, monkeypatch):
    """With transformers' own FP8 loader as the reference's base (what verify used before), the reference cannot be
    built for this checkpoint: the correct merge is UNCHECKED with transformers' reason, not FAILED."""
    from peft_shardmerge.verify import logits

    def transformers_loader(cls, base):
        return cls.from_pretrained(base, quantization_config=FineGrainedFP8Config(dequantize=True)).float()

    try:
        transformers_loader(AutoModelForCausalLM, fp8_320["base"])
    except Exception as e:  # the reason verify must report
        reason = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    else:
        pytest.skip("this transformers builds the 320-row FP8 base: no failing reference to report")
    monkeypatch.setattr(logits, "dequantized_base", transformers_loader)
    report = verify_checkpoint(fp8_320["out"], base=fp8_320["base"], adapter=fp8_320["adapter"])
    text = report.summary()
    assert report.status == "UNCHECKED" and report.exit_code == 3 and not report.problems, text
    assert report.recomputed, text  # the bytes were checked; only the logits were not
    assert len(report.unchecked) == 1 and "logits not compared" in report.unchecked[0], text
    assert reason[:100] in report.unchecked[0] and f"unchecked: {report.unchecked[0]}" in text, text
