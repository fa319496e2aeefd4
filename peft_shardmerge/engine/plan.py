"""What a merge will write: the Plan, its planned tensors, their shards and the peak-memory estimate."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from ..checkpoint.adapter import AdapterSpec, LoraModule
from ..checkpoint.source import CheckpointSource
from ..io.safetensors_io import DTYPES, TensorInfo, row_blocks
from ..quant.nf4 import Nf4Settings
from ..version import __version__


class Op(str, Enum):
    """What the executor does to make one planned tensor.

    Example:
        >>> Op("cast") is Op.CAST, f"{Op.MERGE}"
        (True, 'merge')
    """

    COPY = "copy"  #: its bytes unchanged
    CAST = "cast"  #: a dtype change only
    DEQUANTIZE = "dequantize"  #: a quantized base weight, dequantized and cast
    MERGE = "merge"  #: the base with its changes added in fp32, then cast
    QUANTIZE4 = "quantize4"  #: one stored part of a merged weight quantized to 4-bit again

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass
class PartOp:
    """A PEFT delta of an in-memory tensor, for one of the checkpoint keys that store it.

    Attributes:
        op: the PEFT layer's change (:class:`~peft_shardmerge.checkpoint.peft_deltas.PeftOp`).
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
        token_rows: trainable-token rows (:class:`~peft_shardmerge.checkpoint.adapter.TokenRows`) that replace base
        rows
            before LoRA deltas are added (PEFT nests the token layer inside the LoRA layer).
        peft_ops: LoHa/LoKr/VeRA deltas and IA3 scalings (:class:`~peft_shardmerge.checkpoint.peft_deltas.PeftOp`).
        entry: for a merge of a loaded model, the :class:`~peft_shardmerge.model.walk.LiveEntry` it is produced from
            (``source`` then describes the output tensor itself: its stored dtype and output shape).
        part: for a weight re-quantized to 4-bit, ``""`` for its packed codes, else the quant-state key it holds.
        kind: the operation, when the planner names it (a loaded model's tensors); else :attr:`op` derives it.
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
    entry: object = None
    part: str = ""
    kind: Op | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        return self.source.numel * DTYPES[self.out_dtype][1]

    @property
    def op(self) -> Op:
        """The planned ``kind``, else what the tensor's changes and dtypes call for."""
        if self.kind is not None:
            return self.kind
        if self.loras or self.bias_loras or self.quantize or self.token_rows or self.peft_ops:
            return Op.MERGE
        if self.source.decoder is not None:
            return Op.DEQUANTIZE
        return Op.COPY if self.out_dtype == self.source.dtype else Op.CAST


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
        live: for a merge of a loaded model (then ``base`` and ``adapter`` are None), what produces its tensors
            (:class:`~peft_shardmerge.model.planner.LiveSource`).
        origin: for a merge of a loaded model, what its base is (the name it was loaded from).
        adapter_text: for a merge of a loaded model, which adapters are merged (shown instead of folders).
        resources: what the plan's inputs live in, kept as long as the plan (a temporary folder).
        reproduces: which model the output reproduces (the trained model, or the original base + adapter).
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
    live: object = None
    origin: str = ""
    adapter_text: str = ""
    resources: list = field(default_factory=list)
    reproduces: str = ""

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_parameters(self) -> int:
        if self.live is not None:  # a 4-bit weight counts its elements once, not its packed parts
            return sum(e.numel for e in self.live.live.entries)
        return sum(t.source.numel for t in self.tensors)

    @property
    def layer_count(self) -> int:
        """LoRA modules plus PEFT layers (and LoRA-on-parameter wrappers) whose weights change."""
        if self.live is not None:
            return sum(not k.startswith("tokens:") for k in self.live.live.lora_layers)
        ops = self.adapter.layers.ops.values() if self.adapter.layers is not None else ()
        return len(self.adapter.modules) + sum(o.attr != "bias" for o in ops)

    def shard_tensors(self, i: int) -> list[PlannedTensor]:
        return [t for t in self.tensors if t.shard == i]

    def shard_entries(self) -> list[tuple[str, list[tuple[str, str, tuple[int, ...], int]]]]:
        """``(file name, [(tensor name, safetensors dtype, shape, bytes), ...])`` per shard, in write order: the
        headers a :class:`~peft_shardmerge.output.shard_sink.ShardSink` writes first."""
        return [(name, [(t.name, t.out_dtype, t.shape, t.nbytes) for t in self.shard_tensors(i)])
                for i, name in enumerate(self.shard_names)]

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
        return max((_working_set(t, self.chunk_elems) for t in self.tensors if not t.part), default=0)

    def describe(self) -> str:
        """A human-readable plan: every tensor with shard, dtype, shape, bytes and operation, then totals."""
        lines = self._describe_inputs() + [
            "",
            f"{'shard':<36} {'tensor':<56} {'dtype':<5} {'shape':<16} {'bytes':>12}  op",
        ]
        for t in self.tensors:
            lines.append(
                f"{self.shard_names[t.shard]:<36} {t.name:<56} {t.out_dtype:<5} {str(list(t.shape)):<16} "
                f"{t.nbytes:>12}  {t.op}{self._extra(t)}"
            )
        lines += [
            "",
            f"tensors: {len(self.tensors)}   shards: {len(self.shard_names)}   bytes: {self.total_size}"
            f" ({self.total_size / 1e9:.3f} GB)",
            f"estimated peak working memory: {self.peak_bytes() / 2**20:.1f} MiB",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _describe_inputs(self) -> list[str]:
        if self.live is not None:
            return [
                f"base:            {self.origin} (in memory)",
                f"adapter:         {self.adapter_text}",
                f"dtype:           {str(self.dtype).removeprefix('torch.')}",
                f"base precision:  {self.base_precision}",
                *([f"reproduces:      {self.reproduces}"] if self.reproduces else []),
                f"changed layers:  {self.layer_count}",
            ] + ([f"re-quantized:    4-bit {self.live.quant4['bnb_4bit_quant_type']}"] if self.live.quant4 else [])
        return [
            f"base:            {self.base.folder}",
            f"adapter:         {self.adapter_text or ', '.join(self.adapter.folders)}"
            + (f" (combined: {self.adapter.combination})" if self.adapter.combination else ""),
            f"dtype:           {str(self.dtype).removeprefix('torch.')}",
            f"base precision:  {self.base_precision}" + (f" ({self.nf4.describe()})" if self.nf4 else "")
            + (f" (the stored {self.base.quantized.method}, dequantized)" if self.base.quantized else ""),
            *([f"reproduces:      {self.reproduces}"] if self.reproduces else []),
            f"LoRA modules:    {len(self.adapter.modules)}" if self.adapter.layers is None else
            f"{self.adapter.peft_type} layers: {len(self.adapter.layers.ops)}",
        ]

    def _extra(self, t: PlannedTensor) -> str:
        if self.live is not None:
            return f" ({t.entry.kind})" if t.entry is not None and t.entry.kind not in ("plain", t.op) else ""
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
        return extra


def assign_shards(sizes: list[int], limit: int) -> tuple[list[int], list[str]]:
    """Split tensors, in write order, into consecutive shards of at most ``limit`` bytes.

    A tensor larger than ``limit`` gets a shard of its own; the order is never changed, so shards can be
    streamed one after the other.

    Args:
        sizes: byte size of each tensor, in write order.
        limit: the largest shard in bytes.

    Returns:
        ``(shard index per tensor, file names)``, named as transformers names them.

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
    if t.op is Op.COPY:
        return 8 << 20
    if t.entry is not None:  # a loaded model's tensor: an fp32 copy, its cast, and 4-bit codes when re-quantized
        n = t.entry.numel
        return n * (4 + 4 + DTYPES[t.source.dtype][1]) + (n // 2 if t.op is Op.QUANTIZE4 else 0)
    src_item, out_item = DTYPES[t.source.dtype][1], DTYPES[t.out_dtype][1]
    factors = sum(4 * (m.a.shape[0] * m.a.shape[1] + m.b.shape[0] * m.b.shape[1]) for m in t.loras)
    if t.quantize:
        n = t.source.numel
        return n * (src_item + 4 * 3 + out_item) + factors
    start, stop = row_blocks(t.shape, chunk_elems)[0]
    n = (stop - start) * (t.source.numel // max(1, t.shape[0] if t.shape else 1))
    return n * (src_item + 4 * 2 + out_item) + factors
