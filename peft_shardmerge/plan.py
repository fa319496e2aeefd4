"""The merge plan: every output tensor, its source, the LoRA deltas it receives, its shard and the peak memory."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field

import torch

from .adapter import AdapterSpec, LoraModule
from .errors import InputError
from .model_check import check_model, no_bias_problem
from .model_info import ModelInfo
from .quant import Nf4Settings
from .reading_rules import unmergeable_targets
from .safetensors_io import DTYPES, FLOAT_DTYPES, TORCH_TO_ST, TensorInfo, row_blocks
from .sources import CheckpointSource
from .support import DISK, check_layers, config_variants, raise_if_any

OUTPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BASE_PRECISIONS = ("original", "nf4")
#: elements of one row block of a tensor (16 MiB in fp32)
DEFAULT_CHUNK_ELEMS = 1 << 22
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


@dataclass
class PartOp:
    """A PEFT delta of an in-memory tensor, for one of the checkpoint keys that store it.

    Attributes:
        op: the PEFT layer's change (:class:`~peft_shardmerge.peft_deltas.PeftOp`).
        memory_name: the in-memory tensor, e.g. ``model.layers.0.mlp.experts.gate_up_proj``.
        file_name: the checkpoint key this part is written to.
        count: how many checkpoint keys share the delta.
    """

    op: object
    memory_name: str
    file_name: str
    count: int

    @property
    def key(self) -> str:
        return f"{self.op.key}@{self.file_name}"

    @property
    def kind(self) -> str:
        return "part"


@dataclass
class PlannedTensor:
    """One output tensor and how to make it.

    Attributes:
        name: its name in the output checkpoint.
        out_dtype: safetensors dtype written.
        source: where its base data is read from (a base tensor, or an adapter tensor replacing it).
        from_adapter: True when ``source`` is an adapter tensor (``modules_to_save`` and similar).
        loras: LoRA modules whose weight delta is added.
        bias_loras: LoRA modules whose ``lora_B.bias`` is added (this tensor is a bias).
        transposed: the stored weight is ``[in, out]`` (Conv1D), or an embedding with LoRA (whose delta is
            built transposed).
        quantize: replace the base by dequant(quantize_4bit(base)) before adding deltas.
        shard: index of the output shard.
        token_rows: trainable-token rows (:class:`~peft_shardmerge.adapter.TokenRows`) that replace base rows
            before LoRA deltas are added (PEFT nests the token layer inside the LoRA layer).
        peft_ops: LoHa/LoKr/VeRA deltas and IA3 scalings (:class:`~peft_shardmerge.peft_deltas.PeftOp`).
    """

    name: str
    out_dtype: str
    source: TensorInfo
    from_adapter: bool = False
    loras: list[LoraModule] = field(default_factory=list)
    bias_loras: list[LoraModule] = field(default_factory=list)
    transposed: bool = False
    quantize: bool = False
    shard: int = 0
    token_rows: list = field(default_factory=list)
    peft_ops: list = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        return self.source.numel * DTYPES[self.out_dtype][1]

    @property
    def op(self) -> str:
        """``"copy"`` (bytes unchanged), ``"cast"`` (dtype change only) or ``"merge"``."""
        if self.loras or self.bias_loras or self.quantize or self.token_rows or self.peft_ops:
            return "merge"
        return "copy" if self.out_dtype == self.source.dtype else "cast"


@dataclass
class Plan:
    """Everything the executor will write, decided from headers and configs alone.

    Attributes:
        base: the base checkpoint.
        adapter: the adapter.
        tensors: output tensors in write order.
        shard_names: output file names, in order.
        dtype: the floating-point dtype written.
        base_precision: ``"original"`` or ``"nf4"``.
        nf4: the 4-bit settings when ``base_precision == "nf4"``.
        config: the ``config.json`` to write.
        chunk_elems: elements per row block.
        untied: tied weights written separately because the adapter changed one side.
        notes: things the user should know (logged and kept in the report).
    """

    base: CheckpointSource
    adapter: AdapterSpec
    tensors: list[PlannedTensor]
    shard_names: list[str]
    dtype: torch.dtype
    base_precision: str
    nf4: Nf4Settings | None
    config: dict
    chunk_elems: int
    untied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_parameters(self) -> int:
        return sum(t.source.numel for t in self.tensors)

    @property
    def layer_count(self) -> int:
        """LoRA modules plus PEFT layers (and LoRA-on-parameter wrappers) whose weights change."""
        ops = self.adapter.layers.ops.values() if self.adapter.layers is not None else ()
        return len(self.adapter.modules) + sum(o.attr != "bias" for o in ops)

    def shard_tensors(self, i: int) -> list[PlannedTensor]:
        return [t for t in self.tensors if t.shard == i]

    def index(self) -> dict:
        """The ``model.safetensors.index.json`` content (used when there is more than one shard)."""
        return {
            "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
            "weight_map": {t.name: self.shard_names[t.shard] for t in self.tensors},
        }

    def fingerprint(self) -> str:
        """A digest of everything that decides the output bytes: input files (names, sizes, modification
        times), options and the plan itself. A resumed run keeps earlier shards only when it matches.

        Returns:
            A hex SHA-256 digest.
        """
        import hashlib
        import json
        import os

        from . import __version__

        def files(folder: str) -> list:
            out = []
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                if os.path.isfile(path):
                    st = os.stat(path)
                    out.append([name, st.st_size, st.st_mtime_ns])
            return out

        data = {
            "version": __version__,
            "base": [self.base.folder, files(self.base.folder)],
            "adapter": [[f, files(f)] for f in self.adapter.folders],
            "combination": self.adapter.combination,
            "dtype": str(self.dtype),
            "base_precision": self.base_precision,
            "nf4": self.nf4.describe() if self.nf4 else None,
            "chunk_elems": self.chunk_elems,
            "shards": self.shard_names,
            "tensors": [[t.name, t.out_dtype, t.shard, t.op, [m.key for m in t.loras],
                         [r.key for r in t.token_rows], [o.key for o in t.peft_ops]] for t in self.tensors],
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def peak_bytes(self) -> int:
        """Estimated peak working memory of the executor, beyond the imported libraries."""
        return max((_working_set(t, self.chunk_elems) for t in self.tensors), default=0)

    def describe(self) -> str:
        """A human-readable plan: every tensor with shard, dtype, shape, bytes and operation, then totals."""
        lines = [
            f"base:            {self.base.folder}",
            f"adapter:         {', '.join(self.adapter.folders)}"
            + (f" (combined: {self.adapter.combination})" if self.adapter.combination else ""),
            f"dtype:           {str(self.dtype).removeprefix('torch.')}",
            f"base precision:  {self.base_precision}" + (f" ({self.nf4.describe()})" if self.nf4 else ""),
            f"LoRA modules:    {len(self.adapter.modules)}" if self.adapter.layers is None else
            f"{self.adapter.peft_type} layers: {len(self.adapter.layers.ops)}",
            "",
            f"{'shard':<36} {'tensor':<56} {'dtype':<5} {'shape':<16} {'bytes':>12}  op",
        ]
        for t in self.tensors:
            extra = ""
            if t.loras:
                extra = " +" + ",".join(f"lora(r={m.rank})" for m in t.loras)
            if t.bias_loras:
                extra += " +lora_bias"
            if t.token_rows:
                extra += " +" + ",".join(f"tokens({len(r.indices)})" for r in t.token_rows)
            for o in t.peft_ops:
                extra += f" +{self.adapter.peft_type.lower()}({o.kind})"
            if t.from_adapter:
                extra += " (from adapter)"
            if t.quantize:
                extra += " (4-bit base)"
            lines.append(
                f"{self.shard_names[t.shard]:<36} {t.name:<56} {t.out_dtype:<5} {str(list(t.shape)):<16} "
                f"{t.nbytes:>12}  {t.op}{extra}"
            )
        lines += [
            "",
            f"tensors: {len(self.tensors)}   shards: {len(self.shard_names)}   bytes: {self.total_size}"
            f" ({self.total_size / 1e9:.3f} GB)",
            f"estimated peak working memory: {self.peak_bytes() / 2**20:.1f} MiB",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def assign_shards(sizes: list[int], limit: int) -> tuple[list[int], list[str]]:
    """Split tensors, in write order, into consecutive shards of at most ``limit`` bytes.

    A tensor larger than ``limit`` gets a shard of its own; the order is never changed, so shards can be
    streamed one after the other.

    Args:
        sizes: byte size of each tensor, in write order.
        limit: the largest shard in bytes.

    Returns:
        ``(shard index per tensor, file names)``, named as transformers names them.

    Raises:
        Nothing.

    Example:
        >>> assign_shards([4, 4, 4], 8)
        ([0, 0, 1], ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'])
    """
    indices, shard, size = [], 0, 0
    for n in sizes:
        if size and size + n > limit:
            shard, size = shard + 1, 0
        indices.append(shard)
        size += n
    count = shard + 1
    names = ["model.safetensors"] if count == 1 else [
        f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    return indices, names


def _working_set(t: PlannedTensor, chunk_elems: int) -> int:
    if t.op == "copy":
        return 8 << 20
    src_item, out_item = DTYPES[t.source.dtype][1], DTYPES[t.out_dtype][1]
    factors = sum(4 * (m.a.shape[0] * m.a.shape[1] + m.b.shape[0] * m.b.shape[1]) for m in t.loras)
    if t.quantize:
        n = t.source.numel
        return n * (src_item + 4 * 3 + out_item) + factors
    start, stop = row_blocks(t.shape, chunk_elems)[0]
    n = (stop - start) * (t.source.numel // max(1, t.shape[0] if t.shape else 1))
    return n * (src_item + 4 * 2 + out_item) + factors


def _base_dtype(base: CheckpointSource) -> torch.dtype:
    for key in ("dtype", "torch_dtype"):
        name = base.config.get(key)
        if isinstance(name, str) and name in OUTPUT_DTYPES:
            return OUTPUT_DTYPES[name]
    counts: dict[str, int] = {}
    for t in base.tensors:
        if t.dtype in ("F32", "F16", "BF16"):
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel
    if not counts:
        return torch.float32
    return DTYPES[max(counts, key=counts.get)][0]


def _tie_enabled(config: dict) -> bool:
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return True  # transformers' PretrainedConfig default


def _adapter_of(adapter, mod) -> str:
    """The folder a LoRA module comes from (the adapter of a combination its key names)."""
    folders = getattr(adapter, "folders", None) or [adapter.folder]
    index = mod.key.split(":", 1)[0] if ":" in mod.key else "0"
    return folders[int(index)] if index.isdigit() and int(index) < len(folders) else folders[0]


def shape_mismatch_problems(mismatches: dict[tuple, list[tuple[str, str]]]) -> list[str]:
    """One problem per adapter and kind of module whose LoRA delta does not fit the base weight, naming the adapter
    and the layers (a model of another size gives the same mismatch in every layer).

    Args:
        mismatches: ``(adapter folder, module path, delta shape, base weight name, base shape)``, layer numbers
            written ``*``, -> the ``(module path, base weight name)`` pairs it stands for.

    Returns:
        The problems.

    Raises:
        Nothing.

    Example:
        >>> shape_mismatch_problems({("a1", "model.layers.*.mlp.up_proj", (512, 128), "model.layers.*.mlp.up_proj.weight",
        ...     (256, 128)): [("model.layers.0.mlp.up_proj", ""), ("model.layers.1.mlp.up_proj", "")]})[0][:77]
        "adapter a1: LoRA module 'model.layers.*.mlp.up_proj' (2 layers) gives a delta"
    """
    out = []
    for (folder, pattern, delta, wpattern, base), pairs in mismatches.items():
        path, wname = (f"{pattern!r} ({len(pairs)} layers)", wpattern) if len(pairs) > 1 else (repr(pairs[0][0]),
                                                                                                 pairs[0][1])
        out.append(f"adapter {folder}: LoRA module {path} gives a delta of shape {list(delta)} but the base weight "
                   f"{wname!r} is {list(base)}; the adapter was trained on a different model")
    return out


def output_config(config: dict, dtype: torch.dtype, *, untie: bool) -> dict:
    """The ``config.json`` of the merged checkpoint.

    Removes ``quantization_config`` (also inside ``text_config``/``vision_config``), records the dtype
    written, and turns weight tying off when tied weights were written separately.

    Args:
        config: the base config.
        dtype: the dtype written.
        untie: set ``tie_word_embeddings`` to False.

    Returns:
        A new dict.

    Raises:
        Nothing.

    Example:
        >>> output_config({"quantization_config": {}, "dtype": "float32"}, torch.bfloat16, untie=False)
        {'dtype': 'bfloat16'}
    """
    out = copy.deepcopy(config)
    name = str(dtype).removeprefix("torch.")
    for sub in (out, out.get("text_config"), out.get("vision_config")):
        if isinstance(sub, dict):
            sub.pop("quantization_config", None)
            if sub is out or "dtype" in sub or "torch_dtype" in sub:
                sub["dtype"] = name
            sub.pop("torch_dtype", None)
            if untie and sub is out:
                sub["tie_word_embeddings"] = False
            elif untie and "tie_word_embeddings" in sub:
                sub["tie_word_embeddings"] = False
    return out


def _same_rows(a: PlannedTensor, b: PlannedTensor) -> bool:
    """Whether two tensors get the same trainable-token rows (PEFT saves them for both sides of a tie)."""
    from .safetensors_io import RowReader

    if [r.indices for r in a.token_rows] != [r.indices for r in b.token_rows]:
        return False
    with RowReader() as reader:
        return all(torch.equal(x.rows.load(reader), y.rows.load(reader)) for x, y in zip(a.token_rows, b.token_rows))


def in_file_names(info: ModelInfo, file_keys: list[str]):
    """Translate the structure facts of ``info`` (in-memory names) into the checkpoint's own key names.

    transformers renames some checkpoints' keys on load (LLaVA's ``language_model.model.*`` becomes
    ``model.language_model.*``, Qwen2-VL's ``model.*`` becomes ``model.language_model.*``); adapters use the
    in-memory names. The merged checkpoint keeps the base's names.

    Args:
        info: the model structure.
        file_keys: the base checkpoint's tensor names.

    Returns:
        ``(info in file names, function in-memory name -> file name, parts)``; names the checkpoint does not hold
        go through the reverse renaming ``save_pretrained`` applies; ``parts`` maps an in-memory tensor that the
        checkpoint stores as several keys (fused MoE experts stored per expert) to those keys.

    Raises:
        Nothing.

    Example:
        >>> info, to_file, parts = in_file_names(ModelInfo(), ["w"])
        >>> to_file("w"), parts
        ('w', {})
    """
    if not info.available:
        return info, lambda name: name, {}
    memory = info.memory_names(file_keys)
    by_memory = {m: f for f, (m, converted) in memory.items() if not converted}
    parts: dict[str, list[str]] = {}
    for f, (m, converted) in memory.items():
        if converted:
            parts.setdefault(m, []).append(f)

    def to_file(name: str) -> str:
        return by_memory.get(name) or info.file_name(name)

    out = copy.copy(info)
    out.transposed = {to_file(n) for n in info.transposed}
    out.linear_weights = {to_file(n) for n in info.linear_weights}
    out.tied = {to_file(t): to_file(s) for t, s in info.tied.items()}
    out.input_embedding = to_file(info.input_embedding) if info.input_embedding else None
    out.output_embedding = to_file(info.output_embedding) if info.output_embedding else None
    return out, to_file, parts


def disk_layer_problems(adapter: AdapterSpec, info: ModelInfo) -> list[str]:
    """What the allowlist refuses among the layers an adapter folder changes (the disk path).

    Args:
        adapter: the adapter, with PEFT's rebuilt layers for types merged through them.
        info: the base model's structure (layer kinds by module name).

    Returns:
        The refusals (empty when every layer is claimed for the disk path).

    Raises:
        Nothing.

    Example:
        >>> disk_layer_problems(load_adapter("adapter"), inspect_model("base"))  # doctest: +SKIP
        []
    """
    per_layer, _ = config_variants(adapter.config)
    uses = []
    for path, mod in sorted(adapter.modules.items()):
        kind = info.layers.get(path) or {"embedding": "Embedding", "conv": f"Conv{len(mod.a.shape) - 2}d"}.get(
            mod.kind, "Conv1D" if adapter.fan_in_fan_out else "Linear")
        variants = per_layer + ["DoRA"] * (mod.magnitude is not None) + ["lora_bias"] * (mod.bias is not None)
        uses.append((path, "LORA", kind, variants))
    problems = check_layers(uses, path=DISK)
    no_bias = [p for p, m in sorted(adapter.modules.items()) if m.bias is not None and info.available
               and f"{p}.bias" not in info.state_names]
    if no_bias:
        problems.append(no_bias_problem(no_bias))
    if adapter.layers is not None and adapter.layers.model is not None:
        problems += check_model(adapter.layers.model, ["default"], path=DISK, values=False)[0]
    return problems


def build_plan(
    base: CheckpointSource,
    adapter: AdapterSpec,
    info: ModelInfo,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    base_precision: str = "original",
    nf4: Nf4Settings | None = None,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    problems: list[str] | None = None,
) -> Plan:
    """Decide every output tensor, its LoRA deltas and its shard, from headers and configs only.

    Args:
        base: the base checkpoint.
        adapter: the LoRA adapter.
        info: the model structure (:func:`~peft_shardmerge.model_info.inspect_model`).
        dtype: output dtype; None keeps the base's.
        max_shard_size: largest shard, bytes or a string such as ``"5GB"``.
        base_precision: ``"original"`` (merge into W) or ``"nf4"`` (into dequant(quantize_4bit(W))).
        nf4: 4-bit settings for ``base_precision="nf4"`` (defaults: nf4, blocksize 64, double quant).
        chunk_elems: elements per row block when merging.
        problems: problems already found by the caller, reported together with the plan's.

    Returns:
        The :class:`Plan`.

    Raises:
        InputError: every problem found (missing targets, shape mismatches, bad options), at once.

    Example:
        >>> plan = build_plan(open_checkpoint("base"), load_adapter("adapter"), inspect_model("base"))  # doctest: +SKIP
        >>> print(plan.describe())  # doctest: +SKIP
    """
    problems = list(problems or [])
    info, to_file, parts = in_file_names(info, list(base.by_name))
    try:
        out_torch = parse_dtype(dtype) or _base_dtype(base)
    except InputError as e:
        problems += e.problems
        out_torch = torch.float32
    try:
        shard_limit = parse_size(max_shard_size)
    except InputError as e:
        problems += e.problems
        shard_limit = 1
    if base_precision not in BASE_PRECISIONS:
        problems.append(f"base_precision must be one of {', '.join(BASE_PRECISIONS)}, got {base_precision!r}")
    if base_precision == "nf4":
        nf4 = nf4 or Nf4Settings()
        problems += nf4.validate()
        if not info.available:
            problems.append(
                "base precision 'nf4' needs to know which weights bitsandbytes quantized, but the model class "
                "could not be built from config.json; use base precision 'original'"
            )
    else:
        nf4 = None
    out_st = TORCH_TO_ST[out_torch]

    # Every name the output may hold: the checkpoint's tensors, plus tied targets it leaves out.
    sources: dict[str, TensorInfo] = dict(base.by_name)
    virtual: dict[str, TensorInfo] = {}
    tie_on = _tie_enabled(base.config)
    if tie_on:
        for target, src in info.tied.items():
            if target not in sources and src in sources:
                virtual[target] = sources[src]

    planned: dict[str, PlannedTensor] = {}

    def planned_for(name: str) -> PlannedTensor | None:
        if name in planned:
            return planned[name]
        info_t = sources.get(name) or virtual.get(name)
        if info_t is None:
            return None
        # a tied target the checkpoint leaves out follows its source, also a source the adapter saved resized (the
        # replacements are planned before any target); a modules_to_save copy of the source is a new module in the
        # adapter model, so the target keeps the base's weights
        src = info.tied.get(name)
        if name in virtual and src in planned and src not in adapter.saved_copies:
            info_t = planned[src].source
        out_dtype = out_st if info_t.dtype in FLOAT_DTYPES else info_t.dtype
        planned[name] = PlannedTensor(name, out_dtype, info_t)
        return planned[name]

    for name in base.by_name:
        planned_for(name).transposed = name in info.transposed

    touched: set[str] = set()
    embeddings = {n for n in (info.input_embedding, info.output_embedding) if n}
    new_vocab: int | None = None
    for memory_name, rep in sorted(adapter.replacements.items()):
        name = to_file(memory_name)
        pt = planned_for(name)
        if pt is None:
            problems.append(f"adapter tensor {name!r} (modules_to_save or a trained bias) has no counterpart in the "
                            "base")
            continue
        resized = (name in embeddings and len(rep.shape) == 2 and len(pt.shape) == 2 and rep.shape[1] == pt.shape[1]
                   and rep.shape[0] != pt.shape[0])
        if tuple(rep.shape) != pt.shape and not resized:
            problems.append(
                f"adapter tensor {name!r} has shape {list(rep.shape)} but the base has {list(pt.shape)}; the adapter "
                "was trained on a different model"
            )
            continue
        if resized:
            if new_vocab not in (None, rep.shape[0]):
                problems.append(f"the adapter resizes the vocabulary to both {new_vocab} and {rep.shape[0]} rows")
            new_vocab = rep.shape[0]
        pt.source, pt.from_adapter = rep.info, True
        touched.add(name)
    mismatches: dict[tuple, list[tuple[str, str]]] = {}  # one line per adapter and module kind, not per layer
    for _, mod in sorted(adapter.modules.items()):
        path = mod.path
        wname = to_file(f"{path}.weight")
        pt = planned_for(wname)
        if pt is None:
            problems.append(f"LoRA target {path!r} does not exist in the base (no tensor {wname!r}); wrong base?")
            continue
        if mod.kind == "embedding":
            transposed = True
        elif info.available:
            transposed = wname in info.transposed
        else:
            transposed = adapter.fan_in_fan_out
        out_f, in_f = mod.b.shape[0], mod.a.shape[1]
        expected = (in_f, out_f) if transposed else (out_f, in_f)
        if mod.kind == "conv":
            expected = (out_f, in_f, *mod.a.shape[2:])
        if pt.shape != expected:
            mismatches.setdefault((_adapter_of(adapter, mod), re.sub(r"\.\d+\.", ".*.", path), tuple(expected),
                                   re.sub(r"\.\d+\.", ".*.", wname), pt.shape), []).append((path, wname))
            continue
        if mod.magnitude is not None:
            if math.prod(mod.magnitude.shape) != out_f:
                problems.append(f"DoRA module {path!r}: lora_magnitude_vector has shape {list(mod.magnitude.shape)}, "
                                f"expected [{out_f}]")
                continue
        pt.loras.append(mod)
        pt.transposed = transposed
        touched.add(wname)
        if mod.bias is not None:
            bname = to_file(f"{path}.bias")
            bt = planned_for(bname)
            if bt is None and info.available and f"{path}.bias" not in info.state_names:
                continue  # refused by the allowlist (disk_layer_problems), which names the fix
            if bt is None or bt.shape != (out_f,):
                problems.append(f"LoRA module {path!r} has lora_B.bias but the base has no bias {bname!r} of shape "
                                f"[{out_f}]")
                continue
            bt.bias_loras.append(mod)
            touched.add(bname)

    problems += shape_mismatch_problems(mismatches)
    for memory_name, op in sorted((adapter.layers.ops if adapter.layers is not None else {}).items()):
        if memory_name in parts:  # stored in parts: each gets its slice of the delta, cut by transformers
            for name in parts[memory_name]:
                planned_for(name).peft_ops.append(PartOp(op, memory_name, name, len(parts[memory_name])))
                touched.add(name)
            continue
        name = to_file(memory_name)
        pt = planned_for(name)
        base_t = getattr(op.layer.get_base_layer(), op.attr, None)
        if pt is None or base_t is None or tuple(base_t.shape) != pt.shape:
            problems.append(f"{adapter.peft_type} layer {op.path!r} does not fit the base tensor {name!r}"
                            f"{'' if pt is None else ' ' + str(list(pt.shape))}; the adapter was trained on a "
                            "different model")
            continue
        pt.peft_ops.append(op)
        touched.add(name)

    with_tokens: set[str] = set()
    for path, tr in sorted(adapter.tokens.items()):
        wname = to_file(f"{path}.weight")
        pt = planned_for(wname)
        if pt is None:
            problems.append(f"trainable tokens target {path!r} does not exist in the base (no tensor {wname!r})")
            continue
        rows = pt.source.shape[0] if pt.from_adapter else pt.shape[0]
        if len(pt.shape) != 2 or tr.rows.shape[1] != pt.shape[1] or not all(0 <= i < rows for i in tr.indices):
            problems.append(f"trainable tokens of {path!r} ({len(tr.indices)} rows of width {tr.rows.shape[1]}, "
                            f"ids up to {max(tr.indices, default=0)}) do not fit {wname!r} {list(pt.shape)}")
            continue
        pt.token_rows.append(tr)
        with_tokens.add(wname)

    untied: list[str] = []
    if tie_on:
        for target, src in info.tied.items():
            if target in with_tokens and src in with_tokens and not _same_rows(planned[target], planned[src]):
                problems.append(f"trainable tokens are given for both tied weights {src!r} and {target!r}; tied "
                                "weights share one matrix, so train tokens on the input embedding only")
            if (target in touched or src in touched) and planned_for(target) and planned_for(src):
                untied += [target, src]
                if src in with_tokens and target not in with_tokens:  # the tied head had the same rows in PEFT
                    planned[target].token_rows = list(planned[src].token_rows)
    if new_vocab is not None:
        for name in embeddings:
            pt = planned.get(name)
            if pt is not None and pt.shape[0] != new_vocab:
                problems.append(
                    f"the adapter resizes the vocabulary to {new_vocab} rows but has no {name!r} of that size; save "
                    "the adapter with save_embedding_layers=True after resize_token_embeddings"
                )

    notes = []
    if untied:
        notes.append(
            f"the adapter changes tied weights ({', '.join(sorted(set(untied)))}); both are written and "
            "tie_word_embeddings is set to false"
        )
    if nf4 is not None:
        for name, pt in planned.items():
            if name in info.linear_weights and pt.source.dtype in FLOAT_DTYPES and not pt.from_adapter:
                pt.quantize = True
        notes.append(f"merging into the 4-bit base the adapter was trained on ({nf4.describe()})")

    if adapter.tokenizer_files:
        notes.append("tokenizer files taken from the adapter folder (they replace the base's)")
    problems += unmergeable_targets(list(planned.values()))  # integer / float8 tensors cannot take a delta
    raise_if_any(disk_layer_problems(adapter, info), problems)

    order = list(base.by_name) + [n for n in virtual if n in untied]
    tensors = [planned[n] for n in order]
    indices, names = assign_shards([t.nbytes for t in tensors], shard_limit)
    for t, i in zip(tensors, indices):
        t.shard = i
    config = output_config(base.config, out_torch, untie=bool(untied))
    if new_vocab is not None:
        for sub in (config, config.get("text_config")):
            if isinstance(sub, dict) and "vocab_size" in sub:
                sub["vocab_size"] = new_vocab
        notes.append(f"the adapter resized the vocabulary: {base.config.get('vocab_size')} -> {new_vocab} rows")
    return Plan(base, adapter, tensors, names, out_torch, base_precision, nf4, config, chunk_elems,
                sorted(set(untied)), notes)
