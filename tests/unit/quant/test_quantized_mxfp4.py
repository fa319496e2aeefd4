"""MXFP4 (gpt-oss) base checkpoints: the dequantized view against transformers' own dequantized loading, merges
against PEFT's, bounded reads of the expert blocks, and malformed checkpoints refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from peft_shardmerge import merge_and_save, merge_checkpoint, plan_checkpoint_merge
from peft_shardmerge.checkpoint.base_folder import open_checkpoint
from peft_shardmerge.errors import CorruptFileError, InputError
from peft_shardmerge.io.safetensors_io import RowReader
from tests.helpers import folder_tensors

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 100, 200, 17, 3]])
PROJ = ("gate_up_proj", "down_proj")
QC = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def gpt_oss_config(**overrides):
    """A tiny gpt-oss config: hidden and intermediate sizes are multiples of 32, MXFP4's group."""
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
        dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kw.update(overrides)
    return transformers.GptOssConfig(**kw)


def stored_tensors(config, seed: int) -> dict[str, torch.Tensor]:
    """A random gpt-oss model's tensors as an MXFP4 checkpoint stores them: experts as U8 FP4 blocks
    ``[E, out, in/32, 16]`` with U8 E8M0 scales ``[E, out, in/32]`` (exponents 2**-11 .. 2**-6, as trained weights
    have), the rest bf16."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    out = {}
    for name, value in model.state_dict().items():
        if name.rsplit(".", 1)[-1] in PROJ:
            experts, fan_in, fan_out = value.shape
            out[name + "_blocks"] = torch.randint(0, 256, (experts, fan_out, fan_in // 32, 16), dtype=torch.uint8)
            out[name + "_scales"] = torch.randint(116, 122, (experts, fan_out, fan_in // 32), dtype=torch.uint8)
        else:
            out[name] = value.contiguous()
    return out


def write_checkpoint(folder, config, tensors: dict[str, torch.Tensor], *, shards: int = 1, qc=QC) -> str:
    """Save ``tensors`` with ``config.json`` (plus ``quantization_config``); with ``shards > 1`` consecutive names
    go to different shards, so each weight's blocks and scales lie in different files."""
    os.makedirs(folder, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    else:
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        wmap = {name: files[i % shards] for i, name in enumerate(names)}
        for f in files:
            save_file(
                {n: tensors[n] for n in names if wmap[n] == f}, os.path.join(folder, f), metadata={"format": "pt"}
            )
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wmap}, f)
    cfg = config.to_dict()
    cfg["architectures"] = ["GptOssForCausalLM"]
    if qc is not None:
        cfg["quantization_config"] = qc
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


def load_dequantized(folder, dtype=None):
    """transformers' own MXFP4 loading on the CPU: ``Mxfp4Config(dequantize=True)``."""
    kw = {"dtype": dtype} if dtype is not None else {}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True), output_loading_info=True, **kw
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def within_bf16_rounding(got: torch.Tensor, ref: torch.Tensor, delta: torch.Tensor) -> float:
    """max |got - ref|, asserting each element differs by no more than rounding ``delta`` and the sum to bfloat16
    can (one bf16 step of each)."""
    diff = (got.float() - ref.float()).abs()
    assert bool((diff <= (ref.float().abs() + delta.float().abs()) * 2.0**-7).all()), float(diff.max())
    return float(diff.max())


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The same MXFP4 checkpoint in one file and in three shards, and a LoRA adapter on attention and on the
    fused experts (``target_parameters``) made by PEFT on transformers' dequantized model."""
    root = tmp_path_factory.mktemp("mxfp4")
    config = gpt_oss_config()
    tensors = stored_tensors(config, seed=0)
    single = write_checkpoint(root / "base", config, tensors)
    sharded = write_checkpoint(root / "sharded", config, tensors, shards=3)
    torch.manual_seed(1)
    # init_lora_weights=False: random factors, a delta as large as the weights themselves
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    peft.get_peft_model(load_dequantized(single), lora).save_pretrained(root / "adapter")
    return {"single": single, "sharded": sharded, "adapter": str(root / "adapter"), "root": root}


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_view_is_transformers_dequantized_model(bases, layout):
    ref = load_dequantized(bases[layout]).state_dict()
    src = open_checkpoint(bases[layout])
    assert sorted(t.name for t in src.tensors) == sorted(ref)
    assert src.quantized.dequantized == src.quantized.consumed == 4 and "MXFP4" in src.quantized.method
    with RowReader() as reader:
        for t in src.tensors:
            got = reader.read(t)
            assert got.dtype == ref[t.name].dtype and torch.equal(got, ref[t.name]), t.name
    assert "transformers.integrations.mxfp4.convert_moe_packed_tensors" in src.quantized.note(torch.bfloat16)


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_merge_matches_peft(bases, layout):
    out = str(bases["root"] / f"merged-{layout}")
    plan = plan_checkpoint_merge(bases[layout], bases["adapter"], out)
    assert "MXFP4" in plan.describe()
    merge_checkpoint(bases[layout], bases["adapter"], out, progress=False)
    got = folder_tensors(out)
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)

    base = load_dequantized(bases[layout])
    untouched = {k: v.clone() for k, v in base.state_dict().items()}
    peft_bf16_model = peft.PeftModel.from_pretrained(base, bases["adapter"]).merge_and_unload()
    peft_bf16 = {k: v.clone() for k, v in peft_bf16_model.state_dict().items()}
    peft_fp32 = (
        peft.PeftModel.from_pretrained(load_dequantized(bases[layout]).float(), bases["adapter"])
        .merge_and_unload()
        .state_dict()
    )
    assert set(got) == set(peft_bf16) == set(untouched)
    merged = [k for k in got if not torch.equal(untouched[k], peft_fp32[k].to(torch.bfloat16))]
    assert set(merged) >= {
        f"model.layers.{i}.{m}"
        for i in (0, 1)
        for m in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj.weight")
    }
    worst = 0.0
    for k, v in got.items():
        assert v.dtype == untouched[k].dtype
        assert torch.equal(v, peft_fp32[k].to(torch.bfloat16)), k  # PEFT's float32 merge, rounded once
        if k in merged:
            worst = max(
                worst, within_bf16_rounding(v, peft_bf16[k], peft_fp32[k] - untouched[k].float())
            )  # PEFT's merge in bfloat16
        else:
            assert torch.equal(v, untouched[k]), k
    assert worst > 0  # PEFT's bf16 merge rounds the delta first; ours rounds once

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert getattr(reloaded.config, "quantization_config", None) is None
    trained = peft.PeftModel.from_pretrained(load_dequantized(bases[layout], torch.float32), bases["adapter"]).eval()
    with torch.no_grad():
        ref_logits = trained(input_ids=IDS).logits
        logits = reloaded.eval()(input_ids=IDS).logits
        peft_logits = peft_bf16_model.float().eval()(input_ids=IDS).logits
    err = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    peft_err = float((peft_logits - ref_logits).abs().max() / ref_logits.abs().max())
    print(
        f"{layout}: logits vs the unmerged adapter {err:.3g} (PEFT's bf16 merge: {peft_err:.3g}); "
        f"merged experts vs PEFT's bf16 merge {worst:.3g}"
    )
    assert err < 3e-2 and err <= 2 * peft_err + 1e-3, (err, peft_err)


def test_output_names_are_the_unquantized_models(bases):
    """The merged keys are the dequantized model's state dict, which is what an unquantized gpt-oss saves."""
    out = str(bases["root"] / "merged-names")
    merge_checkpoint(bases["single"], bases["adapter"], out, progress=False)
    plain = transformers.AutoModelForCausalLM.from_config(gpt_oss_config())
    plain.save_pretrained(bases["root"] / "plain")
    assert set(folder_tensors(out)) == set(folder_tensors(bases["root"] / "plain"))


@pytest.mark.slow
def test_cli_writes_the_api_merge(bases):
    api_out, cli_out = str(bases["root"] / "api"), str(bases["root"] / "cli")
    merge_checkpoint(bases["sharded"], bases["adapter"], api_out, progress=False)
    proc = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", bases["sharded"], bases["adapter"], cli_out],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = folder_tensors(api_out), folder_tensors(cli_out)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_in_process_merge_of_the_dequantized_model(bases):
    disk = str(bases["root"] / "disk")
    merge_checkpoint(bases["single"], bases["adapter"], disk, progress=False)
    model = peft.PeftModel.from_pretrained(load_dequantized(bases["single"]), bases["adapter"])
    live = str(bases["root"] / "live")
    merge_and_save(model, live, progress=False)
    a, b = folder_tensors(disk), folder_tensors(live)
    assert set(a) == set(b)
    # in memory as from disk, LoRA on the experts is multiplied in float32 and rounded once, with the sum (PEFT's
    # own get_delta_weight would round the delta to bfloat16 first)
    for k in a:
        assert torch.equal(a[k], b[k]), k


class RecordingReader(RowReader):
    """A reader that records which stored rows are read."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def read_rows(self, info, start, stop):
        if info.decoder is None:
            self.calls.append((info.name, start, stop))
        return super().read_rows(info, start, stop)


def test_rows_read_only_the_requested_experts(tmp_path):
    config = gpt_oss_config(
        num_local_experts=48, num_hidden_layers=1, layer_types=["full_attention"], intermediate_size=96
    )
    folder = write_checkpoint(tmp_path / "many", config, stored_tensors(config, seed=5))
    ref = load_dequantized(folder).state_dict()
    src = open_checkpoint(folder)
    for t in (t for t in src.tensors if t.decoder is not None):
        blocks, scales = t.decoder.stored
        per_expert = blocks.nbytes // blocks.shape[0]
        for start in range(0, 48, 5):
            stop = min(start + 5, 48)
            reader = RecordingReader()
            rows = reader.read_rows(t, start, stop)
            assert rows.shape == (stop - start, *t.shape[1:]) and torch.equal(rows, ref[t.name][start:stop])
            assert reader.calls == [(blocks.name, start, stop), (scales.name, start, stop)]
            assert reader.buffer_bytes() <= (stop - start) * per_expert < blocks.nbytes // 8
            reader.close()


def _break(tensors, how):
    name = "model.layers.1.mlp.experts.down_proj"
    if how == "scales missing":
        del tensors[name + "_scales"]
    elif how == "shapes disagree":
        tensors[name + "_scales"] = tensors[name + "_scales"][:, :-1].contiguous()
    elif how == "blocks not U8":
        tensors[name + "_blocks"] = tensors[name + "_blocks"].to(torch.int16)
    elif how == "blocks missing":
        del tensors[name + "_blocks"]
    return name


@pytest.mark.parametrize("how", ["scales missing", "shapes disagree", "blocks not U8", "blocks missing"])
def test_malformed_checkpoint_is_refused(tmp_path, bases, how):
    config = gpt_oss_config()
    tensors = stored_tensors(config, seed=0)
    name = _break(tensors, how)
    folder = write_checkpoint(tmp_path / "bad", config, tensors)
    out = tmp_path / "out"
    with pytest.raises(CorruptFileError) as e:
        merge_checkpoint(folder, bases["adapter"], str(out), progress=False)
    assert name in str(e.value) and "MXFP4" in str(e.value)
    assert not out.exists()


def test_config_and_weights_disagree(tmp_path, bases):
    config = gpt_oss_config()
    plain = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).state_dict()
    folder = write_checkpoint(tmp_path / "plain", config, {k: v.contiguous() for k, v in plain.items()})
    with pytest.raises(InputError, match="no tensor is stored as MXFP4"):
        merge_checkpoint(folder, bases["adapter"], str(tmp_path / "out"), progress=False)
    wider = gpt_oss_config(intermediate_size=96)
    folder = write_checkpoint(tmp_path / "wider", wider, stored_tensors(config, seed=0))
    with pytest.raises(CorruptFileError, match="config and the weights disagree"):
        open_checkpoint(folder)
    assert not (tmp_path / "out").exists()
    shutil.rmtree(folder)


def test_param_delta_lays_out_experts_as_peft_does(bases):
    """param_delta multiplies in float32 what PEFT's get_delta_weight multiplies; on a float32 model PEFT does not
    round, so the two must be equal: a layout drift in PEFT shows here."""
    from peft_shardmerge.engine.changes import param_delta

    model = peft.PeftModel.from_pretrained(load_dequantized(bases["single"], dtype=torch.float32), bases["adapter"])
    wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert wrappers
    for layer in wrappers:
        ours, theirs = param_delta(layer, "default"), layer.get_delta_weight("default").float()
        assert ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)
        assert ours.abs().max() > 0


def test_verify_says_ok_for_a_merge_from_an_mxfp4_base(bases):
    from peft_shardmerge.verify.report import verify_checkpoint

    out = str(bases["root"] / "verified")
    merge_checkpoint(bases["single"], bases["adapter"], out, progress=False)
    report = verify_checkpoint(out, base=bases["single"], adapter=bases["adapter"])
    assert report.status == "OK" and "checked: logits vs base + adapter" in report.summary(), report.summary()
