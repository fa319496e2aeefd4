"""merge_and_unload(progressbar=True), PEFT's call site (peft_shardmerge/api/dropins.py): a tqdm bar over the
modules."""

from __future__ import annotations

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from peft_shardmerge import merge_and_unload


def _model(base: str, adapter: str):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)


def test_progressbar_shows_a_bar_over_the_modules_and_none_without_it(make_base, make_adapter, capsys):
    base, adapter = make_base("llama"), make_adapter("llama")
    merge_and_unload(_model(base, adapter), progressbar=True)
    err = capsys.readouterr().err
    assert "Unloading and merging model" in err and "14/14" in err  # 2 layers x 7 projections
    merge_and_unload(_model(base, adapter))
    assert "Unloading and merging model" not in capsys.readouterr().err
