"""The allowlist: what is claimed is merged equal to PEFT on every API, everything else is refused by name on every
API before anything is written or any module replaced."""

from __future__ import annotations

import os
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from peft_shardmerge import InputError, UnsupportedError, merge_and_save, merge_checkpoint, save_pretrained_merged
from peft_shardmerge.api.unload import merge_and_unload
from peft_shardmerge.support.claims import CLAIMS, PEFT_TYPES, is_claimed, layer_kind, support_table
from peft_shardmerge.testing import perturb_trainable, token_ids
from tests.helpers import ROOT_DIR, logits_of, rel_err

ROOT = ROOT_DIR


def _peft(base: str, config, *, perturb: bool = True):
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    if perturb:
        perturb_trainable(model, 0.05)
    return model.eval()


def _every_path_refuses(base: str, config, tmp_path, error, match: str) -> None:
    """merge_and_save (both base precisions), merge_and_unload and merge_checkpoint all refuse, write nothing and
    leave the model as it was."""
    model = _peft(base, config)
    adapter = str(tmp_path / "adapter")
    model.save_pretrained(adapter)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for precision in ("auto", "dequantized"):
        with pytest.raises(error, match=match):
            merge_and_save(model, str(tmp_path / f"live-{precision}"), base_precision=precision, progress=False)
        assert not os.path.exists(tmp_path / f"live-{precision}")
    for method in ("merged_16bit", "merged_4bit"):  # the drop-ins
        with pytest.raises(error, match=match):
            save_pretrained_merged(model, str(tmp_path / method), save_method=method, progress=False)
        assert not os.path.exists(tmp_path / method)
    with pytest.raises(error, match=match):
        merge_and_unload(model)
    with pytest.raises(error, match=match):
        merge_checkpoint(base, adapter, str(tmp_path / "disk"), progress=False)
    assert not os.path.exists(tmp_path / "disk")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# --- the allowlist as data, and the documents generated from it ---


def test_allowlist_is_data_and_names_types_layers_variants_paths():
    assert {"LORA", "LOHA", "LOKR", "VERA", "IA3", "TRAINABLE_TOKENS"} == set(PEFT_TYPES)
    assert all(len(c) == 4 and c[3] in ("disk", "in_process") for c in CLAIMS)
    assert is_claimed("LORA", "Conv1D", "DoRA", "disk") and is_claimed("LORA", "Linear4bit", "DoRA", "in_process")
    assert not is_claimed("LORA", "Linear4bit", "plain", "disk")  # a 4-bit layer exists only in memory
    assert not is_claimed("LORA", "parameter 2-D", "DoRA", "in_process")
    assert not is_claimed("LORA", "MultiheadAttention") and not is_claimed("LORA", "Conv2d (groups=2)")
    assert not is_claimed("OFT", "Linear") and not is_claimed("ADALORA", "Linear")


def test_readme_and_docs_tables_are_the_allowlist():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert support_table() in readme
    pages = sorted({re.search(r"docs/([\w-]+\.md)", row).group(1) for row in support_table().splitlines()[2:]})
    assert pages == [
        "variants-layers.md",
        "variants-other-peft.md",
        "variants-several-adapters.md",
        "variants-vocabulary.md",
    ]
    for page in pages:
        text = open(os.path.join(ROOT, "docs", page), encoding="utf-8").read()
        assert support_table(page) in text, page


@pytest.mark.parametrize(
    "module,kind",
    [
        (nn.Linear(4, 4), "Linear"),
        (nn.Embedding(4, 4), "Embedding"),
        (nn.Conv2d(4, 4, 3), "Conv2d"),
        (nn.Conv2d(4, 4, 3, groups=2), "Conv2d (groups=2)"),
        (nn.Conv3d(2, 2, 1), "Conv3d"),
        (nn.MultiheadAttention(8, 2), "MultiheadAttention"),
        (nn.Conv1d(4, 4, 3), "Conv1d"),
    ],
)
def test_layer_kinds(module, kind):
    assert layer_kind(module) == kind


# --- silently wrong once: now equal to PEFT on every path ---


def test_lora_on_a_2d_parameter_matches_peft_on_every_path(make_base, tmp_path):
    """target_parameters on 2-D weights (non-square up_proj): PEFT's delta B @ A in the weight's own layout."""
    base = make_base("llama")
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=[],
        init_lora_weights=False,
        target_parameters=["self_attn.q_proj.weight", "mlp.up_proj.weight"],
    )
    model = _peft(base, config)
    ids = token_ids(model.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    assert rel_err(plain, ref) > 1e-3  # the adapter changes the outputs
    adapter = str(tmp_path / "adapter")
    model.save_pretrained(adapter)
    outs = {"disk": merge_checkpoint(base, adapter, str(tmp_path / "disk"), progress=False, chunk_elems=64)}
    for precision in ("auto", "dequantized"):
        outs[precision] = merge_and_save(
            model, str(tmp_path / precision), base_precision=precision, dtype="float32", progress=False
        )
    assert outs["auto"].base_precision == "original"
    peft_state = _peft(base, config).merge_and_unload().state_dict()
    up = "model.layers.0.mlp.up_proj.weight"
    assert peft_state[up].shape[0] != peft_state[up].shape[1]
    for name in ("disk", "auto", "dequantized"):
        got = load_file(str(tmp_path / name / "model.safetensors"))
        for key in (up, "model.layers.1.self_attn.q_proj.weight"):
            torch.testing.assert_close(got[key], peft_state[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert rel_err(logits_of(str(tmp_path / name), ids), ref) < 1e-5, name
    unloaded = merge_and_unload(model, dtype="float32")
    with torch.no_grad():
        assert rel_err(unloaded(input_ids=ids).logits, ref) < 1e-5


# --- refused by name on every path ---


def test_lora_bias_on_a_layer_without_bias_is_refused_everywhere(make_base, tmp_path):
    config = LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True, init_lora_weights=False)
    _every_path_refuses(
        make_base("llama"),
        config,
        tmp_path,
        UnsupportedError,
        r"lora_bias=True on a layer whose "
        r"base has no bias.*q_proj|q_proj.*lora_bias=True on a layer whose base has no bias",
    )


def test_activated_lora_is_refused_everywhere(make_base, tmp_path):
    config = LoraConfig(
        r=4,
        target_modules=["q_proj", "v_proj"],
        alora_invocation_tokens=[5, 6],
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    _every_path_refuses(
        make_base("llama"),
        config,
        tmp_path,
        UnsupportedError,
        r"activated LoRA \(alora_invocation_tokens\).*not the aLoRA model",
    )


def _other_types():
    import peft

    return {
        "OFT": lambda: peft.OFTConfig(r=4, oft_block_size=0, target_modules=["q_proj"]),
        "HRA": lambda: peft.HRAConfig(r=4, target_modules=["q_proj"]),
        "BOFT": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj"]),
        "ADALORA": lambda: peft.AdaLoraConfig(r=4, target_modules=["q_proj"], total_step=10),
        "LN_TUNING": lambda: peft.LNTuningConfig(target_modules=["input_layernorm"]),
        "MISS": lambda: peft.MissConfig(r=4, target_modules=["q_proj"]),
        "PROMPT_TUNING": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    }


@pytest.mark.parametrize("peft_type", sorted(_other_types()))
def test_unclaimed_peft_types_are_refused_by_name_everywhere(peft_type, make_base, tmp_path):
    _every_path_refuses(
        make_base("llama"),
        _other_types()[peft_type](),
        tmp_path,
        UnsupportedError,
        rf"peft_type='{peft_type}'; the (disk engine|in-process merge) merges LORA, ",
    )


def test_nan_adapter_is_refused_before_the_model_changes(make_base, tmp_path):
    model = _peft(make_base("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        model.base_model.model.model.layers[1].self_attn.v_proj.lora_B["default"].weight[0, 0] = float("nan")
    for call in (
        lambda: merge_and_unload(model),
        lambda: merge_and_save(model, str(tmp_path / "o"), progress=False, base_precision="dequantized"),
    ):
        with pytest.raises(InputError, match=r"NaN or Inf: .*layers\.1\.self_attn\.v_proj\.lora_B"):
            call()
    from peft.tuners.lora import LoraLayer

    assert sum(isinstance(m, LoraLayer) for m in model.modules()) == 4  # nothing was replaced


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.conv = nn.Conv2d(4, 4, 3, groups=2)
        self.attn = nn.MultiheadAttention(8, 2)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("targets", [["lin"], ["conv"], ["attn"]])
def test_a_plain_torch_module_is_refused_not_crashed(targets, tmp_path):
    model = get_peft_model(_Plain(), LoraConfig(r=2, target_modules=targets))
    for call in (
        lambda: merge_and_unload(model),
        lambda: merge_and_save(model, str(tmp_path / "o"), progress=False),
        lambda: save_pretrained_merged(model, str(tmp_path / "o"), save_method="merged_4bit"),
    ):
        with pytest.raises(UnsupportedError, match=r"wraps a plain torch module \(_Plain\), not a transformers model"):
            call()


@pytest.mark.parametrize(
    "kind,path,message",
    [
        ("MultiheadAttention", "in_process", r"m: LORA on a MultiheadAttention layer is not supported \(supported: "),
        ("Conv2d (groups=2)", "disk", r"m: LORA on a Conv2d \(groups=2\) layer is not supported"),
        ("Linear4bit", "disk", r"m: LORA plain on Linear4bit is supported only in process"),
    ],
)
def test_layer_refusals_name_the_layer_and_the_fix(kind, path, message):
    from peft_shardmerge.support.claims import check_layers

    problems = check_layers([("m", "LORA", kind, [])], path=path)
    assert len(problems) == 1 and re.match(message, problems[0]), problems


# --- merge_and_unload returns a plain transformers model that saves and reloads as it computes ---


def _no_peft_modules(model) -> None:
    left = [n for n, m in model.named_modules() if type(m).__module__.startswith("peft.")]
    assert not left, left


def test_tokens_on_a_tied_model_unload_leaves_no_wrapper(make_base, tmp_path):
    """LoRA + trainable_token_indices on Qwen2 (tied head): the head's TrainableTokensWrapper is gone, the head is
    the merged embedding again, and save_pretrained / from_pretrained give the same model."""
    model = _peft(
        make_base("qwen2"),
        LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[3, 9], init_lora_weights=False),
    )
    ids = token_ids(model.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    plain = merge_and_unload(model, dtype="float32")
    _no_peft_modules(plain)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight and plain.config.tie_word_embeddings
    with torch.no_grad():
        assert rel_err(plain(input_ids=ids).logits, ref) < 1e-5
    plain.save_pretrained(str(tmp_path / "saved"))
    assert rel_err(logits_of(str(tmp_path / "saved"), ids), ref) < 1e-5


def test_lora_on_t5_shared_and_lm_head_survives_save_pretrained(tmp_path):
    """T5 ties encoder/decoder embed_tokens and lm_head to shared; LoRA on shared changes none of its partners in
    PEFT's model. Every tied tensor is saved apart so that from_pretrained gives back the same model."""
    from transformers import AutoModelForSeq2SeqLM

    from peft_shardmerge.testing import build_base, model_inputs

    base = build_base(str(tmp_path / "base"), "t5")
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForSeq2SeqLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=4, target_modules=["shared", "lm_head", "q"], init_lora_weights=False),
    )
    perturb_trainable(model, 0.05)
    model.eval()
    inputs = model_inputs(model.config)
    with torch.no_grad():
        ref = model(**inputs).logits
    model.save_pretrained(str(tmp_path / "adapter"))
    merge_checkpoint(base, str(tmp_path / "adapter"), str(tmp_path / "disk"), progress=False)
    merge_and_save(model, str(tmp_path / "live"), base_precision="dequantized", dtype="float32", progress=False)
    plain = merge_and_unload(model, dtype="float32")
    _no_peft_modules(plain)
    plain.save_pretrained(str(tmp_path / "unloaded"))
    for out in ("disk", "live", "unloaded"):
        reloaded = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / out), dtype=torch.float32).eval()
        with torch.no_grad():
            assert rel_err(reloaded(**inputs).logits, ref) < 1e-5, out


def test_unloading_a_4bit_model_gives_a_plain_model(make_base, tmp_path):
    """No quantization left: .to(dtype), .half(), .float() work and the saved folder reloads unquantized."""
    pytest.importorskip("bitsandbytes")
    from tests.integration.test_inprocess import load_quantized, no_cpu_repack, reference_logits

    model = load_quantized(make_base("llama"), "nf4")
    no_cpu_repack(model)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "up_proj"], init_lora_weights=False))
    ids = token_ids(model.config.vocab_size, seed=3)
    ref = reference_logits(model.eval(), ids)
    plain = merge_and_unload(model, dtype="float32")
    assert not getattr(plain, "is_quantized", False) and getattr(plain, "hf_quantizer", None) is None
    assert getattr(plain, "quantization_method", None) is None
    assert getattr(plain.config, "quantization_config", None) is None
    with torch.no_grad():
        assert rel_err(plain(input_ids=ids).logits, ref) < 1e-4
    plain.save_pretrained(str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert getattr(reloaded.config, "quantization_config", None) is None
    assert not getattr(reloaded, "is_quantized", False)
    assert rel_err(logits_of(str(tmp_path / "saved"), ids), ref) < 1e-4
    plain.half()
    plain.float()
    plain.to(torch.float16)
    assert plain.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16


def test_every_field_of_the_claimed_peft_configs_is_classified():
    """A PEFT upgrade that adds a config field fails here until the field is handled, marked inert or refused."""
    import dataclasses

    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    from peft_shardmerge.support import allowlist

    for peft_type in PEFT_TYPES:
        fields = {f.name for f in dataclasses.fields(PEFT_TYPE_TO_CONFIG_MAPPING[peft_type])}
        known = allowlist.HANDLED[peft_type] | allowlist.INERT | set(allowlist.REFUSED)
        assert fields <= known, (peft_type, sorted(fields - known))


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(use_qalora=True), r"QA-LoRA"),
        (dict(layer_replication=[[0, 1]]), r"layer_replication"),
        (dict(ensure_weight_tying=True), r"ensure_weight_tying"),
        (dict(init_lora_weights="mica"), r"'mica' is not sup"),
        (dict(use_bdlora={"nblocks": 2}), r"block-diagonal"),
        (dict(megatron_config={"a": 1}), r"Megatron"),
    ],
)
def test_config_options_that_change_the_forward_are_refused_on_both_paths(options, message):
    from peft_shardmerge.support.claims import check_config

    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **options}
    for path in ("disk", "in_process"):
        problems = check_config(config, where="adapter a", path=path)
        assert len(problems) == 1 and re.search(message, problems[0]), problems


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_prompt_learning_is_refused_by_name_on_any_architecture(arch, make_base, tmp_path):
    """Prompt-learning PeftModels have no tuner between them and the transformers model (GPT-2 has no '.model')."""
    import peft

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(make_base(arch)),
        peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    )
    for call in (lambda: merge_and_unload(model), lambda: merge_and_save(model, str(tmp_path / "o"), progress=False)):
        with pytest.raises(UnsupportedError, match=r"peft_type=.PREFIX_TUNING.*It has no weight delta"):
            call()


def refused_on_every_path(base: str, model, message: str, tmp_path) -> None:
    """The adapter saved in ``tmp_path/adapter`` is refused by name from disk, by merge_and_unload and by
    merge_and_save, and nothing is written."""
    with pytest.raises(UnsupportedError, match=message):
        merge_checkpoint(base, str(tmp_path / "adapter"), str(tmp_path / "disk"), progress=False)
    for call in (
        lambda: merge_and_unload(model),
        lambda: merge_and_save(model, str(tmp_path / "o"), base_precision="dequantized", progress=False),
    ):
        with pytest.raises(UnsupportedError, match=message):
            call()
    assert not os.path.exists(tmp_path / "disk") and not os.path.exists(tmp_path / "o")


def test_lora_on_a_grouped_convolution_is_refused_on_every_path(tmp_path):
    """ConvNeXt's depthwise convolutions (groups = channels): PEFT cannot merge LoRA on them; neither do we."""
    from transformers import AutoModelForImageClassification, ConvNextConfig

    config = ConvNextConfig(
        num_channels=3,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
        num_labels=2,
        architectures=["ConvNextForImageClassification"],
    )
    torch.manual_seed(0)
    base = str(tmp_path / "base")
    AutoModelForImageClassification.from_config(config).save_pretrained(base)
    model = get_peft_model(
        AutoModelForImageClassification.from_pretrained(base),
        LoraConfig(r=16, target_modules=["dwconv"], init_lora_weights=False),
    )
    model.save_pretrained(str(tmp_path / "adapter"))
    message = r"LORA on a Conv2d \(groups=(8|16)\) layer is not supported"
    refused_on_every_path(base, model, message, tmp_path)


def test_lora_on_multihead_attention_is_refused_on_every_path(tmp_path):
    """SigLIP's pooling head is an nn.MultiheadAttention: refused by name, from disk and in process."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
        architectures=["SiglipVisionModel"],
    )
    torch.manual_seed(0)
    base = str(tmp_path / "base")
    SiglipVisionModel(config).save_pretrained(base)
    model = get_peft_model(
        SiglipVisionModel.from_pretrained(base),
        LoraConfig(r=4, target_modules=["head.attention"], init_lora_weights=False),
    )
    assert any(layer_kind(m) == "MultiheadAttention" for m in model.modules())
    model.save_pretrained(str(tmp_path / "adapter"))
    message = r"head\.attention: LORA on a MultiheadAttention layer is not supported"
    refused_on_every_path(base, model, message, tmp_path)
