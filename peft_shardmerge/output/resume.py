"""What a resumed merge may reuse: digests of the input bytes each output shard is computed from."""

from __future__ import annotations

import os
import struct
import threading

from zlib_ng.zlib_ng import crc32  # zlib's CRC-32, computed with the CPU's carry-less multiply

_PIECE = 8 << 20
#: the adapter files PEFT and this package read
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


class Crc32:
    """A running CRC-32 with a hashlib-like interface: fast (GB/s), and enough to tell changed input bytes from the
    ones a kept shard was computed from. Not a defence against tampering.

    Example:
        >>> h = Crc32(); h.update(b"abc"); h.hexdigest()
        '352441c2'
    """

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        """Add bytes."""
        self.value = crc32(data, self.value)

    def hexdigest(self) -> str:
        """The digest as 8 hex characters."""
        return f"{self.value:08x}"


def range_digest(ranges: list[tuple[str, int, int]], stop: threading.Event | None = None) -> str:
    """CRC-32 of the bytes of ``(path, offset, nbytes)`` ranges, in order (each range's path and place included).

    Args:
        ranges: the byte ranges.
        stop: when it is set, the reading stops (``"stopped"`` is returned: a merge that is stopping records nothing).

    Returns:
        8 hex characters, or ``"missing"`` when a file cannot be read or is shorter than a range.

    Example:
        >>> range_digest([])
        '00000000'
    """
    h = Crc32()
    try:
        for path, offset, nbytes in ranges:
            h.update(f"{path}\0{offset}\0{nbytes}\0".encode(errors="surrogateescape"))
            with open(path, "rb") as f:
                f.seek(offset)
                left = nbytes
                while left:
                    if stop is not None and stop.is_set():
                        return "stopped"
                    piece = f.read(min(left, _PIECE))
                    if not piece:
                        return "missing"
                    h.update(piece)
                    left -= len(piece)
    except OSError:
        return "missing"
    return h.hexdigest()


def _whole(path: str) -> tuple[str, int, int]:
    return path, 0, os.path.getsize(path)


def _header(path: str) -> tuple[str, int, int]:
    """The header of a safetensors file: its 8-byte length and the JSON (names, dtypes, shapes, offsets)."""
    with open(path, "rb") as f:
        head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    return path, 0, 8 + min(n, os.path.getsize(path))


class InputDigests:
    """Digests of what a planned merge reads, to tell whether a shard kept from a killed run was computed from
    the same bytes.

    ``common()`` covers what every shard depends on: the adapters' files whole, the base's ``config.json`` and
    index, and the header of every base safetensors file. ``shard(name)`` covers the data ranges of the base (or
    adapter) tensors that shard's tensors are read from. Content, not size and modification time, decides.

    Args:
        plan: the :class:`~peft_shardmerge.engine.plan.Plan`.
    """

    def __init__(self, plan):
        self.plan = plan
        self._ranges: dict[str, list[tuple[str, int, int]]] = {}
        for t in plan.tensors:
            self._ranges.setdefault(plan.shard_names[t.shard], []).extend(
                (s.path, s.offset, s.nbytes) for s in t.stored
            )

    def common(self) -> str:
        """The digest of the inputs every shard depends on (``"missing"`` when one cannot be read)."""
        try:
            ranges = []
            for folder in self.plan.inputs.adapter.folders:
                ranges += [
                    _whole(os.path.join(folder, n)) for n in ADAPTER_FILES if os.path.isfile(os.path.join(folder, n))
                ]
            base = self.plan.inputs.base.folder
            ranges += [
                _whole(os.path.join(base, n))
                for n in ("config.json", "model.safetensors.index.json")
                if os.path.isfile(os.path.join(base, n))
            ]
            ranges += [_header(p) for p in sorted({t.path for t in self.plan.inputs.base.stored})]
        except OSError:
            return "missing"
        return range_digest(ranges)

    def shard(self, name: str, stop: threading.Event | None = None) -> str:
        """The digest of the tensor data shard ``name`` is computed from (see :func:`range_digest` for ``stop``)."""
        return range_digest(self._ranges.get(name, []), stop)
