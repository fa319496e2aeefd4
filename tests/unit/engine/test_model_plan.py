"""Planning the merge of a loaded PeftModel whose active adapter PEFT's ``add_weighted_adapter`` made with
``combination_type="svd"`` (its factors are non-contiguous views): merged like any LoRA, against PEFT's own merge."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import folder_tensors
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from peft_shardmerge import merge_and_save, merge_and_unload, plan_model_merge
from peft_shardmerge.testing import build_base, perturb_trainable

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def svd_combined(tmp_path_factory):
    """A PeftModel on an fp32 base with adapters "a" and "b" and their SVD combination "svd" active, and PEFT's
    merge_and_unload state dict of it."""
    root = tmp_path_factory.mktemp("svd")
    base = build_base(str(root / "base"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), adapter_name="a")
    peft_model.add_adapter("b", LoraConfig(r=8, lora_alpha=8, target_modules=TARGETS))
    perturb_trainable(peft_model)
    peft_model.add_weighted_adapter(["a", "b"], [1.0, 0.6], "svd", combination_type="svd")
    peft_model.set_adapter("svd")
    peft_model.eval()
    lora_a = peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["svd"].weight
    assert not lora_a.is_contiguous()  # the case: PEFT leaves the SVD factors as transposed views
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    base_state = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    assert any(not torch.equal(reference[k], base_state[k]) for k in reference)
    return root, peft_model, reference


def check_equal_to_peft(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Every tensor of ours equals PEFT's float32 merge to float32 rounding."""
    assert set(got) == set(reference)
    for name, want in reference.items():
        torch.testing.assert_close(
            got[name].float(), want, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_an_svd_combined_adapter_merges_as_peft_merges_it(svd_combined):
    """The dry run plans it, merge_and_save writes PEFT's merge, and our merge_and_unload returns it."""
    root, peft_model, reference = svd_combined
    plan = plan_model_merge(peft_model, dtype="float32")
    assert any("q_proj" in line for line in plan.describe().splitlines())
    out = str(root / "out")
    report = merge_and_save(peft_model, out, dtype="float32", progress=False)
    assert report.lora_modules_merged == report.lora_modules_total == 2 * len(TARGETS)
    check_equal_to_peft(folder_tensors(out), reference)
    merged = merge_and_unload(copy.deepcopy(peft_model))
    check_equal_to_peft(merged.state_dict(), reference)
