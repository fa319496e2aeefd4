"""The original checkpoint of a loaded model: which folder (any cached revision) holds the weights now in memory."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ..errors import InputError, ShardMergeError
from ..model.walk import LiveModel, bnb_kind, dequantize, materialized, offload_owner
from ..output.side_files import candidate_folders

log = logging.getLogger(__name__)

#: tensors compared between disk and memory before the original checkpoint is trusted
SAMPLES = 4
#: rows read per compared tensor at most (whole tensors for 4-bit weights, which quantize as a whole)
SAMPLE_ROWS = 64
#: relative difference above which a 4-bit or 8-bit weight is not the disk weight quantized (the same weights
#: differ by ~1e-7, or ~2e-2 after bitsandbytes' CPU repacking; another checkpoint's by ~1; the plain tensors
#: compared with them, embeddings and head, are compared exactly)
QUANT_MISMATCH = 0.05


@dataclass
class OriginalCheck:
    """What was found about the original checkpoint.

    Attributes:
        folder: the checkpoint folder whose tensors match the model in memory, or None.
        reason: why none can be used (empty when ``folder`` is set).
        compared: the tensor names compared.
        quant_error: for a quantized model, the mean relative change of a layer's output, ``|(W - deq(Wq)) x| /
            |deq(Wq) x|`` on random probes, over the compared quantized layers: how far a merge into the
            original weights is from the trained model, layer by layer. None for an unquantized model.
    """

    folder: str | None
    reason: str = ""
    compared: tuple[str, ...] = ()
    quant_error: float | None = None


def _samples(live: LiveModel) -> list:
    """A few tensors to compare: the first and last plain matrices (embeddings, head) and quantized or LoRA base
    weights of the smallest kind spread over the depth of the model."""
    plain = [e for e in live.entries if e.kind == "plain" and e.floating and len(e.shape) == 2]
    based = [e for e in live.entries if e.kind in ("lora", "quantized") and e.attr == "weight"]
    picked = plain[:1] + plain[-1:]
    if based:  # the smallest kind (k_proj/v_proj with grouped-query attention): 4-bit ones are read whole
        smallest = min(e.numel for e in based)
        based = [e for e in based if e.numel == smallest]
        step = max(1, len(based) // (SAMPLES - len(picked) if SAMPLES > len(picked) else 1))
        picked += based[::step]
    seen, out = set(), []
    for e in picked:
        if e.name not in seen:
            seen.add(e.name)
            out.append(e)
    return out[: SAMPLES + 1]


def _compare(live: LiveModel, folder: str) -> tuple[str, tuple[str, ...], list[float]]:
    """``(problem or "", names compared, per-layer quantization errors)`` for one candidate folder."""
    from ..checkpoint.base_folder import open_checkpoint
    from ..io.safetensors_io import RowReader
    from ..quant.nf4 import Nf4Settings, quantize_roundtrip
    from ..support.model_info import in_file_names

    src = open_checkpoint(folder)
    if src.quantized is not None:  # the folder a 4-bit model was loaded from is not a 16-bit original
        raise InputError(f"it is itself stored quantized ({src.quantized.method})")
    _, to_file, _ = in_file_names(live.info, list(src.by_name))  # the checkpoint's own key names (LLaVA, ...)
    reader = RowReader()
    compared, errors = [], []
    try:
        for e in _samples(live):
            info = src.by_name.get(e.name) or src.by_name.get(to_file(e.name))
            tensor = getattr(e.holder, e.attr, None)
            if info is None or tensor is None or tuple(info.shape) != tuple(e.shape):
                if info is not None and tensor is not None:
                    return f"{e.name} has shape {list(info.shape)} on disk, {list(e.shape)} in memory", (), []
                continue
            kind = bnb_kind(tensor)
            with materialized(offload_owner(live.model, e.name, e.holder)):
                if getattr(e.holder, e.attr).is_meta:
                    continue
                if kind is None:
                    rows = min(SAMPLE_ROWS, info.shape[0]) if info.shape else 0
                    disk = reader.read_rows(info, 0, rows) if info.shape else reader.read(info)
                    mem = getattr(e.holder, e.attr).detach()
                    mem = mem.T if e.transpose_out else mem
                    mem = mem[:rows].to("cpu") if info.shape else mem.to("cpu")
                    if not torch.equal(disk.to(mem.dtype), mem):
                        diff = float((disk.to(torch.float32) - mem.float()).abs().max())
                        return f"{e.name} differs (max |difference| {diff:.3g})", (), []
                else:
                    w = dequantize(e.holder, torch.device("cpu"))
                    disk = reader.read(info).to(torch.float32)
                    disk = disk.T if e.transpose_out or e.name in live.info.transposed else disk
                    if kind == "8bit":
                        ref = disk
                    else:
                        qs = tensor.quant_state
                        settings = Nf4Settings(
                            quant_type=qs.quant_type,
                            blocksize=qs.blocksize,
                            double_quant=bool(getattr(qs, "nested", False)),
                        )
                        ref = quantize_roundtrip(disk.to(getattr(qs, "dtype", None) or disk.dtype), settings)
                    rel = float(torch.linalg.norm(w - ref) / torch.linalg.norm(w).clamp_min(1e-30))
                    if not rel < QUANT_MISMATCH:  # NaN counts as a mismatch
                        return (
                            (f"{e.name} in memory is not the disk weight quantized (relative difference {rel:.3g})"),
                            (),
                            [],
                        )
                    probes = torch.randn(w.shape[1], 8, generator=torch.Generator().manual_seed(0))
                    out = w @ probes
                    errors.append(float(torch.linalg.norm((disk - w) @ probes) / torch.linalg.norm(out)))
            compared.append(e.name)
    finally:
        reader.close()
    if not compared:
        return "no tensor could be compared (none of the sampled names is on disk, or all are offloaded)", (), []
    return "", tuple(compared), errors


def find_original(live: LiveModel) -> OriginalCheck:
    """Find the checkpoint on disk that holds the weights now in memory, comparing a sample of tensors.

    Candidates are ``config._name_or_path`` (a folder) or every cached revision of that Hub id; a candidate is
    accepted only when its sampled tensors equal the model's (unquantized weights exactly, after the cast
    transformers made when loading; 4-bit weights after quantizing the disk weight with the model's settings;
    8-bit weights within 5%). A folder changed after loading, or the ``refs/main`` snapshot of a model loaded
    at another revision, is therefore never used.

    Args:
        live: the walked model (:func:`~peft_shardmerge.model.walk.walk`).

    Returns:
        An :class:`OriginalCheck`; ``folder`` is None with the reason when no candidate matches (problems become
        the reason, never raised).
    """
    name = getattr(live.model.config, "_name_or_path", "") or ""
    if not name:
        return OriginalCheck(None, "the model's config has no _name_or_path")
    folders = candidate_folders(name)
    if not folders:
        return OriginalCheck(
            None,
            f"the 16-bit checkpoint the model was loaded from is not available locally "
            f"({name!r} is neither a local folder nor a Hub id in the local cache)",
        )
    mismatches, unusable = [], []
    for folder in folders:
        try:
            problem, compared, errors = _compare(live, folder)
        except ShardMergeError as e:  # e.g. a pre-quantized checkpoint: not a base to merge into from disk
            unusable.append(f"{folder}: {inner_problems(e)}")
            continue
        except Exception as e:  # a candidate that cannot be read is not used
            unusable.append(f"{folder}: {type(e).__name__}: {e}")
            continue
        if not problem:
            return OriginalCheck(folder, "", compared, sum(errors) / len(errors) if errors else None)
        mismatches.append(f"{folder}: {problem}")
    if not mismatches:
        return OriginalCheck(
            None,
            "the checkpoint the model was loaded from cannot be merged into from disk ("
            + "; ".join(unusable[:3])
            + ")",
        )
    where = "; ".join(mismatches[:3]) + (f"; and {len(mismatches) - 3} more" if len(mismatches) > 3 else "")
    return OriginalCheck(
        None,
        f"the checkpoint on disk is not the one in memory ({where}): it changed after "
        "loading, or the model was loaded from another revision",
    )


def inner_problems(error: BaseException) -> str:
    """The problems an error lists, on one line (not its header, "1 problem found before writing anything:").

    Args:
        error: an :class:`~peft_shardmerge.errors.InputError` (or any exception).

    Returns:
        Its problems joined with "; ", or its message.

    Example:
        >>> from peft_shardmerge.errors import InputError
        >>> inner_problems(InputError(["a is wrong", "b too"]))
        'a is wrong; b too'
    """
    problems = getattr(error, "problems", None)
    return "; ".join(problems) if problems else str(error).strip()


def is_quantized(inner: torch.nn.Module) -> bool:
    """Whether a loaded transformers model holds bitsandbytes (or other quantized) weights.

    Args:
        inner: the transformers model.

    Returns:
        True for a model loaded with a ``quantization_config``.

    Example:
        >>> is_quantized(torch.nn.Linear(2, 2))
        False
    """
    config = getattr(inner, "config", None)
    return bool(
        getattr(inner, "is_loaded_in_4bit", False)
        or getattr(inner, "is_loaded_in_8bit", False)
        or getattr(config, "quantization_config", None)
    )


def default_dtype(inner: torch.nn.Module, model_dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """The dtype written when the caller gives none, by the rule of a merge from disk: the base checkpoint's own
    dtype (its config.json's ``dtype``/``torch_dtype``, float32 too), else the dtype of the model's weights.

    Args:
        inner: the transformers model.
        model_dtype: the dtype the model computes in.

    Returns:
        ``(dtype, why)``; ``why`` is a sentence for the report.

    Example:
        >>> default_dtype(torch.nn.Linear(2, 2), torch.float32)[0]
        torch.float32
    """
    import json

    known = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    name = getattr(getattr(inner, "config", None), "_name_or_path", "") or ""
    for folder in candidate_folders(name)[:1]:
        try:
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            continue
        own = config.get("dtype") or config.get("torch_dtype")
        if own in known:
            return known[own], f"dtype {own}: the checkpoint's own (its config.json); pass dtype= to choose"
    return model_dtype, (
        f"dtype {str(model_dtype)[6:]}: the model's (no checkpoint config.json found); pass dtype= to choose"
    )


def describe_base(used: str | None, check: OriginalCheck, quantized: bool, reason: str) -> tuple[str, str]:
    """What a merge reproduces, and the note that says which base was used and why.

    Args:
        used: the original checkpoint merged into, or None for the weights in memory.
        check: the comparison of the original checkpoint with the model (:func:`find_original`).
        quantized: whether the model in memory is quantized.
        reason: why the original checkpoint was not used (when ``used`` is None).

    Returns:
        ``(reproduces, note)``.

    Example:
        >>> describe_base(None, OriginalCheck(None), False, "the model is not a PeftModel")[0]
        'the trained model (its weights as held in memory + adapter)'
    """
    distance = ""
    if quantized and check.quant_error is not None:
        distance = (
            f"merging into the original 16-bit weights moves each layer's output by about "
            f"{check.quant_error:.1%} from the trained model's (random probes, {len(check.compared)} "
            "tensors compared)"
        )
    if used is not None:
        if quantized:
            reproduces = "the original 16-bit base + adapter, NOT the trained 4-bit model"
            note = f"merged into the original checkpoint {used} (checked against the model in memory); {distance}"
            note = note.rstrip("; ")
        else:
            reproduces = "the trained model (the original checkpoint, equal to the weights in memory, + adapter)"
            note = f"merged into the original checkpoint {used}, whose sampled tensors equal the model in memory"
        return reproduces, note
    if quantized:
        reproduces = "the trained model (its 4-bit base dequantized + adapter)"
        note = f"merged into the weights in memory, dequantized ({reason})"
        if distance:
            note += f"; base_precision='original' would merge into {check.folder} instead: {distance}"
    else:
        reproduces = "the trained model (its weights as held in memory + adapter)"
        note = f"merged into the weights in memory ({reason})"
    return reproduces, note
