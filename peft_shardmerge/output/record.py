"""The merge record (``merge_manifest.json``): digests of every output byte and what the merge used, written with
the output (checked by :mod:`peft_shardmerge.verify.integrity`)."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import torch

from ..io.safetensors_io import DTYPES, FLOAT_DTYPES, read_header
from ..quant.bnb_layers import bnb_layer_kind, quant_state_of
from ..version import __version__
from .files import MANIFEST, PUSH_MARK
from .writer import write_json

RECORD_FILE = "merge_manifest.json"
RECORD_FORMAT = "peft-shardmerge merge record"
RECORD_VERSION = 1
#: files a loader may take weights from: one the merge did not write is a problem, not an extra
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".pkl")
_PIECE = 16 << 20


def hash_file(path: str, hasher, piece: int = _PIECE) -> str:
    """Feed a whole file to ``hasher`` (anything with ``update`` and ``hexdigest``), ``piece`` bytes at a time.

    Args:
        path: the file.
        hasher: e.g. ``hashlib.sha256()`` or :class:`~peft_shardmerge.output.resume.Crc32`.
        piece: bytes read at a time.

    Returns:
        ``hasher.hexdigest()`` after the last byte.

    Raises:
        OSError: the file cannot be read.

    Example:
        >>> hash_file(__file__, hashlib.md5()) == hashlib.md5(open(__file__, "rb").read()).hexdigest()
        True
    """
    with open(path, "rb") as f:
        while data := f.read(piece):
            hasher.update(data)
    return hasher.hexdigest()


def file_sha256(path: str) -> str:
    """The hex SHA-256 of a file (what ``sha256sum`` prints), read in 16 MiB pieces.

    Args:
        path: the file.

    Returns:
        64 hex characters.

    Raises:
        OSError: the file cannot be read.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "config.json")
        >>> _ = open(path, "wb").write(b"abc")
        >>> file_sha256(path)
        'ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad'
    """
    return hash_file(path, hashlib.sha256())


def scan_range(fd: int, begin: int, end: int, dtype: str | None = None) -> tuple[str, int, bool]:
    """Hash bytes ``[begin, end)`` of an open file and, for a floating-point ``dtype``, look for NaN/Inf on the way.

    Args:
        fd: a readable file descriptor.
        begin: first byte.
        end: one past the last byte.
        dtype: safetensors dtype of the values there, or None to hash only.

    Returns:
        ``(hex SHA-256, bytes actually read, all values finite)``; fewer bytes than asked means the file is short.

    Raises:
        OSError: the file cannot be read.

    Example:
        >>> fd = os.open(__file__, os.O_RDONLY); scan_range(fd, 0, 0)[1:]; os.close(fd)
        (0, True)
    """
    h = hashlib.sha256()
    torch_dtype, size = DTYPES.get(dtype, (None, 1)) if dtype in FLOAT_DTYPES else (None, 1)
    step = _PIECE - _PIECE % size
    pos, finite = begin, True
    while pos < end:
        piece = os.pread(fd, min(step, end - pos), pos)
        if not piece:
            break
        h.update(piece)
        if torch_dtype is not None and finite and len(piece) % size == 0:
            finite = bool(torch.isfinite(torch.frombuffer(bytearray(piece), dtype=torch_dtype)).all())
        pos += len(piece)
    return h.hexdigest(), pos - begin, finite


def shard_record(path: str) -> dict:
    """The record of a finished shard computed from the file (for shards kept from an interrupted run); the same
    fields :meth:`~peft_shardmerge.output.writer.ShardWriter.record` computes while writing.

    Args:
        path: the ``.safetensors`` file.

    Returns:
        ``{"size", "header": {"size", "sha256"}, "tensors": {name: {"offsets", "sha256"}}}``.

    Raises:
        CorruptFileError: the file is not valid safetensors.
        OSError: it cannot be read.
    """
    infos, _ = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        header_sha = scan_range(fd, 0, 8 + n)[0]
        tensors = {}
        for t in infos:
            begin = t.offset - 8 - n
            tensors[t.name] = {
                "offsets": [begin, begin + t.nbytes],
                "sha256": scan_range(fd, t.offset, t.offset + t.nbytes)[0],
            }
    finally:
        os.close(fd)
    return {"size": os.path.getsize(path), "header": {"size": 8 + n, "sha256": header_sha}, "tensors": tensors}


def _hub_identity(folder: str) -> dict:
    """``{"name", "revision"}`` of a folder in the Hugging Face cache, or its folder name; never a local path."""
    parts = os.path.realpath(folder).split(os.sep)
    if "snapshots" in parts:
        i = parts.index("snapshots")
        repo = parts[i - 1] if i > 0 else ""
        if repo.startswith("models--") and i + 1 < len(parts):
            return {"name": repo[len("models--") :].replace("--", "/"), "revision": parts[i + 1]}
    return {"name": os.path.basename(os.path.normpath(folder))}


def input_identity(folder: str, *, hash_files: bool) -> dict:
    """What identifies an input folder without naming a local path: its name (Hub id and revision when it is in
    the cache), each file's size, and each file's SHA-256 when ``hash_files`` (cheap for adapters; bases record
    only ``config.json``'s).

    Args:
        folder: the input folder.
        hash_files: hash every file (else sizes, and the SHA-256 of ``config.json``).

    Returns:
        A JSON-ready dict.

    Raises:
        OSError: a file cannot be read.
    """
    out = _hub_identity(folder)
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            files[name] = {"size": os.path.getsize(path)}
            if hash_files or name == "config.json":
                files[name]["sha256"] = file_sha256(path)
    out["files"] = files
    return out


def disk_merge_info(plan) -> dict:
    """What a merge from disk used, for the record: base precision (and 4-bit settings), dtype, row block size,
    the inputs' identity and the adapters' weights.

    Args:
        plan: the :class:`~peft_shardmerge.engine.plan.Plan` that was executed.

    Returns:
        A JSON-ready dict.

    Raises:
        OSError: an input file cannot be read.
    """
    nf4 = plan.inputs.nf4
    vectors = plan.inputs.adapter.vectors  # a task-vector method: its own parameters
    if vectors:
        kind, weights, extra = vectors.name, [float(w) for w in vectors.weights], {"task_vectors": vectors.record()}
    else:
        kind, _, text = (plan.inputs.adapter.combination or "").partition(" ")  # e.g. "cat 1, 0.5"
        weights, extra = [float(w) for w in text.split(",")] if text else None, {}
    return {
        "path": "disk",
        "base_precision": plan.base_precision,
        "nf4": {
            "quant_type": nf4.quant_type,
            "blocksize": nf4.blocksize,
            "double_quant": nf4.double_quant,
            **({"skip_modules": list(nf4.skip_modules)} if nf4.skip_modules else {}),
        }
        if nf4
        else None,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "chunk_elems": plan.chunk_elems,
        "base": input_identity(plan.inputs.base.folder, hash_files=False),
        "adapters": [{"name": n, "in_memory": True} for n in plan.in_memory_adapters]  # no file of the user's
        or [input_identity(f, hash_files=True) for f in plan.inputs.adapter.folders],
        "combination": kind or None,
        "weights": weights,
        **extra,
    }


def live_merge_info(
    model,
    out_dtype: torch.dtype,
    adapter_names: list[str] | None,
    weights: dict[str, float] | None = None,
    combination: str = "cat",
    vectors=None,
) -> dict:
    """What an in-process merge into the weights in memory used, for the record: the model's quantization (the
    base the adapter saw is dequant(quantize(W)) with these settings), the dtype the weights were held in, the
    output dtype, and the adapters merged.

    Args:
        model: the transformers model (inside the PeftModel).
        out_dtype: the dtype written.
        adapter_names: the adapters merged (None: the active ones).
        weights: the weight of each adapter of a weighted combination, by name.
        combination: how several adapters were combined (``"cat"``, ``"linear"`` or a task-vector method).
        vectors: the task-vector method (its parameters are recorded), or None.

    Returns:
        A JSON-ready dict (``base_precision`` is ``"dequantized"``).
    """
    config = getattr(model, "config", None)
    qc = getattr(config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc or {})
    quantization = None
    if qc.get("load_in_4bit"):
        quantized_from = None
        for module in model.modules():
            state = quant_state_of(module) if bnb_layer_kind(module) == "4bit" else None
            if state is not None and getattr(state, "dtype", None) is not None:
                quantized_from = str(state.dtype).removeprefix("torch.")
                blocksize = getattr(state, "blocksize", 64)
                break
        quantization = {
            "bits": 4,
            "quant_type": qc.get("bnb_4bit_quant_type", "nf4"),
            "double_quant": bool(qc.get("bnb_4bit_use_double_quant", False)),
            "blocksize": blocksize if quantized_from else 64,
            "quantized_from": quantized_from,
        }
    elif qc.get("load_in_8bit"):
        quantization = {"bits": 8}
    held = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    if os.path.isdir(name):
        base = _hub_identity(name)
    else:  # a Hub id, or a local path that is gone: never record the path itself
        local = os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
        base = {"name": os.path.basename(os.path.normpath(name)) if local else name}
    return {
        "path": "in-process",
        "base_precision": "dequantized",
        "quantization": quantization,
        "held_dtype": str(held).removeprefix("torch.") if held is not None else None,
        "dtype": str(out_dtype).removeprefix("torch."),
        "base": base,
        "adapters": [{"name": n} for n in (adapter_names or [])] or None,
        "combination": combination if weights else None,
        "weights": [float(weights[n]) for n in adapter_names or weights] if weights else None,
        **({"task_vectors": vectors.record()} if vectors else {}),
    }


def record_digest(record: dict) -> str:
    """The SHA-256 of a record without its own ``record_sha256`` (canonical JSON: sorted keys, no spaces).

    Args:
        record: the record.

    Returns:
        64 hex characters.

    Raises:
        TypeError: the record is not JSON-serializable.

    Example:
        >>> record_digest({"a": 1}) == record_digest({"a": 1, "record_sha256": "x"})
        True
    """
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def output_files(folder: str) -> list[str]:
    """Every regular file under ``folder``, as relative paths (``/``-separated), except the record itself, the
    staging folder's resume manifest (removed when the output is committed) and a push's mark.

    Args:
        folder: the output folder.

    Returns:
        Relative paths, top-down: a folder's files (sorted) before its sub-folders' (sorted).

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> os.mkdir(os.path.join(folder, "1_Pooling"))
        >>> for rel in ("config.json", os.path.join("1_Pooling", "config.json"), RECORD_FILE):
        ...     _ = open(os.path.join(folder, rel), "w").write("{}")
        >>> output_files(folder)
        ['config.json', '1_Pooling/config.json']
    """
    out = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if rel not in (RECORD_FILE, MANIFEST, MANIFEST + ".tmp", PUSH_MARK):
                out.append(rel)
    return out


def write_merge_record(folder: str, shards: dict[str, dict], merge: dict) -> None:
    """Write ``merge_manifest.json`` into a finished output folder: each shard's record (from the writer, or
    computed from the file for shards kept from an interrupted run), the SHA-256 of every other file, what the
    merge used, the tool's version, and a digest of the record itself. Call it last, once every file is in place.

    Args:
        folder: the output (staging) folder.
        shards: records of shards written by this run, by file name (from ``ShardWriter.record()``), those no longer
            in ``folder`` too (a push's, uploaded and deleted).
        merge: what the merge used (:func:`disk_merge_info` or :func:`live_merge_info`).

    Raises:
        OSError: a file cannot be read or the record cannot be written.
        CorruptFileError: a shard without a record is not valid safetensors.
    """
    shard_records, files = dict(shards), {}
    for rel in output_files(folder):
        path = os.path.join(folder, rel)
        if rel.endswith(".safetensors") and "/" not in rel:
            shard_records[rel] = shards.get(rel) or shard_record(path)
        else:
            files[rel] = {"size": os.path.getsize(path), "sha256": file_sha256(path)}
    write_json(os.path.join(folder, RECORD_FILE), sealed_record(merge, files, shards=shard_records))


def sealed_record(merge: dict, files: dict[str, dict], shards: dict[str, dict] | None = None) -> dict:
    """A merge record: its format, the tool's version, what the merge used, the outputs' digests, and the record's
    own digest (``record_sha256``).

    Args:
        merge: what the merge used.
        files: ``{name: {"size", "sha256"}}`` of the files listed whole.
        shards: the shards' records, for a folder's output (None: no ``shards`` entry).

    Returns:
        The record.

    Example:
        >>> r = sealed_record({}, {})
        >>> r["record_sha256"] == record_digest(r)
        True
    """
    record = {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "tool": {"name": "peft-shardmerge", "version": __version__},
        "algorithm": "sha256",
        "merge": merge,
        **({"shards": shards} if shards is not None else {}),
        "files": files,
    }
    record["record_sha256"] = record_digest(record)
    return record


def unlisted_files(folder: str, record: dict) -> list[str]:
    """The files of a merged folder its record does not list (added after the merge).

    Args:
        folder: the merged folder.
        record: its parsed, self-checked record.

    Returns:
        Sorted relative paths.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> for name in ("model.safetensors", "config.json", "notes.txt"):
        ...     _ = open(os.path.join(folder, name), "w").write("")
        >>> unlisted_files(folder, {"shards": {"model.safetensors": {}}, "files": {"config.json": {}}})
        ['notes.txt']
    """
    return sorted(set(output_files(folder)) - set(record["shards"]) - set(record["files"]))
