"""The shared shard sink: in-process saves re-checked under the output lock, 4-bit sizes planned from shapes, and
the in-process dry run (plan_model_merge) saying exactly what merge_and_save writes."""

from __future__ import annotations

import json
import os
import threading
import warnings

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GenerationConfig

from peft_shardmerge import InputError, Plan, plan_model_merge
from peft_shardmerge.api.inprocess import merge_and_save, save_merged_4bit
from peft_shardmerge.checkpoint.planner import CheckpointInputs
from peft_shardmerge.io.safetensors_io import read_header
from peft_shardmerge.model.planner import LiveInputs
from peft_shardmerge.output.staging import staged_output
from peft_shardmerge.quant.nf4 import Nf4Settings, packed_4bit_layout, pad_quant_state, quant_state_fields
from peft_shardmerge.testing import default_targets
from tests.integration.test_inprocess import no_cpu_repack, qlora, read_all


def lora16(base: str):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, target_modules=default_targets("llama"), init_lora_weights=False)
    )


def written(out: str) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """(shard, tensor, dtype, shape) of every tensor in the folder, in file and header order."""
    rows = []
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            infos, _ = read_header(os.path.join(out, f))
            rows += [(f, t.name, t.dtype, tuple(t.shape)) for t in infos]
    return rows


def planned(plan: Plan) -> list[tuple[str, str, str, tuple[int, ...]]]:
    return sorted(
        ((plan.shard_names[t.shard], t.name, t.out_dtype, tuple(t.shape)) for t in plan.tensors), key=lambda r: r[0]
    )


# ------------------------------------------------------------------------------------------- lock re-check


def test_staged_output_needs_the_callers_overwrite(tmp_path):
    with pytest.raises(TypeError, match="overwrite"):
        with staged_output(str(tmp_path / "out")):
            pass


def test_what_overwrite_may_replace_is_the_callers_argument_checked_under_the_lock(tmp_path):
    """The Unsloth-style saves replace only their own earlier save: their check is passed down as ``replace_check``
    (no hidden state) and run once the output lock is held."""
    from peft_shardmerge.output import lock as outlock

    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("an earlier save")
    seen = []

    def refuse(folder: str) -> list[str]:
        seen.append((folder, os.path.exists(outlock.OutputLock(folder).path)))
        return [f"{folder} is not an earlier save"]

    with pytest.raises(InputError, match="is not an earlier save"):
        with staged_output(str(out), overwrite=True, replace_check=refuse):
            pytest.fail("nothing is staged into a folder the check refuses")
    assert seen == [(str(out), True)] and os.listdir(out) == ["earlier.txt"]
    with staged_output(str(out), overwrite=True, replace_check=lambda folder: []) as staging:
        with open(os.path.join(staging.path, "config.json"), "w") as f:
            f.write("{}")
    assert os.listdir(out) == ["config.json"]


class WinnerSavesFirst(GenerationConfig):
    """The loser's generation config: saving it (a check made after the output folder was found empty, before
    the output lock is taken) lets another merge, in another thread, finish into the same folder."""

    winner = None

    def save_pretrained(self, *args, **kwargs):
        if WinnerSavesFirst.winner is not None:
            thread, WinnerSavesFirst.winner = WinnerSavesFirst.winner, None
            thread.start()
            thread.join()
        return super().save_pretrained(*args, **kwargs)


@pytest.mark.parametrize("method", ["merge_and_save", "save_merged_4bit"])
def test_second_of_two_concurrent_in_process_saves_is_refused(method, make_base, tmp_path):
    model = qlora(make_base("llama"), "llama", "nf4", torch.bfloat16)
    out = str(tmp_path / "out")
    os.mkdir(out)  # one empty folder, which both saves find empty
    save = {
        "merge_and_save": lambda **kw: merge_and_save(model, out, base_precision="dequantized", **kw),
        "save_merged_4bit": lambda **kw: save_merged_4bit(model, out, **kw),
    }[method]
    results = {}

    def winner():
        results["winner"] = merge_and_save(model, out, base_precision="dequantized", progress=False)

    inner = model.base_model.model
    own = inner.generation_config
    inner.generation_config = WinnerSavesFirst(**own.to_dict())
    WinnerSavesFirst.winner = threading.Thread(target=winner, name="winner")
    try:
        with (
            warnings.catch_warnings(),
            pytest.raises(InputError, match=r"is not empty \(it changed since it was checked\); pass overwrite=True"),
        ):
            warnings.simplefilter("ignore")  # save_merged_4bit's warning that it re-quantizes
            save(overwrite=False, progress=False)
    finally:
        inner.generation_config = own
    assert results["winner"].out_dir == os.path.abspath(out)
    assert os.path.isfile(os.path.join(out, "merge_manifest.json")) and read_all(out)
    assert "quantization_config" not in json.load(open(os.path.join(out, "config.json")))  # the winner's, kept
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging folder or lock left


# ------------------------------------------------------------------------------------------- 4-bit sizes


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("shape", [(7, 5), (64, 64), (3, 33), (300, 700), (1, 1)])
def test_packed_4bit_layout_is_what_bitsandbytes_writes(shape, double_quant, quant_type):
    import bitsandbytes.functional as F

    settings = Nf4Settings(quant_type=quant_type, double_quant=double_quant)
    w = torch.randn(*shape, dtype=torch.bfloat16) * 3
    q, state = F.quantize_4bit(
        w, blocksize=64, compress_statistics=double_quant, quant_type=quant_type, quant_storage=torch.uint8
    )
    packed = state.as_dict(packed=True)
    layout = packed_4bit_layout(shape, torch.bfloat16, settings)
    key = f"quant_state.bitsandbytes__{quant_type}"
    assert [k for k, _, _ in layout] == ["", *packed]
    for (k, dtype, s), t in zip(layout, [q, *packed.values()]):
        assert dtype == {torch.uint8: "U8", torch.float32: "F32"}[t.dtype], k
        if k != key:
            assert tuple(t.shape) == s, k
    fields = quant_state_fields(shape, torch.bfloat16, settings, state.offset.item() if double_quant else 0.0)
    assert fields == F.unpack_tensor_to_dict(packed[key])  # the reserved length is sized from these fields
    padded = pad_quant_state(packed[key], layout[-1][2][0])
    assert padded.numel() == layout[-1][2][0] >= packed[key].numel()
    assert bytes(padded.tolist()).rstrip(b" ") == bytes(packed[key].tolist())
    again = F.QuantState.from_dict({**{k: v for k, v in packed.items() if k != key}, key: padded}, torch.device("cpu"))
    torch.testing.assert_close(F.dequantize_4bit(q, again), F.dequantize_4bit(q, state), rtol=0, atol=0)


def test_merged_4bit_without_double_quant_reloads_as_bitsandbytes_quantizes_it(make_base, tmp_path):
    import bitsandbytes.functional as F

    model = qlora(make_base("llama"), "llama", "fp4", torch.bfloat16, double_quant=False)
    ref32, out = str(tmp_path / "m32"), str(tmp_path / "m4")
    merge_and_save(model, ref32, dtype="float32", base_precision="dequantized", progress=False)
    with pytest.warns(UserWarning, match="re-quantizes"):
        report = save_merged_4bit(model, out, max_shard_size="100KB", progress=False)
    assert len(report.shards) > 1
    header = written(out)
    states = [r for r in header if r[1].endswith("quant_state.bitsandbytes__fp4")]
    assert states and all(r[2] == "U8" for r in states)
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    no_cpu_repack(reloaded)
    merged32, n = read_all(ref32), 0
    for name, m in reloaded.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            assert m.weight.quant_state.quant_type == "fp4" and m.weight.quant_state.state2 is None
            # quantized once, from the float32 merge; dequantized to the model's dtype
            q, st = F.quantize_4bit(
                merged32[f"{name}.weight"].contiguous(), blocksize=64, compress_statistics=False, quant_type="fp4"
            )
            st.dtype = torch.bfloat16
            torch.testing.assert_close(
                F.dequantize_4bit(m.weight.data, m.weight.quant_state).float(),
                F.dequantize_4bit(q, st).float(),
                rtol=0,
                atol=0,
            )
            n += 1
    assert n == report.lora_modules_total > 0


# ------------------------------------------------------------------------------------------- dry run


@pytest.mark.parametrize("kind", ["nf4", "unquantized"])
def test_plan_model_merge_says_what_merge_and_save_writes(kind, make_base, tmp_path):
    base = make_base("llama")
    model = qlora(base, "llama", "nf4", torch.bfloat16) if kind == "nf4" else lora16(base)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    out = tmp_path / "out"
    plan = plan_model_merge(model, out, dtype="bfloat16", max_shard_size="100KB")
    assert isinstance(plan, Plan) and not out.exists() and os.listdir(tmp_path) == []
    assert all(torch.equal(v, p) for (k, v), (_, p) in zip(before.items(), model.named_parameters()))
    assert plan.notes[0].startswith("base precision 'auto': ")
    text = plan.describe()
    for t in plan.tensors:
        assert f"{t.name:<56} {t.out_dtype:<5} {str(list(t.shape)):<16} {t.nbytes:>12}  {t.op}" in text
    assert plan.peak_bytes() > 0 and len(plan.shard_names) > 1
    report = merge_and_save(model, str(out), dtype="bfloat16", max_shard_size="100KB", progress=False)
    assert sorted(written(str(out)), key=lambda r: r[0]) == planned(plan)
    assert report.shards == plan.shard_names and report.bytes_written == plan.total_size
    index = json.load(open(out / "model.safetensors.index.json"))
    assert index == plan.index()
    if kind == "nf4":  # merged from memory; the unquantized model from the checkpoint it was loaded from
        assert isinstance(plan.inputs, LiveInputs) and "merge" in {t.op for t in plan.tensors}
    else:
        assert isinstance(plan.inputs, CheckpointInputs)


def test_plan_model_merge_checks_the_options_and_the_folder(make_base, tmp_path):
    model = lora16(make_base("llama"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("mine")
    with pytest.raises(InputError) as e:
        plan_model_merge(model, tmp_path / "full", dtype="int3", base_precision="nope")
    text = str(e.value)
    assert "base_precision" in text and "int3" in text and "did not write (x.txt)" in text
    assert isinstance(plan_model_merge(model, base_precision="dequantized").inputs, LiveInputs)  # no folder checked


def test_the_dry_run_takes_overwrite_as_merge_and_save_does(make_base, make_adapter, tmp_path):
    """plan_model_merge into a folder of the user's refuses it with or without overwrite=True (and offers none), as
    merge_and_save does, and accepts an earlier output of ours with it (nothing is written)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import InputError, plan_model_merge

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(make_base("llama"), dtype=torch.float32), make_adapter("llama", "default")
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"did not write \(notes\.txt\).*choose another output folder"):
        plan_model_merge(model, str(out))
    with pytest.raises(InputError, match=r"did not write \(notes\.txt\)"):
        plan_model_merge(model, str(out), overwrite=True)
    (out / "notes.txt").unlink()
    (out / "merge_manifest.json").write_text('{"format": "peft-shardmerge merge record", "shards": {}, "files": {}}')
    plan = plan_model_merge(model, str(out), overwrite=True)
    assert plan.tensors and sorted(os.listdir(out)) == ["merge_manifest.json"]


def test_the_dry_run_into_the_original_checkpoint_names_the_adapter_not_a_temporary_folder(
    make_base, make_adapter, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import plan_model_merge

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(make_base("llama"), dtype=torch.float32), make_adapter("llama", "default")
    )
    text = plan_model_merge(model, base_precision="original").describe()
    adapter_line = next(line for line in text.splitlines() if line.startswith("adapter:"))
    assert adapter_line.split(None, 1)[1] == "(in memory: adapter 'default')", adapter_line
    report = merge_and_save(model, str(tmp_path / "m"), base_precision="original", progress=False)
    assert report.adapter == "(in memory: adapter 'default')"
