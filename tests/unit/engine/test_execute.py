"""The executor's failure paths: nothing half-written survives, and accelerator OOM falls back to the CPU."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

import peft_shardmerge.engine.execute as execute
import peft_shardmerge.engine.row_merge as row_merge
from peft_shardmerge import merge_checkpoint, plan_checkpoint_merge
from peft_shardmerge.checkpoint.reader import CheckpointReader
from peft_shardmerge.engine.pipeline import default_workers
from peft_shardmerge.output.shard_sink import FolderSink
from tests.helpers import folder_tensors


def _leftovers(folder) -> list[str]:
    return [p for p in os.listdir(folder) if p.startswith(".")]


@pytest.mark.parametrize("existing", [False, True])
def test_failure_mid_merge_leaves_no_output(existing, make_base, make_adapter, tmp_path, monkeypatch):
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    out = tmp_path / "out"
    if existing:
        out.mkdir()  # an earlier output of ours (its record lists its files), which overwrite may replace
        (out / "model.safetensors").write_text("the previous output")
        (out / "merge_manifest.json").write_text(
            '{"format": "peft-shardmerge merge record", "shards": {"model.safetensors": {}}, "files": {}}'
        )
    calls = {"n": 0}
    real = row_merge.merge_block

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(row_merge, "merge_block", failing)
    with pytest.raises(OSError, match="No space left on device"):
        merge_checkpoint(base, adapter, str(out), overwrite=True, max_shard_size="200KB", progress=False)
    # the tensors already handed to the worker threads (at most 2 per worker ahead of the writer) may finish, one
    # block each here; no other one starts
    assert 5 <= calls["n"] <= 5 + 2 * default_workers()
    assert _leftovers(tmp_path) == []
    if existing:
        assert sorted(os.listdir(out)) == ["merge_manifest.json", "model.safetensors"]
        assert (out / "model.safetensors").read_text() == "the previous output"
    else:
        assert not out.exists()


def test_accelerator_oom_falls_back_to_cpu(make_base, make_adapter, tmp_path, monkeypatch):
    """A real torch.OutOfMemoryError raised from the compute step on the accelerator for one module:
    that block is redone on the CPU, counted, and the output equals an all-CPU merge."""
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    victim = "model.layers.1.mlp.down_proj.weight"
    real = row_merge.RowMerger._lora_rows

    def lora_rows(base_rows, changes, start, stop, device, probes, inplace=False):
        if device.type != "cpu":
            if victim.removesuffix(".weight") in changes.keys:  # the LoRA module of that weight
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            device = torch.device("cpu")
        return real(base_rows, changes, start, stop, device, probes, inplace)

    monkeypatch.setattr(row_merge.RowMerger, "_lora_rows", staticmethod(lora_rows))
    # "meta" stands in for the accelerator; blocks of other modules are computed on the CPU
    plan = plan_checkpoint_merge(base, adapter, str(tmp_path / "a"), dtype="float32", device="cpu")
    report = execute.run(
        plan,
        CheckpointReader(plan, torch.device("meta")),
        FolderSink(str(tmp_path / "a"), overwrite=False),
        progress=False,
    )
    assert report.cpu_fallbacks == 1
    assert "redone on the CPU" in report.summary()
    monkeypatch.undo()
    merge_checkpoint(base, adapter, str(tmp_path / "b"), dtype="float32", device="cpu", progress=False)
    with (
        safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as ha,
        safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as hb,
    ):
        for k in ha.keys():
            assert torch.equal(ha.get_tensor(k), hb.get_tensor(k)), k


@pytest.mark.parametrize(
    ("arch", "tag", "targets", "victim"),
    [
        ("llama_sharded", "dora", ["q_proj", "v_proj", "up_proj"], "model.layers.0.mlp.up_proj.weight"),
        # merged whole for PEFT's column norm before its block: the retry must not reuse those rescaled rows
        ("llama", "dora-embedding", ["q_proj", "embed_tokens"], "model.embed_tokens.weight"),
    ],
)
def test_an_out_of_memory_after_the_lora_step_redoes_the_block(
    arch, tag, targets, victim, make_base, make_adapter, tmp_path, monkeypatch
):
    """An out-of-memory in a block's later steps (DoRA's rescale, the checks, the cast: on the device since the rows
    stay where they were merged) redoes the block on the CPU from its base rows, not from rows already rescaled: the
    output equals an undisturbed merge, and the retry is counted."""
    base = make_base(arch)
    adapter = make_adapter(arch, tag, use_dora=True, target_modules=targets)
    real, failed = row_merge.check_range, []

    def check_range(name, cast, dtype):  # after DoRA has rescaled the rows in place
        if name == victim and not failed:
            failed.append(name)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real(name, cast, dtype)

    monkeypatch.setattr(row_merge, "check_range", check_range)
    report = merge_checkpoint(base, adapter, str(tmp_path / "a"), dtype="bfloat16", progress=False)
    assert failed == [victim] and report.cpu_fallbacks == 1
    monkeypatch.undo()
    merge_checkpoint(base, adapter, str(tmp_path / "b"), dtype="bfloat16", progress=False)
    a, b = folder_tensors(str(tmp_path / "a")), folder_tensors(str(tmp_path / "b"))
    assert a.keys() == b.keys() and victim in a
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.parametrize("whole", [True, False])
def test_an_out_of_memory_in_doras_column_norms_is_redone(whole, make_base, make_adapter, tmp_path, monkeypatch):
    """DoRA's column norms (an embedding) are a pass of their own before the blocks: merged whole, or block by block
    into float64 sums. An out-of-memory there redoes that step on the CPU, counted, and the output equals an
    undisturbed merge."""
    base = make_base("llama")
    adapter = make_adapter("llama", "dora-embedding", use_dora=True, target_modules=["q_proj", "embed_tokens"])
    victim, real, failed = "model.embed_tokens.weight", row_merge.RowMerger._changed_rows, []

    def changed_rows(self, name, *args):  # the first rows of the embedding merged: in the column norms' pass
        if name == victim and not failed:
            failed.append(name)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real(self, name, *args)

    if not whole:
        monkeypatch.setattr(row_merge, "WHOLE_NORM_ELEMS", 0)
    options = dict(dtype="bfloat16", chunk_elems=1 << 12, progress=False)
    monkeypatch.setattr(row_merge.RowMerger, "_changed_rows", changed_rows)
    report = merge_checkpoint(base, adapter, str(tmp_path / "a"), **options)
    assert failed == [victim] and report.cpu_fallbacks == 1
    monkeypatch.setattr(row_merge.RowMerger, "_changed_rows", real)
    merge_checkpoint(base, adapter, str(tmp_path / "b"), **options)
    a, b = folder_tensors(str(tmp_path / "a")), folder_tensors(str(tmp_path / "b"))
    assert a.keys() == b.keys() and victim in a
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_merge_matches_cpu(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama_bf16"), make_adapter("llama_bf16", "default")
    merge_checkpoint(base, adapter, str(tmp_path / "gpu"), dtype="float32", device="cuda", progress=False)
    merge_checkpoint(base, adapter, str(tmp_path / "cpu"), dtype="float32", device="cpu", progress=False)
    for f in os.listdir(tmp_path / "cpu"):
        if f.endswith(".safetensors"):
            with safe_open(str(tmp_path / "gpu" / f), "pt") as hg, safe_open(str(tmp_path / "cpu" / f), "pt") as hc:
                for k in hc.keys():
                    torch.testing.assert_close(hg.get_tensor(k), hc.get_tensor(k), rtol=1e-5, atol=1e-6)
