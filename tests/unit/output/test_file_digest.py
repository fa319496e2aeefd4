"""A shard's whole-file SHA-256 taken while it is written (what names it on the Hub) equals hashlib's of the file,
however its tensors arrive: in order, copied from another file, or at their places from several threads."""

from __future__ import annotations

import hashlib
import os
import random
import threading

import pytest
import torch

from peft_shardmerge.errors import MergeCheckError
from peft_shardmerge.output.writer import ShardWriter


def _entries(sizes):
    return [(f"t{i}", "F32", (n,), 4 * n) for i, n in enumerate(sizes)]


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


SIZES = [0, 1, 1000, 300_000, 7, 0, 262_144, 3]  # empty tensors, odd sizes, pieces past 1 MiB


def test_in_order_and_copied(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(4 * sum(SIZES)))
    path = str(tmp_path / "a.safetensors")
    fd = os.open(src, os.O_RDONLY)
    try:
        with ShardWriter(path, _entries(SIZES), file_digest=True) as w:
            offset = 0
            for i, n in enumerate(SIZES):
                if i % 2:  # every other tensor copied from the file (in the kernel where it can)
                    w.copy_from(fd, offset, 4 * n)
                else:
                    w.write(torch.randn(n))
                offset += 4 * n
    finally:
        os.close(fd)
    assert w.sha256() == _sha(path)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_placed_in_any_order_from_threads(tmp_path, seed):
    path = str(tmp_path / "b.safetensors")
    rng = random.Random(seed)
    order = list(range(len(SIZES)))
    rng.shuffle(order)
    data = {i: torch.randn(n) for i, n in enumerate(SIZES)}
    w = ShardWriter(path, _entries(SIZES), file_digest=True)

    def place(i: int) -> None:
        sink = w.at(i)
        sink.write(data[i])
        sink.finish()

    threads = [threading.Thread(target=place, args=(i,)) for i in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    assert w.sha256() == _sha(path)


def test_asked_before_every_tensor_is_placed(tmp_path):
    w = ShardWriter(str(tmp_path / "c.safetensors"), _entries([2, 2]), file_digest=True)
    sink = w.at(1)
    sink.write(torch.ones(2))
    sink.finish()
    with pytest.raises(MergeCheckError, match="before every tensor"):
        w.sha256()
    w.abort()


def test_a_writer_without_it_says_so(tmp_path):
    with ShardWriter(str(tmp_path / "d.safetensors"), _entries([1])) as w:
        w.write(torch.ones(1))
    with pytest.raises(MergeCheckError, match="without its file digest"):
        w.sha256()
