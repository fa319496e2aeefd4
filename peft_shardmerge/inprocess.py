"""After training, in the same process: merge_and_save, merge_and_unload and the 4-bit re-quantized save."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

from .outcheck import check_out_dir, foreign_model_problems, source_folders
from .api import merge_checkpoint
from .adapter import check_weights, modifies_base
from .peft_deltas import DELTA_TYPES
from .budget import MemoryBudget
from .errors import InputError, MergeCheckError, ShardMergeError
from .execute import current_rss_bytes, peak_rss_bytes
from .merger import check_applied, precision_notes
from .staging import check_written, staged_output
from .live import (LiveEntry, LiveModel, check_adapter_names, unwrap, walk)
from .model_check import require_supported, selected_adapters
from .plan import TORCH_TO_ST, output_config
from .plan_types import assign_shards
from .options import parse_dtype, parse_size
from .original import (OriginalCheck, base_config, default_dtype, describe_base, find_original, inner_problems,
                       is_quantized)
from .report import MergeReport
from .safetensors_io import DTYPES, row_blocks
from .sources import copy_base_side_files
from .record import live_merge_info, write_merge_record
from .writer import ShardWriter, write_json
from .live_merger import LiveMerger
from .options import DEFAULT_CHUNK_ELEMS

log = logging.getLogger(__name__)

BASE_PRECISIONS = ("auto", "original", "dequantized")


def model_dtype(inner: nn.Module) -> torch.dtype:
    """The 16-bit dtype a loaded (possibly 4-bit) model computes in: its config's dtype, else that of its first
    floating-point parameter that bitsandbytes did not quantize.

    Args:
        inner: the transformers model.

    Returns:
        ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.

    Raises:
        Nothing.

    Example:
        >>> model_dtype(model)   # doctest: +SKIP
        torch.bfloat16
    """
    cfg = getattr(getattr(inner, "config", None), "dtype", None) or getattr(inner.config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = getattr(torch, cfg, None)
    if cfg in (torch.bfloat16, torch.float16, torch.float32):
        return cfg
    for p in inner.parameters():
        if p.is_floating_point() and type(p).__name__ not in ("Params4bit", "Int8Params"):
            return p.dtype
    return torch.float32


def merge_and_save(
    model: nn.Module,
    out_dir: str,
    *,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    maximum_memory_usage: float = 0.9,
    base_precision: str = "auto",
    adapter_names: list[str] | None = None,
    weights: list[float] | None = None,
    combination_type: str = "cat",
    overwrite: bool = False,
    progress: bool = True,
) -> MergeReport:
    """Write base + LoRA of a loaded model (bitsandbytes 4-bit, 8-bit or unquantized base) as a 16-bit checkpoint.

    Walks the model one module at a time: each bitsandbytes weight is dequantized, the active adapter's
    delta is added in fp32, the result is cast once and streamed into sharded safetensors. The full 16-bit
    model is never built, and the caller's model is left exactly as it was.

    Args:
        model: a ``PeftModel`` (or a transformers model with a LoRA attached by ``add_adapter``).
        out_dir: the output folder; it appears only when complete.
        tokenizer: saved into ``out_dir`` when given.
        dtype: output dtype (``torch.bfloat16`` or ``"bfloat16"``, ``"float16"``, ``"float32"``); None or ``"auto"``
            writes the checkpoint's own 16-bit dtype, else the model's 16-bit dtype, else bfloat16 (a note says which).
        max_shard_size: largest shard (``"5GB"``, ``"500MB"`` or bytes).
        maximum_memory_usage: fraction (0, 0.95] of the accelerator's memory the process may occupy while
            merging. A module whose working set would go over it is merged on the CPU; on out-of-memory it is
            retried on the CPU and counted in the report. On the CPU, which is the last resort, a module over
            the same fraction of host RAM is merged anyway, with a warning.
        base_precision: ``"auto"`` reproduces the trained model: the weights in memory (dequantized) for a
            quantized model; for an unquantized one the original checkpoint when it holds the same weights, else
            the weights in memory. ``"original"`` merges into the 16-bit checkpoint the model was loaded from
            (``config._name_or_path``: a folder, or any revision of that Hub id in the offline cache), used only
            when a sample of its tensors matches the model in memory; ``"dequantized"`` merges into the weights in
            memory. The report's ``reproduces`` and first note say which, why, and how far the original merge of a
            quantized model is from the trained one.
        adapter_names: adapters of the model to merge together; None merges the active adapter(s).
        weights: one weight per adapter of ``adapter_names`` (default 1.0 each).
        combination_type: ``"cat"`` adds ``sum_i w_i * dW_i`` exactly (any ranks); ``"linear"`` merges the factors
            PEFT's ``add_weighted_adapter(combination_type="linear")`` builds (equal ranks, cross terms included).
        overwrite: replace a non-empty ``out_dir`` (after the new output is complete).
        progress: show progress bars.

    Returns:
        A :class:`~peft_shardmerge.report.MergeReport`; ``base_precision`` says which base was used and
        ``reproduces`` what the result reproduces.

    Raises:
        InputError: bad options, output folder problems, or ``base_precision="original"`` without a local
            original checkpoint (the reason is given).
        UnsupportedError: the adapter uses a feature that cannot be merged (named).
        MergeCheckError: a LoRA layer was not applied exactly once.

    Example:
        >>> from peft_shardmerge import merge_and_save
        >>> report = merge_and_save(model, "merged", tokenizer=tokenizer)   # doctest: +SKIP
        >>> print(report.summary())                                        # doctest: +SKIP
    """
    problems: list[str] = []
    try:
        budget = MemoryBudget(maximum_memory_usage)
    except InputError as e:  # reported with every other problem
        problems += e.problems
    if base_precision not in BASE_PRECISIONS:
        problems.append(f"base_precision must be one of {', '.join(BASE_PRECISIONS)}, got {base_precision!r}")
    try:
        out_dtype = parse_dtype(dtype)
    except InputError as e:
        problems += e.problems
        out_dtype = None
    try:
        limit = parse_size(max_shard_size)
    except InputError as e:
        problems += e.problems
        limit = 1
    inner = unwrap(model)
    names, weight_map, selection_problems = adapter_selection(model, adapter_names, weights, combination_type)
    problems = require_supported(model, names, problems + selection_problems)
    dtype_note = ""
    if out_dtype is None:
        out_dtype, dtype_note = default_dtype(inner, model_dtype(inner))
    original, reason, check = None, "base_precision='dequantized'", OriginalCheck(None)
    if base_precision in ("auto", "original"):
        original, reason, check = _original_checkpoint(model, inner, names or selected_adapters(model, None),
                                                       weight_map, base_precision)
        if original is None and base_precision == "original":
            problems.append(f"base_precision='original' cannot be used: {reason}; use 'dequantized'")
    inputs = {**source_folders(model), **({"base": original} if original else {})}
    problems += check_out_dir(out_dir, inputs=inputs, overwrite=overwrite) + foreign_model_problems(out_dir)
    if problems:
        raise InputError(problems)
    save_extra = _side_saver(tokenizer)
    if original is not None:
        report = _merge_from_original(model, inner, original, out_dir, out_dtype, max_shard_size, overwrite,
                                      progress, save_extra, names, weight_map, combination_type)
    else:
        report = _merge_live(model, out_dir, out_dtype, limit, budget, progress, save_extra,
                             selection=(names, weight_map, combination_type))
    report.reproduces, note = describe_base(original, check, is_quantized(inner), reason)
    report.notes[:0] = [f"base precision {base_precision!r}: {note}"] + ([dtype_note] if dtype_note else [])
    return report


def _original_checkpoint(model: nn.Module, inner: nn.Module, names: list[str], weight_map: dict[str, float],
                         base_precision: str = "original") -> tuple[str | None, str, OriginalCheck]:
    """The 16-bit checkpoint to merge into from disk, ``(folder, "", check)``, or ``(None, why not, check)``.

    The checkpoint is used only when a sample of its tensors equals the model in memory (any cached revision,
    :func:`~peft_shardmerge.original.find_original`). ``"auto"`` reproduces the trained model: it takes the
    checkpoint only for an unquantized model (the same numbers as in memory), never for a quantized one.
    """
    from peft import PeftModel

    try:
        check = find_original(walk(model, names))
    except ShardMergeError as e:
        check = OriginalCheck(None, inner_problems(e))
    if not isinstance(model, PeftModel):
        return None, "the model is not a PeftModel (the adapter cannot be saved on its own)", check
    inits = [getattr(c, "init_lora_weights", True) for c in (getattr(model, "peft_config", None) or {}).values()]
    rewritten = next((i for i in inits if modifies_base(i)), None)
    if rewritten is not None:
        return None, f"the adapter was initialised with {rewritten!r}, which rewrote the base in memory", check
    memory_only = _memory_only(model, names, weight_map)
    if memory_only:
        return None, f"the model has a {memory_only}, which is merged in memory only", check
    if check.folder is None:
        return None, check.reason, check
    if base_precision == "auto" and is_quantized(inner):
        return None, ("'auto' reproduces the trained model, whose base is the quantized one; pass "
                      "base_precision='original' to merge into the 16-bit checkpoint"), check
    return check.folder, "", check


def _side_saver(tokenizer: Any) -> Callable[[str], None] | None:
    if tokenizer is None:
        return None

    def save(folder: str) -> None:
        from .sources import TOKENIZER_FILES

        for name in TOKENIZER_FILES:  # no file of the base's tokenizer may outlive the one given
            path = os.path.join(folder, name)
            if os.path.exists(path):
                os.remove(path)
        tokenizer.save_pretrained(folder)

    return save


def _peft_type(config) -> str:
    return str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "")))


def _memory_only(model: nn.Module, names: list[str], weight_map: dict[str, float]) -> str:
    """What, among the adapters to merge, the disk engine cannot merge (named), or "" when there is none."""
    configs = getattr(model, "peft_config", None) or {}
    combined = len(names) > 1 or any(w != 1 for w in weight_map.values())
    for name in names:
        config = configs.get(name)
        peft_type = _peft_type(config)
        if peft_type not in ("LORA", "TRAINABLE_TOKENS", *DELTA_TYPES):
            return f"{peft_type} adapter"
        if peft_type == "VERA" and not getattr(config, "save_projection", True):
            return "VeRA adapter without saved projections"
        if combined and (peft_type != "LORA" or getattr(config, "target_parameters", None)):
            return f"weighted combination with the {peft_type} adapter {name!r}"
    return ""


def adapter_selection(model: nn.Module, adapter_names, weights, combination_type):
    """Check ``adapter_names``/``weights``/``combination_type``: ``(names or None, weight per name, problems)``."""
    if adapter_names is None and weights is None:
        return None, {}, check_weights(0, None, combination_type, option="combination_type")[1]
    configs = getattr(model, "peft_config", None) or {}
    if adapter_names is None:
        adapter_names = selected_adapters(model, None)
    names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
    problems = check_adapter_names(model, names)
    if problems:
        return names, {}, problems
    weights, problems = check_weights(len(names), weights, combination_type, option="combination_type")
    if len(weights) != len(names):
        return names, {}, problems
    combined = len(names) > 1 or any(w != 1 for w in weights)
    dora = [a for a in names if getattr(configs[a], "use_dora", False) and combined]
    if dora:
        problems.append(f"DoRA adapters cannot be weighted or combined (their magnitudes do not add): {dora}")
    ia3 = [a for a in names if _peft_type(configs[a]) == "IA3" and combined]
    if ia3:
        problems.append(f"IA3 adapters cannot be weighted or combined (their scalings multiply): {ia3}")
    if combination_type == "linear" and len(names) > 1:
        ranks = {a: (configs[a].r, tuple(sorted((configs[a].rank_pattern or {}).items()))) for a in names}
        if len(set(ranks.values())) > 1:
            problems.append("combination_type 'linear' needs adapters of equal rank; use 'cat'")
    return names, dict(zip(names, weights)), problems


def _merge_from_original(model, inner, original, out_dir, out_dtype, max_shard_size, overwrite, progress, save_extra,
                         names=None, weight_map=None, combination="cat"):
    adapters = names or selected_adapters(model, None)
    with tempfile.TemporaryDirectory(prefix="peft-shardmerge-live-adapter-") as folder:
        folders = []
        for i, adapter in enumerate(adapters):
            folders.append(os.path.join(folder, str(i)))
            save_adapter_untouched(model, adapter, folders[-1])
        device = "cuda" if any(p.is_cuda for p in inner.parameters()) else "cpu"
        report = merge_checkpoint(original, folders[0] if len(folders) == 1 else folders, out_dir,
                                  weights=[weight_map[a] for a in adapters] if weight_map else None,
                                  combination=combination, dtype=out_dtype, max_shard_size=max_shard_size,
                                  device=device, overwrite=overwrite, progress=progress, before_commit=save_extra)
    report.adapter = "(in memory: " + ", ".join(
        f"adapter {a!r}" + (f" x {weight_map[a]:g}" if weight_map else "") for a in adapters) + ")"
    return report


def save_adapter_untouched(model: nn.Module, adapter: str, folder: str) -> None:
    """Save one adapter of a PeftModel like ``save_pretrained`` does, without calling ``state_dict()``.

    ``state_dict()`` on a bitsandbytes ``Linear4bit`` that was repacked for the CPU kernel undoes the
    repacking in place (lossily); reading ``named_parameters()`` leaves the model as it is.

    Args:
        model: the ``PeftModel``.
        adapter: the adapter name.
        folder: where ``adapter_config.json`` and ``adapter_model.safetensors`` go.

    Returns:
        None.

    Raises:
        OSError: the folder cannot be written.

    Example:
        >>> save_adapter_untouched(model, "default", "adapter-copy")   # doctest: +SKIP
    """
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = dict(model.named_parameters(remove_duplicate=False))  # shared tensors (VeRA) under every name
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    adapter_state = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.detach().to("cpu").clone() for k, v in adapter_state.items()},  # tied aliases apart
              os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    model.peft_config[adapter].save_pretrained(folder)


def _merge_live(model, out_dir, out_dtype, limit, budget, progress, save_extra, quant4: dict | None = None,
                selection: tuple = (None, {}, "cat")) -> MergeReport:
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    baseline = current_rss_bytes()
    adapter_names, weight_map, combination = selection
    live = walk(model, adapter_names)
    merger = LiveMerger(live, budget, out_dtype, weight_map, combination)
    out_st = TORCH_TO_ST[out_dtype]
    q4_names = live.info.linear_weights if quant4 is not None else set()

    def headers(e: LiveEntry) -> list[tuple[str, str, tuple[int, ...], int]]:
        """The tensors an entry becomes: one, or a packed 4-bit weight with its quant state."""
        if e.name in q4_names:
            return [(n, TORCH_TO_ST[t.dtype], tuple(t.shape), t.numel() * t.element_size())
                    for n, t in _quantize_entry(merger, e, out_dtype, quant4)]
        st = out_st if e.floating else TORCH_TO_ST[_stored_dtype(live, e)]
        return [(e.name, st, e.shape, e.numel * DTYPES[st][1])]

    gen = _valid_generation_config(live.model)
    with torch.no_grad():
        groups = [headers(e) for e in live.entries]  # 4-bit entries are quantized once here to learn sizes
    merger.applied.clear()  # the sizing pass merged (and counted) the 4-bit weights once already
    merger.repacked.clear()
    merger.swallowed.clear()
    sizes = [sum(h[3] for h in g) for g in groups]
    indices, names = assign_shards(sizes, limit)
    with staged_output(out_dir) as staging, torch.no_grad():
        tmp = staging.path
        bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="merging", disable=not progress)
        try:
            plan_headers = []
            records = {}
            for i, fname in enumerate(names):
                members = [j for j in range(len(groups)) if indices[j] == i]
                entries = [h for j in members for h in groups[j]]
                plan_headers.append((fname, [(n, d, sh) for n, d, sh, _ in entries]))
                with ShardWriter(os.path.join(tmp, fname), entries, depth=1) as w:
                    for j in members:
                        _write_entry(merger, live.entries[j], groups[j], w, out_dtype, quant4, q4_names)
                        bar.update(sizes[j])
                records[fname] = w.record()
        finally:
            bar.close()
        all_tensors = [(h[0], names[i]) for g, i in zip(groups, indices) for h in g]
        if len(names) > 1:
            write_json(os.path.join(tmp, "model.safetensors.index.json"), {
                "metadata": {"total_parameters": sum(e.numel for e in live.entries), "total_size": sum(sizes)},
                "weight_map": dict(all_tensors),
            })
        config = output_config(base_config(live.model), out_dtype, untie=bool(live.untied))
        if quant4 is not None:
            config["quantization_config"] = quant4
        write_json(os.path.join(tmp, "config.json"), config)
        copy_base_side_files(getattr(live.model.config, "_name_or_path", "") or "", tmp)  # tokenizer, pipeline, ...
        if gen is not None:
            gen.save_pretrained(tmp)
        if save_extra is not None:
            save_extra(tmp)
        write_merge_record(tmp, records, live_merge_info(live.model, out_dtype, adapter_names, quant4,
                                                           weight_map, combination))
        check_applied(live.lora_layers, merger.applied)
        check_written(tmp, plan_headers)
    notes = list(live.notes)
    if merger.repacked:
        notes.append(
            f"{len(merger.repacked)} 4-bit weight(s) had been repacked by bitsandbytes for its CPU kernel (an eval "
            "forward on a CPU with AVX512-BF16); they were unpacked on a copy: 4-bit codes exact, block scales "
            "kept in bf16 by the repacking (relative error <= 2^-9 per block). Set "
            "module.support_avx512bf16_for_cpu = False after loading to avoid this"
        )
    report = MergeReport(
        out_dir=os.path.abspath(out_dir),
        base=getattr(live.model.config, "_name_or_path", "") or type(live.model).__name__,
        adapter="(in memory)",
        dtype=str(out_dtype).removeprefix("torch."),
        base_precision="dequantized",
        tensors_written=len(all_tensors),
        lora_modules_merged=sum(not k.startswith("tokens:") for k in merger.applied),
        lora_modules_total=sum(not k.startswith("tokens:") for k in live.lora_layers),
        replacements_applied=sum(1 for e in live.entries if e.kind == "saved"),
        shards=names,
        bytes_written=sum(sizes),
        wall_time_s=time.perf_counter() - t0,
        peak_rss_bytes=peak_rss_bytes(),
        baseline_rss_bytes=baseline,
        cpu_fallbacks=merger.fallbacks,
        device=str(next((p.device for p in live.model.parameters()), "cpu")),
        untied=list(live.untied),
        notes=notes + precision_notes(merger.swallowed, out_dtype),
        self_check_max_rel_err=merger.probe_err,
        swallowed={k: v[1] / v[0] for k, v in merger.swallowed.items()},
    )
    log.info("%s", report.summary())
    return report


def _valid_generation_config(inner: nn.Module):
    """The model's generation config if transformers can save it, else None (with a warning), checked before
    any shard is written."""
    gen = getattr(inner, "generation_config", None)
    if gen is None:
        return None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gen.save_pretrained(tmp)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError for inconsistent settings
        log.warning("the model's generation_config cannot be saved (%s); the merged folder will have none", e)
        return None
    return gen


def _write_entry(merger: "LiveMerger", e: LiveEntry, group, w: ShardWriter, out_dtype, quant4, q4_names) -> None:
    if e.name in q4_names:
        for (name, t), (hname, _, shape, _) in zip(_quantize_entry(merger, e, out_dtype, quant4), group):
            if name != hname or tuple(t.shape) != tuple(shape):
                raise MergeCheckError(f"{name}: quantized twice with different results")
            w.write(t)
        return
    _, st, shape, _ = group[0]
    t = merger.produce(e)
    if tuple(t.shape) != e.shape:
        raise MergeCheckError(f"{e.name}: produced shape {list(t.shape)}, expected {list(e.shape)}")
    if t.is_floating_point() and e.kind != "plain" and not torch.isfinite(t.sum()):
        raise MergeCheckError(f"merged tensor {e.name!r} has NaN or Inf")
    target = DTYPES[st][0]
    for start, stop in row_blocks(e.shape, DEFAULT_CHUNK_ELEMS):
        w.write(t[start:stop].detach().to(device="cpu", dtype=target))


def _quantize_entry(merger: "LiveMerger", e: LiveEntry, out_dtype: torch.dtype, quant4: dict):
    """The merged weight quantized with bitsandbytes as transformers would store it: ``name`` (packed codes)
    and ``name.<quant state key>`` tensors, on the CPU."""
    from .quant import require_bitsandbytes

    F = require_bitsandbytes()
    w = merger.produce(e)
    if e.transpose_out or e.name in merger.live.info.transposed:  # bitsandbytes holds Conv1D as [out, in]
        w = w.T
    q, state = F.quantize_4bit(w.to(device="cpu", dtype=out_dtype).contiguous(), blocksize=64,
                               compress_statistics=quant4["bnb_4bit_use_double_quant"],
                               quant_type=quant4["bnb_4bit_quant_type"], quant_storage=torch.uint8)
    out = [(e.name, q.cpu())]
    out += [(f"{e.name}.{k}", v.cpu()) for k, v in state.as_dict(packed=True).items()]
    return out


def _stored_dtype(live: LiveModel, e: LiveEntry) -> torch.dtype:
    # never call state_dict() on a bitsandbytes layer: it undoes the CPU repacking in place
    if e.kind not in ("plain", "saved"):
        return torch.float32
    if "." in e.attr:
        return e.holder.state_dict(keep_vars=True)[e.attr].dtype
    return getattr(e.holder, e.attr).dtype


def save_merged_4bit(model: nn.Module, out_dir: str, *, tokenizer: Any = None, dtype: str | torch.dtype | None = None,
                     max_shard_size: int | str = "5GB", maximum_memory_usage: float = 0.9, overwrite: bool = False,
                     progress: bool = True) -> MergeReport:
    """Merge in fp32 as :func:`merge_and_save` does, then store every weight bitsandbytes quantizes in 4-bit again.

    Warns once (``UserWarning``): the result is not the trained model, each weight moves by its 4-bit error.

    Args:
        model: the trained ``PeftModel``.
        out_dir: the output folder.
        tokenizer: saved with the model when given.
        dtype: the compute dtype recorded for the 4-bit layers (a 16-bit dtype; fp32 becomes bf16).
        max_shard_size: largest shard.
        maximum_memory_usage: fraction (0, 0.95] of accelerator memory the merge may occupy.
        overwrite: replace a non-empty ``out_dir``.
        progress: show progress bars.

    Returns:
        The :class:`MergeReport`; its first note names the 4-bit settings.

    Raises:
        InputError: bad options or output folder.

    Example:
        >>> save_merged_4bit(model, "merged-4bit")   # doctest: +SKIP
    """
    import warnings

    from transformers import BitsAndBytesConfig

    budget = MemoryBudget(maximum_memory_usage)
    inner = unwrap(model)
    problems = require_supported(model, None, check_out_dir(out_dir, inputs=source_folders(model), overwrite=overwrite)
                                 + foreign_model_problems(out_dir))
    out_dtype = parse_dtype(dtype) or model_dtype(inner)
    if out_dtype == torch.float32:
        out_dtype = torch.bfloat16
    limit = parse_size(max_shard_size)
    if problems:
        raise InputError(problems)
    qc = getattr(inner.config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc or {})
    quant4 = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=qc.get("bnb_4bit_quant_type", "nf4") if qc.get("load_in_4bit") else "nf4",
        bnb_4bit_use_double_quant=bool(qc.get("bnb_4bit_use_double_quant", True)) if qc.get("load_in_4bit") else True,
        bnb_4bit_compute_dtype=out_dtype,
    ).to_dict()
    message = ("save_method='merged_4bit' re-quantizes the merged weights to 4-bit: the result is not the model "
               "you trained (each weight moves by its 4-bit quantization error); keep a 'merged_16bit' copy")
    warnings.warn(message, UserWarning, stacklevel=3)  # once: a log record as well would show it twice
    report = _merge_live(model, out_dir, out_dtype, limit, budget, progress, _side_saver(tokenizer), quant4=quant4)
    report.notes.insert(0, f"weights re-quantized to 4-bit ({quant4['bnb_4bit_quant_type']}, "
                           f"{'double quant' if quant4['bnb_4bit_use_double_quant'] else 'no double quant'})")
    return report
