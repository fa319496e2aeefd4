"""Which output folders a merge may write: never an input, a protected folder, or one holding a model we did not
write."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from contextlib import suppress

from .files import is_nonempty, name_problems, read_manifest, sidecar, sidecar_problems
from .recovery import finish_killed_commit
from .replace import not_empty_problems, replace_problems, replaced_entries

log = logging.getLogger(__name__)


def check_out_dir(
    out_dir: str | os.PathLike,
    *,
    inputs: dict[str, str | os.PathLike | None],
    overwrite: bool,
    only_ours: bool = True,
) -> list[str]:
    """Find every problem with an output folder, touching nothing.

    ``out_dir`` is resolved once (a trailing slash changes nothing). Refused whatever ``overwrite`` says: an empty
    path, the filesystem root, the current working folder or a folder holding it, the home folder or a folder
    holding it, an input folder, a folder inside an input or holding one, a symlink, a mount point. Also named
    here: a parent that is a file, a parent that cannot be written, a name too long for the staging folder and
    lock beside it, and those names taken by something the merge did not make. A merge about to run calls
    :func:`settle_out_dir` first, which finishes or undoes a commit a killed merge left half done; checking and
    planning never write.

    Args:
        out_dir: the output folder (``str`` or ``os.PathLike``).
        inputs: folders that must survive the merge, by role (``{"base": ..., "adapter": ...}``); None values
            are skipped.
        overwrite: whether a non-empty ``out_dir`` may be replaced: only an earlier output of peft-shardmerge,
            holding nothing its merge record does not list (:func:`replace_problems`).
        only_ours: False lets the caller decide which non-empty folders ``overwrite`` replaces (the Unsloth-style
            saves replace their own earlier saves).

    Returns:
        The problems, each a sentence with the fix; empty when ``out_dir`` is fine. They are returned, never
        raised, so that the caller can report them with others.

    Example:
        >>> for p in check_out_dir("/tmp/base/merged", inputs={"base": "/tmp/base"}, overwrite=False):
        ...     print(p)
        output folder /tmp/base/merged is inside the base folder /tmp/base; choose a folder outside it
        >>> check_out_dir("", inputs={}, overwrite=True)
        ["output folder is an empty path (''); name the folder to create, e.g. ./merged"]
    """
    raw, out, problems, is_input = _path_problems(out_dir, inputs)
    if out is None:
        return problems
    if is_gguf(raw):
        return problems + _gguf_file_problems(raw, out, overwrite)
    if os.path.islink(out):
        if not problems:
            problems.append(
                f"output {raw} is a symlink; the output is staged beside it and renamed into place, "
                f"which would replace the link: pass the real path ({os.path.realpath(out)})"
            )
    elif os.path.ismount(out):
        problems.append(
            f"output {raw} is a mount point; the output is staged beside it and renamed, which cannot "
            "replace a mount point: choose a folder inside it"
        )
    elif os.path.lexists(out):
        if not os.path.isdir(out):
            problems.append(f"output {raw} exists and is not a folder; remove it or choose another path")
        elif not overwrite and not is_input and is_nonempty(out):
            problems += not_empty_problems(out, raw, only_ours)
        elif overwrite and only_ours and not is_input:
            problems += replace_problems(out, raw)
    return problems + sidecar_problems(out)


def is_gguf(out_dir) -> bool:
    """Whether an output path names one GGUF file (it ends in ``.gguf``) rather than a folder.

    Args:
        out_dir: the output path.

    Returns:
        True for a GGUF file.

    Example:
        >>> is_gguf("out/model-Q4_K_M.GGUF"), is_gguf("merged")
        (True, False)
    """
    return isinstance(out_dir, (str, os.PathLike)) and os.fspath(out_dir).rstrip(os.sep).lower().endswith(".gguf")


def _gguf_file_problems(raw: str, out: str, overwrite: bool) -> list[str]:
    """What forbids writing the GGUF file ``out``: a link, a folder, or an existing file without ``overwrite``."""
    if os.path.islink(out):
        return [
            f"output {raw} is a symlink; the GGUF file is staged beside it and renamed into place, which would "
            f"replace the link: pass the real path ({os.path.realpath(out)})"
        ]
    if os.path.isdir(out):
        return [f"output {raw} is a folder; a path ending in .gguf names one GGUF file: remove it or choose another"]
    record = os.path.splitext(out)[0] + ".merge_manifest.json"  # the record written beside the file
    if os.path.lexists(out) and not overwrite:
        return [f"output {raw} exists; pass overwrite=True (--overwrite) to replace it once the new one is complete"]
    if os.path.lexists(record) and not overwrite:
        return [f"{record} exists beside output {raw}; pass overwrite=True (--overwrite) to replace both"]
    if os.path.lexists(out) and not _our_gguf(out, record):
        return [
            f"output {raw} was not written by peft-shardmerge (no merge record beside it names it), so it is not "
            "replaced: remove it yourself, or choose another name"
        ]
    return []


def _our_gguf(out: str, record: str) -> bool:
    """Whether the record beside a GGUF file names it (an earlier output of ours, which ``overwrite`` replaces)."""
    import json

    try:
        with open(record, encoding="utf-8") as f:
            return os.path.basename(out) in (json.load(f).get("files") or {})
    except (OSError, ValueError, AttributeError):
        return False


def settle_out_dir(
    out_dir: str | os.PathLike, *, inputs: dict[str, str | os.PathLike | None], overwrite: bool
) -> None:
    """The one step of a merge about to run that writes before its plan: a commit a merge into ``out_dir`` killed
    outright left half done is finished or undone, and that merge's lock removed
    (:func:`~peft_shardmerge.output.recovery.finish_killed_commit`), so that ``out_dir`` is judged as it is; then,
    with ``overwrite``, what an earlier output there will be replaced by is logged. Nothing happens where the path
    itself is refused (:func:`check_out_dir` names why); a plan or a dry run never calls this.

    Args:
        out_dir: the output folder.
        inputs: the merge's input folders, by role (as :func:`check_out_dir` takes them).
        overwrite: whether the merge may replace an earlier output.

    Example:
        >>> settle_out_dir("", inputs={}, overwrite=False)  # an empty path: refused by the checks, left alone
    """
    raw, out, problems, is_input = _path_problems(out_dir, inputs)
    if out is None or problems or is_gguf(raw):
        return
    finish_killed_commit(out)
    if overwrite and not is_input and os.path.isdir(out) and not os.path.islink(out) and is_nonempty(out):
        if not replace_problems(out, raw):
            log.info(
                "%s: the earlier output there (%s) is replaced once the new one is complete",
                raw,
                replaced_entries(out),
            )


def _path_problems(out_dir, inputs: dict) -> tuple[str | None, str | None, list[str], bool]:
    """``(raw, absolute path or None, problems, is_input)`` of an output path, from its spelling, the inputs and the
    folders around it (never its content): the absolute path is None where the path cannot be taken at all."""
    raw, problems = path_argument(out_dir, "output folder")
    if raw is None:
        return raw, None, problems, False
    if not raw.strip():
        return (
            raw,
            None,
            [f"output folder is an empty path ({raw!r}); name the folder to create, e.g. ./merged"],
            False,
        )
    bad_name = _not_utf8_problem(raw)
    if bad_name:
        return raw, None, [bad_name], False
    out = os.path.abspath(raw)
    real = os.path.realpath(out)
    as_the_system_reads = os.path.realpath(os.path.join(_here() or os.sep, raw))
    if ".." in raw.split(os.sep) and as_the_system_reads != real:
        return (
            raw,
            None,
            [
                f"output folder {raw} has '..' after a symbolic link: the system reads it as {as_the_system_reads}, "
                f"not {out}; pass the path without '..'"
            ],
            False,
        )
    if real == os.sep:
        return (
            raw,
            None,
            [f"output folder {raw} is the filesystem root; name a new folder, e.g. {os.path.join(raw, 'merged')}"],
            False,
        )
    for what, folder in (("the current working folder", _here()), ("your home folder", os.path.expanduser("~"))):
        folder = os.path.realpath(folder) if folder else None
        if folder and (real == folder or folder.startswith(real.rstrip(os.sep) + os.sep)):
            where = "is" if real == folder else "holds"
            return (
                raw,
                None,
                [
                    f"output folder {raw} ({real}) {where} {what}, which the merge would replace; name a new folder, "
                    f"e.g. {os.path.join(raw, 'merged')}"
                ],
                False,
            )
    problems += _unresolved_input_problems(raw, real, inputs)
    is_input = bool(problems)  # an input (or inside one): no overwrite can help, so none is offered
    seen = set()
    for role, folder in _with_link_targets(inputs):
        src = os.path.realpath(os.fspath(folder)) if folder is not None else None
        if src is None or src in seen:
            continue
        seen.add(src)
        if real == src or real.startswith(src.rstrip(os.sep) + os.sep):
            where = "is" if real == src else "is inside"
            problems.append(
                f"output folder {raw} {where} the {role} folder {os.fspath(folder)}; choose a folder outside it"
            )
            is_input = True
        elif src.startswith(real.rstrip(os.sep) + os.sep):
            problems.append(
                f"the {role} folder {os.fspath(folder)} is inside the output folder {raw}; replacing it would destroy "
                f"the {role}; choose another output folder"
            )
    problems += name_problems(out)
    problems += _parent_problems(raw, out)
    return raw, out, problems, is_input


def path_argument(value, what: str) -> tuple[str | None, list[str]]:
    """A path argument as ``str`` (``str``, ``bytes`` and ``os.PathLike`` accepted), or the problem with it.

    Args:
        value: the argument.
        what: its role, for the message.

    Returns:
        ``(path, [])``, or ``(None, [problem])``.

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

    Example:
        >>> source_folders(object())
        {}
    """
    folders: dict[str, str] = {}
    inner = model
    for attr in ("base_model", "model"):  # PeftModel -> LoraModel -> transformers model
        if hasattr(inner, "peft_config") and hasattr(inner, attr):
            inner = getattr(inner, attr)
    candidates = [
        ("model", getattr(getattr(model, "config", None), "_name_or_path", None)),
        ("model", getattr(getattr(inner, "config", None), "_name_or_path", None)),
    ]
    for name, cfg in (getattr(model, "peft_config", None) or {}).items():
        candidates.append((f"base of adapter {name!r}", getattr(cfg, "base_model_name_or_path", None)))
        for attr in ("adapter_path", "model_id"):
            candidates.append((f"adapter {name!r}", getattr(cfg, attr, None)))
    for role, folder in candidates:
        if (
            isinstance(folder, str)
            and folder
            and not os.path.isabs(folder)
            and not os.path.exists(folder)
            and role not in folders
        ):  # relative, loaded from another working folder (or a Hub id)
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

    Example:
        >>> foreign_model_problems("/nonexistent/merged")
        []
    """
    folder = os.fspath(out_dir)
    if (
        not os.path.isdir(folder)
        or os.path.islink(folder)
        or os.path.isfile(os.path.join(folder, "merge_manifest.json"))
    ):
        return []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    held = sorted(
        n for n in names if n == "adapter_config.json" or n.endswith((".safetensors", ".bin", ".pt", ".pth"))
    )
    if not held:
        return []
    return [
        f"output folder {folder} holds a model or adapter that peft-shardmerge did not write "
        f"({', '.join(held[:3])}"
        f"{', ...' if len(held) > 3 else ''}); it may be the one this model was loaded from, so it is never "
        "replaced: choose another folder, or remove it yourself first"
    ]


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
            problems.append(
                f"output folder {raw} may be the {role} folder, recorded as the relative path {name!r} "
                "when the model was loaded (the working folder has changed since); choose another folder"
            )
    return problems


def _not_utf8_problem(raw: str) -> str | None:
    """An output path that is not valid UTF-8 (bytes such as ``b"out\\xff"``, or a ``str`` holding the surrogates
    ``os.fsdecode`` makes of them) cannot be written: safetensors, ``config.json`` and the Hub take UTF-8 names only,
    and the name cannot even be printed. Refused up front, with a UTF-8 name to use instead."""
    full = os.path.join(_here() or os.sep, raw)
    try:
        encoded = os.fsencode(full)
    except UnicodeEncodeError:  # a lone surrogate that no file name can hold
        shown = raw.encode("utf-8", "backslashreplace").decode("utf-8")
        return (
            f"output folder {shown} is not a valid file name (it holds a lone UTF-16 surrogate); pass the name "
            "as UTF-8 text"
        )
    try:
        encoded.decode("utf-8")
    except UnicodeDecodeError:
        shown = os.fsencode(raw).decode("utf-8", "backslashreplace")
        where = "its name" if _utf8(raw) is None else "a folder above it (the working folder or a parent)"
        fix = "".join("_" if "\udc80" <= c <= "\udcff" else c for c in raw) if _utf8(raw) is None else None
        return (
            f"output folder {shown}: {where} is not valid UTF-8 (bytes shown as \\x..); safetensors, config.json "
            "and the Hub need UTF-8 file names, so nothing can be written there; pass a UTF-8 name"
            + (f", e.g. {fix}" if fix else ", in a folder whose path is UTF-8")
        )
    return None


def _utf8(raw: str) -> str | None:
    """``raw`` when it is valid UTF-8 text, else None."""
    try:
        return os.fsencode(raw).decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return None


def _here() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the working folder was deleted
        return None


def _parent_problems(raw: str, out: str) -> list[str]:
    """The nearest existing ancestor of ``out`` must be a folder this process can create entries in."""
    existing = os.path.dirname(out)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [f"cannot create {raw}: {existing} is a file, not a folder; choose another output path"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [
            f"cannot write in {existing} (read-only or no permission) to create {raw}; choose another output folder"
        ]
    return []


def check_space(out_dir: str, nbytes: int) -> list[str]:
    """Whether ``out_dir`` can be created and ``nbytes`` written beside it, without writing anything (the files an
    interrupted run of ours left in the staging folder count as free: see :func:`staged_bytes`).

    Args:
        out_dir: the output folder (it and its parents may not exist yet).
        nbytes: the bytes the merge will write.

    Returns:
        The problems (read-only or missing-permission parent, not enough free space), each with the fix.

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
        return [
            f"cannot write in {folder} (read-only or no permission) to create {out_dir}; choose another output folder"
        ]
    staged = staged_bytes(out_dir)
    free = shutil.disk_usage(folder).free + staged
    need = nbytes + (1 << 20)
    if free < need:
        held = f" (counting the {staged / 1e9:.4g} GB an interrupted run left in {sidecar(out_dir, 'partial')})"
        return [
            f"not enough free space for {out_dir}: the merge writes {need / 1e9:.3f} GB and the filesystem of "
            f"{parent if os.path.exists(parent) else folder} has {free / 1e9:.3f} GB free{held if staged else ''}; "
            "free some space or choose another output folder"
        ]
    return []


def staged_bytes(out_dir: str) -> int:
    """The disk space held by the files of ``out_dir``'s staging folder, where an earlier run of ours left it: the
    next run either keeps a finished shard (and does not write it again) or removes the file, so that space counts as
    free for it.

    Args:
        out_dir: the output folder.

    Returns:
        The bytes allocated to the staging folder's regular files that have no other name (0 where there is no
        such folder or it is not ours; where it cannot be read, what was counted before the error).

    Example:
        >>> staged_bytes("/tmp/never-merged-here")
        0
    """
    path = sidecar(out_dir, "partial")
    total = 0
    try:
        if not os.path.isdir(path) or os.path.islink(path) or read_manifest(path) is None:
            return 0
        with os.scandir(path) as entries:
            for entry in entries:
                with suppress(FileNotFoundError):  # another run of ours renamed or removed it meanwhile
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:  # a linked file frees nothing when removed
                        total += st.st_blocks * 512
    except OSError:  # unreadable: no credit (what was counted stands); the merge itself reports the folder
        pass
    return total
