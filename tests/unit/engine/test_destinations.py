"""The executor's destinations: a new one is one class against the Sink protocol, with no change to the executor."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

from peft_shardmerge import plan_checkpoint_merge
from peft_shardmerge.checkpoint.reader import CheckpointReader
from peft_shardmerge.engine.execute import run
from peft_shardmerge.engine.sink import SharedSink, Sink
from peft_shardmerge.errors import MergeCheckError
from peft_shardmerge.output.shard_sink import FolderSink
from peft_shardmerge.verify.compare import CompareSink
from tests.helpers import folder_tensors


class _Memory:
    """A destination kept in memory: each part's tensors gathered from the row blocks the executor streams."""

    label = "keeping"

    def __init__(self):
        self.location, self.tensors, self.finished, self.committed = "memory", {}, None, False

    @contextmanager
    def open(self, layout):
        out = _MemoryOutput(self, layout)
        yield out
        self.committed = True


class _Bytes:
    """A part's bytes as the executor streams them: row blocks of merged tensors, ranges of stored files."""

    def __init__(self):
        self.data = bytearray()

    def write(self, tensor):
        self.data += tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    def copy_from(self, fd, offset, nbytes):
        self.data += os.pread(fd, nbytes, offset)


class _MemoryOutput:
    done: set[int] = set()

    def __init__(self, sink, layout):
        self.sink, self.layout = sink, layout

    def write(self, parts, produce):
        for i in parts:
            writer = _Bytes()
            produce(i, writer)
            pos = 0
            for name, _, _, nbytes in self.layout.parts[i][1]:
                self.sink.tensors[name], pos = bytes(writer.data[pos : pos + nbytes]), pos + nbytes
            assert pos == len(writer.data)

    def finish(self, finish):
        for check in finish.checks:
            check()
        self.sink.finished = finish


def test_a_destination_written_against_the_protocol_gets_the_bytes_a_folder_gets(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    folder = str(tmp_path / "folder")
    plan = plan_checkpoint_merge(base, adapter, folder, chunk_elems=4096, max_shard_size="200KB")
    assert len(plan.shard_names) > 1  # several parts, each streamed in row blocks
    memory = _Memory()
    assert isinstance(memory, Sink) and not isinstance(memory, SharedSink)
    kept = run(plan, CheckpointReader(plan), memory, progress=False)
    written = run(plan, CheckpointReader(plan), FolderSink(folder, overwrite=False), progress=False)
    on_disk = folder_tensors(folder)
    assert memory.committed and memory.finished.config == plan.config
    assert set(memory.tensors) == set(on_disk)
    raw = {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in on_disk.items()}
    assert [n for n in on_disk if memory.tensors[n] != raw[n]] == []
    assert kept.lora_modules_merged == written.lora_modules_merged > 0
    assert kept.out_dir.endswith("memory") and kept.tensors_written == len(on_disk)


def test_a_destination_that_fails_its_finish_is_not_committed(make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    plan = plan_checkpoint_merge(base, adapter, str(tmp_path / "unused"))
    memory = _Memory()
    reader = CheckpointReader(plan)
    reader.counts.applied["lora:never-planned"] = 1  # the count check fails: a change applied that the plan never had
    with pytest.raises(MergeCheckError):
        run(plan, reader, memory, progress=False)
    assert not memory.committed


def test_the_folder_is_shared_by_ranks_the_comparison_is_not():
    assert isinstance(FolderSink("x", overwrite=False), SharedSink)
    compare = CompareSink("x", {}, rounding=set())
    assert isinstance(compare, Sink) and not isinstance(compare, SharedSink)
