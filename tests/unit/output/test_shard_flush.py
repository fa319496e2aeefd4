"""A shard goes to the disk while it is written (output/writer.py's Flusher), and a failed flush fails the merge."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.output import direct
from peft_shardmerge.output import writer as writer_module
from peft_shardmerge.output.writer import ShardWriter


def _entries(n: int):
    return [(f"t{i}", "F32", (1 << 18,), 1 << 20) for i in range(n)]  # 1 MiB each


def test_a_shard_is_flushed_while_it_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "FLUSH_EVERY", 1 << 20)
    monkeypatch.setenv(direct.ENVIRONMENT, "0")  # through the page cache (past it, nothing is left to flush)
    monkeypatch.setattr(direct, "preallocate", lambda fd, path, size: False)  # the file grows as it is written
    real, sizes, flushed = os.fdatasync, [], threading.Event()

    def recorded(fd):
        sizes.append(os.fstat(fd).st_size)
        real(fd)
        flushed.set()

    monkeypatch.setattr(os, "fdatasync", recorded)
    path = tmp_path / "model.safetensors"
    tensors = [torch.full((1 << 18,), float(i)) for i in range(4)]
    with ShardWriter(str(path), _entries(4)) as w:
        sink = w.at(0)
        sink.write(tensors[0])
        sink.finish()
        assert flushed.wait(30), "no flush was asked for after the first MiB"
        first = sizes[0]
        for i in (1, 2, 3):
            sink = w.at(i)
            sink.write(tensors[i])
            sink.finish()
    assert 0 < first < path.stat().st_size  # the first flush came before the last bytes were written
    assert len(sizes) >= 2
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[f"t{i}"], t) for i, t in enumerate(tensors))


def test_a_failed_flush_fails_the_shard_even_when_the_last_fsync_succeeds(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "FLUSH_EVERY", 1 << 20)
    monkeypatch.setenv(direct.ENVIRONMENT, "0")  # through the page cache (past it: test_direct_writes.py)

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)  # os.fsync, the final one, is left as it is
    w = ShardWriter(str(tmp_path / "model.safetensors"), _entries(2))
    for i in range(2):
        sink = w.at(i)
        sink.write(torch.zeros(1 << 18))
        sink.finish()
    with pytest.raises(OSError) as e:
        w.close()
    assert e.value.errno == errno.EIO


def test_a_merge_whose_flush_fails_leaves_nothing(make_base, make_adapter, tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "FLUSH_EVERY", 1)

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    out = tmp_path / "out"
    with pytest.raises(OSError) as e:
        merge_checkpoint(make_base("llama"), make_adapter("llama", "default"), str(out), progress=False)
    assert e.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []
