"""One exact 4-bit dequantization on every path (peft_shardmerge.quant.nf4.dequantize_state, used by live_bnb,
quant_bnb
and verify's logits reference), checked against the NF4 definition written here from the spec, on rows that are
not whole 64-value blocks (hidden size 96), where bitsandbytes' CPU dequantize_4bit is wrong."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from peft_shardmerge import merge_and_save, merge_checkpoint
from peft_shardmerge.testing import build_base, perturb_trainable
from peft_shardmerge.verify.logits import dequantized_base
from peft_shardmerge.verify.report import verify_checkpoint
from tests.helpers import nf4_by_hand


@pytest.fixture(scope="module")
def odd_rows(tmp_path_factory):
    """A tiny Llama with 96-wide rows (and 160-wide MLP rows) loaded in 4-bit NF4 with double quant on the CPU,
    saved quantized, then given a LoRA adapter (B moved off zero) that is saved too."""
    root = tmp_path_factory.mktemp("odd-rows")
    base = build_base(
        str(root / "base"),
        "llama",
        hidden_size=96,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, device_map="cpu", dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False  # keep bitsandbytes' usual packing
    model.save_pretrained(str(root / "q4"))
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj", "down_proj"])
    )
    torch.manual_seed(0)
    perturb_trainable(peft_model, 0.05)
    peft_model.save_pretrained(str(root / "adapter"))
    return root, base, peft_model


def _expected(peft_model) -> dict[str, torch.Tensor]:
    """Per 4-bit weight (plain transformers name): the NF4 definition by hand, plus PEFT's fp32 LoRA delta."""
    out = {}
    for name, m in peft_model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            w = m.weight
            value = nf4_by_hand(w.data, w.quant_state)
            layer = peft_model.get_submodule(name.removesuffix(".base_layer"))
            if name.endswith(".base_layer"):
                value = value + layer.get_delta_weight("default").float()
            out[name.removeprefix("base_model.model.").removesuffix(".base_layer") + ".weight"] = value
    return out


def test_merge_and_save_of_odd_rows_equals_the_nf4_definition_plus_peft_delta(odd_rows, tmp_path):
    """In process, into the dequantized 4-bit base: each weight is the definition + PEFT's delta (bitsandbytes'
    CPU dequantize_4bit was 0.04 off on these rows)."""
    _, _, peft_model = odd_rows
    merge_and_save(peft_model, str(tmp_path / "live"), base_precision="dequantized", dtype="float32", progress=False)
    got = load_file(str(tmp_path / "live" / "model.safetensors"))
    expected = _expected(peft_model)
    assert len(expected) == 14
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=2e-7, msg=name)


def test_in_process_and_disk_merges_of_the_same_4bit_model_are_equal(odd_rows, tmp_path):
    """merge_and_save and merge_checkpoint of the saved 4-bit model give the same bytes."""
    root, _, peft_model = odd_rows
    merge_and_save(peft_model, str(tmp_path / "live"), base_precision="dequantized", dtype="float32", progress=False)
    merge_checkpoint(str(root / "q4"), str(root / "adapter"), str(tmp_path / "disk"), dtype="float32", progress=False)
    live = load_file(str(tmp_path / "live" / "model.safetensors"))
    disk = load_file(str(tmp_path / "disk" / "model.safetensors"))
    assert live.keys() == disk.keys()
    for name in live:
        assert torch.equal(live[name], disk[name]), name


def test_verify_logits_reference_of_a_4bit_base_is_the_nf4_definition(odd_rows):
    """verify's reference model for a bitsandbytes base holds the definition's weights, not bitsandbytes' CPU
    dequantization."""
    root, _, peft_model = odd_rows
    model = dequantized_base(AutoModelForCausalLM, str(root / "q4"))
    params = dict(model.named_parameters())
    for name, m in peft_model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            key = name.removeprefix("base_model.model.").removesuffix(".base_layer") + ".weight"
            assert torch.equal(params[key], nf4_by_hand(m.weight.data, m.weight.quant_state)), key


def test_verify_of_a_disk_merge_over_a_4bit_base_with_odd_rows_is_ok(odd_rows, tmp_path):
    """verify OUT --base (4-bit, 96-wide rows) --adapter: the logits check passes (it FAILED at 0.31)."""
    root, _, _ = odd_rows
    out = str(tmp_path / "disk")
    merge_checkpoint(str(root / "q4"), str(root / "adapter"), out, dtype="float32", progress=False)
    report = verify_checkpoint(out, base=str(root / "q4"), adapter=str(root / "adapter"))
    assert report.status == "OK", report.summary()
    assert any(c.startswith("logits vs") for c in report.checks)


def test_verify_of_an_in_process_merge_with_odd_rows_is_ok(odd_rows, tmp_path):
    """verify OUT --base (the 16-bit original) --adapter of merge_and_save's output: the re-quantized reference and
    the logits agree with the merge."""
    root, base, peft_model = odd_rows
    out = str(tmp_path / "live")
    merge_and_save(peft_model, out, base_precision="dequantized", dtype="float32", progress=False)
    report = verify_checkpoint(out, base=base, adapter=str(root / "adapter"))
    assert report.status == "OK", report.summary()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_state_over_several_pieces_equals_bitsandbytes(quant_type, dtype):
    """A weight of whole 64-value rows (where bitsandbytes' CPU dequantize_4bit is right) spanning three pieces of
    PIECE_VALUES, the last one partial: bit for bit bitsandbytes' own dequantization."""
    import bitsandbytes.functional as F

    from peft_shardmerge.quant.nf4 import PIECE_VALUES, dequantize_state

    w = torch.randn(2 * PIECE_VALUES // 1024 + 3, 1024, generator=torch.Generator().manual_seed(1)).to(dtype)
    q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type=quant_type)
    got, want = dequantize_state(q, state), F.dequantize_4bit(q, state)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


@pytest.mark.parametrize("numel", [1, 63, 97, 2 * 65 + 1])
def test_dequantize_4bit_exact_of_an_odd_count_is_the_definition(numel):
    """Odd counts and partial last blocks (the last byte's low nibble unused): the NF4 definition written here."""
    from peft_shardmerge.quant.nf4 import dequantize_4bit_exact, require_bitsandbytes

    g = torch.Generator().manual_seed(numel)
    packed = torch.randint(0, 256, ((numel + 1) // 2,), dtype=torch.uint8, generator=g)
    absmax = torch.rand(-(-numel // 64), generator=g) + 0.5
    code = require_bitsandbytes().get_4bit_type("nf4", device="cpu")
    nibbles = torch.stack([packed.long() // 16, packed.long() % 16], dim=1).reshape(-1)[:numel]
    want = (code[nibbles] * absmax[torch.arange(numel) // 64]).to(torch.bfloat16)
    got = dequantize_4bit_exact(packed, absmax, code, 64, numel, torch.bfloat16)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_dequantize_state_from_an_unaligned_view_and_in_float32_is_the_same():
    """Packed bytes seen through a view at an odd byte offset (a slice of a flat parameter), and the float32 result
    a merge asks for: the same values as from aligned bytes, rounded to the state's dtype first."""
    import bitsandbytes.functional as F

    from peft_shardmerge.quant.nf4 import dequantize_state

    w = torch.randn(70, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    flat = torch.cat([torch.zeros(1, dtype=torch.uint8), q.reshape(-1)])
    unaligned = flat[1:]
    assert unaligned.storage_offset() == 1
    want = dequantize_state(q, state)
    assert torch.equal(dequantize_state(unaligned, state).view(torch.int16), want.view(torch.int16))
    wide = dequantize_state(q, state, torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, want.float())
