"""The option vocabulary shared by every API: output dtypes, sizes and the frozen merge options."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from .combinations import check_weights
from .errors import InputError
from .quant import Nf4Settings

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


#: where the merge maths may run (``"cuda:N"`` too)
DEVICES = ("auto", "cpu", "cuda")

#: what the disk path merges into: the checkpoint's weights, or their 4-bit round trip (QLoRA)
BASE_PRECISIONS = ("original", "nf4")


def _bool_problem(name: str, value) -> list[str]:
    return [] if isinstance(value, bool) else [f"{name} must be True or False, got {value!r}"]


@dataclass(frozen=True)
class MergeOptions:
    """How a disk merge runs: one frozen value for every knob of :func:`~peft_shardmerge.api.merge_checkpoint` and
    :func:`~peft_shardmerge.api.plan_checkpoint_merge` (their keywords of the same names build one).

    Building one never raises; :meth:`problems` lists every problem at once and :meth:`check` raises them.

    Attributes:
        weights: one weight per adapter (None: 1.0 each); kept as a tuple.
        combination: ``"cat"`` or ``"linear"``.
        dtype: output dtype (``"bfloat16"``, ``"float16"``, ``"float32"``, a torch dtype), None keeps the base's.
        max_shard_size: largest output shard, bytes or a string such as ``"5GB"``.
        base_precision: ``"original"`` or ``"nf4"``.
        nf4_quant_type: ``"nf4"`` or ``"fp4"`` (``base_precision="nf4"``).
        nf4_blocksize: 4-bit block size used in training.
        nf4_double_quant: whether training used double quantization.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        overwrite: allow replacing a non-empty output folder.
        progress: show a progress bar.
        chunk_elems: elements per row block (bounds peak memory).
        resume: keep the verified shards of an interrupted run of the same merge.

    Example:
        >>> MergeOptions(dtype="bf16", chunk_elems=0).problems()
        ['chunk_elems must be a positive int, got 0']
    """

    weights: Sequence[float] | None = None
    combination: str = "cat"
    dtype: str | torch.dtype | None = None
    max_shard_size: int | str = "5GB"
    base_precision: str = "original"
    nf4_quant_type: str = "nf4"
    nf4_blocksize: int = 64
    nf4_double_quant: bool = True
    device: str = "auto"
    overwrite: bool = False
    progress: bool = True
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    resume: bool = True

    def __post_init__(self) -> None:
        weights = self.weights
        if weights is not None and not isinstance(weights, (str, bytes)) and hasattr(weights, "__iter__"):
            object.__setattr__(self, "weights", tuple(self.weights))

    @property
    def nf4(self) -> Nf4Settings | None:
        """The 4-bit settings for ``base_precision="nf4"``, else None."""
        if self.base_precision != "nf4":
            return None
        return Nf4Settings(self.nf4_quant_type, self.nf4_blocksize, self.nf4_double_quant)

    def problems(self) -> list[str]:
        """Every problem with these options, at once (the number of weights is checked against the adapters later).

        Returns:
            The problems (empty when the options are valid).

        Raises:
            Nothing.

        Example:
            >>> len(MergeOptions(dtype="int4", max_shard_size="lots", combination="sum").problems())
            3
        """
        problems = []
        if self.weights is None or isinstance(self.weights, tuple):  # the one check, as combine_adapters runs it
            problems += check_weights(len(self.weights or ()), self.weights, self.combination)[1]
        else:
            problems.append(f"adapter weights must be finite numbers, got {self.weights!r}")
            problems += check_weights(0, None, self.combination)[1]
        for parse, value in ((parse_dtype, self.dtype), (parse_size, self.max_shard_size)):
            try:
                parse(value)
            except InputError as e:
                problems += e.problems
        if self.base_precision not in BASE_PRECISIONS:
            problems.append(f"base_precision must be one of {', '.join(BASE_PRECISIONS)}, got {self.base_precision!r}")
        elif self.nf4 is not None:
            problems += self.nf4.validate()
        if not isinstance(self.device, torch.device) and self.device not in DEVICES and not (
                isinstance(self.device, str) and self.device.startswith("cuda:")):
            problems.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not isinstance(self.chunk_elems, int) or isinstance(self.chunk_elems, bool) or self.chunk_elems <= 0:
            problems.append(f"chunk_elems must be a positive int, got {self.chunk_elems!r}")
        for name in ("nf4_double_quant", "overwrite", "progress", "resume"):
            problems += _bool_problem(name, getattr(self, name))
        return problems

    def check(self) -> "MergeOptions":
        """Raise every problem at once, or return the options.

        Returns:
            ``self``.

        Raises:
            InputError: the options have problems (all named).

        Example:
            >>> MergeOptions(dtype="bfloat16").check().dtype
            'bfloat16'
        """
        problems = self.problems()
        if problems:
            raise InputError(problems)
        return self

    @classmethod
    def merged(cls, options: "MergeOptions | None", **given) -> tuple["MergeOptions", list[str]]:
        """The options of a call that takes both keywords and ``options=``.

        Precedence, per option: a keyword left at its default defers to ``options``; a keyword set to another
        value wins over an ``options`` field left at its default; a keyword and an ``options`` field both set,
        to different values, are refused.

        Args:
            options: the ``options=`` argument, or None.
            **given: the call's keywords, named as the fields.

        Returns:
            ``(the options, problems)``: every conflict, and every problem of the result, at once.

        Raises:
            InputError: ``options`` is not a :class:`MergeOptions`.

        Example:
            >>> MergeOptions.merged(MergeOptions(dtype="float16"), dtype="bfloat16")[1]
            ["dtype='bfloat16' conflicts with options.dtype='float16'; give it in one place"]
        """
        if options is None:
            out = cls(**given)
            return out, out.problems()
        if not isinstance(options, cls):
            raise InputError(f"options must be a MergeOptions, got {type(options).__name__}")
        values, conflicts = {}, []
        for f in fields(cls):
            mine, theirs = given.get(f.name, f.default), getattr(options, f.name)
            if f.name == "weights" and mine is not None and hasattr(mine, "__iter__"):
                mine = tuple(mine)
            same = [_same(_canonical(f.name, a), _canonical(f.name, b)) for a, b in ((mine, f.default),
                                                                                       (mine, theirs),
                                                                                       (theirs, f.default))]
            if same[0] or same[1]:
                values[f.name] = theirs
            elif same[2]:
                values[f.name] = mine
            else:
                conflicts.append(f"{f.name}={mine!r} conflicts with options.{f.name}={theirs!r}; give it in one place")
                values[f.name] = theirs
        out = cls(**values)
        return out, conflicts + out.problems()


def _canonical(name: str, value):
    """One spelling per value of a knob (``"bf16"``, ``"bfloat16"`` and ``torch.bfloat16``; ``"5GB"`` and 5e9 bytes),
    for comparing a keyword with ``options``; a value that does not parse is compared as given."""
    parse = {"dtype": parse_dtype, "max_shard_size": parse_size}.get(name)
    try:
        return parse(value) if parse is not None and value is not None else value
    except InputError:
        return value


def _same(a, b) -> bool:
    """Equal, and of the same kind (``True`` is not ``1``)."""
    return type(a) is type(b) and a == b
