"""One rule for both entry points (peft_shardmerge/checkpoint/trained_base.py, original.default_dtype): the CLI and
merge_and_save
reproduce the trained model (a QLoRA adapter's 4-bit base when its files show one) and write the base's own dtype; the
dry run says which model the output reproduces; an adapter naming another base gets a note."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from peft_shardmerge import merge_and_save, merge_checkpoint
from peft_shardmerge.api.cli import main
from peft_shardmerge.api.model_checks import ChecksBeside, outline
from peft_shardmerge.checkpoint.planner import plan_from_folders
from peft_shardmerge.options import MergeOptions
from peft_shardmerge.testing import build_base, default_targets, token_ids
from tests.helpers import folder_tensors, logits_of, rel_err


def trained_on_a_4bit_checkpoint(d, **quantization):
    """A 16-bit base, its bitsandbytes 4-bit checkpoint (as a ``-bnb-4bit`` Hub model is; ``quantization`` adds to
    its settings), a LoRA trained on the 4-bit one, and the trained model's logits (the unmerged PeftModel on the
    4-bit base, fp32 compute): ``(base, adapter, peft_model, ids, trained)``."""
    base = build_base(str(d / "tiny-llama"), "llama", dtype=torch.float32)
    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        **quantization,
    )
    quantized = str(d / "tiny-llama-bnb-4bit")
    AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, dtype=torch.float32).save_pretrained(quantized)
    model = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32)
    for m in model.modules():  # no CPU repacking: the 4-bit bytes stay those of the checkpoint
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    torch.manual_seed(3)
    peft_model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=default_targets("llama"), init_lora_weights=False)
    )
    adapter = str(d / "adapter")
    peft_model.save_pretrained(adapter)
    ids = token_ids(512)
    with torch.no_grad():
        trained = peft_model.eval()(input_ids=ids).logits
    return base, adapter, peft_model, ids, trained


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    return trained_on_a_4bit_checkpoint(tmp_path_factory.mktemp("qlora"))


def test_the_cli_reproduces_the_trained_4bit_model_as_merge_and_save_does(qlora, tmp_path, capsys):
    base, adapter, peft_model, ids, trained = qlora
    assert main(["merge", base, adapter, str(tmp_path / "auto"), "--dtype", "float32", "-q"]) == 0
    assert (
        main(
            [
                "merge",
                base,
                adapter,
                str(tmp_path / "orig"),
                "--dtype",
                "float32",
                "-q",
                "--base-precision",
                "original",
            ]
        )
        == 0
    )
    auto, orig = (
        rel_err(logits_of(str(tmp_path / "auto"), ids), trained),
        rel_err(logits_of(str(tmp_path / "orig"), ids), trained),
    )
    assert auto < 1e-4 and orig > 100 * auto  # the default is the trained model, original is not
    report = merge_and_save(peft_model, str(tmp_path / "live"), dtype="float32", progress=False)
    assert rel_err(logits_of(str(tmp_path / "live"), ids), trained) < 1e-4
    cli, live = folder_tensors(str(tmp_path / "auto")), folder_tensors(str(tmp_path / "live"))
    assert cli.keys() == live.keys() and all(torch.allclose(cli[k], live[k], atol=1e-6) for k in cli)
    assert report.reproduces.startswith("the trained model")

    capsys.readouterr()
    assert main(["merge", base, adapter, str(tmp_path / "dry"), "--dry-run", "-q"]) == 0
    head = capsys.readouterr().out.splitlines()[:6]
    line = next(ln for ln in head if ln.startswith("reproduces:"))
    assert "the trained model" in line and "tiny-llama-bnb-4bit" in line
    assert any(ln.startswith("base precision:  nf4") for ln in head)


def test_the_checks_beside_a_merge_for_a_4bit_trained_adapter_keep_bitsandbytes(qlora):
    """'auto' resolves to 'nf4' here, which quantizes with bitsandbytes: the second process must not keep it out
    (it would answer with "bitsandbytes is not installed")."""
    base, adapter = qlora[:2]
    checks = ChecksBeside.start((base, [adapter]), {"dtype": "float32"})
    try:
        made = checks.join()
    finally:
        checks.stop()
    plan = plan_from_folders(base, [adapter], MergeOptions(dtype="float32").for_path("disk"))
    assert plan.base_precision == "nf4"
    assert made == outline(plan)


def test_an_adapter_whose_files_show_no_4bit_base_says_so_in_the_dry_run(make_base, make_adapter, tmp_path, capsys):
    assert main(["merge", make_base("llama"), make_adapter("llama"), str(tmp_path / "o"), "--dry-run", "-q"]) == 0
    head = capsys.readouterr().out.splitlines()[:6]
    assert any(
        ln.startswith("reproduces:      the original base + adapter") and "base precision nf4" in ln for ln in head
    )


def test_the_default_dtype_is_the_bases_own_on_both_paths(make_base, make_adapter, peft_reference, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama")  # a float32 checkpoint
    with open(f"{base}/config.json") as f:
        assert json.load(f)["dtype"] == "float32"
    disk = merge_checkpoint(base, adapter, str(tmp_path / "disk"), progress=False)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    live = merge_and_save(model, str(tmp_path / "live"), progress=False)
    assert disk.dtype == live.dtype == "float32"
    state = peft_reference(base, adapter)[0]  # PEFT's fp32 merge
    for folder in ("disk", "live"):
        got = folder_tensors(str(tmp_path / folder))
        assert all(torch.allclose(got[k], state[k], rtol=1e-5, atol=1e-6) for k in got), folder


def test_an_adapter_naming_another_base_merges_with_a_note(make_base, make_adapter, tmp_path, capsys):
    adapter = str(tmp_path / "adapter")
    shutil.copytree(make_adapter("llama"), adapter)
    with open(f"{adapter}/adapter_config.json") as f:
        config = json.load(f)
    config["base_model_name_or_path"] = "Qwen/Qwen2.5-0.5B"
    with open(f"{adapter}/adapter_config.json", "w") as f:
        json.dump(config, f)
    report = merge_checkpoint(make_base("llama"), adapter, str(tmp_path / "o"), progress=False)
    notes = [n for n in report.notes if "Qwen/Qwen2.5-0.5B" in n]
    assert len(notes) == 1 and "base_model_name_or_path" in notes[0] and make_base("llama") in notes[0]
    same = merge_checkpoint(make_base("llama"), make_adapter("llama"), str(tmp_path / "p"), progress=False)
    assert not any("base_model_name_or_path" in n for n in same.notes)


def test_modules_training_kept_in_16_bit_are_not_quantized_by_auto(tmp_path):
    """A 4-bit checkpoint whose quantization_config keeps the MLP's down projections unquantized
    (``llm_int8_skip_modules``, as Unsloth's dynamic quants and vision towers do): ``auto`` re-quantizes the other
    linear weights only, and the merge reproduces the trained model."""
    base, adapter, peft_model, ids, trained = trained_on_a_4bit_checkpoint(
        tmp_path, llm_int8_skip_modules=["down_proj", "lm_head"]
    )
    kept = [m for n, m in peft_model.named_modules() if n.endswith("down_proj.base_layer")]
    assert kept and not any(isinstance(m, bnb.nn.Linear4bit) for m in kept)  # training kept them in 16-bit
    out = str(tmp_path / "out")
    report = merge_checkpoint(base, adapter, out, dtype="float32", progress=False)
    assert any("kept in 16-bit: down_proj, lm_head" in n for n in report.notes), report.notes
    assert rel_err(logits_of(out, ids), trained) < 1e-4


@pytest.mark.parametrize("loaded_from", ["16-bit", "bnb-4bit"])
def test_a_4bit_model_and_its_merge_from_disk_write_the_same_files(tmp_path, loaded_from):
    """The in-process merge of a 4-bit model fills the shards in the order of the checkpoint it was loaded from, as
    the merge from disk does: from a 16-bit checkpoint quantized on load (against --base-precision nf4), and from a
    -bnb-4bit checkpoint (against a merge of that checkpoint), every file byte for byte, shards and index."""
    from peft_shardmerge.testing import build_adapter
    from tests.helpers import no_cpu_repack, tree

    base = build_base(str(tmp_path / "base"), "llama", max_shard_size="300KB")
    adapter = build_adapter(base, str(tmp_path / "adapter"))
    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, dtype=torch.float32)
    disk_base, precision = base, "nf4"
    if loaded_from == "bnb-4bit":
        disk_base, precision = str(tmp_path / "base-bnb-4bit"), "original"
        model.save_pretrained(disk_base, max_shard_size="200KB")
        model = AutoModelForCausalLM.from_pretrained(disk_base, dtype=torch.float32)
    no_cpu_repack(model)
    kw = dict(dtype="float32", max_shard_size="300KB", progress=False)
    merge_and_save(PeftModel.from_pretrained(model, adapter), str(tmp_path / "live"), **kw)
    merge_checkpoint(disk_base, adapter, str(tmp_path / "disk"), base_precision=precision, **kw)
    live, disk = tree(tmp_path / "live"), tree(tmp_path / "disk")
    weights = sorted(n for n in live if n.endswith((".safetensors", ".index.json")))
    assert len(weights) > 3 and weights == sorted(n for n in disk if n.endswith((".safetensors", ".index.json")))
    assert {n: live[n] for n in weights} == {n: disk[n] for n in weights}
