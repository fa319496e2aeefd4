"""Verify a GGUF output: its bytes against the merge record beside it, its structure as gguf-py reads it, and every
tensor recomputed from base + adapter and compared in the file's own type (the GGUF sink, comparing instead of
writing)."""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from ..engine.sink import Finish, Layout
from ..errors import NotFoundError, ShardMergeError
from ..output.gguf_sink import GGUFOutput, GGUFOutputs, GGUFSink, record_path
from ..output.gguf_types import OutType
from ..output.record import file_sha256, record_digest
from .report import VerifyReport, settle, stage


def verify_gguf(path: str, *, base: str | None = None, adapter: str | list[str] | None = None) -> VerifyReport:
    """Check a GGUF output a merge wrote: one file, or the files of a split one (give any of them, or the name the
    merge was given).

    Without inputs: each file's size and SHA-256 against the merge record beside it (``NAME.merge_manifest.json``),
    and each file read by gguf-py (every tensor's extent inside the file, 32- and 16-bit values finite). With
    ``base`` and ``adapter``: the merge is run again from them with the recorded options (on the CPU), each GGUF
    tensor encoded in the file's own type and compared byte for byte with the file, and the header (metadata,
    tokenizer, tensor layout) with the file's.

    Args:
        path: the GGUF file.
        base: the base checkpoint the merge came from.
        adapter: the adapter merged, or the adapters of a combination in their order.

    Returns:
        The :class:`~peft_shardmerge.verify.report.VerifyReport`: ``OK``, ``FAILED`` (each problem listed) or
        ``UNCHECKED`` (no record and no inputs).

    Raises:
        NotFoundError: neither the file nor the record of an output of that name.
    """
    target = _target(path)
    if not os.path.isfile(path) and not os.path.isfile(record_path(target)):
        raise NotFoundError(f"{path} is not a file; give the GGUF file a merge wrote")
    report = VerifyReport(os.path.abspath(path))
    adapters = [adapter] if isinstance(adapter, str) else list(adapter or [])
    record = stage(report, "the merge record", _check_record, target, report)
    files = sorted((record or {}).get("files") or {}) or [os.path.basename(path)]
    folder = os.path.dirname(os.path.abspath(target))
    for name in files:
        stage(report, "the file", _check_file, os.path.join(folder, name), report)
    if base is not None and adapters and not report.problems:
        stage(report, "the recomputation", _recompute, target, path, base, adapters, record, report)
    return settle(
        report,
        f"the bytes were not checked: there is no {os.path.basename(record_path(target))} beside the file; give "
        "--base and --adapter to recompute them",
    )


def _target(path: str) -> str:
    """The output a GGUF file belongs to: itself, or the name a split output's files were made from."""
    split = re.fullmatch(r"(.*)-\d{5}-of-\d{5}\.gguf", os.fspath(path))
    return split.group(1) + ".gguf" if split else os.fspath(path)


def _check_record(target: str, report: VerifyReport) -> dict | None:
    """The record beside the output, checked against each file it lists; None where there is none."""
    where = record_path(target)
    if not os.path.isfile(where):
        return None
    with open(where, encoding="utf-8") as f:
        record = json.load(f)
    name = os.path.basename(where)
    if record.get("record_sha256") != record_digest(record):
        report.problems.append(f"{name} was changed after the merge (its own digest differs)")
        report.integrity = False
        return record
    files = record.get("files") or {}
    if not files:
        report.problems.append(f"{name} lists no file")
    report.integrity = bool(files)
    for listed, entry in sorted(files.items()):
        path = os.path.join(os.path.dirname(os.path.abspath(target)), listed)
        if not os.path.isfile(path):
            report.problems.append(f"{listed}, which {name} lists, is missing")
            report.integrity = False
            continue
        size = os.path.getsize(path)
        if size != entry.get("size") or file_sha256(path) != entry.get("sha256"):
            report.problems.append(
                f"{listed} differs from what the merge wrote ({size} bytes, {entry.get('size')} recorded)"
            )
            report.integrity = False
        else:
            report.checks.append(f"{listed}: {size} bytes, SHA-256 as recorded")
    return record


def _check_file(path: str, report: VerifyReport) -> None:
    """The file read by gguf-py; its 32- and 16-bit tensors finite."""
    import gguf

    reader = gguf.GGUFReader(path)
    report.tensors += len(reader.tensors)
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    bad = [t.name for t in reader.tensors if t.tensor_type in floats and not np.isfinite(t.data).all()]
    if bad:
        report.problems.append(f"{os.path.basename(path)}: tensors with NaN or Inf: {', '.join(bad[:5])}")
    report.checks.append(
        f"{os.path.basename(path)}: {len(reader.tensors)} tensors read by gguf-py, {len(reader.fields)} metadata keys"
    )


def _recompute(target: str, path: str, base: str, adapters: list[str], record, report: VerifyReport) -> None:
    """The merge run again from base + adapter into a comparison with the output's files."""
    from ..checkpoint.reader import CheckpointReader
    from ..engine.execute import run
    from .recompute import merge_settings, plan_recomputation, settle_stored_base

    merge = (record or {}).get("merge")
    options, notes = merge_settings(merge, "float32")
    report.notes += notes
    options, settled = settle_stored_base(options, merge, base)
    report.notes += settled
    if options is None:
        report.unchecked += settled
        return
    _, plan = plan_recomputation(base, adapters, {**options, "dtype": "float32"})
    info = (merge or {}).get("gguf") or {}
    outtype = info.get("outtype") or _file_type(path)
    source = CheckpointReader(plan)
    check = GGUFCheck(
        target, OutType.parse(outtype), plan.config, source.side_files, info.get("name"), info.get("split_max_size", 0)
    )
    run(plan, source, check, progress=False)
    if check.header_differs:
        report.problems.append("the metadata differs from what base + adapter give (tokenizer, config or names)")
    differing = {n: b for n, b in check.differing.items() if b}
    if differing:
        listed = ", ".join(f"{n} ({b} bytes)" for n, b in sorted(differing.items())[:5])
        report.problems.append(f"{len(differing)} tensor(s) differ from base + adapter merged again: {listed}")
        report.recomputed = False
    elif not check.header_differs:
        report.recomputed = True
        report.checks.append(f"every tensor recomputed from base + adapter and equal in {outtype}, byte for byte")


def _file_type(path: str) -> str:
    """The GGUF type of a file without a record: its ``general.file_type``."""
    import gguf

    from ..output.gguf_types import file_type_name

    field = gguf.GGUFReader(path).fields.get("general.file_type")
    if field is None:
        raise ShardMergeError(f"{path} has no general.file_type and no record: its type is not known")
    return file_type_name(gguf.LlamaFileType(int(field.contents())))


class GGUFCheck(GGUFSink):
    """The GGUF sink comparing instead of writing: the output laid out for the merge again, each tensor's bytes
    compared with the file's at their offset (:class:`~peft_shardmerge.engine.sink.Sink`).

    Args:
        path: the GGUF output (the name a split output's files were made from).
        outtype: its :class:`~peft_shardmerge.output.gguf_types.OutType`.
        config: the merged model's ``config.json``.
        side_files: writes the base's other files (its tokenizer) into a folder.
        name: the model's name the merge used (None: the file's).
        split_max_size: the split the merge used (0: one file).

    Attributes:
        differing: per GGUF tensor, the bytes that differ.
        header_differs: whether a header (metadata, tokenizer, layout) differs from its file's.
    """

    label = "verifying GGUF"

    def __init__(self, path, outtype: OutType, config: dict, side_files=None, name=None, split_max_size: int = 0):
        super().__init__([(path, outtype)], config, side_files, name=name, split_max_size=split_max_size)
        self.differing: dict[str, int] = {}
        self.header_differs = False

    @contextmanager
    def open(self, layout: Layout) -> Iterator[GGUFOutputs]:
        outs = [_Compared(path, header, layout, self) for path, _, header in self.files(layout)]
        try:
            yield GGUFOutputs(outs, layout, records=False)
        finally:
            for out in outs:
                out.close()


class _Compared(GGUFOutput):
    """One GGUF file compared, not written."""

    def __init__(self, path, header, layout, check: GGUFCheck):
        self.check = check
        super().__init__(path, header, layout, check.targets[0][1].name)

    def _open(self) -> set[int]:
        self.fd = os.open(self.path, os.O_RDONLY)
        self.check.header_differs |= os.pread(self.fd, len(self.header.raw), 0) != self.header.raw
        for t, off in zip(self.header.tensors, self.header.offsets):
            if t.values is not None:
                from ..output.gguf_types import encode

                self.put(encode(t.values.reshape(t.shape), t.qtype), off, t.name)
        return set()

    def put(self, data: bytes, offset: int, name: str) -> None:
        stored = os.pread(self.fd, len(data), offset)
        n = len(data) if len(stored) != len(data) else _differing(data, stored)
        with self.lock:
            self.check.differing[name] = self.check.differing.get(name, 0) + n

    def part_done(self, i: int, digest: str) -> None:
        pass

    def finish(self, finish: Finish) -> None:
        if self.missing:
            raise ShardMergeError(f"GGUF tensors not recomputed: {sorted(self.missing)[:5]}")


def _differing(a: bytes, b: bytes) -> int:
    """The bytes that differ between two equal-length byte strings."""
    return 0 if a == b else int((np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)).sum())
