"""An output name that is not valid UTF-8 is refused before anything is written, on every API, with a message
that names the problem and the fix and can be printed.

File names on Linux are bytes; ``os.fsdecode`` turns the bytes that are not UTF-8 into lone surrogates
(``b"out\\xff"`` -> ``"out\\udcff"``). safetensors, ``config.json`` and the Hub take UTF-8 names only, so such a
name must be refused up front, not halfway through a merge."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from peft_shardmerge import InputError, check_out_dir, merge_and_save, merge_checkpoint, save_pretrained_merged
from peft_shardmerge.testing import build_base
from tests.helpers import tree

BAD = b"out\xff"


@pytest.fixture()
def tiny(make_base, make_adapter):
    return make_base("llama"), make_adapter("llama", "default")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    base = build_base(str(tmp_path_factory.mktemp("outnames") / "tiny-llama"), "llama", dtype=torch.bfloat16)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    )
    return peft_model


def _refused(problems_or_error, name: str = "out") -> str:
    text = "\n".join(problems_or_error) if isinstance(problems_or_error, list) else str(problems_or_error)
    assert "not valid UTF-8" in text and "pass a UTF-8 name" in text, text
    # the bytes shown, and a name to use instead
    assert f"{name}\\xff" in text and f"{name}_" in text.split("e.g.")[-1], text
    assert "safetensors" not in text.split("not valid UTF-8")[0], text
    text.encode("utf-8")  # printable: no lone surrogates in the message
    return text


@pytest.mark.parametrize("out", [os.fsdecode(BAD), BAD], ids=["str-surrogateescape", "bytes"])
def test_check_out_dir_names_the_problem(tmp_path, out, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(check_out_dir(out, inputs={}, overwrite=False))
    assert check_out_dir(os.fsdecode(b"caf\xc3\xa9"), inputs={}, overwrite=False) == []  # UTF-8 "café" is fine


@pytest.mark.parametrize("out", [os.fsdecode(BAD), BAD], ids=["str-surrogateescape", "bytes"])
def test_merge_checkpoint_refuses_up_front(tiny, tmp_path, out, monkeypatch):
    base, adapter = tiny
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path), tree(base), tree(adapter)
    with pytest.raises(InputError) as e:
        merge_checkpoint(base, adapter, out, progress=False)
    _refused(e.value)
    assert (tree(tmp_path), tree(base), tree(adapter)) == before  # nothing left behind: no staging folder, no lock


def test_a_lone_surrogate_is_refused_too(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="not a valid file name") as e:
        merge_checkpoint(*tiny, "out\ud800", progress=False)
    str(e.value).encode("utf-8")
    assert os.listdir(tmp_path) == []


def test_a_working_folder_that_is_not_utf8_is_named(tiny, tmp_path, monkeypatch):
    here = os.path.join(os.fsencode(tmp_path), b"work\xfe")
    os.mkdir(here)
    monkeypatch.chdir(here)
    with pytest.raises(InputError, match="a folder above it") as e:
        merge_checkpoint(*tiny, "merged", progress=False)
    str(e.value).encode("utf-8")
    assert os.listdir(b".") == []


def test_in_process_merge_and_drop_ins_refuse_up_front(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for out in (os.fsdecode(BAD), BAD):
        with pytest.raises(InputError) as e:
            merge_and_save(model, out)
        _refused(e.value)
        for method in ("merged_16bit", "merged_4bit_forced", "lora"):
            with pytest.raises(InputError) as e:
                save_pretrained_merged(model, out, None, save_method=method)
            _refused(e.value)
        assert os.listdir(tmp_path) == []
    merge_and_save(model, "out_", progress=False)  # the suggested name works
    assert os.path.isfile("out_/config.json")


@pytest.mark.slow
def test_cli_refuses_with_exit_2_and_a_printable_message(tiny, tmp_path):
    base, adapter = tiny
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", base, adapter, os.path.join(os.fsencode(tmp_path), BAD)],
        capture_output=True,
        cwd=tmp_path,
        timeout=300,
    )
    err = r.stderr.decode("utf-8")
    assert r.returncode == 2, err
    _refused([err])
    assert "Traceback" not in err and os.listdir(tmp_path) == []
