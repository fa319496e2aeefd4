"""A merge written in a served quantized format: each merged weight encoded as it leaves the merge, on its way into
the sink that stores the files (a folder, the Hub, verify's comparison)."""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..engine.sink import Entry, Finish, Layout
from ..errors import InputError, MergeCheckError
from ..io.safetensors_io import DTYPES, TORCH_TO_ST
from ..quant.encode import Encoder, encoder_record, stored_name
from ..quant.encoder import row_chunks


@dataclass
class Encoding:
    """Which merged weights are encoded, and how the output's config says it.

    Attributes:
        encoder: the format (:class:`~peft_shardmerge.quant.encode.Encoder`).
        names: the merged weights it encodes.
        kept: modules whose weights the format's tool would take and that stay as merged (their sides are not whole
            blocks), named in the config so that the loader does not look for their scales.
        dtype: the model's dtype (its other tensors', the 4-bit compute dtype).
        config: the ``quantization_config`` to write as it is (a base's own, written back); None: the encoder's.
        transposed: encoded weights stored ``[in, out]`` (``Conv1D``), encoded as ``[out, in]`` as bitsandbytes
            holds them.
        unconverted: the model's output layers and fused experts, which the config names as unquantized
            (:attr:`~peft_shardmerge.engine.plan.Plan.unconverted`).
    """

    encoder: Encoder
    names: set[str] = field(default_factory=set)
    kept: list[str] = field(default_factory=list)
    dtype: torch.dtype = torch.bfloat16
    config: dict | None = None
    transposed: set[str] = field(default_factory=set)
    unconverted: tuple[set[str], set[str]] = (set(), set())

    def encode(self, name: str, data: torch.Tensor) -> list[torch.Tensor]:
        """The stored tensors of the merged weight ``name``."""
        return self.encoder.encode(data.T.contiguous() if name in self.transposed else data, self.dtype)

    def quantization_config(self) -> dict:
        """``config.json``'s ``quantization_config``."""
        if self.config is not None:
            return dict(self.config)
        return self.encoder.config(self.kept, self.dtype, self.unconverted)

    def size(self, plan) -> int:
        """The bytes of the encoded files' tensors."""
        return sum(e[3] for t in plan.tensors for e in self.entries((t.name, t.out_dtype, t.shape, t.nbytes)))

    def summary(self, plan) -> str:
        """What a dry run says of the encoding: the weights encoded and the bytes written."""
        size = self.size(plan)
        return f"{self.describe()}\nwritten: {size} bytes ({size / 1e9:.3f} GB)"

    def record(self) -> dict:
        """The merge record's ``quantize``: the encoder, whether the base's own format was written back, how many
        weights were encoded and which modules were kept as merged."""
        return {
            **encoder_record(self.encoder),
            "base": self.config is not None,
            "weights": len(self.names),
            "kept": list(self.kept),
        }

    def describe(self) -> str:
        """The report's note."""
        kept = f"; {len(self.kept)} kept as merged (sides not whole blocks)" if self.kept else ""
        return f"quantized: {len(self.names)} weights as {self.encoder.name} ({self.encoder.tool}){kept}"

    def entries(self, entry: Entry) -> list[Entry]:
        """The stored tensors one merged tensor becomes (itself, unless encoded)."""
        name, _, shape, _ = entry
        if name not in self.names:
            return [entry]
        shape = tuple(shape)[::-1] if name in self.transposed else shape
        return [
            (stored_name(name, s), d, tuple(sh), math.prod(sh) * DTYPES[d][1])
            for s, d, sh in self.encoder.parts(tuple(shape), TORCH_TO_ST[self.dtype])
        ]

    def layout(self, layout: Layout) -> Layout:
        """The layout the files are written in, with a fingerprint of its own (an interrupted 16-bit run's shards,
        or another format's, are never kept for this one)."""
        parts = [(part, [e for entry in entries for e in self.entries(entry)]) for part, entries in layout.parts]
        fingerprint = None
        if layout.fingerprint is not None:
            ident = f"{layout.fingerprint}\n{self.encoder!r}\n{sorted(self.names)}\n{self.dtype}"
            fingerprint = hashlib.sha256(ident.encode()).hexdigest()
        io_bytes = layout.io_bytes
        return Layout(parts, io_bytes, fingerprint, layout.inputs)

    def index(self, layout: Layout, index: dict | None) -> dict | None:
        """The index of the encoded files (its ``total_size`` theirs, its ``weight_map`` every stored tensor)."""
        if index is None:
            return None
        weight_map = {e[0]: part for part, entries in layout.parts for e in entries}
        total = sum(e[3] for _, entries in layout.parts for e in entries)
        return {**index, "metadata": {**index.get("metadata", {}), "total_size": total}, "weight_map": weight_map}


def base_quantization(plan) -> dict | None:
    """The ``quantization_config`` the plan's base was stored (or loaded) with, None for a 16-bit base.

    Example:
        >>> from types import SimpleNamespace
        >>> base_quantization(SimpleNamespace(inputs=SimpleNamespace(base=SimpleNamespace(config={}))))
    """
    base = getattr(plan.inputs, "base", None)
    if base is not None:
        return base.config.get("quantization_config") or None
    model = getattr(getattr(plan.inputs, "live", None), "model", None)
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if not qc:
        return None
    # as config.json holds it: a str enum (quant_method) its value, a dtype its name
    return json.loads(json.dumps(qc.to_dict() if hasattr(qc, "to_dict") else dict(qc), default=str))


def encode_plan(plan, encoder: Encoder, base_config: dict | None = None) -> Encoding:
    """The encoding of a plan, its encoded tensors set to be merged in float32 (quantized once, from that merge).

    Args:
        plan: the :class:`~peft_shardmerge.engine.plan.Plan`.
        encoder: the format.
        base_config: the base's ``quantization_config`` where its own format is written back (its quantized weights
            are the ones encoded, and the config is written as it is); None: a format named, for the weights its
            tool quantizes (:attr:`~peft_shardmerge.engine.plan.Plan.quantizable`).

    Returns:
        The :class:`Encoding`.

    Raises:
        InputError: the format cannot take a weight's shape.
        MissingDependencyError: what the format needs (bitsandbytes) is not installed.
    """
    encoder.requires()
    if plan.fused and not encoder.loads_fused:
        raise InputError(
            f"quantize={encoder.name!r}: this model's checkpoint stores its experts one by one and transformers fuses "
            f"them when it loads it, which it does not do for a {encoder.name} checkpoint (from_pretrained fails); "
            "choose ct-fp8-block, fp8-block, nf4, fp4 or int8 for it"
        )
    candidates = set(plan.quantizable)
    if base_config is not None:
        candidates = {t.name for t in plan.tensors if t.source.decoder is not None} or candidates
    if not encoder.takes_conv1d:
        candidates -= plan.transposed
    encoding = plan_encoding(encoder, plan.tensors, candidates, plan.dtype)
    encoding.transposed = encoding.names & plan.transposed
    encoding.unconverted = plan.unconverted
    encoding.config = dict(base_config) if base_config is not None else None
    for t in plan.tensors:
        if t.name in encoding.names:
            t.out_dtype = "F32"
    return encoding


def plan_encoding(encoder: Encoder, tensors, candidates: set[str], dtype: torch.dtype) -> Encoding:
    """The encoding of a plan's tensors: each candidate the format takes is encoded, one it keeps stays as merged.

    Args:
        encoder: the format.
        tensors: the plan's tensors (``name``, ``shape``).
        candidates: the names the format's tool quantizes (its module kinds, minus what it never quantizes).
        dtype: the merged dtype.

    Returns:
        The :class:`Encoding`.

    Raises:
        InputError: a candidate's shape the format cannot take, each named.

    Example:
        >>> from types import SimpleNamespace
        >>> from peft_shardmerge.quant.encode import Fp8Block
        >>> ts = [SimpleNamespace(name=n, shape=s) for n, s in (("a.weight", (256, 128)), ("b.weight", (64, 64)))]
        >>> e = plan_encoding(Fp8Block(), ts, {"a.weight", "b.weight"}, torch.bfloat16)
        >>> sorted(e.names), e.kept
        (['a.weight'], ['b'])
    """
    encoding = Encoding(encoder, dtype=dtype)
    problems = []
    for t in tensors:
        if t.name not in candidates:
            continue
        shape = tuple(t.shape)
        why = encoder.refuses(t.name, shape)
        if why is not None:
            problems.append(why)
        elif encoder.keeps(shape):
            encoding.kept.append(t.name.rsplit(".", 1)[0])
        else:
            encoding.names.add(t.name)
    if not problems and not encoding.names:
        problems.append(
            f"quantize={encoder.name!r}: none of this model's weights is one {encoder.name}'s tool quantizes "
            f"(its nn.Linear weights but the output layer{', whole 128x128 blocks' if encoding.kept else ''}); "
            "write it in 16-bit, or choose another format (nf4 and int8 take GPT-2's Conv1D weights too)"
        )
    if problems:
        raise InputError(problems)
    return encoding


class QuantSink:
    """A :class:`~peft_shardmerge.engine.sink.Sink` that encodes the merged weights of an :class:`Encoding` and hands
    the stored tensors to ``inner``, which writes them: the same folder, Hub push or comparison as a 16-bit merge,
    laid out for the encoded tensors. Each encoded weight is held whole once merged (its format's scales span it),
    then encoded and written; every other tensor goes through as it comes.

    Args:
        inner: the sink that stores the files.
        encoding: what is encoded.

    Example:
        >>> import os, tempfile
        >>> from safetensors.torch import load_file
        >>> from peft_shardmerge.output.shard_sink import FolderSink
        >>> from peft_shardmerge.quant.encode import Int8
        >>> out = os.path.join(tempfile.mkdtemp(), "merged")
        >>> sink = QuantSink(FolderSink(out, overwrite=False), Encoding(Int8(), {"w.weight"}))
        >>> layout = Layout([("model.safetensors", [("w.weight", "BF16", (2, 2), 8)])])
        >>> with sink.open(layout) as o:
        ...     o.write([0], lambda i, w: w.write(torch.tensor([[1.0, -1.0], [0.5, 0.0]], dtype=torch.bfloat16)))
        ...     o.finish(Finish(config={}))
        >>> sorted(load_file(os.path.join(out, "model.safetensors")))
        ['w.SCB', 'w.weight', 'w.weight_format']
    """

    def __init__(self, inner, encoding: Encoding):
        self.inner, self.encoding = inner, encoding
        self.location, self.label = inner.location, inner.label

    @contextmanager
    def open(self, layout: Layout) -> Iterator["QuantOutput"]:
        """The inner sink opened for the encoded layout."""
        encoded = self.encoding.layout(layout)
        with self.inner.open(encoded) as out:
            yield QuantOutput(out, layout, encoded, self.encoding)

    @contextmanager
    def join(self, layout: Layout, handle: dict, rank: int) -> Iterator["QuantOutput"]:
        """Another rank's view of the output the leader opened (the inner sink's join)."""
        encoded = self.encoding.layout(layout)
        with self.inner.join(encoded, handle, rank) as out:
            yield QuantOutput(out, layout, encoded, self.encoding)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # what a destination adds (a push's commit URL, a check's outcome)


class QuantOutput:
    """An opened :class:`QuantSink`: the inner output (opened for ``encoded``, the layout of the stored tensors), and
    what each merged tensor of a part (``layout``) becomes in it."""

    def __init__(self, out, layout: Layout, encoded: Layout, encoding: Encoding):
        self.out, self.layout, self.encoded, self.encoding = out, layout, encoded, encoding
        self.done = out.done

    def write(self, parts: list[int], produce: Callable[[int, object], None]) -> None:
        """Each part's merged tensors, encoded on their way into the inner output's writer."""

        def encoded(i: int, w) -> None:
            produce(i, _Encoder(w, self.layout.parts[i][1], self.encoding))

        self.out.write(parts, encoded)

    def finish(self, finish: Finish) -> None:
        """The inner output's files, with the encoded index and the config's ``quantization_config``."""
        config = {**finish.config, "quantization_config": self.encoding.quantization_config()}
        index = self.encoding.index(self.encoded, finish.index)

        def merge_info() -> dict:
            return {**finish.merge_info(), "quantize": self.encoding.record()}

        self.out.finish(Finish(config, index, finish.side_files, finish.before_commit, merge_info, finish.checks))

    def __getattr__(self, name: str):
        return getattr(self.out, name)  # a shared output's handle, written, adopt and progress


class _Encoder:
    """One part's writer: merged tensors in (in order, or each at its place), stored tensors out."""

    def __init__(self, w, entries: list[Entry], encoding: Encoding):
        self.w, self.entries, self.encoding = w, entries, encoding
        self.first = []  # where each merged tensor's stored tensors start among the part's
        n = 0
        for entry in entries:
            self.first.append(n)
            n += len(encoding.entries(entry))
        self.k, self.held = 0, None  # the merged tensor being written in order, and its encoder when encoded
        self._written = 0  # the bytes of merged tensor k passed through

    def _encoder(self, index: int, out) -> "_Streamed | _Held":
        """What encodes merged tensor ``index`` into ``out``: as its rows arrive, or (a Conv1D weight, encoded
        transposed) once whole."""
        entry = self.entries[index]
        if entry[0] in self.encoding.transposed:
            return _Held(entry, lambda data: out.done(self.encoding.encode(entry[0], data)))
        return _Streamed(entry, self.encoding, out)

    def at(self, index: int):
        """Merged tensor ``index``'s writer: the inner writer's own where it is not encoded."""
        if self.entries[index][0] not in self.encoding.names:
            return self.w.at(self.first[index])
        return self._encoder(index, _PlacedOut(self.w, self.first[index]))

    def write(self, tensor: torch.Tensor) -> None:
        """The next rows in order."""
        self._next()
        if self.held is None:
            self._written += tensor.numel() * tensor.element_size()
            self.w.write(tensor)
            return
        self.held.write(tensor)
        self._settle()

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        """Stored bytes in order, cut at the merged tensors' ends."""
        while nbytes:
            self._next()
            n = min(nbytes, self.entries[self.k][3] - self._written)
            if self.held is None:
                self._written += n
                self.w.copy_from(fd, offset, n)
            else:
                self.held.copy_from(fd, offset, n)
                self._settle()
            offset, nbytes = offset + n, nbytes - n

    def _next(self) -> None:
        """Move on past finished (and empty) merged tensors; start encoding the next one if it is encoded."""
        if self.held is not None:
            return
        while self.k < len(self.entries) and self._written >= self.entries[self.k][3]:
            self.k, self._written = self.k + 1, 0
        if self.k < len(self.entries) and self.entries[self.k][0] in self.encoding.names:
            self.held = self._encoder(self.k, _InOrderOut(self.w))

    def _settle(self) -> None:
        """The merged tensor written in order is complete: finish its encoding, move on."""
        if self.held.nbytes == self.entries[self.k][3]:
            self.held.finish()
            self.held, self.k, self._written = None, self.k + 1, 0


class _InOrderOut:
    """Where an encoded weight's stored tensors go when a part is written in order: each after the one before."""

    def __init__(self, w):
        self.w = w

    def codes(self, rows: torch.Tensor) -> None:
        self.w.write(rows)

    def done(self, stored: list[torch.Tensor]) -> None:
        """The first stored tensor's rows written already (by :meth:`codes`) where there are none in ``stored``."""
        for t in stored:
            self.w.write(t)


class _PlacedOut:
    """Where an encoded weight's stored tensors go when each is written at its place: the codes as they come, the
    others at the end."""

    def __init__(self, w, first: int):
        self.w, self.first, self._codes = w, first, None

    def codes(self, rows: torch.Tensor) -> None:
        if self._codes is None:
            self._codes = self.w.at(self.first)
        self._codes.write(rows)

    def done(self, stored: list[torch.Tensor]) -> None:
        if self._codes is None:  # a weight encoded whole: its codes come first in ``stored``
            self.codes(stored[0])
            stored = stored[1:]
        self._codes.finish()
        for j, t in enumerate(stored):
            w = self.w.at(self.first + 1 + j)
            w.write(t)
            w.finish()


class _Streamed:
    """One encoded weight's merged rows, encoded a run of whole units at a time as they arrive (in order or at its
    place): its codes written at once, its other stored tensors once its last row is in. What it holds: less than
    one unit of rows (a block's) beside the rows just received, and each run's scales."""

    def __init__(self, entry: Entry, encoding: Encoding, out):
        name, dtype, shape, nbytes = entry
        self.name, self.dtype, self.shape, self.total = name, DTYPES[dtype][0], tuple(shape), nbytes
        self.encoding, self.out = encoding, out
        self.row_bytes = nbytes // shape[0] if shape[0] else 0
        self.unit = encoding.encoder.unit(self.shape)
        self.pending: list[torch.Tensor] = []  # raw bytes received and not encoded yet
        self.held = self.nbytes = 0
        self.sides: list = []

    def write(self, tensor: torch.Tensor) -> None:
        raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._take(raw.clone() if raw.numel() < self.unit * self.row_bytes else raw)

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        import os

        while nbytes:
            piece = os.pread(fd, min(nbytes, 64 << 20), offset)
            if not piece:
                raise OSError(f"{self.name}: source file ended early")
            self._take(torch.frombuffer(bytearray(piece), dtype=torch.uint8))
            offset, nbytes = offset + len(piece), nbytes - len(piece)

    def _take(self, raw: torch.Tensor) -> None:
        self.pending.append(raw)
        self.held += raw.numel()
        self.nbytes += raw.numel()
        runs = self.held // (self.unit * self.row_bytes) if self.row_bytes else 0
        if runs:
            self._encode(runs * self.unit)

    def _encode(self, rows: int) -> None:
        """Encode the first ``rows`` rows pending."""
        data = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        n = rows * self.row_bytes
        block = data[:n].view(self.dtype).reshape(rows, *self.shape[1:])
        for a, b in row_chunks(rows, self.unit, self.row_bytes // block.element_size()):  # the format's temporaries
            codes, side = self.encoding.encoder.first(block[a:b], self.encoding.dtype)
            self.out.codes(codes)
            self.sides.append(side)
        rest = data[n:]
        self.pending, self.held = ([rest.clone()] if rest.numel() else []), rest.numel()

    def finish(self) -> None:
        if self.nbytes != self.total:
            raise MergeCheckError(f"{self.name}: {self.nbytes} bytes merged, {self.total} planned")
        if self.held:  # the weight's last rows, fewer than a unit
            self._encode(self.held // self.row_bytes)
        self.out.done(self.encoding.encoder.rest(self.sides, self.shape, self.encoding.dtype))


class _Held:
    """One encoded weight's merged bytes, gathered whole (in order or at its place), then handed on: a weight
    encoded transposed (GPT-2's Conv1D, as bitsandbytes holds it), whose runs of rows are not the stored ones."""

    def __init__(self, entry: Entry, ready: Callable[[torch.Tensor], None]):
        name, dtype, shape, nbytes = entry
        self.name, self.dtype, self.shape, self.ready = name, DTYPES[dtype][0], tuple(shape), ready
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = 0

    def write(self, tensor: torch.Tensor) -> None:
        raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.buf[self.nbytes : self.nbytes + raw.numel()] = raw
        self.nbytes += raw.numel()

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        import os

        view = memoryview(self.buf.numpy())[self.nbytes : self.nbytes + nbytes]
        while view:
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise OSError(f"{self.name}: source file ended early")
            view, offset, self.nbytes = view[n:], offset + n, self.nbytes + n

    def finish(self) -> None:
        if self.nbytes != self.buf.numel():
            raise MergeCheckError(f"{self.name}: {self.nbytes} bytes merged, {self.buf.numel()} planned")
        data, self.buf = self.buf.view(self.dtype).reshape(self.shape), None
        self.ready(data)
