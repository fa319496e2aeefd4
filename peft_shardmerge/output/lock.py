"""The output folder's lock: an exclusive ``flock`` on ``.<OUT>.lock``, created without following links, whose
record names the holder and journals a commit in progress."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import stat
import time
from contextlib import contextmanager
from typing import Iterator

from ..errors import InputError, OutputLockedError
from .files import MADE_BY, held_signals, kill_point, lock_record_is_ours, sidecar

log = logging.getLogger(__name__)


class OutputLock:
    """An exclusive ``flock`` on ``.<name>.lock`` beside the output, created without following links; its record
    (pid, host, start, and during a commit a journal of it) tells the next merge what a killed one left.

    Args:
        out_dir: the output folder.
    """

    def __init__(self, out_dir: str):
        self.out_dir = os.fspath(out_dir)
        self.path = sidecar(out_dir, "lock")
        self.fd: int | None = None
        self.previous: dict = {}
        self.record: dict = {}

    def _refuse(self, why: str) -> InputError:
        return InputError(
            f"{self.path} {why}; the merge takes its lock under that name and never writes into a file "
            "it did not make: remove it or choose another output folder"
        )

    def acquire(self) -> None:
        """Take the lock (see :func:`output_lock`)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            try:
                fd, created = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(self.path, flags), False
                except FileNotFoundError:
                    continue  # released and removed in between: create it
                except OSError as e:
                    raise self._refuse(
                        "is a symlink" if os.path.islink(self.path) else f"cannot be opened ({e.strerror})"
                    ) from None
                st = os.fstat(fd)
                why = (
                    "is not a regular file"
                    if not stat.S_ISREG(st.st_mode)
                    else f"has {st.st_nlink} hard links"
                    if st.st_nlink != 1
                    else "belongs to another user"
                    if st.st_uid != os.geteuid()
                    else None
                )
                if why:
                    os.close(fd)
                    raise self._refuse(why)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _parse(_read_all(fd))
                os.close(fd)
                raise OutputLockedError(
                    f"another merge is writing {self.out_dir}: pid {holder.get('pid', '?')} on "
                    f"{holder.get('host', '?')}, started {holder.get('started', '?')}; wait for it to finish "
                    "or choose another output folder"
                ) from None
            # the holder before us unlinks the file on release: make sure we locked the file that is still there
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = b"" if created else _read_all(fd)
            if not lock_record_is_ours(previous):
                os.close(fd)
                raise self._refuse("holds data that peft-shardmerge did not write")
            break
        self.fd = fd
        self.previous = _parse(previous)
        if previous:
            who = self.previous if isinstance(self.previous, dict) else {}
            log.info(
                "%s: the lock of a merge that stopped (pid %s, started %s) is taken over",
                self.out_dir,
                who.get("pid", "?"),
                who.get("started", "at an unknown time"),
            )
            log.debug("the stale lock held: %s", previous[:200].decode(errors="replace"))
        self.record = {
            "made_by": MADE_BY,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        self._write()

    def note(self, **fields) -> None:
        """Add ``fields`` to the lock's record (``None`` removes one), durably."""
        for k, v in fields.items():
            if v is None:
                self.record.pop(k, None)
            else:
                self.record[k] = v
        self._write()

    def _write(self) -> None:
        data = json.dumps(self.record).encode()  # starts with '{"made_by": "peft-shardmerge"' (insertion order)
        os.pwrite(self.fd, data, 0)
        kill_point("lock record: written, not yet truncated")  # a shorter record is read up to its end (_parse)
        os.ftruncate(self.fd, len(data))
        os.fsync(self.fd)

    def release(self) -> None:
        """Remove the lock file (when it is still ours) and release the lock."""
        if self.fd is None:
            return
        try:
            if os.lstat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
                kill_point("release: unlink lock")
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, min(size, 64 << 20), 0)


def _parse(data: bytes) -> dict:
    """The lock's record: the JSON object at its start (a kill between writing a shorter record and truncating the
    file leaves the end of the longer one after it)."""
    try:
        record = json.JSONDecoder().raw_decode(data.decode() or "{}")[0]
    except (ValueError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


@contextmanager
def output_lock(out_dir: str) -> Iterator[OutputLock]:
    """Hold an exclusive lock on ``out_dir`` (a ``flock`` on ``.<name>.lock`` beside it) for the block.

    The lock file is created with ``O_EXCL | O_NOFOLLOW``; an existing one is taken over only when it is a regular
    file with one link, owned by this user, holding a record peft-shardmerge wrote (the kernel drops a ``flock``
    when its holder dies, so a lock file left by a killed merge is taken over). Anything else under that name
    is refused, never written.

    Args:
        out_dir: the output folder.

    Returns:
        A context manager yielding the :class:`OutputLock`.

    Raises:
        OutputLockedError: another live process holds the lock; the message names it.
        InputError: the lock's name is taken by a link or a file peft-shardmerge did not write.
        OSError: the lock file cannot be created (e.g. a read-only parent folder).

    Example:
        >>> import tempfile
        >>> out = os.path.join(tempfile.mkdtemp(), "merged")
        >>> with output_lock(out):
        ...     os.listdir(os.path.dirname(out))
        ['.merged.lock']
        >>> os.listdir(os.path.dirname(out))
        []
    """
    lock = OutputLock(out_dir)
    with held_signals():
        lock.acquire()
    try:
        yield lock
    finally:
        with held_signals():
            lock.release()
