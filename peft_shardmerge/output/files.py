"""Safe operations on the output folder and the names beside it: checks, snapshots, exclusive renames, removal of
only what was checked, and signals held back during the steps that must not be cut in half."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import signal
import stat
import threading
from contextlib import contextmanager, suppress
from typing import Iterator

MADE_BY = "peft-shardmerge"
MANIFEST = "manifest.json"
#: the file that marks a push's staging folder as one a push of ours made (the only kind it empties or removes)
PUSH_MARK = ".peft-shardmerge-push"
#: the longest name put beside OUT: ``.<name>.old-`` and 8 hex digits
_LONGEST_SUFFIX = len("..old-") + 8


def sidecar(out_dir: str, suffix: str) -> str:
    """The path ``.<name>.<suffix>`` beside ``out_dir`` (a trailing slash on ``out_dir`` changes nothing).

    Args:
        out_dir: the output folder.
        suffix: ``"partial"``, ``"lock"`` or ``"old-<hex>"``.

    Returns:
        The absolute path.

    Example:
        >>> sidecar("/data/merged/", "lock")
        '/data/.merged.lock'
    """
    parent, name = os.path.split(os.path.abspath(os.fspath(out_dir)))
    return os.path.join(parent, f".{name}.{suffix}")


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:  # missing, a file as a parent, a name too long (named by name_problems)
        return None


def name_problems(out: str) -> list[str]:
    """Whether the names the merge puts beside ``out`` fit the filesystem's limits.

    Args:
        out: the absolute output path.

    Returns:
        The problems (a name too long, a path too long), each with the fix; empty when the names fit.

    Example:
        >>> name_problems("/tmp/" + "x" * 250)[0][:24]
        'output folder name xxxxx'
    """
    parent, name = os.path.split(out)
    existing = parent
    while existing and not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    try:
        name_max = os.pathconf(existing or "/", "PC_NAME_MAX")
        path_max = os.pathconf(existing or "/", "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    longest = len(name.encode(errors="surrogateescape")) + _LONGEST_SUFFIX
    if longest > name_max:
        return [
            f"output folder name {name[:20]}... is {len(name.encode(errors='surrogateescape'))} bytes long: the "
            f"staging folder and lock beside it (.{name[:10]}....partial) need {longest} bytes, more than this "
            f"filesystem's {name_max}; choose a name of at most {name_max - _LONGEST_SUFFIX} bytes"
        ]
    if len(out.encode(errors="surrogateescape")) + _LONGEST_SUFFIX + 1 >= path_max:
        return [
            f"output path {out[:40]}... is too long ({len(out)} bytes, the limit is {path_max}); choose a shorter path"
        ]
    return []


def read_manifest(folder: str, name: str = MANIFEST) -> dict | None:
    """The manifest of a staging folder, only when it is provably ours: a regular file (not a link) owned by
    this user, holding JSON that names peft-shardmerge (or has exactly the two keys earlier versions wrote).

    Args:
        folder: the staging folder.
        name: the manifest's file name (a rank of a distributed merge records its shards in its own).

    Returns:
        The manifest, or None.

    Example:
        >>> read_manifest("/nonexistent") is None
        True
    """
    manifest = _own_manifest(os.path.join(folder, name))
    first = False
    with suppress(OSError):  # a merge killed between fsyncing a new staging folder's first manifest and renaming it
        first = manifest is None and name == MANIFEST and os.listdir(folder) == [MANIFEST + ".tmp"]
    return _own_manifest(os.path.join(folder, MANIFEST + ".tmp")) if first else manifest


def read_regular_file(path: str, *, own: bool = False, limit: int = 64 << 20) -> bytes | None:
    """The bytes of a regular file, opened without following a link; None for anything else.

    Args:
        path: the file.
        own: also require it to belong to this user.
        limit: the largest size read (a larger file gives None).

    Returns:
        Its content, or None when it is missing, a link, not a regular file, someone else's (``own``) or too large.

    Example:
        >>> read_regular_file("/nonexistent") is None
        True
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (own and st.st_uid != os.geteuid()) or st.st_size > limit:
            return None
        data = b""
        while len(data) < st.st_size:
            piece = os.read(fd, st.st_size - len(data))
            if not piece:
                break
            data += piece
    except OSError:
        return None
    finally:
        os.close(fd)
    return data


def _own_manifest(path: str) -> dict | None:
    data = read_regular_file(path, own=True)
    if data is None:
        return None
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    ours = isinstance(manifest, dict) and (  # or an earlier version's
        manifest.get("made_by") == MADE_BY or set(manifest) == {"fingerprint", "shards"}
    )
    return manifest if ours else None


def lock_record_is_ours(data: bytes) -> bool:
    """Whether the bytes of an existing ``.<OUT>.lock`` were written by peft-shardmerge (or are empty: a lock
    file just created by another merge that has not written its record yet)."""
    if not data or data.startswith(b'{"made_by": "' + MADE_BY.encode() + b'"'):
        return True
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(record, dict) and set(record) >= {"pid", "host", "started"}  # written by earlier versions


def sidecar_problems(out: str) -> list[str]:
    """What stands in the way of the staging folder and the lock beside ``out``, without touching anything.

    A symlink, a non-folder, or a folder we cannot prove we made (no manifest of ours inside, not empty) under
    the staging folder's name, and a link, non-regular, hard-linked or foreign file under the lock's name, are
    refused: the merge never follows, empties or deletes them.

    Args:
        out: the absolute output path.

    Returns:
        The problems, each with the fix.

    Example:
        >>> sidecar_problems("/nonexistent/merged")
        []
    """
    problems, partial, lock = [], sidecar(out, "partial"), sidecar(out, "lock")
    st = _lstat(partial)
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            problems.append(
                f"{partial} is a symlink (to {os.readlink(partial)}); the merge stages its output under "
                "that name and never follows a link it did not make: remove the link or choose another "
                "output folder"
            )
        elif not stat.S_ISDIR(st.st_mode):
            problems.append(
                f"{partial} exists and is not a folder; the merge stages its output under that name: "
                "remove it or choose another output folder"
            )
        elif read_manifest(partial) is None and is_nonempty(partial):
            problems.append(
                f"{partial} exists, is not empty and was not made by peft-shardmerge (no manifest of "
                "ours inside); the merge never deletes what it did not make: move it away or choose "
                "another output folder"
            )
    st = _lstat(lock)
    if st is not None:
        why = None
        if stat.S_ISLNK(st.st_mode):
            why = f"is a symlink (to {os.readlink(lock)})"
        elif not stat.S_ISREG(st.st_mode):
            why = "is not a regular file"
        elif st.st_nlink != 1:
            why = f"has {st.st_nlink} hard links"
        elif st.st_uid != os.geteuid():
            why = "belongs to another user"
        else:
            try:
                with open(lock, "rb") as f:
                    if not lock_record_is_ours(f.read(1 << 20)):
                        why = "holds data that peft-shardmerge did not write"
            except OSError as e:
                why = f"cannot be read ({e.strerror})"
        if why:
            problems.append(
                f"{lock} {why}; the merge takes its lock under that name and never writes into a file "
                "it did not make: remove it or choose another output folder"
            )
    return problems


def is_nonempty(folder: str) -> bool:
    """Whether ``folder`` holds anything; a folder that cannot be listed counts as holding something (it is never
    taken for empty, so never replaced or reused unseen).

    Args:
        folder: the folder.

    Returns:
        True when it has an entry or cannot be listed.

    Example:
        >>> is_nonempty("/nonexistent")
        True
    """
    try:
        return bool(os.listdir(folder))
    except OSError:
        return True


def snapshot(folder: str) -> dict[str, list[int]]:
    """What a folder holds, without following links: relative path -> ``[mode, size, mtime_ns, inode]``
    (``[mode, inode]`` for folders, whose times change with their entries).

    Args:
        folder: the folder (``"."`` in the result is the folder itself).

    Returns:
        The snapshot.

    Raises:
        OSError: the folder cannot be listed.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> os.mkdir(os.path.join(folder, "sub"))
        >>> _ = open(os.path.join(folder, "sub", "a.txt"), "w").write("hi")
        >>> snap = snapshot(folder)
        >>> sorted(snap), len(snap["sub"]), snap[os.path.join("sub", "a.txt")][1]
        (['.', 'sub', 'sub/a.txt'], 2, 2)
    """
    out: dict[str, list[int]] = {}

    def visit(rel: str) -> None:
        path = os.path.join(folder, rel) if rel != "." else folder
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            out[rel] = [st.st_mode, st.st_ino]
            for entry in sorted(os.listdir(path)):
                visit(entry if rel == "." else os.path.join(rel, entry))
        else:
            out[rel] = [st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino]

    visit(".")
    return out


def describe_change(before: dict, after: dict) -> str:
    """A short account of how a folder changed between two snapshots (what was added, removed or modified)."""
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k] and k != ".")
    parts = [
        f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
        for label, names in (("added", added), ("removed", removed), ("modified", changed))
        if names
    ]
    return "; ".join(parts) or "replaced by another folder"


def remove_checked(folder: str, snap: dict[str, list[int]]) -> list[str]:
    """Delete what ``snap`` recorded in ``folder`` and nothing else: an entry is removed only while it is still
    the same file (mode, size, time, inode), folders only once empty, links as links.

    Args:
        folder: the folder.
        snap: its snapshot from :func:`snapshot`.

    Returns:
        What is left (relative paths), empty when the folder itself is gone.

    Example:
        >>> remove_checked("/nonexistent", {})
        []
    """
    for rel in sorted(snap, key=lambda r: (r == ".", -r.count(os.sep), r), reverse=False):
        path = folder if rel == "." else os.path.join(folder, rel)
        st = _lstat(path)
        if st is None:
            continue
        if stat.S_ISDIR(st.st_mode):
            if [st.st_mode, st.st_ino] == snap[rel]:
                try:
                    os.rmdir(path)
                except OSError:
                    pass
                kill_point("remove old output: rmdir")
        elif [st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino] == snap[rel]:
            try:
                os.unlink(path)
            except OSError:
                pass
            kill_point("remove old output: unlink")
    if _lstat(folder) is None:
        return []
    try:
        return sorted(snapshot(folder).keys() - {"."})
    except OSError:
        return ["."]


_RENAME_NOREPLACE = 1
_libc = None


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` only if ``dst`` does not exist (``renameat2(RENAME_NOREPLACE)`` where the kernel has
    it, else a check just before ``rename``).

    Args:
        src: what to move.
        dst: where.

    Raises:
        FileExistsError: ``dst`` exists (as anything, a link or an empty folder included).
        OSError: the rename failed.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> a, b = os.path.join(folder, "a"), os.path.join(folder, "b")
        >>> for path in (a, b):
        ...     _ = open(path, "w").write(path)
        >>> rename_noreplace(a, b)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        FileExistsError: [Errno 17] File exists: '.../b'
        >>> os.remove(b); rename_noreplace(a, b); os.listdir(folder)
        ['b']
    """
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2  # raises AttributeError where glibc lacks it
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        at_fdcwd = -100
        if _libc.renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):  # the filesystem or kernel lacks the flag: fall back below
            raise (
                OSError(err, os.strerror(err), src, None, dst)
                if err != errno.EEXIST
                else FileExistsError(err, os.strerror(err), dst)
            )
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


#: how many times this process passed each named step since :func:`kill_point_reset` (for the test hook)
_PASSED: dict[str, int] = {}


def kill_point(step: str) -> None:
    """A test hook after each step of a commit (every unlink, rename, rmdir, fsync of it): with
    ``PEFT_SHARDMERGE_KILL_AT=<step>#<n>`` in the environment, the process SIGKILLs itself right after passing
    ``step`` for the n-th time; with ``PEFT_SHARDMERGE_STEPS=<file>``, every step passed is appended to that file as
    ``<step>#<n>``. Without either variable it does nothing.

    Args:
        step: the step just done, e.g. ``"commit: rename new output into place"``.

    Returns:
        None.

    Example:
        >>> kill_point("commit: journal written")
    """
    kill, trace = os.environ.get("PEFT_SHARDMERGE_KILL_AT"), os.environ.get("PEFT_SHARDMERGE_STEPS")
    if not kill and not trace:
        return
    _PASSED[step] = _PASSED.get(step, 0) + 1
    name = f"{step}#{_PASSED[step]}"
    if trace:
        with open(trace, "a") as f:
            f.write(name + "\n")
    if kill == name:
        os.kill(os.getpid(), signal.SIGKILL)


def kill_point_reset() -> None:
    """Start counting the steps of :func:`kill_point` afresh (at the start of each commit)."""
    _PASSED.clear()


_OLD_NAME = re.compile(r"\.(?P<name>.+)\.old-[0-9a-f]{8}$")


def is_old_name(out: str, name: str) -> bool:
    """Whether ``name`` is a name this package gives a previous output of ``out`` while replacing it."""
    m = _OLD_NAME.fullmatch(name)
    return bool(m) and m.group("name") == os.path.basename(out)


@contextmanager
def held_signals(deliver: bool = True) -> Iterator[list[int]]:
    """Hold back SIGINT and SIGTERM for the block; a signal that arrives meanwhile is delivered at its end.

    Only the main thread receives Python signal handlers, so elsewhere the block runs as is.

    Args:
        deliver: deliver a held signal at the end; False: only note it (the block's work, once done, is the end of
            what the signal would stop).

    Returns:
        A context manager yielding the signals held so far (a list that grows as they arrive).

    Raises:
        Whatever the held signal's handler raises (KeyboardInterrupt, ...), at the end of the block.

    Example:
        >>> with held_signals():
        ...     pass
    """
    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, lambda signum, frame: pending.append(signum))
        except (ValueError, OSError):
            pass
    try:
        yield pending
    finally:
        for sig, handler in previous.items():
            # None: a handler installed from C, which Python cannot reinstall; the default is the nearest
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if pending and deliver:
            signal.raise_signal(pending[0])
