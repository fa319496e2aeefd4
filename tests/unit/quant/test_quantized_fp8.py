"""Fine-grained FP8 bases (DeepSeek-V3/R1, Qwen3 -FP8 layout) read from disk: every tensor against transformers'
dequantization, merges against PEFT's, bounded reads, and refusals of malformed checkpoints."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers.integrations.finegrained_fp8 as finegrained_fp8
from helpers import folder_tensors, logits_of, rel_err, tensor_bytes
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from peft_shardmerge import merge_and_save, merge_checkpoint, plan_checkpoint_merge
from peft_shardmerge.checkpoint.base_folder import open_checkpoint
from peft_shardmerge.errors import CorruptFileError, InputError
from peft_shardmerge.io.safetensors_io import RowReader, row_blocks
from peft_shardmerge.testing import tiny_config, token_ids

#: q/o [256, 256] and k/v [64, 256] fill their blocks' sides or sit inside one; gate/up [200, 256] and down
#: [256, 200] end in a partial block
SHAPES = dict(hidden_size=256, intermediate_size=200, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]
BF16_ULP = 2.0**-7  # spacing of bfloat16 numbers relative to the value (8 significant bits)


def quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn codes and float32 ``weight_scale_inv`` of ``w``, one scale per block (partial last blocks),
    as DeepSeek's and Qwen's FP8 releases store them."""
    rows, cols = w.shape
    b0, b1 = block or (rows, cols)
    grid = (math.ceil(rows / b0), math.ceil(cols / b1))
    q, s = torch.empty(rows, cols, dtype=torch.float8_e4m3fn), torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            piece = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].float()
            s[i, j] = piece.abs().max().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (piece / s[i, j]).to(torch.float8_e4m3fn)
    return q, (s if block else s.reshape(()))


def write_fp8_base(
    folder: str,
    *,
    block=(128, 128),
    dtype: str = "bfloat16",
    shards: int = 1,
    extra: dict | None = None,
    seed: int = 0,
) -> str:
    """A tiny Llama saved as a fine-grained FP8 release: linear weights FP8 with their scales, norms, embeddings and
    lm_head in bf16 (modules_to_not_convert), config.json with the quantization_config, ``shards`` files."""
    torch.manual_seed(seed)
    config = tiny_config("llama", **SHAPES)
    model = AutoModelForCausalLM.from_config(config)
    tensors = {}
    for name, w in model.state_dict().items():
        if name.endswith("_proj.weight"):
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize(w, block)
        else:
            tensors[name] = w.to(torch.bfloat16).contiguous()
    tensors.update(extra or {})
    os.makedirs(folder, exist_ok=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_file(part, os.path.join(folder, file), metadata={"format": "pt"})
            weight_map.update({n: file for n in part})
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": weight_map,
        }
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    cfg = config.to_dict()
    cfg.update(
        dtype=dtype,
        architectures=["LlamaForCausalLM"],
        quantization_config={
            "quant_method": "fp8",
            "weight_block_size": list(block) if block else None,
            "activation_scheme": "dynamic",
            "modules_to_not_convert": ["model.embed_tokens", "lm_head"],
        },
    )
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return folder


def transformers_reference(folder: str, block, *, float32: bool = False) -> dict[str, torch.Tensor]:
    """Each FP8 weight dequantized by transformers' ``_dequantize_fp8_weight`` (its FP8 matmul's dequantization,
    which takes the block size and reads partial last blocks), in float32, cast once to the model's dtype (left in
    float32 with ``float32``)."""
    with open(os.path.join(folder, "config.json")) as f:
        dtype = torch.float32 if float32 else getattr(torch, json.load(f)["dtype"])
    raw = folder_tensors(folder)
    return {
        k: finegrained_fp8._dequantize_fp8_weight(
            q, raw[k[:-6] + "weight_scale_inv"], list(block) if block else None, torch.float32
        ).to(dtype)
        for k, q in raw.items()
        if q.dtype == torch.float8_e4m3fn
    }


def load_dequantized(folder: str, block):
    """The base as transformers loads it on the CPU: ``FineGrainedFP8Config(dequantize=True)``."""
    model, info = AutoModelForCausalLM.from_pretrained(
        folder,
        quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=block),
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def fills_blocks(shape, block) -> bool:
    return block is None or all(side % b == 0 or side < b for side, b in zip(shape, block))


def read_logical(folder: str, step: int = 48) -> dict[str, torch.Tensor]:
    """Every dequantized tensor of our view, read in row blocks of ``step`` rows."""
    src = open_checkpoint(folder)
    with RowReader() as reader:
        return {
            t.name: torch.cat([reader.read_rows(t, a, min(a + step, t.shape[0])) for a in range(0, t.shape[0], step)])
            for t in src.tensors
            if t.decoder is not None
        }


@pytest.mark.parametrize("block,dtype", [((128, 128), "bfloat16"), ((64, 8), "float16"), (None, "float32")])
def test_every_weight_reads_as_transformers_dequantizes_it(tmp_path, block, dtype):
    # a per-tensor activation scale, which transformers reads with the weight and drops when it dequantizes
    extra = {"model.layers.0.self_attn.q_proj.activation_scale": torch.tensor(0.25)} if block is None else {}
    folder = write_fp8_base(str(tmp_path / "base"), block=block, dtype=dtype, extra=extra)
    ours, reference = read_logical(folder), transformers_reference(folder, block)
    loaded = load_dequantized(folder, block).state_dict()
    src = open_checkpoint(folder)
    assert "fine-grained FP8" in src.quantized.method and src.quantized.dequantized == 14
    assert src.quantized.consumed == 14 + len(extra)
    assert [t.name for t in src.tensors] == [t.name for t in src.stored if t.name in loaded]  # stored order
    assert set(ours) == set(reference) and len(ours) == 14
    loader_gap = {}
    for name, rows in ours.items():  # rows are float32, cast once when written (or after the delta is added)
        assert rows.dtype == torch.float32 and loaded[name].dtype == getattr(torch, dtype)
        rows = rows.to(loaded[name].dtype)
        assert torch.equal(rows, reference[name]), name
        if fills_blocks(rows.shape, block):  # transformers' loader derives the right block from the scale grid
            assert torch.equal(rows, loaded[name]), name
        else:
            loader_gap[name] = float((rows.float() - loaded[name].float()).abs().max())
    print(f"block {block}: bit for bit with transformers; its loader differs on partial blocks by {loader_gap}")
    for t in src.tensors:  # bf16 norms, embeddings and lm_head are passed through as stored
        if t.decoder is None:
            assert t == next(s for s in src.stored if s.name == t.name)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """A base in the FP8 layout (one file and three shards), a LoRA adapter made by PEFT on transformers'
    dequantized base, and PEFT's float32 merge of it on the FP8 weights as the format defines them, in float32."""
    root = tmp_path_factory.mktemp("fp8")
    base = write_fp8_base(str(root / "base"))
    sharded = write_fp8_base(str(root / "sharded"), shards=3)
    reference = transformers_reference(base, (128, 128))
    model = load_dequantized(base, (128, 128))
    with torch.no_grad():  # the loader's partial blocks are not the format's (test above): set the format's values
        for name, p in model.named_parameters():
            if name in reference:
                p.copy_(reference[name])
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False))
    adapter = str(root / "adapter")
    peft_model.save_pretrained(adapter)
    ref_base = AutoModelForCausalLM.from_config(model.config).float()
    ref_base.load_state_dict({**base_state, **transformers_reference(base, (128, 128), float32=True)})  # FP8 exact
    ref = PeftModel.from_pretrained(ref_base, adapter).eval()
    ids = token_ids(model.config.vocab_size, seed=0)
    with torch.no_grad():
        unmerged_logits = ref(input_ids=ids).logits
    merged = ref.merge_and_unload()
    out = str(root / "merged")
    merge_checkpoint(base, adapter, out, dtype="bfloat16", progress=False)
    return dict(
        root=root,
        base=base,
        sharded=sharded,
        adapter=adapter,
        base_state=base_state,
        out=out,
        ids=ids,
        merged_fp32={k: v.clone() for k, v in merged.state_dict().items()},
        merged_model=merged,
        unmerged_logits=unmerged_logits,
    )


def check_against_peft(out: str, fp8: dict) -> dict[str, float]:
    """Every tensor of a merged folder against PEFT's float32 merge of the dequantized base: tensors without LoRA
    bit for bit, merged ones within one bfloat16 rounding of it; returns the largest difference of each kind."""
    got, ref, base = folder_tensors(out), fp8["merged_fp32"], fp8["base_state"]
    assert set(got) == set(ref)
    worst = {"untouched": 0.0, "merged": 0.0, "merged_ulps": 0.0}
    for name, t in got.items():
        assert t.dtype == torch.bfloat16, name
        if any(f"{m}." in name for m in TARGETS):
            diff = (t.float() - ref[name]).abs()
            assert bool((diff <= ref[name].abs() * BF16_ULP).all()), name
            worst["merged"] = max(worst["merged"], float(diff.max()))
            worst["merged_ulps"] = max(worst["merged_ulps"], float((diff / (ref[name].abs() * BF16_ULP)).max()))
        else:
            assert torch.equal(t, base[name].to(torch.bfloat16)), name
    return worst


def test_disk_merge_matches_peft_on_the_dequantized_base(fp8):
    worst = check_against_peft(fp8["out"], fp8)
    with open(os.path.join(fp8["out"], "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    got = logits_of(fp8["out"], fp8["ids"])  # loads with no missing or unexpected keys
    with torch.no_grad():  # PEFT's merge cast to bfloat16, as ours is written
        bf16_ref = fp8["merged_model"].to(torch.bfloat16).float()(input_ids=fp8["ids"]).logits
        fp8["merged_model"].float()
    err_merged, err_unmerged = rel_err(got, bf16_ref), rel_err(got, fp8["unmerged_logits"])
    print(
        f"max |ours - PEFT merge|: untouched {worst['untouched']}, merged {worst['merged']:.3g} "
        f"({worst['merged_ulps']:.2f} bf16 ulp); logits rel. error vs PEFT merge in bf16 {err_merged:.3g}, "
        f"vs unmerged fp32 {err_unmerged:.3g}"
    )
    assert err_merged < 1e-3 and err_unmerged < 2e-2
    plan = plan_checkpoint_merge(fp8["base"], fp8["adapter"], str(fp8["root"] / "unused"), dtype="bfloat16")
    text = plan.describe()
    assert "fine-grained FP8" in text and "weight_scale_inv" not in text
    assert "model.layers.0.mlp.up_proj.weight" in text


@pytest.mark.slow
def test_sharded_base_through_the_cli_and_small_row_blocks_write_the_same(fp8):
    out = str(fp8["root"] / "cli")
    run = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", fp8["sharded"], fp8["adapter"], out, "--dtype", "bfloat16"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    small = str(fp8["root"] / "small-blocks")
    # 2048 elements = 8 rows of the [256, 256] FP8 weights, 1/32 of them; 200-column rows end mid-block
    merge_checkpoint(fp8["base"], fp8["adapter"], small, dtype="bfloat16", chunk_elems=2048, progress=False)
    want = folder_tensors(fp8["out"])
    for folder in (out, small):
        got = folder_tensors(folder)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), folder


def in_process_merge(fp8: dict, out: str, *, fix: bool) -> dict[str, torch.Tensor]:
    """merge_and_save of a PeftModel over the base loaded with ``dequantize=True``; with ``fix``, its weights set to
    the format's values first (transformers' loader reads partial blocks with another block size)."""
    model = load_dequantized(fp8["base"], (128, 128))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if fix and name.endswith("_proj.weight"):
                p.copy_(fp8["base_state"][name])
    merge_and_save(PeftModel.from_pretrained(model, fp8["adapter"]), out, dtype="bfloat16", progress=False)
    return folder_tensors(out)


def same_or_one_bf16_step(live: torch.Tensor, disk: torch.Tensor, name: str, base: torch.Tensor) -> bool:
    """Tensors without LoRA equal; LoRA-merged ones within one bf16 step (at the larger of the base weight and the
    results) of the disk merge: the model in memory holds the FP8 weights already rounded to bf16, the merge from
    disk adds the delta to their float32 values."""
    if not any(f"{m}." in name for m in TARGETS):
        return torch.equal(live, disk)
    larger = torch.maximum(base.float().abs(), torch.maximum(live.float().abs(), disk.float().abs()))
    return bool(((live.float() - disk.float()).abs() <= larger * BF16_ULP).all())


def test_in_process_merge_of_the_dequantized_model_equals_the_disk_merge(fp8):
    disk = folder_tensors(fp8["out"])
    raw = in_process_merge(fp8, str(fp8["root"] / "in-process-raw"), fix=False)
    gaps = {}
    for name, t in raw.items():  # where transformers' loader reads the format, both routes agree
        if fills_blocks(t.shape, (128, 128)) or not name.endswith("_proj.weight"):
            assert same_or_one_bf16_step(t, disk[name], name, fp8["base_state"][name]), name
        else:
            gaps[name] = float((t.float() - disk[name].float()).abs().max())
    print(f"in process, as transformers loads it: partial-block tensors differ by {gaps}")
    fixed = in_process_merge(fp8, str(fp8["root"] / "in-process"), fix=True)
    assert set(fixed) == set(disk) and all(
        same_or_one_bf16_step(fixed[k], disk[k], k, fp8["base_state"][k]) for k in disk
    )


def write_one_weight(folder: str, tensors: dict[str, torch.Tensor], qc: dict | None = None) -> str:
    """A checkpoint folder holding ``tensors`` and a config.json whose quantization_config is ``qc``."""
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = tiny_config("llama").to_dict()
    config.update(
        dtype="bfloat16",
        quantization_config=qc
        or {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    )
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def test_rows_read_only_their_bytes_of_a_weight_much_larger_than_a_row_block(tmp_path):
    torch.manual_seed(5)
    q, s = quantize(torch.randn(1000, 300) * 0.02, (128, 128))  # both sides end in a partial block
    folder = write_one_weight(
        str(tmp_path / "big"),
        {"big.weight": q, "big.weight_scale_inv": s, "norm.weight": torch.ones(300, dtype=torch.bfloat16)},
    )
    info = next(t for t in open_checkpoint(folder).tensors if t.name == "big.weight")
    want = finegrained_fp8._dequantize_fp8_weight(q, s, [128, 128], torch.float32)  # rows stay float32
    chunk = 4096  # 13 rows of 300; the FP8 weight is 300000 bytes
    peak = 0
    for start, stop in row_blocks(info.shape, chunk):
        reader = RowReader()
        rows = info.decoder.rows(reader, start, stop)
        peak = max(peak, reader.buffer_bytes())
        assert reader.buffer_bytes() <= (stop - start) * 300  # its own FP8 rows, or its few scale rows
        reader.close()
        assert torch.equal(rows, want[start:stop]), (start, stop)
    assert peak * 50 < q.numel()
    print(f"largest read buffer {peak} bytes for a {q.numel()}-byte FP8 weight")


def fp8_tensors(change: dict | None = None, drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """One FP8 weight [200, 160] with its scales and a bf16 norm, with ``change`` set and ``drop`` left out."""
    torch.manual_seed(6)
    q, s = quantize(torch.randn(200, 160), (128, 128))
    tensors = {"a.weight": q, "a.weight_scale_inv": s, "norm.weight": torch.ones(160, dtype=torch.bfloat16)}
    tensors.update(change or {})
    return {k: v for k, v in tensors.items() if k not in drop}


@pytest.mark.parametrize(
    "tensors,qc,error,words",
    [
        (fp8_tensors(drop=("a.weight_scale_inv",)), None, CorruptFileError, ["'a.weight'", "no 'a.weight_scale_inv'"]),
        (
            fp8_tensors({"a.weight_scale_inv": torch.ones(1, 2)}),
            None,
            CorruptFileError,
            ["'a.weight_scale_inv'", "[1, 2]", "needs [2, 2]"],
        ),
        (
            fp8_tensors({"a.weight_scale_inv": torch.ones(2, 2, dtype=torch.int32)}),
            None,
            CorruptFileError,
            ["'a.weight_scale_inv'", "I32"],
        ),
        (
            fp8_tensors({"b.weight_scale_inv": torch.ones(1, 1)}),
            None,
            CorruptFileError,
            ["'b.weight_scale_inv'", "'b.weight'", "missing"],
        ),
        (
            fp8_tensors({"norm.qscale_weight": torch.ones(1, 1)}),
            None,
            CorruptFileError,  # not copied into the output
            ["'norm.qscale_weight'", "'norm.weight'", "stored as BF16, not FP8"],
        ),
        (
            fp8_tensors({"a.input_scale": torch.ones(1)}),
            None,
            InputError,
            ["'a.input_scale'", "transformers does not"],
        ),
        (fp8_tensors({"c.bias": torch.ones(4, dtype=torch.float8_e4m3fn)}), None, InputError, ["'c.bias'", "2-D"]),
        ({"norm.weight": torch.ones(160, dtype=torch.bfloat16)}, None, InputError, ["no weight is stored as FP8"]),
    ]
    + [
        (
            fp8_tensors(),
            {"quant_method": "fp8", "weight_block_size": bad},
            InputError,
            ["weight_block_size", repr(bad)],
        )
        for bad in ([128], [0, 128], [128, -1], "128", [128.0, 128], [True, 128], [128, 128, 1])
    ]
    + [
        (fp8_tensors(), {"quant_method": "fp8", "activation_scheme": "per-token"}, InputError, ["activation_scheme"]),
        (fp8_tensors(), {"quant_method": "fp8", "modules_to_convert": ["embed"]}, InputError, ["modules_to_convert"]),
        (
            fp8_tensors(),
            {"quant_method": "fp8", "weight_block_size": None},
            CorruptFileError,
            ["'a.weight_scale_inv'", "[2, 2]", "weight_block_size is null"],
        ),
    ],
)
def test_malformed_fp8_checkpoints_are_refused_by_name(tmp_path, tensors, qc, error, words):
    folder = write_one_weight(str(tmp_path / "bad"), tensors, qc)
    with pytest.raises(error) as caught:
        open_checkpoint(folder)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_a_malformed_base_stops_the_merge_before_anything_is_written(tmp_path, fp8):
    folder = write_one_weight(str(tmp_path / "bad"), fp8_tensors({"a.weight_scale_inv": torch.ones(3, 2)}))
    out = tmp_path / "out"
    with pytest.raises(CorruptFileError, match="'a.weight_scale_inv' .* has shape \\[3, 2\\]"):
        merge_checkpoint(folder, fp8["adapter"], str(out), dtype="bfloat16", progress=False)
    assert not out.exists()


def test_verify_says_ok_for_a_merge_from_an_fp8_base(fp8):
    """verify's logits reference is the base dequantized by transformers with the format's blocks, not a quantized
    forward (which failed on the CPU) nor the loader's partial blocks."""
    from peft_shardmerge.verify.report import verify_checkpoint

    report = verify_checkpoint(fp8["out"], base=fp8["base"], adapter=fp8["adapter"])
    assert report.status == "OK" and "checked: logits vs base + adapter" in report.summary(), report.summary()


def test_a_merge_from_an_fp8_base_weighs_the_bytes_it_reads_not_the_dequantized_ones(fp8):
    plan = plan_checkpoint_merge(fp8["base"], fp8["adapter"], str(fp8["root"] / "weighed"), dtype="bfloat16")
    assert sum(plan.shard_io_bytes()) == tensor_bytes(fp8["base"]) + tensor_bytes(fp8["out"])
