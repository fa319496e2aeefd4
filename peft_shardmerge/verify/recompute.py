"""Checking a merged checkpoint against its inputs: every tensor recomputed from base + adapter by the disk
engine's own plan and merge code, one row block at a time, and compared with the stored bytes."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..engine.plan import Op
from ..errors import ShardMergeError
from ..io.safetensors_io import DTYPES, FLOAT_DTYPES, TensorInfo
from ..output.quant_sink import QuantSink, base_quantization, encode_plan
from ..quant.encode import encoder_from_record
from .compare import CompareSink


@dataclass
class RecomputeResult:
    """What :func:`recompute_and_compare` found.

    Attributes:
        problems: every difference, each a sentence.
        checks: what was checked, one line each.
        notes: limits of the comparison (what could not be recomputed and why).
        compared: tensors compared.
        bitwise: tensors equal byte for byte.
        complete: every tensor of the output was recomputed and compared.
        fits: False when base + adapter do not give the checkpoint's tensors (they cannot be planned, or names,
            dtypes or shapes differ); None when not recomputed.
        unchecked: checks without a verdict, each with the reason: tensors that differ from the recomputation only
            within the loss of bitsandbytes' CPU repacking the merge read them from (the record names those weights).
    """

    problems: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    compared: int = 0
    bitwise: int = 0
    complete: bool = False
    fits: bool | None = None
    unchecked: list[str] = field(default_factory=list)


def merge_settings(record: dict | None, out_dtype: str | None) -> tuple[dict | None, list[str]]:
    """How to redo the merge a record describes with the disk engine: ``(options, notes)``.

    ``options`` are the settings for :func:`~peft_shardmerge.checkpoint.planner.build_plan` plus ``weights``,
    ``combination``
    and ``held`` (the dtype an in-process merge held the base in, or quantized it from); a note explains any
    guess or limit. ``options`` is None when the merge cannot be redone from disk.

    Args:
        record: the ``merge`` section of ``merge_manifest.json``, or None.
        out_dtype: the output's floating-point dtype (torch name), used when there is no record.

    Returns:
        ``(options or None, notes)``.

    Example:
        >>> merge_settings(None, "bfloat16")[0]["base_precision"]
        'original'
    """
    if record is None:
        return (
            {
                "dtype": out_dtype,
                "base_precision": "original",
                "nf4": None,
                "chunk_elems": None,
                "weights": None,
                "combination": "cat",
                "task_vectors": None,
                "held": None,
            },
            [f"no merge record: recomputed as a merge into the original base, written as {out_dtype}"],
        )
    options = {
        "dtype": record.get("dtype"),
        "base_precision": "original",
        "nf4": None,
        "chunk_elems": record.get("chunk_elems"),
        "weights": record.get("weights"),
        "combination": record.get("combination") or "cat",
        "task_vectors": record.get("task_vectors"),
        "held": None,
    }
    if record.get("output_quantization"):
        return None, ["the output was re-quantized to 4-bit: its tensors are not recomputed"]
    if record.get("path") == "disk":
        options["base_precision"] = record.get("base_precision", "original")
        options["nf4"] = record.get("nf4")
        return options, []
    quant = record.get("quantization")
    if quant and quant.get("bits") == 8:
        return None, ["the merge used an 8-bit base held in memory: its tensors are not recomputed"]
    if quant:
        options["base_precision"] = "nf4"
        options["nf4"] = {k: quant.get(k) for k in ("quant_type", "blocksize", "double_quant")}
        options["held"] = quant.get("quantized_from")
        return options, []
    options["held"] = record.get("held_dtype")
    return options, []


def settle_stored_base(options: dict | None, record: dict | None, base: str) -> tuple[dict | None, list[str]]:
    """The settings of :func:`merge_settings` for the base actually given: an in-process merge of a model loaded
    from a bitsandbytes 4-bit checkpoint held that checkpoint's own 4-bit weights, so its recomputation reads the
    stored weights dequantized (base precision ``original``), not a 16-bit base quantized again.

    Args:
        options: what :func:`merge_settings` returned (None: nothing to settle).
        record: the ``merge`` section of ``merge_manifest.json``, or None.
        base: the base checkpoint given.

    Returns:
        ``(options or None, notes)``: options None when the base given is stored in another 4-bit format than the
        one the merge held (the one note then says so, and which base to give).

    Example:
        >>> settle_stored_base(None, None, "base")
        (None, [])
    """
    if options is None or options["base_precision"] != "nf4" or (record or {}).get("path") == "disk":
        return options, []
    from ..checkpoint.base_folder import open_checkpoint

    try:
        view = open_checkpoint(base).quantized
    except ShardMergeError:  # the plan names what is wrong with the base
        return options, []
    if view is None:
        return options, []
    nf4 = options["nf4"] or {}
    held = (nf4.get("quant_type"), nf4.get("blocksize"), bool(nf4.get("double_quant")))
    stored = {
        (d.quant_type, d.blocksize, bool(d.nested_blocksize))
        for t in view.tensors
        if (d := getattr(t, "decoder", None)) is not None and hasattr(d, "quant_type")
    }
    if stored != {held}:
        return None, [
            f"the merge held its base in 4-bit ({held[0]}, blocksize {held[1]}, "
            f"{'' if held[2] else 'no '}double quant), but {base} is stored as {view.method}: not recomputed; "
            "give the 16-bit checkpoint the model was quantized from, or the 4-bit checkpoint it was loaded from"
        ]
    return {**options, "base_precision": "original", "nf4": None, "held": None}, [
        f"the base is stored as {view.method}, the weights the merge held: recomputed from them dequantized"
    ]


def _reproducible(held: str | None, plan) -> str:
    """Why the disk engine cannot reproduce an in-process merge whose base was held in (or quantized from)
    ``held``, or "" when it can: every stored value of a changed weight must survive the cast to ``held``."""
    if held is None or not hasattr(torch, str(held)):
        return ""
    held_dtype = getattr(torch, held)
    for t in plan.tensors:
        stored = DTYPES[t.source.dtype][0] if t.source.dtype in DTYPES else None
        if t.op is not Op.MERGE or stored is None or not stored.is_floating_point or stored == held_dtype:
            continue
        if torch.finfo(held_dtype).bits <= torch.finfo(stored).bits:
            return (
                f"the merge held the base in {held}, the checkpoint stores {str(stored)[6:]}: the disk engine "
                "cannot reproduce that rounding, so the tensors are not recomputed"
            )
    return ""


def plan_recomputation(base: str, adapters: list[str], options: dict):
    """``(model info, plan)``: the disk engine's plan for ``options``, built the way ``plan_checkpoint_merge``
    builds it (without an output folder)."""
    from ..checkpoint.adapter import load_adapter
    from ..checkpoint.base_folder import open_checkpoint
    from ..checkpoint.combine import combine_adapters
    from ..checkpoint.peft_deltas import rebuild
    from ..checkpoint.planner import build_plan
    from ..options import DEFAULT_CHUNK_ELEMS, MergeOptions
    from ..support.model_info import inspect_model

    src = open_checkpoint(base)
    tv = options.get("task_vectors") or {}  # a task-vector method's parameters, as recorded
    spec = combine_adapters(
        [load_adapter(a) for a in adapters],
        options["weights"],
        options["combination"],
        density=tv.get("density"),
        majority_sign=tv.get("majority_sign") or "total",
        normalize=tv.get("normalize"),
        seed=tv.get("seed") or 0,
    )
    info = inspect_model(src.folder)
    if spec.needs_layers:
        from transformers import AutoConfig

        spec.layers = rebuild(
            spec.folder, spec.config, AutoConfig.from_pretrained(src.folder), None, skip=spec.layer_skip
        )
    nf4 = {f"nf4_{k}": tuple(v) if k == "skip_modules" else v for k, v in (options["nf4"] or {}).items()}
    opts = MergeOptions(
        dtype=options["dtype"],
        max_shard_size=1 << 62,
        base_precision=options["base_precision"],
        chunk_elems=options["chunk_elems"] or DEFAULT_CHUNK_ELEMS,
        **nf4,
    )
    return info, build_plan(src, spec, info, opts)


def _match_names(planned: dict, stored: dict[str, TensorInfo], info) -> tuple[dict[str, str], set, set]:
    """``(planned name -> stored name, fused planned names, fused stored names)``: each of the base's checkpoint keys
    matches the same key, or the name transformers loads it under (an in-process merge writes in-memory names,
    e.g. LLaVA's ``model.language_model.*`` for ``language_model.model.*``); keys that loading fuses into one
    tensor (per-expert MoE weights into ``experts.gate_up_proj``) are returned apart, with the fused tensors."""
    target = {n: n for n in planned if n in stored}
    rest = [n for n in planned if n not in stored]
    fused, fused_stored = set(), set()
    if rest:
        taken = set(target.values())
        for name, (memory, converted) in info.memory_names(rest).items():
            if memory in stored and memory not in taken:
                if converted:
                    fused.add(name)
                    fused_stored.add(memory)
                else:
                    target[name] = memory
                    taken.add(memory)
    return target, fused, fused_stored


def _identity_notes(record: dict | None, base: str, adapters: list[str]) -> list[str]:
    """Notes where the given inputs are not the files the record says the merge read (the recomputation decides
    whether that matters: another copy of the same weights gives the same tensors)."""
    from ..output.record import file_sha256

    notes = []
    wanted = [(base, (record or {}).get("base"), "the base")]
    wanted += [
        (a, r, f"adapter {i + 1}") for i, (a, r) in enumerate(zip(adapters, (record or {}).get("adapters") or []))
    ]
    for folder, entry, what in wanted:
        files = (entry or {}).get("files") or {}
        if not os.path.isdir(folder):
            continue
        for name, meta in sorted(files.items(), key=lambda kv: not kv[0].endswith((".safetensors", ".bin"))):
            if name == "README.md":
                continue
            path = os.path.join(folder, name)
            if "sha256" in meta and os.path.isfile(path) and file_sha256(path) != meta["sha256"]:
                notes.append(f"{what} given differs from the one merged: its {name} is not the file the merge read")
                break
    return notes


def _encoding(record: dict | None, plan, result: RecomputeResult):
    """The served format the record says the merge was written in, applied to the recomputation's plan (None: the
    merge's dtype; False: it cannot be, said in ``result``)."""
    quantize = (record or {}).get("quantize")
    if not quantize:
        return None
    try:
        encoder = encoder_from_record(quantize)
        return encode_plan(plan, encoder, base_quantization(plan) if quantize.get("base") else None)
    except ShardMergeError as e:
        result.problems.append(f"the quantized format cannot be recomputed: {str(e).splitlines()[0]}")
        result.fits = False
        return False


def _config_problems(stored: dict[str, TensorInfo], encoding) -> list[str]:
    """What differs between the checkpoint's ``quantization_config`` and the one the merge writes for its format (a
    loader reads the tensors by it)."""
    import json

    folder = os.path.dirname(next(iter(stored.values())).path) if stored else "."
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            got = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return []  # the structural checks say what is wrong with config.json
    want = json.loads(json.dumps(encoding.quantization_config()))
    if got == want:
        return []
    keys = sorted(k for k in set(got or {}) | set(want) if (got or {}).get(k) != want.get(k))
    return [
        f"config.json's quantization_config differs from the one the merge writes for {encoding.encoder.name} in "
        f"{', '.join(keys[:5])}: a loader would read the stored tensors otherwise"
    ]


def _planned_stored(plan, encoding) -> tuple[dict, dict[str, list[str]]]:
    """The tensors the recomputation plans, as stored (an encoded weight's stored tensors each, with their dtype and
    shape), and the stored names of each planned tensor."""
    planned, parts = {}, {}
    for t in plan.tensors:
        if encoding is None or t.name not in encoding.names:
            planned[t.name], parts[t.name] = t, [t.name]
            continue
        entries = encoding.entries((t.name, t.out_dtype, tuple(t.shape), t.nbytes))
        parts[t.name] = [e[0] for e in entries]
        for name, dtype, shape, _ in entries:
            planned[name] = SimpleNamespace(out_dtype=dtype, shape=shape)
    return planned, parts


def _check_layout(result: RecomputeResult, planned: dict, stored: dict[str, TensorInfo], info) -> tuple[dict, list]:
    """Match the planned tensors with the stored ones and add every missing, extra or reshaped tensor to
    ``result`` (``fits`` says whether all match); returns ``(planned name -> stored name, planned names of another
    dtype or shape)``."""
    target, fused, fused_stored = _match_names(planned, stored, info)
    missing = sorted(set(planned) - set(target) - fused)
    extra = sorted(set(stored) - set(target.values()) - fused_stored)
    if fused:
        result.notes.append(
            f"{len(fused_stored)} tensor(s) stored fused as transformers loads them (e.g. "
            f"{sorted(fused_stored)[0]}), built from {len(fused)} checkpoint keys: not recomputed "
            "(the logits cover them)"
        )
    if missing:
        result.problems.append(
            f"{len(missing)} tensor(s) that base + adapter give are not in the checkpoint: {', '.join(missing[:5])}"
        )
    if extra:
        result.problems.append(
            f"{len(extra)} tensor(s) of the checkpoint do not come from base + adapter: {', '.join(extra[:5])}"
        )
    shapes = [
        n
        for n in sorted(target)
        if (planned[n].out_dtype, tuple(planned[n].shape)) != (stored[target[n]].dtype, tuple(stored[target[n]].shape))
    ]
    for n in shapes[:5]:
        got = stored[target[n]]
        result.problems.append(
            f"{target[n]}: the checkpoint has {got.dtype} {list(got.shape)}, base + adapter "
            f"give {planned[n].out_dtype} {list(planned[n].shape)}"
        )
    if len(shapes) > 5:
        result.problems.append(f"... and {len(shapes) - 5} more tensor(s) of another dtype or shape")
    result.fits = not (missing or extra or shapes)
    return target, shapes


def _summarize(result: RecomputeResult, sink: CompareSink, options: dict, n_stored: int) -> None:
    """Add the comparison's outcome to ``result``: the tensors that differ (ten named) and the one-line check."""
    result.compared, result.bitwise = sink.compared, sink.bitwise
    for name, why in sink.differ[:10]:
        result.problems.append(f"{name}: {why}")
    if len(sink.differ) > 10:
        result.problems.append(f"... and {len(sink.differ) - 10} more tensor(s) differ from base + adapter")
    near = sink.within_repacking
    if near:
        result.unchecked.append(
            f"{len(near)} tensor(s) ({', '.join(near[:3])}{', ...' if len(near) > 3 else ''}) differ from base + "
            "adapter, within the loss of "
            "bitsandbytes' CPU repacking: the merge read them from 4-bit weights repacked for its CPU kernel (an eval "
            "forward on a CPU with AVX512-BF16), whose block scales were rounded to bf16, so their exact base was not "
            "the one merged; merge again from a model loaded with module.support_avx512bf16_for_cpu = False"
        )
    result.complete = not result.problems and not result.unchecked and result.compared == n_stored
    nf4 = options["nf4"]
    precision = options["base_precision"] + (
        f" ({nf4['quant_type']}, blocksize {nf4['blocksize']}, {'' if nf4['double_quant'] else 'no '}double quant)"
        if nf4
        else ""
    )
    result.checks.append(
        f"recomputed {result.compared} tensors from base + adapter (base precision {precision}): "
        f"{result.bitwise} equal byte for byte, "
        f"{result.compared - result.bitwise - len(sink.differ) - len(near)} within rounding, "
        + (f"{len(near)} within the CPU repacking's loss, " if near else "")
        + f"{len(sink.differ)} different"
    )


def recompute_and_compare(
    stored: dict[str, TensorInfo], base: str, adapters: list[str], record: dict | None, *, device: str = "cpu"
) -> RecomputeResult:
    """Recompute every tensor of a merged checkpoint from ``base`` + ``adapters`` with the disk engine (the plan
    and merge code the merge itself runs, one row block at a time, into the base precision the record names) and
    compare it with the stored bytes: byte for byte where the result is the same, else each merged value within
    one rounding to the output dtype plus :data:`SUM_ORDER_EPS` float32 epsilons of its block's largest value (a
    different summation order). Tensors no adapter changes must be equal byte for byte.

    Args:
        stored: the checkpoint's tensors by name (from its headers).
        base: the base checkpoint.
        adapters: the adapter folders, in the order they were combined.
        record: the ``merge`` section of ``merge_manifest.json``, or None.
        device: where the maths runs.

    Returns:
        The :class:`RecomputeResult`; inputs that do not fit are among its problems, never raised.
    """
    from ..checkpoint.reader import CheckpointReader
    from ..engine.execute import resolve_device, run

    result = RecomputeResult()
    floats = {DTYPES[t.dtype][0] for t in stored.values() if t.dtype in FLOAT_DTYPES}
    out_dtype = str(next(iter(floats))).removeprefix("torch.") if len(floats) == 1 else None
    options, notes = merge_settings(record, out_dtype)
    result.notes += notes
    if options is not None:
        options, settled = settle_stored_base(options, record, base)
        if options is None:  # the base given cannot be the one merged: no verdict either way
            result.unchecked += settled
            return result
        result.notes += settled
    if options is None:
        return result
    n_recorded = len((record or {}).get("adapters") or [])
    if n_recorded and n_recorded != len(adapters):
        result.problems.append(
            f"the merge combined {n_recorded} adapter(s), {len(adapters)} given: give each "
            "one, in the order they were merged"
        )
        result.fits = False
        return result
    result.notes += _identity_notes(record, base, adapters)
    try:
        info, plan = plan_recomputation(base, adapters, options)
    except ShardMergeError as e:
        lines = getattr(e, "problems", None) or [str(e)]
        result.problems += [f"base + adapter cannot be planned: {p}" for p in lines]
        result.fits = False
        return result
    why = _reproducible(options["held"], plan)
    if why:
        result.notes.append(why)
        return result
    encoding = _encoding(record, plan, result)
    if encoding is False:
        return result
    planned, parts = _planned_stored(plan, encoding)
    target, shapes = _check_layout(result, planned, stored, info)
    todo = [t for t in plan.tensors if all(n in target and n not in shapes for n in parts[t.name])]
    sink = CompareSink(
        os.path.dirname(next(iter(stored.values())).path) if stored else ".",
        {n: stored[m] for n, m in target.items()},
        rounding={t.name for t in todo if t.op is Op.MERGE and (encoding is None or t.name not in encoding.names)},
        repacked=set((record or {}).get("cpu_repacked") or ()),
    )
    if encoding is not None:  # compared in the stored format: the recomputed merge encoded as the merge encoded it
        sink = QuantSink(sink, encoding)
        result.problems += _config_problems(stored, encoding)
    part = dataclasses.replace(plan, tensors=todo)  # those whose name, dtype and shape the checkpoint has
    try:
        run(part, CheckpointReader(part, resolve_device(device)), sink, progress=False)
    except ShardMergeError as e:
        result.problems.append(f"recomputing failed: {str(e).splitlines()[0]}")
        return result
    _summarize(result, sink, options, len(stored))
    return result
