"""Task-vector combinations end to end: DARE's bytes fixed by the seed (whatever the row blocks and workers), a
loaded model's merge equal to the merge from disk, what is refused, and what the record, report and command line
say. The maths against MergeKit: tests/unit/engine/test_task_vectors.py and tests/integration/test_mergekit.py."""

from __future__ import annotations

import glob
import hashlib
import json
import os

import pytest

from peft_shardmerge import merge_and_save, merge_checkpoint
from peft_shardmerge.api.cli import main
from peft_shardmerge.errors import InputError


def tensors(folder: str) -> dict:
    """Every tensor of a checkpoint folder, by name."""
    from safetensors.torch import load_file

    out = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        out.update(load_file(path))
    return out


def digests(folder: str) -> dict[str, str]:
    """SHA-256 of every safetensors file of a folder."""
    return {
        os.path.basename(p): hashlib.sha256(open(p, "rb").read()).hexdigest()
        for p in glob.glob(os.path.join(folder, "*.safetensors"))
    }


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
    a, b = tensors(live.out_dir), tensors(disk.out_dir)
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k].dtype != b[k].dtype or not a[k].equal(b[k])] == []


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
