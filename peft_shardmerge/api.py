"""The public disk-to-disk API: merge_checkpoint and plan_checkpoint_merge."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Callable, Sequence

import torch

from .adapter import combine_adapters, load_adapter
from .errors import InputError, ShardMergeError
from .execute import execute_plan, resolve_device
from .model_info import inspect_model
from .outfiles import name_problems, sidecar_problems
from .peft_deltas import rebuild
from .plan import DEFAULT_CHUNK_ELEMS, Plan, build_plan
from .quant import Nf4Settings
from .reading_rules import adapter_load_problems
from .report import MergeReport
from .sources import open_checkpoint
from .staging import NOTHING_WRITTEN, FileSystemError

log = logging.getLogger(__name__)


def check_out_dir(out_dir: str | os.PathLike, *, inputs: dict[str, str | os.PathLike | None],
                  overwrite: bool) -> list[str]:
    """Find every problem with an output folder, without touching anything.

    ``out_dir`` is resolved once (a trailing slash changes nothing). Refused whatever ``overwrite`` says: an empty
    path, the filesystem root, the current working folder or a folder holding it, the home folder or a folder
    holding it, an input folder, a folder inside an input or holding one, a symlink, a mount point. Also named
    here: a parent that is a file, a parent that cannot be written, a name too long for the staging folder and
    lock beside it, and those names taken by something the merge did not make.

    Args:
        out_dir: the output folder (``str`` or ``os.PathLike``).
        inputs: folders that must survive the merge, by role (``{"base": ..., "adapter": ...}``); None values
            are skipped.
        overwrite: whether a non-empty ``out_dir`` may be replaced.

    Returns:
        The problems, each a sentence with the fix; empty when ``out_dir`` is fine.

    Raises:
        Nothing: problems are returned, so that the caller can report them with others.

    Example:
        >>> for p in check_out_dir("/tmp/base/merged", inputs={"base": "/tmp/base"}, overwrite=False):
        ...     print(p)
        output folder /tmp/base/merged is inside the base folder /tmp/base; choose a folder outside it
        >>> check_out_dir("", inputs={}, overwrite=True)
        ["output folder is an empty path (''); name the folder to create, e.g. ./merged"]
    """
    raw, problems = path_argument(out_dir, "output folder")
    if raw is None:
        return problems
    if not raw.strip():
        return [f"output folder is an empty path ({raw!r}); name the folder to create, e.g. ./merged"]
    out = os.path.abspath(raw)
    real = os.path.realpath(out)
    as_the_system_reads = os.path.realpath(os.path.join(_here() or os.sep, raw))
    if ".." in raw.split(os.sep) and as_the_system_reads != real:
        return [f"output folder {raw} has '..' after a symbolic link: the system reads it as {as_the_system_reads}, "
                f"not {out}; pass the path without '..'"]
    if real == os.sep:
        return [f"output folder {raw} is the filesystem root; name a new folder, e.g. {os.path.join(raw, 'merged')}"]
    for what, folder in (("the current working folder", _here()), ("your home folder", os.path.expanduser("~"))):
        folder = os.path.realpath(folder) if folder else None
        if folder and (real == folder or folder.startswith(real.rstrip(os.sep) + os.sep)):
            where = "is" if real == folder else "holds"
            return [f"output folder {raw} ({real}) {where} {what}, which the merge would replace; name a new folder, "
                    f"e.g. {os.path.join(raw, 'merged')}"]
    problems += _unresolved_input_problems(raw, real, inputs)
    seen = set()
    for role, folder in _with_link_targets(inputs):
        src = os.path.realpath(os.fspath(folder)) if folder is not None else None
        if src is None or src in seen:
            continue
        seen.add(src)
        if real == src or real.startswith(src.rstrip(os.sep) + os.sep):
            where = "is" if real == src else "is inside"
            problems.append(f"output folder {raw} {where} the {role} folder {os.fspath(folder)}; choose a folder "
                            "outside it")
        elif src.startswith(real.rstrip(os.sep) + os.sep):
            problems.append(
                f"the {role} folder {os.fspath(folder)} is inside the output folder {raw}; replacing it would destroy "
                f"the {role}; choose another output folder"
            )
    problems += name_problems(out)
    problems += _parent_problems(raw, out)
    if os.path.islink(out):
        if not problems:
            problems.append(f"output {raw} is a symlink; the output is staged beside it and renamed into place, "
                            f"which would replace the link: pass the real path ({real})")
    elif os.path.ismount(out):
        problems.append(f"output {raw} is a mount point; the output is staged beside it and renamed, which cannot "
                        "replace a mount point: choose a folder inside it")
    elif os.path.lexists(out):
        if not os.path.isdir(out):
            problems.append(f"output {raw} exists and is not a folder; remove it or choose another path")
        elif not overwrite and _nonempty(out):
            problems.append(f"output folder {raw} is not empty; pass --overwrite (overwrite=True) to replace it")
    return problems + sidecar_problems(out)


def path_argument(value, what: str) -> tuple[str | None, list[str]]:
    """A path argument as ``str`` (``str``, ``bytes`` and ``os.PathLike`` accepted), or the problem with it.

    Args:
        value: the argument.
        what: its role, for the message.

    Returns:
        ``(path, [])``, or ``(None, [problem])``.

    Raises:
        Nothing.

    Example:
        >>> from pathlib import Path
        >>> path_argument(Path("a/b"), "base")
        ('a/b', [])
    """
    try:
        path = os.fspath(value)
    except TypeError:
        return None, [f"{what} must be a path (str or os.PathLike), got {type(value).__name__} {value!r:.60}"]
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if "\0" in path:
        return None, [f"{what} {path!r} contains a NUL character; pass a valid path"]
    return path, []


def source_folders(model) -> dict[str, str]:
    """The local folders a loaded model came from, which a save must never write over, into or around.

    Args:
        model: a transformers model or a PEFT model.

    Returns:
        ``{"model": folder}`` (``config._name_or_path``) and ``{"base of adapter 'name'": folder}`` (each adapter
        config's ``base_model_name_or_path``), when they are local folders, and ``{"adapter 'name'": folder}``
        where PEFT recorded one.

    Raises:
        Nothing.

    Example:
        >>> source_folders(object())
        {}
    """
    folders: dict[str, str] = {}
    inner = model
    for attr in ("base_model", "model"):  # PeftModel -> LoraModel -> transformers model
        if hasattr(inner, "peft_config") and hasattr(inner, attr):
            inner = getattr(inner, attr)
    candidates = [("model", getattr(getattr(model, "config", None), "_name_or_path", None)),
                  ("model", getattr(getattr(inner, "config", None), "_name_or_path", None))]
    for name, cfg in (getattr(model, "peft_config", None) or {}).items():
        candidates.append((f"base of adapter {name!r}", getattr(cfg, "base_model_name_or_path", None)))
        for attr in ("adapter_path", "model_id"):
            candidates.append((f"adapter {name!r}", getattr(cfg, attr, None)))
    for role, folder in candidates:
        if (isinstance(folder, str) and folder and not os.path.isabs(folder) and not os.path.exists(folder)
                and role not in folders):  # relative, loaded from another working folder (or a Hub id)
            folders[role] = folder
        elif isinstance(folder, (str, os.PathLike)) and os.fspath(folder) and os.path.isdir(folder):
            real = os.path.realpath(folder)
            if real not in {os.path.realpath(f) for f in folders.values()}:
                folders[role if role not in folders else f"{role} ({len(folders)})"] = os.fspath(folder)
    return folders


def foreign_model_problems(out_dir: str | os.PathLike) -> list[str]:
    """Problems with replacing ``out_dir`` from a loaded model: a folder holding a model or an adapter that
    peft-shardmerge did not write (no merge record) may be the one the model was loaded from, which PEFT does not
    record for adapters, so it is never replaced, ``overwrite`` or not.

    Args:
        out_dir: the output folder.

    Returns:
        The problems, each a sentence with the fix; empty when ``out_dir`` holds no such files.

    Raises:
        Nothing.

    Example:
        >>> foreign_model_problems("/nonexistent/merged")
        []
    """
    folder = os.fspath(out_dir)
    if not os.path.isdir(folder) or os.path.islink(folder) or os.path.isfile(os.path.join(folder, "merge_manifest.json")):
        return []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    held = sorted(n for n in names if n == "adapter_config.json" or n.endswith((".safetensors", ".bin", ".pt", ".pth")))
    if not held:
        return []
    return [f"output folder {folder} holds a model or adapter that peft-shardmerge did not write ({', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}); it may be the one this model was loaded from, so it is never "
            "replaced: choose another folder, or remove it yourself first"]


def _with_link_targets(inputs: dict) -> list[tuple[str, str]]:
    """Each input folder, then the folders its linked files really live in (a Hub snapshot's ``blobs/``): replacing
    those would destroy the input as surely as replacing the folder itself."""
    pairs = []
    for role, folder in inputs.items():
        pairs.append((role, folder))
        if folder is None or not os.path.isdir(folder):
            continue
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                path = os.path.join(root, name)
                if os.path.islink(path):
                    pairs.append((f"{role} (the files its links point to)", os.path.dirname(os.path.realpath(path))))
            if len(pairs) > 10_000:
                break
    return pairs


def _unresolved_input_problems(raw: str, real: str, inputs: dict) -> list[str]:
    """An input recorded as a relative path that no longer resolves (the working folder changed since the model was
    loaded) may be the output folder under another spelling: refuse an OUT whose path ends with it."""
    problems = []
    for role, folder in inputs.items():
        name = os.fspath(folder) if folder is not None else ""
        if not name or os.path.isabs(name) or os.path.exists(name):
            continue
        tail = os.sep + os.path.normpath(name).strip(os.sep)
        if (real + os.sep).find(tail + os.sep) >= 0:
            problems.append(f"output folder {raw} may be the {role} folder, recorded as the relative path {name!r} "
                            "when the model was loaded (the working folder has changed since); choose another folder")
    return problems


def _here() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the working folder was deleted
        return None


def _nonempty(folder: str) -> bool:
    try:
        return bool(os.listdir(folder))
    except OSError:
        return True


def _parent_problems(raw: str, out: str) -> list[str]:
    """The nearest existing ancestor of ``out`` must be a folder this process can create entries in."""
    existing = os.path.dirname(out)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [f"cannot create {raw}: {existing} is a file, not a folder; choose another output path"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"cannot write in {existing} (read-only or no permission) to create {raw}; choose another output "
                "folder"]
    return []


def plan_checkpoint_merge(
    base: str | os.PathLike,
    adapter: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    weights: Sequence[float] | None = None,
    combination: str = "cat",
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    base_precision: str = "original",
    nf4_quant_type: str = "nf4",
    nf4_blocksize: int = 64,
    nf4_double_quant: bool = True,
    device: str = "auto",
    overwrite: bool = False,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> Plan:
    """Check every input and decide the whole merge without reading tensor data (what ``--dry-run`` prints).

    Args:
        base: base checkpoint folder, or a Hub id in the local cache.
        adapter: PEFT LoRA adapter folder, or a Hub id in the local cache; or a list of them, merged as the
            weighted combination ``weights``/``combination`` describe.
        out_dir: the output folder.
        weights: one weight per adapter (default 1.0 each).
        combination: ``"cat"`` (exactly ``sum_i w_i * dW_i``, any ranks) or ``"linear"`` (PEFT's
            ``add_weighted_adapter`` linear factors, equal ranks); see
            :func:`~peft_shardmerge.adapter.combine_adapters`.
        dtype: output dtype (``"bfloat16"``, ``"float16"``, ``"float32"`` or a torch dtype); None keeps the base's.
        max_shard_size: largest output shard (``"5GB"``, ``"500MB"`` or bytes).
        base_precision: ``"original"`` merges into the checkpoint's weights; ``"nf4"`` merges into
            dequant(quantize_4bit(W)), the weights a QLoRA adapter was trained against.
        nf4_quant_type: ``"nf4"`` or ``"fp4"`` for ``base_precision="nf4"``.
        nf4_blocksize: 4-bit block size used during training.
        nf4_double_quant: whether training used double quantization.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        overwrite: allow replacing a non-empty ``out_dir``.
        chunk_elems: elements per row block (bounds peak memory).

    Returns:
        The :class:`~peft_shardmerge.plan.Plan`; ``print(plan.describe())`` shows it.

    Raises:
        InputError: every problem with the options, the output folder and the adapter/base pairing, at once.
        NotFoundError: the base or adapter cannot be found.
        UnsupportedError: the adapter type or an adapter option cannot be merged.
        CorruptFileError: a checkpoint or adapter file is malformed.

    Example:
        >>> plan = plan_checkpoint_merge("tiny-base", "tiny-adapter", "merged")   # doctest: +SKIP
        >>> print(plan.describe())   # doctest: +SKIP
    """
    base, problems = path_argument(base, "base")
    many = not isinstance(adapter, (str, bytes, os.PathLike)) and isinstance(adapter, Sequence)
    locations = []
    for i, a in enumerate(adapter if many else [adapter]):
        a, bad = path_argument(a, f"adapter {i + 1}" if many else "adapter")
        locations.append(a)
        problems += bad
    if not locations:
        problems.append("adapter is an empty list; pass at least one adapter folder")
    if problems:  # unreadable path arguments: nothing else can be checked
        raise InputError(problems + check_out_dir(out_dir, inputs={}, overwrite=overwrite))
    out_dir = os.fspath(out_dir) if isinstance(out_dir, os.PathLike) else out_dir
    try:
        resolve_device(device)
    except InputError as e:
        problems += e.problems
    if not isinstance(chunk_elems, int) or chunk_elems <= 0:
        problems.append(f"chunk_elems must be a positive int, got {chunk_elems!r}")
        chunk_elems = DEFAULT_CHUNK_ELEMS
    src = open_checkpoint(base)
    spec = combine_adapters([load_adapter(a) for a in locations], weights, combination)
    inputs = {"base": src.folder, **{"adapter" if len(spec.folders) == 1 else f"adapter {i + 1}": f
                                     for i, f in enumerate(spec.folders)}}
    problems += check_out_dir(out_dir, inputs=inputs, overwrite=overwrite)
    info = inspect_model(src.folder)
    problems += adapter_load_problems(spec, src.folder)  # what PeftModel.from_pretrained would ignore
    if spec.needs_layers:
        from transformers import AutoConfig

        spec.layers = rebuild(spec.folder, spec.config, AutoConfig.from_pretrained(src.folder), None,
                              skip=spec.layer_skip)
    nf4 = Nf4Settings(nf4_quant_type, nf4_blocksize, nf4_double_quant) if base_precision == "nf4" else None
    plan = build_plan(
        src, spec, info,
        dtype=dtype, max_shard_size=max_shard_size, base_precision=base_precision,
        nf4=nf4, chunk_elems=chunk_elems, problems=problems,
    )
    space = check_space(out_dir, plan.total_size + sum(
        os.path.getsize(os.path.join(src.folder, f)) for f in src.extra_files))
    if space:
        raise InputError(space)
    return plan


def check_space(out_dir: str, nbytes: int) -> list[str]:
    """Whether ``out_dir`` can be created and ``nbytes`` written beside it, without writing anything.

    Args:
        out_dir: the output folder (it and its parents may not exist yet).
        nbytes: the bytes the merge will write.

    Returns:
        The problems (read-only or missing-permission parent, not enough free space), each with the fix.

    Raises:
        Nothing.

    Example:
        >>> check_space("/tmp/merged", 1000)
        []
    """
    existing = os.path.dirname(os.path.abspath(out_dir))  # the staging folder and lock live in OUT's parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    folder = existing if os.path.isdir(existing) else os.path.dirname(existing)
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.access(folder, os.W_OK):
        return [f"cannot write in {folder} (read-only or no permission) to create {out_dir}; choose another "
                "output folder"]
    free = shutil.disk_usage(folder).free
    need = nbytes + (1 << 20)
    if free < need:
        return [f"not enough free space for {out_dir}: the merge writes {need / 1e9:.3f} GB and the filesystem of "
                f"{parent if os.path.exists(parent) else folder} has {free / 1e9:.3f} GB free; free some space or "
                "choose another output folder"]
    return []


def merge_checkpoint(
    base: str | os.PathLike,
    adapter: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    weights: Sequence[float] | None = None,
    combination: str = "cat",
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    base_precision: str = "original",
    nf4_quant_type: str = "nf4",
    nf4_blocksize: int = 64,
    nf4_double_quant: bool = True,
    device: str = "auto",
    overwrite: bool = False,
    dry_run: bool = False,
    progress: bool = True,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    before_commit: Callable[[str], None] | None = None,
    resume: bool = True,
) -> MergeReport:
    """Merge a LoRA adapter into a base checkpoint on disk, streaming one row block at a time.

    The output is a transformers checkpoint (``model.safetensors`` or shards with an index, ``config.json``
    without ``quantization_config``, generation and tokenizer files) that ``from_pretrained`` loads as is.
    Peak memory is one row block, whatever the model or shard size. The folder appears only when complete.

    Args:
        base: base checkpoint folder, or a Hub id already in the local Hugging Face cache.
        adapter: PEFT LoRA adapter folder, or a cached Hub id; or a list of them (a weighted combination).
        out_dir: the output folder.
        weights: one weight per adapter (default 1.0 each).
        combination: ``"cat"`` or ``"linear"`` (see :func:`plan_checkpoint_merge`).
        dtype: output dtype; None keeps the base's.
        max_shard_size: largest output shard (decimal units: ``"5GB"`` is 5e9 bytes).
        base_precision: ``"original"`` or ``"nf4"`` (see :func:`plan_checkpoint_merge`).
        nf4_quant_type: ``"nf4"`` or ``"fp4"``.
        nf4_blocksize: 4-bit block size used in training.
        nf4_double_quant: whether training used double quantization.
        device: where the maths runs: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        overwrite: allow replacing a non-empty ``out_dir`` (replaced only after the new one is complete).
        dry_run: plan and check only; nothing is read beyond headers and nothing is written.
        progress: show a progress bar.
        chunk_elems: elements per row block.
        before_commit: called with the temporary output folder before it is checked and moved into place
            (to add files, e.g. ``tokenizer.save_pretrained``).
        resume: when an earlier run of the same merge (same inputs and options) was killed, keep its
            finished and verified shards (``.<OUT>.partial/manifest.json``) and redo the rest.

    Returns:
        A :class:`~peft_shardmerge.report.MergeReport` (``report.summary()`` for a one-screen summary).

    Raises:
        InputError: problems with inputs or options, all reported at once, before anything is written.
        NotFoundError: the base or adapter cannot be found.
        UnsupportedError: the adapter cannot be merged by this version.
        CorruptFileError: a file is malformed.
        MergeCheckError: a consistency check failed after writing; nothing was committed.
        OutputLockedError: another merge is writing ``out_dir``.
        OutputChangedError: ``out_dir`` changed while the merge ran; it was left as it is and the new output
            kept in ``.<OUT>.partial`` (the message says so).
        FileSystemError: the filesystem failed (disk full, I/O error); an ``OSError`` too, whose message says
            what became of ``out_dir``.

    Example:
        >>> from peft_shardmerge import merge_checkpoint
        >>> report = merge_checkpoint("tiny-base", "tiny-adapter", "merged", dtype="bfloat16")  # doctest: +SKIP
        >>> print(report.summary())   # doctest: +SKIP
    """
    try:
        plan = plan_checkpoint_merge(
            base, adapter, out_dir, weights=weights, combination=combination,
            dtype=dtype, max_shard_size=max_shard_size, base_precision=base_precision,
            nf4_quant_type=nf4_quant_type, nf4_blocksize=nf4_blocksize, nf4_double_quant=nf4_double_quant,
            device=device, overwrite=overwrite, chunk_elems=chunk_elems,
        )
    except OSError as e:  # the filesystem failed while reading the inputs: say so in the family, with OUT's state
        if isinstance(e, ShardMergeError):
            raise
        raise FileSystemError(e, NOTHING_WRITTEN) from e
    out_dir = os.path.abspath(os.fspath(out_dir))  # resolved once: every later step uses this path
    for note in plan.notes:
        log.info("%s", note)
    if dry_run:
        return MergeReport(
            out_dir=os.path.abspath(out_dir), base=plan.base.folder, adapter=", ".join(plan.adapter.folders),
            dtype=str(plan.dtype).removeprefix("torch."), base_precision=plan.base_precision,
            tensors_written=0, lora_modules_total=plan.layer_count, shards=list(plan.shard_names),
            notes=list(plan.notes), dry_run=True, plan_text=plan.describe(),
        )
    return execute_plan(plan, out_dir, device=device, progress=progress, before_commit=before_commit, resume=resume,
                        overwrite=overwrite)
