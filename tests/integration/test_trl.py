"""A TRL script, as TRL's documentation writes it (``SFTTrainer(..., peft_config=LoraConfig(...))``, then
``trainer.train()`` and ``trainer.save_model(...)``), followed by this package's call sites as
docs/after-training.md shows them: the merged checkpoint reloads to the trained model's logits.

Tiny random Llama saved to disk with a word-level tokenizer, a tiny in-memory dataset, two optimizer steps on the
CPU; LoRA on a float32 base, and QLoRA (NF4 through transformers' BitsAndBytesConfig with the real bitsandbytes).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset
from peft import LoraConfig, PeftModel
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from peft_shardmerge import merge_and_save, merge_and_unload
from peft_shardmerge.testing import build_base, token_ids
from tests.helpers import logits_of, rel_err

TOL = 1e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A float32 tiny Llama with its tokenizer in the folder, as a Hub model is."""
    folder = build_base(str(tmp_path_factory.mktemp("trl") / "tiny-llama"), "llama", dtype=torch.float32)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", pad_token="w1", eos_token="w2").save_pretrained(
        folder
    )
    return folder


def dataset() -> Dataset:
    return Dataset.from_dict(
        {"text": [" ".join(f"w{(7 * i + 3 * j) % 500 + 3}" for j in range(12)) for i in range(8)]}
    )


def sft(model, output_dir: str) -> SFTTrainer:
    """TRL's "Python Example" with LoRA: the config, the trainer, ``trainer.train()`` (two steps here)."""
    peft_config = LoraConfig(
        r=32,
        lora_alpha=16,
        lora_dropout=0.05,
        bias="none",
        task_type="CAUSAL_LM",
    )
    training_args = SFTConfig(
        output_dir=output_dir,
        learning_rate=1.0e-2,  # TRL's 2.0e-4 moves a two-step adapter too little to tell a merge from the base
        max_steps=2,
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,  # what transformers asks for on a machine without a GPU
        bf16=False,  # no bf16 autocast around the trained model's forward: it is then an exact fp32 reference
    )
    trainer = SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset(),
        peft_config=peft_config,
    )
    trainer.train()
    return trainer


def trained_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def base_logits(base: str, ids) -> torch.Tensor:
    return logits_of(base, ids)


def test_sft_lora_merge_and_save_and_the_saved_adapter(base, tmp_path):
    trainer = sft(base, str(tmp_path / "sft"))  # TRL loads the model from its name, as its docs show
    ids = token_ids(512)
    want = trained_logits(trainer.model, ids)
    assert rel_err(base_logits(base, ids), want) > 100 * TOL  # the adapter moved the model

    merge_and_save(trainer.model, str(tmp_path / "merged"))  # docs/after-training.md, "From a TRL script"
    assert json.load(open(tmp_path / "merged" / "config.json"))["dtype"] == "float32"  # the base's own by default
    assert rel_err(logits_of(str(tmp_path / "merged"), ids), want) < 2e-2  # bf16 rounding of every weight
    merge_and_save(trainer.model, str(tmp_path / "merged-fp32"), dtype="float32")
    assert rel_err(logits_of(str(tmp_path / "merged-fp32"), ids), want) < TOL

    trainer.save_model(str(tmp_path / "adapter"))  # then TRL's "Loading" section, with the drop-in
    base_model = AutoModelForCausalLM.from_pretrained(base)
    model = PeftModel.from_pretrained(base_model, str(tmp_path / "adapter"))
    model = merge_and_unload(model)
    assert rel_err(trained_logits(model, ids), want) < TOL
    model.save_pretrained(str(tmp_path / "unloaded"))
    assert rel_err(logits_of(str(tmp_path / "unloaded"), ids), want) < TOL

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "adapter"))
    merge_and_save(model, str(tmp_path / "merged-from-folder"), dtype="float32")
    assert rel_err(logits_of(str(tmp_path / "merged-from-folder"), ids), want) < TOL


def test_sft_qlora_merge_and_save(base, tmp_path):
    import bitsandbytes as bnb

    bnb_config = BitsAndBytesConfig(  # TRL's QLoRA example (compute in float32: the reference is then exact)
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=True,
    )
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=bnb_config, device_map="cpu")
    for module in model.modules():  # docs/after-training.md: keep the CPU from repacking the 4-bit weights
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    trainer = sft(model, str(tmp_path / "sft"))
    ids = token_ids(512)

    report = merge_and_save(trainer.model, str(tmp_path / "merged"), dtype="float32")
    for param in trainer.model.parameters():  # TRL keeps QLoRA's factors in bf16; the same values in fp32 make
        if param.requires_grad:  # the LoRA branch compute in fp32 too (in bf16 it is ~3e-4 off the fp32 merge)
            param.data = param.data.float()
    want = trained_logits(trainer.model, ids)
    assert report.base_precision == "dequantized"  # the default reproduces the trained 4-bit model
    assert rel_err(logits_of(str(tmp_path / "merged"), ids), want) < TOL
    assert not os.path.exists(tmp_path / "merged" / "adapter_config.json")
