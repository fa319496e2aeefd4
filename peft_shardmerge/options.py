"""The option vocabulary shared by every API: output dtypes and sizes."""

from __future__ import annotations

import re

import torch

from .errors import InputError

OUTPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Parse a shard size: an int of bytes, or a string such as ``"5GB"`` (decimal) or ``"512MiB"`` (binary).

    Args:
        size: bytes as an int, or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).

    Returns:
        The size in bytes.

    Raises:
        InputError: not a positive size.

    Example:
        >>> parse_size("5GB"), parse_size("1MiB"), parse_size(1000)
        (5000000000, 1048576, 1000)
    """
    if isinstance(size, bool):
        raise InputError(f"max_shard_size must be a size such as '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE_RE.match(str(size))
        if not m or m.group(2).upper() not in _UNITS:
            raise InputError(f"max_shard_size {size!r} is not a size; write e.g. '5GB', '500MB' or '2GiB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise InputError(f"max_shard_size must be positive, got {size!r}")
    return value


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Parse an output dtype: ``None``, a ``torch.dtype`` or its name.

    Args:
        dtype: ``None`` or ``"auto"`` (keep the base's), ``"bfloat16"``/``"float16"``/``"float32"`` (``"bf16"``, ``"fp16"``,
            ``"fp32"``, ``"torch.bfloat16"`` too) or the torch dtype.

    Returns:
        The torch dtype, or None.

    Raises:
        InputError: any other value.

    Example:
        >>> parse_dtype("bf16")
        torch.bfloat16
    """
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in OUTPUT_DTYPES.values():
        return dtype
    if dtype == "auto":  # transformers' spelling of "the checkpoint's own"
        return None
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    name = str(dtype).removeprefix("torch.")
    name = aliases.get(name, name)
    if name not in OUTPUT_DTYPES:
        raise InputError(f"dtype {dtype!r} is not supported; use one of {', '.join(OUTPUT_DTYPES)}")
    return OUTPUT_DTYPES[name]


#: elements of one row block of a tensor (16 MiB in fp32)
DEFAULT_CHUNK_ELEMS = 1 << 22
