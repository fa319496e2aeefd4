"""What a shard's file gets on the local filesystems known to take it: its blocks allocated at once, and its tensor
bytes written past the page cache (``O_DIRECT``), the whole aligned blocks of each write straight to the disk and the
blocks two writes share assembled in memory first."""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from ..errors import MergeCheckError

log = logging.getLogger(__name__)

#: the least alignment of a direct write's offset, length and buffer: a multiple of every logical block size Linux's
#: local filesystems use; a file on a larger page or filesystem block is aligned to that (:func:`alignment`)
ALIGN = 4096
#: complete shared blocks held for :meth:`DirectWrites.close`, at most; that many are written at once beyond it
HELD_BLOCKS = 1024
#: filesystems whose direct writes are used (an allowlist: on others, FUSE and network filesystems among them, a direct
#: write may be refused, slow, or cached all the same)
DIRECT_FILESYSTEMS = frozenset({"ext4", "xfs"})
#: ``0`` in the environment: every shard through the page cache; ``1``: past it wherever the filesystem allows; unset
#: (or ``auto``): past it where the machine's free memory would not hold the shard, or its memory would not hold what
#: the merge reads and writes together
ENVIRONMENT = "PEFT_SHARDMERGE_DIRECT_IO"


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem that holds ``path`` (``"ext4"``, ``"tmpfs"``...), from ``/proc/self/mountinfo``:
    the innermost mount point above it among the mounts of its device (a mount another one hides is not taken).

    Args:
        path: an existing file or folder.

    Returns:
        The type, or None where it cannot be told (no ``/proc``, a device no mount names).

    Example:
        >>> filesystem_type("/proc") in ("proc", None)
        True
    """
    try:
        real, dev = os.fsencode(os.path.realpath(path)), os.stat(path).st_dev
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best, kind = b"", None
    for line in lines:
        fields, _, rest = line.partition(b" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        major, _, minor = parts[2].partition(b":")
        if (int(major), int(minor)) != (os.major(dev), os.minor(dev)):
            continue
        mount = _unescape(parts[4])
        inside = real == mount or real.startswith(mount.rstrip(b"/") + b"/")
        if inside and len(mount) >= len(best):  # a later mount on the same point hides the earlier
            best, kind = mount, os.fsdecode(rest.split()[0])
    return kind


def _unescape(field: bytes) -> bytes:
    """A mountinfo path field as the path: the kernel writes space, tab, newline and backslash as octal escapes."""
    for code, char in ((b"\\040", b" "), (b"\\011", b"\t"), (b"\\012", b"\n"), (b"\\134", b"\\")):
        field = field.replace(code, char)
    return field


def alignment(fd: int) -> int:
    """The alignment of the direct writes into ``fd``: :data:`ALIGN`, or the page size or the filesystem's block size
    where larger (so that a block written through the page cache never shares a page with one written direct).

    Args:
        fd: the file (or any descriptor on its filesystem).

    Returns:
        A power of two, at least :data:`ALIGN`.

    Example:
        >>> fd = os.open(".", os.O_RDONLY); alignment(fd) >= ALIGN; os.close(fd)
        True
    """
    return max(ALIGN, mmap.PAGESIZE, os.fstatvfs(fd).f_frsize)


def wanted(path: str, nbytes: int, working_set: int = 0) -> bool:
    """Whether the tensors of a shard are written past the page cache: on an allowlisted filesystem
    (:data:`DIRECT_FILESYSTEMS`) where the machine's free memory would not hold the shard, or its memory would not hold
    the whole merge's reads and writes together (either way, writing through the page cache would evict what the cache
    holds, the base still to be read among it), or as the environment variable :data:`ENVIRONMENT` says.

    Args:
        path: the shard (its folder exists).
        nbytes: its size.
        working_set: the bytes the whole merge reads from disk and writes (0: not known).

    Returns:
        True to use :class:`DirectWrites`.

    Example:
        >>> wanted("/proc/version", 1 << 40)
        False
    """
    setting = os.environ.get(ENVIRONMENT, "auto")
    if setting == "0" or not hasattr(os, "O_DIRECT"):
        return False
    if filesystem_type(os.path.dirname(os.path.abspath(path)) or ".") not in DIRECT_FILESYSTEMS:
        return False
    if setting == "1":
        return True
    free, memory = free_memory(), physical_memory()
    if free < nbytes or 0 < memory < working_set:
        log.debug(
            "%s written past the page cache: %.2f GB free for %.2f GB; %.2f GB of memory for a merge reading and "
            "writing %.2f GB (%s=0 to write through it)",
            os.path.basename(path),
            free / 1e9,
            nbytes / 1e9,
            memory / 1e9,
            working_set / 1e9,
            ENVIRONMENT,
        )
        return True
    return False


def preallocate(fd: int, path: str, size: int) -> bool:
    """Allocate the blocks of a new file of ``size`` bytes at once, on the filesystems of :data:`DIRECT_FILESYSTEMS`:
    the writes that follow, through the page cache or past it, find their blocks allocated (on ext4 a write through the
    page cache then skips the delayed allocation of each page: about a third less system time for the write alone,
    about a tenth for a whole merge, docs/benchmarks.md), and a disk too small for the file says so before a byte of it
    is written. Elsewhere, and where the filesystem does not allocate so (an ext4 without extents), nothing is done.

    Why by hand: Python offers only ``os.posix_fallocate``, which the C library emulates where the filesystem does not
    allocate natively by writing to every block of the file: a second pass over the disk, not a saving.
    ``fallocate(2)`` itself (through ``ctypes``) never emulates.

    Args:
        fd: the file, open for writing.
        path: its path (for the filesystem's type).
        size: its final size.

    Returns:
        Whether the blocks were allocated.

    Raises:
        OSError: no room for the file (``ENOSPC``), or another failure than the filesystem not allocating so.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile(dir="/dev/shm") as f:  # tmpfs: not on the list
        ...     preallocate(f.fileno(), "/dev/shm/x", 1 << 20)
        False
    """
    if size <= 0 or filesystem_type(os.path.dirname(os.path.abspath(path)) or ".") not in DIRECT_FILESYSTEMS:
        return False
    try:
        _fallocate(fd, size)
    except OSError as e:
        # EPERM: a sandbox that forbids the call (the file was just created: not append-only nor immutable)
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV, errno.EPERM):
            return False
        raise
    return True


def _fallocate(fd: int, size: int) -> None:
    """``fallocate(fd, 0, 0, size)`` (Linux): the blocks allocated by the filesystem, or ``OSError``; ``ENOSYS``
    where the C library has no such call."""
    call = _fallocate_call()
    if call is None:
        raise OSError(errno.ENOSYS, "fallocate is not available")
    while call(fd, 0, 0, size) != 0:
        code = ctypes.get_errno()
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code))


@functools.cache
def _fallocate_call():
    """The C library's ``fallocate64`` (or ``fallocate``, with a 64-bit ``off_t``), loaded once (each load makes
    objects the cyclic collector must free); None where there is neither."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if call is not None:
        call.argtypes, call.restype = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int
    return call


def free_memory() -> int:
    """The free memory in bytes, as the C library counts it (``MemFree`` of ``/proc/meminfo``: the page cache not
    counted as free), or less where this process's control group has a memory limit (:func:`cgroup_memory`: the limit
    less what the group holds, its page cache included), or 0 where it cannot tell.

    Example:
        >>> free_memory() >= 0
        True
    """
    free = _pages("SC_AVPHYS_PAGES")
    group = cgroup_memory() if free else None
    return free if group is None else max(0, min(free, group[0] - group[1]))


def physical_memory() -> int:
    """The memory in bytes: the machine's (``MemTotal`` of ``/proc/meminfo``), or this process's control group's
    memory limit where smaller (:func:`cgroup_memory`; a container's), or 0 where it cannot tell.

    Example:
        >>> physical_memory() > 0
        True
    """
    total = _pages("SC_PHYS_PAGES")
    group = cgroup_memory() if total else None
    return total if group is None else min(total, group[0])


def _pages(name: str) -> int:
    """``os.sysconf(name)`` pages in bytes; 0 where the system does not say."""
    try:
        return os.sysconf(name) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


#: this process's control groups, one line per hierarchy: ``ID:CONTROLLERS:PATH`` (``0::PATH`` for cgroup v2)
_PROC_CGROUP = "/proc/self/cgroup"
#: where the memory controller is mounted: cgroup v2 (unified, or hybrid), then v1; with the files of a group's limit
#: and of what it holds now
_CGROUP_MOUNTS = (
    ("/sys/fs/cgroup", "", ("memory.max", "memory.current")),
    ("/sys/fs/cgroup/unified", "", ("memory.max", "memory.current")),
    ("/sys/fs/cgroup/memory", "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")),
)


def cgroup_memory() -> tuple[int, int] | None:
    """The tightest memory limit on this process among its control group and the groups above it (cgroup v2 or v1, at
    their usual mount points), and what that group holds now (its page cache included), in bytes.

    Why by hand: neither the standard library nor torch reads it; a container's page cache is reclaimed at its limit,
    not at the machine's memory.

    Returns:
        ``(limit, held)``, or None where no limit is set or none can be read.

    Example:
        >>> cgroup_memory() is None or cgroup_memory()[0] > 0
        True
    """
    try:
        with open(_PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2]
        for mount, controller, files in _CGROUP_MOUNTS:
            if controllers != controller and controller not in controllers.split(","):
                continue
            folder = os.path.normpath(mount + path)
            folders = [mount]  # where the group's path is not below the mount: a container's own group, mounted whole
            if os.path.isdir(folder):
                folders = [folder]
                while folder != mount and folder.startswith(mount + "/"):  # the groups above it, up to the mount
                    folder = os.path.dirname(folder)
                    folders.append(folder)
            for folder in folders:
                best = _tighter(best, folder, *files)
    return best


def _tighter(best: tuple[int, int] | None, folder: str, limit_file: str, held_file: str) -> tuple[int, int] | None:
    """``best`` or ``folder``'s limit and usage, whichever limit is smaller (``max`` or past 2**60: no limit)."""
    try:
        with open(os.path.join(folder, limit_file)) as f:
            limit = f.read().strip()
        with open(os.path.join(folder, held_file)) as f:
            held = int(f.read().strip())
    except (OSError, ValueError):
        return best
    if not limit.isdigit() or int(limit) >= 1 << 60:
        return best
    return (int(limit), held) if best is None or int(limit) < best[0] else best


class DirectWrites:
    """The tensor bytes of one shard, from any thread (several at once), written with ``O_DIRECT``: the whole aligned
    blocks of each write (:func:`alignment`) are copied, in pieces of ``piece`` bytes, into free page-aligned buffers
    that ``threads`` threads of its own write to the disk while the caller goes on (it waits only for a free buffer);
    the partial blocks at a write's ends (shared with the header or the neighbouring write) are assembled in memory and
    written through the page cache by :meth:`close`, after the direct writes (or :data:`HELD_BLOCKS` at a time, so
    that memory stays bounded). Where the file cannot be opened so, or the filesystem refuses a direct write,
    everything from then on goes through the page cache: the same bytes.

    Why by hand: neither the standard library nor safetensors offers aligned direct writes, and on a machine whose
    memory the page cache must first be given (a virtual machine that returns free memory to its host, say), filling
    the page cache cost more than the merge's own arithmetic (docs/benchmarks.md, "Writes past the page cache").

    Args:
        path: the shard, created already (its blocks allocated by :func:`preallocate`, where it writes direct).
        fd: its descriptor through the page cache (kept open by the caller until :meth:`close` has returned).
        size: the shard's final size in bytes.
        head: the bytes written before (the header): the block they share with the first tensor is completed here.
        piece: the most one direct write moves (a multiple of :data:`ALIGN`; rounded down to the file's alignment).
        threads: the threads that write the pieces.
        buffers: pieces copied and not yet written, at most.

    Attributes:
        align: the file's alignment.
        direct: whether pieces still go past the page cache.
        error: the first failed write of a piece (direct, or through the page cache after a refusal): raised by the
            next call that writes whole blocks, and by :meth:`close`.

    Raises:
        ValueError: ``piece`` is not a multiple of :data:`ALIGN`.

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
        self.fd, self.size, self.align = fd, size, alignment(fd)
        self.piece = max(self.align, piece - piece % self.align)
        self.error: BaseException | None = None
        try:
            self._dfd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:  # no direct writes on this filesystem after all
            self._dfd = -1
        self.direct = self._dfd >= 0  # its blocks already allocated (preallocate): every direct write an overwrite
        self._closed = False
        self._lock = threading.Lock()
        self._partial: dict[int, tuple[bytearray, int]] = {}  # block index -> (its bytes, how many are in)
        self._complete: list[tuple[int, bytearray]] = []  # (block index, bytes): written by close
        self._free: queue.Queue = queue.Queue()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-direct")
        try:
            for _ in range(buffers if self.direct else 0):
                self._free.put(memoryview(mmap.mmap(-1, self.piece)))  # anonymous maps are page-aligned
            cut = len(head) - len(head) % self.align
            self._fragment(memoryview(head)[cut:], cut)
        except BaseException:
            self.abort()
            raise

    def pwrite(self, view: memoryview, pos: int) -> None:
        """Write ``view`` (bytes, format ``B``) at ``pos``; every byte of the file is written once, by one call.

        Raises:
            OSError: a write failed (disk full, I/O error; this one or an earlier piece's), or the writes were closed.
        """
        end = pos + len(view)
        first, last = -(-pos // self.align) * self.align, end // self.align * self.align
        if first >= last:  # no whole block inside
            self._fragment(view, pos)
            return
        self._fragment(view[: first - pos], pos)
        self._whole(view[first - pos : last - pos], first)
        self._fragment(view[last - pos :], last)

    def close(self) -> None:
        """Wait for the pieces in flight, close the direct descriptor, and write the blocks assembled in memory through
        ``fd`` (the caller fsyncs it, which covers both).

        Raises:
            OSError: a write failed.
            MergeCheckError: a block was left incomplete (bytes of the file never written).
        """
        self.abort()
        if self.error is not None:
            raise self.error
        if self._partial:
            blocks = sorted(self._partial)
            raise MergeCheckError(
                f"bytes never written in {len(blocks)} block(s) from offset {blocks[0] * self.align}"
            )
        for block, data in sorted(self._complete):
            self._buffered(memoryview(data), block * self.align)
        self._complete.clear()

    def abort(self) -> None:
        """Refuse further writes, wait for the pieces in flight (at most ``buffers``), let go of the buffers and close
        the direct descriptor (idempotent)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
        while not self._free.empty():
            self._free.get_nowait()
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
            if not self.direct:
                self._check_open()
                self._buffered(chunk, pos + at)
                continue
            buffer = self._take()
            buffer[: len(chunk)] = chunk
            with self._lock:  # never submitted once closed: abort waits only for what was
                if self._closed:
                    self._free.put(buffer)
                self._check_open()
                self._pool.submit(self._write, buffer, len(chunk), pos + at)

    def _take(self) -> memoryview:
        """A free buffer, once one is (the writes closed meanwhile: an error)."""
        while True:
            try:
                return self._free.get(timeout=0.5)
            except queue.Empty:
                self._check_open()

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "the shard's writes were closed")

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
        """Bytes short of whole blocks: kept in their blocks, which :meth:`close` writes through the page cache once
        the direct writes are done (a write through the cache waits for every direct one in flight: ext4 takes the
        file's lock for it alone), or, :data:`HELD_BLOCKS` of them at a time, the call that completes the last."""
        while view:
            block, offset = divmod(pos, self.align)
            take = min(len(view), self.align - offset)
            length = min(self.align, self.size - block * self.align)  # the file's last block may be short
            ready = None
            with self._lock:
                self._check_open()
                data, filled = self._partial.pop(block, (None, 0))
                data = bytearray(length) if data is None else data
                data[offset : offset + take] = view[:take]
                filled += take
                if filled < length:
                    self._partial[block] = (data, filled)
                else:
                    self._complete.append((block, data))
                    if len(self._complete) >= HELD_BLOCKS:  # memory stays bounded, whatever the shard's size
                        ready, self._complete = self._complete, []
            for block_ready, data_ready in sorted(ready or ()):
                self._buffered(memoryview(data_ready), block_ready * self.align)
            view, pos = view[take:], pos + take

    def _buffered(self, view: memoryview, pos: int) -> None:
        while view:
            n = os.pwrite(self.fd, view, pos)
            view, pos = view[n:], pos + n
