"""The plan of a loaded model's merge: every output tensor, its dtype, shape, bytes and shard, from the model alone."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from ..engine.plan import Op, Plan, PlannedTensor, assign_shards
from ..engine.task_vectors import TaskVectorMethod
from ..io.safetensors_io import DTYPES, TORCH_TO_ST, TensorInfo
from ..options import DEFAULT_CHUNK_ELEMS
from ..output.config import base_config, output_config
from ..support.combinations import warn_about_combination
from .walk import LiveEntry, LiveModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FromModel:
    """The :class:`~peft_shardmerge.engine.plan.Recipe` of a tensor of a loaded model's merge: the module entry it is
    produced from, and what is done to it.

    Attributes:
        entry: the :class:`~peft_shardmerge.model.entries.LiveEntry` (a handle only the model's source reads).
        kind: the operation.
    """

    entry: LiveEntry
    kind: Op

    def op(self, t: PlannedTensor) -> Op:
        return self.kind

    def stored(self, t: PlannedTensor) -> tuple[TensorInfo, ...]:
        """None: its weights are in memory."""
        return ()

    def change_keys(self) -> list[list[str]]:
        """None listed: the walked model's identity stands for them."""
        return [[], [], []]


@dataclass
class LiveInputs:
    """What produces the tensors of a loaded model's plan.

    Attributes:
        live: the walked model.
        adapter_names: the adapters merged (None: the active ones).
        weights: weight per adapter (empty: 1.0 each).
        combination: ``"cat"``, ``"linear"`` or a task-vector method's name.
        vectors: the task-vector method (TIES, DARE, magnitude pruning) of such a combination, else None.
        generation_config: the model's generation config when transformers can save it, else None.
    """

    live: LiveModel
    adapter_names: list[str] | None = None
    weights: dict[str, float] = field(default_factory=dict)
    combination: str = "cat"
    vectors: TaskVectorMethod | None = None
    generation_config: object = None

    @property
    def origin(self) -> str:
        """What the base is: the name the model was loaded from, else its class."""
        model = self.live.model
        return getattr(model.config, "_name_or_path", "") or type(model).__name__

    def header(self, plan: Plan) -> list[str]:
        return [
            f"base:            {self.origin} (in memory)",
            f"adapter:         {plan.adapter_text}",
            f"dtype:           {str(plan.dtype).removeprefix('torch.')}",
            f"base precision:  {plan.base_precision}",
            *([f"reproduces:      {plan.reproduces}"] if plan.reproduces else []),
            f"changed layers:  {self.changed_layers()}",
        ]

    def annotate(self, t: PlannedTensor) -> str:
        entry = t.recipe.entry
        return f" ({entry.kind})" if entry is not None and entry.kind not in ("plain", t.op) else ""

    def parameters(self, plan: Plan) -> int:
        """Each entry's elements once."""
        return sum(e.numel for e in self.live.entries)

    def changed_layers(self) -> int:
        return sum(not k.startswith("tokens:") for k in self.live.lora_layers)

    def identity(self) -> dict:
        """The model's name, every entry's name, kind and shape, and the adapters."""
        return {
            "origin": self.origin,
            "entries": [[e.name, e.kind, list(e.shape)] for e in self.live.entries],
            "adapters": in_memory_text(self.adapter_names, self.weights),
            "combination": self.combination,
            "task_vectors": self.vectors.record() if self.vectors else None,
        }

    def working_set(self, t: PlannedTensor, chunk_elems: int) -> int:
        """An fp32 copy of the entry and its cast."""
        if t.op is Op.COPY:
            return 8 << 20
        n = t.recipe.entry.numel
        return n * (4 + 4 + DTYPES[t.source.dtype][1])


def plan_live(
    source: LiveInputs,
    out_dtype: torch.dtype,
    limit: int,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    order: Sequence[str] = (),
) -> Plan:
    """The plan of a walked model's merge: each entry's output tensors, sized from shapes alone.

    Args:
        source: the walked model and the adapter selection.
        out_dtype: the floating-point dtype written.
        limit: the largest shard in bytes.
        chunk_elems: elements per row block.
        order: the tensor names of the checkpoint the model was loaded from, in its order: where it names every
            output tensor (one a module), the shards are filled in that order, as a merge from that checkpoint
            fills them (the same files); else in the model's module order.

    Returns:
        A :class:`~peft_shardmerge.engine.plan.Plan` with ``live`` set.
    """
    live = source.live
    warn_about_combination(source.vectors)
    groups = [[_entry_tensor(e, out_dtype)] for e in live.entries]
    place = {name: i for i, name in enumerate(order)}
    if place and all(len(g) == 1 and g[0].name in place for g in groups):
        groups.sort(key=lambda g: place[g[0].name])
    indices, names = assign_shards([sum(t.nbytes for t in g) for g in groups], limit)
    tensors = []
    for g, shard in zip(groups, indices):
        for t in g:
            t.shard = shard
            tensors.append(t)
    config = output_config(base_config(live.model), out_dtype, untie=bool(live.untied))
    return Plan(
        source,
        tensors=tensors,
        shard_names=names,
        dtype=out_dtype,
        base_precision="dequantized",
        config=config,
        chunk_elems=chunk_elems,
        untied=list(live.untied),
        notes=list(live.notes),
        adapter_text=in_memory_text(source.adapter_names, source.weights)
        + (f" ({source.vectors.describe()})" if source.vectors else ""),
        quantizable=set(live.info.linear_weights),
        transposed=set(live.info.transposed) | {e.name for e in live.entries if e.transpose_out},
        unconverted=live.info.unconverted,
    )


def in_memory_text(names: list[str] | None, weights: dict[str, float]) -> str:
    """How a plan and its report name the adapters of a loaded model: ``(in memory: adapter 'a' x 0.5, ...)``.

    Args:
        names: the adapters merged (None: the active ones, unnamed).
        weights: weight per adapter (empty: 1.0 each, not shown).

    Returns:
        The text.

    Example:
        >>> in_memory_text(["a", "b"], {"a": 0.5, "b": 1.0})
        "(in memory: adapter 'a' x 0.5, adapter 'b' x 1)"
    """
    text = ", ".join(f"adapter {a!r}" + (f" x {weights[a]:g}" if a in weights else "") for a in names or [])
    return f"(in memory: {text or 'active adapter'})"


def _entry_tensor(e: LiveEntry, out_dtype: torch.dtype) -> PlannedTensor:
    """The planned tensor an entry becomes."""
    held = _stored_dtype(e)
    st = TORCH_TO_ST[out_dtype] if e.floating else TORCH_TO_ST[held]
    stored = TORCH_TO_ST.get(held, st)
    if e.kind in ("plain", "saved"):
        kind = Op.COPY if stored == st else Op.CAST
    else:
        kind = Op.DEQUANTIZE if e.kind == "quantized" else Op.MERGE
    return PlannedTensor(
        name=e.name,
        out_dtype=st,
        source=TensorInfo(e.name, stored, tuple(e.shape), "", 0, e.numel * DTYPES[stored][1]),
        recipe=FromModel(e, kind),
    )


def _stored_dtype(e: LiveEntry) -> torch.dtype:
    # never call state_dict() on a bitsandbytes layer: it undoes the CPU repacking in place
    if e.kind not in ("plain", "saved"):
        return torch.float32
    if "." in e.attr:
        return e.holder.state_dict(keep_vars=True)[e.attr].dtype
    return getattr(e.holder, e.attr).dtype


def valid_generation_config(inner: nn.Module):
    """The model's generation config if transformers can save it, else None (with a warning), checked before
    any shard is written.

    Args:
        inner: the transformers model.

    Returns:
        Its ``GenerationConfig``, or None.
    """
    gen = getattr(inner, "generation_config", None)
    if gen is None:
        return None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gen.save_pretrained(tmp)
    except Exception as e:  # transformers raises ValueError for inconsistent settings
        log.warning("the model's generation_config cannot be saved (%s); the merged folder will have none", e)
        return None
    return gen
