"""The 4-bit base a QLoRA adapter was trained against: dequant(quantize_4bit(W)) with bitsandbytes on CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError, MissingDependencyError


@dataclass(frozen=True)
class Nf4Settings:
    """How bitsandbytes quantized the base during QLoRA training.

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"`` (``bnb_4bit_quant_type``).
        blocksize: quantization block size (64 in transformers' bitsandbytes integration).
        double_quant: ``bnb_4bit_use_double_quant``.

    Example:
        >>> Nf4Settings(quant_type="nf4", blocksize=64, double_quant=True).describe()
        'nf4, blocksize 64, double quant'
    """

    quant_type: str = "nf4"
    blocksize: int = 64
    double_quant: bool = True

    def validate(self) -> list[str]:
        """Return the problems with these settings (empty when valid)."""
        problems = []
        if self.quant_type not in ("nf4", "fp4"):
            problems.append(f"4-bit quant type must be 'nf4' or 'fp4', got {self.quant_type!r}")
        if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            problems.append(f"4-bit blocksize must be a power of two from 32 to 4096, got {self.blocksize}")
        return problems

    def describe(self) -> str:
        return f"{self.quant_type}, blocksize {self.blocksize}, {'double quant' if self.double_quant else 'no double quant'}"


def require_bitsandbytes():
    """Import bitsandbytes.functional, or explain how to install it.

    Args:
        None.

    Returns:
        The ``bitsandbytes.functional`` module.

    Raises:
        MissingDependencyError: bitsandbytes is not installed.

    Example:
        >>> F = require_bitsandbytes()   # doctest: +SKIP
    """
    try:
        import bitsandbytes.functional as F
    except ImportError as e:
        raise MissingDependencyError(
            "base precision 'nf4' needs bitsandbytes: pip install 'peft-shardmerge[bnb]'"
        ) from e
    return F


def quantize_roundtrip(weight: torch.Tensor, settings: Nf4Settings) -> torch.Tensor:
    """Return dequant(quantize_4bit(weight)) in float32, as bitsandbytes computes it.

    The whole tensor is quantized at once, because double quantization normalises the block scales by
    their mean over the tensor.

    Args:
        weight: the original weight, in the dtype it was loaded with for training.
        settings: the 4-bit settings used during training.

    Returns:
        The weights the adapter saw during training, as float32, same shape.

    Raises:
        MissingDependencyError: bitsandbytes is not installed.
        InputError: the settings are invalid.

    Example:
        >>> w = torch.randn(64, 64, dtype=torch.bfloat16)
        >>> quantize_roundtrip(w, Nf4Settings()).shape   # doctest: +SKIP
        torch.Size([64, 64])
    """
    problems = settings.validate()
    if problems:
        raise InputError(problems)
    F = require_bitsandbytes()
    q, state = F.quantize_4bit(
        weight.contiguous(),
        blocksize=settings.blocksize,
        compress_statistics=settings.double_quant,
        quant_type=settings.quant_type,
    )
    return F.dequantize_4bit(q, state).to(torch.float32).reshape(weight.shape)
