"""The Source protocol: a checkpoint on disk and the same model loaded give the same base tensors and rows."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from peft_shardmerge.checkpoint.source import open_checkpoint
from peft_shardmerge.engine.source import Source
from peft_shardmerge.io.safetensors_io import RowReader, row_blocks
from peft_shardmerge.model.planner import LiveSource
from peft_shardmerge.model.walk import walk


def _both(base: str, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    return open_checkpoint(base), LiveSource(walk(model, None))


def test_both_sources_implement_the_protocol_and_agree_on_every_tensor(make_base):
    disk, live = _both(make_base("llama_sharded"))
    assert isinstance(disk, Source) and isinstance(live, Source)
    on_disk = {t.name: t for t in disk.base_tensors()}
    in_memory = {t.name: t for t in live.base_tensors()}
    assert set(in_memory) <= set(on_disk) and len(in_memory) > 10
    reader = RowReader()
    try:
        for name, t in in_memory.items():
            assert on_disk[name].shape == t.shape, name
            rows_disk = disk.base_rows(name, torch.device("cpu"), reader)
            rows_live = live.base_rows(name, torch.device("cpu"))
            for start, stop in row_blocks(t.shape, 300):  # several blocks per weight
                a = rows_disk(start, stop).float().reshape(stop - start, -1)
                b = rows_live(start, stop).float().reshape(stop - start, -1)
                assert torch.equal(a, b), f"{name} rows {start}:{stop}"
    finally:
        reader.close()


def test_a_row_block_of_the_disk_source_reads_only_its_rows(make_base):
    disk = open_checkpoint(make_base("llama"))
    name = next(t.name for t in disk.tensors if t.name.endswith("mlp.down_proj.weight"))
    info = disk.by_name[name]
    reader = RowReader()
    try:
        rows = disk.base_rows(name, torch.device("cpu"), reader)
        first = rows(0, 2).clone()
        assert len(reader._buf) == 2 * info.nbytes // info.shape[0]  # two rows' bytes, not the tensor's
        from safetensors import safe_open

        with safe_open(info.path, "pt") as f:
            assert torch.equal(first, f.get_slice(name)[0:2])
    finally:
        reader.close()
