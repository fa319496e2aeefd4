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
    """A part's bytes as the executor streams them: in order (row blocks of merged tensors, ranges of stored files),
    or each tensor at its place from worker threads."""

    def __init__(self, sizes):
        self.data, self.pos = bytearray(sum(sizes)), 0
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def write(self, tensor):
        self.put(self.pos, tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def copy_from(self, fd, offset, nbytes):
        self.put(self.pos, os.pread(fd, nbytes, offset))

    def put(self, at, raw):
        self.data[at : at + len(raw)] = raw
        self.pos = at + len(raw)

    def at(self, index):
        return _Place(self, self.starts[index])


class _Place:
    """One tensor's writer at its place in the part."""

    def __init__(self, part, start):
        self.part, self.pos, self.nbytes = part, start, 0

    def write(self, tensor):
        self.put(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    def copy_from(self, fd, offset, nbytes):
        self.put(os.pread(fd, nbytes, offset))

    def put(self, raw):
        self.part.data[self.pos : self.pos + len(raw)] = raw
        self.pos, self.nbytes = self.pos + len(raw), self.nbytes + len(raw)

    def finish(self):
        pass


class _MemoryOutput:
    done: set[int] = set()

    def __init__(self, sink, layout):
        self.sink, self.layout = sink, layout

    def write(self, parts, produce):
        for i in parts:
            entries = self.layout.parts[i][1]
            writer = _Bytes([e[3] for e in entries])
            produce(i, writer)
            for (name, _, _, nbytes), start in zip(entries, writer.starts):
                self.sink.tensors[name] = bytes(writer.data[start : start + nbytes])

    def finish(self, finish):
        for check in finish.checks:
            check()
        self.sink.finished = finish


@pytest.mark.parametrize("workers", [1, 2])
def test_a_destination_written_against_the_protocol_gets_the_bytes_a_folder_gets(
    workers, make_base, make_adapter, tmp_path
):
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    folder = str(tmp_path / "folder")
    plan = plan_checkpoint_merge(base, adapter, folder, chunk_elems=4096, max_shard_size="200KB")
    assert len(plan.shard_names) > 1  # several parts, each streamed in row blocks
    memory = _Memory()
    assert isinstance(memory, Sink) and not isinstance(memory, SharedSink)
    kept = run(plan, CheckpointReader(plan, workers=workers), memory, progress=False)
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


def _compared(tmp_path, produce, *, placed: bool):
    """A checkpoint of a 2x2 tensor and a zero-size one after it, compared with what ``produce`` streams."""
    from safetensors.torch import save_file

    from peft_shardmerge.engine.sink import Finish, Layout
    from peft_shardmerge.io.safetensors_io import read_header

    path = str(tmp_path / "model.safetensors")
    save_file({"a": torch.ones(2, 2), "z": torch.empty(0, 3)}, path)
    stored = {t.name: t for t in read_header(path)[0]}
    sink = CompareSink(str(tmp_path), stored, rounding={"a"})
    layout = Layout([("model.safetensors", [("a", "F32", (2, 2), 16), ("z", "F32", (0, 3), 0)])])
    with sink.open(layout) as out:
        out.write([0], lambda i, w: produce([w.at(0), w.at(1)] if placed else [w, w]))
        out.finish(Finish(config={}))
    return sink


@pytest.mark.parametrize("placed", [False, True])
def test_the_comparison_takes_a_zero_size_tensor_last_and_names_a_byte_count_that_differs(tmp_path, placed):
    def same(writers):
        writers[0].write(torch.ones(2, 2))
        writers[1].write(torch.empty(0, 3))  # the one empty block a reader sends for a zero-size tensor
        for w in writers if placed else ():
            w.finish()

    sink = _compared(tmp_path, same, placed=placed)
    assert (sink.compared, sink.bitwise, sink.differ) == (2, 2, [])

    def short(writers):
        writers[0].write(torch.ones(3))
        writers[1].write(torch.empty(0, 3))
        for w in writers if placed else ():
            w.finish()

    sink = _compared(tmp_path, short, placed=placed)
    assert sink.differ == [("a", "12 bytes recomputed, 16 stored")] and sink.compared == 2

    def long(writers):
        writers[0].write(torch.ones(5))
        for w in writers if placed else ():
            w.finish()

    sink = _compared(tmp_path, long, placed=placed)
    assert sink.differ == [("a", "20 bytes recomputed, 16 stored")] and sink.compared == 2


def test_the_comparison_counts_the_bytes_a_copied_tensor_differs_by(tmp_path):
    """A tensor the merge copies (its stored bytes, ``copy_from``) is compared byte for byte; the count is of bytes."""
    from safetensors.torch import save_file

    from peft_shardmerge.engine.sink import Finish, Layout
    from peft_shardmerge.io.safetensors_io import read_header

    save_file({"a": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    save_file({"a": torch.tensor([1.0, 1.0, 1.0, 2.0])}, str(tmp_path / "base.safetensors"))  # 2.0: 2 bytes off 1.0
    stored = {t.name: t for t in read_header(str(tmp_path / "model.safetensors"))[0]}
    base = read_header(str(tmp_path / "base.safetensors"))[0][0]
    sink = CompareSink(str(tmp_path), stored, rounding=set())
    fd = os.open(base.path, os.O_RDONLY)
    try:
        with sink.open(Layout([("model.safetensors", [("a", "F32", (4,), 16)])])) as out:
            out.write([0], lambda i, w: w.copy_from(fd, base.offset, base.nbytes))
            out.finish(Finish(config={}))
    finally:
        os.close(fd)
    assert sink.differ == [("a", "2 bytes differ from base + adapter")]
