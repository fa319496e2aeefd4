"""Quantized base checkpoints on disk: which formats are read, and the dequantized view a plan sees of them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from .errors import InputError
from .safetensors_io import DTYPES, TORCH_TO_ST, RowReader, TensorInfo

__all__ = ["Decoder", "RowDecoder", "QuantView", "FORMATS", "dequantized_view", "logical_info", "model_dtype_name"]

#: quant_method -> module reading it (each module has ``view(tensors, config, qc) -> QuantView``)
FORMATS = {
    "bitsandbytes": "peft_shardmerge.quant_bnb",
    "fp8": "peft_shardmerge.quant_fp8",
    "mxfp4": "peft_shardmerge.quant_mxfp4",
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


class Decoder(Protocol):
    """How one logical (dequantized) tensor is computed from the stored tensors of a quantized checkpoint.

    Attributes:
        stored: the stored tensors it reads (packed codes, scales, quant state), for fingerprints and messages.
        method: what does the arithmetic, e.g. ``"bitsandbytes.functional.dequantize_4bit"``.

    Example:
        >>> rows = info.decoder.rows(reader, 0, 16)   # doctest: +SKIP
    """

    stored: tuple[TensorInfo, ...]
    method: str

    def rows(self, reader: RowReader, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (dimension 0) of the dequantized tensor, in the logical dtype, as an independent
        tensor, reading only the stored bytes those rows need."""
        ...  # pragma: no cover - a protocol


@dataclass(frozen=True)
class RowDecoder:
    """What the format decoders share: the stored tensors read, the logical dtype, and :meth:`rows`, documented
    once, which hands the range to the format's ``decode``.

    Attributes:
        stored: the stored tensors read, the main one first.
        dtype: the logical (dequantized) dtype.
    """

    stored: tuple[TensorInfo, ...]
    dtype: torch.dtype

    def rows(self, reader: RowReader, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (dimension 0) of the dequantized tensor, reading only the stored bytes they need.

        Args:
            reader: the reader of the checkpoint's files.
            start: first row (expert, for a 3-D tensor of experts).
            stop: one past the last row.

        Returns:
            An independent tensor of shape ``(stop - start, *shape[1:])`` in the logical dtype.

        Raises:
            CorruptFileError: a file ended early.

        Example:
            >>> info.decoder.rows(reader, 0, 16).shape   # doctest: +SKIP
            torch.Size([16, 200])
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
            :class:`~peft_shardmerge.safetensors_io.TensorInfo` with a ``decoder``.
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
        return (f"the base is stored as {self.method}: its {self.dequantized} quantized weights are dequantized "
                f"block by block ({', '.join(methods)}) and written as {str(dtype).removeprefix('torch.')}; "
                f"{self.consumed} stored scale/state tensors are read, not copied")


def model_dtype_name(config: dict) -> str:
    """The safetensors dtype a dequantized weight takes: the dtype ``config.json`` records (also inside
    ``text_config``), else bfloat16.

    Args:
        config: the checkpoint's ``config.json``.

    Returns:
        ``"BF16"``, ``"F16"`` or ``"F32"``.

    Raises:
        Nothing.

    Example:
        >>> model_dtype_name({"torch_dtype": "float16"}), model_dtype_name({})
        ('F16', 'BF16')
    """
    for sub in (config, config.get("text_config")):
        if isinstance(sub, dict):
            for key in ("dtype", "torch_dtype"):
                name = sub.get(key)
                if name in ("bfloat16", "float16", "float32"):
                    return TORCH_TO_ST[getattr(torch, name)]
    return "BF16"


def logical_info(name: str, dtype: str, shape: tuple[int, ...], decoder: Decoder) -> TensorInfo:
    """A :class:`~peft_shardmerge.safetensors_io.TensorInfo` for a dequantized tensor: its name, dtype and shape as
    transformers' dequantized model has them; ``path``/``offset`` are those of its first stored tensor and
    ``nbytes`` is its size once dequantized.

    Args:
        name: the tensor's key in the output (and in the dequantized model's state dict).
        dtype: its safetensors dtype once dequantized.
        shape: its shape once dequantized.
        decoder: what computes its rows.

    Returns:
        The TensorInfo, with ``decoder`` set.

    Raises:
        Nothing.

    Example:
        >>> info = logical_info("w", "BF16", (4, 64), decoder)   # doctest: +SKIP
    """
    first = decoder.stored[0]
    numel = 1
    for s in shape:
        numel *= s
    return replace(first, name=name, dtype=dtype, shape=tuple(shape), nbytes=numel * DTYPES[dtype][1],
                   decoder=decoder)


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
    method = str(qc.get("quant_method", "bitsandbytes" if ("load_in_4bit" in qc or "load_in_8bit" in qc)
                        else "unknown"))
    if method not in FORMATS:
        name = _INSTEAD.get(method, f"quant_method={method!r}")
        raise InputError(
            f"base {folder} is stored quantized as {name}, which this version does not read (it reads "
            f"bitsandbytes 4-bit/8-bit, fine-grained FP8 and MXFP4); merge into the unquantized checkpoint the "
            f"quantized one was made from, or load the base with transformers, dequantize it "
            f"(model.dequantize() where the format supports it) and save_pretrained it as a 16-bit checkpoint"
        )
    return importlib.import_module(FORMATS[method]).view(tensors, config, qc)
