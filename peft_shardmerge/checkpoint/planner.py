"""The merge plan: every output tensor, its source, the LoRA deltas it receives, its shard and the peak memory."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..engine.plan import Op, Plan, PlannedTensor, assign_shards
from ..errors import InputError
from ..io.safetensors_io import DTYPES, FLOAT_DTYPES, TORCH_TO_ST, row_blocks
from ..options import BASE_PRECISIONS, OUTPUT_DTYPES, MergeOptions
from ..output.config import output_config
from ..output.out_dir import check_out_dir, check_space, is_gguf
from ..quant.nf4 import Nf4Settings
from ..support.claims import DISK, check_layers, config_variants, raise_if_any
from ..support.combinations import warn_about_combination
from ..support.model import check_model, no_bias_problem
from ..support.model_info import ModelInfo, in_file_names, inspect_model
from ..support.peft_reading import adapter_load_problems, unmergeable_targets
from ..support.ties import untie_note
from .adapter import AdapterSpec, load_adapter
from .base_folder import CheckpointSource, check_base_files, open_checkpoint
from .combine import combine_adapters
from .peft_deltas import rebuild
from .place_changes import PlanState, plan_lora, plan_peft_ops, plan_replacements, plan_ties, plan_tokens, plan_vocab
from .trained_base import base_name_notes, disk_base_choice

#: what :func:`plan_from_folders` calls before the model-class checks: ``(base precision, base storage or None)``
BeforeChecks = Callable[[str, str | None], None]


def base_dtype(base: CheckpointSource) -> torch.dtype:
    """The base's dtype: its config's, else that of most of its floating-point weights."""
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


def disk_layer_problems(adapter: AdapterSpec, info: ModelInfo) -> list[str]:
    """What the allowlist refuses among the layers an adapter folder changes (the disk path).

    Args:
        adapter: the adapter, with PEFT's rebuilt layers for types merged through them.
        info: the base model's structure (layer kinds by module name).

    Returns:
        The refusals (empty when every layer is claimed for the disk path).
    """
    per_layer, _ = config_variants(adapter.config)
    uses = []
    for path, mod in sorted(adapter.modules.items()):
        kind = info.layers.get(path) or {"embedding": "Embedding", "conv": f"Conv{len(mod.a.shape) - 2}d"}.get(
            mod.kind, "Conv1D" if adapter.fan_in_fan_out else "Linear"
        )
        variants = per_layer + ["DoRA"] * (mod.magnitude is not None) + ["lora_bias"] * (mod.bias is not None)
        uses.append((path, "LORA", kind, variants))
    problems = check_layers(uses, path=DISK)
    no_bias = [
        p
        for p, m in sorted(adapter.modules.items())
        if m.bias is not None and info.available and f"{p}.bias" not in info.state_names
    ]
    if no_bias:
        problems.append(no_bias_problem(no_bias))
    if adapter.layers is not None and adapter.layers.model is not None:
        problems += check_model(adapter.layers.model, ["default"], path=DISK, values=False)[0]
    return problems


@dataclass
class CheckpointInputs:
    """What a plan from disk reads (:class:`~peft_shardmerge.engine.plan.PlanInputs`).

    Attributes:
        base: the base checkpoint.
        adapter: the adapter (or the combination of several).
        nf4: the 4-bit settings when ``base_precision == "nf4"``.
    """

    base: CheckpointSource
    adapter: AdapterSpec
    nf4: Nf4Settings | None = None

    def header(self, plan: Plan) -> list[str]:
        adapter = self.adapter
        return [
            f"base:            {self.base.folder}",
            f"adapter:         {plan.adapter_text or ', '.join(adapter.folders)}"
            + (f" (combined: {adapter.combination})" if adapter.combination else ""),
            f"dtype:           {str(plan.dtype).removeprefix('torch.')}",
            f"base precision:  {plan.base_precision}"
            + (f" ({self.nf4.describe()})" if self.nf4 else "")
            + (f" (the stored {self.base.quantized.method}, dequantized)" if self.base.quantized else ""),
            *([f"reproduces:      {plan.reproduces}"] if plan.reproduces else []),
            f"LoRA modules:    {len(adapter.modules)}"
            if adapter.layers is None
            else f"{adapter.peft_type} layers: {len(adapter.layers.ops)}",
        ]

    def annotate(self, t: PlannedTensor) -> str:
        extra = " +" + ",".join(f"lora(r={m.rank})" for m in t.recipe.loras) if t.recipe.loras else ""
        if t.recipe.bias_loras:
            extra += " +lora_bias"
        if t.recipe.token_rows:
            extra += " +" + ",".join(f"tokens({len(r.indices)})" for r in t.recipe.token_rows)
        for o in t.recipe.peft_ops:
            extra += f" +{self.adapter.peft_type.lower()}({o.kind})"
        if t.recipe.from_adapter:
            extra += " (from adapter)"
        if t.recipe.quantize:
            extra += " (4-bit base)"
        return extra

    def parameters(self, plan: Plan) -> int:
        return sum(t.source.numel for t in plan.tensors)

    def changed_layers(self) -> int:
        ops = self.adapter.layers.ops.values() if self.adapter.layers is not None else ()
        return len(self.adapter.modules) + sum(o.attr != "bias" for o in ops)

    def identity(self) -> dict:
        """The input files (names, sizes, modification times), the combination and the 4-bit settings."""
        return {
            "base": [self.base.folder, _files(self.base.folder)],
            "adapter": [[f, _files(f)] for f in self.adapter.folders],
            "combination": self.adapter.combination,
            "task_vectors": self.adapter.vectors.record() if self.adapter.vectors else None,
            "nf4": self.nf4.describe() if self.nf4 else None,
        }

    def working_set(self, t: PlannedTensor, chunk_elems: int) -> int:
        """A row block read, widened, merged and cast, plus the LoRA factors (a 4-bit base: the whole tensor)."""
        if t.op is Op.COPY:
            return 8 << 20
        src_item, out_item = DTYPES[t.source.dtype][1], DTYPES[t.out_dtype][1]
        factors = sum(4 * (m.a.shape[0] * m.a.shape[1] + m.b.shape[0] * m.b.shape[1]) for m in t.recipe.loras)
        if t.recipe.quantize:
            return t.source.numel * (src_item + 4 * 3 + out_item) + factors
        start, stop = row_blocks(t.shape, chunk_elems)[0]
        n = (stop - start) * (t.source.numel // max(1, t.shape[0] if t.shape else 1))
        return n * (src_item + 4 * 2 + out_item) + factors


def _files(folder: str) -> list:
    out = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            st = os.stat(path)
            out.append([name, st.st_size, st.st_mtime_ns])
    return out


def build_plan(
    base: CheckpointSource,
    adapter: AdapterSpec,
    info: ModelInfo,
    opts: MergeOptions,
    *,
    problems: list[str] | None = None,
) -> Plan:
    """Decide every output tensor, its LoRA deltas and its shard, from headers and configs only.

    Args:
        base: the base checkpoint.
        adapter: the LoRA adapter.
        info: the model structure (:func:`~peft_shardmerge.support.model_info.inspect_model`).
        opts: the options, ``base_precision`` resolved to ``"original"`` (merge into W) or ``"nf4"`` (into
            dequant(quantize_4bit(W)), with ``opts.nf4``); their parsed ``out_dtype`` (None keeps the base's) and
            ``shard_bytes`` and their ``chunk_elems`` are planned with.
        problems: problems already found by the caller (the options' own among them), reported together with the
            plan's.

    Returns:
        The :class:`Plan`.

    Raises:
        InputError: every problem found (missing targets, shape mismatches, bad options), at once.
    """
    problems = list(problems or [])
    info, to_file, parts = in_file_names(info, list(base.by_name))
    out_torch, nf4, bad = _plan_options(base, info, opts)
    st = PlanState(base, adapter, info, to_file, parts, TORCH_TO_ST[out_torch])
    problems += [p for p in bad if p not in problems]  # the caller may have checked the options already
    problems += plan_replacements(st) + plan_lora(st) + plan_peft_ops(st) + plan_tokens(st)
    tie_problems, untied = plan_ties(st)
    problems += tie_problems + plan_vocab(st)
    notes = [untie_note(untied)] if untied else []
    if base.quantized is not None:
        notes.append(base.quantized.note(out_torch))
    if nf4 is not None:
        for name, pt in st.planned.items():
            if (
                name in info.linear_weights
                and pt.source.dtype in FLOAT_DTYPES
                and not pt.recipe.from_adapter
                and nf4.quantizes(name.removesuffix(".weight"))
            ):
                pt.recipe.quantize = True
        notes.append(f"merging into the 4-bit base the adapter was trained on ({nf4.describe()})")
    if adapter.tokenizer_files:
        notes.append("tokenizer files taken from the adapter folder (they replace the base's)")
    warn_about_combination(adapter.vectors)
    problems += unmergeable_targets(list(st.planned.values()))  # integer / float8 tensors cannot take a delta
    raise_if_any(disk_layer_problems(adapter, info), problems)

    tensors = [st.planned[n] for n in list(base.by_name) + [n for n in st.virtual if n in untied]]
    indices, names = assign_shards([t.nbytes for t in tensors], opts.shard_bytes)
    for t, i in zip(tensors, indices):
        t.shard = i
    config = output_config(base.config, out_torch, untie=bool(untied))
    if st.new_vocab is not None:
        for sub in (config, config.get("text_config")):
            if isinstance(sub, dict) and "vocab_size" in sub:
                sub["vocab_size"] = st.new_vocab
        notes.append(f"the adapter resized the vocabulary: {base.config.get('vocab_size')} -> {st.new_vocab} rows")
    plan = Plan(
        CheckpointInputs(base, adapter, nf4),
        tensors,
        names,
        out_torch,
        opts.base_precision,
        config,
        opts.chunk_elems,
        untied,
        notes,
    )
    plan.quantizable = set(info.linear_weights)
    plan.fused = bool(parts)
    plan.transposed = set(info.transposed)
    plan.unconverted = info.unconverted
    return plan


def _plan_options(
    base: CheckpointSource, info: ModelInfo, opts: MergeOptions
) -> tuple[torch.dtype, Nf4Settings | None, list[str]]:
    """The output dtype and the 4-bit settings of a plan, with every problem of the options it plans with."""
    problems: list[str] = []
    try:
        out_torch = opts.out_dtype or base_dtype(base)
    except InputError as e:  # named with the plan's own problems: the plan is refused before it is made
        problems += e.problems
        out_torch = base_dtype(base)
    base_precision = opts.base_precision
    if base_precision not in BASE_PRECISIONS:
        problems.append(f"base_precision must be one of {', '.join(BASE_PRECISIONS)}, got {base_precision!r}")
    if base_precision != "nf4":
        return out_torch, None, problems
    if base.quantized is not None:
        problems.append(
            f"base precision 'nf4' re-quantizes a 16-bit base, but this base is already stored as "
            f"{base.quantized.method}: drop base precision 'nf4'; the adapter is then merged into the stored "
            "weights dequantized, which for an adapter trained on this base are the weights it was trained on"
        )
        return out_torch, None, problems
    nf4 = opts.nf4
    problems += nf4.validate()
    if importlib.util.find_spec("bitsandbytes") is None:
        problems.append(
            "base precision 'nf4' (what 'auto' picks for an adapter trained on a 4-bit base) quantizes "
            "with bitsandbytes, which is not installed: pip install 'peft-shardmerge[bnb]', or pass "
            "base precision 'original' to merge into the checkpoint's own weights"
        )
    if not info.available:
        problems.append(
            "base precision 'nf4' needs to know which weights bitsandbytes quantized, but the model class "
            "could not be built from config.json; use base precision 'original'"
        )
    return out_torch, nf4, problems


def plan_from_folders(
    base: str,
    adapters: list[str],
    opts: MergeOptions,
    problems: list[str] | None = None,
    *,
    out_dir: str | None = None,
    check_out: bool = False,
    model_checks: bool = True,
    before_checks: BeforeChecks | None = None,
) -> Plan:
    """Plan the merge of adapter folders into a base checkpoint: the one planner entry of a merge from disk (the
    command line, :func:`~peft_shardmerge.api.disk.merge_checkpoint`, a loaded model's original checkpoint).

    Args:
        base: the base checkpoint folder (or cached Hub id), checked as a path argument by the caller.
        adapters: the adapter folders (or cached Hub ids), combined as ``opts.weights`` and ``opts.combination``
            say.
        opts: the options; ``base_precision`` ``"auto"`` is resolved here from the adapters' training settings.
        problems: problems already found, reported with the plan's.
        out_dir: the output folder: its free space is checked (and, with ``check_out``, everything else about it).
        check_out: check ``out_dir`` as :func:`~peft_shardmerge.output.out_dir.check_out_dir` does (False: the
            caller did).
        model_checks: build the model class on the meta device and ask PEFT which adapter tensors it loads; False
            plans from the files alone (as for a custom architecture), for a merge whose checks run beside it
            (:mod:`~peft_shardmerge.api.model_checks`).
        before_checks: with ``model_checks``, called before them with the resolved base precision and the base's
            storage (``Quantized.method``, None for a 16- or 32-bit base): the second process of the checks keeps
            out what they will not need.

    Returns:
        The :class:`Plan`; its ``reproduces`` says which model the output is, its first notes compare the base with
        the one the adapters name.

    Raises:
        InputError: every problem found, at once.
        CorruptFileError: a checkpoint or adapter file is malformed.
    """
    problems = list(problems or [])
    src = open_checkpoint(base, check_files=False)  # mapped whole by safetensors: after the space check
    try:
        spec = combine_adapters(
            [load_adapter(a) for a in adapters],
            opts.weights,
            opts.combination,
            density=opts.density,
            majority_sign=opts.majority_sign,
            normalize=opts.normalize,
            seed=opts.seed,
        )
    except InputError as e:  # nothing further can be planned: every problem found so far, at once
        raise InputError(problems + [p for p in e.problems if p not in problems]) from e
    trained = [(part.folder, part.config) for part in spec.parts or [spec]]
    storage = src.quantized.method if src.quantized is not None else None
    precision, nf4_fields, reproduces = disk_base_choice(opts.base_precision, trained, storage)
    opts = replace(opts, base_precision=precision, **nf4_fields)
    if model_checks and before_checks is not None:
        before_checks(precision, storage)
    if check_out:
        inputs = {
            "base": src.folder,
            **{"adapter" if len(spec.folders) == 1 else f"adapter {i + 1}": f for i, f in enumerate(spec.folders)},
        }
        problems += check_out_dir(out_dir, inputs=inputs, overwrite=opts.overwrite)
    info = inspect_model(src.folder) if model_checks else ModelInfo()
    if model_checks:
        problems += adapter_load_problems(spec, src.folder)  # what PeftModel.from_pretrained would ignore
    if spec.needs_layers:
        from transformers import AutoConfig

        spec.layers = rebuild(
            spec.folder, spec.config, AutoConfig.from_pretrained(src.folder), None, skip=spec.layer_skip
        )
    plan = build_plan(src, spec, info, opts, problems=problems)  # raises every problem, a bad chunk size too
    plan.reproduces = reproduces
    plan.notes[:0] = base_name_notes(trained, base, src.folder)
    space = (
        []
        if out_dir is None or is_gguf(out_dir)  # a GGUF's size is its type's: its sink checks the space
        else check_space(out_dir, plan.total_size + src.extra_bytes)
    )
    if space:
        raise InputError(space)
    check_base_files(src)
    return plan
