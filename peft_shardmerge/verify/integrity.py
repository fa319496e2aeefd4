"""Checking a merged checkpoint's bytes against its merge record (``merge_manifest.json``), without any input."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from ..io.safetensors_io import read_header
from ..output.record import (
    RECORD_FILE,
    RECORD_FORMAT,
    RECORD_VERSION,
    WEIGHT_SUFFIXES,
    file_sha256,
    record_digest,
    scan_range,
    unlisted_files,
)


@dataclass
class IntegrityResult:
    """What :func:`check_integrity` found.

    Attributes:
        record: the parsed record, or None when there is none (or it is unreadable).
        problems: every difference from the record, each a sentence.
        checks: what was checked, one line each.
        notes: things worth knowing that are not problems (files added after the merge).
        nonfinite: tensors holding NaN or Inf.
        unchecked: files added after the merge that a loader may read, which the record does not cover.
    """

    record: dict | None = None
    problems: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)


def read_record(folder: str) -> tuple[dict | None, list[str]]:
    """Read and self-check ``merge_manifest.json``.

    Args:
        folder: the merged checkpoint.

    Returns:
        ``(record or None, problems)``: ``(None, [])`` when there is no record at all.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> read_record(folder)
        (None, [])
        >>> _ = open(os.path.join(folder, RECORD_FILE), "w").write("{")
        >>> read_record(folder)
        (None, ['merge_manifest.json cannot be read (JSONDecodeError): it was damaged or edited'])
    """
    path = os.path.join(folder, RECORD_FILE)
    if not os.path.lexists(path):
        return None, []
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        return None, [f"{RECORD_FILE} cannot be read ({type(e).__name__}): it was damaged or edited"]
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        return None, [f"{RECORD_FILE} is not a peft-shardmerge merge record"]
    if record.get("version") != RECORD_VERSION:
        return None, [
            f"{RECORD_FILE} has record version {record.get('version')!r}; this peft-shardmerge reads "
            f"version {RECORD_VERSION}: verify with the version that wrote it"
        ]
    if record.get("record_sha256") != record_digest(record):
        return None, [f"{RECORD_FILE} does not match its own digest: it was damaged or edited"]
    if not isinstance(record.get("shards"), dict) or not record["shards"] or not isinstance(record.get("files"), dict):
        return None, [f"{RECORD_FILE} lists no shards"]
    return record, []


#: what transformers' Trainer writes into an output folder besides the model (its ``TRAINING_ARGS_NAME``,
#: ``TRAINER_STATE_NAME``, optimizer, scheduler, scaler and RNG states, and ``save_metrics``'
#: ``{split}_results.json``), at the folder's top: no model loader reads them, so a copy beside a merged model leaves
#: its check complete
TRAINER_FILES = re.compile(
    r"training_args\.bin|trainer_state\.json|optimizer\.(pt|bin)|scheduler\.pt|scaler\.pt|rng_state(_\d+)?\.pth"
    r"|(all|train|eval|test|predict)_results\.json"
)


def check_integrity(folder: str) -> IntegrityResult:
    """Compare every byte of a merged checkpoint with its record: each shard's size, header and tensors, every
    other file written by the merge, shards or weight files that are missing or were added; and look for NaN/Inf
    in each floating-point tensor on the same read.

    Args:
        folder: the merged checkpoint.

    Returns:
        The :class:`IntegrityResult`; ``record`` is None when the folder has no usable record. An unreadable file
        is one of its problems, never raised.
    """
    result = IntegrityResult()
    record, problems = read_record(folder)
    result.problems += problems
    if record is None:
        return result
    result.record = record
    for name in unlisted_files(folder, record):
        if TRAINER_FILES.fullmatch(name):
            result.notes.append(f"{name} was added after the merge (training state, which no loader reads)")
        elif name.lower().endswith(WEIGHT_SUFFIXES):
            result.problems.append(f"{name} was not written by the merge (a loader may take weights from it)")
        elif _documentation(name):
            result.notes.append(f"{name} was added after the merge (not covered by {RECORD_FILE})")
        else:
            result.unchecked.append(name)
            result.notes.append(
                f"{name} was added after the merge and was not checked: {RECORD_FILE} does not "
                "cover it, and a loader reads it; remove it, or write it with the merge (e.g. "
                "tokenizer=...) so that the record covers it"
            )
    tensors = 0
    for name, shard in sorted(record["shards"].items()):
        tensors += _check_shard(folder, name, shard, result)
    for name, meta in sorted(record["files"].items()):
        path = os.path.join(folder, name)
        if not _inside(name) or not isinstance(meta, dict):
            result.problems.append(
                f"{RECORD_FILE} names {name!r} in a malformed entry (outside the folder or not an object)"
            )
        elif not os.path.isfile(path):
            result.problems.append(f"{name} is missing (the merge wrote it)")
        elif os.path.getsize(path) != meta.get("size") or file_sha256(path) != meta.get("sha256"):
            result.problems.append(f"{name} differs from what the merge wrote (SHA-256 mismatch)")
    result.checks.append(
        f"integrity: {len(record['shards'])} shard(s), {tensors} tensors and "
        f"{len(record['files'])} other file(s) match the SHA-256 digests in {RECORD_FILE}"
        if not result.problems
        else f"integrity: compared with the SHA-256 digests in {RECORD_FILE}"
    )
    return result


def _inside(name: str) -> bool:
    """A relative ``/``-separated path that stays inside the folder."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and ".." not in parts and "" not in parts


def _check_shard(folder: str, name: str, shard: dict, result: IntegrityResult) -> int:
    path = os.path.join(folder, name)
    if "/" in name or not _inside(name) or not os.path.isfile(path):
        result.problems.append(f"shard {name} is missing (the merge wrote it)")
        return 0
    size = os.path.getsize(path)
    try:
        header = shard["header"]
        if size != shard["size"]:
            result.problems.append(
                f"{name} is {size} bytes, the merge wrote {shard['size']} "
                f"({'truncated' if size < shard['size'] else 'extended'})"
            )
        fd = os.open(path, os.O_RDONLY)
        try:
            if scan_range(fd, 0, header["size"])[0] != header["sha256"]:
                result.problems.append(
                    f"{name}: header differs from what the merge wrote (names, dtypes, shapes, "
                    "offsets or metadata changed)"
                )
            dtypes = _header_dtypes(path)
            changed = []
            for tensor, meta in shard["tensors"].items():
                begin, end = (header["size"] + o for o in meta["offsets"])
                digest, got, finite = scan_range(fd, begin, end, dtypes.get(tensor))
                if got != end - begin or digest != meta["sha256"]:
                    changed.append(tensor)
                if not finite:
                    result.nonfinite.append(tensor)
        finally:
            os.close(fd)
    except (KeyError, TypeError, ValueError) as e:
        result.problems.append(f"{RECORD_FILE}: the entry of {name} is malformed ({type(e).__name__})")
        return 0
    except OSError as e:
        result.problems.append(f"{name} cannot be read ({e.strerror or e})")
        return 0
    if changed:
        result.problems.append(
            f"{name}: {len(changed)} tensor(s) differ from what the merge wrote: "
            f"{', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}"
        )
    return len(shard["tensors"])


def _header_dtypes(path: str) -> dict[str, str]:
    """Tensor dtypes from the shard's header, for the NaN/Inf scan ({} when the header is unreadable)."""
    try:
        return {t.name: t.dtype for t in read_header(path)[0]}
    except Exception:  # a damaged header is reported by its digest
        return {}


def _documentation(name: str) -> bool:
    """Whether an added file is documentation no loader reads (a README, a licence, an image)."""
    base = name.rsplit("/", 1)[-1].lower()
    return (
        base.startswith(("readme", "license"))
        or base == ".gitattributes"
        or base.endswith((".md", ".png", ".jpg", ".jpeg", ".gif", ".svg"))
    )
