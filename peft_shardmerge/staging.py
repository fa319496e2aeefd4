"""The output folder's life: the lock, the staging folder with its resume manifest, and the atomic commit."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

from .errors import MergeCheckError, ShardMergeError
from .safetensors_io import read_header
from .writer import Crc32

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_HASH_PIECE = 8 << 20


class OutputLockedError(ShardMergeError, RuntimeError):
    """Another merge is writing the same output folder right now."""


def _sidecar(out_dir: str, suffix: str) -> str:
    parent, name = os.path.split(os.path.abspath(out_dir))
    return os.path.join(parent, f".{name}.{suffix}")


def partial_dir(out_dir: str) -> str:
    """The staging folder of ``out_dir``: ``.<name>.partial`` beside it (same filesystem, so the commit is a
    rename).

    Args:
        out_dir: the output folder.

    Returns:
        The staging folder's path.

    Raises:
        Nothing.

    Example:
        >>> partial_dir("/data/merged")
        '/data/.merged.partial'
    """
    return _sidecar(out_dir, "partial")


def file_digest(path: str) -> str:
    """The CRC-32 hex digest of a file, read in 8 MiB pieces (what :class:`ShardWriter` computes while writing).

    Args:
        path: the file.

    Returns:
        8 hex characters.

    Raises:
        OSError: the file cannot be read.

    Example:
        >>> file_digest("model.safetensors")   # doctest: +SKIP
        '3f2a…'
    """
    h = Crc32()
    with open(path, "rb") as f:
        while True:
            piece = f.read(_HASH_PIECE)
            if not piece:
                return h.hexdigest()
            h.update(piece)


@contextmanager
def output_lock(out_dir: str) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` (a ``flock`` on ``.<name>.lock`` beside it) for the block.

    The kernel drops the lock when its holder dies, so a lock file left by a killed merge is taken over.

    Args:
        out_dir: the output folder.

    Returns:
        A context manager.

    Raises:
        OutputLockedError: another live process holds the lock; the message names it.
        OSError: the lock file cannot be created (e.g. a read-only parent folder).

    Example:
        >>> with output_lock("merged"):   # doctest: +SKIP
        ...     pass
    """
    path = _sidecar(out_dir, "lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            except (ValueError, UnicodeDecodeError):
                holder = {}
            os.close(fd)
            raise OutputLockedError(
                f"another merge is writing {out_dir}: pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
                f"started {holder.get('started', '?')}; wait for it to finish or choose another output folder"
            ) from None
        # the holder before us unlinks the file on release: make sure we locked the file that is still there
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    previous = os.pread(fd, 4096, 0)
    if previous:
        log.info("taking over a stale lock on %s (%s)", out_dir, previous.decode(errors="replace").strip())
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
    try:
        yield
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.close(fd)


class Staging:
    """A staging folder for ``out_dir`` that remembers finished shards across a crash.

    With a ``fingerprint`` (a digest of the inputs and options), shards recorded in ``manifest.json`` by an
    earlier run that died (SIGKILL, power loss) are kept when their size and digest still match, and the
    rest is redone. A different fingerprint, or none, starts from an empty folder.

    Args:
        out_dir: the final folder.
        fingerprint: identity of the merge; None disables resuming.

    Example:
        >>> with staged_output("merged", fingerprint="abc") as st:   # doctest: +SKIP
        ...     st.is_done("model-00001-of-00002.safetensors")
        False
    """

    def __init__(self, out_dir: str, fingerprint: str | None):
        self.out_dir = os.path.abspath(out_dir)
        self.path = partial_dir(out_dir)
        self.fingerprint = fingerprint
        self.done: dict[str, dict] = {}
        self.resumed: list[str] = []
        self.committed = False

    def open(self) -> None:
        """Create the staging folder, or reuse the verified finished shards of a matching earlier run."""
        kept: dict[str, dict] = {}
        if os.path.isdir(self.path) and self.fingerprint is not None:
            try:
                with open(os.path.join(self.path, MANIFEST)) as f:
                    manifest = json.load(f)
            except (OSError, ValueError):
                manifest = {}
            if manifest.get("fingerprint") == self.fingerprint:
                for fname, meta in (manifest.get("shards") or {}).items():
                    p = os.path.join(self.path, os.path.basename(fname))
                    if (os.path.isfile(p) and os.path.getsize(p) == meta.get("size")
                            and file_digest(p) == meta.get("digest")):
                        kept[fname] = meta
        if os.path.isdir(self.path):
            for entry in os.listdir(self.path):
                if entry not in kept:
                    p = os.path.join(self.path, entry)
                    shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        else:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            os.mkdir(self.path)
        self.done = kept
        self.resumed = sorted(kept)
        if kept:
            log.info("resuming: %d finished shard(s) kept from an interrupted run", len(kept))
        self._write_manifest()

    def is_done(self, fname: str) -> bool:
        """Whether shard ``fname`` was finished and verified by an earlier run."""
        return fname in self.done

    def record(self, fname: str, digest: str) -> None:
        """Record a finished, fsynced shard in the manifest (written atomically)."""
        size = os.path.getsize(os.path.join(self.path, fname))
        self.done[fname] = {"size": size, "digest": digest}
        self._write_manifest()

    def _write_manifest(self) -> None:
        if self.fingerprint is None:
            return
        tmp = os.path.join(self.path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"fingerprint": self.fingerprint, "shards": self.done}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, MANIFEST))
        _fsync_dir(self.path)

    def commit(self) -> None:
        """Drop the manifest and move the staging folder into place (replacing an old ``out_dir`` only now)."""
        for name in (MANIFEST, MANIFEST + ".tmp"):
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass
        _fsync_dir(self.path)
        parent, name = os.path.split(self.out_dir)
        if os.path.lexists(self.out_dir):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rmdir(old)
            os.rename(self.out_dir, old)
            try:
                os.rename(self.path, self.out_dir)
            except BaseException:
                os.rename(old, self.out_dir)
                raise
            self.committed = True
            try:  # the new output is in place: removing the old one is best effort, even when interrupted
                shutil.rmtree(old)
            except BaseException as e:  # noqa: BLE001
                log.warning("the previous output was replaced but %s could not be removed (%s); delete it", old, e)
        else:
            os.rename(self.path, self.out_dir)
            self.committed = True
        _fsync_dir(parent)

    def discard(self) -> None:
        """Remove the staging folder."""
        shutil.rmtree(self.path, ignore_errors=True)


def _fsync_dir(path: str) -> None:
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


@contextmanager
def staged_output(out_dir: str, *, fingerprint: str | None = None, overwrite: bool = True) -> Iterator[Staging]:
    """Lock ``out_dir``, yield its :class:`Staging`, and move it into place when the block succeeds.

    On any exception (KeyboardInterrupt and SIGTERM included) the staging folder is removed and ``out_dir`` is
    left as it was. Only a process killed outright leaves the staging folder, for the next run to resume.

    Args:
        out_dir: the final folder.
        fingerprint: identity of the merge, for resuming; None starts fresh every time.
        overwrite: whether a non-empty ``out_dir`` may be replaced (checked again under the lock, in case another
            merge finished in between).

    Returns:
        A context manager yielding the :class:`Staging` (its ``path`` is where to write).

    Raises:
        OutputLockedError: another merge is writing ``out_dir``.
        InputError: ``out_dir`` became non-empty and ``overwrite`` is False.
        OSError: the parent folder cannot be created or written.

    Example:
        >>> with staged_output("merged") as st:   # doctest: +SKIP
        ...     open(os.path.join(st.path, "config.json"), "w").write("{}")
    """
    with output_lock(out_dir):
        if not overwrite and os.path.isdir(out_dir) and os.listdir(out_dir):
            from .errors import InputError

            raise InputError(f"output folder {out_dir} is not empty (another merge finished there meanwhile); "
                             "pass --overwrite (overwrite=True) to replace it")
        staging = Staging(out_dir, fingerprint)
        staging.open()
        try:
            yield staging
            staging.commit()
        except BaseException:
            if not staging.committed:
                staging.discard()
            raise


def check_written(folder: str, shards: list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]) -> None:
    """Read back every written shard's header and compare it with what was planned.

    Args:
        folder: where the shards are.
        shards: ``(file name, [(tensor name, dtype, shape), ...])`` per shard, in write order.

    Returns:
        None.

    Raises:
        MergeCheckError: a header differs from the plan or lacks ``{"format": "pt"}``.
        CorruptFileError: a written file is not valid safetensors.

    Example:
        >>> check_written(tmp, [("model.safetensors", [("w", "F32", (2,))])])   # doctest: +SKIP
    """
    for shard_name, want in shards:
        infos, meta = read_header(os.path.join(folder, shard_name))
        got = [(t.name, t.dtype, t.shape) for t in infos]
        if got != [(n, d, tuple(s)) for n, d, s in want] or meta.get("format") != "pt":
            raise MergeCheckError(f"{shard_name}: written header does not match the plan")
