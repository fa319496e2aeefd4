"""MXFP4 base checkpoints (gpt-oss): the fused MoE expert weights stored as FP4 blocks with E8M0 scales, read as
transformers' dequantized model has them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import CorruptFileError, InputError
from ..io.safetensors_io import DTYPES, RowReader, TensorInfo
from .formats import Decoder, QuantView, logical_info, model_dtype_name

__all__ = ["Mxfp4Decoder", "view"]

#: the weights transformers stores as MXFP4 (``Mxfp4HfQuantizer.serialized_names``): name -> (in, out) config fields
PROJECTIONS = {"gate_up_proj": ("hidden_size", "intermediate_size"), "down_proj": ("intermediate_size", "hidden_size")}
BLOCKS, SCALES = "_blocks", "_scales"
#: FP4 values per stored byte and per scale (one E8M0 exponent covers a group of 32 values, 16 bytes)
PER_BYTE, GROUP = 2, 32
METHOD = "transformers.integrations.mxfp4.convert_moe_packed_tensors"


@dataclass(frozen=True)
class Mxfp4Decoder(Decoder):
    """The rows (experts) of one fused expert weight of an MXFP4 checkpoint, dequantized by transformers' own
    ``convert_moe_packed_tensors`` on just those experts' blocks and scales.

    The stored blocks are ``[experts, out, groups, 16]`` bytes (two FP4 values each) and the scales
    ``[experts, out, groups]``; transformers dequantizes them to ``[experts, out, groups * 32]`` and transposes the
    last two dimensions, so the logical tensor is ``[experts, in, out]`` (``gate_up_proj``: ``[E, hidden,
    2 * intermediate]``, ``down_proj``: ``[E, intermediate, hidden]``). Dimension 0 is the experts dimension both in
    the stored tensors and in the logical one, and every value of an expert depends only on that expert's blocks
    and scales, so logical rows ``[start, stop)`` read exactly stored rows ``[start, stop)`` of both.

    Attributes:
        stored: ``(blocks, scales)``.
        method: the function doing the arithmetic.
        dtype: the logical dtype (the dtype transformers' dequantized parameter has).
    """

    method: ClassVar[str] = METHOD

    def decode(self, reader: RowReader, start: int, stop: int) -> torch.Tensor:
        """Experts ``[start, stop)`` dequantized, shape ``(stop - start, in, out)``."""
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        blocks, scales = self.stored
        packed = reader.read_rows(blocks, start, stop).clone()  # the reader's buffer is reused by the next read
        exponents = reader.read_rows(scales, start, stop).clone()
        return convert_moe_packed_tensors(packed, exponents, dtype=self.dtype)


def _check_pair(blocks: TensorInfo, scales: TensorInfo | None, config: dict, proj: str) -> list[str]:
    """What is wrong with one blocks/scales pair (empty when it is an MXFP4 weight transformers dequantizes)."""
    where = f"{blocks.name!r} in {blocks.path}"
    if scales is None:
        return [
            f"{where} has no {blocks.name.removesuffix(BLOCKS) + SCALES!r} next to it: an MXFP4 weight needs its "
            f"E8M0 scales; re-download or re-convert the checkpoint"
        ]
    problems = []
    if blocks.dtype != "U8" or len(blocks.shape) != 4 or blocks.shape[-1] != GROUP // PER_BYTE:
        problems.append(
            f"{where} is {blocks.dtype} {list(blocks.shape)}; MXFP4 blocks are U8 "
            f"[experts, out, groups, {GROUP // PER_BYTE}] (transformers reads no other layout)"
        )
    if scales.dtype != "U8":
        problems.append(f"{scales.name!r} in {scales.path} is {scales.dtype}; MXFP4 scales are U8 E8M0 exponents")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        problems.append(
            f"{scales.name!r} has shape {list(scales.shape)} but {blocks.name!r} is "
            f"{list(blocks.shape)}: the scales must be the blocks' shape without the last dimension "
            f"({list(blocks.shape[:-1])}); the checkpoint is corrupted or not MXFP4"
        )
    if problems:
        return problems
    fan_in, fan_out = (config.get(field) for field in PROJECTIONS[proj])
    want_in = fan_in
    want_out = fan_out * 2 if proj == "gate_up_proj" and isinstance(fan_out, int) else fan_out
    _, out, groups, _ = blocks.shape
    if isinstance(want_in, int) and isinstance(want_out, int) and (groups * GROUP, out) != (want_in, want_out):
        problems.append(
            f"{where} dequantizes to [in={groups * GROUP}, out={out}] per expert but config.json "
            f"({'/'.join(PROJECTIONS[proj])}) makes {proj} [in={want_in}, out={want_out}]; "
            f"the config and the weights disagree"
        )
    return problems


def _projection(name: str, suffix: str) -> str | None:
    """``"gate_up_proj"``/``"down_proj"`` when ``name`` is that weight's stored part ``suffix``, else None."""
    for proj in PROJECTIONS:
        if name.endswith(proj + suffix):
            return proj
    return None


def view(tensors: list[TensorInfo], config: dict, qc: dict) -> QuantView:
    """The dequantized view of an MXFP4 checkpoint (transformers' ``Mxfp4Config``, as gpt-oss ships).

    Each ``<experts>.gate_up_proj_blocks``/``down_proj_blocks`` with its ``..._scales`` becomes the tensor
    ``<experts>.gate_up_proj``/``down_proj`` that ``from_pretrained(..., quantization_config=
    Mxfp4Config(dequantize=True))`` builds, in the model's dtype (``config.json``'s, else bfloat16); every other
    tensor (attention, router, biases, norms, embeddings, stored in 16 bits) is passed through.

    Args:
        tensors: the stored tensors in checkpoint order, each expert weight as a ``_blocks``/``_scales`` pair.
        config: the checkpoint's ``config.json`` (its ``hidden_size`` and ``intermediate_size`` are checked
            against the dequantized shapes).
        qc: its ``quantization_config`` (``quant_method: "mxfp4"``).

    Returns:
        The :class:`~peft_shardmerge.quant.formats.QuantView`, the experts under their dequantized names.

    Raises:
        CorruptFileError: blocks without their scales, scales without their blocks, blocks and scales whose shapes
            or dtypes do not fit, or a dequantized shape that disagrees with ``config.json``.
        InputError: the config says MXFP4 but no tensor is stored as MXFP4 blocks.
    """
    by_name = {t.name: t for t in tensors}
    dtype_name = model_dtype_name(config)
    out: list[TensorInfo] = []
    problems: list[str] = []
    consumed = dequantized = 0
    done: set[str] = set()
    for t in tensors:
        proj = _projection(t.name, BLOCKS) or _projection(t.name, SCALES)
        base = t.name.removesuffix(BLOCKS).removesuffix(SCALES) if proj else None
        blocks = by_name.get(f"{base}{BLOCKS}") if proj else None
        if blocks is None:  # not MXFP4, or scales whose blocks are missing
            if proj:
                problems.append(
                    f"{t.name!r} in {t.path} has no {base + BLOCKS!r} to scale; the checkpoint is "
                    f"incomplete (a shard or tensor is missing)"
                )
            out.append(t)
            continue
        if base in done:  # the pair's second stored tensor: the weight took the place of the first
            consumed += 1
            continue
        done.add(base)
        scales = by_name.get(base + SCALES)
        found = _check_pair(blocks, scales, config, proj)
        if found:
            problems.extend(found)
            continue
        experts, fan_out, groups, _ = blocks.shape
        out.append(
            logical_info(
                base,
                dtype_name,
                (experts, groups * GROUP, fan_out),
                Mxfp4Decoder((blocks, scales), DTYPES[dtype_name][0]),
            )
        )
        dequantized += 1
    if problems:
        raise CorruptFileError("MXFP4 checkpoint: " + "; ".join(problems))
    if not dequantized:
        raise InputError(
            "config.json's quantization_config says MXFP4 (quant_method 'mxfp4') but no tensor is stored as MXFP4 "
            "(no '*.gate_up_proj_blocks'/'*.down_proj_blocks' with their '_scales'): the config and the weights "
            "disagree; remove quantization_config from config.json if the weights are not quantized"
        )
    return QuantView(out, "MXFP4 (FP4 E2M1 blocks of 32 with E8M0 scales)", dequantized, consumed)
