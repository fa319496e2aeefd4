"""merge_and_save / save_pretrained_merged with ``tokenizer=`` a name or a folder (peft_shardmerge/api/inprocess.py):
loaded with AutoTokenizer and saved, or refused by name before anything is written."""

from __future__ import annotations

import os

import pytest
import torch
from peft import PeftModel
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from peft_shardmerge import InputError, merge_and_save, save_pretrained_merged


def _model(base: str, adapter: str):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)


@pytest.fixture()
def tokenizer_folder(tmp_path) -> str:
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = str(tmp_path / "tok")
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", pad_token="w1", eos_token="w2").save_pretrained(
        folder
    )
    return folder


def test_a_tokenizer_folder_given_by_path_is_saved(make_base, make_adapter, tokenizer_folder, tmp_path):
    model = _model(make_base("llama"), make_adapter("llama"))
    for out, save in ((tmp_path / "a", merge_and_save), (tmp_path / "b", save_pretrained_merged)):
        save(model, str(out), tokenizer=tokenizer_folder)
        want = AutoTokenizer.from_pretrained(tokenizer_folder)
        got = AutoTokenizer.from_pretrained(str(out))
        assert got("w5 w7 w300")["input_ids"] == want("w5 w7 w300")["input_ids"] == [5, 7, 300]


def test_a_name_that_cannot_be_loaded_is_refused_before_writing(make_base, make_adapter, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _model(make_base("llama"), make_adapter("llama"))
    for save in (merge_and_save, save_pretrained_merged):
        with pytest.raises(InputError, match="tokenizer 'gpt2' could not be loaded with AutoTokenizer"):
            save(model, str(tmp_path / "o"), tokenizer="gpt2")
        with pytest.raises(InputError, match="tokenizer must be a tokenizer object"):
            save(model, str(tmp_path / "o"), tokenizer=3)
        assert os.listdir(tmp_path) == []
