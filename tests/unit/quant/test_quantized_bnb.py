"""bitsandbytes-quantized bases on disk (4-bit NF4/FP4 with and without double quant, 8-bit LLM.int8), merged from
the folder transformers' save_pretrained writes, against transformers' own model.dequantize() and PEFT's merge."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

bnb = pytest.importorskip("bitsandbytes")

from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.api.disk import plan_checkpoint_merge
from peft_shardmerge.api.inprocess import merge_and_save
from peft_shardmerge.checkpoint.base_folder import open_checkpoint
from peft_shardmerge.errors import CorruptFileError, InputError
from peft_shardmerge.io.safetensors_io import RowReader, row_blocks
from peft_shardmerge.testing import build_adapter, build_base, token_ids
from tests.helpers import folder_tensors, logits_of, no_cpu_repack, rel_err

KINDS = {
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False),
    "fp4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False),
    "int8": dict(load_in_8bit=True),
    # weights of skipped modules are stored unquantized and pass through
    "nf4-skip": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", llm_int8_skip_modules=["down_proj", "lm_head"]),
    "int8-skip": dict(load_in_8bit=True, llm_int8_skip_modules=["o_proj", "lm_head"]),
}
METHODS = {
    "nf4-double": "bitsandbytes 4-bit (nf4, double quant)",
    "nf4": "bitsandbytes 4-bit (nf4)",
    "fp4-double": "bitsandbytes 4-bit (fp4, double quant)",
    "fp4": "bitsandbytes 4-bit (fp4)",
    "int8": "bitsandbytes 8-bit (LLM.int8)",
    "nf4-skip": "bitsandbytes 4-bit (nf4)",
    "int8-skip": "bitsandbytes 8-bit (LLM.int8)",
}
MEASURED: dict[str, float] = {}


def save_quantized(base: str, folder: str, kind: str, **save) -> str:
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=BitsAndBytesConfig(**KINDS[kind]), device_map="cpu"
    )
    no_cpu_repack(model)
    model.save_pretrained(folder, **save)
    return folder


def dequantized(folder: str):
    """transformers' own dequantization of a saved bitsandbytes checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    no_cpu_repack(model)
    return model.dequantize()


def compare(
    ours: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    merged: set[str],
    base: dict[str, torch.Tensor],
    kind: str = "",
) -> float:
    """Untouched tensors equal bit for bit; merged ones within the dtype's rounding (and moved off the dequantized
    base). Returns the largest merged difference relative to the tensor's largest value.

    int8: ours adds the delta to the float32 dequantized weight and casts once; transformers' dequantize() rounds
    the weight to bf16 first and PEFT's bf16 merge rounds the delta too: two bf16 steps at most, at the larger of
    the base weight and the results."""
    assert set(ours) == set(ref) == set(base)
    worst = 0.0
    for name, r in ref.items():
        assert ours[name].dtype == r.dtype and ours[name].shape == r.shape, name
        if name in merged:
            assert not torch.equal(r, base[name]), name
            if kind.startswith("int8"):
                larger = torch.maximum(base[name].float().abs(), torch.maximum(ours[name].float().abs(), r.abs()))
                assert bool(((ours[name].float() - r.float()).abs() <= larger * 2.0**-6).all()), name
            else:
                torch.testing.assert_close(ours[name], r, msg=name)
            worst = max(worst, rel_err(ours[name].float(), r.float()))
        else:
            assert torch.equal(ours[name], r), name
    return worst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb")
    base = build_base(str(root / "base"), dtype=torch.bfloat16)
    adapter = build_adapter(base, str(root / "adapter"), init_lora_weights=False)
    return root, base, adapter


def merged_names(ref_model) -> set[str]:
    return {n for n, m in ref_model.named_modules() if hasattr(m, "lora_A")}


@pytest.mark.parametrize("kind", list(KINDS))
def test_merge_equals_transformers_dequantize_then_peft_merge(tiny, kind):
    root, base, adapter = tiny
    folder = save_quantized(base, str(root / kind), kind)
    deq = dequantized(folder)
    before = {k: v.clone() for k, v in deq.state_dict().items()}
    peft_model = PeftModel.from_pretrained(deq, adapter)
    merged = {n.removeprefix("base_model.model.") + ".weight" for n in merged_names(peft_model)}
    ref_model = peft_model.merge_and_unload()
    ref = {k: v.contiguous() for k, v in ref_model.state_dict().items()}
    out = str(root / f"{kind}-out")
    merge_checkpoint(folder, adapter, out, progress=False)
    stored = open_checkpoint(folder).quantized
    assert stored.method == METHODS[kind] and stored.dequantized == (12 if kind.endswith("skip") else 14)
    ours = folder_tensors(out)
    MEASURED[kind] = compare(ours, ref, merged, before, kind)
    assert merged and merged <= set(ours)
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    ids = token_ids(512, batch=2, length=10, seed=3)
    with torch.no_grad():
        want = ref_model.float()(input_ids=ids).logits
    MEASURED[kind + " logits"] = rel_err(logits_of(out, ids), want)  # logits_of asserts no missing/unexpected keys
    assert MEASURED[kind + " logits"] < 1e-2
    print(f"{kind}: merged tensors max rel diff {MEASURED[kind]:.3g}, logits {MEASURED[kind + ' logits']:.3g}")


def test_unmerged_tensors_equal_transformers_dequantize_bit_for_bit_in_any_row_blocks(tiny):
    """Row blocks that cut quantization blocks and nested absmax blocks anywhere give transformers' tensors."""
    root, base, _ = tiny
    for kind in ("nf4-double", "fp4", "int8"):
        folder = save_quantized(base, str(root / f"rows-{kind}"), kind)
        ref = dequantized(folder).state_dict()
        ckpt = open_checkpoint(folder)
        assert ckpt.quantized.method == METHODS[kind] and ckpt.quantized.dequantized == 14
        assert {t.name for t in ckpt.tensors} == set(ref)
        reader = RowReader()
        for t in ckpt.tensors:
            for step in (1, 3, 5):
                got = torch.cat(
                    [reader.read_rows(t, a, min(a + step, t.shape[0])).clone() for a in range(0, t.shape[0], step)]
                )
                if kind == "int8" and t.decoder is not None:  # float32 rows, cast once when written
                    assert got.dtype == torch.float32
                    got = got.to(ref[t.name].dtype)
                assert got.dtype == ref[t.name].dtype and torch.equal(got, ref[t.name]), (kind, t.name, step)
        reader.close()


def test_sharded_save(tiny):
    root, base, adapter = tiny
    folder = save_quantized(base, str(root / "sharded"), "nf4-double", max_shard_size="60KB")
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    deq = dequantized(folder)
    before = {k: v.clone() for k, v in deq.state_dict().items()}
    peft_model = PeftModel.from_pretrained(deq, adapter)
    merged = {n.removeprefix("base_model.model.") + ".weight" for n in merged_names(peft_model)}
    ref = {k: v.contiguous() for k, v in peft_model.merge_and_unload().state_dict().items()}
    out = str(root / "sharded-out")
    merge_checkpoint(folder, adapter, out, progress=False, max_shard_size="100KB")
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
    MEASURED["sharded"] = compare(folder_tensors(out), ref, merged, before)


@pytest.mark.slow
def test_cli_and_plan_name_the_format(tiny):
    root, base, adapter = tiny
    folder = save_quantized(base, str(root / "cli"), "fp4-double")
    plan = plan_checkpoint_merge(folder, adapter, str(root / "cli-plan"))
    assert METHODS["fp4-double"] in plan.describe()
    out = str(root / "cli-out")
    run = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", folder, adapter, out],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    api_out = str(root / "cli-api-out")
    merge_checkpoint(folder, adapter, api_out, progress=False)
    a, b = folder_tensors(out), folder_tensors(api_out)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


class CountingReader(RowReader):
    """A RowReader that records the bytes of every stored piece it reads."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, int]] = []

    def read_rows(self, info, start, stop):
        if info.decoder is None:
            row = info.numel // info.shape[0] if info.shape else 1
            self.reads.append((info.name, (stop - start) * row * info.nbytes // max(info.numel, 1)))
        return super().read_rows(info, start, stop)


@pytest.mark.parametrize("kind", ["nf4-double", "int8"])
def test_rows_read_only_their_blocks(tmp_path, kind):
    """A weight far larger than the row block is never read whole: each row block reads a few KB of it."""
    base = build_base(str(tmp_path / "wide"), dtype=torch.bfloat16, intermediate_size=16384, num_hidden_layers=1)
    folder = save_quantized(base, str(tmp_path / "wide-q"), kind)
    ref = dequantized(folder).state_dict()
    ckpt = open_checkpoint(folder)
    info = max((t for t in ckpt.tensors if t.decoder is not None), key=lambda t: t.decoder.stored[0].nbytes)
    packed = info.decoder.stored[0].nbytes
    assert packed >= 1_000_000
    chunk = 16384
    blocks = row_blocks(info.shape, chunk)
    assert len(blocks) >= 128
    rows = []
    for a, b in blocks:
        reader = CountingReader()
        rows.append(info.decoder.rows(reader, a, b))
        largest = max(n for _, n in reader.reads)
        assert sum(n for _, n in reader.reads) < packed / 50, reader.reads
        assert largest <= chunk + 4096
        reader.close()
    assert torch.equal(torch.cat(rows).to(ref[info.name].dtype), ref[info.name])  # int8 rows: float32, cast once
    # the whole merge in row blocks that small: every tensor without LoRA is transformers' dequantized one
    adapter = build_adapter(base, str(tmp_path / "adapter"), target_modules=["q_proj"])
    merge_checkpoint(folder, adapter, str(tmp_path / "out"), progress=False, chunk_elems=chunk)
    ours = folder_tensors(str(tmp_path / "out"))
    assert all(torch.equal(ours[k], v) for k, v in ref.items() if "q_proj" not in k)
    assert not torch.equal(
        ours["model.layers.0.self_attn.q_proj.weight"], ref["model.layers.0.self_attn.q_proj.weight"]
    )


def _rewrite(folder: str, drop=(), config=None) -> None:
    """Rewrite a single-file checkpoint without some tensors, or with config.json fields changed."""
    path = os.path.join(folder, "model.safetensors")
    tensors = {k: v for k, v in folder_tensors(folder).items() if not any(k.endswith(d) for d in drop)}
    save_file(tensors, path, metadata={"format": "pt"})
    if config is not None:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"].update(config)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)


@pytest.mark.parametrize(
    "kind, drop, config, error, match",
    [
        (
            "nf4-double",
            ["layers.0.self_attn.q_proj.weight.absmax"],
            None,
            CorruptFileError,
            r"q_proj.weight' has no .*q_proj.weight.absmax'",
        ),
        (
            "nf4-double",
            ["layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"],
            None,
            CorruptFileError,
            r"up_proj.weight' has no quant state",
        ),
        (
            "nf4",
            [".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4"],
            None,
            CorruptFileError,
            r"is stored as U8 but has no quant_state/absmax",
        ),
        (
            "fp4-double",
            ["layers.0.mlp.down_proj.weight.nested_absmax"],
            None,
            CorruptFileError,
            r"down_proj.weight' has no .*nested_absmax'",
        ),
        (
            "int8",
            ["layers.0.self_attn.v_proj.SCB"],
            None,
            CorruptFileError,
            r"v_proj.weight' has no .*v_proj.SCB' \(row scales\)",
        ),
        ("nf4", [], {"bnb_4bit_quant_storage": "bfloat16"}, InputError, r"packed into bfloat16"),
        (
            "int8",
            [],
            {"load_in_8bit": False, "load_in_4bit": True, "_load_in_4bit": True},
            CorruptFileError,
            r"8-bit piece, but config.json's quantization_config says 4-bit",
        ),
    ],
)
def test_malformed_bases_are_refused(tiny, kind, drop, config, error, match):
    root, base, adapter = tiny
    folder = save_quantized(base, str(root / f"bad-{kind}-{len(drop)}-{bool(config)}"), kind)
    _rewrite(folder, drop, config)
    with pytest.raises(error, match=match):
        merge_checkpoint(folder, adapter, str(root / "bad-out"), progress=False)
    assert not os.path.exists(root / "bad-out")


def test_conv1d_models_are_refused(tmp_path):
    """GPT-2's Conv1D weights are quantized transposed; model.dequantize() would write them as nn.Linear."""
    base = build_base(str(tmp_path / "gpt2"), "gpt2", dtype=torch.bfloat16)
    folder = save_quantized(base, str(tmp_path / "gpt2-q"), "nf4")
    adapter = build_adapter(base, str(tmp_path / "adapter"), target_modules=["c_attn"])
    with pytest.raises(InputError, match=r"\(gpt2\) has Conv1D projections"):
        merge_checkpoint(folder, adapter, str(tmp_path / "out"), progress=False)


def test_config_says_bitsandbytes_but_no_tensor_is_quantized(tiny):
    root, base, adapter = tiny
    folder = str(root / "claims-4bit")
    shutil.copytree(base, folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", **KINDS["nf4-double"]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(InputError, match=r"says bitsandbytes but no tensor is stored quantized"):
        merge_checkpoint(folder, adapter, str(root / "claims-out"), progress=False)


def test_in_process_merge_and_disk_merge_agree(tiny):
    """merge_and_save of a PeftModel on the 4-bit model loaded from the saved folder, and merge_checkpoint of that
    folder, write the same tensors (to the output dtype's rounding)."""
    root, base, adapter = tiny
    folder = save_quantized(base, str(root / "live"), "nf4-double")
    model = AutoModelForCausalLM.from_pretrained(folder)
    no_cpu_repack(model)
    model = PeftModel.from_pretrained(model, adapter)
    live_out, disk_out = str(root / "live-out"), str(root / "disk-out")
    merge_and_save(model, live_out, progress=False)
    merge_checkpoint(folder, adapter, disk_out, progress=False)
    live, disk = folder_tensors(live_out), folder_tensors(disk_out)
    assert set(live) == set(disk)
    worst = 0.0
    for k in live:
        assert live[k].dtype == disk[k].dtype, k
        torch.testing.assert_close(live[k], disk[k], msg=k)
        worst = max(worst, rel_err(live[k].float(), disk[k].float()))
    MEASURED["in-process vs disk"] = worst
    print(f"in-process vs disk: max rel diff {worst:.3g}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4-double", "fp4"])
def test_rows_of_weights_whose_rows_do_not_fill_quantization_blocks(tmp_path, kind):
    """Row lengths 68 and 131 are not multiples of the block size (64): every single row, cut anywhere inside a
    quantization block, equals transformers' dequantization."""
    from peft_shardmerge.checkpoint.base_folder import open_checkpoint

    base = build_base(
        str(tmp_path / "base"),
        dtype=torch.bfloat16,
        hidden_size=68,
        intermediate_size=131,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    folder = save_quantized(base, str(tmp_path / kind), kind)
    ref = dequantized(folder).state_dict()
    src = open_checkpoint(folder)
    reader = RowReader()
    try:
        for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"):
            info = src.by_name[name]
            assert info.shape[1] % 64 and info.decoder is not None
            for s in range(info.shape[0]):
                assert torch.equal(info.decoder.rows(reader, s, s + 1)[0], ref[name][s]), (name, s)
    finally:
        reader.close()


def test_verify_says_ok_for_a_merge_from_an_odd_sided_4bit_base(tmp_path):
    """Sides of 68 and 131 are not multiples of bitsandbytes' CPU kernel block: verify's reference is the base
    dequantized by transformers, not that kernel's forward (which asserted), and the merge is read in row blocks
    that cut quantization blocks."""
    from peft_shardmerge.options import MergeOptions
    from peft_shardmerge.verify.report import verify_checkpoint

    base = build_base(
        str(tmp_path / "base"),
        dtype=torch.bfloat16,
        hidden_size=68,
        intermediate_size=131,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    adapter = build_adapter(base, str(tmp_path / "adapter"), init_lora_weights=False)
    folder = save_quantized(base, str(tmp_path / "nf4"), "nf4-double")
    out = str(tmp_path / "merged")
    merge_checkpoint(folder, adapter, out, options=MergeOptions(chunk_elems=137, progress=False))
    report = verify_checkpoint(out, base=folder, adapter=adapter)
    assert report.status == "OK" and "checked: logits vs base + adapter" in report.summary(), report.summary()
