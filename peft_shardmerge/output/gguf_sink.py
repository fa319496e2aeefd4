"""A merge written as one GGUF file: the header laid out before the first tensor, each merged row block turned into
its GGUF rows (q/k rows permuted within their head, quantized) and written at its place, staged and renamed."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import numpy as np

from ..engine.sink import Finish, Layout
from ..errors import InputError
from .files import held_signals
from .gguf_arch import GGUFTensor, architecture, convert_tensors, load_hparams, refuse_reranker
from .gguf_meta import add_model_metadata
from .gguf_types import OutType
from .lock import output_lock
from .out_dir import check_space
from .record import file_sha256, sealed_record
from .writer import write_json

#: the merged bytes (32-bit) of each part of a GGUF merge: what a merge killed midway keeps, each part fsynced and
#: recorded as it is finished
PART_BYTES = 2 * 10**9
#: numpy's reading of the safetensors dtypes a merge streams
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def staging_path(path: str) -> str:
    """Where the GGUF file ``path`` is written before it is renamed into place (beside it, hidden)."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{tail}.peft-shardmerge-partial")


def record_path(path: str) -> str:
    """The merge record of the GGUF file ``path``, beside it: ``model.gguf`` -> ``model.merge_manifest.json``.

    Args:
        path: the GGUF file.

    Returns:
        The record's path.

    Example:
        >>> record_path("out/model-Q4_K_M.gguf")
        'out/model-Q4_K_M.merge_manifest.json'
    """
    return os.path.splitext(os.fspath(path))[0] + ".merge_manifest.json"


class GGUFSink:
    """A merge into GGUF files (:class:`~peft_shardmerge.engine.sink.Sink`), each byte for byte what llama.cpp's
    converter (and quantizer) writes from the 32-bit merge (:mod:`~peft_shardmerge.output.gguf_arch`); several
    types are written from one pass over the merge.

    Each file's header (metadata, tokenizer, every tensor's type and offset) is laid out when the sink is opened,
    from the model's config and the files the merge carries beside its weights (the tokenizer): a model the
    converter cannot take is refused then, before any file is created. Tensors are written at their offsets as their
    row blocks arrive, into staging files beside the outputs, renamed into place once complete and checked.

    Args:
        targets: ``(path, OutType)`` of each GGUF file (:class:`~peft_shardmerge.output.gguf_types.OutType`).
        config: the merged model's ``config.json``.
        side_files: writes the merge's other files (the tokenizer) into a folder.
        before_commit: the caller's hook that writes into that folder too (a tokenizer passed in).
        overwrite: whether existing files may be replaced.
        name: the model's name (``general.name``, as the converter takes it from its folder's name); None: each
            file's name without ``.gguf``.
        split_max_size: the most bytes of tensors in one file (0: one file per target), as the converter's
            ``--split-max-size``.
        quiet: holds back the libraries' messages while the headers are laid out (transformers reads the tokenizer).
    """

    label = "writing GGUF"

    def __init__(
        self,
        targets: list[tuple[str, OutType]],
        config: dict,
        side_files: Callable[[str], None] | None = None,
        before_commit: Callable[[str], None] | None = None,
        overwrite: bool = False,
        name: str | None = None,
        split_max_size: int = 0,
        quiet: Callable[[], ContextManager] = nullcontext,
    ):
        self.targets = [(os.path.abspath(path), outtype) for path, outtype in targets]
        self.split_max_size, self.quiet = split_max_size, quiet
        self.location = self.targets[0][0] if len(self.targets) == 1 else os.path.dirname(self.targets[0][0])
        self.config, self.side_files, self.before_commit = config, side_files, before_commit
        self.overwrite, self.name = overwrite, name

    def files(self, layout: Layout) -> list[tuple[str, str, GGUFHeader]]:
        """``(file, target, header)`` of every file to write, laid out for ``layout`` from the model's config and
        its other files in a scratch folder named as the model (the converter names a model after its folder); a
        split target's files are named as llama.cpp names them (``NAME-00001-of-00003.gguf``)."""
        import gguf

        entries = [(name, tuple(shape), dtype) for _, part in layout.parts for name, dtype, shape, _ in part]
        files = []
        for path, outtype in self.targets:
            with tempfile.TemporaryDirectory(prefix="peft-shardmerge-gguf-") as scratch, self.quiet():
                folder = os.path.join(scratch, self.name or os.path.splitext(os.path.basename(path))[0])
                os.mkdir(folder)
                headers = gguf_header(
                    folder, self.config, entries, outtype, self.side_files, self.before_commit, self.split_max_size
                )
            stem = os.path.splitext(path)[0]
            for i, header in enumerate(headers):
                name = path if len(headers) == 1 else gguf.SHARD_NAME_FORMAT.format(stem, i + 1, len(headers))
                files.append((name, path, header))
        return files

    def describe(self, layout: Layout) -> str:
        """What the files will hold, for a dry run: each GGUF tensor's name, type, shape and bytes.

        Args:
            layout: the plan's layout.

        Returns:
            Lines of text.
        """
        lines = []
        types = dict(self.targets)
        for path, target, header in self.files(layout):
            lines.append(f"GGUF {path} ({types[target].name}): {len(header.tensors)} tensors, {header.size} bytes")
            for t in header.tensors:
                lines.append(f"  {t.name:<32} {t.qtype.name:<5} {'x'.join(map(str, t.shape)):<16} {t.nbytes}")
        return "\n".join(lines)

    @contextmanager
    def open(self, layout: Layout) -> Iterator[GGUFOutputs]:
        """Lay out the files, take the outputs' locks, stage the files, write the tensors in the block; rename them
        into place (each target's files, then its record) on a clean exit, remove them otherwise. Only a process
        killed outright leaves its staging files, whose finished parts the next run of the same merge keeps."""
        files = self.files(layout)
        problems = []
        for path, _, _ in files:
            if os.path.islink(path) or os.path.isdir(path):
                problems.append(f"{path} is a link or a folder; a GGUF output is written there only as a new file")
            elif os.path.lexists(path) and not self.overwrite:
                problems.append(f"{path} exists; pass overwrite=True to replace it")
        for folder in dict.fromkeys(os.path.dirname(p) for p, _, _ in files):
            here = [p for p, _, _ in files if os.path.dirname(p) == folder]
            written = sum(h.size for p, _, h in files if os.path.dirname(p) == folder)
            problems += check_space(here[0], written - _staged(files, folder))
        if problems:
            raise InputError(problems)
        types = dict(self.targets)
        with ExitStack() as held:
            for target, _ in self.targets:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                held.enter_context(output_lock(target))
            outs: list[GGUFOutput] = []
            try:
                inputs = _Inputs(layout)
                for path, target, header in files:
                    outs.append(GGUFOutput(path, header, layout, types[target].name, target, inputs))
                yield GGUFOutputs(outs, layout, inputs=inputs, split_max_size=self.split_max_size)
                with held_signals():  # every file, then each target's record (which names its files)
                    for out in outs:
                        out.close()
                        os.replace(out.staging, out.path)
                    for target, _ in self.targets:
                        os.replace(staging_path(record_path(target)), record_path(target))
                        _fsync_dir(os.path.dirname(target))
            finally:
                for out in outs:
                    out.close()
                    for leftover in (staging_path(record_path(out.target)), out.staging, out.kept):
                        if os.path.isfile(leftover) and not os.path.islink(leftover):
                            os.unlink(leftover)


def _staged(files, folder: str) -> int:
    """The bytes staging files of ours beside the outputs in ``folder`` hold already (a resumed merge's)."""
    paths = [staging_path(p) for p, _, _ in files if os.path.dirname(p) == folder]
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p) and not os.path.islink(p))


class _Inputs:
    """What a resumed part is checked against: digests of the merge's inputs, by content
    (:class:`~peft_shardmerge.output.resume.InputDigests`), each read once for every file of the merge."""

    def __init__(self, layout: Layout):
        self.layout, self.parts = layout, {}
        self.resumable = layout.fingerprint is not None and layout.inputs is not None
        self.common = layout.inputs.common() if self.resumable else None

    def part(self, i: int) -> str:
        """The digest of the input data part ``i`` is computed from."""
        if i not in self.parts:
            self.parts[i] = self.layout.inputs.shard(self.layout.parts[i][0])
        return self.parts[i]


class GGUFOutputs:
    """An opened :class:`GGUFSink` (:class:`~peft_shardmerge.engine.sink.Opened`): every merged row block is
    handed to each of its files."""

    def __init__(
        self,
        outs: list[GGUFOutput],
        layout: Layout,
        records: bool = True,
        inputs: _Inputs | None = None,
        split_max_size: int = 0,
    ):
        self.outs, self.layout, self.records, self.inputs = outs, layout, records, inputs
        self.split_max_size = split_max_size
        #: the parts an interrupted run of the same merge finished in every file
        self.done = set.intersection(*(out.done for out in outs))

    def write(self, parts: list[int], produce: Callable[[int, object], None]) -> None:
        """Write the merged tensors of ``parts`` at their places in every file; each part, once written, is made
        durable and recorded as done."""
        for i in parts:
            writers = [_PartWriter(out, self.layout.parts[i][1]) for out in self.outs]
            produce(i, _Tee(writers))
            for w in writers:
                w.close()
            if self.inputs is not None and self.inputs.resumable:
                digest = self.inputs.part(i)
                for out in self.outs:
                    out.part_done(i, digest)

    def finish(self, finish: Finish) -> None:
        """Check that every change was applied once and every GGUF tensor written, then make the files durable
        and stage their records."""
        for check in finish.checks:
            check()
        for out in self.outs:
            out.finish(finish)
        for target in dict.fromkeys(out.target for out in self.outs if self.records):
            files = [out for out in self.outs if out.target == target]
            gguf_info = {
                "outtype": files[0].outtype,
                "files": len(files),
                "name": os.path.basename(files[0].header.folder),  # general.name is read from it
                "split_max_size": self.split_max_size,
            }
            merge = {**finish.merge_info(), "gguf": gguf_info}
            write_gguf_record(
                {os.path.basename(out.path): out.staging for out in files}, merge, staging_path(record_path(target))
            )


class _Tee:
    """One part's writer handing what it is given to each file's writer (the executor's two ways: in order, and
    each tensor at its place)."""

    def __init__(self, writers: list):
        self.writers = writers

    def write(self, tensor) -> None:
        for w in self.writers:
            w.write(tensor)

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        for raw in _read(fd, offset, nbytes):
            for w in self.writers:
                w.feed(raw)

    def at(self, index: int) -> _Tee:
        return _Tee([w.at(index) for w in self.writers])

    def feed(self, raw: memoryview) -> None:
        for w in self.writers:
            w.feed(raw)

    def finish(self) -> None:
        for w in self.writers:
            w.finish()

    @property
    def nbytes(self) -> int:
        return self.writers[0].nbytes


def _read(fd: int, offset: int, nbytes: int) -> Iterator[memoryview]:
    """Stored bytes, in pieces of 64 MiB."""
    while nbytes:
        n = min(nbytes, 64 << 20)
        yield memoryview(os.pread(fd, n, offset))
        offset, nbytes = offset + n, nbytes - n


class GGUFHeader:
    """A GGUF file laid out: its header bytes, its tensors and where each one's data starts, and the folder the model
    was read from (its name is the model's ``general.name``)."""

    def __init__(self, raw: bytes, tensors: list[GGUFTensor], offsets: list[int], size: int, folder: str = ""):
        self.raw, self.tensors, self.offsets, self.size, self.folder = raw, tensors, offsets, size, folder
        self.by_source = {}  # merged tensor -> (its GGUF tensor, where its bytes start)
        for t, off in zip(tensors, offsets):
            for i, name in enumerate(t.sources):
                self.by_source[name] = (t, off + i * t.nbytes // len(t.sources))


def gguf_header(
    folder: str,
    config: dict,
    entries: list[tuple[str, tuple[int, ...], str]],
    outtype: OutType,
    side_files: Callable[[str], None] | None = None,
    before_commit: Callable[[str], None] | None = None,
    split_max_size: int = 0,
) -> list[GGUFHeader]:
    """Lay out the GGUF file of a merge: its metadata, tokenizer and tensor infos, as the converter writes them;
    split into files of at most ``split_max_size`` bytes of tensors as the converter splits them.

    Args:
        folder: an empty scratch folder, where the model's config and other files are written to be read.
        config: the merged model's ``config.json``.
        entries: ``(name, shape, safetensors dtype)`` of every merged tensor.
        outtype: the :class:`~peft_shardmerge.output.gguf_types.OutType`.
        side_files: writes the tokenizer and other files into ``folder``.
        before_commit: the caller's hook writing into ``folder`` too.
        split_max_size: the most bytes of tensors in one file (0: one file), as the converter's ``--split-max-size``.

    Returns:
        The :class:`GGUFHeader` of each file (one, unless split).

    Raises:
        UnsupportedError: an architecture, tokenizer or tensor the converter's rules do not cover.
        InputError: no tokenizer beside the model.
    """
    import gguf

    from .gguf_vocab import add_tokenizer

    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    for write in (side_files, before_commit):
        if write is not None:
            write(folder)
    hparams = load_hparams(folder)
    hf_arch, rules, arch = architecture(hparams)
    if hf_arch == "Qwen3ForCausalLM":
        refuse_reranker(config, folder)
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch], split_max_size=split_max_size)
    rows = 0
    if rules.vocab_rows:
        from .gguf_vocab import vocab_rows

        rows = vocab_rows(folder, hparams)
    shapes = [(n, s) for n, s, _ in entries]
    converted = convert_tensors(hparams, shapes, outtype.converter, writer=writer, vocab_rows=rows)
    tensors = outtype.retype(converted, hparams, gguf.MODEL_ARCH_NAMES[arch])
    if outtype.quantizer:  # llama-quantize writes its file's tensors in its loader's order
        tensors.sort(key=_llama_quantize_order)
    for t in tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    add_model_metadata(writer, hparams, outtype.file_type, folder)
    add_tokenizer(writer, folder, hparams)
    if outtype.quantizer:  # and sets these two keys anew, which puts them last (gguf_set_val_u32)
        for key in (gguf.Keys.General.QUANTIZATION_VERSION, gguf.Keys.General.FILE_TYPE):
            writer.kv_data[0][key] = writer.kv_data[0].pop(key)
    scratch = Path(os.path.dirname(folder), "header.gguf")
    writer.write_header_to_file(path=scratch)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    headers = []
    for name, infos in zip(writer.format_shard_names(scratch), writer.tensors):
        raw = name.read_bytes()
        mine = [t for t in tensors if t.name in infos]
        at, offsets = writer.ggml_pad(len(raw), writer.data_alignment), []
        for t in mine:
            offsets.append(at)
            at += writer.ggml_pad(t.nbytes, writer.data_alignment)
        headers.append(GGUFHeader(raw, mine, offsets, at, folder))
    return headers


class GGUFOutput:
    """One GGUF file being written: the staging file, its header written, every tensor written at its offset as it
    arrives.

    Args:
        path: the GGUF file (written beside it, at :func:`staging_path`).
        header: its :class:`GGUFHeader`.
        layout: the merge's parts.
        outtype: its type's name, for the record.
        target: the output it is a file of (itself, or the name of the files a split output is made of).
    """

    def __init__(
        self,
        path: str,
        header: GGUFHeader,
        layout: Layout,
        outtype: str,
        target: str | None = None,
        inputs: _Inputs | None = None,
    ):
        self.path, self.staging, self.outtype, self.target = path, staging_path(path), outtype, target or path
        self.inputs = inputs
        self.header, self.layout = header, layout
        self.kept, self.digest = self.staging + ".json", hashlib.sha256(header.raw).hexdigest()
        self.lock = threading.Lock()
        self.done = self._open()
        self.digests = {i: self.inputs.part(i) for i in self.done}
        kept = {name for i in self.done for name, *_ in layout.parts[i][1]}
        self.missing = set(header.by_source) - kept

    def _open(self) -> set[int]:
        """Open the staging file, the parts an interrupted run finished kept, else laid out anew; those parts."""
        done = self._kept()
        if os.path.islink(self.staging):
            raise InputError(f"{self.staging} is a link; remove it (the staging file's name is taken)")
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (0 if done else os.O_TRUNC)
        self.fd = os.open(self.staging, flags, 0o644)
        if not done:
            os.ftruncate(self.fd, self.header.size)
            os.pwrite(self.fd, self.header.raw, 0)
            for t, off in zip(self.header.tensors, self.header.offsets):
                if t.values is not None:
                    self.put(_encode(t.values.reshape(t.shape), t.qtype), off, t.name)
        return done

    def put(self, data: bytes, offset: int, name: str) -> None:
        """Write a GGUF tensor's bytes (some of its rows) at ``offset``."""
        os.pwrite(self.fd, data, offset)

    def _kept(self) -> set[int]:
        """The parts a killed run of this very merge (same inputs, by content, options and file layout) finished
        here."""
        inputs = self.inputs
        if inputs is None or not inputs.resumable or not os.path.isfile(self.kept) or os.path.islink(self.staging):
            return set()
        try:
            with open(self.kept, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return set()
        same = record.get("fingerprint") == self.layout.fingerprint and record.get("header") == self.digest
        same = same and record.get("inputs") == inputs.common
        if not same or not os.path.isfile(self.staging) or os.path.getsize(self.staging) != self.header.size:
            return set()
        parts = record.get("parts") or {}
        done = {int(i) for i in parts if str(i).isdecimal() and int(i) < len(self.layout.parts)}
        return {i for i in done if parts[str(i)] == inputs.part(i)}  # each part's inputs read again

    def part_done(self, i: int, digest: str) -> None:
        """Make part ``i`` durable, then record it as done with the digest of its inputs."""
        os.fsync(self.fd)
        self.done.add(i)
        self.digests[i] = digest
        record = {
            "fingerprint": self.layout.fingerprint,
            "header": self.digest,
            "inputs": self.inputs.common,
            "parts": {str(k): v for k, v in sorted(self.digests.items())},
        }
        with open(self.kept + ".tmp", "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.kept + ".tmp", self.kept)

    def tensor(self, entry) -> _TensorWriter:
        """The writer of one merged tensor (a tensor the converter skips is read and dropped)."""
        name, dtype, shape, nbytes = entry
        placed = self.header.by_source.get(name)
        return _TensorWriter(self, name, dtype, tuple(shape), nbytes, *(placed or (None, 0)))

    def written(self, name: str) -> None:
        """Note one merged tensor as wholly written."""
        with self.lock:
            self.missing.discard(name)

    def finish(self, finish: Finish) -> None:
        """Check that every GGUF tensor was written, then make the file durable."""
        if self.missing:
            raise InputError(f"GGUF tensors never written: {sorted(self.missing)[:5]}")
        os.fsync(self.fd)

    def close(self) -> None:
        """Close the staging file (once)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _PartWriter:
    """The executor's writer of one part: in order (``write``/``copy_from``, tensor after tensor), or each tensor
    at its place (``at``)."""

    def __init__(self, out: GGUFOutput, entries):
        self.out, self.entries, self.i, self.current = out, entries, 0, None

    def at(self, index: int) -> _TensorWriter:
        return self.out.tensor(self.entries[index])

    def _next(self) -> _TensorWriter:
        """The tensor the next bytes belong to (zero-size tensors passed over)."""
        while self.current is None or self.current.full:
            if self.current is not None:
                self.current.finish()
            self.current = self.out.tensor(self.entries[self.i])
            self.i += 1
        return self.current

    def write(self, tensor) -> None:
        self.feed(_raw(tensor))

    def feed(self, raw: memoryview) -> None:
        while len(raw):
            w = self._next()
            n = min(len(raw), w.nbytes - w.received)
            w.feed(raw[:n])
            raw = raw[n:]

    def close(self) -> None:
        """Finish the last tensor and any zero-size ones after it."""
        if self.current is not None:
            self.current.finish()
        for entry in self.entries[self.i :]:
            self.out.tensor(entry).finish()


class _TensorWriter:
    """One merged tensor's bytes turned into its GGUF rows: whole units (a row, or a head's rows where q/k rows are
    permuted) are transformed, encoded in the tensor's type and written at their offset; the rest waits."""

    def __init__(self, out, name, dtype, shape, nbytes, target: GGUFTensor | None, offset: int):
        self.out, self.name, self.dtype, self.target, self.offset = out, name, dtype, target, offset
        self.nbytes, self.received, self.pending = nbytes, 0, bytearray()
        self.cols = shape[-1] if len(shape) >= 2 else 1
        rows = int(np.prod(shape)) // self.cols if self.cols else 0
        heads = target.heads if target is not None else 0
        self.unit = rows // heads if heads else 1  # rows moved together
        self.item = np.dtype(_DTYPES[dtype]).itemsize
        self.done_rows = 0
        self.keep = target.rows if target is not None and target.rows is not None else rows

    @property
    def full(self) -> bool:
        return self.received >= self.nbytes

    def write(self, tensor) -> None:
        self.feed(_raw(tensor))

    def feed(self, raw: memoryview) -> None:
        self.received += len(raw)
        unit_bytes = self.unit * self.cols * self.item
        if self.target is None or not unit_bytes:
            return
        if self.pending:  # the rest of a unit an earlier block began
            take = min(len(raw), -len(self.pending) % unit_bytes)
            self.pending += raw[:take]
            raw = raw[take:]
            if len(self.pending) % unit_bytes == 0:
                self._emit(bytes(self.pending))
                self.pending.clear()
        whole = len(raw) // unit_bytes * unit_bytes
        if whole:  # whole units straight from the block, not copied
            self._emit(raw[:whole])
        self.pending += raw[whole:]

    def _emit(self, raw) -> None:
        """Write whole units of rows at their place in the file."""
        values = np.frombuffer(raw, dtype=_DTYPES[self.dtype])
        if self.dtype == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        rows = values.astype(np.float32, copy=False).reshape(-1, self.cols)
        first, t = self.done_rows, self.target
        self.done_rows += len(rows)
        rows = rows[: max(0, self.keep - first)]  # past the rows kept: read and dropped
        if not len(rows):
            return
        if t.heads:
            half = self.unit // 2
            rows = rows.reshape(-1, 2, half, self.cols).swapaxes(1, 2).reshape(-1, self.cols)
        if t.shift:
            rows = rows + np.float32(t.shift)
        data = _encode(rows if len(t.shape) >= 2 else rows.reshape(-1), t.qtype)
        self.out.put(data, self.offset + first * (len(data) // len(rows)), t.name)

    def finish(self) -> None:
        if self.pending:
            raise InputError(f"{self.name}: {len(self.pending)} bytes left over a whole row")
        if self.target is not None and self.full:
            self.out.written(self.name)


def _raw(tensor) -> memoryview:
    """A tensor's bytes."""
    import torch

    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _encode(values: np.ndarray, qtype) -> bytes:
    """Values in a GGUF type, as gguf-py (bit-exact to llama.cpp) or the K-quants' port encodes them."""
    from .gguf_types import encode

    return encode(values, qtype)


def _llama_quantize_order(t: GGUFTensor) -> tuple[int, str]:
    """llama.cpp's loader's ``weight_name_comparer``: by layer (``blk.N.``; the others first), then by name."""
    layer = t.name.split(".")[1] if t.name.startswith("blk.") else ""
    return (int(layer) if layer.isdecimal() else -1, t.name)


def write_gguf_record(files: dict[str, str], merge: dict, to: str) -> None:
    """Write the merge record of finished GGUF files (``{name: where it is now}``): each one's size and SHA-256,
    what the merge used, the tool's version, and the record's own digest (as a folder's ``merge_manifest.json``)."""
    files = {name: {"size": os.path.getsize(path), "sha256": file_sha256(path)} for name, path in files.items()}
    record = sealed_record(merge, files)
    write_json(to, record)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["GGUFSink", "gguf_header", "staging_path"]
