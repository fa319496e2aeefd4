"""merge_and_save on a live QLoRA model: real bitsandbytes on CPU, a real optimizer step, PEFT as reference."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from peft_shardmerge.api.inprocess import merge_and_save
from peft_shardmerge.testing import default_targets, token_ids
from tests.helpers import add_adapter_or_skip, load_quantized, logits_of, no_cpu_repack, rel_err


def train_one_step(model, vocab: int, steps: int = 2) -> None:
    """A real optimizer step, so that every LoRA B moves off zero."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    ids = token_ids(vocab, batch=2, length=12, seed=7)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def qlora(base: str, arch: str, quant: str = "nf4", compute_dtype=torch.float32, double_quant=True, **lora):
    model = load_quantized(base, quant, compute_dtype, double_quant)
    no_cpu_repack(model)
    kw = dict(r=8, lora_alpha=16, target_modules=default_targets(arch), lora_dropout=0.0)
    if arch == "gpt2":
        kw["fan_in_fan_out"] = quant == "none"
    kw.update(lora)
    model = get_peft_model(model, LoraConfig(**kw))
    train_one_step(model, model.config.vocab_size)
    return model


def reference_logits(model, ids) -> torch.Tensor:
    """Logits of the unmerged PeftModel with every 4-bit layer computing in fp32."""
    saved = {}
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            saved[m] = m.compute_dtype
            m.compute_dtype = torch.float32
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits.float()
    finally:
        for m, d in saved.items():
            m.compute_dtype = d


def snapshot(model) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and 4-bit quant state, read without state_dict() (which, on a repacked
    Linear4bit, undoes the repacking in place)."""
    out = {k: v.detach().clone() for k, v in model.named_parameters()}
    out.update({k: v.detach().clone() for k, v in model.named_buffers()})
    for name, m in model.named_modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is not None:
            out[f"{name}::packed"] = torch.tensor(bool(getattr(qs, "packing_format_for_cpu", False)))
            out[f"{name}::absmax"] = qs.absmax.detach().clone()
    return out


def assert_unchanged(before, model) -> None:
    after = snapshot(model)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed"


def read_all(out: str) -> dict[str, torch.Tensor]:
    got = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(out, f), "pt") as h:
                assert h.metadata() == {"format": "pt"}
                got.update({k: h.get_tensor(k) for k in h.keys()})
    return got


def check_output(model, out: str, dtype: str, tol: float) -> None:
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = json.load(open(os.path.join(out, "config.json")))
    assert "quantization_config" not in config and config["dtype"] == dtype
    ids = token_ids(model.config.vocab_size, seed=3)
    ref = reference_logits(model, ids)
    with torch.no_grad():
        got = reloaded.eval()(input_ids=ids).logits
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < tol, err


QUANT_CASES = [(q, dq, cd) for q in ("nf4", "fp4") for dq in (True, False) for cd in (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize(
    "quant,double_quant,compute_dtype",
    QUANT_CASES,
    ids=[f"{q}-{'dq' if d else 'nodq'}-{str(c)[6:]}" for q, d, c in QUANT_CASES],
)
def test_4bit_llama(quant, double_quant, compute_dtype, make_base, tmp_path):
    model = qlora(make_base("llama"), "llama", quant, compute_dtype, double_quant)
    before = snapshot(model)
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", base_precision="dequantized", progress=False)
    assert report.base_precision == "dequantized"
    assert report.lora_modules_merged == report.lora_modules_total == 14
    assert_unchanged(before, model)
    check_output(model, out, "float32", 1e-5)
    check_lora_tensors(model, read_all(out))


def check_lora_tensors(model, got, transposed=()) -> None:
    """Every LoRA weight equals the dequantized base weight + PEFT's own get_delta_weight."""
    import bitsandbytes.functional as F

    checked = 0
    for name, m in model.base_model.model.named_modules():
        if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer"):
            w = m.base_layer.weight
            with torch.no_grad():
                if type(w).__name__ == "Params4bit":
                    base = F.dequantize_4bit(w.data, w.quant_state).float()
                elif type(w).__name__ == "Int8Params":
                    scb = w.SCB if getattr(w, "SCB", None) is not None else m.base_layer.state.SCB
                    base = F.int8_vectorwise_dequant(w.data, scb).float()
                else:
                    base = w.float()
                want = base + m.get_delta_weight("default").float()
            have = got[f"{name}.weight"].float()
            if f"{name}.weight" in transposed:
                have = have.T
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6, msg=lambda msg: f"{name}: {msg}")
            checked += 1
    assert checked


@pytest.mark.parametrize(
    "arch_base,quant", [("qwen2", "nf4"), ("gpt2", "nf4"), ("llama", "8bit"), ("llama", "none"), ("gpt2", "none")]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_architectures_and_quantizations(arch_base, quant, dtype, make_base, tmp_path):
    model = qlora(make_base(arch_base), arch_base, quant)
    before = snapshot(model)
    out = str(tmp_path / "m")
    report = merge_and_save(
        model, out, dtype=dtype, base_precision="dequantized", max_shard_size="200KB", progress=False
    )
    assert report.lora_modules_merged == report.lora_modules_total > 0
    assert len(report.shards) > 1
    assert_unchanged(before, model)
    # LLM.int8 quantizes activations too, so the unmerged 8-bit forward differs from fp32 maths by ~1%
    tol = 3e-2 if dtype == "bfloat16" or quant == "8bit" else 1e-5
    check_output(model, out, dtype, tol)
    if dtype == "float32":
        conv1d = {
            k
            for k in read_all(out)
            if arch_base == "gpt2"
            and quant != "none"
            and ".attn.c_" in k
            or arch_base == "gpt2"
            and quant != "none"
            and ".mlp.c_" in k
        }
        check_lora_tensors(model, read_all(out), transposed=conv1d)


def test_qwen2_tied_with_modules_to_save(make_base, tmp_path):
    model = qlora(make_base("qwen2"), "qwen2", "nf4", target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", base_precision="dequantized", progress=False)
    assert report.untied == ["lm_head.weight", "model.embed_tokens.weight"]
    assert json.load(open(os.path.join(out, "config.json")))["tie_word_embeddings"] is False
    check_output(model, out, "float32", 1e-5)


def test_cpu_repacked_weights_are_unpacked_not_garbage(make_base, tmp_path):
    """An eval forward on a CPU with AVX512-BF16 repacks Linear4bit weights in place; the merge still writes
    the right weights (to the bf16 block-scale precision the repacking kept) and says so."""
    import bitsandbytes.functional as F

    model = qlora(make_base("llama"), "llama", "nf4", torch.float32)
    want = {}
    for name, m in model.base_model.model.named_modules():
        if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer"):
            w = m.base_layer.weight
            with torch.no_grad():
                want[f"{name}.weight"] = F.dequantize_4bit(w.data, w.quant_state).float() + m.get_delta_weight(
                    "default"
                )
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = True
    with torch.no_grad():
        model(input_ids=token_ids(model.config.vocab_size))
    repacked = [
        m
        for m in model.modules()
        if isinstance(m, bnb.nn.Linear4bit) and getattr(m.weight.quant_state, "packing_format_for_cpu", False)
    ]
    if not repacked:
        pytest.skip("bitsandbytes did not repack on this CPU (no AVX512-BF16 kernel)")
    before = snapshot(model)
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", base_precision="dequantized", progress=False)
    assert_unchanged(before, model)
    assert any("repacked by bitsandbytes" in n for n in report.notes)
    got = read_all(out)
    for name, w in want.items():
        rel = float((got[name] - w).abs().max() / w.abs().max())
        assert rel < 2**-8, (name, rel)  # the bf16 block scales; garbage would be O(1)


def test_oom_on_one_module_is_retried_on_cpu(make_base, tmp_path, monkeypatch):
    import peft_shardmerge.model.reader as live_merger

    model = qlora(make_base("llama"), "llama", "nf4")
    real = live_merger.LiveMerger._merge_weight
    victim = "model.layers.0.mlp.up_proj.weight"
    calls = []

    def merge_weight(self, entry, device):
        calls.append((entry.name, device.type))
        if entry.name == victim and len([c for c in calls if c[0] == victim]) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(self, entry, device)

    monkeypatch.setattr(live_merger.LiveMerger, "_merge_weight", merge_weight)
    a = str(tmp_path / "a")
    report = merge_and_save(model, a, dtype="float32", base_precision="dequantized", progress=False)
    assert report.cpu_fallbacks == 1 and [c for c in calls if c[0] == victim] == [(victim, "cpu"), (victim, "cpu")]
    monkeypatch.undo()
    b = str(tmp_path / "b")
    merge_and_save(model, b, dtype="float32", base_precision="dequantized", progress=False)
    ga, gb = read_all(a), read_all(b)
    assert all(torch.equal(ga[k], gb[k]) for k in gb)


def test_original_uses_the_original_checkpoint(make_base, tmp_path):
    from peft_shardmerge.testing import compare_logits

    base = make_base("llama")
    model = qlora(base, "llama", "nf4")
    adapter = str(tmp_path / "adapter")
    model.save_pretrained(adapter)
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", base_precision="original", progress=False)
    assert report.base_precision == "original"
    assert any("merged into the original checkpoint" in n for n in report.notes)
    assert compare_logits(base, adapter, out) < 1e-4


def test_original_requested_but_missing(make_base, tmp_path):
    from peft_shardmerge import InputError

    model = qlora(make_base("llama"), "llama", "nf4")
    model.base_model.model.config._name_or_path = str(tmp_path / "gone")
    with pytest.raises(
        InputError,
        match=r"base_precision='original' cannot be used: the 16-bit checkpoint the "
        r"model was loaded from is not available locally \(.*gone",
    ):
        merge_and_save(model, str(tmp_path / "m"), base_precision="original", progress=False)
    report = merge_and_save(model, str(tmp_path / "m"), progress=False)
    assert report.base_precision == "dequantized" and "is not available locally" in report.notes[0]


@pytest.mark.parametrize("value", [0, 0.99, -1, "0.5", True])
def test_memory_budget_is_validated(value, make_base, tmp_path):
    from peft_shardmerge import InputError

    model = qlora(make_base("llama"), "llama", "nf4")
    with pytest.raises(InputError, match="maximum_memory_usage must be a fraction in"):
        merge_and_save(model, str(tmp_path / "m"), maximum_memory_usage=value, progress=False)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    "arch_base,quant", [("llama", "nf4"), ("qwen2", "nf4"), ("gpt2", "nf4"), ("llama", "8bit"), ("llama", "none")]
)
def test_merge_and_unload_gives_a_plain_model(arch_base, quant, make_base, tmp_path):
    from peft_shardmerge.api.unload import merge_and_unload

    model = qlora(
        make_base(arch_base),
        arch_base,
        quant,
        target_modules=None if arch_base != "qwen2" else ["q_proj", "v_proj", "embed_tokens"],
        **({"modules_to_save": ["lm_head"]} if arch_base == "qwen2" else {}),
    )
    out = str(tmp_path / "saved")
    merge_and_save(model, out, dtype="float32", base_precision="dequantized", progress=False)
    ids = token_ids(model.config.vocab_size, seed=3)
    ref = reference_logits(model, ids)
    plain = merge_and_unload(model, dtype=torch.float32)
    kinds = {type(m).__module__.split(".")[0] for m in plain.modules()}
    assert "peft" not in kinds and "bitsandbytes" not in kinds, kinds
    assert getattr(plain.config, "quantization_config", None) is None
    with torch.no_grad():
        got = plain.eval()(input_ids=ids).logits
    tol = 3e-2 if quant == "8bit" else 1e-5
    assert float((got - ref).abs().max() / ref.abs().max()) < tol
    # the same weights merge_and_save wrote, and it saves and reloads as a normal model
    saved = read_all(out)
    state = plain.state_dict()
    for k, v in saved.items():
        assert torch.equal(state[k].float(), v), k
    plain.save_pretrained(str(tmp_path / "plain"))
    again, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "plain"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.fixture()
def fake_hub(monkeypatch):
    import huggingface_hub.constants as hc
    from hub_server import FakeHub

    with FakeHub() as hub:
        monkeypatch.setattr(hc, "ENDPOINT", hub.url)
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        yield hub


def test_push_to_hub_merged_uploads_the_merged_folder(make_base, tmp_path, fake_hub, caplog):
    import logging

    from peft_shardmerge import push_to_hub_merged

    caplog.set_level(logging.DEBUG)
    base = make_base("llama")
    model = qlora(base, "llama", "nf4")
    secret = "hf_TESTtokenNEVERprinted123"
    url = push_to_hub_merged(
        model, "me/tiny-merged", token=secret, private=True, max_shard_size="300KB", dtype="bfloat16", progress=False
    )
    assert len(fake_hub.commits) == 1 and "/me/tiny-merged/commit/" in url
    files = fake_hub.files["me/tiny-merged"]
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert len(shards) > 1 and "model.safetensors.index.json" in files and "config.json" in files
    assert fake_hub.repos["me/tiny-merged"]["visibility"] == "private"
    card = files["README.md"].decode()
    assert card.startswith("---\n") and "| base precision | dequantized |" in card and "| dtype | bfloat16 |" in card
    assert all(a == f"Bearer {secret}" for a in fake_hub.auth)
    assert secret not in caplog.text and secret not in card
    # what was uploaded loads and equals a local merge
    local = tmp_path / "local"
    merge_and_save(model, str(local), dtype="bfloat16", max_shard_size="300KB", progress=False)
    for name in shards:
        assert files[name] == (local / name).read_bytes()


def test_save_pretrained_merged_methods(make_base, tmp_path, fake_hub):
    from peft_shardmerge import InputError, save_pretrained_merged

    model = qlora(make_base("llama"), "llama", "nf4")
    report = save_pretrained_merged(
        model, str(tmp_path / "m16"), save_method="merged_16bit", max_shard_size="300KB", progress=False
    )
    assert report.lora_modules_merged == 14 and len(report.shards) > 1
    assert save_pretrained_merged(model, str(tmp_path / "lora"), save_method="lora") is None
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists()
    assert save_pretrained_merged(model, str(tmp_path / "x"), is_main_process=False) is None
    assert not (tmp_path / "x").exists()
    with pytest.raises(InputError, match=r"(?s)save_method must be one of.*safe_serialization=False"):
        save_pretrained_merged(model, str(tmp_path / "q"), save_method="awq", safe_serialization=False)
    with pytest.raises(InputError, match="save_directory is also the Hub repository id"):
        save_pretrained_merged(model, str(tmp_path / "a" / "b"), push_to_hub=True)
    assert not (tmp_path / "q").exists()


def test_patch_peft_adds_methods(make_base, tmp_path):
    import peft_shardmerge

    peft_shardmerge.patch_peft()
    model = qlora(make_base("llama"), "llama", "nf4")
    report = model.save_pretrained_merged(str(tmp_path / "m"), dtype="float32", progress=False)
    assert report.lora_modules_merged == 14


def test_auto_on_a_repacked_model_leaves_it_untouched(make_base, tmp_path):
    from peft_shardmerge.testing import compare_logits

    base = make_base("llama")
    model = qlora(base, "llama", "nf4")
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = True
    with torch.no_grad():
        model(input_ids=token_ids(model.config.vocab_size))
    before = snapshot(model)
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", base_precision="original", progress=False)
    assert report.base_precision == "original"
    assert_unchanged(before, model)
    adapter = str(tmp_path / "adapter")
    model.save_pretrained(adapter)  # (this one does unpack the model: bitsandbytes' state_dict)
    assert compare_logits(base, adapter, out) < 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_budget_sends_modules_to_cpu_with_the_same_result(make_base, tmp_path):

    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(make_base("llama"), quantization_config=qc, device_map="cuda:0")
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=default_targets("llama"), init_lora_weights=False)
    )
    a, b = str(tmp_path / "gpu"), str(tmp_path / "cpu")
    merge_and_save(model, a, dtype="float32", base_precision="dequantized", progress=False)
    # a budget below current use sends every module to the CPU
    merge_and_save(model, b, dtype="float32", base_precision="dequantized", maximum_memory_usage=0.01, progress=False)
    ga, gb = read_all(a), read_all(b)
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch_base", ["llama", "gpt2"])
def test_merged_4bit_reloads_as_bitsandbytes_4bit(arch_base, make_base, tmp_path):
    import bitsandbytes.functional as F

    from peft_shardmerge import save_pretrained_merged

    model = qlora(make_base(arch_base), arch_base, "nf4", torch.bfloat16)
    ref32 = str(tmp_path / "m32")
    merge_and_save(model, ref32, dtype="float32", base_precision="dequantized", progress=False)
    out = str(tmp_path / "m4")
    with pytest.warns(UserWarning, match="re-quantizes the merged weights to 4-bit"):
        report = save_pretrained_merged(model, out, save_method="merged_4bit", max_shard_size="100KB", progress=False)
    assert report.lora_modules_merged == report.lora_modules_total > 0 and len(report.shards) > 1
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["quantization_config"]["load_in_4bit"] is True
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    no_cpu_repack(reloaded)
    merged32 = read_all(ref32)
    n = 0
    for name, m in reloaded.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            got = F.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
            want = merged32[f"{name}.weight"]  # quantized once, from the float32 merge
            if arch_base == "gpt2":
                want = want.T
            q, st = F.quantize_4bit(want.contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4")
            st.dtype = torch.bfloat16  # dequantized to the model's dtype
            torch.testing.assert_close(got, F.dequantize_4bit(q, st).float(), rtol=0, atol=0)
            n += 1
    assert n == report.lora_modules_total


def test_accelerate_disk_offload(make_base, tmp_path):
    """Modules offloaded to disk by an accelerate device_map are brought in for their turn only.

    (On a CPU-only machine PEFT cannot attach LoRA to a disk-offloaded layer itself: get_peft_model leaves its
    factors on the meta device and PeftModel.from_pretrained fails in accelerate's dispatch_model. So the LoRA
    layers stay on the CPU here while the embeddings and the head live on disk.)"""
    base = make_base("llama")
    device_map = {
        "model.embed_tokens": "disk",
        "model.layers": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "disk",
    }
    model = AutoModelForCausalLM.from_pretrained(
        base, device_map=device_map, offload_folder=str(tmp_path / "offload"), dtype=torch.float32
    )
    assert model.model.embed_tokens.weight.device.type == "meta"
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    ids = token_ids(model.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", base_precision="dequantized", progress=False)
    assert report.lora_modules_merged == 4
    assert model.base_model.model.model.embed_tokens.weight.device.type == "meta"  # offloaded again
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_olora_init_rewrote_the_base_so_auto_uses_it(make_base, tmp_path):
    """OLoRA (like PiSSA, CorDA, LoftQ) subtracts the initial LoRA from the base in memory: merging into the
    checkpoint on disk would be wrong, so 'auto' merges into the in-memory base and 'original' is refused."""
    from peft_shardmerge import InputError

    base = make_base("llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights="olora")
    )
    train_one_step(model, model.config.vocab_size)
    ids = token_ids(model.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    with pytest.raises(
        InputError,
        match=r"base_precision='original' cannot be used: the adapter was initialised "
        r"with 'olora'",
    ):
        merge_and_save(model, str(tmp_path / "o"), base_precision="original", progress=False)
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", progress=False)
    assert report.base_precision == "dequantized"
    assert rel_err(logits_of(out, ids), ref) < 1e-5


def test_only_the_active_adapter_is_merged(make_base, tmp_path):
    base = make_base("llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights=False), adapter_name="a"
    )
    model.add_adapter("b", LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False))
    model.set_adapter("a")
    ids = token_ids(model.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", base_precision="dequantized", progress=False)
    assert report.lora_modules_merged == report.lora_modules_total == 2
    assert rel_err(logits_of(out, ids), ref) < 1e-5


@pytest.mark.parametrize("quant", ["nf4", "none"])
def test_dora_in_process(quant, make_base, tmp_path):
    model = qlora(make_base("llama"), "llama", quant, use_dora=True, target_modules=["q_proj", "v_proj", "up_proj"])
    ids = token_ids(model.config.vocab_size, seed=3)
    ref = reference_logits(model, ids)
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", base_precision="dequantized", progress=False)
    assert report.lora_modules_merged == 6
    assert rel_err(logits_of(out, ids), ref) < 1e-5


def test_transformers_model_with_add_adapter(make_base, tmp_path):
    """A LoRA attached with transformers' add_adapter (no PeftModel): 'auto' merges the in-memory base."""
    base = make_base("llama")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    add_adapter_or_skip(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    ids = token_ids(model.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", progress=False)
    assert report.base_precision == "dequantized" and "not a PeftModel" in report.notes[0]
    assert report.lora_modules_merged == 4
    assert rel_err(logits_of(out, ids), ref) < 1e-5


def test_a_model_whose_transformers_refuses_its_peft_merges_as_before(make_base, tmp_path, monkeypatch):
    """Where transformers' own PEFT integration refuses the installed PEFT (5.24 with 0.21), a model a LoRA was
    attached to merges as before: the active adapter is read off its LoRA layers, not asked of transformers."""
    import transformers.integrations.peft as hf_peft

    from peft_shardmerge.support.model import selected_adapters

    model = AutoModelForCausalLM.from_pretrained(make_base("llama"), dtype=torch.float32)
    monkeypatch.setattr(hf_peft, "check_peft_version", lambda min_version: None)
    model.add_adapter(LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights=False), adapter_name="mine")
    model.add_adapter(LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False), adapter_name="other")
    model.set_adapter("mine")

    def refuse(min_version):
        raise ValueError("The version of PEFT you are using is not compatible, please use a version >= 0.22.0")

    monkeypatch.setattr(hf_peft, "check_peft_version", refuse)
    with pytest.raises(ValueError, match="0.22.0"):
        model.active_adapters()
    assert selected_adapters(model) == ["mine"]
    ids = token_ids(model.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    out = str(tmp_path / "m")
    report = merge_and_save(model, out, dtype="float32", progress=False)
    assert report.lora_modules_merged == 2
    assert rel_err(logits_of(out, ids), ref) < 1e-5


def test_self_check_and_precision_report_in_process(make_base, tmp_path, monkeypatch):
    import peft_shardmerge.engine.maths as maths
    from peft_shardmerge import MergeCheckError

    model = qlora(make_base("llama"), "llama", "nf4")
    report = merge_and_save(model, str(tmp_path / "a"), dtype="bfloat16", base_precision="dequantized", progress=False)
    assert 0 < report.self_check_max_rel_err < 1e-5
    assert len(report.swallowed) == 14 and max(report.swallowed.values()) < 0.5
    assert not any(n.startswith("bfloat16 kept the LoRA update in ") for n in report.notes)  # the usual share

    real = maths.add_lora_

    def doubled(rows32, factors, start, stop, *, transposed, base=None):
        return real(rows32, [(a, b, 2 * s) for a, b, s in factors], start, stop, transposed=transposed, base=base)

    monkeypatch.setattr(maths, "add_lora_", doubled)
    out = tmp_path / "b"
    with pytest.raises(MergeCheckError, match=r"self-check failed for 'model\.layers\.0\..*' rows 0-\d+"):
        merge_and_save(model, str(out), base_precision="dequantized", progress=False)
    assert not out.exists()
