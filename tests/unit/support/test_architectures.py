"""Encoder, encoder-decoder and vision-language models: both paths reload with their own Auto classes and key
names and match the unmerged PeftModel (LoRA on text and vision layers, Conv2d/Conv3d patch embeddings)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.api.inprocess import merge_and_save
from peft_shardmerge.testing import build_adapter, build_base, model_class, model_inputs
from tests.helpers import nf4_by_hand

ARCHS = ["bert", "t5", "llava", "qwen2_vl"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    cache = {}

    def make(arch: str):
        if arch not in cache:
            base = build_base(str(root / f"base-{arch}"), arch)
            adapter = build_adapter(base, str(root / f"adapter-{arch}"), r=4, lora_alpha=8)
            cache[arch] = (base, adapter)
        return cache[arch]

    return make


def reference(base: str, adapter: str):
    from transformers import AutoConfig

    cls = model_class(AutoConfig.from_pretrained(base))
    peft_model = PeftModel.from_pretrained(cls.from_pretrained(base, dtype=torch.float32), adapter).eval()
    inputs = model_inputs(peft_model.config)
    with torch.no_grad():
        return peft_model, peft_model(**inputs).logits, inputs, cls


def keys(folder: str) -> set[str]:
    out = set()
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as h:
                out |= set(h.keys())
    return out


def check(out: str, cls, inputs, ref) -> None:
    merged, info = cls.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        got = merged.eval()(**inputs).logits
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, err


@pytest.mark.parametrize("arch", ARCHS)
def test_disk_engine(arch, models, tmp_path):
    base, adapter = models(arch)
    _, ref, inputs, cls = reference(base, adapter)
    out = str(tmp_path / "m")
    report = merge_checkpoint(base, adapter, out, progress=False)
    assert report.lora_modules_merged == report.lora_modules_total > 0
    assert keys(out) == keys(base)  # the base's own key names (and tied-weight omissions) are kept
    check(out, cls, inputs, ref)
    from peft_shardmerge.verify.report import verify_checkpoint

    verdict = verify_checkpoint(out, base=base, adapter=adapter)
    assert verdict.ok and verdict.logits_max_rel_err < 1e-5, verdict.summary()


@pytest.mark.parametrize("base_precision", ["dequantized", "original"])
@pytest.mark.parametrize("arch", ARCHS)
def test_in_process(arch, base_precision, models, tmp_path):
    base, adapter = models(arch)
    peft_model, ref, inputs, cls = reference(base, adapter)
    out = str(tmp_path / "m")
    report = merge_and_save(peft_model, out, base_precision=base_precision, dtype="float32", progress=False)
    assert report.base_precision == base_precision
    assert report.lora_modules_merged == report.lora_modules_total > 0
    check(out, cls, inputs, ref)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == [cls.__name__]


def test_vision_lora_changes_the_output(models):
    """The reference really exercises the vision LoRA (patch embedding convolutions, vision attention)."""
    for arch in ("llava", "qwen2_vl"):
        base, adapter = models(arch)
        peft_model, ref, inputs, _ = reference(base, adapter)
        with peft_model.disable_adapter(), torch.no_grad():
            plain = peft_model(**inputs).logits
        assert float((plain - ref).abs().max()) > 1e-3
        conv = [n for n, m in peft_model.named_modules() if type(m).__name__ in ("Conv2d", "Conv3d") and "lora_A" in n]
        assert conv, arch


SAVED = {"bert": ["transform.dense"], "t5": ["final_layer_norm"], "llava": ["lm_head"], "qwen2_vl": ["lm_head"]}
VARIANTS = {
    "dora": lambda arch: dict(use_dora=True),
    "rslora-patterns": lambda arch: dict(
        use_rslora=True,
        rank_pattern={"v_proj": 2, "value": 2, "v": 2},
        alpha_pattern={"v_proj": 3, "value": 3, "v": 3},
    ),
    "modules_to_save": lambda arch: dict(modules_to_save=SAVED[arch]),
    "lora_bias": lambda arch: dict(lora_bias=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_variant_matrix(arch, variant, models, tmp_path):
    """Each architecture x each variant, on both paths, against the unmerged PeftModel."""
    base, _ = models(arch)
    adapter = build_adapter(base, str(tmp_path / "adapter"), r=4, lora_alpha=8, **VARIANTS[variant](arch))
    if variant == "lora_bias" and arch != "bert":  # no bias to add lora_B.bias to (PEFT cannot merge it either)
        from peft_shardmerge import UnsupportedError

        with pytest.raises(UnsupportedError, match="lora_bias=True on a layer whose base has no bias"):
            merge_checkpoint(base, adapter, str(tmp_path / "disk"), progress=False)
        peft_model, *_ = reference(base, adapter)
        with pytest.raises(UnsupportedError, match="lora_bias=True on a layer whose base has no bias"):
            merge_and_save(peft_model, str(tmp_path / "live"), base_precision="dequantized", progress=False)
        return
    peft_model, ref, inputs, cls = reference(base, adapter)
    merge_checkpoint(base, adapter, str(tmp_path / "disk"), progress=False, chunk_elems=1024)
    check(str(tmp_path / "disk"), cls, inputs, ref)
    merge_and_save(peft_model, str(tmp_path / "live"), base_precision="dequantized", dtype="float32", progress=False)
    check(str(tmp_path / "live"), cls, inputs, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_weighted_combination_matrix(arch, models, tmp_path):
    base, first = models(arch)
    second = build_adapter(base, str(tmp_path / "second"), seed=5, r=4, lora_alpha=8)
    from transformers import AutoConfig

    cls = model_class(AutoConfig.from_pretrained(base))
    peft_model = PeftModel.from_pretrained(cls.from_pretrained(base, dtype=torch.float32), first, adapter_name="a")
    peft_model.load_adapter(second, adapter_name="b")
    peft_model.add_weighted_adapter(["a", "b"], [0.8, -0.5], "mix", combination_type="cat")
    peft_model.set_adapter("mix")
    inputs = model_inputs(peft_model.config)
    with torch.no_grad():
        ref = peft_model.eval()(**inputs).logits
    merge_checkpoint(base, [first, second], str(tmp_path / "disk"), weights=[0.8, -0.5], progress=False)
    check(str(tmp_path / "disk"), cls, inputs, ref)
    merge_and_save(
        peft_model,
        str(tmp_path / "live"),
        adapter_names=["a", "b"],
        weights=[0.8, -0.5],
        base_precision="dequantized",
        dtype="float32",
        progress=False,
    )
    check(str(tmp_path / "live"), cls, inputs, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_output_within_rounding(arch, models, tmp_path):
    """bf16 output: logits within bf16 rounding of the fp32 reference (the merge itself is done in fp32)."""
    base, adapter = models(arch)
    _, ref, inputs, cls = reference(base, adapter)
    out = str(tmp_path / "m")
    merge_checkpoint(base, adapter, out, dtype="bfloat16", progress=False)
    merged = cls.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(**inputs).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 3e-2


TIED_CASES = {
    "qwen2-embed-copy": ("qwen2", dict(modules_to_save=["embed_tokens"], target_modules=["q_proj"])),
    "t5-shared-copy": ("t5", dict(modules_to_save=["shared"])),
    "t5-head-copy": ("t5", dict(modules_to_save=["lm_head"])),
    "t5-lora-head": ("t5", dict(target_modules=["q", "lm_head"])),
}


@pytest.mark.parametrize("case", list(TIED_CASES))
def test_tied_partners_of_a_trained_copy(case, tmp_path):
    """A modules_to_save copy of one side of a tie is a new module in the adapter model: the other side keeps
    the base's weights (both written, tie off); LoRA on one side changes that side only."""
    arch, kwargs = TIED_CASES[case]
    base = build_base(str(tmp_path / "base"), arch)
    adapter = build_adapter(base, str(tmp_path / "adapter"), r=4, lora_alpha=8, **kwargs)
    peft_model, ref, inputs, cls = reference(base, adapter)
    report = merge_checkpoint(base, adapter, str(tmp_path / "disk"), progress=False)
    assert report.untied
    check(str(tmp_path / "disk"), cls, inputs, ref)
    merge_and_save(peft_model, str(tmp_path / "live"), base_precision="dequantized", dtype="float32", progress=False)
    check(str(tmp_path / "live"), cls, inputs, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_in_process_on_a_4bit_base(arch, models, tmp_path):
    """QLoRA on every architecture: bitsandbytes NF4 layers dequantized and merged, against the 4-bit model."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoConfig, BitsAndBytesConfig

    base, adapter = models(arch)
    cls = model_class(AutoConfig.from_pretrained(base))
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = cls.from_pretrained(base, quantization_config=qc, device_map="cpu", dtype=torch.float32)
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized
    for m in quantized:
        m.support_avx512bf16_for_cpu = False
    peft_model = PeftModel.from_pretrained(model, adapter).eval()
    inputs = model_inputs(peft_model.config)
    # the reference: the unmerged adapter over the NF4 definition of each 4-bit weight (bitsandbytes' own CPU
    # dequantization is wrong on rows that are not whole 64-value blocks, as these models' vision towers have)
    plain = cls.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, bnb.nn.Linear4bit):
                plain.get_submodule(name.removeprefix("base_model.model.").replace(".base_layer", "")).weight.copy_(
                    nf4_by_hand(m.weight.data, m.weight.quant_state)
                )
        ref = PeftModel.from_pretrained(plain, adapter).eval()(**inputs).logits
    out = str(tmp_path / "m")
    report = merge_and_save(peft_model, out, base_precision="dequantized", dtype="float32", progress=False)
    assert report.lora_modules_merged == report.lora_modules_total > 0
    check(out, cls, inputs, ref)
