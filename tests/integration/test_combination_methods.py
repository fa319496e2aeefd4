"""Task-vector combinations end to end: DARE's bytes fixed by the seed (whatever the row blocks and workers), a
loaded model's merge equal to the merge from disk, what is refused, and what the record, report and command line
say. The maths against MergeKit: tests/unit/engine/test_task_vectors.py and tests/integration/test_mergekit.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from peft_shardmerge import merge_and_save, merge_checkpoint
from peft_shardmerge.api.cli import main
from peft_shardmerge.errors import InputError
from peft_shardmerge.testing import build_adapter
from tests.helpers import folder_tensors, load_quantized, no_cpu_repack, tree


def digests(folder: str) -> dict[str, str]:
    """SHA-256 of every safetensors file of a folder (the record, which names the row block, left out)."""
    return {k: v for k, v in tree(folder).items() if k.endswith(".safetensors")}


@pytest.fixture
def two(make_base, make_adapter):
    base = make_base("llama_sharded")
    a = make_adapter("llama_sharded", "tv-a", r=8, lora_alpha=16, seed=1)
    b = make_adapter(
        "llama_sharded", "tv-b", r=4, lora_alpha=8, seed=2, target_modules=["q_proj", "v_proj", "up_proj"]
    )
    return base, [a, b]


def test_dare_bytes_depend_on_the_seed_alone(tmp_path, two):
    base, adapters = two
    kw = dict(weights=[0.6, 0.4], combination="dare_ties", density=0.3, max_shard_size="300KB", progress=False)
    first = merge_checkpoint(base, adapters, str(tmp_path / "a"), seed=11, workers=1, **kw)
    again = merge_checkpoint(base, adapters, str(tmp_path / "b"), seed=11, workers=2, chunk_elems=1000, **kw)
    other = merge_checkpoint(base, adapters, str(tmp_path / "c"), seed=12, workers=1, **kw)
    assert len(first.shards) > 1
    assert digests(first.out_dir) == digests(again.out_dir)
    assert digests(first.out_dir) != digests(other.out_dir)
    record = json.load(open(os.path.join(first.out_dir, "merge_manifest.json")))["merge"]
    assert record["combination"] == "dare_ties" and record["weights"] == [0.6, 0.4]
    assert record["task_vectors"] == {
        "method": "dare_ties",
        "weights": [0.6, 0.4],
        "density": 0.3,
        "majority_sign": "total",
        "normalize": False,
        "seed": 11,
    }
    assert (
        first.combination == "dare_ties (weights 0.6, 0.4; density 0.3; majority sign total; seed 11; not normalized)"
    )


@pytest.mark.parametrize("method", ["ties", "dare_linear"])
@pytest.mark.parametrize("base_precision", ["dequantized", "original"])
def test_a_loaded_model_gives_the_bytes_of_the_merge_from_disk(tmp_path, two, method, base_precision):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapters = two
    kw = dict(weights=[0.7, 0.3], density=0.5, seed=4 if method.startswith("dare") else 0, progress=False)
    disk = merge_checkpoint(base, adapters, str(tmp_path / "disk"), combination=method, max_shard_size="100KB", **kw)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters[0], adapter_name="a")
    model.load_adapter(adapters[1], adapter_name="b")
    live = merge_and_save(
        model,
        str(tmp_path / "live"),
        adapter_names=["a", "b"],
        combination_type=method,
        base_precision=base_precision,
        max_shard_size="100KB",
        **kw,
    )
    assert live.base_precision == base_precision
    assert method in live.combination
    first = live.summary().splitlines()[0]  # the adapters, then the method once
    assert first.count(f"{method} (weights 0.7, 0.3;") == 1, first
    assert "(in memory: adapter 'a' x 0.7, adapter 'b' x 0.3)" in first, first
    cat = folder_tensors(
        merge_checkpoint(base, adapters, str(tmp_path / "cat"), weights=[0.7, 0.3], progress=False).out_dir
    )
    a, b = folder_tensors(live.out_dir), folder_tensors(disk.out_dir)
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k].dtype != b[k].dtype or not a[k].equal(b[k])] == []
    differs = [k for k in a if not a[k].equal(cat[k])]  # the method is not the plain weighted sum
    assert len(differs) == 14 and all(k.endswith("proj.weight") for k in differs)  # every LoRA'd tensor


def test_verify_recomputes_a_task_vector_merge(tmp_path, two):
    from peft_shardmerge.verify.report import verify_checkpoint

    base, adapters = two
    out = merge_checkpoint(
        base,
        adapters,
        str(tmp_path / "o"),
        weights=[0.7, 0.3],
        combination="dare_ties",
        density=0.5,
        seed=3,
        progress=False,
    ).out_dir
    report = verify_checkpoint(out, base=base, adapter=adapters)
    assert report.status == "OK" and report.recomputed, report.summary()
    assert "task-vector method" in report.summary()
    record = os.path.join(out, "merge_manifest.json")
    data = json.load(open(record))
    data["merge"]["task_vectors"]["seed"] = 4  # another draw: the recomputation must disagree
    json.dump(data, open(record, "w"))
    assert verify_checkpoint(out, base=base, adapter=adapters).status == "FAILED"


def _loha(base: str, folder: str, seed: int, **kw) -> str:
    from peft import LoHaConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_shardmerge.testing import perturb_trainable

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoHaConfig(r=4, **kw))
    perturb_trainable(model, 0.02)
    model.save_pretrained(folder)
    return folder


def test_each_refusal_of_a_task_vector_method_names_a_combination_that_then_works(tmp_path, two, make_adapter):
    """The advice is followed: from disk, modules_to_save -> 'cat' from disk; a LoHa adapter (or LoRA on
    target_parameters), which the disk engine never combines -> 'cat' in process."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapters = two
    saved = make_adapter("llama_sharded", "tv-saved", modules_to_save=["lm_head"], target_modules=["q_proj"])
    with pytest.raises(InputError, match=r"Combine it with 'cat' \(or 'linear', for adapters of equal rank\)"):
        merge_checkpoint(base, [adapters[0], saved], str(tmp_path / "o"), combination="ties", density=0.5)
    merge_checkpoint(base, [adapters[0], saved], str(tmp_path / "cat"), combination="cat", progress=False)
    loha = [_loha(base, str(tmp_path / f"loha{i}"), i, target_modules=["q_proj", "v_proj"]) for i in (1, 2)]
    with pytest.raises(InputError) as e:
        merge_checkpoint(base, loha, str(tmp_path / "o"), combination="ties", density=0.5)
    text = str(e.value)
    assert "on disk only LoRA adapters on modules are combined at all" in text
    assert "merge_and_save(model, out_dir, adapter_names=[...], combination_type='cat')" in text
    assert "Combine it with 'cat'" not in text
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), loha[0], adapter_name="a")
    model.load_adapter(loha[1], adapter_name="b")
    with pytest.raises(InputError, match="the adapter a also has peft_type LOHA.*Combine it with 'cat'"):
        merge_and_save(model, str(tmp_path / "o"), adapter_names=["a", "b"], combination_type="ties", density=0.5)
    merge_and_save(model, str(tmp_path / "ip"), adapter_names=["a", "b"], combination_type="cat", progress=False)
    assert os.path.exists(tmp_path / "ip" / "model.safetensors")


def test_what_a_task_vector_method_refuses(tmp_path, two, make_adapter):
    base, adapters = two
    out = str(tmp_path / "o")
    with pytest.raises(InputError, match="needs a density"):
        merge_checkpoint(base, adapters, out, combination="ties")
    with pytest.raises(InputError, match="density=0.5 applies to the task-vector combinations"):
        merge_checkpoint(base, adapters, out, density=0.5)
    saved = make_adapter("llama_sharded", "tv-saved", modules_to_save=["lm_head"], target_modules=["q_proj"])
    with pytest.raises(InputError, match="combines the LoRA deltas of modules only.*modules_to_save"):
        merge_checkpoint(base, [adapters[0], saved], out, combination="ties", density=0.5)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters[0], adapter_name="a")
    model.load_adapter(saved, adapter_name="saved")
    with pytest.raises(InputError, match="combination_type 'ties' combines the LoRA deltas of modules only"):
        merge_and_save(model, out, adapter_names=["a", "saved"], combination_type="ties", density=0.5)
    with pytest.raises(InputError, match="majority_sign_method='frequency' applies to the methods that elect"):
        merge_and_save(
            model,
            out,
            adapter_names=["a"],
            combination_type="dare_linear",
            density=0.5,
            majority_sign_method="frequency",
        )
    assert not os.path.exists(out)


def test_the_command_line_takes_the_method_and_names_it(tmp_path, two, capsys):
    base, adapters = two
    out = str(tmp_path / "o")
    args = ["merge", base, adapters[0], out, "--add-adapter", adapters[1], "--weights", "0.7", "0.3"]
    assert main([*args, "--combination", "ties", "-q"]) == 2
    assert "needs a density" in capsys.readouterr().err and not os.path.exists(out)
    assert (
        main([*args, "--combination", "ties", "--density", "0.5", "--majority-sign", "frequency", "--no-normalize"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "ties (weights 0.7, 0.3; density 0.5; majority sign frequency; not normalized)" in printed
    assert "LoRA modules merged 20/20" in printed


@pytest.mark.parametrize("combination_type", ["ties", "dare_linear", "magnitude_prune"])
def test_an_adapter_built_by_peft_add_weighted_adapter_merges_like_any_lora(tmp_path, two, combination_type):
    """PEFT's own ties/dare/magnitude_prune work on the factors and give a LoRA adapter: merged in process and from
    disk, it equals PEFT's merge of it."""
    import copy

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, _ = two
    a = build_adapter(base, str(tmp_path / "a"), r=4, lora_alpha=8, seed=5)
    b = build_adapter(base, str(tmp_path / "b"), r=4, lora_alpha=16, seed=6, target_modules=["q_proj", "v_proj"])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), a, adapter_name="a")
    model.load_adapter(b, adapter_name="b")
    torch.manual_seed(0)  # PEFT's DARE draws from torch's generator
    model.add_weighted_adapter(["a", "b"], [0.7, 0.3], "mix", combination_type=combination_type, density=0.5)
    model.set_adapter("mix")
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    live = folder_tensors(merge_and_save(model, str(tmp_path / "live"), adapter_names=["mix"], progress=False).out_dir)
    model.save_pretrained(str(tmp_path / "saved"), selected_adapters=["mix"])
    disk = folder_tensors(
        merge_checkpoint(base, str(tmp_path / "saved" / "mix"), str(tmp_path / "disk"), progress=False).out_dir
    )
    for got in (live, disk):
        assert sorted(got) == sorted(want)
        assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)
    assert not torch.equal(
        want["model.layers.0.self_attn.q_proj.weight"], folder_tensors(base)["model.layers.0.self_attn.q_proj.weight"]
    )


def test_a_4bit_model_combined_by_ties_equals_the_merge_into_the_4bit_round_trip(tmp_path, two):
    """A QLoRA model with two adapters: ties in process, into the weights in memory, gives the bytes of the merge
    from disk into dequant(quantize_4bit(W)) with the same 4-bit settings."""
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel

    base, adapters = two
    model = load_quantized(base, "nf4")  # double quant, float32 compute
    no_cpu_repack(model)
    model = PeftModel.from_pretrained(model, adapters[0], adapter_name="a")
    model.load_adapter(adapters[1], adapter_name="b")
    kw = dict(weights=[0.7, 0.3], density=0.5, dtype="float32", progress=False)
    live = merge_and_save(model, str(tmp_path / "live"), adapter_names=["a", "b"], combination_type="ties", **kw)
    disk = merge_checkpoint(base, adapters, str(tmp_path / "disk"), combination="ties", base_precision="nf4", **kw)
    a, b = folder_tensors(live.out_dir), folder_tensors(disk.out_dir)
    assert sorted(a) == sorted(b)
    assert [k for k in a if not a[k].equal(b[k])] == []


def test_the_model_card_names_the_method(tmp_path, two, monkeypatch):
    import huggingface_hub.constants as hc
    from hub_server import FakeHub

    from peft_shardmerge.api.hub import prepare_repo, publish
    from peft_shardmerge.output.hub_push import HubTarget

    base, adapters = two
    report = merge_checkpoint(
        base, adapters, str(tmp_path / "o"), weights=[0.7, 0.3], combination="ties", density=0.5, progress=False
    )
    with FakeHub() as hub:
        monkeypatch.setattr(hc, "ENDPOINT", hub.url)
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        repo = prepare_repo("me/tiny-ties", token="hf_x")
        publish(report.out_dir, HubTarget(repo, token="hf_x"), base_model=None, report=report)
        card = hub.files["me/tiny-ties"]["README.md"].decode()
    assert "| adapters combined | ties (weights 0.7, 0.3; density 0.5; majority sign total; normalized) |" in card


def test_a_lora_on_the_embeddings_combines_in_process_from_the_original_checkpoint(tmp_path):
    """Merging a loaded model into its original checkpoint saves its adapters to a scratch folder first; without a
    resized vocabulary PEFT's copy of the embedding layer is the same weights again, and is not saved (it would be
    taken for a replacement, which a task-vector method refuses)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from peft_shardmerge.testing import build_base, perturb_trainable

    base = build_base(str(tmp_path / "base"), "llama")
    for i, targets in enumerate((["q_proj", "embed_tokens"], ["q_proj", "v_proj"])):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=targets))
        perturb_trainable(model, 0.02)
        model.save_pretrained(str(tmp_path / f"ad{i}"), save_embedding_layers=False)
    adapters = [str(tmp_path / "ad0"), str(tmp_path / "ad1")]
    kw = dict(weights=[0.7, 0.3], density=0.5, progress=False)
    disk = merge_checkpoint(base, adapters, str(tmp_path / "disk"), combination="ties", **kw)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters[0], adapter_name="ad0")
    model.load_adapter(adapters[1], adapter_name="ad1")
    live = merge_and_save(model, str(tmp_path / "live"), adapter_names=["ad0", "ad1"], combination_type="ties", **kw)
    assert live.base_precision == "original"
    a, b = folder_tensors(live.out_dir), folder_tensors(disk.out_dir)
    assert [k for k in a if not a[k].equal(b[k])] == [] and sorted(a) == sorted(b)
    assert not a["model.embed_tokens.weight"].equal(folder_tensors(base)["model.embed_tokens.weight"])


def test_gpt2_adapters_whose_fan_in_fan_out_flags_differ_combine(tmp_path):
    """PEFT writes the fan_in_fan_out of the last module it wrapped: an adapter on c_attn and lm_head says false, its
    c_attn factors are GPT-2's Conv1D layout all the same. The layout comes from the model class."""
    from peft_shardmerge.testing import build_base

    base = build_base(str(tmp_path / "base"), "gpt2")
    a = build_adapter(base, str(tmp_path / "a"), r=8, fan_in_fan_out=True, target_modules=["c_attn"], seed=1)
    b = build_adapter(
        base, str(tmp_path / "b"), r=4, fan_in_fan_out=True, target_modules=["c_attn", "lm_head"], seed=2
    )
    assert json.load(open(os.path.join(b, "adapter_config.json")))["fan_in_fan_out"] is False
    both = folder_tensors(
        merge_checkpoint(base, [a, b], str(tmp_path / "ab"), weights=[0.5, 0.5], progress=False).out_dir
    )
    alone = [
        folder_tensors(merge_checkpoint(base, x, str(tmp_path / f"{i}"), progress=False).out_dir)
        for i, x in enumerate((a, b))
    ]
    original = folder_tensors(base)
    name = "transformer.h.0.attn.c_attn.weight"
    expected = original[name] + 0.5 * (alone[0][name] - original[name]) + 0.5 * (alone[1][name] - original[name])
    assert torch.allclose(both[name], expected, rtol=0, atol=1e-6)
