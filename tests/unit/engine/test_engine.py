"""The disk-to-disk merge against PEFT's own merge_and_unload and the unmerged PeftModel's logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from peft_shardmerge import merge_checkpoint
from tests.helpers import folder_tensors

# (case id, base, adapter tag, LoRA kwargs)
CASES = [
    ("llama-default", "llama", "default", {}),
    (
        "llama-sharded-rslora-patterns",
        "llama_sharded",
        "patterns",
        dict(
            r=8,
            lora_alpha=16,
            use_rslora=True,
            rank_pattern={"q_proj": 4, "down_proj": 2},
            alpha_pattern={"v_proj": 3},
        ),
    ),
    ("llama-lm_head-lora", "llama", "lm_head", dict(target_modules=["q_proj", "lm_head"])),
    ("llama-lora_bias", "llama_bias", "lora_bias", dict(target_modules=["q_proj", "v_proj"], lora_bias=True)),
    ("llama-bf16-base", "llama_bf16", "default", {}),
    (
        "qwen2-tied-modules_to_save-embedding",
        "qwen2",
        "mts",
        dict(target_modules=["q_proj", "v_proj", "embed_tokens"], modules_to_save=["lm_head"], bias="lora_only"),
    ),
    ("qwen2-tied-untouched", "qwen2", "plain", dict(target_modules=["q_proj", "o_proj"])),
    # PEFT's merge_and_unload adds the lm_head delta to the tied tensor, so its embed_tokens changes too;
    # the unmerged model embeds with the base weight, and so do we (checked against the logits below).
    ("qwen2-tied-lm_head-lora", "qwen2", "lm_head", dict(target_modules=["up_proj", "lm_head"])),
    ("gpt2-conv1d", "gpt2", "default", dict(fan_in_fan_out=True)),
    ("gpt2-conv1d-bias-all", "gpt2", "bias_all", dict(fan_in_fan_out=True, bias="all", target_modules=["c_attn"])),
]


def _read_output(out: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a merged folder, read back with safetensors.safe_open; also name -> file."""
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    tensors, where = {}, {}
    for f in files:
        with safe_open(os.path.join(out, f), framework="pt") as h:
            assert h.metadata() == {"format": "pt"}
            for k in h.keys():
                assert k not in tensors, f"{k} written twice"
                tensors[k] = h.get_tensor(k)
                where[k] = f
    return tensors, where


def _base_names(base: str) -> list[str]:
    return list(folder_tensors(base))


def _changed_by(adapter: str) -> set[str]:
    """Base tensor names an adapter changes (LoRA targets' weights and tensors it saves whole)."""
    with safe_open(os.path.join(adapter, "adapter_model.safetensors"), framework="pt") as h:
        keys = list(h.keys())
    names = set()
    for k in keys:
        k = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
        for part in (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B"):
            if k.endswith(part):
                k = k[: -len(part)] + ".weight"
        names.add(k)
    return names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_merge_matches_peft(case, dtype, make_base, make_adapter, peft_reference, tmp_path):
    _, base_name, tag, kwargs = case
    base = make_base(base_name)
    adapter = make_adapter(base_name, tag, **kwargs)
    out = str(tmp_path / "merged")
    report = merge_checkpoint(base, adapter, out, dtype=dtype, max_shard_size="300KB", progress=False)

    ref_state, ref_logits, ids = peft_reference(base, adapter)
    tensors, where = _read_output(out)

    # every base tensor is written once; tied weights are added only when the adapter touched them
    base_names = set(_base_names(base))
    assert base_names <= set(tensors)
    extra = set(tensors) - base_names
    config = json.load(open(os.path.join(out, "config.json")))
    if extra:
        assert extra == {"lm_head.weight"} and config["tie_word_embeddings"] is False
    assert report.lora_modules_merged == report.lora_modules_total > 0
    assert report.tensors_written == len(tensors)

    # the merged tensors equal PEFT's merge_and_unload on the fp32 base
    out_dtype = getattr(torch, dtype)
    base_tensors = folder_tensors(base) if report.untied else {}
    for name, got in tensors.items():
        want = ref_state[name]
        if name in report.untied and name not in _changed_by(adapter):
            want = base_tensors[name].float()
        assert got.dtype == out_dtype, name
        if dtype == "float32":
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
        else:
            torch.testing.assert_close(got, want.to(out_dtype), rtol=2**-7, atol=1e-6, msg=lambda m: f"{name}: {m}")

    # index and layout as transformers writes them
    shards = sorted(set(where.values()))
    if len(shards) > 1:
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        assert index == {
            "metadata": {
                "total_parameters": sum(t.numel() for t in tensors.values()),
                "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
            },
            "weight_map": where,
        }
        assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    else:
        assert shards == ["model.safetensors"]
        assert not os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    assert config["dtype"] == dtype and "quantization_config" not in config
    assert os.path.exists(os.path.join(out, "generation_config.json"))

    # the reloaded model loads cleanly and gives the unmerged PeftModel's logits
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model.eval()(ids).logits
    scale = ref_logits.abs().max()
    err = float((logits - ref_logits).abs().max() / scale)
    assert err < (1e-5 if dtype == "float32" else 2e-2), err


def test_tie_kept_when_adapter_leaves_embeddings_alone(make_base, make_adapter, tmp_path):
    base = make_base("qwen2")
    adapter = make_adapter("qwen2", "plain", target_modules=["q_proj", "o_proj"])
    out = str(tmp_path / "m")
    report = merge_checkpoint(base, adapter, out, progress=False)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["tie_word_embeddings"] is True and report.untied == []
    assert "lm_head.weight" not in _read_output(out)[0]


def test_untouched_tensors_are_copied_byte_for_byte(make_base, make_adapter, tmp_path):
    base = make_base("llama_bf16")
    adapter = make_adapter("llama_bf16", "default")
    out = str(tmp_path / "m")
    merge_checkpoint(base, adapter, out, progress=False)
    got, _ = _read_output(out)
    want = folder_tensors(base)
    untouched = [k for k in want if "norm" in k or "embed" in k]
    assert untouched
    for k in untouched:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("shard_size", ["50KB", "300KB", "5GB"])
def test_shards_are_consecutive_and_bounded(shard_size, make_base, make_adapter, tmp_path):
    from peft_shardmerge import parse_size, plan_checkpoint_merge

    base = make_base("llama_sharded")
    adapter = make_adapter("llama_sharded", "default")
    out = str(tmp_path / "m")
    plan = plan_checkpoint_merge(base, adapter, out, max_shard_size=shard_size)
    shards = [t.shard for t in plan.tensors]
    assert shards == sorted(shards)
    limit = parse_size(shard_size)
    for i in range(len(plan.shard_names)):
        members = plan.shard_tensors(i)
        size = sum(t.nbytes for t in members)
        assert size <= limit or len(members) == 1
    report = merge_checkpoint(base, adapter, out, max_shard_size=shard_size, progress=False)
    assert report.shards == plan.shard_names
    _, where = _read_output(out)
    assert [where[t.name] for t in plan.tensors] == [plan.shard_names[t.shard] for t in plan.tensors]


def test_small_row_blocks_give_the_same_values(make_base, make_adapter, tmp_path):
    """Row blocks change only the BLAS blocking of B @ A: results agree to fp32 rounding."""
    base = make_base("qwen2")
    adapter = make_adapter(
        "qwen2",
        "mts",
        target_modules=["q_proj", "v_proj", "embed_tokens"],
        modules_to_save=["lm_head"],
        bias="lora_only",
    )
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    merge_checkpoint(base, adapter, a, dtype="float32", progress=False)
    merge_checkpoint(base, adapter, b, dtype="float32", progress=False, chunk_elems=300)
    ta, tb = _read_output(a)[0], _read_output(b)[0]
    assert ta.keys() == tb.keys()
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-6, atol=1e-7)


def test_legacy_bin_adapter_is_read_without_pickle(make_base, make_adapter, tmp_path):
    import shutil

    from safetensors.torch import load_file

    from peft_shardmerge.testing import compare_logits

    base = make_base("qwen2")
    src = make_adapter(
        "qwen2",
        "mts",
        target_modules=["q_proj", "v_proj", "embed_tokens"],
        modules_to_save=["lm_head"],
        bias="lora_only",
    )
    legacy = tmp_path / "legacy"
    shutil.copytree(src, legacy)
    torch.save(load_file(str(legacy / "adapter_model.safetensors")), str(legacy / "adapter_model.bin"))
    os.remove(legacy / "adapter_model.safetensors")
    out = str(tmp_path / "m")
    report = merge_checkpoint(base, str(legacy), out, dtype="float32", progress=False)
    assert report.lora_modules_merged == 5 and report.replacements_applied > 0
    assert compare_logits(base, src, out) < 1e-4


def test_pickle_with_code_is_refused(make_base, make_adapter, tmp_path):
    import shutil

    from peft_shardmerge import CorruptFileError

    legacy = tmp_path / "legacy"
    shutil.copytree(make_adapter("llama", "default"), legacy)
    os.remove(legacy / "adapter_model.safetensors")
    torch.save({"w": torch.ones(1), "f": os.getcwd}, str(legacy / "adapter_model.bin"))
    with pytest.raises(CorruptFileError, match=r"cannot be read safely with torch.load\(weights_only=True\)"):
        merge_checkpoint(make_base("llama"), str(legacy), str(tmp_path / "m"), progress=False)


def test_self_check_catches_a_wrong_merge(make_base, make_adapter, tmp_path, monkeypatch):
    import peft_shardmerge.engine.maths as maths
    from peft_shardmerge import MergeCheckError

    real = maths.add_lora_

    def doubled(rows32, factors, start, stop, *, transposed, base=None):
        return real(rows32, [(a, b, 2 * s) for a, b, s in factors], start, stop, transposed=transposed, base=base)

    monkeypatch.setattr(maths, "add_lora_", doubled)
    out = tmp_path / "m"
    with pytest.raises(
        MergeCheckError,
        match=r"self-check failed for 'model\.layers\.0\..*' rows 0-\d+: merged "
        r"weight times probe vectors differs from base \+ LoRA",
    ):
        merge_checkpoint(make_base("llama"), make_adapter("llama", "default"), str(out), progress=False)
    assert not out.exists()


def test_precision_report(make_base, make_adapter, tmp_path, caplog):
    import logging

    from peft_shardmerge.testing import build_adapter

    base = make_base("llama_bf16")
    with caplog.at_level(logging.DEBUG, logger="peft_shardmerge.engine.row_merge"):
        normal = merge_checkpoint(base, make_adapter("llama_bf16", "default"), str(tmp_path / "a"), progress=False)
    assert normal.swallowed and max(normal.swallowed.values()) < 0.5
    assert 0 < normal.self_check_max_rel_err < 1e-5
    kept = 1 - sum(normal.swallowed.values()) / len(normal.swallowed)  # the usual share: -v only, not a note
    assert kept > 0.95 and not any("kept the LoRA update" in n for n in normal.notes)
    assert "bfloat16 kept the LoRA update in 99." in caplog.text

    tiny = build_adapter(base, str(tmp_path / "tiny-adapter"), noise=1e-6)
    caplog.set_level(logging.WARNING)
    report = merge_checkpoint(base, tiny, str(tmp_path / "b"), progress=False)
    assert min(report.swallowed.values()) > 0.5
    assert "bfloat16 swallowed more than 50% of the LoRA update in 14 tensor(s)" in caplog.text
    assert "write float32 or float16 to keep it (dtype='float32' in Python" in report.notes[-1]
    assert report.notes[-2].startswith("bfloat16 kept the LoRA update in ")  # a share to decide on: a note
    kept = merge_checkpoint(base, tiny, str(tmp_path / "c"), dtype="float32", progress=False)
    assert kept.swallowed == {}


@pytest.mark.parametrize("base_name", ["llama", "qwen2"])
def test_resized_vocabulary(base_name, make_base, tmp_path):
    """An adapter saved after resize_token_embeddings: the output takes the new shape and vocab_size."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from peft_shardmerge.testing import token_ids

    base = make_base(base_name)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(model.config.vocab_size + 64)
    targets = ["q_proj", "embed_tokens"]
    # untied: the new lm_head rows must travel with the adapter; tied: they are the embedding's
    extra = {"modules_to_save": ["lm_head"]} if base_name == "llama" else {}
    peft_model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False, **extra)
    )
    adapter = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter, save_embedding_layers=True)
    out = str(tmp_path / "m")
    report = merge_checkpoint(base, adapter, out, dtype="float32", progress=False)
    assert any("resized the vocabulary: 512 -> 576" in n for n in report.notes)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["vocab_size"] == 576
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ref_base.resize_token_embeddings(576)
    ref = PeftModel.from_pretrained(ref_base, adapter).eval()
    ids = token_ids(576, seed=4)
    ids[0, :4] = torch.tensor([512, 540, 575, 520])  # new tokens
    with torch.no_grad():
        want, got = ref(ids).logits, reloaded.eval()(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_resized_vocabulary_without_the_new_head_rows_is_refused(make_base, tmp_path):
    from peft import LoraConfig, get_peft_model

    from peft_shardmerge import InputError

    base = make_base("llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(576)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["embed_tokens"]))
    adapter = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter, save_embedding_layers=True)
    with pytest.raises(
        InputError, match=r"resizes the vocabulary to 576 rows but has no 'lm_head\.weight' of that size"
    ):
        merge_checkpoint(base, adapter, str(tmp_path / "m"), progress=False)


def test_float16_overflow_is_refused(make_base, make_adapter, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from peft_shardmerge import MergeCheckError

    base = shutil.copytree(make_base("llama"), tmp_path / "base")
    tensors = load_file(str(base / "model.safetensors"))
    tensors["model.norm.weight"][0] = 1e6
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MergeCheckError, match=r"'model\.norm\.weight' has values beyond float16's range"):
        merge_checkpoint(
            str(base), make_adapter("llama", "default"), str(tmp_path / "m"), dtype="float16", progress=False
        )
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dora_on_linear_layers(dtype, make_base, make_adapter, peft_reference, tmp_path):
    base = make_base("llama_sharded")
    adapter = make_adapter("llama_sharded", "dora", use_dora=True, target_modules=["q_proj", "v_proj", "up_proj"])
    out = str(tmp_path / "m")
    report = merge_checkpoint(base, adapter, out, dtype=dtype, progress=False, chunk_elems=4096)
    assert report.lora_modules_merged == 6
    ref_state, ref_logits, ids = peft_reference(base, adapter)
    got, _ = _read_output(out)
    for name, t in got.items():
        if dtype == "float32":
            torch.testing.assert_close(t, ref_state[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits
    err = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    assert err < (1e-5 if dtype == "float32" else 2e-2), err


DORA_LAYOUTS = {
    "embedding": ("llama", ["q_proj", "embed_tokens"], {}),
    "conv1d": ("gpt2", ["c_attn", "c_fc"], {"fan_in_fan_out": True}),
}


@pytest.mark.parametrize("layout", list(DORA_LAYOUTS))
def test_dora_on_embeddings_and_conv1d(layout, make_base, make_adapter, peft_reference, tmp_path):
    """DoRA norms run over stored columns here: two passes over row blocks (tiny blocks force several)."""
    from peft import PeftModel

    from peft_shardmerge.api.inprocess import merge_and_save

    arch, targets, extra = DORA_LAYOUTS[layout]
    base = make_base(arch)
    adapter = make_adapter(arch, f"dora-{layout}", use_dora=True, target_modules=targets, **extra)
    ref_state, ref_logits, ids = peft_reference(base, adapter)
    out = str(tmp_path / "m")
    merge_checkpoint(base, adapter, out, progress=False, chunk_elems=2048)
    got, _ = _read_output(out)
    for name, t in got.items():
        torch.testing.assert_close(t, ref_state[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    merge_and_save(model, str(tmp_path / "live"), base_precision="dequantized", dtype="float32", progress=False)
    for out_dir in (out, str(tmp_path / "live")):
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()(ids).logits
        assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) < 1e-5, out_dir
