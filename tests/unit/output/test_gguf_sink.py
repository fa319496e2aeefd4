"""The GGUF sink's streaming: however the merged bytes arrive (row blocks splitting rows and heads, stored bytes in
pieces, one at a time or all at once), each GGUF tensor's bytes are those of the whole tensor encoded at once."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from peft_shardmerge.output.gguf_arch import GGUFTensor
from peft_shardmerge.output.gguf_sink import _TensorWriter
from peft_shardmerge.output.gguf_types import encode

Q = gguf.GGMLQuantizationType


class _File:
    """Where a tensor writer puts its bytes: a bytearray."""

    def __init__(self, size: int):
        self.data, self.done = bytearray(size), set()

    def put(self, data: bytes, offset: int, name: str) -> None:
        self.data[offset : offset + len(data)] = data

    def written(self, name: str) -> None:
        self.done.add(name)


def _whole(values: np.ndarray, t: GGUFTensor) -> bytes:
    """The tensor encoded at once, as the converter does: rows kept, permuted, shifted."""
    rows = values.reshape(-1, values.shape[-1]) if values.ndim > 1 else values.reshape(-1, 1)
    rows = rows[: t.rows] if t.rows is not None else rows
    if t.heads:
        n = rows.shape[0]
        rows = rows.reshape(t.heads, 2, n // t.heads // 2, -1).swapaxes(1, 2).reshape(n, -1)
    rows = rows + np.float32(t.shift) if t.shift else rows
    return encode(rows if values.ndim > 1 else rows.reshape(-1), t.qtype)


@pytest.mark.parametrize(
    "shape,qtype,heads,shift,keep",
    [
        ((16, 64), Q.Q8_0, 4, 0.0, None),  # q rows of 4 heads, permuted
        ((16, 64), Q.F16, 2, 0.0, None),
        ((12, 256), Q.Q4_K, 0, 0.0, None),
        ((64,), Q.F32, 0, 1.0, None),  # Gemma's norm + 1
        ((10, 32), Q.BF16, 0, 0.0, 7),  # Gemma 3's embedding cut to 7 rows
        ((0, 32), Q.F16, 0, 0.0, None),
    ],
)
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_any_split_of_the_bytes_gives_the_whole_tensors_bytes(shape, qtype, heads, shift, keep, dtype):
    rng = np.random.default_rng(0)
    values = rng.standard_normal(shape).astype(np.float32)
    if dtype == "BF16":  # what the merge streams: the bf16 values as stored
        values = ((values.view(np.uint32) >> 16).astype(np.uint32) << 16).view(np.float32)
        raw = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = values.tobytes()
    out_shape = (keep, *shape[1:]) if keep else shape
    t = GGUFTensor("t", out_shape, qtype, ("x",), heads=heads, shift=shift, rows=keep)
    want = _whole(values, t)
    for cuts in (0, 1, 3, 17):
        points = sorted(rng.choice(max(1, len(raw)), size=min(cuts, len(raw)), replace=False)) if raw else []
        pieces = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)])]
        file = _File(len(want) + 8)
        w = _TensorWriter(file, "x", dtype, shape, len(raw), t, 8)
        for piece in pieces:
            w.feed(memoryview(piece))
        w.finish()
        assert bytes(file.data[8:]) == want and file.done == {"x"}, cuts
