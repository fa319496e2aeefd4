"""The option vocabulary shared by both paths (disk and a loaded model): output dtypes, sizes and the frozen merge
options."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import torch

from .errors import InputError
from .quant.nf4 import Nf4Settings
from .support.combinations import check_weights, task_vector_problems

OUTPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


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
        dtype: ``None`` or ``"auto"`` (keep the base's), ``"bfloat16"``/``"float16"``/``"float32"`` (``"bf16"``,
            ``"fp16"``, ``"fp32"``, ``"torch.bfloat16"`` too) or the torch dtype.

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


#: when a merge from disk runs its model-class checks (:mod:`peft_shardmerge.api.model_checks`)
MODEL_CHECKS = ("auto", "first", "beside")
#: where the merge maths may run (``"cuda:N"`` too)
DEVICES = ("auto", "cpu", "cuda")

#: what the disk path merges into: what reproduces the trained model (the 4-bit round trip where the adapter's files
#: show a 4-bit base, else the checkpoint's weights), the checkpoint's weights, or their 4-bit round trip (QLoRA)
BASE_PRECISIONS = ("auto", "original", "nf4")
#: what a loaded model's merge merges into: the best available, the original checkpoint, or the weights in memory
MODEL_BASE_PRECISIONS = ("auto", "original", "dequantized")
#: the two paths: a checkpoint on disk (merge_checkpoint) and a loaded model (merge_and_save)
DISK, MODEL = "disk", "model"
#: the in-process entries' keywords named as PEFT names them, and the option fields they set
PEFT_NAMES = {"combination_type": "combination", "majority_sign_method": "majority_sign"}
_PATH_DEFAULTS = {DISK: {"base_precision": "auto"}, MODEL: {"base_precision": "auto"}}
#: knobs that mean something on one path only, with what to use on the other
_ONE_PATH = {
    "nf4_quant_type": (DISK, "the 4-bit settings of base_precision='nf4' apply to merges from disk"),
    "nf4_blocksize": (DISK, "the 4-bit settings of base_precision='nf4' apply to merges from disk"),
    "nf4_double_quant": (DISK, "the 4-bit settings of base_precision='nf4' apply to merges from disk"),
    "nf4_skip_modules": (DISK, "the 4-bit settings of base_precision='nf4' apply to merges from disk"),
    "device": (
        DISK,
        "device applies to merges from disk; a loaded model merges where its weights are, within maximum_memory_usage",
    ),
    "resume": (DISK, "resume applies to merges from disk"),
    "model_checks": (DISK, "model_checks applies to merges from disk; a loaded model's class is already built"),
    "maximum_memory_usage": (
        MODEL,
        "maximum_memory_usage applies to merges of a loaded model; from disk, device= chooses where the maths runs",
    ),
}


def _bool_problem(name: str, value) -> list[str]:
    return [] if isinstance(value, bool) else [f"{name} must be True or False, got {value!r}"]


@dataclass(frozen=True)
class MergeOptions:
    """How a merge runs: one frozen value for the knobs of both paths, from disk
    (:func:`~peft_shardmerge.api.disk.merge_checkpoint`, :func:`~peft_shardmerge.api.disk.plan_checkpoint_merge`) and
    of a
    loaded model (:func:`~peft_shardmerge.api.inprocess.merge_and_save`,
    :func:`~peft_shardmerge.api.model_plan.plan_model_merge`); their keywords of the same names build one
    (``combination_type``, PEFT's name, is ``combination``). A knob that means something on one path only is
    refused on the other when set.

    Building one never raises; :meth:`problems` lists every problem at once and :meth:`check` raises them.
    ``dtype`` and ``max_shard_size`` are parsed once, when the options are made: :attr:`out_dtype` and
    :attr:`shard_bytes` give the parsed values to the planners.

    Attributes:
        weights: one weight per adapter (None: 1.0 each); kept as a tuple.
        combination: ``"cat"``, ``"linear"``, or a task-vector method: ``"ties"``, ``"dare_ties"``,
            ``"dare_linear"``, ``"magnitude_prune"``
            (:data:`~peft_shardmerge.support.combinations.TASK_VECTOR_METHODS`).
        density: the fraction of each adapter's delta a task-vector method keeps, in (0, 1] (required by them).
        majority_sign: ``"total"`` or ``"frequency"``: how ``ties`` and ``dare_ties`` elect each element's sign
            (``majority_sign_method`` in process, PEFT's name).
        normalize: divide by the weights of the deltas kept at each element; None: the method's default (True for
            ``ties`` only, as in MergeKit).
        seed: the seed of DARE's random draw (``dare_ties``, ``dare_linear``).
        dtype: output dtype (``"bfloat16"``, ``"float16"``, ``"float32"``, a torch dtype), None keeps the base's.
        max_shard_size: largest output shard, bytes or a string such as ``"5GB"``.
        base_precision: from disk ``"auto"``, ``"original"`` or ``"nf4"``; for a loaded model ``"auto"``,
            ``"original"`` or ``"dequantized"``; None (the default) is ``"auto"`` on both: reproduce the trained
            model.
        nf4_quant_type: ``"nf4"`` or ``"fp4"`` (``base_precision="nf4"``).
        nf4_blocksize: 4-bit block size used in training.
        nf4_double_quant: whether training used double quantization.
        nf4_skip_modules: modules training kept unquantized (``llm_int8_skip_modules``); ``auto`` reads them from
            the adapter's files.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        overwrite: allow replacing a non-empty output folder.
        progress: show a progress bar.
        chunk_elems: elements per row block (bounds peak memory).
        resume: keep the verified shards of an interrupted run of the same merge (from disk).
        workers: tensors in flight at once, each on its own thread: from disk, each merged and written there; a loaded
            model's modules are merged in order on the caller's thread and written by the workers. None: one per
            CPU, at most 8.
        model_checks: when a merge from disk builds the model class on the meta device and asks PEFT which adapter
            tensors it loads: ``"first"``, before anything is read; ``"beside"``, in a second process while the merge
            streams the plan made from the files, the two plans compared before the commit (the merge is made again
            if they differ; an error is raised with nothing committed); ``"auto"`` (the default): beside where this
            process has not imported PEFT yet and has two CPUs or more (a fresh command line), else first.
        maximum_memory_usage: fraction (0, 0.95] of accelerator memory a loaded model's merge may occupy.
        split_max_size: a GGUF output split into files of at most this many bytes of tensors, as llama.cpp's
            converter splits them (``"2G"``: powers of 1000, as its ``--split-max-size``); 0 writes one file.
        outtype: the GGUF type of an output ending in ``.gguf`` (:data:`~peft_shardmerge.support.outtypes.OUTTYPES`,
            Unsloth's names too); None is ``"auto"``, the base's 16-bit type.
        quantize: the served format the merged weights are written in
            (:data:`~peft_shardmerge.quant.encode.NAMES`: ``"fp8-block"``, ``"ct-fp8-block"``, ``"ct-w4a16"``,
            ``"nf4"``, ``"fp4"``, ``"int8"``, or ``"base"``, the base checkpoint's own); None: the merge's dtype.

    Example:
        >>> MergeOptions(dtype="bf16", chunk_elems=0).problems()
        ['chunk_elems must be a positive int, got 0']
        >>> opts = MergeOptions(dtype="bf16", max_shard_size="2GiB")
        >>> opts.out_dtype, opts.shard_bytes
        (torch.bfloat16, 2147483648)
    """

    weights: Sequence[float] | None = None
    combination: str = "cat"
    density: float | None = None
    majority_sign: str = "total"
    normalize: bool | None = None
    seed: int = 0
    dtype: str | torch.dtype | None = None
    max_shard_size: int | str = "5GB"
    base_precision: str | None = None
    nf4_quant_type: str = "nf4"
    nf4_blocksize: int = 64
    nf4_double_quant: bool = True
    nf4_skip_modules: tuple[str, ...] = ()
    device: str = "auto"
    overwrite: bool = False
    progress: bool = True
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    resume: bool = True
    workers: int | None = None
    model_checks: str = "auto"
    maximum_memory_usage: float = 0.9
    outtype: str | None = None
    split_max_size: int | str = 0
    quantize: str | None = None
    # dtype and max_shard_size parsed once, in __post_init__: the value, or the problems of one that does not parse
    _out_dtype: torch.dtype | None = field(default=None, init=False, repr=False, compare=False)
    _shard_bytes: int = field(default=0, init=False, repr=False, compare=False)
    _unparsed: dict[str, list[str]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        weights = self.weights
        if weights is not None and not isinstance(weights, (str, bytes)) and hasattr(weights, "__iter__"):
            object.__setattr__(self, "weights", tuple(self.weights))
        unparsed: dict[str, list[str]] = {}
        for name, parse, private in (
            ("dtype", parse_dtype, "_out_dtype"),
            ("max_shard_size", parse_size, "_shard_bytes"),
        ):
            try:
                object.__setattr__(self, private, parse(getattr(self, name)))
            except InputError as e:
                unparsed[name] = e.problems
        object.__setattr__(self, "_unparsed", unparsed)

    @property
    def out_dtype(self) -> torch.dtype | None:
        """The output dtype, parsed from ``dtype`` when the options were made (None keeps the base's).

        Raises:
            InputError: ``dtype`` does not parse (:meth:`problems` names it with the rest).
        """
        self._refuse_unparsed("dtype")
        return self._out_dtype

    @property
    def shard_bytes(self) -> int:
        """The largest output shard in bytes, parsed from ``max_shard_size`` when the options were made.

        Raises:
            InputError: ``max_shard_size`` does not parse (:meth:`problems` names it with the rest).
        """
        self._refuse_unparsed("max_shard_size")
        return self._shard_bytes

    def _refuse_unparsed(self, name: str) -> None:
        if name in self._unparsed:  # a value that does not parse never reaches a plan
            raise InputError(self._unparsed[name])

    @property
    def nf4(self) -> Nf4Settings | None:
        """The 4-bit settings for ``base_precision="nf4"``, else None."""
        if self.base_precision != "nf4":
            return None
        return Nf4Settings(
            self.nf4_quant_type, self.nf4_blocksize, self.nf4_double_quant, tuple(self.nf4_skip_modules)
        )

    def problems(self, path: str = DISK) -> list[str]:
        """Every problem with these options for one path, at once (the number of weights is checked against the
        adapters later).

        Args:
            path: ``"disk"`` (a checkpoint on disk) or ``"model"`` (a loaded model).

        Returns:
            The problems (empty when the options are valid).

        Example:
            >>> len(MergeOptions(dtype="int4", max_shard_size="lots", combination="sum").problems())
            3
            >>> MergeOptions(device="cpu").problems("model")[0][:48]
            "device='cpu': device applies to merges from disk"
        """
        problems = []
        # for a loaded model, weights and combination are checked against its adapters, under PEFT's name
        # combination_type (model_plan.adapter_selection)
        if path == DISK and (self.weights is None or isinstance(self.weights, tuple)):
            problems += check_weights(len(self.weights or ()), self.weights, self.combination)[1]
        elif path == DISK:
            problems.append(f"adapter weights must be finite numbers, got {self.weights!r}")
            problems += check_weights(0, None, self.combination)[1]
        problems += task_vector_problems(
            self.combination,
            self.density,
            self.majority_sign,
            self.normalize,
            self.seed,
            option="combination" if path == DISK else "combination_type",
            sign_option="majority_sign" if path == DISK else "majority_sign_method",
        )
        problems += self._unparsed.get("dtype", []) + self._unparsed.get("max_shard_size", [])
        allowed = BASE_PRECISIONS if path == DISK else MODEL_BASE_PRECISIONS
        if self.base_precision is not None and self.base_precision not in allowed:
            problems.append(f"base_precision must be one of {', '.join(allowed)}, got {self.base_precision!r}")
        elif self.nf4 is not None:
            problems += self.nf4.validate()
        if (
            not isinstance(self.device, torch.device)
            and self.device not in DEVICES
            and not (isinstance(self.device, str) and self.device.startswith("cuda:"))
        ):
            problems.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not isinstance(self.chunk_elems, int) or isinstance(self.chunk_elems, bool) or self.chunk_elems <= 0:
            problems.append(f"chunk_elems must be a positive int, got {self.chunk_elems!r}")
        if self.workers is not None and (
            not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers <= 0
        ):
            problems.append(f"workers must be a positive int or None (one per CPU, at most 8), got {self.workers!r}")
        if self.model_checks not in MODEL_CHECKS:
            problems.append(f"model_checks must be one of {', '.join(MODEL_CHECKS)}, got {self.model_checks!r}")
        for name in ("nf4_double_quant", "overwrite", "progress", "resume"):
            problems += _bool_problem(name, getattr(self, name))
        if self.quantize is not None:
            from .quant.encode import name_problems

            problems += name_problems(self.quantize)
        if self.outtype is not None:
            from .support.outtypes import outtype_problems

            problems += outtype_problems(self.outtype)
        try:
            from .support.outtypes import split_bytes

            split_bytes(self.split_max_size)
        except ValueError as e:
            problems.append(str(e))
        defaults = {f.name: f.default for f in fields(self) if f.init}
        for name, (only, why) in _ONE_PATH.items():
            if only != path and not _same(getattr(self, name), defaults[name]):
                problems.append(f"{name}={getattr(self, name)!r}: {why}")
        return problems

    def for_path(self, path: str) -> "MergeOptions":
        """These options with ``base_precision`` resolved to the path's default when it is None.

        Args:
            path: ``"disk"`` or ``"model"``.

        Returns:
            A :class:`MergeOptions` whose ``base_precision`` is set.

        Example:
            >>> MergeOptions().for_path("model").base_precision
            'auto'
        """
        if self.base_precision is not None:
            return self
        return replace(self, base_precision=_PATH_DEFAULTS[path]["base_precision"])

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
    def from_call(cls, call: dict, *, path: str = DISK) -> tuple["MergeOptions", list[str]]:
        """The options of a public call, from its arguments as its signature names them (``locals()`` as it starts):
        each option field among them (PEFT's ``combination_type`` and ``majority_sign_method`` taken as
        ``combination`` and ``majority_sign``), merged with its ``options=`` by :meth:`merged`'s precedence.

        Args:
            call: the call's arguments by name; those that are no option (the model, the folders) are left out.
            path: ``"disk"`` or ``"model"``: which path's defaults and knobs apply.

        Returns:
            ``(options, problems)`` as :meth:`merged` returns them.

        Example:
            >>> opts, problems = MergeOptions.from_call({"model": None, "combination_type": "linear"})
            >>> opts.combination, problems
            ('linear', [])
        """
        names = {f.name for f in fields(cls) if f.init}
        given = {PEFT_NAMES.get(k, k): v for k, v in call.items() if PEFT_NAMES.get(k, k) in names}
        return cls.merged(call.get("options"), path=path, **given)

    @classmethod
    def merged(cls, options: "MergeOptions | None", *, path: str = DISK, **given) -> tuple["MergeOptions", list[str]]:
        """The options of a call that takes both keywords and ``options=``.

        Precedence, per option: a keyword left at its default defers to ``options``; a keyword set to another
        value wins over an ``options`` field left at its default; a keyword and an ``options`` field both set,
        to different values, are refused.

        Args:
            options: the ``options=`` argument, or None.
            path: ``"disk"`` or ``"model"``: which path's defaults and knobs apply.
            **given: the call's keywords, named as the fields.

        Returns:
            ``(the options with base_precision resolved, problems)``: every conflict, and every problem of the
            result, at once.

        Raises:
            InputError: ``options`` is not a :class:`MergeOptions`.

        Example:
            >>> MergeOptions.merged(MergeOptions(dtype="float16"), dtype="bfloat16")[1]
            ["dtype='bfloat16' conflicts with options.dtype='float16'; give it in one place"]
        """
        if options is None:
            out = cls(**given)
            return out.for_path(path), out.problems(path)
        if not isinstance(options, cls):
            raise InputError(f"options must be a MergeOptions, got {type(options).__name__}")
        values, conflicts = {}, []
        for f in (f for f in fields(cls) if f.init):
            default = _PATH_DEFAULTS[path].get(f.name, f.default)
            mine, theirs = given.get(f.name, default), getattr(options, f.name)
            if f.name in _PATH_DEFAULTS[path] and theirs is None:  # None: the path's own default
                theirs = default
            if f.name == "weights" and mine is not None and hasattr(mine, "__iter__"):
                mine = tuple(mine)
            same = [_equivalent(f.name, a, b) for a, b in ((mine, default), (mine, theirs), (theirs, default))]
            if same[0] or same[1]:
                values[f.name] = theirs
            elif same[2]:
                values[f.name] = mine
            else:
                conflicts.append(f"{f.name}={mine!r} conflicts with options.{f.name}={theirs!r}; give it in one place")
                values[f.name] = theirs
        out = cls(**values)
        return out.for_path(path), conflicts + out.problems(path)


def _equivalent(name: str, a, b) -> bool:
    """Whether two values of a knob mean the same, for comparing a keyword with ``options``: ``"bf16"``,
    ``"bfloat16"`` and ``torch.bfloat16`` do, as do ``"5GB"`` and 5e9 bytes; a value that does not parse is compared
    as given."""
    parse = {"dtype": parse_dtype, "max_shard_size": parse_size}.get(name)
    if parse is not None:
        try:
            return _same(parse(a), parse(b))
        except InputError:
            pass
    return _same(a, b)


def _same(a, b) -> bool:
    """Equal, and of the same kind (``True`` is not ``1``)."""
    return type(a) is type(b) and a == b
