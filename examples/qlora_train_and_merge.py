"""Train a tiny QLoRA adapter on the CPU for a few steps, then merge it with merge_and_save.

    python examples/qlora_train_and_merge.py [WORKDIR]

Builds a random tiny Llama, loads it in 4-bit NF4 with bitsandbytes, trains LoRA on every projection
for a few optimizer steps, and writes a merged 16-bit checkpoint without building the 16-bit model in
memory. Then it reloads the result with transformers and compares logits with the adapter model.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch


def main(workdir: str) -> int:
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging as hf_logging

    from peft_shardmerge import merge_and_save
    from peft_shardmerge.testing import build_base, default_targets, token_ids

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    base = build_base(os.path.join(workdir, "tiny-llama"), "llama", dtype=torch.bfloat16)

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    # float32 for the layers bitsandbytes leaves alone, so the comparison below is exact maths, not bf16 noise
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=quant, device_map="cpu", dtype=torch.float32
    )
    for module in model.modules():  # keep bitsandbytes from repacking weights for its CPU kernel
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=default_targets("llama")))

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    batch = token_ids(model.config.vocab_size, batch=4, length=32, seed=1)
    model.train()
    for step in range(5):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    model.eval()

    out = os.path.join(workdir, "tiny-llama-qlora-merged")
    report = merge_and_save(model, out, dtype="float32", base_precision="dequantized", max_shard_size="500KB")
    print(report.summary())

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = token_ids(model.config.vocab_size, seed=2)
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
        got = merged(input_ids=ids).logits
    err = float((got - want).abs().max())
    ok = err < 1e-3
    print(f"max |logits(merged) - logits(QLoRA model)| = {err:.2e}  ->  {'MATCH' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(sys.argv[1]))
    with tempfile.TemporaryDirectory(prefix="peft-shardmerge-qlora-") as tmp:
        sys.exit(main(tmp))
