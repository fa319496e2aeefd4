"""The train -> evaluate -> save -> merge_and_save flow on a CPU with AVX512-BF16, where bitsandbytes repacks 4-bit
weights at the first eval forward (and PEFT's save_pretrained undoes that in place, lossily): merge_and_save says
so, the record names those weights, and verify reports them UNCHECKED naming the repacking, never FAILED."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from peft_shardmerge import merge_and_save
from peft_shardmerge.testing import build_base, token_ids
from peft_shardmerge.verify.integrity import read_record
from peft_shardmerge.verify.report import verify_checkpoint
from tests.integration.test_inprocess import train_one_step


@pytest.mark.parametrize(
    "dtype,double_quant", [("bfloat16", True), ("float32", True), ("bfloat16", False), ("float32", False)]
)
def test_verify_after_a_repacking_eval_forward_names_the_repacking_not_failed(tmp_path, dtype, double_quant):
    base = build_base(str(tmp_path / "base"), "llama", dtype=torch.bfloat16)
    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, device_map="cpu", dtype=torch.bfloat16)
    peft_model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    train_one_step(peft_model, model.config.vocab_size)
    with torch.no_grad():  # evaluate: the eval-mode forward that repacks on such a CPU
        peft_model(input_ids=token_ids(model.config.vocab_size))
    layers = [m for m in peft_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers):
        pytest.skip("bitsandbytes did not repack on this CPU (no AVX512-BF16 kernel)")
    peft_model.save_pretrained(str(tmp_path / "adapter"))  # undoes the repacking in place
    out = str(tmp_path / "out")
    report = merge_and_save(peft_model, out, dtype=dtype, progress=False)
    assert any("repacked by bitsandbytes" in n for n in report.notes), report.summary()
    record, _ = read_record(out)
    assert len(record["merge"]["cpu_repacked"]) == len(layers)
    result = verify_checkpoint(out, base=base, adapter=str(tmp_path / "adapter"))
    if not double_quant:
        # without double quant the block scales of a bf16 model are bf16 values, which the repacking keeps exactly
        assert result.status == "OK" and result.recomputed, result.summary()
        return
    assert result.status == "UNCHECKED" and not result.problems, result.summary()
    assert any("CPU repacking" in u for u in result.unchecked), result.summary()
