"""Merges written in a served quantized format (``quantize=``, ``--quantize``): every stored tensor against the
format's own quantizer (transformers' Fp8Quantize, bitsandbytes, compressed-tensors) applied to PEFT's float32 merge,
the output loaded by transformers on the CPU, verify's verdict, an FP8 base written back, and the refusals."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from helpers import folder_tensors, tensor_bytes
from peft import PeftModel
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.quantizers.base import get_keys_to_not_convert

from peft_shardmerge import InputError, merge_checkpoint
from peft_shardmerge.testing import build_adapter, build_base, token_ids
from peft_shardmerge.verify.report import verify_checkpoint

bnbf = pytest.importorskip("bitsandbytes.functional")
ct = pytest.importorskip("compressed_tensors")

FORMATS = ["fp8-block", "ct-fp8-block", "ct-w4a16", "nf4", "fp4", "int8"]
ARCHS = ["llama", "qwen2", "mixtral"]  # qwen2 ties its embeddings; mixtral's experts are not nn.Linear


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per architecture: a bf16 base, an adapter, PEFT's float32 merge of the two (state dict and model)."""
    built = {}

    def get(arch: str):
        if arch not in built:
            tmp = tmp_path_factory.mktemp(arch)
            base = build_base(str(tmp / "base"), arch, dtype=torch.bfloat16)
            adapter = build_adapter(base, str(tmp / "adapter"))
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            merged = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
            built[arch] = (str(tmp), base, adapter, merged)
        return built[arch]

    return get


def linear_weights(model) -> dict[str, torch.Tensor]:
    """The float32 weights of the model's exact nn.Linear modules but the output embedding: what transformers'
    quantizers replace (by module name)."""
    out_emb = model.get_output_embeddings()
    return {
        name: m.weight.detach()
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m is not out_emb and name != "lm_head"
    }


def reference(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The format's own quantizer on the float32 merged weight ``w``: the stored tensors by suffix (None: the tool
    leaves the weight unquantized)."""
    if fmt == "fp8-block":
        from transformers import FineGrainedFP8Config
        from transformers.integrations.finegrained_fp8 import Fp8Quantize
        from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

        out = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config()))._quantize_one("m.weight", w)
        return None if len(out) == 1 else {"weight": out["m.weight"], "weight_scale_inv": out["m.weight_scale_inv"]}
    if fmt in ("nf4", "fp4"):
        packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type=fmt)
        state.dtype = torch.bfloat16  # the model's dtype, which dequantization returns
        return {"weight": packed, **{"weight." + k: v for k, v in state.as_dict(packed=True).items()}}
    if fmt == "int8":
        codes, scb, _ = bnbf.int8_vectorwise_quant(w.to(torch.float16))
        return {"weight": codes, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)}
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, maybe_pad_tensor_for_block_quant

    w = w.to(torch.bfloat16)  # llm-compressor quantizes the model as loaded, in its dtype
    if fmt == "ct-fp8-block":
        scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
        p = maybe_pad_tensor_for_block_quant(w, (128, 128))
        groups = p.reshape(p.shape[0] // 128, 128, p.shape[1] // 128, 128).transpose(1, 2).flatten(-2)
        compressor = FloatQuantizationCompressor
    else:
        scheme = preset_name_to_scheme("W4A16", ["Linear"])
        groups = w.reshape(w.shape[0], w.shape[1] // 128, 128)
        compressor = PackedQuantizationCompressor
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    return compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)


def stored_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Byte for byte, dtype and shape included."""
    return (
        got.dtype == want.dtype
        and tuple(got.shape) == tuple(want.shape)
        and bytes(got.contiguous().view(torch.uint8).numpy()) == bytes(want.contiguous().view(torch.uint8).numpy())
    )


@pytest.mark.parametrize(
    "arch", [a if a == "llama" else pytest.param(a, marks=pytest.mark.matrix) for a in ARCHS]
)  # make test: llama; make test-all: qwen2 and mixtral too
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tensor_is_the_format_quantizer_on_peft_fp32_merge(cases, arch, fmt):
    tmp, base, adapter, merged = cases(arch)
    out = os.path.join(tmp, f"q-{fmt}")
    if fmt == "ct-w4a16" and arch == "mixtral":
        with pytest.raises(InputError, match="experts one by one"):
            merge_checkpoint(base, adapter, out, quantize=fmt, progress=False)
        assert not os.path.exists(out)
        return
    report = merge_checkpoint(base, adapter, out, quantize=fmt, progress=False)
    stored = folder_tensors(out)
    config = json.load(open(os.path.join(out, "config.json")))
    qc = config["quantization_config"]
    encoded, kept = 0, []
    for module, w in linear_weights(merged).items():
        want = reference(fmt, w)
        if want is None:  # left as the tool leaves it: the merge in the model's dtype, named so in the config
            kept.append(module)
            assert stored_equal(stored[f"{module}.weight"], w.to(torch.bfloat16)), module
            continue
        encoded += 1
        for suffix, tensor in want.items():
            got = stored[f"{module}.{suffix}"]
            if suffix.startswith("weight.quant_state."):  # bitsandbytes' JSON, padded with spaces to its room
                assert bytes(got.numpy()).rstrip(b" ") == bytes(tensor.numpy()), module
            else:
                assert stored_equal(got, tensor), f"{module}.{suffix}"
    assert encoded > 0 and f"quantized: {encoded} weights as {fmt}" in report.notes[-1]
    # everything else is the 16-bit merge: embeddings, norms, lm_head, the experts
    quantized_modules = set(linear_weights(merged)) - set(kept)
    for name, value in merged.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in quantized_modules or name not in stored:
            continue
        assert stored_equal(stored[name], value.to(torch.bfloat16)), name
    if fmt == "fp8-block":
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
        assert qc["activation_scheme"] == "dynamic"  # vLLM requires it
        skip = qc["modules_to_not_convert"]  # transformers adds the output layer itself only to a list of None
        experts = sorted(n for n, _ in merged.named_modules() if n.endswith(".experts"))
        outputs = sorted(get_keys_to_not_convert(merged))  # transformers' default: the output layer (and its tie)
        assert skip == ([*outputs, *experts, *sorted(kept)] if kept or experts else None)
    elif fmt.startswith("ct-"):
        from compressed_tensors.quantization import QuantizationConfig

        assert QuantizationConfig.model_validate(qc).quant_method == "compressed-tensors"
    else:
        assert qc["quant_method"] == "bitsandbytes"
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        assert set(json.load(open(index))["weight_map"]) == set(stored)
    # transformers loads it on the CPU; its logits stay near the 16-bit merge's
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    ids = token_ids(model.config.vocab_size, seed=0)
    with torch.no_grad():
        got = model.eval()(input_ids=ids).logits.float()
        want = merged(input_ids=ids).logits
    err = float((got - want).abs().max() / want.abs().max())
    assert err < LOGITS_BOUND[fmt], err


#: the largest relative logits error of the quantized tiny models against PEFT's float32 merge (random weights of
#: two layers; docs/quantized.md gives the measured figures)
LOGITS_BOUND = {"fp8-block": 0.2, "ct-fp8-block": 0.2, "int8": 0.2, "nf4": 0.5, "fp4": 0.6, "ct-w4a16": 0.6}


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_ok_then_failed_after_one_flipped_byte(cases, fmt, tmp_path):
    _, base, adapter, _ = cases("llama")
    out = str(tmp_path / "q")
    merge_checkpoint(base, adapter, out, quantize=fmt, progress=False)
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "OK", report.summary()
    assert any("equal byte for byte" in c for c in report.checks)
    # one byte of an encoded weight's codes flipped: the record's digests and the recomputation both see it
    name = "model.layers.1.mlp.down_proj." + ("weight_packed" if fmt == "ct-w4a16" else "weight")
    _flip_byte(out, name)
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "FAILED", report.summary()
    named = [p for p in report.problems if name in p]
    assert any("differ from what the merge wrote" in p for p in named), report.problems  # the record's digests
    assert any("1 bytes differ from base + adapter" in p for p in named), report.problems  # the recomputation


def _flip_byte(folder: str, name: str) -> None:
    """Flip the first data byte of tensor ``name``."""
    from peft_shardmerge.io.safetensors_io import read_header

    path = os.path.join(folder, "model.safetensors")
    infos, _ = read_header(path)
    info = next(t for t in infos if t.name == name)
    with open(path, "r+b") as f:
        f.seek(info.offset)
        b = f.read(1)
        f.seek(info.offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_fp8_base_written_back(tmp_path):
    """An FP8 base (transformers' quantizer on a bf16 model): with an adapter whose delta is zero, quantize='base'
    gives back the base's bytes; with a trained one, the base's layout with the changed weights re-quantized."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    b16 = build_base(str(tmp_path / "b16"), dtype=torch.bfloat16)
    fp8 = str(tmp_path / "fp8")
    shutil.copytree(b16, fp8)
    quantizer = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config()))
    tensors = {}
    for name, w in folder_tensors(b16).items():
        tensors.update(quantizer._quantize_one(name, w) if name.endswith("_proj.weight") else {name: w})
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(fp8, "config.json")))
    kept = sorted(
        n.removesuffix(".weight")
        for n, t in tensors.items()
        if n.endswith("_proj.weight") and t.dtype != torch.float8_e4m3fn
    )
    config["quantization_config"] = json.loads(
        json.dumps(FineGrainedFP8Config(modules_to_not_convert=kept or None).to_dict())
    )
    json.dump(config, open(os.path.join(fp8, "config.json"), "w"))

    zero = build_adapter(fp8, str(tmp_path / "zero"), noise=0.0)  # lora_B stays zero: the delta is exactly 0
    out = str(tmp_path / "back")
    merge_checkpoint(fp8, zero, out, quantize="base", progress=False)
    got = folder_tensors(out)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert stored_equal(got[name], t), name
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"] == config["quantization_config"]
    assert tensor_bytes(out) == tensor_bytes(fp8)  # the base's size: only the header's layout differs

    trained = build_adapter(fp8, str(tmp_path / "trained"))
    out = str(tmp_path / "trained-out")
    merge_checkpoint(fp8, trained, out, quantize="base", progress=False)
    got = folder_tensors(out)
    assert {n: (t.dtype, t.shape) for n, t in got.items()} == {n: (t.dtype, t.shape) for n, t in tensors.items()}
    model = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32)  # dequantized on the CPU, in float32
    merged = PeftModel.from_pretrained(model, trained).merge_and_unload()
    changed = 0
    for module, w in linear_weights(merged).items():
        want = quantizer._quantize_one(f"{module}.weight", w)
        if len(want) == 2:
            changed += 1
            for name, tensor in want.items():
                assert stored_equal(got[name], tensor), name
    assert changed > 0
    assert verify_checkpoint(out, base=fp8, adapter=trained).status == "OK"


def test_refusals_before_anything_is_written(cases, tmp_path):
    _, base, adapter, _ = cases("llama")
    out = str(tmp_path / "out")
    cases_ = [
        (dict(quantize="gptq"), "GPTQ needs calibration data"),
        (dict(quantize="awq"), "llm-compressor"),
        (dict(quantize="int3"), "not a format this version writes"),
        (dict(quantize="base"), "not stored quantized"),
    ]
    for kwargs, match in cases_:
        with pytest.raises(InputError, match=match):
            merge_checkpoint(base, adapter, out, progress=False, **kwargs)
        assert not os.path.exists(out)
    with pytest.raises(InputError, match="GGUF file's quantization is its outtype"):
        merge_checkpoint(base, adapter, str(tmp_path / "m.gguf"), quantize="nf4", progress=False)
    odd = build_base(str(tmp_path / "odd"), dtype=torch.bfloat16, intermediate_size=200)
    odd_adapter = build_adapter(odd, str(tmp_path / "odd-adapter"))
    with pytest.raises(InputError, match=r"down_proj.weight: ct-w4a16 quantizes groups of 128 inputs.*200"):
        merge_checkpoint(odd, odd_adapter, out, quantize="ct-w4a16", progress=False)
    assert not os.path.exists(out)


@pytest.mark.parametrize(
    "qc, said",
    [
        ({"quant_method": "fp8", "weight_block_size": None}, "one scale per tensor"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "static activation"),
        ({"quant_method": "gptq"}, "'gptq', which this version reads but does not write back"),
    ],
)
def test_base_formats_not_written_back_are_named(qc, said):
    from peft_shardmerge.quant.encode import encoder_for

    with pytest.raises(InputError, match=said):
        encoder_for("base", qc)


def test_command_line_and_a_loaded_model(cases, tmp_path):
    from peft_shardmerge import merge_and_save
    from peft_shardmerge.api.cli import main

    tmp, base, adapter, _ = cases("llama")
    out = str(tmp_path / "cli")
    assert main(["merge", base, adapter, out, "--quantize", "nf4", "--quiet"]) == 0
    disk = folder_tensors(out)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), adapter)
    live = str(tmp_path / "live")
    merge_and_save(model, live, quantize="nf4", progress=False)
    got = folder_tensors(live)
    assert set(got) == set(disk)
    for name in disk:  # the same merge, from disk and from memory, quantized the same
        if ".quant_state." in name:
            assert bytes(got[name].numpy()).rstrip() == bytes(disk[name].numpy()).rstrip(), name
        else:
            assert stored_equal(got[name], disk[name]), name


def test_pushed_quantized_equals_the_local_one(cases, tmp_path, monkeypatch):
    """``push --quantize`` streams the same files to the Hub in one commit, its card naming the format."""
    import huggingface_hub.constants as hc
    from hub_server import FakeHub

    from peft_shardmerge.api.cli import main

    _, base, adapter, _ = cases("qwen2")
    local = str(tmp_path / "local")
    merge_checkpoint(base, adapter, local, quantize="fp8-block", max_shard_size="200KB", progress=False)
    with FakeHub() as server:
        monkeypatch.setattr(hc, "ENDPOINT", server.url)
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setenv("HF_TOKEN", "hf_x")
        args = ["push", base, adapter, "me/q", "--quantize", "fp8-block", "--max-shard-size", "200KB"]
        (tmp_path / "staging").mkdir()
        assert main([*args, "--staging", str(tmp_path / "staging"), "--quiet"]) == 0
        files = {name: server.files["me/q"][name] for name in server.files["me/q"]}
        assert len(server.commits) == 1
    shards = [f for f in os.listdir(local) if f.endswith(".safetensors")]
    assert len(shards) > 1
    for name in [*shards, "model.safetensors.index.json", "config.json"]:
        assert files[name] == open(os.path.join(local, name), "rb").read(), name
    card = files["README.md"].decode()
    assert "fp8-block" in card and "quantized" in card


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def mxfp4_by_definition(x: torch.Tensor) -> torch.Tensor:
    """MXFP4 of ``x [experts, in, out]`` by its definition, in float64 and plain Python rounding: per expert, output
    and group of 32 inputs, the scale 2**ceil(log2(amax / 6)), each value the nearest E2M1 value times it (a tie
    away from zero, beyond 6 clamped)."""
    out = torch.empty_like(x, dtype=torch.float64)
    levels = torch.tensor(E2M1, dtype=torch.float64)
    mids = (levels[1:] + levels[:-1]) / 2
    for e in range(x.shape[0]):
        for o in range(x.shape[2]):
            for g in range(0, x.shape[1], 32):
                v = x[e, g : g + 32, o].double()
                amax = float(v.abs().max())
                scale = 2.0 ** torch.ceil(torch.log2(torch.tensor(amax / 6.0))).item() if amax > 0 else 0.0
                r = (v.abs() / scale).clamp(max=6.0) if scale else v.abs() * 0
                idx = (r.unsqueeze(-1) >= mids).sum(-1)  # a value on a midpoint takes the larger level
                out[e, g : g + 32, o] = torch.sign(v) * levels[idx] * scale
    return out


def test_mxfp4_encoding_decodes_to_its_definition():
    """Our MXFP4 codes and scales, decoded by transformers' own dequantizer, are the format's definition of the
    values (random experts, exact ties and zero groups included)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from peft_shardmerge.quant.encode import Mxfp4

    torch.manual_seed(0)
    x = torch.randn(2, 64, 8) * 0.01
    x[0, :32, 0] = 0.0  # a group of zeros
    x[1, :32, 1] = torch.tensor([6.0, 2.5, -5.0, 0.75, 0.25, -1.25] + [0.0] * 26)  # ties between levels
    blocks, scales = Mxfp4().encode(x, torch.bfloat16)
    got = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(got.double(), mxfp4_by_definition(x))


def test_mxfp4_base_written_back(tmp_path):
    """A gpt-oss MXFP4 base whose groups each hold a code of magnitude 4 or 6 (the scale the rule gives back): an
    adapter on attention leaves the experts as stored, bytes and all; transformers loads the output."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit", "quant"))
    from test_quantized_mxfp4 import QC, gpt_oss_config, stored_tensors, write_checkpoint

    config = gpt_oss_config()
    tensors = stored_tensors(config, seed=0)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        blocks = tensors[name]
        blocks[..., 0] = (blocks[..., 0] & 0xF0) | 0x07  # the group's first code: 6 (E2M1 0b0111)
    base = write_checkpoint(str(tmp_path / "base"), config, tensors)
    adapter = build_adapter(base, str(tmp_path / "adapter"), noise=0.0, target_modules=["q_proj", "v_proj"])
    out = str(tmp_path / "out")
    merge_checkpoint(base, adapter, out, quantize="base", progress=False)
    got = folder_tensors(out)
    assert set(got) == set(tensors)
    for name in tensors:
        assert stored_equal(got[name], tensors[name]), name
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"] == QC
    import transformers

    model, info = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.Mxfp4Config(dequantize=True), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("kind", ["nf4-double", "int8"])
def test_bitsandbytes_base_written_back(cases, tmp_path, kind):
    """A base saved by transformers + bitsandbytes, merged with quantize='base': the base's layout and settings,
    each changed weight bitsandbytes' own quantization of PEFT's float32 merge over the dequantized base."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit", "quant"))
    from test_quantized_bnb import save_quantized

    _, b16, _, _ = cases("llama")
    base = save_quantized(b16, str(tmp_path / "base"), kind)
    adapter = build_adapter(b16, str(tmp_path / "adapter"))
    out = str(tmp_path / "out")
    merge_checkpoint(base, adapter, out, quantize="base", progress=False)
    stored, got = folder_tensors(base), folder_tensors(out)
    assert {n: (t.dtype, t.shape) for n, t in got.items() if ".quant_state." not in n} == {
        n: (t.dtype, t.shape) for n, t in stored.items() if ".quant_state." not in n
    }
    base_qc = json.load(open(os.path.join(base, "config.json")))["quantization_config"]
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"] == base_qc
    from test_quantized_bnb import dequantized

    model = dequantized(base).float()
    if kind == "int8":  # the format's definition, codes * SCB / 127 (float64, exact, then float32), not bf16
        with torch.no_grad():
            for module, w in linear_weights(model).items():
                codes, scb = stored[f"{module}.weight"].double(), stored[f"{module}.SCB"].double()
                w.copy_((codes * scb[:, None] / 127).float())
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    encoder = "int8" if kind == "int8" else "nf4"
    for module, w in linear_weights(merged).items():
        for suffix, tensor in reference(encoder, w).items():
            name = f"{module}.{suffix}"
            if ".quant_state." in suffix:
                assert json.loads(bytes(got[name].numpy())) == json.loads(bytes(tensor.numpy())), name
            else:
                assert stored_equal(got[name], tensor), name
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("fmt", ["nf4", "int8", "fp8-block"])
def test_gpt2_conv1d_weights(tmp_path, fmt):
    """GPT-2 stores its projections [in, out] (Conv1D): bitsandbytes quantizes them as [out, in], the FP8 and
    compressed-tensors tools only nn.Linear, of which GPT-2 has none but its output layer."""
    from transformers.pytorch_utils import Conv1D

    base = build_base(str(tmp_path / "base"), "gpt2", dtype=torch.bfloat16)
    adapter = build_adapter(base, str(tmp_path / "adapter"))
    out = str(tmp_path / "out")
    if fmt == "fp8-block":
        with pytest.raises(InputError, match="none of this model's weights"):
            merge_checkpoint(base, adapter, out, quantize=fmt, progress=False)
        assert not os.path.exists(out)
        return
    merge_checkpoint(base, adapter, out, quantize=fmt, progress=False)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    stored = folder_tensors(out)
    n = 0
    for name, m in merged.named_modules():
        if isinstance(m, Conv1D):
            n += 1
            for suffix, tensor in reference(fmt, m.weight.detach().T.contiguous()).items():
                got = stored[f"{name}.{suffix}"]
                if ".quant_state." in suffix:
                    assert bytes(got.numpy()).rstrip(b" ") == bytes(tensor.numpy()), name
                else:
                    assert stored_equal(got, tensor), f"{name}.{suffix}"
    assert n > 0
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_fp8_block_loads_as_on_an_fp8_gpu(cases, tmp_path, monkeypatch, arch):
    """transformers' FP8 loading without its no-GPU fallback (which dequantizes everything and would hide a wrong
    config): every quantized module is FP8Linear with its stored scales, and the output layer, the weights kept in
    16-bit and a mixture's experts stay as written, nothing missing or converted without its scale."""
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    _, base, adapter, _ = cases(arch)
    out = str(tmp_path / "fp8")
    merge_checkpoint(base, adapter, out, quantize="fp8-block", progress=False)
    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    model, info = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", output_loading_info=True)
    assert not any(info.values()), info
    stored = folder_tensors(out)
    fp8 = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert fp8 == {n.removesuffix(".weight_scale_inv") for n in stored if n.endswith(".weight_scale_inv")}
    for name in fp8:
        m = model.get_submodule(name)
        assert torch.equal(m.weight_scale_inv, stored[f"{name}.weight_scale_inv"]), name
    assert type(model.get_output_embeddings()) is nn.Linear
    for name, m in model.named_modules():
        if name.endswith(".experts"):
            assert all(p.dtype == torch.bfloat16 for p in m.parameters()), name


def test_verify_fails_a_quantization_config_that_misreads_the_tensors(cases, tmp_path):
    """A config whose block size differs from the stored scales' (the record sealed again for it, so that only the
    comparison with what the merge writes can see it) is FAILED, by name."""
    import hashlib

    from peft_shardmerge.output.record import record_digest

    _, base, adapter, _ = cases("llama")
    out = str(tmp_path / "q")
    merge_checkpoint(base, adapter, out, quantize="fp8-block", progress=False)
    path = os.path.join(out, "config.json")
    config = json.load(open(path))
    config["quantization_config"]["weight_block_size"] = [64, 64]
    with open(path, "w") as f:
        json.dump(config, f)
    manifest = os.path.join(out, "merge_manifest.json")
    record = json.load(open(manifest))
    raw = open(path, "rb").read()
    record["files"]["config.json"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    record["record_sha256"] = record_digest(record)
    with open(manifest, "w") as f:
        json.dump(record, f)
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "FAILED", report.summary()
    assert any("quantization_config differs" in p and "weight_block_size" in p for p in report.problems), (
        report.problems
    )


def test_verify_of_a_model_this_machine_cannot_run_is_ok_with_a_note(tmp_path):
    """bitsandbytes' CPU 4-bit matmul wants inputs in whole groups of 32: a model with 200-wide MLPs cannot run its
    forward here, which says nothing of its bytes (all recomputed): OK, the logits' absence noted."""
    base = build_base(str(tmp_path / "base"), dtype=torch.bfloat16, intermediate_size=200)
    adapter = build_adapter(base, str(tmp_path / "adapter"))
    out = str(tmp_path / "q")
    merge_checkpoint(base, adapter, out, quantize="nf4", progress=False)
    report = verify_checkpoint(out, base=base, adapter=adapter)
    assert report.status == "OK", report.summary()
    said = [*report.notes, *report.checks]  # where the kernel runs (a GPU, another bitsandbytes), the measured error
    assert any("logits not compared: the nf4 model does not run here" in n or "logits of the nf4" in n for n in said)


def test_a_qlora_model_written_back_in_its_own_4bit_format(cases, tmp_path):
    """merge_and_save(model_4bit, quantize="base") writes the model's own bitsandbytes settings; its tensors are the
    ones save_pretrained_merged(save_method="merged_4bit") writes, both quantized once from the float32 merge."""
    import warnings

    from helpers import load_quantized, no_cpu_repack

    from peft_shardmerge import merge_and_save, save_pretrained_merged

    _, base, adapter, _ = cases("llama")
    model = PeftModel.from_pretrained(load_quantized(base, "nf4", compute_dtype=torch.bfloat16), adapter)
    no_cpu_repack(model)
    out, forced = str(tmp_path / "base"), str(tmp_path / "forced")
    merge_and_save(model, out, quantize="base", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # merged_4bit's warning that the result is not the model trained
        save_pretrained_merged(model, forced, save_method="merged_4bit_forced", progress=False)
    got, want = folder_tensors(out), folder_tensors(forced)
    assert set(got) == set(want) and any(n.endswith(".absmax") for n in got)
    for name in got:
        if ".quant_state." in name:
            assert json.loads(bytes(got[name].numpy())) == json.loads(bytes(want[name].numpy())), name
        else:
            assert stored_equal(got[name], want[name]), name
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert qc["load_in_4bit"] and qc["bnb_4bit_quant_type"] == "nf4"
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("fmt", ["ct-fp8-block", "nf4", "int8"])
def test_the_same_bytes_in_order_or_at_their_places_in_any_row_blocks(cases, tmp_path, fmt):
    """Each weight is encoded as its rows arrive: written in order (one worker) or at their places (three), in row
    blocks of any size (a few rows, or whole tensors), the files are the same bytes."""
    _, base, adapter, _ = cases("llama")
    outs = []
    for i, (workers, chunk) in enumerate([(1, 1000), (3, 3000), (2, 1 << 22)]):
        out = str(tmp_path / f"o{i}")
        merge_checkpoint(
            base,
            adapter,
            out,
            quantize=fmt,
            workers=workers,
            chunk_elems=chunk,
            max_shard_size="300KB",
            progress=False,
        )
        outs.append(
            {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out) if f.endswith(".safetensors")}
        )
    assert len(outs[0]) > 1 and outs[0] == outs[1] == outs[2]
