"""What the command line says: each note once (summary, not a log line too, under --dry-run too), and BASE and ADAPTER
given the wrong way round named as such."""

from __future__ import annotations

import logging
import os

import pytest

from peft_shardmerge.api.cli import main
from peft_shardmerge.api.disk import plan_checkpoint_merge


def test_each_note_is_printed_once(make_base, make_adapter, tmp_path, capsys, caplog):
    base = make_base("qwen2")  # tied embeddings: a LoRA on the head unties them, which the plan notes
    adapter = make_adapter("qwen2", "head", target_modules=["q_proj", "lm_head"])
    notes = plan_checkpoint_merge(base, adapter, str(tmp_path / "plan")).notes
    assert notes
    for args in (["--dry-run"], []):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert main(["merge", base, adapter, str(tmp_path / f"o{len(args)}"), *args]) == 0
        shown = capsys.readouterr().out + "\n".join(
            r.getMessage() for r in caplog.records if r.levelno >= logging.INFO
        )
        for note in notes:
            assert shown.count(note) == 1, (args, note)


@pytest.mark.parametrize("which", ["merge", "dry-run"])
def test_base_and_adapter_swapped_are_named(which, make_base, make_adapter, tmp_path, capsys):
    base, adapter = make_base("llama"), make_adapter("llama")
    out = str(tmp_path / "o")
    assert main(["merge", adapter, base, out, *(["--dry-run"] if which == "dry-run" else [])]) == 2
    err = capsys.readouterr().err
    assert "BASE and ADAPTER look swapped" in err and "adapter_config.json" in err and not os.path.exists(out)


def test_merge_adapter_out_takes_the_base_the_adapter_names(make_base, make_adapter, tmp_path, capsys, caplog):
    """Two arguments, as Axolotl and LLaMA-Factory take them: the base is the adapter's base_model_name_or_path, said
    so, and the output is the three-argument merge's byte for byte; a base that is not here is named with the fix."""
    import json

    from tests.helpers import tree

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    assert json.load(open(os.path.join(adapter, "adapter_config.json")))["base_model_name_or_path"] == base
    with caplog.at_level(logging.INFO, logger="peft_shardmerge"):
        assert main(["merge", adapter, str(tmp_path / "two"), "-q"]) == 0
    assert f"base: {base} (base_model_name_or_path in the adapter's adapter_config.json)" in caplog.messages
    assert main(["merge", base, adapter, str(tmp_path / "three"), "-q"]) == 0
    assert tree(tmp_path / "two") == tree(tmp_path / "three")
    elsewhere = tmp_path / "adapter-elsewhere"
    os.mkdir(elsewhere)
    os.link(os.path.join(adapter, "adapter_model.safetensors"), elsewhere / "adapter_model.safetensors")
    config = json.load(open(os.path.join(adapter, "adapter_config.json")))
    json.dump({**config, "base_model_name_or_path": "tiny-org/not-here"}, open(elsewhere / "adapter_config.json", "w"))
    capsys.readouterr()
    assert main(["merge", str(elsewhere), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "was trained on tiny-org/not-here (base_model_name_or_path in its adapter_config.json)" in err, err
    assert "hf download tiny-org/not-here" in err and "peft-shardmerge merge BASE ADAPTER OUT" in err
    assert not os.path.exists(tmp_path / "o")


def test_a_training_output_folder_points_at_its_checkpoints(make_base, tmp_path, capsys):
    """The folder a Trainer wrote checkpoint-N folders into (its output_dir) is named with them; the last one given
    as the hint merges."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    base = make_base("llama")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(target_modules=["q_proj"])
    )
    run = tmp_path / "trainer_out"
    args = TrainingArguments(
        str(run), max_steps=2, save_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(4)]
    Trainer(model=model, args=args, train_dataset=data).train()
    assert main(["merge", base, str(run), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    hint = f"it holds 2 training checkpoint(s) that do (checkpoint-1, checkpoint-2): pass one, e.g. the last, {run}/"
    assert hint + "checkpoint-2" in err, err
    assert main(["merge", base, str(run / "checkpoint-2"), str(tmp_path / "o"), "-q"]) == 0
