"""What a merge will write: the Plan, its planned tensors, their shards and the peak-memory estimate."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from ..io.safetensors_io import DTYPES, TensorInfo
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

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class Change(Protocol):
    """A change a planned tensor receives (a LoRA module, trainable-token rows, a PEFT layer), counted by its key."""

    @property
    def key(self) -> str: ...  # pragma: no cover - a protocol


class Recipe(Protocol):
    """How one source makes a planned tensor: what only that source reads (a checkpoint's LoRA modules, token rows and
    PEFT layers; a loaded model's module), beside the neutral :class:`PlannedTensor`. Two kinds:
    :class:`~peft_shardmerge.checkpoint.place_changes.FromFiles` and
    :class:`~peft_shardmerge.model.planner.FromModel`."""

    def op(self, t: PlannedTensor) -> Op:
        """What the executor does to make ``t``."""
        ...  # pragma: no cover - a protocol

    def stored(self, t: PlannedTensor) -> tuple[TensorInfo, ...]:
        """The stored tensors read from disk to make ``t`` (none for weights in memory)."""
        ...  # pragma: no cover - a protocol

    def change_keys(self) -> list[list[str]]:
        """The keys of the changes ``t`` receives, by kind (LoRA, token rows, PEFT layers), for the fingerprint."""
        ...  # pragma: no cover - a protocol


@dataclass(slots=True)
class PlannedTensor:
    """One output tensor and how to make it: the neutral part every destination and the executor read, and the
    recipe only its source reads.

    Attributes:
        name: its name in the output checkpoint.
        out_dtype: safetensors dtype written.
        source: the stored tensor its bytes come from (a base tensor, or an adapter tensor replacing it; for a loaded
            model, the output tensor itself: its stored dtype and output shape).
        recipe: how its source makes it (:class:`Recipe`).
        shard: index of the output shard.
    """

    name: str
    out_dtype: str
    source: TensorInfo
    recipe: Recipe
    shard: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        return self.source.numel * DTYPES[self.out_dtype][1]

    @property
    def stored(self) -> tuple[TensorInfo, ...]:
        """The stored tensors read from disk to make it (:meth:`Recipe.stored`)."""
        return self.recipe.stored(self)

    @property
    def op(self) -> Op:
        """What the executor does to make it (:meth:`Recipe.op`)."""
        return self.recipe.op(self)


class PlanInputs(Protocol):
    """What a plan reads, as the plan shows it: a checkpoint and adapter folders
    (:class:`~peft_shardmerge.checkpoint.planner.CheckpointInputs`) or a loaded model
    (:class:`~peft_shardmerge.model.planner.LiveInputs`)."""

    def header(self, plan: Plan) -> list[str]:
        """The first lines of :meth:`Plan.describe`: base, adapter, precision, changed layers."""
        ...  # pragma: no cover - a protocol

    def annotate(self, t: PlannedTensor) -> str:
        """What :meth:`Plan.describe` adds after a tensor's operation (its changes), or ``""``."""
        ...  # pragma: no cover - a protocol

    def parameters(self, plan: Plan) -> int:
        """The model's parameter count (the index's ``total_parameters``)."""
        ...  # pragma: no cover - a protocol

    def changed_layers(self) -> int:
        """The layers whose weights the merge changes (the report's ``lora_modules_total``)."""
        ...  # pragma: no cover - a protocol

    def identity(self) -> dict:
        """What decides the output bytes beside the plan's tensors (input files, options), for the fingerprint."""
        ...  # pragma: no cover - a protocol

    def working_set(self, t: PlannedTensor, chunk_elems: int) -> int:
        """Bytes held at once while ``t`` is produced, beyond the imported libraries."""
        ...  # pragma: no cover - a protocol


@dataclass
class Plan:
    """Everything the executor will write, decided from headers and configs alone.

    Attributes:
        inputs: what the plan reads (:class:`PlanInputs`).
        tensors: output tensors in write order.
        shard_names: output file names, in order.
        dtype: the floating-point dtype written.
        base_precision: what the changes are added to: ``"original"``, ``"nf4"`` or ``"dequantized"``.
        config: the ``config.json`` to write.
        chunk_elems: elements per row block.
        untied: tied weights written separately because the adapter changed one side.
        notes: things the user should know (logged and kept in the report).
        adapter_text: which adapters are merged, when the inputs' own description is not the one to show.
        in_memory_adapters: the names of a loaded model's adapters merged through copies saved for the plan (the
            record names them, not the copies' files).
        resources: what the plan's inputs live in, kept as long as the plan (a temporary folder).
        reproduces: which model the output reproduces (the trained model, or the original base + adapter).
        quantizable: the weights a served format's quantizer takes (``nn.Linear`` weights but the output embedding
            and tied ones, as transformers' quantizers choose them), in output names.
        fused: the checkpoint stores tensors that transformers fuses into one when it loads them (a mixture of
            experts' per-expert weights).
        transposed: the weights stored ``[in, out]`` (GPT-2's ``Conv1D``), in output names.
        unconverted: ``(output layers, fused experts)``: the modules a served format's config names as left
            unquantized, by their names in memory (:attr:`~peft_shardmerge.support.model_info.ModelInfo.unconverted`).
    """

    inputs: PlanInputs
    tensors: list[PlannedTensor]
    shard_names: list[str]
    dtype: torch.dtype
    base_precision: str
    config: dict
    chunk_elems: int
    untied: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    adapter_text: str = ""
    in_memory_adapters: list[str] = field(default_factory=list)
    resources: list = field(default_factory=list)
    reproduces: str = ""
    # what the model class says (a plan from the files alone has neither): it decides no byte of a 16-bit merge
    quantizable: set[str] = field(default_factory=set, compare=False)
    fused: bool = field(default=False, compare=False)
    transposed: set[str] = field(default_factory=set, compare=False)
    unconverted: tuple[set[str], set[str]] = field(default_factory=lambda: (set(), set()), compare=False)

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_parameters(self) -> int:
        return self.inputs.parameters(self)

    @property
    def layer_count(self) -> int:
        """LoRA modules plus PEFT layers (and LoRA-on-parameter wrappers) whose weights change."""
        return self.inputs.changed_layers()

    def shard_tensors(self, i: int) -> list[PlannedTensor]:
        return [t for t in self.tensors if t.shard == i]

    def shard_entries(self) -> list[tuple[str, list[tuple[str, str, tuple[int, ...], int]]]]:
        """``(file name, [(tensor name, safetensors dtype, shape, bytes), ...])`` per shard, in write order: the
        layout a :class:`~peft_shardmerge.engine.sink.Sink` is opened for."""
        return [
            (name, [(t.name, t.out_dtype, t.shape, t.nbytes) for t in self.shard_tensors(i)])
            for i, name in enumerate(self.shard_names)
        ]

    def shard_sizes(self) -> list[int]:
        """Per shard, in order, the bytes of its tensors."""
        sizes = [0] * len(self.shard_names)
        for t in self.tensors:
            sizes[t.shard] += t.nbytes
        return sizes

    def shard_io_bytes(self) -> list[int]:
        """Per shard, in order, the bytes a merge reads from disk (:attr:`PlannedTensor.stored`) and writes for it."""
        counts = [0] * len(self.shard_names)
        for t in self.tensors:
            counts[t.shard] += t.nbytes + sum(s.nbytes for s in t.stored)
        return counts

    def index(self) -> dict:
        """The ``model.safetensors.index.json`` content (used when there is more than one shard)."""
        return {
            "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
            "weight_map": {t.name: self.shard_names[t.shard] for t in self.tensors},
        }

    def fingerprint(self) -> str:
        """A digest of everything that decides the output bytes: the inputs (files, options) and the plan itself.
        A resumed run keeps earlier shards only when it matches; the ranks of a job agree on it.

        Returns:
            A hex SHA-256 digest.
        """
        import hashlib
        import json

        data = {
            "version": __version__,
            "inputs": self.inputs.identity(),
            "dtype": str(self.dtype),
            "base_precision": self.base_precision,
            "chunk_elems": self.chunk_elems,
            "shards": self.shard_names,
            "tensors": [[t.name, t.out_dtype, t.shard, t.op, *t.recipe.change_keys()] for t in self.tensors],
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()

    def peak_bytes(self) -> int:
        """Estimated peak working memory of one tensor's merge, beyond the imported libraries."""
        return max((self.inputs.working_set(t, self.chunk_elems) for t in self.tensors), default=0)

    def describe(self) -> str:
        """A human-readable plan: every tensor with shard, dtype, shape, bytes and operation, then totals."""
        lines = self.inputs.header(self) + [
            "",
            f"{'shard':<36} {'tensor':<56} {'dtype':<5} {'shape':<16} {'bytes':>12}  op",
        ]
        for t in self.tensors:
            lines.append(
                f"{self.shard_names[t.shard]:<36} {t.name:<56} {t.out_dtype:<5} {str(list(t.shape)):<16} "
                f"{t.nbytes:>12}  {t.op}{self.inputs.annotate(t)}"
            )
        lines += [
            "",
            f"tensors: {len(self.tensors)}   shards: {len(self.shard_names)}   bytes: {self.total_size}"
            f" ({self.total_size / 1e9:.3f} GB)",
            f"estimated peak working memory: {self.peak_bytes() / 2**20:.1f} MiB per tensor in flight "
            "(from disk: up to --workers at once; a loaded model: one, plus merged modules waiting for their write, "
            "at most the largest tensor's bytes of them)",
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
    names = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    return indices, names
