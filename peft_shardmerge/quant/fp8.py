"""Fine-grained FP8 base checkpoints (DeepSeek-V3/R1, Qwen3 -FP8): float8 weights with one ``weight_scale_inv`` per
block, read as their dequantized rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CorruptFileError, InputError
from ..io.safetensors_io import DTYPES, RowReader, TensorInfo
from .formats import Decoder, QuantView, logical_info, model_dtype_name

__all__ = ["Fp8Decoder", "block_size", "view"]

METHOD = "transformers.integrations.finegrained_fp8.Fp8Dequantize"
#: the FP8 dtypes a weight may be stored in (transformers upcasts either to float32 before scaling)
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
#: dtypes of scales that convert to float32 exactly, as transformers converts them
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
#: where a weight ``X.weight`` keeps its scales: transformers reads ``X.weight_scale_inv`` and renames ``X.scale``
#: (DeepSeek-V4) and ``X.qscale_weight`` (Mistral Large 4) to it
SCALE_NAMES = ("weight_scale_inv", "scale", "qscale_weight")
#: scale names that are never a model's own parameter: such a tensor without an FP8 weight is refused, not copied
#: (``scale`` is also the name of some norms' parameter)
ORPHAN_CHECKED = ("weight_scale_inv", "qscale_weight")
#: per-tensor activation scales transformers reads with the weight and drops when it dequantizes
ACTIVATION_SCALE = "activation_scale"
#: the default of ``FineGrainedFP8Config.weight_block_size`` when the config leaves it out
DEFAULT_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Decoder(Decoder):
    """Rows of one FP8 weight ``[out, in]``, dequantized as ``fp8.to(float32) * scale_inv`` of their block, in float32.

    Transformers' loader (``FineGrainedFP8Config(dequantize=True)``, the route it takes on a machine without a
    GPU) derives the block from the scale grid (``rows // scale_rows``), which is the block only when both sides
    of the weight are multiples of it; for a side that is not (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows),
    it scales the wrong rows, or refuses the weight. The format's block is ``weight_block_size`` with a partial
    last block, as transformers' own FP8 matmul and the DeepSeek and vLLM kernels read it. So each row gets the
    float32 scales of its row block (``scale_inv[row // block[0]]``, one per column block), the columns are padded
    with zeros to whole blocks, and transformers' ``Fp8Dequantize`` does the arithmetic on that piece, where the
    block it derives (one row by ``block[1]`` columns) is the true one. Its result is float32 and is returned as is,
    sliced back to the weight's columns: the merge adds the adapter's float32 delta to it and casts once (a weight
    without a delta is cast once too, as transformers casts its float32 product once).

    Attributes:
        stored: ``(weight, scales)``.
        dtype: the logical dtype (that of transformers' dequantized parameter).
        block: ``(rows, columns)`` of a block; None for one scale per tensor.
        method: what does the arithmetic.
    """

    block: tuple[int, int] | None
    method: ClassVar[str] = METHOD

    def decode(self, reader: RowReader, start: int, stop: int) -> torch.Tensor:
        """The rows dequantized, reading scale rows ``start // block[0]`` to ``(stop - 1) // block[0]`` only."""
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        weight, scales = self.stored
        cols = weight.shape[1]
        if stop <= start or cols == 0:
            return torch.empty((max(stop - start, 0), cols), dtype=torch.float32)
        q = reader.read_rows(weight, start, stop).clone()  # the reader's buffer is reused by the next read
        per_row, width = self._row_scales(reader, start, stop, cols)
        if width != cols:  # a partial last column block: zeros up to whole blocks, dropped after
            padded = q.new_zeros((stop - start, width))
            padded[:, :cols] = q
            q = padded
        out = Fp8Dequantize(None).convert({"weight": q, "weight_scale_inv": per_row})["weight"]
        return out[:, :cols].contiguous()  # float32: cast once, after the delta is added

    def _row_scales(self, reader: RowReader, start: int, stop: int, cols: int) -> tuple[torch.Tensor, int]:
        """The float32 scales of rows ``[start, stop)``, one per column block, and the padded width."""
        scales = self.stored[1]
        if self.block is None:
            one = reader.read(scales).reshape(1, 1).to(torch.float32)
            return one.expand(stop - start, 1).contiguous(), cols
        b0, b1 = self.block
        first = start // b0
        grid = reader.read_rows(scales, first, (stop - 1) // b0 + 1).to(torch.float32, copy=True)
        index = torch.arange(start, stop) // b0 - first
        return grid.index_select(0, index), grid.shape[1] * b1


def block_size(qc: dict) -> tuple[int, int] | None:
    """The block of a fine-grained FP8 ``quantization_config``, as ``FineGrainedFP8Config`` reads it.

    Args:
        qc: the ``quantization_config`` object of ``config.json``.

    Returns:
        ``(rows, columns)``; ``(128, 128)`` when ``weight_block_size`` is left out (transformers' default);
        None when it is ``null`` (one scale per tensor).

    Raises:
        InputError: ``weight_block_size`` is not two positive integers.

    Example:
        >>> block_size({"quant_method": "fp8", "weight_block_size": [128, 128]})
        (128, 128)
        >>> block_size({"quant_method": "fp8", "weight_block_size": None}) is None
        True
    """
    if "weight_block_size" not in qc:
        return DEFAULT_BLOCK
    value = qc["weight_block_size"]
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise InputError(
            f"config.json: quantization_config.weight_block_size is {value!r}; fine-grained FP8 needs "
            "two positive integers (e.g. [128, 128]) or null for one scale per tensor; fix config.json"
        )
    return int(value[0]), int(value[1])


def _check_config(qc: dict) -> None:
    """Refuse the settings of ``FineGrainedFP8Config`` that transformers refuses or that change what is stored."""
    problems = []
    scheme = qc.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() not in ("dynamic", "static"):
        problems.append(
            f"config.json: quantization_config.activation_scheme is {scheme!r}; transformers reads only "
            "'dynamic' or 'static'; fix config.json"
        )
    if qc.get("scale_fmt", "float") not in ("float", "ue8m0"):
        problems.append(
            f"config.json: quantization_config.scale_fmt is {qc.get('scale_fmt')!r}; transformers reads "
            "only 'float' or 'ue8m0'; fix config.json"
        )
    if qc.get("expert_dtype", "fp8") != "fp8":
        problems.append(
            f"config.json: quantization_config.expert_dtype is {qc.get('expert_dtype')!r}: FP4-packed "
            "experts (DeepSeek-V4) are not read by this version; merge into a 16-bit checkpoint"
        )
    if qc.get("modules_to_convert"):
        problems.append(
            "config.json: quantization_config.modules_to_convert names FP8 embedding tables, which "
            "transformers keeps in FP8 even when it dequantizes; this version does not read them; merge "
            "into a 16-bit checkpoint"
        )
    if problems:
        raise InputError(problems)


def _expected_grid(weight: TensorInfo, block: tuple[int, int] | None) -> tuple[int, ...] | None:
    """The scale shape a 2-D weight needs (None: one scale per tensor)."""
    if block is None:
        return None
    return tuple(-(-side // b) for side, b in zip(weight.shape, block))


def _scale_problem(weight: TensorInfo, scales: TensorInfo, block: tuple[int, int] | None) -> str:
    """What is wrong with a weight's scales ('' when they fit it)."""
    where = f"{scales.name!r} in {scales.path}"
    if scales.dtype == "U8":
        return (
            f"{where} holds UE8M0 exponents as bytes (U8), which this version does not read; merge into a 16-bit "
            "checkpoint of the model"
        )
    if scales.dtype not in SCALE_DTYPES:
        return (
            f"{where} is stored as {scales.dtype}; fine-grained FP8 scales are float32 (or bf16/f16/E8M0), "
            "which this version reads; re-download or re-convert the checkpoint"
        )
    grid = _expected_grid(weight, block)
    if grid is None:
        if scales.numel != 1 or len(scales.shape) > 2:
            return (
                f"{where} has shape {list(scales.shape)} but weight_block_size is null (one scale per tensor); "
                "set weight_block_size in config.json to the block the scales were made with"
            )
        return ""
    if scales.shape != grid:
        return (
            f"{where} has shape {list(scales.shape)}, but {weight.name!r} {list(weight.shape)} in blocks of "
            f"{list(block)} needs {list(grid)}; the scales do not fit the weight or config.json's "
            "weight_block_size; re-download the checkpoint or fix weight_block_size"
        )
    return ""


def _pair(
    weight: TensorInfo, by_name: dict[str, TensorInfo], block: tuple[int, int] | None
) -> tuple[TensorInfo | None, list[str], list[str]]:
    """The scales of a stored FP8 tensor, with what this version does not read and what is corrupt about it."""
    where = f"{weight.name!r} in {weight.path}"
    if not weight.name.endswith(".weight") or len(weight.shape) != 2:
        return (
            None,
            [
                f"{where} is stored as {weight.dtype} with shape {list(weight.shape)}; this version reads "
                "fine-grained FP8 only as 2-D linear weights named '.weight'; merge into a 16-bit checkpoint "
                "of the model"
            ],
            [],
        )
    scales, more = _scales_of(weight, by_name)
    if more:
        return None, [], more
    if scales is None:
        stem = weight.name.removesuffix("weight")
        return (
            None,
            [],
            [
                f"{where} is stored as {weight.dtype} but has no {stem + SCALE_NAMES[0]!r} next to it: an "
                "FP8 weight needs its scales; re-download or re-convert the checkpoint"
            ],
        )
    problem = _scale_problem(weight, scales, block)
    return (None, [], [problem]) if problem else (scales, [], [])


def _scales_of(weight: TensorInfo, by_name: dict[str, TensorInfo]) -> tuple[TensorInfo | None, list[str]]:
    """The scale tensor of an FP8 weight (by transformers' names), and a problem when it has more than one."""
    stem = weight.name.removesuffix("weight")
    found = [by_name[stem + s] for s in SCALE_NAMES if stem + s in by_name]
    if len(found) > 1:
        return None, [
            f"{weight.name!r} has scales under more than one name ({', '.join(t.name for t in found)}); "
            "transformers would read one of them over the other; keep only the right one"
        ]
    return (found[0] if found else None), []


def view(tensors: list[TensorInfo], config: dict, qc: dict) -> QuantView:
    """The dequantized view of a fine-grained FP8 checkpoint: each FP8 ``X.weight`` becomes a tensor of the model's
    dtype read through an :class:`Fp8Decoder`; its scales and ``X.activation_scale`` (which transformers reads and
    drops when it dequantizes) are consumed; every other tensor is passed through as stored.

    Args:
        tensors: the stored tensors, in checkpoint order.
        config: the checkpoint's ``config.json``.
        qc: its ``quantization_config`` (``quant_method: "fp8"``).

    Returns:
        The :class:`~peft_shardmerge.quant.formats.QuantView`.

    Raises:
        InputError: a setting transformers refuses or this version does not read (``weight_block_size``,
            ``activation_scheme``, ``scale_fmt``, ``expert_dtype``), an FP8 tensor that is not a 2-D ``.weight``, an
            ``input_scale`` tensor (not part of this format: transformers does not read it), or no FP8 weight at all.
        CorruptFileError: an FP8 weight without its scales, scales of the wrong shape or dtype, or scales without an
            FP8 weight.
    """
    _check_config(qc)
    block = block_size(qc)
    dtype = model_dtype_name(config)
    by_name = {t.name: t for t in tensors}
    decoders, consumed, unsupported, corrupt = {}, set(), [], []
    for t in tensors:
        if t.dtype in FP8_DTYPES:
            scales, refused, bad = _pair(t, by_name, block)
            unsupported += refused
            corrupt += bad
            if scales is not None:
                decoders[t.name] = Fp8Decoder((t, scales), DTYPES[dtype][0], block)
                consumed.add(scales.name)
    for t in tensors:
        stem, _, last = t.name.rpartition(".")
        if last == ACTIVATION_SCALE:
            consumed.add(t.name)
        elif last == "input_scale":
            unsupported.append(
                f"{t.name!r} in {t.path}: fine-grained FP8 (quant_method 'fp8') has no input_scale "
                "tensors and transformers does not read them (it reports them as unexpected); the "
                "checkpoint is probably another FP8 format; merge into a 16-bit checkpoint instead"
            )
        elif last in ORPHAN_CHECKED and t.name not in consumed and f"{stem}.weight" not in decoders:
            weight = by_name.get(f"{stem}.weight")
            if weight is None or weight.dtype not in FP8_DTYPES:
                corrupt.append(
                    f"{t.name!r} in {t.path} scales {stem + '.weight'!r}, which is "
                    f"{'missing' if weight is None else 'stored as ' + weight.dtype + ', not FP8'}; "
                    "the checkpoint is inconsistent; re-download or re-convert it"
                )
    if corrupt:
        raise CorruptFileError("; ".join(dict.fromkeys(corrupt)))
    if unsupported:
        raise InputError(list(dict.fromkeys(unsupported)))
    if not decoders:
        raise InputError(
            "config.json says the base is fine-grained FP8 (quantization_config.quant_method 'fp8') "
            "but no weight is stored as FP8 with its weight_scale_inv: the config and the weights "
            "disagree; remove quantization_config from config.json if the weights are 16-bit"
        )
    out = []
    for t in tensors:
        if t.name in decoders:
            out.append(logical_info(t.name, dtype, t.shape, decoders[t.name]))
        elif t.name not in consumed:
            out.append(t)
    return QuantView(out, _method(tensors, decoders, block), len(decoders), len(consumed))


def _method(tensors: list[TensorInfo], decoders: dict, block: tuple[int, int] | None) -> str:
    """The format in words, e.g. ``fine-grained FP8 (F8_E4M3 weights, one float32 scale per 128x128 block)``."""
    kinds = sorted({t.dtype for t in tensors if t.name in decoders})
    scales = sorted({DTYPES[d.stored[1].dtype][0] for d in decoders.values()}, key=str)
    scale = "/".join(str(s).removeprefix("torch.") for s in scales)
    per = "tensor" if block is None else f"{block[0]}x{block[1]} block"
    return f"fine-grained FP8 ({'/'.join(kinds)} weights, one {scale} scale per {per})"
