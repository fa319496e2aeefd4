"""The merge plan: every output tensor, its source, the LoRA deltas it receives, its shard and the peak memory."""

from __future__ import annotations

import copy
import math
import re

import torch

from .adapter import AdapterSpec
from .errors import InputError
from .model_check import check_model, no_bias_problem
from .model_info import ModelInfo
from .quant import Nf4Settings
from .reading_rules import unmergeable_targets
from .safetensors_io import DTYPES, FLOAT_DTYPES, TORCH_TO_ST, TensorInfo
from .sources import CheckpointSource
from .support import DISK, check_layers, config_variants, raise_if_any
from .options import DEFAULT_CHUNK_ELEMS, OUTPUT_DTYPES, parse_dtype, parse_size
from .plan_types import Plan, PartOp, PlannedTensor, assign_shards

BASE_PRECISIONS = ("original", "nf4")


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
