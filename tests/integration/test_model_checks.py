"""A merge from disk whose model-class checks run beside it (a second process with the real transformers and PEFT):
the same files as with the checks made first, their problems raised with nothing committed, a plan they change merged
again, and the command line starting them early, for its merge to take over."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from peft_shardmerge import InputError, merge_checkpoint
from peft_shardmerge.api import model_checks
from peft_shardmerge.api.model_checks import ChecksBeside, checks_beside, outline
from peft_shardmerge.checkpoint.planner import plan_from_folders
from peft_shardmerge.options import MergeOptions
from peft_shardmerge.testing import build_adapter, build_base
from tests.helpers import tree


def _merge(base, adapter, out, mode: str, **kw):
    return merge_checkpoint(base, adapter, str(out), progress=False, model_checks=mode, **kw)


@pytest.mark.parametrize("name", ["llama_sharded", "gpt2", "qwen2"])
def test_checks_beside_write_the_files_checks_made_first_write(make_base, make_adapter, tmp_path, name, caplog):
    base, adapter = make_base(name), make_adapter(name, "default")
    _merge(base, adapter, tmp_path / "first", "first", dtype="bfloat16", max_shard_size="100KB")
    with caplog.at_level(logging.DEBUG, logger="peft_shardmerge"):
        report = _merge(base, adapter, tmp_path / "beside", "beside", dtype="bfloat16", max_shard_size="100KB")
    assert "model-class checks beside the merge: done" in caplog.text  # they ran, in the second process
    assert "merging again" not in caplog.text
    assert report.lora_modules_merged == report.lora_modules_total > 0
    assert tree(tmp_path / "beside") == tree(tmp_path / "first")  # shards, index, config, side files, record


@pytest.mark.parametrize("kind", ["loha", "ia3"])
def test_layers_peft_rebuilds_are_merged_beside_as_first(make_base, tmp_path, kind, caplog):
    from peft import IA3Config, LoHaConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_shardmerge.testing import perturb_trainable

    base = make_base("llama")
    config = {
        "loha": LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "up_proj"], init_weights=False),
        "ia3": IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    }[kind]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    perturb_trainable(model)
    model.save_pretrained(str(tmp_path / "adapter"))
    adapter = str(tmp_path / "adapter")
    _merge(base, adapter, tmp_path / "first", "first")
    with caplog.at_level(logging.INFO, logger="peft_shardmerge"):
        _merge(base, adapter, tmp_path / "beside", "beside")  # their layers, rebuilt on the meta device, outlined
    assert "merging again" not in caplog.text
    assert tree(tmp_path / "beside") == tree(tmp_path / "first")


def test_the_plan_from_the_files_alone_is_the_whole_plan_where_the_class_adds_nothing(make_base, make_adapter):
    base, adapter = make_base("gpt2"), make_adapter("gpt2", "default")  # Conv1D: the layout from the adapter's flag
    opts = MergeOptions().for_path("disk")
    whole = plan_from_folders(base, [adapter], opts)
    alone = plan_from_folders(base, [adapter], opts, model_checks=False)
    assert outline(alone) == outline(whole)
    other = plan_from_folders(base, [adapter], MergeOptions(dtype="bfloat16").for_path("disk"))
    assert outline(other) != outline(whole)


def _with_base_weight(adapter: str) -> None:
    """An adapter file that also holds its LoRA module's base weight, which PeftModel.from_pretrained ignores."""
    path = os.path.join(adapter, "adapter_model.safetensors")
    weights = load_file(path)
    weights["base_model.model.model.layers.0.self_attn.q_proj.weight"] = torch.ones(128, 128)
    save_file(weights, path)


def test_a_problem_only_the_checks_find_is_raised_with_nothing_committed(make_base, tmp_path):
    base = make_base("llama")
    adapter = build_adapter(base, str(tmp_path / "adapter"))
    _with_base_weight(adapter)
    with pytest.raises(InputError) as first:
        _merge(base, adapter, tmp_path / "first", "first")
    assert "before writing anything" in str(first.value)
    with pytest.raises(InputError) as beside:
        _merge(base, adapter, tmp_path / "out", "beside")
    assert beside.value.problems == first.value.problems  # PEFT's own load check, from the second process's side
    assert "would not be loaded by PEFT" in str(beside.value)
    assert "run beside the merge; its output was discarded and OUT is unchanged" in str(beside.value)
    assert sorted(os.listdir(tmp_path)) == ["adapter"]  # no output, no staging folder, no lock


def test_a_plan_the_model_class_changes_is_merged_again_with_it(tmp_path, caplog):
    base = build_base(str(tmp_path / "base"), "qwen2")  # tied embeddings: the class unties them under a LoRA
    adapter = build_adapter(base, str(tmp_path / "adapter"), target_modules=["q_proj", "embed_tokens"])
    opts = MergeOptions().for_path("disk")
    alone = plan_from_folders(base, [adapter], opts, model_checks=False)
    whole = plan_from_folders(base, [adapter], opts)
    assert alone.untied == [] and whole.untied  # the case: only the class knows the tie
    _merge(base, adapter, tmp_path / "first", "first")
    with caplog.at_level(logging.INFO, logger="peft_shardmerge"):
        _merge(base, adapter, tmp_path / "beside", "beside")
    assert "differs from the one made from the files alone; merging again with it" in caplog.text
    assert tree(tmp_path / "beside") == tree(tmp_path / "first")
    assert sorted(os.listdir(tmp_path)) == ["adapter", "base", "beside", "first"]


def test_a_second_process_that_cannot_plan_is_replaced_by_planning_here(
    make_base, make_adapter, tmp_path, monkeypatch, caplog
):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    _merge(base, adapter, tmp_path / "first", "first")
    monkeypatch.setattr(model_checks, "CHILD", "print('not JSON'); import sys; sys.exit(3)")
    with caplog.at_level(logging.DEBUG, logger="peft_shardmerge"):
        _merge(base, adapter, tmp_path / "beside", "beside")
    assert "did not plan (exit status 3" in caplog.text
    assert tree(tmp_path / "beside") == tree(tmp_path / "first")


def test_a_second_process_that_cannot_start_leaves_the_checks_first(make_base, make_adapter, tmp_path, monkeypatch):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    _merge(base, adapter, tmp_path / "first", "first")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))  # Popen raises FileNotFoundError
    assert ChecksBeside.start((base, [adapter]), {}) is None
    _merge(base, adapter, tmp_path / "beside", "beside")
    assert tree(tmp_path / "beside") == tree(tmp_path / "first")


def test_the_second_process_answers_with_the_outline_of_the_whole_plan(make_base, make_adapter):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    checks = ChecksBeside.start((base, [adapter]), {"dtype": "bfloat16"})
    try:
        made = checks.join()
    finally:
        checks.stop()
    opts = MergeOptions(dtype="bfloat16").for_path("disk")
    assert made == outline(plan_from_folders(base, [adapter], opts))


#: the second process's answer (``plan_beside.main``, in a fresh process), then, on a line of its own, what
#: ``sys.modules`` holds afterwards (whether PEFT was imported, whether bitsandbytes was kept out) and whether the
#: model class still builds there (a failed build only warns and plans without it)
_SECOND_PROCESS = """
import sys
from peft_shardmerge.api.plan_beside import main
from peft_shardmerge.support.model_info import inspect_model
main({"given": [sys.argv[1], [sys.argv[2]]], "options": {}})
print()
kept_out = sys.modules.get("bitsandbytes", "not-imported") is None
print("peft" in sys.modules, kept_out, inspect_model(sys.argv[1]).available)
"""


def _second_process(base: str, adapter: str) -> tuple[dict, list[str]]:
    r = subprocess.run(
        [sys.executable, "-c", _SECOND_PROCESS, base, adapter], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    answer, modules = r.stdout.rsplit("\n", 2)[:2]
    return json.loads(answer), modules.split()


def test_the_second_process_leaves_bitsandbytes_unimported_for_a_16_bit_base(make_base, make_adapter):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    answer, modules = _second_process(base, adapter)
    assert modules == ["True", "True", "True"]  # the checks imported PEFT; bitsandbytes was kept out; the class built
    assert answer == {"outline": outline(plan_from_folders(base, [adapter], MergeOptions().for_path("disk")))}


def test_without_bitsandbytes_the_second_process_still_finds_what_peft_would_not_load(make_base, tmp_path):
    base = make_base("llama")
    adapter = build_adapter(base, str(tmp_path / "adapter"))
    _with_base_weight(adapter)
    answer, modules = _second_process(base, adapter)
    assert modules == ["True", "True", "True"]
    assert "would not be loaded by PEFT" in answer["error"]


def test_options_are_sent_as_json_numbers_and_names():
    import numpy as np

    assert model_checks._plain(np.float32(0.5)) == 0.5 and model_checks._plain(np.int64(3)) == 3
    assert model_checks._plain(torch.bfloat16) == "bfloat16"
    assert ChecksBeside.start(("base", ["adapter"]), {"weights": [object()]}) is None  # refused, not guessed


def test_a_legacy_bin_adapter_is_not_merged_twice(make_base, make_adapter, tmp_path, caplog):
    import shutil

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    legacy = str(tmp_path / "legacy")
    shutil.copytree(adapter, legacy)
    weights = load_file(os.path.join(legacy, "adapter_model.safetensors"))
    torch.save(weights, os.path.join(legacy, "adapter_model.bin"))
    os.remove(os.path.join(legacy, "adapter_model.safetensors"))  # converted into a temporary folder by each plan
    _merge(base, legacy, tmp_path / "first", "first")
    with caplog.at_level(logging.INFO, logger="peft_shardmerge"):
        _merge(base, legacy, tmp_path / "beside", "beside")
    assert "merging again" not in caplog.text
    assert tree(tmp_path / "beside") == tree(tmp_path / "first")


def test_an_interrupted_merge_to_resume_makes_its_checks_first(tmp_path):
    out = tmp_path / "out"
    assert checks_beside("beside", distributed=False, dry_run=False, out_dir=str(out))
    (tmp_path / ".out.partial").mkdir()  # what a killed merge leaves: its shards are kept for their own plan only
    assert not checks_beside("beside", distributed=False, dry_run=False, out_dir=str(out))


def test_checks_started_early_for_a_merge_that_makes_them_first_are_stopped(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    ChecksBeside.start_early((base, [adapter]), {})
    early = model_checks._EARLY[0]
    _merge(base, adapter, tmp_path / "first", "first")
    assert model_checks._EARLY == [] and early.proc.poll() is not None


def test_when_the_checks_run_beside():
    assert checks_beside("beside", distributed=False, dry_run=False)
    assert not checks_beside("first", distributed=False, dry_run=False)
    assert not checks_beside("beside", distributed=True, dry_run=False)  # the ranks agree on one plan, made first
    assert not checks_beside("beside", distributed=False, dry_run=True)  # a dry run prints the whole plan
    assert "peft" in sys.modules and not checks_beside("auto", distributed=False, dry_run=False)  # imports paid
    assert MergeOptions(model_checks="later").problems() == [
        "model_checks must be one of auto, first, beside, got 'later'"
    ]


def test_checks_started_early_are_taken_over_by_the_same_merge_only(make_base, make_adapter):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    options = {"dtype": "bfloat16", "workers": 1}
    ChecksBeside.start_early((base, [adapter]), options)
    early = model_checks._EARLY[0]
    same = ChecksBeside.take((base, [adapter]), MergeOptions(dtype="bfloat16", workers=1).for_path("disk"))
    assert same is early and model_checks._EARLY == []
    same.stop()
    ChecksBeside.start_early((base, [adapter]), options)
    early = model_checks._EARLY[0]
    other = ChecksBeside.take((base, [adapter]), MergeOptions(dtype="float16", workers=1).for_path("disk"))
    assert other is not early and early.proc.poll() is not None  # the early ones, for another merge, were ended
    assert other.opts.dtype == "float16"
    other.stop()


def test_the_command_line_starts_the_checks_early_and_its_merge_takes_them_over(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    out = tmp_path / "cli"
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", "-v", base, adapter, str(out), "--dtype", "bfloat16"]
        + ["--model-checks", "beside"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "model-class checks beside the merge: the ones started early" in r.stderr
    assert "model-class checks beside the merge: done" in r.stderr
    _merge(base, adapter, tmp_path / "first", "first", dtype="bfloat16")
    assert tree(out) == tree(tmp_path / "first")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "peft_shardmerge",
            "merge",
            "-v",
            base,
            adapter,
            str(tmp_path / "f2"),
            "--model-checks",
            "first",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "model-class checks beside" not in r.stderr


def test_between_tensors_a_finished_second_process_stops_a_merge_of_another_plan(make_base, make_adapter):
    from peft_shardmerge.api.disk import _Confirmed
    from peft_shardmerge.errors import PlanChanged

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    plan = plan_from_folders(base, [adapter], MergeOptions(dtype="bfloat16").for_path("disk"), model_checks=False)
    for dtype, changed in (("float16", True), ("bfloat16", False)):
        checks = ChecksBeside((base, [adapter]), {"dtype": dtype})
        confirm = _Confirmed(plan, checks)
        checks.proc.wait()
        try:
            if changed:
                with pytest.raises(PlanChanged):
                    confirm.before(plan.tensors[0])
            else:
                confirm.before(plan.tensors[0])
                assert confirm.confirmed
        finally:
            checks.stop()


def test_a_verdict_kept_for_the_same_inputs_spares_the_second_process(make_base, tmp_path, monkeypatch, caplog):
    """The checks' verdict is kept for the same inputs: a next merge of them starts no second process (here one
    that would fail, so any start shows) and writes the same files; an edited input, or one whose plan differs from
    the verdict's (its time changed), is checked again; a verdict that failed is never kept."""
    monkeypatch.setenv("PEFT_SHARDMERGE_CHECKS_CACHE", "1")
    monkeypatch.setenv("PEFT_SHARDMERGE_CACHE", str(tmp_path / "cache"))
    base = make_base("llama")
    adapter = build_adapter(base, str(tmp_path / "adapter"))
    _merge(base, adapter, tmp_path / "first", "beside")
    kept = os.listdir(tmp_path / "cache" / "checks")
    assert len(kept) == 1 and kept[0].endswith(".json")
    monkeypatch.setattr(model_checks, "CHILD", "import sys; sys.exit(3)")  # a second process started now fails
    with caplog.at_level(logging.DEBUG, logger="peft_shardmerge"):
        _merge(base, adapter, tmp_path / "again", "beside")
    assert "the verdict kept for the same inputs" in caplog.text and "did not plan" not in caplog.text
    assert tree(tmp_path / "again") == tree(tmp_path / "first")

    config = os.path.join(adapter, "adapter_config.json")
    text = open(config).read()
    assert '"lora_dropout": 0.0' in text
    open(config, "w").write(text.replace('"lora_dropout": 0.0', '"lora_dropout": 0.1'))  # same size, other content
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="peft_shardmerge"):
        _merge(base, adapter, tmp_path / "edited", "beside")
    assert "the verdict kept" not in caplog.text and "did not plan (exit status 3" in caplog.text

    os.utime(os.path.join(adapter, "adapter_model.safetensors"), (1e9, 1e9))  # same content, another time
    monkeypatch.setattr(model_checks, "CHILD", "import sys; sys.exit(3)")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="peft_shardmerge"):
        _merge(base, adapter, tmp_path / "touched", "beside")
    assert "the kept verdict is for another plan; checking" in caplog.text, caplog.text
    assert tree(tmp_path / "touched") == tree(tmp_path / "edited")

    _with_base_weight(adapter)  # now refused by the checks: nothing is kept for it
    before = sorted(os.listdir(tmp_path / "cache" / "checks"))
    with pytest.raises(InputError, match="would not be loaded by PEFT"):
        _merge(base, adapter, tmp_path / "refused", "beside")
    assert sorted(os.listdir(tmp_path / "cache" / "checks")) == before
