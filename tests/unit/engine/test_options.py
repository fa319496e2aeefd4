"""MergeOptions: one frozen value for the knobs of both paths, every problem at once, conflicts refused."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from peft_shardmerge import InputError, merge_checkpoint, plan_checkpoint_merge
from peft_shardmerge.options import MergeOptions
from tests.helpers import folder_tensors


def test_options_are_frozen_and_weights_a_tuple():
    opts = MergeOptions(weights=[0.5, 0.5], dtype="bfloat16")
    assert opts.weights == (0.5, 0.5) and opts.problems() == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.dtype = "float16"  # type: ignore[misc]
    assert MergeOptions(base_precision="nf4", nf4_blocksize=128).nf4.blocksize == 128
    assert MergeOptions().nf4 is None


def test_every_problem_of_the_options_at_once():
    opts = MergeOptions(
        weights=[1.0, float("nan")],
        combination="sum",
        dtype="int4",
        max_shard_size="lots",
        base_precision="nf4",
        nf4_blocksize=100,
        device="tpu",
        chunk_elems=0,
        progress="yes",
    )
    problems = opts.problems()
    assert problems == [
        "adapter weights must be finite numbers, got [1.0, nan]",
        "combination must be one of cat, linear, ties, dare_ties, dare_linear, magnitude_prune, got 'sum'",
        "dtype 'int4' is not supported; use one of float32, float16, bfloat16",
        "max_shard_size 'lots' is not a size; write e.g. '5GB', '500MB' or '2GiB'",
        "4-bit blocksize must be a power of two from 32 to 4096, got 100",
        "device must be one of auto, cpu, cuda, got 'tpu'",
        "chunk_elems must be a positive int, got 0",
        "progress must be True or False, got 'yes'",
    ]
    with pytest.raises(InputError) as e:
        opts.check()
    assert str(e.value).startswith("8 problems found before writing anything:")


def test_conflicts_refused_and_precedence():
    opts, problems = MergeOptions.merged(
        MergeOptions(dtype="float16", chunk_elems=1 << 10), dtype="bfloat16", chunk_elems=1 << 10, max_shard_size="1MB"
    )
    assert problems == ["dtype='bfloat16' conflicts with options.dtype='float16'; give it in one place"]
    # a keyword at its default defers to options; a keyword set wins over a field left at its default
    opts, problems = MergeOptions.merged(MergeOptions(dtype="float16", progress=False), max_shard_size="1MB")
    assert problems == [] and (opts.dtype, opts.progress, opts.max_shard_size) == ("float16", False, "1MB")
    with pytest.raises(InputError, match="options must be a MergeOptions, got dict"):
        MergeOptions.merged({"dtype": "float16"}, dtype=None)  # type: ignore[arg-type]


def test_conflict_refused_by_the_public_functions(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    out = str(tmp_path / "m")
    with pytest.raises(InputError) as e:
        merge_checkpoint(
            base, adapter, out, dtype="float16", progress=False, options=MergeOptions(dtype="bfloat16", chunk_elems=-1)
        )
    assert e.value.problems[:2] == [
        "dtype='float16' conflicts with options.dtype='bfloat16'; give it in one place",
        "chunk_elems must be a positive int, got -1",
    ]
    assert not os.path.exists(out)
    plan = plan_checkpoint_merge(base, adapter, out, options=MergeOptions(dtype="bfloat16", max_shard_size="100KB"))
    assert plan.dtype == torch.bfloat16 and len(plan.shard_names) > 1


def test_dtype_and_shard_size_are_parsed_once_and_a_value_that_does_not_parse_never_reaches_a_plan(
    make_base, make_adapter
):
    from peft_shardmerge.checkpoint.adapter import load_adapter
    from peft_shardmerge.checkpoint.base_folder import open_checkpoint
    from peft_shardmerge.checkpoint.planner import build_plan
    from peft_shardmerge.support.model_info import inspect_model

    opts = MergeOptions(dtype="fp16", max_shard_size="2GiB")
    assert (opts.out_dtype, opts.shard_bytes, MergeOptions(dtype="auto").out_dtype) == (torch.float16, 2 << 30, None)
    assert dataclasses.replace(opts, max_shard_size="1MB").shard_bytes == 10**6
    assert opts == MergeOptions(dtype="fp16", max_shard_size="2GiB") and "_out_dtype" not in repr(opts)
    bad = MergeOptions(dtype="int4", max_shard_size="lots", base_precision="original")
    for value, words in (("out_dtype", "dtype 'int4'"), ("shard_bytes", "max_shard_size 'lots'")):
        with pytest.raises(InputError, match=words):
            getattr(bad, value)
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    with pytest.raises(InputError) as e:  # the caller passed no problems: the planner names them itself
        build_plan(open_checkpoint(base), load_adapter(adapter), inspect_model(base), bad)
    assert any("dtype 'int4'" in p for p in e.value.problems)


def _files(folder: str) -> dict[str, bytes]:
    names = [n for n in sorted(os.listdir(folder)) if n != "merge_manifest.json"]
    return {n: open(os.path.join(folder, n), "rb").read() for n in names}


def test_options_and_keywords_give_byte_identical_outputs(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    keywords = merge_checkpoint(
        base,
        adapter,
        str(tmp_path / "kw"),
        dtype="bfloat16",
        max_shard_size="100KB",
        chunk_elems=1 << 12,
        device="cpu",
        progress=False,
    )
    options = merge_checkpoint(
        base,
        adapter,
        str(tmp_path / "opt"),
        options=MergeOptions(
            dtype="bfloat16", max_shard_size="100KB", chunk_elems=1 << 12, device="cpu", progress=False
        ),
    )
    a, b = _files(str(tmp_path / "kw")), _files(str(tmp_path / "opt"))
    assert len([n for n in a if n.endswith(".safetensors")]) > 1
    assert a == b
    assert keywords.shards == options.shards and keywords.dtype == options.dtype == "bfloat16"


def test_equivalent_spellings_are_not_conflicts():
    """``"bf16"``, ``"bfloat16"`` and ``torch.bfloat16`` are one dtype; ``"5GB"`` and 5e9 bytes one size."""
    import torch

    opts = MergeOptions(dtype="bfloat16", max_shard_size="500MB")
    for dtype in ("bf16", torch.bfloat16, "bfloat16"):
        merged, problems = MergeOptions.merged(opts, dtype=dtype, max_shard_size=500 * 10**6)
        assert problems == [], problems
        assert merged.dtype == "bfloat16" and merged.max_shard_size == "500MB"
    assert MergeOptions.merged(opts, dtype="float16")[1] == [
        "dtype='float16' conflicts with options.dtype='bfloat16'; give it in one place"
    ]


def test_bad_weights_and_combination_are_reported_with_every_other_problem(make_base, make_adapter, tmp_path):
    with pytest.raises(InputError) as e:
        merge_checkpoint(
            make_base("llama"),
            make_adapter("llama", "default"),
            str(tmp_path / "out"),
            dtype="int3",
            max_shard_size="huge",
            base_precision="best",
            chunk_elems=0,
            combination="sum",
            weights=[float("nan")],
            progress=False,
        )
    assert len(e.value.problems) == 6, e.value.problems
    assert not (tmp_path / "out").exists()


# ---- one options object for both paths: a loaded model's merge takes the same MergeOptions ----


def _loaded(base: str, adapter: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)


def test_one_options_object_drives_both_paths_to_the_same_tensors(make_base, make_adapter, tmp_path):
    from peft_shardmerge import merge_and_save, plan_model_merge

    base, adapter = make_base("llama"), make_adapter("llama")
    opts = MergeOptions(dtype="bfloat16", max_shard_size="200KB", chunk_elems=1000, progress=False)
    disk = merge_checkpoint(base, adapter, str(tmp_path / "disk"), options=opts)
    model = _loaded(base, adapter)
    assert plan_model_merge(model, options=opts).chunk_elems == 1000  # the row block reaches the in-process plan
    live = merge_and_save(model, str(tmp_path / "live"), options=replace_base(opts, "dequantized"))
    assert disk.dtype == live.dtype == "bfloat16" and len(disk.shards) == len(live.shards) > 1
    a, b = folder_tensors(str(tmp_path / "disk")), folder_tensors(str(tmp_path / "live"))
    assert a.keys() == b.keys()
    for k in a:  # the same fp32 base and factors through the one row merge: the same bytes
        assert torch.equal(a[k], b[k]), k


def replace_base(opts: MergeOptions, base_precision: str) -> MergeOptions:
    return dataclasses.replace(opts, base_precision=base_precision)


def test_base_precision_default_is_the_paths_own(make_base, make_adapter):
    from peft_shardmerge import plan_model_merge

    assert MergeOptions().base_precision is None
    assert MergeOptions().for_path("disk").base_precision == "auto"
    assert MergeOptions().for_path("model").base_precision == "auto"
    plan = plan_checkpoint_merge(make_base("llama"), make_adapter("llama"), "/nonexistent/out", options=MergeOptions())
    assert plan.base_precision == "original"  # "auto" resolved: nothing in this adapter's files shows a 4-bit base
    model = _loaded(make_base("llama"), make_adapter("llama"))
    # the keyword's own default ("auto") defers to options; the model path's vocabulary applies
    assert plan_model_merge(model, options=MergeOptions(base_precision="dequantized")).base_precision == "dequantized"
    with pytest.raises(InputError, match=r"base_precision must be one of auto, original, dequantized, got 'nf4'"):
        plan_model_merge(model, options=MergeOptions(base_precision="nf4"))
    with pytest.raises(InputError, match=r"base_precision must be one of auto, original, nf4, got 'dequantized'"):
        plan_checkpoint_merge(
            make_base("llama"),
            make_adapter("llama"),
            "/nonexistent/out",
            options=MergeOptions(base_precision="dequantized"),
        )


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("device", "cpu", "device applies to merges from disk"),
        ("resume", False, "resume applies to merges from disk"),
        ("nf4_blocksize", 128, "apply to merges from disk"),
    ],
)
def test_a_disk_only_knob_is_refused_for_a_loaded_model(make_base, make_adapter, tmp_path, field, value, words):
    from peft_shardmerge import merge_and_save

    model = _loaded(make_base("llama"), make_adapter("llama"))
    out = tmp_path / "out"
    with pytest.raises(InputError, match=words):
        merge_and_save(model, str(out), options=MergeOptions(**{field: value}), progress=False)
    assert not out.exists()


def test_a_model_only_knob_is_refused_from_disk(make_base, make_adapter, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(
        InputError,
        match=r"maximum_memory_usage=0\.5: maximum_memory_usage applies to merges of a "
        r"loaded model",
    ):
        merge_checkpoint(
            make_base("llama"), make_adapter("llama"), str(out), options=MergeOptions(maximum_memory_usage=0.5)
        )
    assert not out.exists()


def test_a_loaded_models_keyword_and_options_conflict_is_refused_with_every_problem(make_base, make_adapter, tmp_path):
    from peft_shardmerge import merge_and_save

    model = _loaded(make_base("llama"), make_adapter("llama"))
    out = tmp_path / "out"
    with pytest.raises(InputError) as err:
        merge_and_save(
            model,
            str(out),
            dtype="bf16",
            maximum_memory_usage=2.0,
            options=MergeOptions(dtype="float16", chunk_elems=0),
        )
    text = str(err.value)
    assert "dtype='bf16' conflicts with options.dtype='float16'" in text
    assert "chunk_elems must be a positive int, got 0" in text and "maximum_memory_usage" in text
    assert not out.exists()
    # equivalent spellings are one value, and PEFT's combination_type is the options' combination
    opts = MergeOptions(dtype="bfloat16", combination="cat")
    merge_and_save(model, str(out), dtype=torch.bfloat16, combination_type="cat", options=opts, progress=False)
    assert out.is_dir()


def test_nf4_without_bitsandbytes_is_refused_before_anything_is_written(
    make_base, make_adapter, tmp_path, monkeypatch
):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as on a machine without it: import fails
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"quantizes with bitsandbytes, which is not installed: pip install "):
        merge_checkpoint(make_base("llama"), make_adapter("llama"), str(out), base_precision="nf4", progress=False)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
