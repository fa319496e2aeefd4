"""Streaming safetensors output: the header first, then tensor bytes as they are produced (with a SHA-256 per
tensor and of the header, recorded while writing or handed in by whoever produced the bytes, and the file flushed
to the disk as it grows; written in place, past the page cache where the filesystem takes it), then the index."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import threading

import torch

from ..errors import MergeCheckError
from ..io.safetensors_io import build_header
from . import direct

_COPY_PIECE = 64 << 20
#: the most one ``write``/``pwrite`` (or a copy's ``pread``) moves at once, whatever the block handed in: with calls
#: of 1 MiB instead of one per row block (8 MiB, freshly cast), a merge on 2 cores took 0.58-0.60 times as long at
#: 0.5B and 1B (at 8B, the page cache full, 1.06 times: 3 pairs); a copy's reads of 8 MiB, written in 1 MiB pieces,
#: made it 1.05-1.10 times as long again (Linux 6.18, ext4; docs/benchmarks.md, "Writes in pieces of 1 MiB"). A copy in
#: the kernel (``copy_file_range``, in pieces of ``_COPY_PIECE``) has no user buffer to cut and is left as it is.
WRITE_PIECE = 1 << 20
#: bytes written to a shard between two requests to the kernel to put what is written so far on the disk
FLUSH_EVERY = 64 << 20


class Flusher:
    """Puts a file's written bytes on the disk while more are being written: each :meth:`request` asks a thread of
    its own for an ``fdatasync``, requests made while one runs are served by one more, and :meth:`stop` serves the
    last one asked for before it returns. The final ``fsync`` then has only the tail left; without it the kernel
    would start writing a shard only when it is closed (below its dirty-page limits), and the whole shard would
    wait on the disk at the end.

    Args:
        fd: the file, open for writing (kept open until :meth:`stop` has returned).

    Attributes:
        error: the first failed sync, for the file's owner to raise (after a failed sync, Linux may report the next
            one as a success).

    Example:
        >>> import tempfile
        >>> fd, path = tempfile.mkstemp()
        >>> flusher = Flusher(fd)
        >>> os.write(fd, b"abc"); flusher.request(); flusher.stop(); os.close(fd); flusher.error
        3
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.error: OSError | None = None
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._asked = self._served = 0  # requests made, and how many of them the last sync covered
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="shard-flush", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Ask for the bytes written so far to go to the disk (returns at once)."""
        with self._lock:
            self._asked += 1
        self._wanted.set()

    def _run(self) -> None:
        sync = getattr(os, "fdatasync", os.fsync)
        while True:
            self._wanted.wait()
            self._wanted.clear()
            with self._lock:
                asked = self._asked
            if asked > self._served:
                try:
                    sync(self.fd)
                except OSError as e:
                    self.error = self.error or e
                self._served = asked
            if self._closing:
                return

    def stop(self) -> None:
        """Serve the request asked for last, if not yet, and stop the thread (before the file closes; idempotent)."""
        if self._thread.is_alive():
            self._closing = True
            self._wanted.set()
            self._thread.join()


class TensorDigests:
    """SHA-256 of each tensor's bytes in a stream of consecutive tensors, split at the tensors' boundaries.

    Args:
        entries: ``(name, nbytes)`` of every tensor, in the order their bytes arrive.

    Example:
        >>> d = TensorDigests([("a", 2), ("b", 1)]); d.update(b"xyz"); d.digests()["b"][:8]
        '594e519a'
    """

    def __init__(self, entries: list[tuple[str, int]]):
        self._entries = list(entries)
        self._done: dict[str, str] = {}
        self._i = 0
        self._left = 0
        self._hash = None
        self._next()

    def _next(self) -> None:
        """Start the next tensor with bytes to come (finishing any empty ones on the way)."""
        while self._i < len(self._entries):
            name, nbytes = self._entries[self._i]
            if nbytes > 0:
                self._hash, self._left = hashlib.sha256(), nbytes
                return
            self._done[name] = hashlib.sha256().hexdigest()
            self._i += 1
        self._hash, self._left = None, 0

    def update(self, data) -> None:
        """Add the next bytes of the stream.

        Raises:
            ValueError: more bytes than the entries announced.
        """
        view = memoryview(data).cast("B")
        while view:
            if self._hash is None:
                raise ValueError(f"{len(view)} bytes beyond the last tensor")
            take = min(self._left, len(view))
            self._hash.update(view[:take])
            view, self._left = view[take:], self._left - take
            if self._left == 0:
                self._done[self._entries[self._i][0]] = self._hash.hexdigest()
                self._i += 1
                self._next()

    def digests(self) -> dict[str, str]:
        """Hex SHA-256 per finished tensor, in stream order (complete once every byte has arrived)."""
        return dict(self._done)


class FileDigest:
    """The SHA-256 of a whole shard, from the bytes as they are written: in order (:meth:`update`), or tensor by
    tensor at their places (:meth:`placed`), where the finished prefix of the file is hashed as it grows, read back
    from the page cache it was just written to. It names the file on the Hub (an LFS object's id).

    Args:
        header: the shard's header bytes (its first bytes).
        sizes: each tensor's bytes, in file order.
        path: the shard, read back for the tensors written at their places.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> _ = open(path, "wb").write(b"hdab")
        >>> d = FileDigest(b"hd", [1, 1], path); d.placed(1); d.placed(0)
        >>> d.hexdigest() == hashlib.sha256(b"hdab").hexdigest()
        True
    """

    def __init__(self, header: bytes, sizes: list[int], path: str):
        self._sha = hashlib.sha256(header)
        self._sizes, self._path = list(sizes), path
        self._next, self._pos = 0, len(header)
        self._ready: set[int] = set()
        self._lock = threading.Lock()
        self._busy = False

    def update(self, data) -> None:
        """Add the next bytes of a shard written in order."""
        self._sha.update(data)

    def placed(self, index: int) -> None:
        """Tensor ``index`` is written: hash the prefix of the file it completes (one thread at a time does it; the
        others only mark theirs)."""
        with self._lock:
            self._ready.add(index)
            if self._busy:
                return
            self._busy = True
        while True:
            with self._lock:
                if self._next not in self._ready:
                    self._busy = False
                    return
                i = self._next
                self._next += 1
            with open(self._path, "rb", buffering=0) as f:
                left, pos = self._sizes[i], self._pos
                while left:
                    piece = os.pread(f.fileno(), min(WRITE_PIECE, left), pos)
                    if not piece:
                        raise MergeCheckError(f"{self._path}: shorter than its header says")
                    self._sha.update(piece)
                    left, pos = left - len(piece), pos + len(piece)
            self._pos += self._sizes[i]

    def hexdigest(self) -> str:
        """The file's SHA-256 (complete once every tensor is in)."""
        if self._next < len(self._sizes) and self._ready:
            raise MergeCheckError(f"{self._path}: its SHA-256 asked for before every tensor was written")
        return self._sha.hexdigest()


class ShardWriter:
    """Writes one safetensors file whose header is known before any data.

    In order (:meth:`write`, :meth:`copy_from`), writes happen on a background thread so that computing the next
    block overlaps writing this one; at most ``depth`` blocks wait in between, so memory stays bounded by a few
    blocks. In place (:meth:`at`), each tensor is written by the thread that produces it, several at once; on the
    filesystems of :data:`~peft_shardmerge.output.direct.DIRECT_FILESYSTEMS` past the page cache
    (:class:`~peft_shardmerge.output.direct.DirectWrites`), the same bytes.

    Args:
        path: the file to create (must not exist).
        entries: ``(name, dtype, shape, nbytes)`` of every tensor, in write order.
        metadata: the ``__metadata__`` map; ``{"format": "pt"}`` is always included.
        depth: blocks queued to the writer thread.
        working_set: the bytes the whole merge reads from disk and writes, for the choice of writes past the page
            cache (:func:`~peft_shardmerge.output.direct.wanted`; 0: not known).
        file_digest: also take the whole file's SHA-256 (:meth:`sha256`) as it is written; its writes then go
            through the page cache (the file is read again at once, by its upload).

    Raises:
        FileExistsError: ``path`` exists.

    Example:
        >>> import tempfile
        >>> from safetensors.torch import load_file
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> with ShardWriter(path, [("w", "F32", (2,), 8)]) as w:
        ...     w.write(torch.ones(2))
        >>> load_file(path)
        {'w': tensor([1., 1.])}
    """

    def __init__(
        self,
        path: str,
        entries: list[tuple[str, str, tuple[int, ...], int]],
        metadata: dict[str, str] | None = None,
        *,
        depth: int = 2,
        working_set: int = 0,
        file_digest: bool = False,
    ):
        self.path = path
        self.working_set = working_set
        self.expected = sum(e[3] for e in entries)
        self.written = 0
        meta = {"format": "pt", **(metadata or {})}
        header = build_header(entries, meta)  # before the file and the threads: nothing to undo when it fails
        self._header = (len(header), hashlib.sha256(header).hexdigest())
        self._error: BaseException | None = None
        self._entries = [(e[0], e[3]) for e in entries]
        self._tensors = TensorDigests(self._entries)
        self._file = FileDigest(header, [n for _, n in self._entries], path) if file_digest else None
        self._placed: dict[int, str] = {}  # entries written in place (at), by index
        self._lock = threading.Lock()
        self._unflushed = 0  # bytes written since the last flush request
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._head = header  # for the writes in place past the page cache: the block it shares with the first tensor
        # made at the first write in place; False: not used
        self._direct: direct.DirectWrites | None | bool = None if self._file is None else False
        self._flusher = Flusher(self._fd)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._drain, name="shard-writer", daemon=True)
        self._thread.start()
        try:
            direct.preallocate(self._fd, path, len(header) + self.expected)  # a full disk said before any byte
            self._write_all(memoryview(header), data=False)
        except BaseException:
            self.abort()
            raise

    def _drain(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._error is not None:
                continue
            try:
                job()
            except BaseException as e:  # handed to the caller on its next call
                self._error = e

    def _submit(self, job) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(job)

    def _write_all(self, view: memoryview, data: bool = True) -> None:
        if data:
            self._tensors.update(view)
            if self._file is not None:
                self._file.update(view)
        while view:
            n = os.write(self._fd, view[:WRITE_PIECE])
            view = view[n:]
            self._wrote(n)

    def _wrote(self, nbytes: int) -> None:
        """Count bytes written (from any thread); every :data:`FLUSH_EVERY` of them, ask for a flush."""
        with self._lock:
            self._unflushed += nbytes
            if self._unflushed < FLUSH_EVERY:
                return
            self._unflushed = 0
        self._flusher.request()

    def write(self, tensor: torch.Tensor) -> None:
        """Append a tensor's (or a row block's) bytes, in its own dtype.

        The tensor must not be modified afterwards: it is written in the background.

        Args:
            tensor: the data; it is made contiguous on the CPU.

        Raises:
            OSError: an earlier background write failed (disk full, ...).
        """
        t = tensor.detach().to("cpu").contiguous()
        if t.numel() == 0:
            return
        raw = t.reshape(-1).view(torch.uint8).numpy()
        self.written += raw.nbytes
        self._submit(lambda: self._write_all(memoryview(raw).cast("B")))

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        """Append ``nbytes`` copied from another file, in the kernel where the filesystem allows.

        Args:
            fd: a readable file descriptor (kept open until :meth:`close`).
            offset: where to start reading in it.
            nbytes: how many bytes to copy.

        Raises:
            OSError: an earlier background write failed.
        """
        self.written += nbytes
        self._submit(lambda: self._copy(fd, offset, nbytes))

    def at(self, index: int) -> "TensorAt":
        """A sink for the whole of entry ``index``, writing at its place in the file from any thread (several at once):
        its bytes go there with ``pwrite`` and their SHA-256 is computed on the way.

        Args:
            index: the entry's position in ``entries``.

        Returns:
            A :class:`TensorAt`; its :meth:`~TensorAt.finish` records the tensor.
        """
        begin = self._header[0] + sum(n for _, n in self._entries[:index])
        with self._lock:
            if self._direct is None:
                self._direct = self._direct_writes()
        return TensorAt(self, index, begin)

    def _direct_writes(self) -> "direct.DirectWrites | bool":
        """The shard's writes past the page cache where :func:`~peft_shardmerge.output.direct.wanted`, else False."""
        size = self.expected + self._header[0]
        if not direct.wanted(self.path, size, self.working_set):
            return False
        return direct.DirectWrites(self.path, self._fd, size, self._head, WRITE_PIECE)

    def _placed_tensor(self, index: int, nbytes: int, sha256: str) -> None:
        with self._lock:
            if index in self._placed or nbytes != self._entries[index][1]:
                raise MergeCheckError(f"{self.path}: {self._entries[index][0]} written twice or with the wrong size")
            self._placed[index] = sha256
            self.written += nbytes
        if self._file is not None:
            self._file.placed(index)

    def _copy(self, fd: int, offset: int, nbytes: int) -> None:
        done = 0
        use_kernel = hasattr(os, "copy_file_range")
        while done < nbytes:
            want = min(_COPY_PIECE, nbytes - done)
            n = 0
            if use_kernel:
                try:
                    n = os.copy_file_range(fd, self._fd, want, offset + done)
                    self._wrote(n)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                        raise
                    use_kernel = False
            if not use_kernel or n == 0:
                use_kernel = False
                data = os.pread(fd, min(WRITE_PIECE, want), offset + done)
                if not data:
                    raise MergeCheckError(f"source file ended early while copying into {self.path}")
                self._write_all(memoryview(data))
                n = len(data)
            else:  # copied in the kernel: read the same bytes back from the page cache for the digest
                for pos in range(0, n, WRITE_PIECE):
                    piece = os.pread(fd, min(WRITE_PIECE, n - pos), offset + done + pos)
                    self._tensors.update(piece)
                    if self._file is not None:
                        self._file.update(piece)
            done += n

    def record(self) -> dict:
        """What the merge record (``merge_manifest.json``) keeps of this shard: its size, the header's length and
        SHA-256, and each tensor's byte range (relative to the data, as in the header) and SHA-256, all
        computed from the bytes as they were written.

        Returns:
            ``{"size", "header": {"size", "sha256"}, "tensors": {name: {"offsets": [begin, end], "sha256"}}}``;
            complete only after :meth:`close`.

        Raises:
            MergeCheckError: called before every tensor's bytes were written.
        """
        # a shard is written in order (write, copy_from) or in place (at), not both
        digests = self._tensors.digests() if not self._placed else {}
        digests.update({self._entries[i][0]: sha for i, sha in self._placed.items()})
        if len(digests) != len(self._entries):
            raise MergeCheckError(f"{self.path}: digests asked for before every tensor was written")
        tensors, begin = {}, 0
        for name, nbytes in self._entries:
            tensors[name] = {"offsets": [begin, begin + nbytes], "sha256": digests[name]}
            begin += nbytes
        size, sha = self._header
        return {"size": size + begin, "header": {"size": size, "sha256": sha}, "tensors": tensors}

    def sha256(self) -> str:
        """The whole file's SHA-256, taken as it was written (with ``file_digest``; after :meth:`close`).

        Raises:
            MergeCheckError: the writer takes no file digest, or a tensor is not written yet.
        """
        if self._file is None:
            raise MergeCheckError(f"{self.path}: written without its file digest")
        return self._file.hexdigest()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def close(self) -> None:
        """Finish the background writes, flush to disk and check the byte count.

        Raises:
            MergeCheckError: more or fewer bytes were written than the header announced.
            OSError: a background write failed.
        """
        if self._fd < 0:
            return
        try:
            self._stop()
            self._flusher.stop()
            for error in (self._error, self._flusher.error):  # a failed write explains more than a failed flush
                if error is not None:
                    raise error
            if self._direct:
                self._direct.close()
            os.fsync(self._fd)
        finally:
            self._flusher.stop()
            if self._direct:
                self._direct.abort()
            os.close(self._fd)
            self._fd = -1
        if self.written != self.expected:
            raise MergeCheckError(f"{self.path}: wrote {self.written} data bytes, header announced {self.expected}")

    def abort(self) -> None:
        """Close without checks (after an error)."""
        self._stop()
        self._flusher.stop()
        if self._direct:
            self._direct.abort()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TensorAt:
    """One tensor's bytes written at their place in a shard (``pwrite``, or the shard's direct writes), hashed on the
    way: the sink a worker thread writes a tensor into (:meth:`ShardWriter.at`), with the calls a :class:`ShardWriter`
    receives.

    Args:
        writer: the shard.
        index: the tensor's entry.
        begin: its first byte in the file.
    """

    def __init__(self, writer: ShardWriter, index: int, begin: int):
        self.writer, self.index, self.pos = writer, index, begin
        self.nbytes = 0
        self._sha = hashlib.sha256()

    def write(self, tensor: torch.Tensor) -> None:
        """Write the next rows (in their own dtype, made contiguous on the CPU)."""
        t = tensor.detach().to("cpu").contiguous()
        if t.numel() == 0:
            return
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
        self._sha.update(view)
        self._pwrite(view)

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` from another file, hashing them as read (the digest needs the bytes: read once); past the
        page cache, the first piece is cut so that the others start on the file's blocks (whole blocks, written
        direct, not shared ones)."""
        done = 0
        align = self.writer._direct.align if self.writer._direct else 1
        while done < nbytes:
            want = WRITE_PIECE - self.pos % align if done == 0 else WRITE_PIECE
            piece = os.pread(fd, min(want, nbytes - done), offset + done)
            if not piece:
                raise MergeCheckError(f"source file ended early while copying into {self.writer.path}")
            self._sha.update(piece)
            self._pwrite(memoryview(piece))
            done += len(piece)

    def _pwrite(self, view: memoryview) -> None:
        if self.writer._direct:  # past the page cache, in pieces of its own (nothing for the flusher but the tail)
            self.writer._direct.pwrite(view, self.pos)
            self.pos, self.nbytes = self.pos + len(view), self.nbytes + len(view)
            return
        fd = self.writer._fd
        while view:
            n = os.pwrite(fd, view[:WRITE_PIECE], self.pos)
            view, self.pos, self.nbytes = view[n:], self.pos + n, self.nbytes + n
            self.writer._wrote(n)

    def finish(self) -> None:
        """Record the tensor as written, with its digest.

        Raises:
            MergeCheckError: it was written twice, or its size is not the planned one.
        """
        self.writer._placed_tensor(self.index, self.nbytes, self._sha.hexdigest())


def shard_digest(record: dict) -> str:
    """One digest of a shard from its record (size, header SHA-256, each tensor's byte range and SHA-256): the bytes
    of the file decide it, and the writer has it without hashing the file a second time.

    Args:
        record: a shard's record (:meth:`ShardWriter.record`, :func:`~peft_shardmerge.output.record.shard_record`).

    Returns:
        64 hex characters.

    Example:
        >>> shard_digest({"size": 8, "header": {"size": 8, "sha256": "0"}, "tensors": {}})[:8]
        '92797f79'
    """
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def write_json(path: str, data: dict) -> None:
    """Write a JSON file the way transformers does (indent 2, sorted keys, trailing newline), fsynced.

    Args:
        path: the file.
        data: the object.

    Raises:
        OSError: the file cannot be written.
        TypeError: ``data`` is not JSON-serializable.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "config.json")
        >>> write_json(path, {"vocab_size": 32000, "model_type": "llama"})
        >>> print(open(path).read(), end="")
        {
          "model_type": "llama",
          "vocab_size": 32000
        }
    """
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
