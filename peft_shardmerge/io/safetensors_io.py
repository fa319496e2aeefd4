"""The safetensors file format: parsing headers, reading tensor rows in bounded pieces, building headers."""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptFileError

#: safetensors dtype name -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "C64": (torch.complex64, 8),
}
for _name, _attr, _size in (
    ("F8_E4M3", "float8_e4m3fn", 1),
    ("F8_E5M2", "float8_e5m2", 1),
    ("F8_E8M0", "float8_e8m0fnu", 1),
    ("U16", "uint16", 2),
    ("U32", "uint32", 4),
    ("U64", "uint64", 8),
):
    if hasattr(torch, _attr):
        DTYPES[_name] = (getattr(torch, _attr), _size)

TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
#: dtypes safetensors knows that this version cannot read (sub-byte floats)
UNREADABLE_DTYPES = ("F4", "F6_E2M3", "F6_E3M2")
#: the largest dimension torch can represent (safetensors accepts up to 2**64 - 1, torch cannot read that)
MAX_DIM = 2**63 - 1

#: largest JSON header we accept (safetensors itself caps it at 100 MB)
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives inside a safetensors file.

    Attributes:
        name: the tensor's key in the file.
        dtype: safetensors dtype name, e.g. ``"BF16"``.
        shape: the tensor's shape.
        path: the file holding it.
        offset: absolute byte offset of its data in the file.
        nbytes: size of its data in bytes.
        decoder: for a tensor of a quantized checkpoint, what computes its dequantized rows
            (:class:`~peft_shardmerge.quant.formats.Decoder`); ``dtype``, ``shape`` and ``nbytes`` are then those of
            the dequantized tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    offset: int
    nbytes: int
    decoder: Any = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


def read_header(path: str, *, check: bool = True) -> tuple[list[TensorInfo], dict[str, str]]:
    """Parse a safetensors file's header without reading any tensor data.

    Args:
        path: the ``.safetensors`` file.
        check: also open it with safetensors (:func:`check_with_safetensors`, which maps the whole file); False
            leaves that to the caller, e.g. until the free space for the output has been checked.

    Returns:
        ``(tensors, metadata)``: the tensors in the order of their data in the file, and the
        ``__metadata__`` string map (empty when absent).

    Raises:
        CorruptFileError: the header length, JSON, dtypes, shapes or offsets are invalid, bytes follow the last
            tensor's data, a tensor is stored in a sub-byte dtype this version cannot read (``F4``, ``F6_*``), or
            ``safetensors.safe_open`` itself refuses the file (every file read is also opened by
            safetensors, so nothing it rejects is ever merged).
        InputError: the file cannot be mapped into memory (``check``; see :func:`check_with_safetensors`).
        FileNotFoundError: the file does not exist.

    Example:
        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_file({"w": torch.arange(6.0).reshape(3, 2)}, path, metadata={"format": "pt"})
        >>> tensors, meta = read_header(path)
        >>> tensors[0].name, tensors[0].dtype, tensors[0].shape, meta
        ('w', 'F32', (3, 2), {'format': 'pt'})
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptFileError(f"{path}: file is {size} bytes, too short to be safetensors; re-save it")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
            raise CorruptFileError(
                f"{path}: header length {hlen} is beyond the file ({size} bytes); the file is truncated "
                "or not safetensors"
            )
        raw = f.read(hlen)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptFileError(f"{path}: header is not valid JSON ({e}); the file is corrupted") from e
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: header is not a JSON object; the file is corrupted")
    data_start = 8 + hlen
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptFileError(f"{path}: __metadata__ is not an object of strings; the file is corrupted")
    tensors = [_entry(path, name, entry, data_start, size) for name, entry in header.items()]
    tensors.sort(key=lambda t: (t.offset, t.nbytes))  # safetensors orders by (begin, end): empty tensors first
    pos = data_start
    for t in tensors:
        if t.offset != pos:
            raise CorruptFileError(f"{path}: tensor {t.name!r} overlaps another or leaves a gap in the data")
        pos += t.nbytes
    if pos != size:
        raise CorruptFileError(
            f"{path}: {size - pos} byte(s) follow the last tensor's data; safetensors refuses "
            "such a file (the file is corrupted or was appended to)"
        )
    if check:
        check_with_safetensors(path)
    return tensors, dict(metadata)


def _entry(path: str, name: str, entry: object, data_start: int, size: int) -> TensorInfo:
    """One header entry, checked: its dtype, shape and offsets, inside a file of ``size`` bytes."""
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError) as e:
        raise CorruptFileError(f"{path}: entry {name!r} lacks dtype/shape/data_offsets") from e
    if dtype in UNREADABLE_DTYPES:
        raise CorruptFileError(
            f"{path}: tensor {name!r} is stored as {dtype} (sub-byte floats), which this "
            "version cannot read; merge into a 16-bit checkpoint of the model"
        )
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CorruptFileError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise CorruptFileError(
            f"{path}: tensor {name!r} has shape {shape!r}; a shape is a list of integers from 0 to 2**63 - 1"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets):
        raise CorruptFileError(
            f"{path}: tensor {name!r} has data_offsets {offsets!r}; they are two integers from 0 to 2**63 - 1"
        )
    shape, (begin, end) = tuple(shape), offsets
    info = TensorInfo(name, dtype, shape, path, data_start + begin, end - begin)
    if end < begin or info.nbytes != info.numel * DTYPES[dtype][1]:
        raise CorruptFileError(
            f"{path}: tensor {name!r} offsets [{begin}, {end}) do not fit its dtype {dtype} and shape {list(shape)}"
        )
    if data_start + end > size:
        raise CorruptFileError(f"{path}: tensor {name!r} ends beyond the file; the file is truncated")
    return info


def _is_count(x: object) -> bool:
    """A JSON value safetensors reads as a size and torch can represent: an int (not a bool) in [0, 2**63)."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_DIM


def check_with_safetensors(path: str) -> None:
    """Open a file with safetensors itself, which validates the header the way every reader of the checkpoint will;
    anything it refuses is refused here too. safetensors maps the whole file: a mapping the process's address space
    or memory cannot hold is refused by name, never let out as a raw ``RuntimeError``.

    Args:
        path: a ``.safetensors`` file whose header :func:`read_header` accepted.

    Returns:
        None.

    Raises:
        CorruptFileError: safetensors refuses the file.
        InputError: the file cannot be mapped: the address-space limit (``ulimit -v``) or the memory is too small.

    Example:
        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> path = os.path.join(tempfile.mkdtemp(), "one.safetensors")
        >>> save_file({"w": torch.zeros(2)}, path)
        >>> check_with_safetensors(path)
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt"):
            pass
    except (RuntimeError, MemoryError, OSError) as e:
        if not _mapping_failed(e):
            if isinstance(e, OSError):
                raise CorruptFileError(
                    f"{path}: safetensors refuses the file ({str(e).splitlines()[0]}); the file "
                    "is corrupted; re-save it"
                ) from e
            raise
        from ..errors import InputError

        raise InputError(
            f"{path} ({os.path.getsize(path)} bytes) cannot be mapped into memory to be read: this "
            "process's address space or memory is too small for it (an address-space limit such as "
            "`ulimit -v`, or a memory limit); raise the limit (e.g. `ulimit -v unlimited`) or run the "
            "merge where more memory is available"
        ) from None
    except (SafetensorError, ValueError, TypeError, OverflowError) as e:
        raise CorruptFileError(
            f"{path}: safetensors refuses the file ({str(e).splitlines()[0]}); the file is corrupted; re-save it"
        ) from e


def _mapping_failed(e: BaseException) -> bool:
    """Whether an error from opening a file with safetensors is a failed memory mapping (ENOMEM), not a bad file."""
    import errno

    text = str(e)
    return (
        isinstance(e, MemoryError)
        or getattr(e, "errno", None) == errno.ENOMEM
        or "unable to mmap" in text
        or "Cannot allocate memory" in text
    )


class RowReader:
    """Reads rows of tensors from safetensors files with ``pread`` into one reusable buffer per thread.

    Memory stays at the largest piece requested (per thread reading): nothing is memory-mapped, so the kernel does
    not count file pages as resident memory. Several threads may read at once.

    Example:
        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_file({"w": torch.arange(6.0).reshape(3, 2)}, path)
        >>> info = read_header(path)[0][0]
        >>> with RowReader() as reader:
        ...     reader.read_rows(info, 1, 3).clone()
        tensor([[2., 3.],
                [4., 5.]])
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def fd(self, path: str) -> int:
        """Return a cached read-only file descriptor for ``path``."""
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def buffer_bytes(self) -> int:
        """The size of this thread's read buffer (the most it read at once)."""
        return len(getattr(self._local, "buf", b""))

    def _buffer(self, nbytes: int) -> memoryview:
        """This thread's read buffer, grown to at least ``nbytes``."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def read_rows(self, info: TensorInfo, start: int, stop: int) -> torch.Tensor:
        """Read rows ``[start, stop)`` of a tensor (dimension 0).

        The returned tensor is a view of the reader's buffer: convert or copy it before the next read.

        Args:
            info: the tensor.
            start: first row.
            stop: one past the last row.

        Returns:
            A tensor of shape ``(stop - start, *info.shape[1:])`` in the file's dtype (for a quantized
            checkpoint's tensor, an independent tensor of its dequantized rows in ``info.dtype``).

        Raises:
            CorruptFileError: the file ended early.
        """
        if info.decoder is not None:  # a quantized checkpoint's tensor: its rows dequantized from what is stored
            return info.decoder.rows(self, start, stop)
        if not info.shape:
            start, stop, row_elems = 0, 1, 1
        else:
            row_elems = info.numel // info.shape[0] if info.shape[0] else 0
        item = DTYPES[info.dtype][1]
        nbytes = (stop - start) * row_elems * item
        view = self._buffer(nbytes)
        fd = self.fd(info.path)
        got, off = 0, info.offset + start * row_elems * item
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], off + got)
            if n <= 0:
                raise CorruptFileError(f"{info.path}: file ended while reading {info.name!r}")
            got += n
        shape = info.shape[1:] if info.shape else ()
        if nbytes == 0:
            return torch.empty((stop - start, *shape), dtype=info.torch_dtype)
        t = torch.frombuffer(view, dtype=info.torch_dtype)
        return t.reshape((stop - start, *shape)) if info.shape else t.reshape(())

    def read(self, info: TensorInfo) -> torch.Tensor:
        """Read a whole tensor as an independent copy (for small tensors such as LoRA factors)."""
        rows = info.shape[0] if info.shape else 1
        return self.read_rows(info, 0, rows).clone()

    def close(self) -> None:
        """Close every file descriptor and drop the read buffers (every thread's)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self._local = threading.local()

    def __enter__(self) -> "RowReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """Build the 8-byte length plus JSON header of a safetensors file.

    Args:
        entries: ``(name, dtype, shape, nbytes)`` for each tensor, in the order their data will follow.
        metadata: the ``__metadata__`` string map (``{"format": "pt"}`` for transformers).

    Returns:
        The bytes to write before the tensor data; the header is padded with spaces to 8 bytes.

    Raises:
        TypeError: a name or metadata value is not JSON-serializable.

    Example:
        >>> len(build_header([("w", "F32", (2,), 8)], {"format": "pt"})) % 8
        0
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def row_blocks(shape: tuple[int, ...], max_elems: int) -> list[tuple[int, int]]:
    """Split dimension 0 of ``shape`` into ``(start, stop)`` blocks of at most ``max_elems`` elements.

    A block always holds at least one row, so a single row larger than ``max_elems`` is its own block. A tensor
    with no elements (any dimension 0) is one empty block, whatever its number of rows.

    Args:
        shape: the tensor shape; a scalar counts as one row.
        max_elems: the element budget per block.

    Returns:
        The blocks, covering every row once, in order.

    Example:
        >>> row_blocks((10, 4), 16)
        [(0, 4), (4, 8), (8, 10)]
        >>> row_blocks((2**62, 0), 16)   # zero bytes: one empty block, not 2**58 of them
        [(0, 4611686018427387904)]
    """
    if not shape:
        return [(0, 1)]
    rows = shape[0]
    per_row = 1
    for s in shape[1:]:
        per_row *= s
    if rows == 0 or per_row == 0:  # no data at all, however many rows are declared: one empty block
        return [(0, rows)]
    step = max(1, max_elems // per_row)
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]
