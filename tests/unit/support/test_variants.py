"""Adapter variants on both paths (disk engine and in-process), each checked against PEFT's own computation."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from peft_shardmerge import InputError, merge_checkpoint
from peft_shardmerge.api.inprocess import merge_and_save
from peft_shardmerge.testing import build_adapter, perturb_trainable, token_ids
from tests.helpers import logits_of, rel_err


@pytest.fixture(scope="module")
def two_adapters(make_base, tmp_path_factory):
    """Two adapters on the tiny Llama: equal ranks (for 'linear') and a third of another rank."""
    base = make_base("llama")
    root = tmp_path_factory.mktemp("weighted")
    a = build_adapter(base, str(root / "a"), seed=1, r=8, lora_alpha=16)
    b = build_adapter(base, str(root / "b"), seed=2, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    c = build_adapter(base, str(root / "c"), seed=3, r=4, lora_alpha=4, use_rslora=True)
    return base, a, b, c


def peft_weighted(base: str, folders: list[str], weights: list[float], combination: str):
    """Logits and merged state of PEFT's add_weighted_adapter combination, the reference."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, folders[0], adapter_name="a0")
    for i, f in enumerate(folders[1:], 1):
        peft_model.load_adapter(f, adapter_name=f"a{i}")
    names = [f"a{i}" for i in range(len(folders))]
    peft_model.add_weighted_adapter(names, weights, "mix", combination_type=combination)
    peft_model.set_adapter("mix")
    ids = token_ids(model.config.vocab_size, seed=3)
    with torch.no_grad():
        logits = peft_model.eval()(input_ids=ids).logits
    return peft_model, logits, ids


CASES = [("cat", ("a", "b", "c"), [0.7, -0.3, 1.5]), ("linear", ("a", "b"), [0.6, 0.4]), ("cat", ("a",), [0.5])]


@pytest.mark.parametrize("combination,which,weights", CASES, ids=["cat3", "linear2", "cat1"])
def test_weighted_adapters_on_disk_match_add_weighted_adapter(combination, which, weights, two_adapters, tmp_path):
    base, *folders = two_adapters
    chosen = [dict(zip("abc", folders))[k] for k in which]
    _, ref, ids = peft_weighted(base, chosen, weights, combination)
    out = str(tmp_path / "m")
    report = merge_checkpoint(base, chosen, out, weights=weights, combination=combination, progress=False)
    assert rel_err(logits_of(out, ids), ref) < 1e-5
    assert report.self_check_max_rel_err < 1e-5


def test_cat_is_the_weighted_sum_of_merges(two_adapters, tmp_path):
    """'cat' is exactly sum_i w_i * dW_i: compare the merged weights with the single-adapter merges."""
    from safetensors.torch import load_file

    base, a, b, _ = two_adapters
    merge_checkpoint(base, [a, b], str(tmp_path / "ab"), weights=[0.25, 2.0], progress=False)
    merge_checkpoint(base, a, str(tmp_path / "a"), progress=False)
    merge_checkpoint(base, b, str(tmp_path / "b"), progress=False)
    w0, wa, wb, wab = (
        load_file(f"{p}/model.safetensors") for p in (base, tmp_path / "a", tmp_path / "b", tmp_path / "ab")
    )
    for k in w0:
        want = w0[k] + 0.25 * (wa[k] - w0[k]) + 2.0 * (wb[k] - w0[k])
        assert torch.allclose(wab[k], want, atol=1e-6), k


@pytest.mark.parametrize("combination", ["cat", "linear"])
@pytest.mark.parametrize("base_precision", ["dequantized", "original"])
def test_weighted_adapters_in_process(combination, base_precision, two_adapters, tmp_path):
    base, a, b, _ = two_adapters
    peft_model, ref, ids = peft_weighted(base, [a, b], [0.6, 0.4], combination)
    peft_model.set_adapter("a0")  # the selection, not the active adapter, decides
    out = str(tmp_path / "m")
    report = merge_and_save(
        peft_model,
        out,
        adapter_names=["a0", "a1"],
        weights=[0.6, 0.4],
        combination_type=combination,
        base_precision=base_precision,
        dtype="float32",
        progress=False,
    )
    assert report.base_precision == base_precision
    assert rel_err(logits_of(out, ids), ref) < 1e-5


def test_weighted_merge_and_unload(two_adapters):
    from peft_shardmerge.api.unload import merge_and_unload

    base, a, b, _ = two_adapters
    peft_model, ref, ids = peft_weighted(base, [a, b], [1.0, -1.0], "cat")
    plain = merge_and_unload(peft_model, adapter_names=["a0", "a1"], weights=[1.0, -1.0], dtype="float32")
    with torch.no_grad():
        assert rel_err(plain(input_ids=ids).logits, ref) < 1e-5


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(weights=[1.0]), r"1 weight\(s\) given for 2 adapter\(s\)"),
        (dict(weights=[1.0, float("nan")]), "must be finite numbers"),
        (dict(combination="sum"), "combination must be one of cat, linear"),
    ],
)
def test_bad_weighted_options_on_disk(kwargs, message, two_adapters, tmp_path):
    base, a, b, _ = two_adapters
    with pytest.raises(InputError, match=message):
        merge_checkpoint(base, [a, b], str(tmp_path / "m"), progress=False, **kwargs)
    assert not (tmp_path / "m").exists()


def test_linear_needs_equal_ranks(two_adapters, tmp_path):
    base, a, _, c = two_adapters
    with pytest.raises(InputError, match=r"same rank, got \[4, 8\]; use 'cat'"):
        merge_checkpoint(base, [a, c], str(tmp_path / "m"), combination="linear", progress=False)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), a, adapter_name="a")
    model.load_adapter(c, adapter_name="c")
    with pytest.raises(InputError, match="needs adapters of equal rank"):
        merge_and_save(model, str(tmp_path / "m"), adapter_names=["a", "c"], combination_type="linear")
    with pytest.raises(InputError, match=r"must name loaded adapters; the model has \['a', 'c'\]"):
        merge_and_save(model, str(tmp_path / "m"), adapter_names=["a", "x"])
    assert not (tmp_path / "m").exists()


def test_cli_merges_several_adapters(two_adapters, tmp_path):
    from peft_shardmerge.api.cli import main

    base, a, b, _ = two_adapters
    _, ref, ids = peft_weighted(base, [a, b], [0.7, 0.3], "cat")
    out = str(tmp_path / "m")
    assert main(["merge", base, a, out, "--add-adapter", b, "--weights", "0.7", "0.3", "-q"]) == 0
    assert rel_err(logits_of(out, ids), ref) < 1e-5


TOKEN_CASES = {
    "llama-list": ("llama", dict(trainable_token_indices=[1, 5, 7])),
    "llama-dict": ("llama", dict(trainable_token_indices={"embed_tokens": [1, 5, 7], "lm_head": [2, 9]})),
    "qwen2-tied": ("qwen2", dict(trainable_token_indices=[1, 5, 7])),
    "qwen2-tied-lora-head": ("qwen2", dict(trainable_token_indices=[4, 8], target_modules=["q_proj", "lm_head"])),
}


@pytest.mark.parametrize("case", list(TOKEN_CASES))
def test_trainable_tokens(case, make_base, make_adapter, peft_reference, tmp_path):
    base_name, kwargs = TOKEN_CASES[case]
    base = make_base(base_name)
    adapter = make_adapter(base_name, f"tokens-{case}", **kwargs)
    state, ref, ids = peft_reference(base, adapter)
    out = str(tmp_path / "disk")
    report = merge_checkpoint(base, adapter, out, progress=False)
    assert rel_err(logits_of(out, ids), ref) < 1e-5
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    # PEFT's merge_and_unload leaves a token layer nested in a LoRA layer unmerged (its keys keep
    # 'token_adapter'); the unmerged logits above are the reference for those
    compared = [k for k in state if "token_adapter" not in k]
    assert "model.embed_tokens.weight" in compared
    for k in compared:
        assert torch.allclose(merged[k], state[k], atol=1e-6), k
    tied = base_name == "qwen2" and "lm_head" not in str(kwargs.get("target_modules"))
    assert ("tie_word_embeddings is set to false" in " ".join(report.notes)) == (base_name == "qwen2" and not tied)

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    for precision in ("dequantized", "original"):
        out = str(tmp_path / precision)
        merge_and_save(model, out, base_precision=precision, dtype="float32", progress=False)
        assert rel_err(logits_of(out, ids), ref) < 1e-5, precision


def test_standalone_trainable_tokens_adapter(make_base, tmp_path):
    from peft import TrainableTokensConfig, get_peft_model

    base = make_base("llama")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[3, 4, 11]),
    )
    perturb_trainable(model, 1.0)
    model.save_pretrained(str(tmp_path / "adapter"))
    ids = token_ids(model.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = model.eval()(input_ids=ids).logits
    merge_checkpoint(base, str(tmp_path / "adapter"), str(tmp_path / "disk"), progress=False)
    assert rel_err(logits_of(str(tmp_path / "disk"), ids), ref) < 1e-5
    merge_and_save(model, str(tmp_path / "live"), base_precision="dequantized", dtype="float32", progress=False)
    assert rel_err(logits_of(str(tmp_path / "live"), ids), ref) < 1e-5


def _other_configs():
    from peft import IA3Config, LoHaConfig, LoKrConfig, VeraConfig

    return {
        "loha": LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_weights=False),
        "lokr": LoKrConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_weights=False),
        "vera": VeraConfig(r=8, target_modules=["q_proj", "v_proj"], init_weights=False),
        "ia3": IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"], init_ia3_weights=False
        ),
    }


# PEFT's LoHa and LoKr layers do not run on bitsandbytes 4-bit bases; VeRA and IA3 do
@pytest.mark.parametrize(
    "kind,quant",
    [("loha", "none"), ("lokr", "none"), ("vera", "none"), ("ia3", "none"), ("vera", "nf4"), ("ia3", "nf4")],
)
def test_other_peft_types_in_process(kind, quant, make_base, tmp_path):
    """LoHa, LoKr, VeRA and IA3 merge through PEFT's own layers, in process and from disk."""
    from peft import get_peft_model

    from tests.integration.test_inprocess import load_quantized, no_cpu_repack, reference_logits

    base = make_base("llama")
    model = load_quantized(base, quant)
    no_cpu_repack(model)
    model = get_peft_model(model, _other_configs()[kind])
    if kind == "ia3":
        perturb_trainable(model)
    ids = token_ids(model.config.vocab_size, seed=3)
    ref = reference_logits(model.eval(), ids)
    with torch.no_grad(), model.disable_adapter():
        plain = model(input_ids=ids).logits
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, base_precision="dequantized", dtype="float32", progress=False)
    assert report.lora_modules_merged == report.lora_modules_total == (4 if kind == "vera" else 6)
    assert rel_err(logits_of(out, ids), ref) < 1e-5
    assert float((plain - ref).abs().max()) > 1e-4  # the adapter really changes the output
    if quant == "none":  # the same adapter from disk: PEFT's layers rebuilt on a meta-device model
        model.save_pretrained(str(tmp_path / "adapter"))
        disk = merge_checkpoint(
            base, str(tmp_path / "adapter"), str(tmp_path / "disk"), progress=False, chunk_elems=2048
        )
        assert disk.lora_modules_merged == disk.lora_modules_total == report.lora_modules_total
        dry = merge_checkpoint(base, str(tmp_path / "adapter"), str(tmp_path / "dry"), dry_run=True, progress=False)
        assert dry.lora_modules_total == report.lora_modules_total
        assert rel_err(logits_of(str(tmp_path / "disk"), ids), ref) < 1e-5
        auto = merge_and_save(model, str(tmp_path / "auto"), dtype="float32", progress=False)
        assert auto.base_precision == "original"
        assert rel_err(logits_of(str(tmp_path / "auto"), ids), ref) < 1e-5
        ref_state = model.merge_and_unload().state_dict()
        from safetensors.torch import load_file

        for k, v in load_file(str(tmp_path / "disk" / "model.safetensors")).items():
            torch.testing.assert_close(v, ref_state[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_lora_on_fused_moe_experts(arch, tmp_path):
    """target_parameters on fused 3-D expert weights, through PEFT's delta: in process, and from a checkpoint that
    stores the experts one by one."""
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    config = (
        Qwen3MoeConfig(moe_intermediate_size=32, intermediate_size=128, **common)
        if arch == "qwen3_moe"
        else MixtralConfig(intermediate_size=64, **common)
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "base"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    lora = LoraConfig(
        r=2,
        target_modules=["q_proj"],
        init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = get_peft_model(model, lora).eval()
    ids = token_ids(256, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, base_precision="dequantized", dtype="float32", progress=False)
    assert report.lora_modules_merged == report.lora_modules_total == 6
    assert rel_err(logits_of(out, ids), ref) < 1e-5
    # from disk: the checkpoint stores experts one by one; each gets its slice of PEFT's fused delta
    model.save_pretrained(str(tmp_path / "adapter"))
    disk = merge_checkpoint(str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "disk"), progress=False)
    assert disk.lora_modules_merged == disk.lora_modules_total == 6
    assert rel_err(logits_of(str(tmp_path / "disk"), ids), ref) < 1e-5
    # each per-expert key's delta comes from its expert's factors alone, equal to the cut of the whole delta
    from peft_shardmerge import plan_checkpoint_merge

    plan = plan_checkpoint_merge(str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "plan"))
    parts = [o for t in plan.tensors for o in t.recipe.peft_ops if o.kind == "part"]
    assert len(parts) == 2 * 3 * 4  # layers x (gate, up, down) x experts
    for part in parts[:6]:
        own = plan.inputs.adapter.layers.part_delta(part.op, part.memory_name, part.file_name)
        whole = plan.inputs.adapter.layers.split(part.memory_name, part.op.delta())[part.file_name]
        assert own is not None and torch.allclose(own, whole, atol=1e-7)
    report = merge_and_save(model, str(tmp_path / "auto"), dtype="float32", progress=False)
    assert report.base_precision == "original"
    assert rel_err(logits_of(str(tmp_path / "auto"), ids), ref) < 1e-5


def test_trainable_tokens_with_lora_on_fused_experts(tmp_path):
    """Token rows of an adapter merged through PEFT's rebuilt layers (target_parameters) are kept on both paths."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "base"))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32),
        LoraConfig(
            r=2,
            target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj"],
            trainable_token_indices=[1, 5, 7],
            init_lora_weights=False,
        ),
    )
    perturb_trainable(model)
    ids = torch.tensor([[1, 5, 7, 9, 11, 20, 30, 40]])
    with torch.no_grad():
        ref = model.eval()(input_ids=ids).logits
    model.save_pretrained(str(tmp_path / "adapter"))
    disk = merge_checkpoint(str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "disk"), progress=False)
    live = merge_and_save(model, str(tmp_path / "live"), base_precision="dequantized", dtype="float32", progress=False)
    assert disk.lora_modules_merged == live.lora_modules_merged == 4  # q_proj and experts, 2 layers; tokens apart
    for out in ("disk", "live"):
        assert rel_err(logits_of(str(tmp_path / out), ids), ref) < 1e-5, out


def test_two_adapters_training_the_same_tokens_are_refused(make_base, tmp_path):
    base = make_base("llama")
    a = build_adapter(base, str(tmp_path / "a"), seed=1, target_modules=["q_proj"], trainable_token_indices=[3])
    b = build_adapter(base, str(tmp_path / "b"), seed=2, target_modules=["v_proj"], trainable_token_indices=[4])
    with pytest.raises(InputError, match="two adapters train tokens of 'model.embed_tokens'"):
        merge_checkpoint(base, [a, b], str(tmp_path / "disk"), progress=False)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), a, adapter_name="a")
    model.load_adapter(b, adapter_name="b")
    with pytest.raises(InputError, match="several adapters train tokens here"):
        merge_and_save(model, str(tmp_path / "live"), adapter_names=["a", "b"], base_precision="dequantized")
    assert not (tmp_path / "disk").exists() and not (tmp_path / "live").exists()


# --- corner cases found in review: each was wrong or crashed once ---


@pytest.mark.parametrize("feedforward", [False, True])
def test_ia3_on_a_convolution(feedforward, tmp_path):
    """IA3 on LLaVA's Conv2d patch embedding: outputs (rows) or, as a feedforward module, input channels."""
    from peft import IA3Config, get_peft_model

    from peft_shardmerge.testing import build_base, model_inputs

    base = build_base(str(tmp_path / "base"), "llava")
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(
        model,
        IA3Config(
            target_modules=["patch_embedding"],
            init_ia3_weights=False,
            feedforward_modules=["patch_embedding"] if feedforward else [],
        ),
    )
    inputs = model_inputs(model.config)
    with torch.no_grad():
        ref = model.eval()(**inputs).logits
    model.save_pretrained(str(tmp_path / "adapter"))
    merge_checkpoint(base, str(tmp_path / "adapter"), str(tmp_path / "disk"), progress=False, chunk_elems=64)
    merge_and_save(model, str(tmp_path / "live"), base_precision="dequantized", dtype="float32", progress=False)
    for out in ("disk", "live"):
        merged = LlavaForConditionalGeneration.from_pretrained(str(tmp_path / out), dtype=torch.float32).eval()
        with torch.no_grad():
            assert rel_err(merged(**inputs).logits, ref) < 1e-5, out


def test_merge_and_unload_takes_every_kind(make_base):
    """merge_and_unload replaces LoHa, IA3, trainable-token and LoRA-on-convolution layers too."""
    from peft import IA3Config, LoHaConfig, LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from peft_shardmerge.api.unload import merge_and_unload

    base = make_base("llama")
    for config in (
        LoHaConfig(r=4, target_modules=["q_proj"], init_weights=False),
        IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"], init_ia3_weights=False),
        LoraConfig(target_modules=["q_proj"], trainable_token_indices=[3, 9], init_lora_weights=False),
    ):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
        perturb_trainable(model)
        ids = token_ids(512, seed=3)
        with torch.no_grad():
            ref = model.eval()(input_ids=ids).logits
        plain = merge_and_unload(model, dtype="float32")
        assert not [m for m in plain.modules() if isinstance(m, BaseTunerLayer)]
        with torch.no_grad():
            assert rel_err(plain(input_ids=ids).logits, ref) < 1e-5, type(config).__name__


def test_resized_vocabulary_with_trainable_tokens_on_a_tied_model(make_base, tmp_path):
    """PEFT saves the token rows (and the resized matrix) for both sides of the tie; both paths merge them."""
    from peft import LoraConfig, get_peft_model

    base = make_base("qwen2")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(520)
    model = get_peft_model(
        model, LoraConfig(target_modules=["q_proj"], trainable_token_indices=[512, 519], init_lora_weights=False)
    )
    perturb_trainable(model)
    model.save_pretrained(str(tmp_path / "adapter"))
    ids = torch.tensor([[5, 512, 7, 519, 9]])
    with torch.no_grad():
        ref = model.eval()(input_ids=ids).logits
    report = merge_checkpoint(base, str(tmp_path / "adapter"), str(tmp_path / "disk"), progress=False)
    assert any("520 rows" in n for n in report.notes)
    assert rel_err(logits_of(str(tmp_path / "disk"), ids), ref) < 1e-5
    merge_and_save(model, str(tmp_path / "orig"), base_precision="original", dtype="float32", progress=False)
    assert rel_err(logits_of(str(tmp_path / "orig"), ids), ref) < 1e-5


def test_trainable_token_rows_are_exact_in_fp32_output_of_a_bf16_base(make_base, make_adapter, tmp_path):
    from safetensors import safe_open

    base = make_base("llama_bf16")
    adapter = make_adapter("llama_bf16", "tokens", trainable_token_indices=[4, 6])
    merge_checkpoint(base, adapter, str(tmp_path / "m"), dtype="float32", progress=False)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    want = model.merge_and_unload().model.embed_tokens.weight[[4, 6]]
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:  # fp32 tiny model: one file
        assert torch.equal(f.get_tensor("model.embed_tokens.weight")[[4, 6]], want)


def test_several_active_adapters_are_all_merged_by_default(two_adapters, tmp_path):
    base, a, b, _ = two_adapters
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), a, adapter_name="a"
    )
    model.load_adapter(b, adapter_name="b")
    model.base_model.set_adapter(["a", "b"])
    ids = token_ids(512, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    for precision in ("original", "dequantized"):
        merge_and_save(model, str(tmp_path / precision), base_precision=precision, dtype="float32", progress=False)
        assert rel_err(logits_of(str(tmp_path / precision), ids), ref) < 1e-5, precision


def test_other_types_weighted_in_process(make_base, tmp_path):
    """LoHa deltas scale with their weight (merged in memory: the disk engine combines LoRA only); IA3 refuses."""
    from peft import IA3Config, LoHaConfig, get_peft_model

    base = make_base("llama")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoHaConfig(r=4, target_modules=["q_proj"], init_weights=False),
    )
    ids = token_ids(512, seed=3)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    report = merge_and_save(model, str(tmp_path / "zero"), weights=[0.0], dtype="float32", progress=False)
    assert report.base_precision == "dequantized" and "weighted combination" in report.notes[0]
    assert rel_err(logits_of(str(tmp_path / "zero"), ids), plain) < 1e-6
    assert rel_err(plain, full) > 1e-4
    ia3 = get_peft_model(AutoModelForCausalLM.from_pretrained(base), IA3Config(target_modules=["k_proj"]))
    with pytest.raises(InputError, match="IA3 adapters cannot be weighted or combined"):
        merge_and_save(ia3, str(tmp_path / "ia3"), weights=[0.5])


def test_loha_with_modules_to_save_from_disk(make_base, tmp_path):
    from peft import LoHaConfig, get_peft_model

    base = make_base("llama")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoHaConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], init_weights=False),
    )
    perturb_trainable(model)
    model.save_pretrained(str(tmp_path / "adapter"))
    ids = token_ids(512, seed=3)
    with torch.no_grad():
        ref = model.eval()(input_ids=ids).logits
    report = merge_checkpoint(base, str(tmp_path / "adapter"), str(tmp_path / "disk"), progress=False)
    assert report.replacements_applied == 1
    assert rel_err(logits_of(str(tmp_path / "disk"), ids), ref) < 1e-5
