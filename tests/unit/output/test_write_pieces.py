"""A shard's bytes go to the kernel in pieces of at most ``WRITE_PIECE`` (output/writer.py), whatever the size of the
row block handed in: in order, in place and through a copy; the file is the same as written whole (through the page
cache; past it, test_direct_writes.py)."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from peft_shardmerge.output import direct
from peft_shardmerge.output import writer as writer_module
from peft_shardmerge.output.writer import ShardWriter

N = 7 * writer_module.WRITE_PIECE // 4 + 5  # float32 elements: 7 pieces and a little more


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """The size of every write/pwrite into the "out" file and of every pread from the "src" file; copies done
    without the kernel."""
    sizes: dict[str, list[int]] = {"written": [], "read": []}
    real_write, real_pwrite, real_pread = os.write, os.pwrite, os.pread

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("out.safetensors"):
            sizes["written"].append(len(data))
        return real_write(fd, data)

    def pwrite(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("out.safetensors"):
            sizes["written"].append(len(data))
        return real_pwrite(fd, data, offset)

    def pread(fd, n, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("src.safetensors"):
            sizes["read"].append(n)
        return real_pread(fd, n, offset)

    def no_kernel_copy(*args):
        raise OSError(errno.EXDEV, "cross-device link")  # as between two filesystems: the copy reads and writes

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "copy_file_range", no_kernel_copy)
    monkeypatch.setenv(direct.ENVIRONMENT, "0")  # through the page cache (test_direct_writes.py: past it)
    return sizes


@pytest.mark.parametrize("placed", [False, True], ids=["in order", "in place"])
def test_large_blocks_and_copies_are_written_in_pieces(placed, calls, tmp_path):
    src = tmp_path / "src.safetensors"
    tensors = {"a": torch.arange(N, dtype=torch.float32), "b": torch.linspace(-1, 1, N)}
    save_file({"b": tensors["b"]}, str(src))
    data_start = 8 + int.from_bytes(src.read_bytes()[:8], "little")
    entries = [(k, "F32", (N,), 4 * N) for k in tensors]
    path = tmp_path / "out.safetensors"
    fd = os.open(src, os.O_RDONLY)
    try:
        with ShardWriter(str(path), entries) as w:
            if placed:
                sink = w.at(0)
                sink.write(tensors["a"])
                sink.finish()
                sink = w.at(1)
                sink.copy_from(fd, data_start, 4 * N)
                sink.finish()
            else:
                w.write(tensors["a"])
                w.copy_from(fd, data_start, 4 * N)
    finally:
        os.close(fd)
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    data = calls["written"][1:]  # the header is written first, in one call
    assert sum(data) == 8 * N and max(data) == writer_module.WRITE_PIECE
    assert sum(calls["read"]) == 4 * N and max(calls["read"]) == writer_module.WRITE_PIECE
