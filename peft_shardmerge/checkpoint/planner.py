"""The merge plan: every output tensor, its source, the LoRA deltas it receives, its shard and the peak memory."""

from __future__ import annotations

import copy
import importlib.util

import torch

from ..engine.model_info import ModelInfo, inspect_model
from ..engine.plan import Plan, assign_shards
from ..engine.ties import untie_note
from ..errors import InputError
from ..io.safetensors_io import DTYPES, FLOAT_DTYPES, TORCH_TO_ST
from ..options import BASE_PRECISIONS, OUTPUT_DTYPES, MergeOptions
from ..quant.nf4 import Nf4Settings
from ..support.check import DISK, check_layers, config_variants, raise_if_any
from ..support.model import check_model, no_bias_problem
from ..support.peft_reading import adapter_load_problems, unmergeable_targets
from .adapter import AdapterSpec, combine_adapters, load_adapter
from .peft_deltas import rebuild
from .planners import PlanState, plan_lora, plan_peft_ops, plan_replacements, plan_ties, plan_tokens, plan_vocab
from .source import CheckpointSource, check_base_files, open_checkpoint
from .trained_base import base_name_notes


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


def build_plan(base: CheckpointSource, adapter: AdapterSpec, info: ModelInfo, opts: MergeOptions, *,
               problems: list[str] | None = None) -> Plan:
    """Decide every output tensor, its LoRA deltas and its shard, from headers and configs only.

    Args:
        base: the base checkpoint.
        adapter: the LoRA adapter.
        info: the model structure (:func:`~peft_shardmerge.engine.model_info.inspect_model`).
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
            if name in info.linear_weights and pt.source.dtype in FLOAT_DTYPES and not pt.from_adapter \
                    and nf4.quantizes(name.removesuffix(".weight")):
                pt.quantize = True
        notes.append(f"merging into the 4-bit base the adapter was trained on ({nf4.describe()})")
    if adapter.tokenizer_files:
        notes.append("tokenizer files taken from the adapter folder (they replace the base's)")
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
    return Plan(base, adapter, tensors, names, out_torch, opts.base_precision, nf4, config, opts.chunk_elems, untied,
                notes)


def _plan_options(base: CheckpointSource, info: ModelInfo, opts: MergeOptions
                  ) -> tuple[torch.dtype, Nf4Settings | None, list[str]]:
    """The output dtype and the 4-bit settings of a plan, with every problem of the options it plans with."""
    problems: list[str] = []
    try:
        out_torch = opts.out_dtype or _base_dtype(base)
    except InputError as e:  # named with the plan's own problems: the plan is refused before it is made
        problems += e.problems
        out_torch = _base_dtype(base)
    base_precision = opts.base_precision
    if base_precision not in BASE_PRECISIONS:
        problems.append(f"base_precision must be one of {', '.join(BASE_PRECISIONS)}, got {base_precision!r}")
    if base_precision != "nf4":
        return out_torch, None, problems
    if base.quantized is not None:
        problems.append(
            f"base precision 'nf4' re-quantizes a 16-bit base, but this base is already stored as "
            f"{base.quantized.method}: drop base precision 'nf4'; the adapter is then merged into the stored "
            "weights dequantized, which for an adapter trained on this base are the weights it was trained on")
        return out_torch, None, problems
    nf4 = opts.nf4
    problems += nf4.validate()
    if importlib.util.find_spec("bitsandbytes") is None:
        problems.append("base precision 'nf4' (what 'auto' picks for an adapter trained on a 4-bit base) quantizes "
                        "with bitsandbytes, which is not installed: pip install 'peft-shardmerge[bnb]', or pass "
                        "base precision 'original' to merge into the checkpoint's own weights")
    if not info.available:
        problems.append(
            "base precision 'nf4' needs to know which weights bitsandbytes quantized, but the model class "
            "could not be built from config.json; use base precision 'original'"
        )
    return out_torch, nf4, problems


def plan_from_folders(base_folder: str, adapter_folders: list[str], opts: MergeOptions,
                      problems: list[str] | None = None) -> Plan:
    """Plan the merge of adapter folders into a base checkpoint folder, for a caller that checked the output folder
    itself (the original checkpoint of a loaded model): the planning steps of a merge from disk, with no path or
    output-folder check.

    Args:
        base_folder: the base checkpoint folder.
        adapter_folders: the adapter folders, combined as ``opts.weights`` and ``opts.combination`` say.
        opts: the options (see :func:`build_plan`: ``base_precision`` resolved).
        problems: problems already found, reported with the plan's.

    Returns:
        The :class:`Plan`; its first notes compare the base with the one the adapters name.

    Raises:
        InputError: every problem found, at once.
        CorruptFileError: a checkpoint or adapter file is malformed.
    """
    problems = list(problems or [])
    src = open_checkpoint(base_folder, check_files=False)
    try:
        spec = combine_adapters([load_adapter(a) for a in adapter_folders], opts.weights, opts.combination)
    except InputError as e:  # nothing further can be planned: every problem found so far, at once
        raise InputError(problems + [p for p in e.problems if p not in problems]) from e
    info = inspect_model(src.folder)
    problems += adapter_load_problems(spec, src.folder)  # what PeftModel.from_pretrained would ignore
    if spec.needs_layers:
        from transformers import AutoConfig

        spec.layers = rebuild(spec.folder, spec.config, AutoConfig.from_pretrained(src.folder), None,
                              skip=spec.layer_skip)
    plan = build_plan(src, spec, info, opts, problems=problems)
    plan.notes[:0] = base_name_notes([(part.folder, part.config) for part in spec.parts or [spec]], base_folder,
                                     src.folder)
    check_base_files(src)
    return plan
