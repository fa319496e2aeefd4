"""MergeOptions: one frozen value for the disk API's knobs, every problem at once, conflicts refused."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from peft_shardmerge import InputError, merge_checkpoint, plan_checkpoint_merge
from peft_shardmerge.options import MergeOptions


def test_options_are_frozen_and_weights_a_tuple():
    opts = MergeOptions(weights=[0.5, 0.5], dtype="bfloat16")
    assert opts.weights == (0.5, 0.5) and opts.problems() == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.dtype = "float16"  # type: ignore[misc]
    assert MergeOptions(base_precision="nf4", nf4_blocksize=128).nf4.blocksize == 128
    assert MergeOptions().nf4 is None


def test_every_problem_of_the_options_at_once():
    opts = MergeOptions(weights=[1.0, float("nan")], combination="sum", dtype="int4", max_shard_size="lots",
                        base_precision="nf4", nf4_blocksize=100, device="tpu", chunk_elems=0, progress="yes")
    problems = opts.problems()
    assert problems == [
        "adapter weights must be finite numbers, got [1.0, nan]",
        "combination must be one of cat, linear, got 'sum'",
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
    opts, problems = MergeOptions.merged(MergeOptions(dtype="float16", chunk_elems=1 << 10), dtype="bfloat16",
                                         chunk_elems=1 << 10, max_shard_size="1MB")
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
        merge_checkpoint(base, adapter, out, dtype="float16", progress=False,
                         options=MergeOptions(dtype="bfloat16", chunk_elems=-1))
    assert e.value.problems[:2] == ["dtype='float16' conflicts with options.dtype='bfloat16'; give it in one place",
                                    "chunk_elems must be a positive int, got -1"]
    assert not os.path.exists(out)
    plan = plan_checkpoint_merge(base, adapter, out, options=MergeOptions(dtype="bfloat16", max_shard_size="100KB"))
    assert plan.dtype == torch.bfloat16 and len(plan.shard_names) > 1


def _files(folder: str) -> dict[str, bytes]:
    names = [n for n in sorted(os.listdir(folder)) if n != "merge_manifest.json"]
    return {n: open(os.path.join(folder, n), "rb").read() for n in names}


def test_options_and_keywords_give_byte_identical_outputs(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    keywords = merge_checkpoint(base, adapter, str(tmp_path / "kw"), dtype="bfloat16", max_shard_size="100KB",
                                chunk_elems=1 << 12, device="cpu", progress=False)
    options = merge_checkpoint(base, adapter, str(tmp_path / "opt"), options=MergeOptions(
        dtype="bfloat16", max_shard_size="100KB", chunk_elems=1 << 12, device="cpu", progress=False))
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
        "dtype='float16' conflicts with options.dtype='bfloat16'; give it in one place"]


def test_bad_weights_and_combination_are_reported_with_every_other_problem(make_base, make_adapter, tmp_path):
    with pytest.raises(InputError) as e:
        merge_checkpoint(make_base("llama"), make_adapter("llama", "default"), str(tmp_path / "out"), dtype="int3",
                         max_shard_size="huge", base_precision="best", chunk_elems=0, combination="sum",
                         weights=[float("nan")], progress=False)
    assert len(e.value.problems) == 6, e.value.problems
    assert not (tmp_path / "out").exists()
