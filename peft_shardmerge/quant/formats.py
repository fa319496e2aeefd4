"""Quantized base checkpoints on disk: which formats are read, and the dequantized view a plan sees of them."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..errors import InputError
from ..io.safetensors_io import DTYPES, TORCH_TO_ST, RowReader, TensorInfo

__all__ = [
    "Decoder",
    "QuantView",
    "FORMATS",
    "dequantized_view",
    "logical_info",
    "model_dtype_name",
    "quant_method",
    "recorded_dtype_name",
]

#: quant_method -> module reading it (each module has ``view(tensors, config, qc) -> QuantView``)
FORMATS = {
    "bitsandbytes": "peft_shardmerge.quant.bnb_checkpoint",
    "fp8": "peft_shardmerge.quant.fp8",
    "mxfp4": "peft_shardmerge.quant.mxfp4",
}

_INSTEAD = {
    "gptq": "GPTQ",
    "awq": "AWQ",
    "compressed-tensors": "compressed-tensors (llm-compressor)",
    "hqq": "HQQ",
    "aqlm": "AQLM",
    "vptq": "VPTQ",
    "eetq": "EETQ",
    "quanto": "optimum-quanto",
    "torchao": "torchao",
    "fbgemm_fp8": "FBGEMM FP8",
    "bitnet": "BitNet",
    "higgs": "HIGGS",
    "spqr": "SpQR",
    "quark": "AMD Quark",
    "fp_quant": "FP-Quant",
    "auto-round": "AutoRound",
    "modelopt": "NVIDIA ModelOpt (NVFP4/FP8)",
}


@dataclass(frozen=True)
class Decoder:
    """How one logical (dequantized) tensor is computed from the stored tensors of a quantized checkpoint; each
    format subclasses it with its ``decode`` and its ``method``.

    Attributes:
        stored: the stored tensors read (packed codes, scales, quant state), the main one first.
        dtype: the logical (dequantized) dtype.
        method: what does the arithmetic, e.g. ``"bitsandbytes.functional.dequantize_4bit"`` (a class attribute of
            each format's decoder).
    """

    stored: tuple[TensorInfo, ...]
    dtype: torch.dtype
    method: ClassVar[str] = ""

    def rows(self, reader: RowReader, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (dimension 0) of the dequantized tensor, reading only the stored bytes they need.

        Args:
            reader: the reader of the checkpoint's files.
            start: first row (expert, for a 3-D tensor of experts).
            stop: one past the last row.

        Returns:
            An independent tensor of shape ``(stop - start, *shape[1:])``: in float32 where the format's
            dequantization is float32 (FP8, LLM.int8; the merge adds the delta and casts once), else in the logical
            dtype (bitsandbytes 4-bit, MXFP4).

        Raises:
            CorruptFileError: a file ended early.
        """
        return self.decode(reader, start, stop)

    def decode(self, reader: RowReader, start: int, stop: int) -> torch.Tensor:  # pragma: no cover - overridden
        """The format's arithmetic for :meth:`rows`."""
        raise NotImplementedError


@dataclass
class QuantView:
    """The tensors a quantized checkpoint holds, as transformers' dequantized model names them.

    Attributes:
        tensors: every logical tensor in checkpoint order: unquantized ones as stored, quantized ones as a
            :class:`~peft_shardmerge.io.safetensors_io.TensorInfo` with a ``decoder``.
        method: the format in words, e.g. ``"bitsandbytes 4-bit (nf4, double quant)"``.
        dequantized: how many tensors are dequantized.
        consumed: how many stored auxiliary tensors (scales, quant state) are read and not copied.
    """

    tensors: list[TensorInfo]
    method: str
    dequantized: int
    consumed: int

    def note(self, dtype: torch.dtype) -> str:
        """The plan's note about this base."""
        methods = sorted({t.decoder.method for t in self.tensors if t.decoder is not None})
        return (
            f"the base is stored as {self.method}: its {self.dequantized} quantized weights are dequantized "
            f"block by block ({', '.join(methods)}) and written as {str(dtype).removeprefix('torch.')}; "
            f"{self.consumed} stored scale/state tensors are read, not copied"
        )


def recorded_dtype_name(config: dict) -> str | None:
    """The safetensors dtype ``config.json`` records (``dtype``/``torch_dtype``, also inside ``text_config``), the
    dtype transformers' dequantization casts to; None when it records none.

    Args:
        config: the checkpoint's ``config.json``.

    Returns:
        ``"BF16"``, ``"F16"``, ``"F32"`` or None.

    Example:
        >>> recorded_dtype_name({"torch_dtype": "float16"}), recorded_dtype_name({})
        ('F16', None)
    """
    for sub in (config, config.get("text_config")):
        if isinstance(sub, dict):
            for key in ("dtype", "torch_dtype"):
                name = sub.get(key)
                if name in ("bfloat16", "float16", "float32"):
                    return TORCH_TO_ST[getattr(torch, name)]
    return None


def model_dtype_name(config: dict) -> str:
    """The safetensors dtype a dequantized weight takes: :func:`recorded_dtype_name`, else bfloat16.

    Args:
        config: the checkpoint's ``config.json``.

    Returns:
        ``"BF16"``, ``"F16"`` or ``"F32"``.

    Example:
        >>> model_dtype_name({"torch_dtype": "float16"}), model_dtype_name({})
        ('F16', 'BF16')
    """
    return recorded_dtype_name(config) or "BF16"


def logical_info(name: str, dtype: str, shape: tuple[int, ...], decoder: Decoder) -> TensorInfo:
    """A :class:`~peft_shardmerge.io.safetensors_io.TensorInfo` for a dequantized tensor: its name, dtype and shape as
    transformers' dequantized model has them; ``path``/``offset`` are those of its first stored tensor and
    ``nbytes`` is its size once dequantized.

    Args:
        name: the tensor's key in the output (and in the dequantized model's state dict).
        dtype: its safetensors dtype once dequantized.
        shape: its shape once dequantized.
        decoder: what computes its rows.

    Returns:
        The TensorInfo, with ``decoder`` set.
    """
    return replace(
        decoder.stored[0],
        name=name,
        dtype=dtype,
        shape=tuple(shape),
        nbytes=math.prod(shape) * DTYPES[dtype][1],
        decoder=decoder,
    )


def dequantized_view(folder: str, config: dict, tensors: list[TensorInfo]) -> QuantView | None:
    """The dequantized view of a checkpoint whose ``config.json`` has a ``quantization_config``.

    Args:
        folder: the checkpoint folder (for messages).
        config: its ``config.json``.
        tensors: its stored tensors, in checkpoint order.

    Returns:
        None for an unquantized checkpoint, else the :class:`QuantView`.

    Raises:
        InputError: the format is not one this version reads (named, with what to do instead), or
            ``quantization_config`` is not an object.
        CorruptFileError: a quantized tensor's scales or quant state are missing or do not fit it.

    Example:
        >>> dequantized_view("/ckpt", {}, []) is None
        True
    """
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise InputError(f"base {folder}: config.json's quantization_config is not an object; fix config.json")
    method = quant_method(qc)
    if method not in FORMATS:
        name = _INSTEAD.get(method, f"quant_method={method!r}")
        raise InputError(
            f"base {folder} is stored quantized as {name}, which this version does not read (it reads "
            f"bitsandbytes 4-bit/8-bit, fine-grained FP8 and MXFP4); merge into the unquantized checkpoint the "
            f"quantized one was made from, or load the base with transformers, dequantize it "
            f"(model.dequantize() where the format supports it) and save_pretrained it as a 16-bit checkpoint"
        )
    return importlib.import_module(FORMATS[method]).view(tensors, config, qc)


def quant_method(qc: dict) -> str:
    """The format a ``quantization_config`` object names: its ``quant_method``, ``"bitsandbytes"`` for the older
    configs that only say ``load_in_4bit``/``load_in_8bit``, else ``"unknown"``.

    Args:
        qc: the ``quantization_config`` object of ``config.json``.

    Returns:
        The method name.

    Example:
        >>> quant_method({"load_in_4bit": True}), quant_method({"quant_method": "fp8"})
        ('bitsandbytes', 'fp8')
    """
    fallback = "bitsandbytes" if ("load_in_4bit" in qc or "load_in_8bit" in qc) else "unknown"
    return str(qc.get("quant_method", fallback))
