"""What a killed merge left beside OUT: a commit cut short, finished or undone from the journal in the lock's
record, and the filesystem steps a commit is made of (fsync of a folder, writing and removing the staging manifest)."""

from __future__ import annotations

import json
import logging
import os
import stat

from ..errors import ShardMergeError
from .files import (
    MANIFEST,
    held_signals,
    is_old_name,
    kill_point,
    read_manifest,
    remove_checked,
    rename_noreplace,
    sidecar,
)
from .lock import OutputLock

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
        kill_point(f"drop manifest: unlink {name}")
    fsync_dir(folder)
    kill_point("drop manifest: fsync folder")


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (renames, removals) to disk; a folder that cannot be opened or synced is passed over.

    Args:
        path: the folder.

    Returns:
        None.

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
    """Finish or undo a commit that a killed merge left half done, from the journal in its lock's record.

    The journal is written once the new output is complete and checked; then the staging manifest leaves the staging
    folder (the journal keeps it), the previous OUT is renamed aside, the new one renamed into place, the previous
    one emptied of what was checked. When the new output landed, what is left of the previous one is removed (only
    what was checked); when it did not, the previous output is put back and the staging folder gets its manifest
    again, so that the next run reuses its finished shards. Nothing the journal does not name, or whose inode
    differs, is touched. Every step can be cut by a kill and done again; the journal is cleared last.

    Args:
        out: the absolute output folder.
        lock: its acquired :class:`~peft_shardmerge.output.lock.OutputLock` (``previous`` holds the journal).

    Returns:
        None.

    Raises:
        OSError: a rename or removal the journal asks for fails.

    Example:
        >>> import tempfile
        >>> out = os.path.join(tempfile.mkdtemp(), "merged")
        >>> lock = OutputLock(out); lock.acquire(); recover_commit(out, lock); lock.release()
    """
    journal = lock.previous.get("commit")
    if not isinstance(journal, dict):
        return
    st = lstat_or_none(out)
    landed = st is not None and stat.S_ISDIR(st.st_mode) and st.st_ino == journal.get("staging_ino")
    if landed and read_manifest(out) is not None:  # an earlier version moved the manifest with the folder
        drop_manifest(out)
    staging = sidecar(out, "partial")
    sst = lstat_or_none(staging)
    if (
        not landed
        and sst is not None
        and stat.S_ISDIR(sst.st_mode)
        and sst.st_ino == journal.get("staging_ino")
        and read_manifest(staging) is None
        and isinstance(journal.get("manifest"), dict)
    ):
        write_manifest(os.path.join(staging, MANIFEST), journal["manifest"])  # resumable again
        kill_point("recover: staging manifest restored")
    name = journal.get("old")
    if isinstance(name, str) and is_old_name(out, name) and isinstance(journal.get("snapshot"), dict):
        old = os.path.join(os.path.dirname(out), name)
        ost = lstat_or_none(old)
        if (
            ost is not None
            and stat.S_ISDIR(ost.st_mode)
            and (ost.st_ino, ost.st_dev) == (journal.get("old_ino"), journal.get("old_dev"))
        ):
            if not landed and st is None:
                rename_noreplace(old, out)
                fsync_dir(os.path.dirname(out))
                kill_point("recover: previous output put back")
                log.warning(
                    "a merge killed while replacing %s had moved the previous output to %s; it was put back", out, old
                )
            elif landed:
                left = remove_checked(old, journal["snapshot"])
                log.warning(
                    "a merge killed just after replacing %s left the previous output in %s; %s",
                    out,
                    old,
                    f"what was added to it during that merge is kept there ({', '.join(left[:5])})"
                    if left
                    else "it was removed",
                )
    lock.note(commit=None)
    kill_point("recover: journal cleared")


def finish_killed_commit(out: str) -> None:
    """Before OUT is judged: when a merge into it was killed, finish or undo its commit (:func:`recover_commit`) and
    remove the lock it left, so that OUT is either the previous or the new complete output and nothing of a dead
    merge's lock stays beside it, even when this run is then refused. A lock held by a live merge, or anything under
    the lock's name that is not provably ours (:meth:`~peft_shardmerge.output.lock.OutputLock.acquire` refuses it
    without writing), is left alone: the checks name it. Nothing is raised: what cannot be recovered now is left
    for the merge itself, which names it.

    Args:
        out: the absolute output folder.

    Example:
        >>> finish_killed_commit("/nonexistent/merged")
    """
    if not os.path.lexists(sidecar(out, "lock")):
        return
    lock = OutputLock(out)
    try:
        with held_signals():
            lock.acquire()
    except (ShardMergeError, OSError):
        return
    try:
        with held_signals():
            recover_commit(out, lock)
    except OSError as e:
        log.warning("a commit into %s cut short by a kill could not be finished yet: %s", out, e)
    finally:
        with held_signals():
            lock.release()


def write_manifest(path: str, data: dict) -> None:
    """Write a staging manifest atomically and durably: a temporary file, fsynced, renamed over ``path``.

    Args:
        path: the manifest's path in a staging folder.
        data: its JSON content.

    Raises:
        OSError: the filesystem failed.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "manifest.json")
        >>> write_manifest(path, {"done": ["model.safetensors"]})
        >>> open(path).read(), os.listdir(os.path.dirname(path))
        ('{"done": ["model.safetensors"]}', ['manifest.json'])
    """
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(data))  # json.dump's encoder, written in Python, leaves reference cycles behind each call
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
