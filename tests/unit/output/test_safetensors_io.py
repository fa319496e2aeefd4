"""Our safetensors header parser, row reader and streaming writer against the safetensors library itself."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from peft_shardmerge import CorruptFileError, MergeCheckError
from peft_shardmerge.io.safetensors_io import RowReader, read_header, row_blocks
from peft_shardmerge.output.writer import ShardWriter

TENSORS = {
    "a.weight": torch.randn(37, 16, dtype=torch.bfloat16),
    "b.bias": torch.randn(16),
    "c.ids": torch.arange(10, dtype=torch.int64),
    "d.half": torch.randn(3, 4, 5, dtype=torch.float16),
    "e.scalar": torch.tensor(3.5),
}


@pytest.fixture()
def st_file(tmp_path):
    path = str(tmp_path / "x.safetensors")
    save_file(TENSORS, path, metadata={"format": "pt"})
    return path


def test_header_and_rows_match_safetensors(st_file):
    infos, meta = read_header(st_file)
    assert meta == {"format": "pt"}
    assert {i.name for i in infos} == set(TENSORS)
    with RowReader() as reader:
        for info in infos:
            want = TENSORS[info.name]
            assert info.shape == tuple(want.shape)
            assert torch.equal(reader.read(info), want)
            if want.dim() >= 1 and want.shape[0] > 3:
                blocks = row_blocks(info.shape, 40)
                got = torch.cat([reader.read_rows(info, s, e).clone() for s, e in blocks])
                assert torch.equal(got, want)


def test_row_blocks():
    assert row_blocks((10, 4), 16) == [(0, 4), (4, 8), (8, 10)]
    assert row_blocks((3, 100), 10) == [(0, 1), (1, 2), (2, 3)]
    assert row_blocks((), 10) == [(0, 1)]
    assert row_blocks((0, 5), 10) == [(0, 0)]


def test_streaming_writer_is_read_by_safetensors(tmp_path):
    path = str(tmp_path / "out.safetensors")
    entries = [
        (
            n,
            {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.float16: "F16"}[t.dtype],
            tuple(t.shape),
            t.numel() * t.element_size(),
        )
        for n, t in TENSORS.items()
    ]
    with ShardWriter(path, entries) as w:
        for name, t in TENSORS.items():
            if t.dim() and t.shape[0] > 2:
                for s, e in row_blocks(tuple(t.shape), 20):
                    w.write(t[s:e])
            else:
                w.write(t)
    with safe_open(path, framework="pt") as h:
        assert h.metadata() == {"format": "pt"}
        assert list(h.keys()) == sorted(TENSORS)
        for name, t in TENSORS.items():
            assert torch.equal(h.get_tensor(name), t)


def test_writer_refuses_wrong_byte_count(tmp_path):
    path = str(tmp_path / "out.safetensors")
    with pytest.raises(MergeCheckError, match="wrote 4 data bytes, header announced 8"):
        with ShardWriter(path, [("w", "F32", (2,), 8)]) as w:
            w.write(torch.ones(1))


def _raw(tmp_path, header_bytes: bytes, length: int | None = None, data: bytes = b"") -> str:
    path = str(tmp_path / "bad.safetensors")
    n = len(header_bytes) if length is None else length
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + header_bytes + data)
    return path


@pytest.mark.parametrize(
    "header,length,data,message",
    [
        (b"{}", 10**12, b"", "header length 1000000000000 is beyond the file"),
        (b"{not json", None, b"", "header is not valid JSON"),
        (b"[]", None, b"", "header is not a JSON object"),
        (
            json.dumps({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}).encode(),
            None,
            b"\0",
            "unknown dtype 'Q7'",
        ),
        (
            json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode(),
            None,
            b"\0" * 4,
            "ends beyond the file",
        ),
        (
            json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode(),
            None,
            b"\0" * 4,
            "do not fit its dtype F32",
        ),
        (
            json.dumps(
                {
                    "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]},
                }
            ).encode(),
            None,
            b"\0" * 8,
            "overlaps another",
        ),
        (json.dumps({"w": {"dtype": "F32", "shape": [1]}}).encode(), None, b"", "lacks dtype/shape/data_offsets"),
    ],
)
def test_corrupt_headers(tmp_path, header, length, data, message):
    with pytest.raises(CorruptFileError, match=message):
        read_header(_raw(tmp_path, header, length, data))


def test_too_short(tmp_path):
    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    with pytest.raises(CorruptFileError, match="too short to be safetensors"):
        read_header(str(path))


def test_writer_failing_on_its_header_leaves_no_thread_or_descriptor(tmp_path, monkeypatch):
    import os
    import threading

    path = str(tmp_path / "out.safetensors")
    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = threading.active_count()

    def full(self, view, data=True):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardWriter, "_write_all", full)
    for _ in range(3):
        with pytest.raises(OSError, match="No space left"):
            ShardWriter(path, [("w", "F32", (2,), 8)])
        os.remove(path)
    assert threading.active_count() == threads_before
    assert len(os.listdir("/proc/self/fd")) == fds_before
