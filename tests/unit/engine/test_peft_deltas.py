"""LoRA on fused MoE experts (``target_parameters``) over a bf16 base whose checkpoint stores the experts one by one:
the deltas merged from disk against PEFT's float32 merge of the same adapter on the base loaded in float32."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from peft_shardmerge import merge_checkpoint, plan_checkpoint_merge
from peft_shardmerge.testing import perturb_trainable

COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def moe_config(arch: str):
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(moe_intermediate_size=32, intermediate_size=128, **COMMON)
    return MixtralConfig(intermediate_size=64, **COMMON)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def bf16_moe(request, tmp_path_factory):
    """A tiny MoE saved in bf16 (experts stored one by one), an adapter with LoRA on the fused experts, and PEFT's
    float32 merge of it on the base loaded in float32 (fused in memory)."""
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config(request.param)).to(torch.bfloat16).save_pretrained(str(root / "base"))
    model = AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], target_parameters=EXPERTS))
    perturb_trainable(peft_model)
    peft_model.save_pretrained(str(root / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.float32)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, str(root / "adapter")).merge_and_unload().state_dict()
    return root, base_state, merged


def test_expert_deltas_from_a_bf16_base_equal_peft_float32_merge(bf16_moe, tmp_path):
    """merge_checkpoint --dtype float32: every expert tensor's delta is PEFT's float32 delta (to float32 rounding),
    not one computed from factors rounded to the base's bf16."""
    from safetensors import safe_open

    root, base, ref = bf16_moe
    with safe_open(str(root / "base" / "model.safetensors"), "pt") as f:  # the premise: stored one expert a key
        stored = set(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in ref and not any(k.endswith("_proj") for k in stored)
    assert sum(".experts.3." in k for k in stored) == 2 * 3  # layers x (gate, up, down)
    out = str(tmp_path / "out")
    merge_checkpoint(str(root / "base"), str(root / "adapter"), out, dtype="float32", progress=False)
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()  # fused again, as PEFT's
    checked = 0
    for name in ref:
        want = ref[name] - base[name]
        if not want.abs().max() > 0:
            continue
        got = ours[name] - base[name]
        err = float((got - want).norm() / want.norm())
        assert err < 1e-6, f"{name}: delta off PEFT's float32 merge by {err:.3g} (relative)"
        checked += "experts" in name
    assert checked == 2 * len(EXPERTS)


def test_per_expert_and_whole_delta_routes_are_float32(bf16_moe):
    """Both routes to a per-expert key's delta (that expert's factors alone, or the whole fused delta cut by
    transformers' reverse conversion) give PEFT's float32 delta of that expert."""
    root, base, ref = bf16_moe
    plan = plan_checkpoint_merge(str(root / "base"), str(root / "adapter"), str(root / "plan2"))
    parts = [o for t in plan.tensors for o in t.recipe.peft_ops if o.kind == "part"]
    assert len(parts) == 2 * 3 * 4  # layers x (gate, up, down) x experts
    layers = plan.inputs.adapter.layers
    for part in parts:
        whole = part.op.delta()
        want = ref[part.memory_name] - base[part.memory_name]
        assert whole.dtype == torch.float32
        assert float((whole - want).norm() / want.norm()) < 1e-6, part.memory_name
        own = layers.part_delta(part.op, part.memory_name, part.file_name)
        cut = layers.split(part.memory_name, whole)[part.file_name]
        assert own is not None and own.dtype == torch.float32
        assert float((own - cut).norm() / cut.norm()) < 1e-6, part.file_name
