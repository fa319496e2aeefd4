"""Measure which base a QLoRA adapter should be merged into: the original weights or the dequantized 4-bit ones.

    python examples/compare_bases.py [WORKDIR] [--steps N]

Trains a tiny QLoRA (NF4, double quant) on a synthetic task (a fixed successor table of tokens), then
compares the loss on held-out sequences of:
  - the trained model itself (4-bit base + adapter, the model you evaluated during training),
  - the merge into the original bf16 weights (merge_and_save(base_precision="original")),
  - the merge into the dequantized 4-bit weights (base_precision="dequantized"),
and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch


def patterns(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """Sequences that follow a fixed random successor table (token t is always followed by succ[t]), from random
    starting tokens: a tiny model learns it in a few dozen steps, and held-out sequences start elsewhere."""
    succ = torch.randperm(vocab - 3, generator=torch.Generator().manual_seed(123)) + 3
    g = torch.Generator().manual_seed(seed)
    seq = [torch.randint(3, vocab, (batch,), generator=g)]
    for _ in range(length - 1):
        seq.append(succ[seq[-1] - 3])
    return torch.stack(seq, dim=1)


def loss_of(model, data: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=data, labels=data).loss)


def main(workdir: str, steps: int) -> int:
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging as hf_logging

    from peft_shardmerge import merge_and_save
    from peft_shardmerge.testing import build_base, default_targets

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    base = build_base(
        os.path.join(workdir, "base"),
        "llama",
        dtype=torch.bfloat16,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=quant, device_map="cpu", dtype=torch.float32
    )
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=default_targets("llama")))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    vocab = model.config.vocab_size
    model.train()
    for step in range(steps):
        data = patterns(vocab, 8, 64, seed=step)
        model(input_ids=data, labels=data).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    held_out = patterns(vocab, 16, 64, seed=10_000)

    rows = [
        ("base alone (bf16)", loss_of(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), held_out)),
        ("trained QLoRA model (4-bit base + adapter)", loss_of(model, held_out)),
    ]
    for precision in ("original", "dequantized"):
        out = os.path.join(workdir, f"merged-{precision}")
        merge_and_save(model, out, dtype="bfloat16", base_precision=precision, progress=False)
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        rows.append((f"merged into the {precision} base, bf16", loss_of(merged, held_out)))
    print(f"| model ({steps} training steps) | held-out loss |")
    print("|---|---:|")
    for name, loss in rows:
        print(f"| {name} | {loss:.4f} |")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", nargs="?")
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    if args.workdir:
        sys.exit(main(args.workdir, args.steps))
    with tempfile.TemporaryDirectory(prefix="peft-shardmerge-bases-") as tmp:
        sys.exit(main(tmp, args.steps))
