"""peft-shardmerge verify: a clean merge passes; each kind of damage is named; with base + adapter every tensor is
recomputed into the base precision the merge used, so documented paths pass and wrong inputs are named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.verify.report import verify_checkpoint


@pytest.fixture(scope="module")
def merged(tmp_path_factory, make_base, make_adapter):
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    out = str(tmp_path_factory.mktemp("verify") / "merged")
    merge_checkpoint(base, adapter, out, dtype="float32", max_shard_size="300KB", progress=False)
    return base, adapter, out


def _copy(out, tmp_path):
    return shutil.copytree(out, tmp_path / "copy")


def test_clean_merge_passes_with_logits(merged):
    base, adapter, out = merged
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.ok, report.summary()
    assert report.logits_max_rel_err < 1e-5 and report.tensors == 21
    assert report.recomputed is True and report.integrity is True
    assert any(
        "recomputed 21 tensors from base + adapter (base precision original): 21 equal byte for byte" in c
        for c in report.checks
    )
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "verify", out, "--base", base, "--adapter", adapter],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.startswith("OK: ")


def test_wrong_adapter_fails_the_logits(merged, make_adapter):
    base, _, out = merged
    other = make_adapter(
        "llama_sharded",
        "patterns",
        r=8,
        lora_alpha=16,
        use_rslora=True,
        rank_pattern={"q_proj": 4, "down_proj": 2},
        alpha_pattern={"v_proj": 3},
    )
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "verify", out, "--base", base, "--adapter", other],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1 and r.stdout.startswith("FAILED: ") and "logits differ from base + adapter" in r.stdout
    assert "values beyond rounding differ from base + adapter" in r.stdout
    assert "adapter 1 given differs from the one merged: its adapter_model.safetensors" in r.stdout


def _first_shard(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]


def test_missing_tensor_and_index_disagreement(merged, tmp_path):
    out = _copy(merged[2], tmp_path)
    shard = os.path.join(out, _first_shard(out))
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    report = verify_checkpoint(str(out))
    assert report.integrity is False and any(
        "tensor(s) differ from what the merge wrote" in p for p in report.problems
    )
    assert not report.ok
    assert f"tensor {dropped} is in the index but in no shard" in report.problems
    assert any(p.startswith("index total_size") for p in report.problems)
    assert any("the model expects are missing" in p for p in report.problems)


def test_nan_and_format_metadata(merged, tmp_path):
    out = _copy(merged[2], tmp_path)
    shard = os.path.join(out, _first_shard(out))
    tensors = load_file(shard)
    name = sorted(n for n in tensors if tensors[n].is_floating_point())[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, shard)  # and no {"format": "pt"}
    report = verify_checkpoint(str(out))
    assert any(p.startswith("NaN or Inf in 1 tensor(s): " + name) for p in report.problems)
    assert any("lacks {'format': 'pt'} metadata" in p for p in report.problems)


def test_config_inconsistencies(merged, tmp_path):
    out = _copy(merged[2], tmp_path)
    config = json.load(open(out / "config.json"))
    config.update(dtype="bfloat16", tie_word_embeddings=True, vocab_size=1000)
    json.dump(config, open(out / "config.json", "w"))
    report = verify_checkpoint(str(out))
    text = "\n".join(report.problems)
    assert "config.json says dtype bfloat16 but the tensors are float32" in text
    assert "tie_word_embeddings is true but the tied output weights are stored separately" in text
    assert "model.embed_tokens.weight has shape [512, 128], the config implies [1000, 128]" in text


def test_not_a_checkpoint(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "verify", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2 and "has no config.json" in r.stderr and "Traceback" not in r.stderr


# --- with --base/--adapter: recomputed into the base the merge used -------------------------------------------------


def _run(*args):
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "verify", *args], capture_output=True, text=True, timeout=600
    )
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    return r


def _ok(folder, base, adapter, precision):
    report = verify_checkpoint(folder, base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed is True and report.integrity is True, report.summary()
    assert any(f"(base precision {precision}" in c for c in report.checks), report.summary()
    assert not (report.logits_max_rel_err > 1e-4) and report.logits_max_rel_err is not None
    return report


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nf4_merge_passes(dtype, make_base, make_adapter, tmp_path):
    bnb = pytest.importorskip("bitsandbytes")  # noqa: F841
    base, adapter = make_base("llama_bf16"), make_adapter("llama_bf16", "default")
    out = str(tmp_path / "nf4")
    merge_checkpoint(base, adapter, out, dtype=dtype, base_precision="nf4", progress=False)
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed, report.summary()
    assert any("base precision nf4 (nf4, blocksize 64, double quant)" in c for c in report.checks)
    r = _run(out, "--base", base, "--adapter", adapter)
    assert r.returncode == 0 and r.stdout.startswith("OK: ") and r.stderr == "", (r.stdout, r.stderr)


def _load_4bit(base, quant="nf4", double_quant=True, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.float32,
    )
    return AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, device_map="cpu", dtype=dtype)


@pytest.mark.parametrize(
    "quant,double_quant,dtype", [("nf4", True, "float32"), ("fp4", False, "bfloat16"), (None, None, "bfloat16")]
)
def test_in_process_dequantized_merges_pass(quant, double_quant, dtype, make_base, make_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    if quant:
        pytest.importorskip("bitsandbytes")
        model = PeftModel.from_pretrained(_load_4bit(base, quant, double_quant), adapter)
    else:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    out = str(tmp_path / "m")
    merge_and_save(model, out, dtype=dtype, base_precision="dequantized", progress=False)
    record = json.load(open(os.path.join(out, "merge_manifest.json")))["merge"]
    assert record["path"] == "in-process" and record["base_precision"] == "dequantized"
    assert (record["quantization"] or {}).get("quant_type") == quant
    assert record["base"] == {"name": os.path.basename(base)}  # never a local path
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed and report.integrity, report.summary()
    assert any("equal byte for byte" in c for c in report.checks)
    if quant:
        assert any(f"(base precision nf4 ({quant}, blocksize 64" in c for c in report.checks)
        assert any("logits vs base + adapter (4-bit base)" in c for c in report.checks)


@pytest.mark.parametrize("double_quant", [False, True])
def test_in_process_merge_of_a_4bit_checkpoint_verifies_against_that_checkpoint(
    double_quant, make_base, make_adapter, tmp_path
):
    """A model loaded from a saved -bnb-4bit folder holds that folder's 4-bit weights: verify with it as the base
    recomputes from those weights dequantized (no base precision to drop), byte for byte; a 4-bit folder of
    another format is named, not taken for the base merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save
    from tests.helpers import no_cpu_repack

    pytest.importorskip("bitsandbytes")
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    saved = str(tmp_path / "base-bnb-4bit")
    _load_4bit(base, "nf4", double_quant).save_pretrained(saved)
    loaded = AutoModelForCausalLM.from_pretrained(saved, device_map="cpu")
    no_cpu_repack(loaded)
    out = str(tmp_path / "merged")
    merge_and_save(PeftModel.from_pretrained(loaded, adapter), out, progress=False)
    report = verify_checkpoint(out, base=saved, adapter=adapter)
    assert report.status == "OK" and report.recomputed, report.summary()
    assert any(
        "recomputed 21 tensors from base + adapter (base precision original): 21 equal byte" in c
        for c in report.checks
    ), report.summary()
    assert any("the base is stored as bitsandbytes 4-bit (nf4" in n for n in report.notes), report.summary()
    other = str(tmp_path / "base-fp4")
    _load_4bit(base, "fp4", double_quant).save_pretrained(other)
    report = verify_checkpoint(out, base=other, adapter=adapter)
    assert report.status == "UNCHECKED" and not report.problems and report.recomputed is None, report.summary()
    assert any(f"but {other} is stored as bitsandbytes 4-bit (fp4" in n for n in report.unchecked), report.summary()


def test_base_held_in_a_coarser_dtype_is_not_recomputed_but_passes(make_base, make_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save

    base, adapter = make_base("llama"), make_adapter("llama", "default")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), adapter)
    out = str(tmp_path / "m")
    merge_and_save(model, out, dtype="bfloat16", base_precision="dequantized", progress=False)
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed is None and report.integrity, report.summary()
    assert any("held the base in bfloat16, the checkpoint stores float32" in n for n in report.notes)
    assert report.logits_max_rel_err < 3e-2


def test_peft_merge_saved_by_transformers_passes_within_rounding(merged, tmp_path):
    """A checkpoint we did not write (no record): OK only because every tensor is recomputed."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter, _ = merged
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    out = str(tmp_path / "peft")
    model.merge_and_unload().save_pretrained(out)
    assert verify_checkpoint(out).status == "UNCHECKED"
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed is True and report.integrity is None, report.summary()
    assert any("no merge record" in n for n in report.notes)


def _without_record(out, tmp_path, name):
    folder = shutil.copytree(out, tmp_path / name)
    os.remove(folder / "merge_manifest.json")
    return str(folder)


def _tensor_bytes(folder):
    """name -> (file, absolute begin, end, dtype) for every tensor."""
    import struct

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            path = os.path.join(folder, f)
            raw = open(path, "rb").read()
            n = struct.unpack("<Q", raw[:8])[0]
            for name, meta in json.loads(raw[8 : 8 + n]).items():
                if name != "__metadata__":
                    b, e = meta["data_offsets"]
                    out[name] = (path, 8 + n + b, 8 + n + e, meta["dtype"])
    return out


def _flip(path, pos, bit):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))


@pytest.fixture(scope="module")
def merged_bf16(tmp_path_factory, make_base, make_adapter):
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    out = str(tmp_path_factory.mktemp("verify16") / "merged")
    merge_checkpoint(base, adapter, out, dtype="bfloat16", max_shard_size="300KB", progress=False)
    return base, adapter, out


def test_recompute_alone_detects_changes(merged_bf16, tmp_path):
    """Without the record, the recomputation finds: any bit flip in a tensor no adapter changes (20 seeded), a sign
    or exponent flip in a merged value (20 seeded), a value set to 3e38, two same-shape merged tensors swapped."""
    import random

    base, adapter, out = merged_bf16
    adapter_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    layout = _tensor_bytes(out)
    merged_names = sorted(n for n in layout if any(t in n for t in adapter_targets))
    copied_names = sorted(set(layout) - set(merged_names))
    rng = random.Random(2024)
    cases = []
    for _ in range(20):
        name = rng.choice(copied_names)
        _, b, e, _ = layout[name]
        cases.append((name, rng.randrange(b, e), rng.randrange(8)))
    for _ in range(20):  # bf16: the high byte holds the sign and 7 of the 8 exponent bits
        name = rng.choice(merged_names)
        _, b, e, _ = layout[name]
        cases.append((name, b + 2 * rng.randrange((e - b) // 2) + 1, rng.randrange(8)))
    folder = _without_record(out, tmp_path, "flips")
    pristine = {p: open(p, "rb").read() for p, *_ in layout.values()}
    detected = 0
    for name, pos, bit in cases:
        path = os.path.join(folder, os.path.basename(layout[name][0]))
        _flip(path, pos, bit)
        report = verify_checkpoint(folder, base=base, adapter=adapter)
        detected += report.status == "FAILED" and any(p.startswith(name + ":") for p in report.problems)
        open(path, "wb").write(pristine[layout[name][0]])
    assert detected == len(cases)
    # 3e38 into a merged weight, then two same-shape merged tensors swapped
    name = merged_names[0]
    path, b, e, _ = layout[name]
    path = os.path.join(folder, os.path.basename(path))
    with open(path, "r+b") as f:
        f.seek(b + 2 * rng.randrange((e - b) // 2))
        f.write(torch.tensor([3e38], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    report = verify_checkpoint(folder, base=base, adapter=adapter)
    assert any(p.startswith(f"{name}: 1 values beyond rounding") for p in report.problems), report.summary()
    open(path, "wb").write(pristine[layout[name][0]])
    a, c = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    (pa, ba, ea, _), (pc, bc, ec, _) = layout[a], layout[c]
    da, dc = pristine[pa][ba:ea], pristine[pc][bc:ec]
    for p, pos, data in ((pa, ba, dc), (pc, bc, da)):
        with open(os.path.join(folder, os.path.basename(p)), "r+b") as f:
            f.seek(pos)
            f.write(data)
    report = verify_checkpoint(folder, base=base, adapter=adapter)
    assert report.status == "FAILED" and {a, c} <= {p.split(":")[0] for p in report.problems}, report.summary()


def test_nan_weight_fails_recompute_and_logits(merged, tmp_path):
    base, adapter, out = merged
    folder = _without_record(out, tmp_path, "nan")
    path, b, _, _ = _tensor_bytes(folder)["model.layers.1.mlp.up_proj.weight"]
    with open(path, "r+b") as f:
        f.seek(b)
        f.write(torch.tensor([float("nan")]).numpy().tobytes())
    report = verify_checkpoint(folder, base=base, adapter=adapter)
    text = "\n".join(report.problems)
    assert report.status == "FAILED" and "NaN or Inf in 1 tensor(s)" in text
    assert "model.layers.1.mlp.up_proj.weight: 1 values beyond rounding" in text
    assert "logits differ from base + adapter: max relative error nan" in text


@pytest.mark.slow
def test_inputs_that_do_not_fit_are_listed(merged, make_base, make_adapter, tmp_path):
    base, adapter, out = merged
    other_base = make_base("qwen2")  # another architecture: names and shapes differ
    r = _run(out, "--base", other_base, "--adapter", adapter)
    assert r.returncode == 1 and r.stdout.startswith("FAILED: ") and "problem: " in r.stdout, r.stdout
    # an adapter whose factors have the wrong shape (PEFT would dump a load_state_dict error)
    from safetensors.torch import load_file as load
    from safetensors.torch import save_file as save

    bad = shutil.copytree(adapter, tmp_path / "bad-adapter")
    tensors = load(str(bad / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    save(tensors, str(bad / "adapter_model.safetensors"), metadata={"format": "pt"})
    r = _run(out, "--base", base, "--adapter", str(bad))
    assert r.returncode == 1 and r.stdout.startswith("FAILED: ") and "cannot be planned" in r.stdout, r.stdout
    assert "size mismatch" not in r.stdout and len(r.stdout.splitlines()) < 30


@pytest.mark.slow
def test_combination_needs_every_adapter(make_base, make_adapter, tmp_path):
    base = make_base("llama")
    a, b = make_adapter("llama", "default"), make_adapter("llama", "second", seed=5)
    out = str(tmp_path / "combined")
    merge_checkpoint(base, [a, b], out, weights=[0.7, 0.4], dtype="float32", progress=False)
    r = _run(out, "--base", base, "--adapter", a, "--adapter", b)
    assert r.returncode == 0 and "logits not compared" in r.stdout and "equal byte for byte" in r.stdout, r.stdout
    r = _run(out, "--base", base, "--adapter", a)
    assert r.returncode == 1 and "the merge combined 2 adapter(s), 1 given" in r.stdout, r.stdout


def test_in_process_weighted_combination_passes(make_base, make_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save

    base = make_base("llama")
    a, b = make_adapter("llama", "default"), make_adapter("llama", "second", seed=5)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), a)
    model.load_adapter(b, adapter_name="second")
    out = str(tmp_path / "m")
    merge_and_save(
        model,
        out,
        dtype="float32",
        base_precision="dequantized",
        adapter_names=["default", "second"],
        weights=[0.7, 0.4],
        progress=False,
    )
    record = json.load(open(os.path.join(out, "merge_manifest.json")))["merge"]
    assert record["weights"] == [0.7, 0.4] and record["combination"] == "cat"
    report = verify_checkpoint(out, base=base, adapter=[a, b])
    assert report.status == "OK" and report.recomputed, report.summary()
    report = verify_checkpoint(out, base=base, adapter=a)
    assert report.status == "FAILED" and "the merge combined 2 adapter(s), 1 given" in report.summary()


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_in_process_output_with_renamed_keys_is_recomputed(arch, tmp_path):
    """In process, vision-language models are written under transformers' in-memory names; the recomputation
    matches them to the base's checkpoint keys."""
    from peft import PeftModel
    from transformers import AutoConfig

    from peft_shardmerge import merge_and_save
    from peft_shardmerge.testing import build_adapter, build_base, model_class

    base = build_base(str(tmp_path / "base"), arch)
    adapter = build_adapter(base, str(tmp_path / "adapter"), r=4, lora_alpha=8)
    cls = model_class(AutoConfig.from_pretrained(base))
    model = PeftModel.from_pretrained(cls.from_pretrained(base, dtype=torch.float32), adapter)
    out = str(tmp_path / "m")
    merge_and_save(model, out, base_precision="dequantized", dtype="float32", progress=False)
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed, report.summary()
    assert any(f"recomputed {report.tensors} tensors" in c and "equal byte for byte" in c for c in report.checks)


def test_in_process_fused_experts_pass_with_a_note(tmp_path):
    """LoRA on fused MoE experts merged in process: the fused tensors are not recomputed (named in a note), the rest
    is, and the logits cover the experts."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from peft_shardmerge import merge_and_save

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
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "base"))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32),
        LoraConfig(
            r=2,
            target_modules=["q_proj"],
            init_lora_weights=False,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    model.save_pretrained(str(tmp_path / "adapter"))
    out = str(tmp_path / "m")
    merge_and_save(model, out, base_precision="dequantized", dtype="float32", progress=False)
    report = verify_checkpoint(out, base=str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
    assert report.status == "OK" and report.recomputed is False and report.integrity, report.summary()
    assert any("4 tensor(s) stored fused as transformers loads them" in n for n in report.notes)
    assert report.logits_max_rel_err < 1e-4


def test_a_resized_vocabulary_with_saved_embeddings_is_checked_by_its_logits_too(make_base, tmp_path):
    """The reference base is resized as before training, so the adapter's saved embedding layers load into it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_shardmerge.testing import perturb_trainable

    base = make_base("llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(model.config.vocab_size + 8, mean_resizing=False)
    model = get_peft_model(
        model,
        LoraConfig(target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"], init_lora_weights=False),
    )
    perturb_trainable(model)
    adapter, out = str(tmp_path / "adapter"), str(tmp_path / "m")
    model.save_pretrained(adapter)
    merge_checkpoint(base, adapter, out, progress=False)
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed, report.summary()
    assert report.logits_max_rel_err < 1e-5, report.summary()


def test_a_reference_that_cannot_load_is_named_with_the_detail():
    from peft_shardmerge.verify.logits import _no_reference
    from peft_shardmerge.verify.report import VerifyReport

    try:
        torch.nn.Linear(2, 2).load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(2)})
    except RuntimeError as e:
        error = e
    report = VerifyReport("out")
    _no_reference(report, error)
    (line,) = report.unchecked
    assert line.startswith(
        "logits not compared: base + adapter could not be run as the reference (RuntimeError: Error(s) in loading "
        "state_dict for Linear: size mismatch for weight"
    ), line


def test_merge_and_save_of_a_lora_on_the_embeddings_names_no_other_adapter(make_base, tmp_path):
    """The in-process merge into the original checkpoint goes through a copy of the adapter saved for it: the
    record names the adapter in memory, not that copy, so the adapter the user saved is not called another one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save
    from peft_shardmerge.testing import perturb_trainable

    base = make_base("llama")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(target_modules=["q_proj", "embed_tokens"], init_lora_weights=False),
    )
    perturb_trainable(model)
    adapter, out = str(tmp_path / "adapter"), str(tmp_path / "m")
    model.save_pretrained(adapter)  # saves the embedding layer too (save_embedding_layers="auto")
    merge_and_save(model, out, progress=False)
    record = json.load(open(os.path.join(out, "merge_manifest.json")))["merge"]
    assert record["adapters"] == [{"name": "default", "in_memory": True}]
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed, report.summary()
    assert not any("differs from the one merged" in n for n in report.notes), report.summary()


def test_what_a_trainer_writes_beside_the_model_leaves_the_check_complete(merged, tmp_path):
    """The files transformers' Trainer writes (its arguments, state and metrics), copied into the output, are
    named and leave verify OK; a config a loader reads still makes it UNCHECKED."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    base, _, out = merged
    out = str(_copy(out, tmp_path))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(2)]
    run = str(tmp_path / "run")
    args = TrainingArguments(run, max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_state()
    trainer.save_model(run)
    trainer.save_metrics("eval", {"eval_loss": 1.0})
    written = sorted(
        n
        for n in os.listdir(run)
        if os.path.isfile(os.path.join(run, n)) and (not n.endswith((".safetensors", ".json")) or "results" in n)
    ) + ["trainer_state.json"]
    assert {"training_args.bin", "eval_results.json", "all_results.json"} <= set(written), written
    for name in written:
        shutil.copy(os.path.join(run, name), os.path.join(out, name))
    report = verify_checkpoint(out)
    assert report.status == "OK", report.summary()
    assert sum("training state, which no loader reads" in n for n in report.notes) == len(written), report.notes
    shutil.copy(os.path.join(run, "config.json"), os.path.join(out, "extra_config.json"))
    assert verify_checkpoint(out).status == "UNCHECKED"
