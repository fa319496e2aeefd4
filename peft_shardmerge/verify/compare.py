"""verify's destination for the one executor: each recomputed tensor compared with the bytes a merged checkpoint
stores at its place, within the rounding a merge allows; nothing is written."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ..engine.sink import Finish, Layout
from ..io.safetensors_io import TensorInfo

#: beyond one unit in the last place of the output dtype, a merged value may differ by this many float32
#: epsilons of the largest value in its row block (a different summation order of the LoRA product)
SUM_ORDER_EPS = 8
#: how far a weight an in-process merge read from bitsandbytes' CPU repacking may be from the exact 4-bit base, as a
#: fraction of its row block's largest value: the repacking keeps each block scale in bf16 (relative error <= 2^-9),
#: and undoing it in place (a state_dict()) re-quantizes those scales with a new double-quant offset (measured up to
#: 1.5 * 2^-8 on tiny Llamas); a wrong base (another checkpoint, garbage) is off by far more
REPACK_LOSS = 2.0**-6
_PIECE = 8 << 20


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each of ``values`` (the smallest normal's below it).

    Args:
        values: any floating-point values.
        dtype: a floating-point dtype.

    Returns:
        float32 (float64 for float64) spacings, same shape.

    Example:
        >>> ulp(torch.tensor([1.0, 3.0]), torch.bfloat16).tolist()
        [0.0078125, 0.015625]
    """
    info = torch.finfo(dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    _, exponent = torch.frexp(values.to(work).abs().clamp_min(info.tiny))
    return torch.ldexp(torch.full_like(values, info.eps, dtype=work), exponent - 1)


class CompareSink:
    """A merged checkpoint as the destination of its own recomputation (:class:`~peft_shardmerge.engine.sink.Sink`):
    the executor streams each recomputed tensor into it as it would into a shard, and it compares the bytes with the
    stored ones at the same place: byte for byte, or, where ``rounding`` says the tensor was merged, each value within
    one unit in the last place of its dtype plus :data:`SUM_ORDER_EPS` float32 epsilons of its block's largest value.

    Args:
        location: the merged checkpoint.
        stored: the stored tensor each planned name is compared with.
        rounding: the planned names whose values may differ by a merge's rounding (the others must be equal).
        repacked: stored names the merge read from bitsandbytes' CPU repacking: within its loss is no verdict.

    Attributes:
        compared: tensors compared.
        bitwise: tensors equal byte for byte.
        differ: ``(planned name, what differs)``, in the order found.
        within_repacking: stored names that differ only within the repacking's loss.

    Example:
        >>> import os, tempfile
        >>> from safetensors.torch import save_file
        >>> from peft_shardmerge.engine.sink import Finish, Layout
        >>> from peft_shardmerge.io.safetensors_io import read_header
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_file({"w": torch.ones(2)}, path)
        >>> sink = CompareSink(os.path.dirname(path), {"w": read_header(path)[0][0]}, rounding=set())
        >>> with sink.open(Layout([("model.safetensors", [("w", "F32", (2,), 8)])])) as out:
        ...     out.write([0], lambda i, w: w.write(torch.tensor([1.0, 2.0])))
        ...     out.finish(Finish(config={}))
        >>> sink.compared, sink.differ
        (1, [('w', '2 bytes differ from base + adapter')])
    """

    label = "verifying"

    def __init__(
        self, location: str, stored: dict[str, TensorInfo], rounding: set[str], repacked: set[str] = frozenset()
    ):
        self.location, self.stored, self.rounding, self.repacked = location, stored, rounding, repacked
        self.compared = self.bitwise = 0
        self.differ: list[tuple[str, str]] = []
        self.within_repacking: list[str] = []
        self.lock = threading.Lock()
        self.fds: dict[str, int] = {}

    @contextmanager
    def open(self, layout: Layout) -> Iterator["_Comparing"]:
        """The comparison of ``layout``'s tensors; the stored files are closed when the block ends.

        Args:
            layout: the tensors recomputed (the recomputation's plan, in parts of its own).

        Returns:
            A context manager yielding the opened comparison.
        """
        try:
            yield _Comparing(self, layout)
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()

    def fd(self, path: str) -> int:
        """An open descriptor of the stored file ``path``."""
        with self.lock:
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_RDONLY)
            return self.fds[path]

    def tensor(self, name: str, planned: int) -> "_TensorCompare":
        """The comparison of the planned tensor ``name`` of ``planned`` bytes."""
        return _TensorCompare(self, name, planned)

    def ended(self, name: str, info: TensorInfo, outcome: str | None, repack: bool) -> None:
        """Record one tensor's outcome (None: equal byte for byte; ``""``: within the allowed rounding)."""
        with self.lock:
            self.compared += 1
            if outcome is None:
                self.bitwise += 1
            elif outcome:
                self.differ.append((name, outcome))
            elif repack:
                self.within_repacking.append(info.name)


class _Comparing:
    """An opened :class:`CompareSink` (:class:`~peft_shardmerge.engine.sink.Opened`): nothing is kept from an
    earlier run, and nothing is committed."""

    done: set[int] = frozenset()

    def __init__(self, sink: CompareSink, layout: Layout):
        self.sink, self.layout = sink, layout

    def write(self, parts: list[int], produce: Callable[[int, object], None]) -> None:
        """Compare the tensors of ``parts``, produced by ``produce(i, writer)``."""
        for i in parts:
            part = _PartCompare(self.sink, [(e[0], e[3]) for e in self.layout.parts[i][1]])
            produce(i, part)
            part.close()

    def finish(self, finish: Finish) -> None:
        """Nothing to write: the comparison is :class:`CompareSink`'s counts. The count check of ``finish`` is a
        merge's guard before it commits; every value compared here says more, and a partial recomputation (tensors
        whose layout differs left out) would fail it."""


class _PartCompare:
    """One shard's tensors compared in order (``write``/``copy_from``) or each at its place (``at``)."""

    def __init__(self, sink: CompareSink, entries: list[tuple[str, int]]):
        self.sink, self.entries = sink, entries
        self.next = 0
        self.current: _TensorCompare | None = None
        self.placed = False  # the executor wrote each tensor at its place: each finished its own comparison

    def at(self, index: int) -> "_TensorCompare":
        self.placed = True
        return self.sink.tensor(*self.entries[index])

    def _current(self) -> "_TensorCompare":
        """The tensor the next bytes belong to: the first not yet full (bytes past the last tensor go to it, which
        then says how many were recomputed)."""
        while self.current is None or (self.current.full() and self.next < len(self.entries)):
            if self.current is not None:
                self.current.finish()
            self.current, self.next = self.sink.tensor(*self.entries[self.next]), self.next + 1
        return self.current

    def write(self, tensor: torch.Tensor) -> None:
        if tensor.numel():  # a zero-size tensor's one empty block: nothing to compare, no boundary to cross
            self._current().write(tensor)

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        if nbytes:
            self._current().copy_from(fd, offset, nbytes)

    def close(self) -> None:
        """Written in order: finish the last tensor and those that received no bytes."""
        if self.placed:
            return
        if self.current is not None:
            self.current.finish()
        for entry in self.entries[self.next :]:
            self.sink.tensor(*entry).finish()


class _TensorCompare:
    """One recomputed tensor against its stored bytes, block by block."""

    def __init__(self, sink: CompareSink, name: str, planned: int):
        self.sink, self.name, self.planned = sink, name, planned
        self.info = info = sink.stored[name]
        self.fd = sink.fd(info.path)
        self.pos, self.equal, self.bad, self.worst, self.short = 0, True, 0, 0.0, False
        self.loose = info.name in sink.repacked
        self.rounding = name in sink.rounding or self.loose
        self.repack = False

    @property
    def nbytes(self) -> int:
        """The bytes compared so far (what the executor's progress counts)."""
        return self.pos

    def full(self) -> bool:
        return self.pos >= self.planned

    def _stored(self, n: int) -> bytes:
        data = os.pread(self.fd, n, self.info.offset + self.pos)
        self.pos += n
        if len(data) != n:
            self.short = True
        return data

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        for pos in range(0, nbytes, _PIECE):
            n = min(_PIECE, nbytes - pos)
            self._bytes(self._stored(n), os.pread(fd, n, offset + pos))

    def _bytes(self, stored: bytes, want: bytes) -> None:
        """Compare bytes that must be equal, counting those that differ (a short stored read: all of them)."""
        if stored == want:
            return
        self.equal = False
        if len(stored) != len(want):
            self.short, self.bad = True, self.bad + len(want)
            return
        a, b = (torch.frombuffer(bytearray(x), dtype=torch.uint8) for x in (stored, want))
        self.bad += int((a != b).sum())

    def write(self, tensor: torch.Tensor) -> None:
        want = tensor.detach().to("cpu").contiguous().reshape(-1)
        raw = self._stored(want.numel() * want.element_size())
        if self.short:
            self.equal = False
            return
        if not (self.rounding and want.is_floating_point()):
            self._bytes(raw, want.view(torch.uint8).numpy().tobytes())
            return
        if raw == want.view(torch.uint8).numpy().tobytes():
            return
        self.equal = False
        got = torch.frombuffer(bytearray(raw), dtype=want.dtype)
        work = torch.float64 if want.dtype == torch.float64 else torch.float32
        g, w = got.to(work), want.to(work)
        diff = (g - w).abs()
        tol = ulp(w, want.dtype) + SUM_ORDER_EPS * torch.finfo(torch.float32).eps * w.abs().max()
        if self.loose:  # read from bitsandbytes' CPU repacking: within its loss is no verdict either way
            self.repack = self.repack or not bool((diff <= tol).all())
            tol = tol + REPACK_LOSS * w.abs().max()
        bad = ~(diff <= tol)  # NaN on either side counts as a difference
        self.bad += int(bad.sum())
        if bool(bad.any()):
            self.worst = max(
                self.worst, float(torch.where(bad, diff / tol, torch.zeros_like(diff)).nan_to_num(float("inf")).max())
            )

    def finish(self) -> None:
        outcome = ""
        if self.pos != self.info.nbytes:
            outcome = f"{self.pos} bytes recomputed, {self.info.nbytes} stored"
        elif self.short:
            outcome = "the stored tensor is shorter than its header says"
        elif self.equal:
            outcome = None
        elif self.bad:
            what = "values beyond rounding" if self.rounding else "bytes"
            worst = f" (worst {self.worst:.3g}x the allowed rounding)" if self.worst else ""
            outcome = f"{self.bad} {what} differ from base + adapter{worst}"
        self.sink.ended(self.name, self.info, outcome, self.repack)
