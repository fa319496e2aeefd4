"""The one executor and its two Sources: a checkpoint on disk and the same model loaded write the same bytes."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from peft_shardmerge import plan_checkpoint_merge, plan_model_merge
from peft_shardmerge.checkpoint.reader import CheckpointReader
from peft_shardmerge.engine.budget import MemoryBudget
from peft_shardmerge.engine.execute import run
from peft_shardmerge.engine.source import Source
from peft_shardmerge.io.safetensors_io import RowReader
from peft_shardmerge.output.shard_sink import FolderSink
from tests.helpers import folder_tensors


def test_both_sources_through_the_one_executor_write_the_same_bytes(make_base, tmp_path):
    from peft_shardmerge.model.reader import ModelReader

    base = make_base("llama_sharded")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    model.save_pretrained(str(tmp_path / "adapter"))
    disk_plan = plan_checkpoint_merge(base, str(tmp_path / "adapter"), str(tmp_path / "disk"), chunk_elems=4096)
    live_plan = plan_model_merge(model, base_precision="dequantized")
    disk, live = CheckpointReader(disk_plan), ModelReader(live_plan, MemoryBudget(0.9))
    assert isinstance(disk, Source) and isinstance(live, Source)
    a = run(disk_plan, disk, FolderSink(str(tmp_path / "disk"), overwrite=False), progress=False)
    b = run(live_plan, live, FolderSink(str(tmp_path / "live"), overwrite=False), progress=False)
    assert a.lora_modules_merged == b.lora_modules_merged == 4
    on_disk, in_memory = folder_tensors(str(tmp_path / "disk")), folder_tensors(str(tmp_path / "live"))
    assert set(on_disk) == set(in_memory) and len(on_disk) > 10
    assert [n for n in on_disk if not torch.equal(on_disk[n], in_memory[n])] == []


def test_a_row_block_of_the_disk_source_reads_only_its_rows(make_base):
    from peft_shardmerge.checkpoint.base_folder import open_checkpoint

    disk = open_checkpoint(make_base("llama"))
    name = next(t.name for t in disk.tensors if t.name.endswith("mlp.down_proj.weight"))
    info = disk.by_name[name]
    with RowReader() as reader:
        first = reader.read_rows(info, 0, 2).clone()
        assert reader.buffer_bytes() == 2 * info.nbytes // info.shape[0]  # two rows' bytes, not the tensor's
        with safe_open(info.path, "pt") as f:
            assert torch.equal(first, f.get_slice(name)[0:2])
