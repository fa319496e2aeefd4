"""Which files of the base folder the merged output carries: what belongs to a model folder (an allowlist), never an
adapter's files, other weight formats or training state, and never a PEFT adapter card as the model's README."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.output.side_files import list_side_files
from peft_shardmerge.testing import build_adapter

#: files of a model folder that are carried (config.json is written anew)
MODEL_FILES = [
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/tool_use.jinja",
    "README.md",
    "LICENSE",
    "LICENSE.txt",
    # remote code and the helpers it imports; DeBERTa-v3's and Mistral's own tokenizer files
    "modeling_custom.py",
    "conversation.py",
    "spm.model",
    "tekken.json",
    "tokenizer.model.v3",
]
#: files that do not belong to the merged model
FOREIGN = [
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "pytorch_model.bin",
    "model.pt",
    "model.pth",
    "model.gguf",
    "tf_model.h5",
    "flax_model.msgpack",
    "model.ckpt",
    "optimizer.pt",
    "scheduler.pt",
    "trainer_state.json",
    "training_args.bin",
    "rng_state.pth",
    "rng_state_3.pth",
    "notes.txt",
    "checkpoint-500/optimizer.pt",
    "runs/events.out",
    "original/consolidated.00.pth",
]


def _files(folder) -> dict[str, str]:
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(root, n)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _fill(folder, names) -> None:
    for rel in names:
        os.makedirs(os.path.dirname(os.path.join(folder, rel)) or folder, exist_ok=True)
        with open(os.path.join(folder, rel), "w") as f:
            f.write(f"{rel} of the base")


def test_only_what_belongs_to_a_model_folder_is_listed(tmp_path):
    _fill(tmp_path, MODEL_FILES + FOREIGN + ["config.json", "model.safetensors"])
    assert list_side_files(str(tmp_path)) == sorted(MODEL_FILES)


def test_a_base_with_every_kind_of_foreign_file_merges_without_them(make_base, make_adapter, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(make_base("llama"), base)
    _fill(base, MODEL_FILES + FOREIGN)
    out = tmp_path / "out"
    merge_checkpoint(str(base), make_adapter("llama", "default"), str(out), progress=False)
    got = _files(out)
    assert not set(FOREIGN) & set(got), sorted(set(FOREIGN) & set(got))
    for rel in MODEL_FILES:
        assert got[rel] == _files(base)[rel], rel


def test_a_sentence_transformers_layout_keeps_its_modules(tmp_path):
    names = [
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/model.safetensors",
        "3_Normalize/config.json",
        "vocab.txt",
    ]
    _fill(tmp_path, names + ["model.safetensors", "adapter_config.json", "training_args.bin"])
    with open(tmp_path / "modules.json", "w") as f:
        f.write(
            '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},'
            ' {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},'
            ' {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]'
        )
    assert list_side_files(str(tmp_path)) == sorted(names)


@pytest.fixture()
def same_folder(make_base, tmp_path):
    """A base with its adapter saved into the same folder (adapter_config.json, adapter_model.safetensors and
    PEFT's README beside the weights), and the same two apart."""
    both = tmp_path / "both"
    shutil.copytree(make_base("llama"), both)
    build_adapter(str(both), str(both), arch="llama")
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(os.listdir(both))
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(both, base, ignore=shutil.ignore_patterns("adapter_*", "README.md"))
    adapter.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(both / name, adapter / name)
    return both, base, adapter


def test_base_and_adapter_in_one_folder_load_as_a_model(same_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    both, base, adapter = same_folder
    out, apart = tmp_path / "out", tmp_path / "apart"
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", both, both, out, "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    assert r.returncode == 0, r.stderr
    merge_checkpoint(str(base), str(adapter), str(apart), progress=False)
    assert sorted(os.listdir(out)) == sorted(os.listdir(apart))
    assert not {"adapter_config.json", "adapter_model.safetensors", "README.md"} & set(os.listdir(out))
    assert load_file(out / "model.safetensors").keys() == load_file(apart / "model.safetensors").keys()
    for name, t in load_file(out / "model.safetensors").items():
        assert torch.equal(t, load_file(apart / "model.safetensors")[name]), name
    model = AutoModelForCausalLM.from_pretrained(out)
    reference = AutoModelForCausalLM.from_pretrained(apart)
    for (name, p), (_, q) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
