"""The first hour of a QLoRA user: each test does what a user following PEFT's, Unsloth's or TRL's documentation did.

Tiny random Llama / Qwen2 models on the CPU; 4-bit through transformers' BitsAndBytesConfig with the real
bitsandbytes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import peft_shardmerge
from peft_shardmerge import InputError, merge_and_save, merge_and_unload, save_pretrained_merged
from peft_shardmerge.testing import build_base, token_ids
from tests.helpers import add_adapter_or_skip, logits_of, rel_err
from tests.integration.test_inprocess import reference_logits, train_one_step

NF4 = dict(
    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
)


def peft_qlora(base: str, **load) -> PeftModel:
    """PEFT's QLoRA recipe: BitsAndBytesConfig, prepare_model_for_kbit_training, get_peft_model, a few steps.

    Loaded in float32 so that the unmerged model computes in float32 too and can serve as the reference to 1e-5
    (a bf16-loaded 4-bit layer dequantizes to bf16 on the CPU, a rounding of ~3e-3 in the logits)."""
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=BitsAndBytesConfig(**NF4), **{"dtype": torch.float32, **load}
    )
    for m in model.modules():  # keep the CPU from repacking the weights (see docs/after-training.md)
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    )
    train_one_step(model, model.config.vocab_size)
    return model


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory):
    return build_base(str(tmp_path_factory.mktemp("first-hour") / "tiny-llama"), "llama", dtype=torch.bfloat16)


# --- trust: what the default reproduces -----------------------------------------------------------------------


@pytest.mark.parametrize("attach", ["get_peft_model", "add_adapter"])
def test_default_reproduces_the_trained_4bit_model_however_the_adapter_was_attached(attach, bf16_base, tmp_path):
    """PeftModel (get_peft_model) and transformers' add_adapter get the same default, and it is the trained model."""
    ids = token_ids(512, seed=3)
    if attach == "get_peft_model":
        model = peft_qlora(bf16_base)
        ref = reference_logits(model, ids)
        report = merge_and_save(model, str(tmp_path / "peft"), dtype="float32", progress=False)
        assert report.base_precision == "dequantized"
        assert report.reproduces.startswith("the trained model")
        assert "'original' would merge into" in report.notes[0] and "% from the trained model's" in report.notes[0]
        assert rel_err(logits_of(str(tmp_path / "peft"), ids), ref) < 1e-5
        assert "reproduces the trained model" in report.summary()
        return

    plain = AutoModelForCausalLM.from_pretrained(
        bf16_base, quantization_config=BitsAndBytesConfig(**NF4), dtype=torch.float32
    )
    for m in plain.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    add_adapter_or_skip(
        plain, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    ref = reference_logits(plain, ids)
    report = merge_and_save(plain, str(tmp_path / "add_adapter"), dtype="float32", progress=False)
    assert report.base_precision == "dequantized" and report.reproduces.startswith("the trained model")
    assert rel_err(logits_of(str(tmp_path / "add_adapter"), ids), ref) < 1e-5


def test_original_says_it_is_not_the_trained_model_and_how_far(bf16_base, tmp_path):
    model = peft_qlora(bf16_base)
    report = merge_and_save(model, str(tmp_path / "m"), base_precision="original", progress=False)
    assert report.base_precision == "original"
    assert "NOT the trained 4-bit model" in report.reproduces
    far = float(report.notes[0].split("by about ")[1].split("%")[0])
    assert 1 < far < 50, report.notes[0]  # NF4's error on a random base, per layer; measured, not zero


def _hub_cache(tmp_path, bases: dict[str, str], main: str):
    """A Hugging Face cache holding ``org/tiny`` at several revisions (branch name -> checkpoint folder)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    for i, (branch, folder) in enumerate(bases.items()):
        sha = f"{i + 1:x}" * 40
        shutil.copytree(folder, repo / "snapshots" / sha)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(sha)
    (repo / "refs" / "main").write_text((repo / "refs" / main).read_text())
    return str(tmp_path / "hub")


def test_auto_merges_into_the_revision_the_model_was_loaded_from(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    v1 = build_base(str(tmp_path / "v1"), "llama", seed=1)
    v2 = build_base(str(tmp_path / "v2"), "llama", seed=2)
    cache = _hub_cache(tmp_path, {"v1": v1, "v2": v2}, main="v2")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", cache)
    model = AutoModelForCausalLM.from_pretrained("org/tiny", revision="v1", cache_dir=cache, dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    ids = token_ids(512, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    report = merge_and_save(model, str(tmp_path / "m"), dtype="float32", progress=False)
    assert report.base_precision == "original" and "1" * 40 in report.notes[0]  # v1's snapshot, not refs/main's
    assert rel_err(logits_of(str(tmp_path / "m"), ids), ref) < 1e-5


def test_a_base_folder_changed_after_loading_is_not_used(tmp_path):
    base = build_base(str(tmp_path / "base"), "llama", seed=1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    build_base(base, "llama", seed=5)  # the folder is rewritten after loading
    ids = token_ids(512, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    with pytest.raises(
        InputError,
        match=r"base_precision='original' cannot be used: the checkpoint on disk is not "
        r"the one in memory \(.*model\.embed_tokens\.weight differs",
    ):
        merge_and_save(model, str(tmp_path / "o"), dtype="float32", base_precision="original", progress=False)
    report = merge_and_save(model, str(tmp_path / "m"), dtype="float32", progress=False)
    assert report.base_precision == "dequantized" and "changed after loading" in report.notes[0]
    assert rel_err(logits_of(str(tmp_path / "m"), ids), ref) < 1e-5


# --- dtype ----------------------------------------------------------------------------------------------------


def test_a_model_loaded_in_fp32_is_written_in_the_checkpoints_own_dtype(bf16_base, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(bf16_base, dtype=torch.float32)  # as many CPU tutorials do
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    report = merge_and_save(model, str(tmp_path / "m"), progress=False)
    assert report.dtype == "bfloat16" and any("the checkpoint's own" in n for n in report.notes)
    assert json.load(open(tmp_path / "m" / "config.json"))["dtype"] == "bfloat16"

    fp32 = build_base(str(tmp_path / "fp32"), "llama", dtype=torch.float32)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32),
        LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights=False),
    )
    report = merge_and_save(model, str(tmp_path / "n"), progress=False)  # the base's own dtype, as from disk
    assert report.dtype == "float32" and any("the checkpoint's own" in n for n in report.notes)
    assert merge_and_save(model, str(tmp_path / "a"), dtype="auto", progress=False).dtype == "float32"


# --- Unsloth's call sites -------------------------------------------------------------------------------------


def test_unsloth_save_methods_and_rerunning_the_cell(bf16_base, tmp_path, caplog):
    peft_shardmerge.patch_peft()
    model = peft_qlora(bf16_base)
    out = str(tmp_path / "model")
    model.save_pretrained_merged(tmp_path / "model", None, save_method="merged_16bit", progress=False)  # a Path
    first = os.path.getmtime(os.path.join(out, "config.json"))
    report = model.save_pretrained_merged(out, None, save_method="merged_16bit", progress=False)  # re-run the cell
    assert report.lora_modules_merged == 14 and os.path.getmtime(os.path.join(out, "config.json")) >= first
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as caught:  # the same folder, another method
        warnings.simplefilter("always")
        model.save_pretrained_merged(out, None, save_method="merged_4bit_forced", progress=False)
    assert len([w for w in caught if "re-quantizes" in str(w.message)]) == 1
    assert "re-quantizes" not in caplog.text  # once, as a warning, not again as a log record
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["quantization_config"]["load_in_4bit"] is True
    model.save_pretrained_merged(out, None, save_method="lora")
    model.save_pretrained_merged(out, None, save_method="lora")  # re-run
    assert sorted(os.listdir(out)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    with pytest.raises(InputError, match="holds an adapter .* a merged save does not replace it"):
        model.save_pretrained_merged(out, None, save_method="merged_16bit", progress=False)  # it may be an input

    with pytest.raises(InputError, match=r"save_method='mxfp4' .* use save_method='merged_16bit'"):
        model.save_pretrained_merged(str(tmp_path / "x"), None, save_method="mxfp4")
    busy = tmp_path / "trainer-output"
    busy.mkdir()
    (busy / "training_args.bin").write_bytes(b"x")
    with pytest.raises(InputError, match=r"is not an earlier save \(it holds training_args.bin\)"):
        model.save_pretrained_merged(str(busy), None, progress=False)
    with pytest.raises(InputError, match=r"is the model folder"):
        save_pretrained_merged(model, bf16_base, None, progress=False)
    assert not (tmp_path / "x").exists() and os.listdir(busy) == ["training_args.bin"]


# --- PEFT's merge_and_unload ----------------------------------------------------------------------------------


def test_merge_and_unload_takes_peft_parameters(bf16_base, tmp_path):
    model = peft_qlora(bf16_base)
    ids = token_ids(512, seed=3)
    ref = reference_logits(model, ids)
    plain = merge_and_unload(model, progressbar=True, safe_merge=True, adapter_names=["default"], dtype="float32")
    assert not any(type(m).__module__.startswith(("peft.", "bitsandbytes.")) for m in plain.modules())
    with torch.no_grad():
        assert rel_err(plain(input_ids=ids).logits, ref) < 1e-5


def test_merge_and_unload_on_a_model_without_adapter_raises_and_leaves_it_clean(bf16_base):
    model = AutoModelForCausalLM.from_pretrained(bf16_base)
    with pytest.raises(ValueError, match="has no LoRA adapter"):
        merge_and_unload(model)
    assert not hasattr(model, "peft_config")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_peft_model(model, LoraConfig(target_modules=["q_proj"]))
    assert not [w for w in caught if "peft_config" in str(w.message)]


@pytest.mark.parametrize("how", ["from_pretrained", "dispatch_model"])
def test_merge_and_unload_on_an_offloaded_model_keeps_it_offloaded(bf16_base, tmp_path, how):
    """merge_and_unload on a model accelerate offloads to disk: each offloaded layer is merged in its turn and stays
    offloaded (its merged weights in a new folder inside the offload folder, the checkpoint it was loaded from left
    alone); the logits are PEFT's merge of a non-offloaded copy, and save_pretrained writes them.

    from_pretrained(device_map=...) is the issue's recipe: embeddings and head on disk, LoRA on the layers in
    memory. PEFT cannot attach LoRA to a layer that is offloaded already (its factors stay on the meta device with
    no weights): that is refused with the model unchanged. accelerate's dispatch_model of a PeftModel offloads the
    LoRA layers of layer 0 themselves (base weights and factors)."""
    import copy
    import hashlib
    from pathlib import Path

    from accelerate import dispatch_model
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from peft_shardmerge.model.walk import offloaded_modules

    def digest(folder):
        return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))}

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(bf16_base, dtype=torch.float32), config)
    ids = token_ids(512, seed=3)
    with torch.no_grad():
        unmerged = ref(input_ids=ids).logits
    base_files = digest(Path(bf16_base))
    offload = tmp_path / "offload"
    on_disk = {
        "model.embed_tokens": "disk",
        "model.layers.0": "cpu",
        "model.layers.1": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "disk",
    }
    if how == "from_pretrained":
        load = dict(dtype=torch.float32, offload_folder=str(offload))
        broken = get_peft_model(
            AutoModelForCausalLM.from_pretrained(bf16_base, device_map={**on_disk, "model.layers.0": "disk"}, **load),
            copy.deepcopy(config),
        )
        kinds = [type(m) for m in broken.modules()]
        with pytest.raises(
            InputError,
            match=r"model\.layers\.0\.self_attn\.q_proj: the LoRA factors of default are "
            r"on the meta device with no weights",
        ):
            merge_and_unload(broken)
        assert kinds == [type(m) for m in broken.modules()]
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(bf16_base, device_map=on_disk, **load), copy.deepcopy(config)
        )
        set_peft_model_state_dict(model, get_peft_model_state_dict(ref))
    else:
        device_map = {f"base_model.model.{k}": v for k, v in {**on_disk, "model.layers.0": "disk"}.items()}
        model = dispatch_model(copy.deepcopy(ref), device_map=device_map, offload_dir=str(offload))
    assert model.base_model.model.lm_head.weight.is_meta
    if how == "dispatch_model":  # merge_and_save reads the offloaded LoRA factors too (not the original checkpoint)
        report = merge_and_save(model, str(tmp_path / "saved-first"), dtype="float32", progress=False)
        assert "offloaded by accelerate" in report.notes[0]
        assert float((logits_of(str(tmp_path / "saved-first"), ids) - unmerged).abs().max()) < 1e-4
        assert digest(Path(bf16_base)) == base_files
    merged = merge_and_unload(model, dtype="float32")
    peft_merged = ref.merge_and_unload()
    assert not any(type(m).__module__.startswith("peft.") for m in merged.modules())
    assert "lm_head" in offloaded_modules(merged) and merged.lm_head.weight.is_meta
    if how == "dispatch_model":  # a merged layer that stays offloaded, its weights in the offload folder
        assert merged.model.layers[0].self_attn.q_proj.weight.is_meta
        assert [f for f in os.listdir(offload) if f.startswith("merged-")]
    assert digest(Path(bf16_base)) == base_files
    with torch.no_grad():
        got = merged(input_ids=ids).logits
        want = peft_merged(input_ids=ids).logits
    assert float((got - want).abs().max()) < 1e-5
    assert float((got - unmerged).abs().max()) < 1e-4
    merged.save_pretrained(str(tmp_path / "saved"))
    assert float((logits_of(str(tmp_path / "saved"), ids) - got).abs().max()) < 1e-6


# --- messages -------------------------------------------------------------------------------------------------


def test_every_problem_at_once_in_python(bf16_base, tmp_path):
    model = peft_qlora(bf16_base)
    with pytest.raises(InputError) as e:
        merge_and_save(
            model,
            str(tmp_path / "m"),
            dtype="int3",
            max_shard_size="huge",
            base_precision="best",
            maximum_memory_usage=2.0,
            progress=False,
        )
    assert len(e.value.problems) == 4, e.value.problems
    assert not any("--" in p for p in e.value.problems)  # Python callers are not told about CLI flags
    assert not (tmp_path / "m").exists()


def test_merge_report_repr_is_short(bf16_base, tmp_path):
    model = peft_qlora(bf16_base)
    report = save_pretrained_merged(model, str(tmp_path / "m"), max_shard_size="200KB", progress=False)
    assert len(repr(report)) < 200 and repr(report).startswith("MergeReport(out_dir=")


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )


@pytest.mark.slow
def test_cli_summary_once_quiet_dtype_aliases_and_bare_help(tmp_path):
    base = build_base(str(tmp_path / "base"), "llama")
    from peft_shardmerge.testing import build_adapter

    adapter = build_adapter(base, str(tmp_path / "adapter"), arch="llama")
    r = _cli("merge", base, adapter, str(tmp_path / "a"), "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("LoRA modules merged 14/14") == 1 and "LoRA modules merged" not in r.stderr
    assert "reproduces the original base + adapter: the trained model for an adapter trained on this base" in r.stdout
    assert json.load(open(tmp_path / "a" / "config.json"))["dtype"] == "bfloat16"
    r = _cli("merge", base, adapter, str(tmp_path / "b"), "-q")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""
    r = _cli()
    assert r.returncode == 0 and r.stdout.startswith("usage: peft-shardmerge") and "merge" in r.stdout


def test_help_does_not_import_torch():
    """`peft-shardmerge --help` took 2.3 s importing torch, transformers and peft; it now imports none."""
    code = (
        "import sys, peft_shardmerge.api.cli as c, peft_shardmerge as p; print(sorted({'torch', 'transformers', "
        "'peft'} & set(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


# --- adding chat tokens ---------------------------------------------------------------------------------------


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", pad_token="w1", eos_token="w2")


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["4bit", "none"])
def test_adding_chat_tokens_merges_on_every_path(quant, tmp_path):
    """add_special_tokens, resize_token_embeddings, modules_to_save=["embed_tokens", "lm_head"], train, merge."""
    base = build_base(str(tmp_path / "base"), "llama")
    tokenizer = _word_tokenizer()
    load = {"quantization_config": BitsAndBytesConfig(**NF4)} if quant == "4bit" else {}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **load)
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    model.resize_token_embeddings(len(tokenizer))
    model = get_peft_model(
        model,
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"]
        ),
    )
    train_one_step(model, len(tokenizer))
    ids = torch.cat([token_ids(512, batch=2, length=8, seed=3), torch.tensor([[512, 513]] * 2)], dim=1)
    ref = reference_logits(model, ids)
    outs = {
        "default": merge_and_save(
            model, str(tmp_path / "default"), tokenizer=tokenizer, dtype="float32", progress=False
        )
    }
    if quant == "none":
        outs["original"] = merge_and_save(
            model, str(tmp_path / "original"), dtype="float32", base_precision="original", progress=False
        )
    for name, report in outs.items():
        assert report.replacements_applied >= 2, name
        got = logits_of(str(tmp_path / name), ids)
        assert got.shape[-1] == 514 and rel_err(got, ref) < 1e-5, name
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "default"))) == 514

    # PEFT 0.21: X.weight, X.modules_to_save.weight, X.original_module.weight
    model.save_pretrained(str(tmp_path / "adapter"))
    r = _cli("merge", base, str(tmp_path / "adapter"), str(tmp_path / "cli"), "--dtype", "float32", "-q")
    assert r.returncode == 0, r.stderr
    assert json.load(open(tmp_path / "cli" / "config.json"))["vocab_size"] == 514
    if quant == "none":  # from disk the base is the original one: the same model as the unquantized one trained
        assert rel_err(logits_of(str(tmp_path / "cli"), ids), ref) < 1e-5


# --- pushing to the Hub ---------------------------------------------------------------------------------------


@pytest.fixture
def no_temp_left(tmp_path, monkeypatch):
    """Temporary folders go under a folder of the test's, so that a test can tell whether a merge started."""
    import tempfile

    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_push_checks_offline_mode_and_hub_access_before_merging(bf16_base, tmp_path, monkeypatch, no_temp_left):
    import huggingface_hub.constants as hc

    from peft_shardmerge import push_to_hub_merged
    from peft_shardmerge.errors import HubUploadError

    model = peft_qlora(bf16_base)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with pytest.raises(InputError, match="offline mode \\(HF_HUB_OFFLINE=1\\)"):
        push_to_hub_merged(model, "me/tiny", token="hf_secret")
    with pytest.raises(InputError, match="offline mode"):
        save_pretrained_merged(model, "me/tiny", push_to_hub=True, token="hf_secret")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(HubUploadError, match="nothing was merged") as e:
        push_to_hub_merged(model, "me/tiny", token="hf_secret")
    assert "hf_secret" not in str(e.value) and "peft-shardmerge-push-" not in str(e.value)
    assert os.listdir(no_temp_left) == [] and not os.path.exists("me")


def test_push_to_a_bare_repository_name_with_a_clean_model_card(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc
    from hub_server import FakeHub
    from huggingface_hub import ModelCard

    from peft_shardmerge import push_to_hub_merged

    cache = _hub_cache(tmp_path, {"v1": build_base(str(tmp_path / "v1"), "llama")}, main="v1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", cache)
    model = AutoModelForCausalLM.from_pretrained("org/tiny", cache_dir=cache, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    with FakeHub() as hub:
        monkeypatch.setattr(hc, "ENDPOINT", hub.url)
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        url = push_to_hub_merged(model, "tiny-merged", token="hf_secret", progress=False)  # no namespace
        assert "/user/tiny-merged/commit/" in url
        card = hub.files["user/tiny-merged"]["README.md"].decode()
    data = ModelCard(card).data.to_dict()
    assert data["base_model"] == "org/tiny" and data["base_model_relation"] == "finetune"
    assert data["library_name"] == "transformers" and "merged-lora" in data["tags"]
    assert str(tmp_path) not in card and "/tmp" not in card
    assert "| target modules | down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj |" in card
    assert "model.layers.0" not in card
    from peft_shardmerge import __version__

    assert "pypi.org" not in card and f"by peft-shardmerge {__version__}. It loads with" in card  # no dead link


def test_the_model_card_links_the_repository_the_package_names(monkeypatch):
    import importlib.metadata as md
    from email.message import Message

    from peft_shardmerge.api.hub import project_link

    meta = Message()
    meta["Project-URL"] = "Documentation, https://docs.example/peft-shardmerge"
    meta["Project-URL"] = "Repository, https://git.example/peft-shardmerge"
    monkeypatch.setattr(md, "metadata", lambda name: meta)
    from peft_shardmerge import __version__

    assert project_link() == f"[peft-shardmerge {__version__}](https://git.example/peft-shardmerge)"
    monkeypatch.setattr(md, "metadata", lambda name: Message())
    assert project_link() == f"peft-shardmerge {__version__}"


def test_a_pre_quantized_base_says_what_is_wrong_with_it(tmp_path):
    """Unsloth's and TRL's examples often load an '-bnb-4bit' checkpoint: the reason names it, not a header line."""
    base = build_base(str(tmp_path / "tiny"), "llama")
    AutoModelForCausalLM.from_pretrained(
        base, quantization_config=BitsAndBytesConfig(**NF4), dtype=torch.float32
    ).save_pretrained(str(tmp_path / "tiny-bnb-4bit"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tiny-bnb-4bit"), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights=False))
    with pytest.raises(
        InputError,
        match=r"cannot be used: the checkpoint the model was loaded from cannot be merged "
        r"into from disk \(.*tiny-bnb-4bit: it is itself stored quantized "
        r"\(bitsandbytes 4-bit",
    ):
        merge_and_save(model, str(tmp_path / "o"), base_precision="original", progress=False)
    report = merge_and_save(model, str(tmp_path / "m"), progress=False)
    assert report.base_precision == "dequantized" and "is itself stored quantized" in report.notes[0]
    assert "problem found before writing anything" not in report.notes[0]


def test_in_process_merges_write_the_base_config_with_only_the_needed_changes(bf16_base, tmp_path):
    """TRL sets use_cache=False for training; the merged config.json must not carry that, nor a local path."""
    model = peft_qlora(bf16_base)
    model.config.use_cache = False
    merge_and_save(model, str(tmp_path / "m"), progress=False)
    disk = json.load(open(os.path.join(bf16_base, "config.json")))
    written = json.load(open(tmp_path / "m" / "config.json"))
    assert written == {**disk, "dtype": "bfloat16"}


def test_an_adapter_with_no_update_is_not_said_to_be_swallowed(bf16_base, tmp_path, caplog):
    """get_peft_model's default init (B = 0), saved before training: nothing to keep, so nothing is lost."""
    from peft_shardmerge import merge_checkpoint

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(bf16_base), LoraConfig(target_modules=["q_proj"]))
    caplog.set_level(logging.WARNING)
    report = merge_and_save(model, str(tmp_path / "m"), base_precision="dequantized", progress=False)
    model.save_pretrained(str(tmp_path / "adapter"))
    disk = merge_checkpoint(bf16_base, str(tmp_path / "adapter"), str(tmp_path / "d"), progress=False)
    for r in (report, disk):
        assert not any("swallowed" in n for n in r.notes) and not any("kept the LoRA update" in n for n in r.notes)
    assert "swallowed" not in caplog.text


def test_a_mismatched_adapter_among_several_is_named_once_per_module_kind(tmp_path):
    from peft_shardmerge import merge_checkpoint
    from peft_shardmerge.testing import build_adapter

    good_base = build_base(str(tmp_path / "base"), "llama")
    wide_base = build_base(str(tmp_path / "wide"), "llama", intermediate_size=512)
    good = build_adapter(good_base, str(tmp_path / "good"), arch="llama")
    wrong = build_adapter(wide_base, str(tmp_path / "wrong"), arch="llama")
    with pytest.raises(InputError) as e:
        merge_checkpoint(good_base, [good, wrong], str(tmp_path / "m"), progress=False)
    shapes = [p for p in e.value.problems if "gives a delta" in p]
    assert len(shapes) == 3  # gate, up, down: one line each, not one per layer
    assert all(
        p.startswith(f"adapter {wrong}: LoRA module 'model.layers.*.mlp.") and "(2 layers)" in p for p in shapes
    )
    assert not any(good + ":" in p or f"in {good} " in p for p in e.value.problems)


def test_a_missing_hub_id_names_the_hf_command(tmp_path):
    from peft_shardmerge import NotFoundError, merge_checkpoint

    with pytest.raises(NotFoundError, match=r"download it first \(hf download org/not-cached\)") as e:
        merge_checkpoint("org/not-cached", str(tmp_path), str(tmp_path / "m"), progress=False)
    assert "huggingface-cli" not in str(e.value)
