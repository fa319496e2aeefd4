"""What a killed merge left beside OUT: a commit cut short, finished or undone from the journal in the lock's
record, and the filesystem steps a commit is made of (fsync of a folder, writing and removing the staging manifest)."""

from __future__ import annotations

import json
import logging
import os
import stat

from .outfiles import MANIFEST, is_old_name, read_manifest, remove_checked, rename_noreplace
from .outlock import OutputLock

log = logging.getLogger(__name__)


def lstat_or_none(path: str) -> os.stat_result | None:
    """``os.lstat(path)``, or None when nothing is there.

    Args:
        path: any path.

    Returns:
        The stat result (of a link itself, not its target), or None.

    Raises:
        OSError: another error than a missing entry (e.g. permission denied).

    Example:
        >>> lstat_or_none("/nonexistent") is None
        True
    """
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def drop_manifest(folder: str) -> None:
    """Remove the staging manifest (and its temporary file) from ``folder`` and fsync it: what makes a committed
    output an ordinary folder.

    Args:
        folder: a staging folder that became the output.

    Returns:
        None.

    Raises:
        OSError: a manifest is there but cannot be removed.

    Example:
        >>> drop_manifest("/nonexistent")
    """
    for name in (MANIFEST, MANIFEST + ".tmp"):
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    fsync_dir(folder)


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (renames, removals) to disk; a folder that cannot be opened or synced is passed over.

    Args:
        path: the folder.

    Returns:
        None.

    Raises:
        Nothing.

    Example:
        >>> fsync_dir("/nonexistent")
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def recover_commit(out: str, lock: OutputLock) -> None:
    """Finish or undo a commit that a killed merge left half done, from the journal in its lock's record: the
    previous output moved aside is put back (the new one never landed) or emptied of what was checked (it did),
    and the staging manifest is dropped from a new output that landed with it. Nothing the journal does not
    name, or whose inode differs, is touched; the journal is then cleared.

    Args:
        out: the absolute output folder.
        lock: its acquired :class:`~peft_shardmerge.outlock.OutputLock` (``previous`` holds the journal).

    Returns:
        None.

    Raises:
        OSError: a rename or removal the journal asks for fails.

    Example:
        >>> lock = OutputLock("/data/merged"); lock.acquire(); recover_commit("/data/merged", lock)   # doctest: +SKIP
    """
    journal = lock.previous.get("commit")
    if not isinstance(journal, dict):
        return
    st = lstat_or_none(out)
    if st is not None and stat.S_ISDIR(st.st_mode) and st.st_ino == journal.get("staging_ino") \
            and read_manifest(out) is not None:  # the new output landed with its manifest still in it
        drop_manifest(out)
    name = journal.get("old")
    if isinstance(name, str) and is_old_name(out, name) and isinstance(journal.get("snapshot"), dict):
        old = os.path.join(os.path.dirname(out), name)
        st = lstat_or_none(old)
        if st is not None and stat.S_ISDIR(st.st_mode) and (st.st_ino, st.st_dev) == (journal.get("old_ino"),
                                                                                         journal.get("old_dev")):
            if not os.path.lexists(out):
                rename_noreplace(old, out)
                log.warning("a merge killed while replacing %s had moved the previous output to %s; it was put back",
                            out, old)
            else:
                left = remove_checked(old, journal["snapshot"])
                log.warning("a merge killed just after replacing %s left the previous output in %s; %s", out, old,
                            f"what was added to it during that merge is kept there ({', '.join(left[:5])})"
                            if left else "it was removed")
    lock.note(commit=None)


def write_manifest(path: str, data: dict) -> None:
    """Write a staging manifest atomically and durably: a temporary file, fsynced, renamed over ``path``.

    Args:
        path: the manifest's path in a staging folder.
        data: its JSON content.

    Returns:
        None.

    Raises:
        OSError: the filesystem failed.

    Example:
        >>> write_manifest(os.path.join(staging.path, "manifest.rank-1.json"), {})   # doctest: +SKIP
    """
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
