"""What ``overwrite`` may replace in an existing output folder: an earlier output of ours and its model card, no more.

An earlier output is known by its merge record (``merge_manifest.json``), which lists every file it wrote.
"""

from __future__ import annotations

import os

from .files import snapshot

#: what users add to a merged model (or edit in it) that ``overwrite`` replaces with the earlier output: its model card
MODEL_CARD = ("readme.md",)


def not_empty_problems(out: str, shown: str, only_ours: bool) -> list[str]:
    """A non-empty output folder without ``overwrite``: what is there, and whether ``overwrite`` would replace it (the
    hint names it only where it would)."""
    if not only_ours:
        return [f"output folder {shown} is not empty; pass overwrite=True to replace it"]
    refused = replace_problems(out, shown)
    if refused:
        return refused
    listed, _ = _record_listing(out)
    if not listed:  # nothing in it but empty folders
        return [f"output folder {shown} is not empty (it holds empty folders only); pass overwrite=True to replace it"]
    return [
        f"output folder {shown} holds an earlier output of peft-shardmerge; pass overwrite=True to replace it "
        f"({replaced_entries(out)})"
    ]


def replaced_entries(out_dir: str | os.PathLike) -> str:
    """What ``overwrite`` replaces in an earlier output of ours, in words: its files by kind, and a model card added
    or edited since.

    Args:
        out_dir: an output folder :func:`replace_problems` accepts.

    Returns:
        A phrase, e.g. ``"2 shards, 4 other files of the merge and README.md, added after it"``.

    Example:
        >>> import tempfile
        >>> replaced_entries(tempfile.mkdtemp())
        'nothing'
    """
    folder = os.fspath(out_dir)
    listed, changed = _record_listing(folder)
    try:
        found = {rel for rel in snapshot(folder) if rel != "."}
    except OSError:
        found = set()
    top = {rel for rel in found if os.sep not in rel}
    shards = sorted(rel for rel in top & listed if rel.endswith(".safetensors"))
    others = sorted(top & listed - set(shards))
    cards = sorted(rel for rel in top if rel.lower() in MODEL_CARD and (rel not in listed or rel in changed))
    parts = [f"{len(shards)} shard{'s' * (len(shards) != 1)}"] if shards else []
    parts += [f"{len(others)} other file{'s' * (len(others) != 1)} of the merge"] if others else []
    parts += [f"{c}, {'edited' if c in listed else 'added'} after it" for c in cards]
    return " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts) or "nothing"


def replace_problems(out_dir: str | os.PathLike, shown: str | None = None) -> list[str]:
    """Why ``overwrite`` may not replace an existing folder: only an empty folder, or an earlier output of
    peft-shardmerge holding nothing but what its merge record (``merge_manifest.json``) lists, and a model card
    (``README.md``) added or edited since, is ever replaced.

    Args:
        out_dir: the existing output folder.
        shown: how to name it in the message (default: ``out_dir``).

    Returns:
        The problem (what is there, a few names, and how to proceed), or an empty list when it may be replaced.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> replace_problems(folder)
        []
        >>> _ = open(os.path.join(folder, "notes.txt"), "w").write("mine")
        >>> print(replace_problems(folder, "out")[0].split(" and is ")[0])
        output folder out holds files peft-shardmerge did not write (notes.txt)
    """
    folder, shown = os.fspath(out_dir), shown if shown is not None else os.fspath(out_dir)
    try:
        found = snapshot(folder)
    except OSError as e:
        return [
            (
                f"output folder {shown} cannot be read ({e.strerror}); overwrite replaces only a folder it can "
                "check: remove it yourself or choose another output folder"
            )
        ]
    listed, changed = _record_listing(folder)
    ours = set()
    for rel in listed:
        while rel:
            ours.add(rel)
            rel = os.path.dirname(rel)
    foreign = sorted(rel for rel in found if rel != "." and rel not in ours)
    if listed:  # an earlier output of ours: its model card goes with it
        foreign = [rel for rel in foreign if rel.lower() not in MODEL_CARD]
        changed = [rel for rel in changed if rel.lower() not in MODEL_CARD]
    if changed:
        names = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        return [
            (
                f"output folder {shown} holds files changed since peft-shardmerge wrote them ({names}); overwrite "
                "replaces only an empty folder or an earlier output of peft-shardmerge as it wrote it: copy your "
                "changes out (or remove the folder yourself), or choose another output folder"
            )
        ]
    if not foreign:
        return []
    names = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    entries = f"{len(foreign)} {'entry' if len(foreign) == 1 else 'entries'}"
    if not listed:
        return [
            f"output folder {shown} holds files peft-shardmerge did not write ({names}) and is not an output of "
            "peft-shardmerge (no merge_manifest.json of ours); overwrite replaces only an empty folder or an earlier "
            "output of peft-shardmerge: choose another output folder, or move them out"
        ]
    return [
        f"output folder {shown} holds an earlier output of peft-shardmerge and {entries} added after the merge "
        f"that its merge record (merge_manifest.json) does not list ({names}); overwrite replaces that output and "
        "its model card (README.md), nothing else: move the others out, or choose another output folder"
    ]


def _record_listing(folder: str) -> tuple[set[str], list[str]]:
    """The entries an earlier output's merge record names (the record itself included; empty when it has none of
    ours: missing, a link, not JSON, or not our record's format), and those changed since: a side file whose
    SHA-256 differs from the record's, a shard whose size does (shards are not hashed again here)."""
    import json

    from .files import read_regular_file
    from .record import RECORD_FILE, RECORD_FORMAT

    data = read_regular_file(os.path.join(folder, RECORD_FILE))
    try:
        record = json.loads(data) if data is not None else None
    except (ValueError, UnicodeDecodeError):
        return set(), []
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        return set(), []
    listed, changed = {RECORD_FILE}, []
    for key in ("shards", "files"):
        if isinstance(record.get(key), dict):
            for name, entry in record[key].items():
                rel = os.path.normpath(str(name))
                listed.add(rel)
                if isinstance(entry, dict) and _changed(os.path.join(folder, rel), entry, key == "files"):
                    changed.append(rel)
    return listed, sorted(changed)


def _changed(path: str, entry: dict, hashed: bool) -> bool:
    """Whether a file differs from its record entry (its size; for a side file its SHA-256 too)."""
    from .record import file_sha256

    try:
        if not os.path.isfile(path) or os.path.islink(path):
            return False  # gone or not a file: the snapshot's comparison names it
        if "size" in entry and os.path.getsize(path) != entry["size"]:
            return True
        return hashed and "sha256" in entry and file_sha256(path) != entry["sha256"]
    except OSError:
        return True
