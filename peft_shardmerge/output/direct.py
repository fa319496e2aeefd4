"""A shard's tensor bytes written past the page cache (``O_DIRECT``) on the local filesystems known to take it: the
whole aligned blocks of each write straight to the disk, the blocks two writes share assembled in memory first."""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from ..errors import MergeCheckError

#: the alignment of a direct write's offset, length and buffer: the page size, a multiple of every logical block size
#: Linux's local filesystems use
ALIGN = 4096
#: filesystems whose direct writes are used (an allowlist: on others, FUSE and network filesystems among them, a direct
#: write may be refused, slow, or cached all the same)
DIRECT_FILESYSTEMS = frozenset({"ext4", "xfs"})
#: set to ``0`` in the environment to write every shard through the page cache
ENVIRONMENT = "PEFT_SHARDMERGE_DIRECT_IO"


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem that holds ``path`` (``"ext4"``, ``"tmpfs"``...), from ``/proc/self/mountinfo``.

    Args:
        path: an existing file or folder.

    Returns:
        The type of the innermost mount holding it, or None where it cannot be told (no ``/proc``).

    Example:
        >>> filesystem_type("/proc") in ("proc", None)
        True
    """
    real, best, kind = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields, _, rest = line.partition(" - ")
                mount = fields.split()[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best) and rest:  # a later mount on the same point hides the earlier
                    best, kind = mount, rest.split()[0]
    except OSError:
        return None
    return kind


def wanted(path: str) -> bool:
    """Whether the tensors of a shard at ``path`` are written past the page cache: on an allowlisted filesystem
    (:data:`DIRECT_FILESYSTEMS`), unless the environment variable :data:`ENVIRONMENT` is ``0``.

    Args:
        path: the shard (its folder exists).

    Returns:
        True to use :class:`DirectWrites`.

    Example:
        >>> wanted("/proc/version")
        False
    """
    if os.environ.get(ENVIRONMENT, "1") == "0" or not hasattr(os, "O_DIRECT"):
        return False
    return filesystem_type(os.path.dirname(os.path.abspath(path)) or ".") in DIRECT_FILESYSTEMS


class DirectWrites:
    """The tensor bytes of one shard, from any thread (several at once), written with ``O_DIRECT``: the whole
    :data:`ALIGN`-blocks of each write are copied, in pieces of ``piece`` bytes, into free page-aligned buffers that
    ``threads`` threads of its own write to the disk while the caller goes on (it waits only for a free buffer); the
    partial blocks at a write's ends (shared with the header or the neighbouring write) are assembled in memory and
    written through the page cache once complete. Where the file cannot be opened so, or the filesystem refuses a
    direct write, everything from then on goes through the page cache: the bytes are the same either way.

    Why by hand: neither the standard library nor safetensors offers aligned direct writes, and on a machine whose
    memory the page cache must first be given (a virtual machine that returns free memory to its host, say), copying
    into fresh page-cache pages cost more than the merge's own arithmetic (docs/benchmarks.md, "Writes past the page
    cache").

    Args:
        path: the shard, created already.
        fd: its descriptor through the page cache (kept open by the caller until :meth:`close` has returned).
        size: the shard's final size in bytes.
        head: the bytes written before (the header): the block they share with the first tensor is completed here.
        piece: the most one direct write moves (a multiple of :data:`ALIGN`).
        threads: the threads that write the pieces.
        buffers: pieces copied and not yet written, at most.

    Attributes:
        direct: whether pieces still go past the page cache.
        error: the first failed direct write, raised at the next call.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> fd = os.open(path, os.O_RDWR | os.O_CREAT)
        >>> os.write(fd, b"head")
        4
        >>> d = DirectWrites(path, fd, 4 + 3 * ALIGN, b"head")
        >>> d.pwrite(memoryview(b"x" * (3 * ALIGN)), 4); d.close()
        >>> data = os.pread(fd, 4 * ALIGN, 0); os.close(fd); data == b"head" + b"x" * (3 * ALIGN)
        True
    """

    def __init__(
        self, path: str, fd: int, size: int, head: bytes, piece: int = 1 << 20, *, threads: int = 4, buffers: int = 8
    ):
        if piece % ALIGN:
            raise ValueError(f"piece must be a multiple of {ALIGN}, got {piece}")
        self.fd, self.size, self.piece = fd, size, piece
        self.error: BaseException | None = None
        try:
            self._dfd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # no direct writes on this filesystem after all
            self._dfd = -1
        self.direct = self._dfd >= 0 and hasattr(os, "O_DIRECT")
        self._closed = False
        self._lock = threading.Lock()
        self._free: queue.Queue = queue.Queue()
        for _ in range(buffers if self.direct else 0):
            self._free.put(memoryview(mmap.mmap(-1, piece)))  # anonymous maps are page-aligned
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-direct")
        self._partial: dict[int, tuple[bytearray, int]] = {}  # block index -> (its bytes, how many are in)
        cut = len(head) - len(head) % ALIGN
        self._fragment(memoryview(head)[cut:], cut)

    def pwrite(self, view: memoryview, pos: int) -> None:
        """Write ``view`` (bytes, format ``B``) at ``pos``; every byte of the file is written once, by one call.

        Raises:
            OSError: the write failed (disk full, I/O error).
        """
        end = pos + len(view)
        first, last = -(-pos // ALIGN) * ALIGN, end // ALIGN * ALIGN
        if first >= last:  # no whole block inside
            self._fragment(view, pos)
            return
        self._fragment(view[: first - pos], pos)
        self._whole(view[first - pos : last - pos], first)
        self._fragment(view[last - pos :], last)

    def close(self) -> None:
        """Wait for the direct writes in flight and close the direct descriptor (the caller fsyncs ``fd``, which
        covers both).

        Raises:
            OSError: a direct write failed.
            MergeCheckError: a block was left incomplete (bytes of the file never written).
        """
        self.abort(cancel=False)
        if self.error is not None:
            raise self.error
        if self._partial:
            blocks = sorted(self._partial)
            raise MergeCheckError(f"bytes never written in {len(blocks)} block(s) from offset {blocks[0] * ALIGN}")

    def abort(self, cancel: bool = True) -> None:
        """Stop (the writes not started are dropped unless ``cancel`` is False), wait for the rest, and close the
        direct descriptor."""
        self._pool.shutdown(wait=True, cancel_futures=cancel)
        self._closed = True  # a late call writes through the page cache, waiting for no buffer
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1

    def _whole(self, view: memoryview, pos: int) -> None:
        """Whole blocks at an aligned ``pos``: each piece copied into a free page-aligned buffer and written direct by
        one of the threads (the caller goes on; it waits only for a free buffer)."""
        for at in range(0, len(view), self.piece):
            if self.error is not None:
                raise self.error
            chunk = view[at : at + self.piece]
            if not self.direct or self._closed:
                self._buffered(chunk, pos + at)
                continue
            buffer = self._free.get()
            buffer[: len(chunk)] = chunk
            self._pool.submit(self._write, buffer, len(chunk), pos + at)

    def _write(self, buffer: memoryview, n: int, pos: int) -> None:
        """One piece, direct (through the page cache once the filesystem has refused one); the buffer freed after."""
        try:
            done = 0
            if self.direct:
                try:
                    done = os.pwrite(self._dfd, buffer[:n], pos)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct = False
            self._buffered(buffer[done:n], pos + done)
        except BaseException as e:
            self.error = self.error or e
        finally:
            self._free.put(buffer)

    def _fragment(self, view: memoryview, pos: int) -> None:
        """Bytes short of whole blocks: kept in their blocks until complete, then written through the page cache."""
        while view:
            block, offset = divmod(pos, ALIGN)
            take = min(len(view), ALIGN - offset)
            length = min(ALIGN, self.size - block * ALIGN)  # the file's last block may be short
            with self._lock:
                data, filled = self._partial.pop(block, (None, 0))
                data = bytearray(length) if data is None else data
                data[offset : offset + take] = view[:take]
                filled += take
                if filled < length:
                    self._partial[block] = (data, filled)
                    data = None
            if data is not None:
                self._buffered(memoryview(data), block * ALIGN)
            view, pos = view[take:], pos + take

    def _buffered(self, view: memoryview, pos: int) -> None:
        while view:
            n = os.pwrite(self.fd, view, pos)
            view, pos = view[n:], pos + n
