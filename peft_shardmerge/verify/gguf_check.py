"""Verify a GGUF output: its bytes against the merge record beside it, its structure as gguf-py reads it, and every
tensor recomputed from base + adapter and compared in the file's own type (the GGUF sink, comparing instead of
writing)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from ..engine.sink import Finish, Layout
from ..errors import NotFoundError, ShardMergeError
from ..output.gguf_sink import GGUFOutput, GGUFOutputs, GGUFSink, record_path
from ..output.gguf_types import OutType
from ..output.record import file_sha256, record_digest
from .report import VerifyReport, stage


def verify_gguf(path: str, *, base: str | None = None, adapter: str | list[str] | None = None) -> VerifyReport:
    """Check a GGUF file a merge wrote.

    Without inputs: its size and SHA-256 against the merge record beside it (``NAME.merge_manifest.json``), and
    the file read by gguf-py (every tensor's extent inside the file, 32- and 16-bit values finite). With ``base``
    and ``adapter``: the merge is run again from them with the recorded options (on the CPU), each GGUF tensor
    encoded in the file's own type and compared byte for byte with the file, and the header (metadata, tokenizer,
    tensor layout) with the file's.

    Args:
        path: the GGUF file.
        base: the base checkpoint the merge came from.
        adapter: the adapter merged, or the adapters of a combination in their order.

    Returns:
        The :class:`~peft_shardmerge.verify.report.VerifyReport`: ``OK``, ``FAILED`` (each problem listed) or
        ``UNCHECKED`` (no record and no inputs).

    Raises:
        NotFoundError: ``path`` is not a file.
    """
    if not os.path.isfile(path):
        raise NotFoundError(f"{path} is not a file; give the GGUF file a merge wrote")
    report = VerifyReport(os.path.abspath(path))
    adapters = [adapter] if isinstance(adapter, str) else list(adapter or [])
    record = stage(report, "the merge record", _check_record, path, report)
    stage(report, "the file", _check_file, path, report)
    if base is not None and adapters and not report.problems:
        stage(report, "the recomputation", _recompute, path, base, adapters, record, report)
    if report.problems:
        report.status = "FAILED"
    elif report.integrity or report.recomputed:
        report.status = "OK"
    else:
        report.status = "UNCHECKED"
        report.notes.append(
            f"the bytes were not checked: there is no {os.path.basename(record_path(path))} beside the file; give "
            "--base and --adapter to recompute them"
        )
    report.ok = report.status == "OK"
    return report


def _check_record(path: str, report: VerifyReport) -> dict | None:
    """The record beside the file, checked against the file; None where there is none."""
    where = record_path(path)
    if not os.path.isfile(where):
        return None
    with open(where, encoding="utf-8") as f:
        record = json.load(f)
    if record.get("record_sha256") != record_digest(record):
        report.problems.append(f"{os.path.basename(where)} was changed after the merge (its own digest differs)")
        report.integrity = False
        return record
    name = os.path.basename(path)
    entry = (record.get("files") or {}).get(name)
    if entry is None:
        report.problems.append(f"{os.path.basename(where)} does not list {name}")
        report.integrity = False
        return record
    size = os.path.getsize(path)
    if size != entry.get("size") or file_sha256(path) != entry.get("sha256"):
        report.problems.append(
            f"{name} differs from what the merge wrote ({size} bytes, {entry.get('size')} recorded)"
        )
        report.integrity = False
    else:
        report.integrity = True
        report.checks.append(f"{name}: {size} bytes, SHA-256 as recorded")
    return record


def _check_file(path: str, report: VerifyReport) -> None:
    """The file read by gguf-py; its 32- and 16-bit tensors finite."""
    import gguf

    reader = gguf.GGUFReader(path)
    report.tensors = len(reader.tensors)
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    bad = [t.name for t in reader.tensors if t.tensor_type in floats and not np.isfinite(t.data).all()]
    if bad:
        report.problems.append(f"tensors with NaN or Inf: {', '.join(bad[:5])}")
    report.checks.append(f"{report.tensors} tensors read by gguf-py, {len(reader.fields)} metadata keys")


def _recompute(path: str, base: str, adapters: list[str], record: dict | None, report: VerifyReport) -> None:
    """The merge run again from base + adapter into a comparison with the file."""
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
    outtype = ((merge or {}).get("gguf") or {}).get("outtype") or _file_type(path)
    source = CheckpointReader(plan)
    check = GGUFCheck(path, OutType.parse(outtype), plan.config, source.side_files)
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
    """The GGUF sink comparing instead of writing: the file laid out for the merge again, each tensor's bytes
    compared with the file's at their offset (:class:`~peft_shardmerge.engine.sink.Sink`).

    Args:
        path: the GGUF file.
        outtype: its :class:`~peft_shardmerge.output.gguf_types.OutType`.
        config: the merged model's ``config.json``.
        side_files: writes the base's other files (its tokenizer) into a folder.

    Attributes:
        differing: per GGUF tensor, the bytes that differ.
        header_differs: whether the header (metadata, tokenizer, layout) differs from the file's.
    """

    label = "verifying GGUF"

    def __init__(self, path: str, outtype: OutType, config: dict, side_files=None):
        super().__init__([(path, outtype)], config, side_files)
        self.differing: dict[str, int] = {}
        self.header_differs = False

    @contextmanager
    def open(self, layout: Layout) -> Iterator[GGUFOutputs]:
        (path, _, header), *more = self.files(layout)
        if more:
            raise ShardMergeError("a split GGUF output is verified file by file against its record only")
        out = _Compared(path, header, layout, self)
        try:
            yield GGUFOutputs([out], layout, records=False)
        finally:
            out.close()


class _Compared(GGUFOutput):
    """One GGUF file compared, not written."""

    def __init__(self, path, header, layout, check: GGUFCheck):
        self.check = check
        super().__init__(path, header, layout, check.targets[0][1].name)

    def _open(self) -> set[int]:
        self.fd = os.open(self.path, os.O_RDONLY)
        self.check.header_differs = os.pread(self.fd, len(self.header.raw), 0) != self.header.raw
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

    def part_done(self, i: int) -> None:
        pass

    def finish(self, finish: Finish) -> None:
        if self.missing:
            raise ShardMergeError(f"GGUF tensors not recomputed: {sorted(self.missing)[:5]}")


def _differing(a: bytes, b: bytes) -> int:
    """The bytes that differ between two equal-length byte strings."""
    return 0 if a == b else int((np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)).sum())
