"""The per-change planners of the disk plan: each places one kind of adapter change on its output tensors."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..engine.plan import Op, PlannedTensor
from ..io.safetensors_io import FLOAT_DTYPES, TensorInfo
from ..support.model_info import ModelInfo
from ..support.ties import tie_enabled, tokens_on_both_sides, untied_names
from .adapter import AdapterSpec, LoraModule
from .base_folder import CheckpointSource
from .peft_deltas import PartOp


@dataclass(slots=True)
class FromFiles:
    """The :class:`~peft_shardmerge.engine.plan.Recipe` of a tensor of a merge from disk: the changes placed on it.

    Attributes:
        from_adapter: its source is an adapter tensor (``modules_to_save`` and similar).
        loras: LoRA modules whose weight delta is added (:class:`~peft_shardmerge.checkpoint.adapter.LoraModule`).
        bias_loras: LoRA modules whose ``lora_B.bias`` is added (the tensor is a bias).
        transposed: the stored weight is ``[in, out]`` (Conv1D), or an embedding with LoRA (whose delta is built
            transposed).
        quantize: the base is replaced by dequant(quantize_4bit(base)) before the changes are added.
        token_rows: trainable-token rows (:class:`~peft_shardmerge.checkpoint.adapter.TokenRows`) that replace base
            rows before LoRA deltas are added (PEFT nests the token layer inside the LoRA layer).
        peft_ops: LoHa/LoKr/VeRA deltas and IA3 scalings (:class:`~peft_shardmerge.checkpoint.peft_deltas.PeftOp`).

    Example:
        >>> from peft_shardmerge.engine.plan import PlannedTensor
        >>> from peft_shardmerge.io.safetensors_io import TensorInfo
        >>> PlannedTensor("w", "BF16", TensorInfo("w", "F32", (2, 2), "", 0, 16), FromFiles()).op
        <Op.CAST: 'cast'>
    """

    from_adapter: bool = False
    loras: list = field(default_factory=list)
    bias_loras: list = field(default_factory=list)
    transposed: bool = False
    quantize: bool = False
    token_rows: list = field(default_factory=list)
    peft_ops: list = field(default_factory=list)

    def op(self, t: PlannedTensor) -> Op:
        """A merge where changes land on it (or its base is re-quantized), else a dequantization, copy or cast."""
        if self.loras or self.bias_loras or self.quantize or self.token_rows or self.peft_ops:
            return Op.MERGE
        if t.source.decoder is not None:
            return Op.DEQUANTIZE
        return Op.COPY if t.out_dtype == t.source.dtype else Op.CAST

    def stored(self, t: PlannedTensor) -> tuple[TensorInfo, ...]:
        """A quantized base's packed codes and scales, else its source."""
        return t.source.decoder.stored if t.source.decoder is not None else (t.source,)

    def change_keys(self) -> list[list[str]]:
        return [[m.key for m in self.loras], [r.key for r in self.token_rows], [o.key for o in self.peft_ops]]


@dataclass
class PlanState:
    """What the planners share while a plan is built: the inputs and every output tensor planned so far.

    Attributes:
        base: the base checkpoint.
        adapter: the adapter.
        info: the model structure, in the checkpoint's names.
        to_file: in-memory name -> the checkpoint's name.
        parts: in-memory tensor -> the keys the checkpoint stores it as (fused MoE experts stored per expert).
        out_st: the safetensors dtype written for float tensors.
        tie_on: whether the base config ties its embeddings.
        virtual: tied targets the checkpoint leaves out, with the tensor they follow.
        planned: the output tensors planned so far, by name.
        touched: names an adapter change lands on (LoRA, bias, PEFT layers, replacements).
        with_tokens: names receiving trainable-token rows.
        new_vocab: the vocabulary size after a resize saved in the adapter, or None.
    """

    base: CheckpointSource
    adapter: AdapterSpec
    info: ModelInfo
    to_file: Callable[[str], str]
    parts: dict[str, list[str]]
    out_st: str
    tie_on: bool = field(init=False)
    virtual: dict[str, TensorInfo] = field(default_factory=dict)
    planned: dict[str, PlannedTensor] = field(default_factory=dict)
    touched: set = field(default_factory=set)
    with_tokens: set = field(default_factory=set)
    new_vocab: int | None = None

    def __post_init__(self) -> None:
        self.tie_on = tie_enabled(self.base.config)
        if self.tie_on:  # every name the output may hold: the checkpoint's, plus tied targets it leaves out
            for target, src in self.info.tied.items():
                if target not in self.base.by_name and src in self.base.by_name:
                    self.virtual[target] = self.base.by_name[src]
        for name in self.base.by_name:
            self.planned_for(name).recipe.transposed = name in self.info.transposed

    @property
    def embeddings(self) -> set[str]:
        """The input and output embedding weights' names."""
        return {n for n in (self.info.input_embedding, self.info.output_embedding) if n}

    def targets(self, items: dict, suffix: str = "") -> Iterator[tuple[str, object, str, PlannedTensor | None]]:
        """``(key, value, checkpoint name, planned tensor or None)`` for adapter entries keyed by in-memory names
        (``key + suffix`` is the tensor's in-memory name), in name order."""
        for key, value in sorted(items.items()):
            name = self.to_file(key + suffix)
            yield key, value, name, self.planned_for(name)

    def planned_for(self, name: str) -> PlannedTensor | None:
        """The output tensor ``name``, planned on first use; None when the output cannot hold it."""
        if name in self.planned:
            return self.planned[name]
        info_t = self.base.by_name.get(name) or self.virtual.get(name)
        if info_t is None:
            return None
        # a tied target the checkpoint leaves out follows its source, also a source the adapter saved resized (the
        # replacements are planned before any target); a modules_to_save copy of the source is a new module in the
        # adapter model, so the target keeps the base's weights
        src = self.info.tied.get(name)
        if name in self.virtual and src in self.planned and src not in self.adapter.saved_copies:
            info_t = self.planned[src].source
        out_dtype = self.out_st if info_t.dtype in FLOAT_DTYPES else info_t.dtype
        self.planned[name] = PlannedTensor(name, out_dtype, info_t, FromFiles())
        return self.planned[name]


def _adapter_of(adapter: AdapterSpec, mod: LoraModule) -> str:
    """The folder a LoRA module comes from (the adapter of a combination its key names)."""
    folders = adapter.folders
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

    Example:
        >>> shape_mismatch_problems({("a1", "model.layers.*.mlp.up_proj", (512, 128),
        ...     "model.layers.*.mlp.up_proj.weight", (256, 128)): [("model.layers.0.mlp.up_proj", ""),
        ...     ("model.layers.1.mlp.up_proj", "")]})[0][:77]
        "adapter a1: LoRA module 'model.layers.*.mlp.up_proj' (2 layers) gives a delta"
    """
    out = []
    for (folder, pattern, delta, wpattern, base), pairs in mismatches.items():
        path, wname = (
            (f"{pattern!r} ({len(pairs)} layers)", wpattern) if len(pairs) > 1 else (repr(pairs[0][0]), pairs[0][1])
        )
        out.append(
            f"adapter {folder}: LoRA module {path} gives a delta of shape {list(delta)} but the base weight "
            f"{wname!r} is {list(base)}; the adapter was trained on a different model"
        )
    return out


def plan_replacements(st: PlanState) -> list[str]:
    """Place the whole tensors the adapter saved (``modules_to_save``, trained biases, resized embeddings).

    Args:
        st: the plan state; records ``new_vocab`` when a saved embedding resizes the vocabulary.

    Returns:
        The problems (a saved tensor with no counterpart in the base, or of another shape).
    """
    problems = []
    for memory_name, rep, name, pt in st.targets(st.adapter.replacements):
        if pt is None:
            problems.append(
                f"adapter tensor {name!r} (modules_to_save or a trained bias) has no counterpart in the base"
            )
            continue
        resized = (
            name in st.embeddings
            and len(rep.shape) == 2
            and len(pt.shape) == 2
            and rep.shape[1] == pt.shape[1]
            and rep.shape[0] != pt.shape[0]
        )
        if tuple(rep.shape) != pt.shape and not resized:
            problems.append(
                f"adapter tensor {name!r} has shape {list(rep.shape)} but the base has {list(pt.shape)}; the adapter "
                "was trained on a different model"
            )
            continue
        if resized:
            if st.new_vocab not in (None, rep.shape[0]):
                problems.append(f"the adapter resizes the vocabulary to both {st.new_vocab} and {rep.shape[0]} rows")
            st.new_vocab = rep.shape[0]
        pt.source, pt.recipe.from_adapter = rep.info, True
        st.touched.add(name)
    return problems


def _lora_shape(st: PlanState, mod: LoraModule, wname: str) -> tuple[bool, tuple]:
    """Whether the base weight of a LoRA module is stored transposed, and the shape its delta needs."""
    if mod.kind == "embedding":
        transposed = True
    elif st.info.available:
        transposed = wname in st.info.transposed
    else:
        transposed = st.adapter.fan_in_fan_out
    out_f, in_f = mod.b.shape[0], mod.a.shape[1]
    expected = (in_f, out_f) if transposed else (out_f, in_f)
    if mod.kind == "conv":
        expected = (out_f, in_f, *mod.a.shape[2:])
    return transposed, tuple(expected)


def plan_lora(st: PlanState) -> list[str]:
    """Place every LoRA delta (and DoRA magnitude, and ``lora_bias`` term) on its base weight.

    Args:
        st: the plan state.

    Returns:
        The problems: missing targets, shape mismatches (one per adapter and kind of module), bad magnitudes.
    """
    problems = []
    flags = {part.fan_in_fan_out for part in st.adapter.parts}
    if not st.info.available and len(flags) > 1:  # the layout would come from the adapters' flags, which differ
        problems.append(
            "the adapters disagree on fan_in_fan_out and the model class could not be built to tell which weights are "
            "stored transposed (Conv1D); merge them one at a time, or with a base transformers can build"
        )
    mismatches: dict[tuple, list[tuple[str, str]]] = {}  # one line per adapter and module kind, not per layer
    for _, mod in sorted(st.adapter.modules.items()):
        path = mod.path
        wname = st.to_file(f"{path}.weight")
        pt = st.planned_for(wname)
        if pt is None:
            problems.append(f"LoRA target {path!r} does not exist in the base (no tensor {wname!r}); wrong base?")
            continue
        transposed, expected = _lora_shape(st, mod, wname)
        if pt.shape != expected:
            mismatches.setdefault(
                (
                    _adapter_of(st.adapter, mod),
                    re.sub(r"\.\d+\.", ".*.", path),
                    expected,
                    re.sub(r"\.\d+\.", ".*.", wname),
                    pt.shape,
                ),
                [],
            ).append((path, wname))
            continue
        bad = _dora_problems(mod)
        if bad:
            problems += bad
            continue
        pt.recipe.loras.append(mod)
        pt.recipe.transposed = transposed
        st.touched.add(wname)
        if mod.bias is not None:
            problems += plan_lora_bias(st, mod)
    return problems + shape_mismatch_problems(mismatches)


def _dora_problems(mod: LoraModule) -> list[str]:
    """A DoRA module's magnitude must hold one value per output row."""
    out_f = mod.b.shape[0]
    if mod.magnitude is None or math.prod(mod.magnitude.shape) == out_f:
        return []
    return [
        f"DoRA module {mod.path!r}: lora_magnitude_vector has shape {list(mod.magnitude.shape)}, expected [{out_f}]"
    ]


def plan_lora_bias(st: PlanState, mod: LoraModule) -> list[str]:
    """Place the ``lora_B.bias`` term of one LoRA module on the base's bias.

    Args:
        st: the plan state.
        mod: a LoRA module with a bias.

    Returns:
        The problems (a missing bias the allowlist refuses is left to it, which names the fix).
    """
    out_f = mod.b.shape[0]
    bname = st.to_file(f"{mod.path}.bias")
    bt = st.planned_for(bname)
    if bt is None and st.info.available and f"{mod.path}.bias" not in st.info.state_names:
        return []  # refused by the allowlist (disk_layer_problems)
    if bt is None or bt.shape != (out_f,):
        return [f"LoRA module {mod.path!r} has lora_B.bias but the base has no bias {bname!r} of shape [{out_f}]"]
    bt.recipe.bias_loras.append(mod)
    st.touched.add(bname)
    return []


def plan_peft_ops(st: PlanState) -> list[str]:
    """Place the deltas PEFT's rebuilt layers compute (LoHa, LoKr, VeRA, IA3 scales, LoRA on parameters).

    Args:
        st: the plan state.

    Returns:
        The problems (a layer that does not fit its base tensor).
    """
    problems = []
    adapter = st.adapter
    for memory_name, op in sorted((adapter.layers.ops if adapter.layers is not None else {}).items()):
        if memory_name in st.parts:  # stored in parts: each gets its slice of the delta, cut by transformers
            for name in st.parts[memory_name]:
                st.planned_for(name).recipe.peft_ops.append(PartOp(op, memory_name, name, len(st.parts[memory_name])))
                st.touched.add(name)
            continue
        name = st.to_file(memory_name)
        pt = st.planned_for(name)
        base_t = getattr(op.layer.get_base_layer(), op.attr, None)
        if pt is None or base_t is None or tuple(base_t.shape) != pt.shape:
            problems.append(
                f"{adapter.peft_type} layer {op.path!r} does not fit the base tensor {name!r}"
                f"{'' if pt is None else ' ' + str(list(pt.shape))}; the adapter was trained on a "
                "different model"
            )
            continue
        pt.recipe.peft_ops.append(op)
        st.touched.add(name)
    return problems


def plan_tokens(st: PlanState) -> list[str]:
    """Place the trainable-token rows on their embeddings.

    Args:
        st: the plan state.

    Returns:
        The problems (a missing target, rows that do not fit).
    """
    problems = []
    for path, tr, wname, pt in st.targets(st.adapter.tokens, ".weight"):
        if pt is None:
            problems.append(f"trainable tokens target {path!r} does not exist in the base (no tensor {wname!r})")
            continue
        rows = pt.source.shape[0] if pt.recipe.from_adapter else pt.shape[0]
        if len(pt.shape) != 2 or tr.rows.shape[1] != pt.shape[1] or not all(0 <= i < rows for i in tr.indices):
            problems.append(
                f"trainable tokens of {path!r} ({len(tr.indices)} rows of width {tr.rows.shape[1]}, "
                f"ids up to {max(tr.indices, default=0)}) do not fit {wname!r} {list(pt.shape)}"
            )
            continue
        pt.recipe.token_rows.append(tr)
        st.with_tokens.add(wname)
    return problems


def _same_rows(a: PlannedTensor, b: PlannedTensor) -> bool:
    """Whether two tensors get the same trainable-token rows (PEFT saves them for both sides of a tie)."""
    from ..io.safetensors_io import RowReader

    rows_a, rows_b = a.recipe.token_rows, b.recipe.token_rows
    if [r.indices for r in rows_a] != [r.indices for r in rows_b]:
        return False
    with RowReader() as reader:
        return all(torch.equal(x.rows.load(reader), y.rows.load(reader)) for x, y in zip(rows_a, rows_b))


def plan_ties(st: PlanState) -> tuple[list[str], list[str]]:
    """Untie the tied weights an adapter changes (both are written) and check trainable tokens on both sides.

    Args:
        st: the plan state, after every other change was placed.

    Returns:
        ``(problems, untied names)``.
    """
    if not st.tie_on:
        return [], []
    problems = []
    for target, src in st.info.tied.items():
        if target in st.with_tokens and src in st.with_tokens and not _same_rows(st.planned[target], st.planned[src]):
            problems.append(tokens_on_both_sides(src, target))
    changed = [(t, s) for t, s in st.info.tied.items() if t in st.touched or s in st.touched]
    present = [n for t, s in changed if st.planned_for(t) and st.planned_for(s) for n in (t, s)]
    untied = untied_names(st.info.tied, st.touched, present)
    for target, src in st.info.tied.items():
        if target in untied and src in st.with_tokens and target not in st.with_tokens:
            # the tied head had the same rows
            st.planned[target].recipe.token_rows = list(st.planned[src].recipe.token_rows)
    return problems, untied


def plan_vocab(st: PlanState) -> list[str]:
    """Check that a vocabulary resized by the adapter is saved for every embedding.

    Args:
        st: the plan state.

    Returns:
        The problems.
    """
    if st.new_vocab is None:
        return []
    problems = []
    for name in sorted(st.embeddings):
        pt = st.planned.get(name)
        if pt is not None and pt.shape[0] != st.new_vocab:
            problems.append(
                f"the adapter resizes the vocabulary to {st.new_vocab} rows but has no {name!r} of that size; save "
                "the adapter with save_embedding_layers=True after resize_token_embeddings"
            )
    return problems
