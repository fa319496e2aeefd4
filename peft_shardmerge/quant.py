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


#: characters reserved for the ``nested_offset`` float in a packed quant state (the longest ``repr`` of a float)
_FLOAT_CHARS = 24


def quant_state_fields(shape: tuple[int, ...], dtype: torch.dtype, settings: Nf4Settings,
                       nested_offset: float = 0.0) -> dict:
    """The non-tensor part of a bitsandbytes 4-bit quant state, as ``QuantState.as_dict(packed=True)`` packs it.

    Args:
        shape: the weight's shape.
        dtype: the dtype the weight had when quantized (its compute dtype after loading).
        settings: the 4-bit settings.
        nested_offset: the double-quantization offset (the mean block scale).

    Returns:
        The dict whose JSON is stored as the ``quant_state.bitsandbytes__<type>`` tensor.

    Raises:
        Nothing.

    Example:
        >>> quant_state_fields((4, 64), torch.bfloat16, Nf4Settings(double_quant=False))
        {'quant_type': 'nf4', 'blocksize': 64, 'dtype': 'bfloat16', 'shape': [4, 64]}
    """
    fields = {"quant_type": settings.quant_type, "blocksize": settings.blocksize,
              "dtype": str(dtype).removeprefix("torch."), "shape": list(shape)}
    if settings.double_quant:
        fields.update({"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": float(nested_offset)})
    return fields


def packed_4bit_layout(shape: tuple[int, ...], dtype: torch.dtype,
                       settings: Nf4Settings) -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensors transformers stores for one 4-bit weight, computed from its shape alone (nothing is quantized).

    Packed codes hold two 4-bit values a byte; ``absmax`` holds one scale per block (one byte each with double
    quantization, which adds one float32 scale per 256 blocks and the 256-entry map); the quant-state JSON is
    given a fixed length, room for any ``nested_offset``, and :func:`pad_quant_state` pads bitsandbytes' own JSON with spaces.

    Args:
        shape: the weight's shape.
        dtype: the dtype it is quantized from.
        settings: the 4-bit settings.

    Returns:
        ``(key suffix, safetensors dtype, shape)`` in the order bitsandbytes writes them; the suffix is ``""`` for
        the packed codes, else the part after ``<weight name>.``.

    Raises:
        Nothing.

    Example:
        >>> [(k, d, s) for k, d, s in packed_4bit_layout((7, 5), torch.bfloat16, Nf4Settings())][:3]
        [('', 'U8', (18, 1)), ('absmax', 'U8', (1,)), ('quant_map', 'F32', (16,))]
    """
    numel = 1
    for s in shape:
        numel *= s
    blocks = -(-numel // settings.blocksize)
    out = [("", "U8", ((numel + 1) // 2, 1)), ("absmax", "U8" if settings.double_quant else "F32", (blocks,)),
           ("quant_map", "F32", (16,))]
    if settings.double_quant:
        out += [("nested_absmax", "F32", (-(-blocks // 256),)), ("nested_quant_map", "F32", (256,))]
    out.append((f"quant_state.bitsandbytes__{settings.quant_type}", "U8", (quant_state_length(shape, dtype, settings),)))
    return out


def quant_state_length(shape: tuple[int, ...], dtype: torch.dtype, settings: Nf4Settings) -> int:
    """Bytes reserved for the quant-state JSON of a weight: its JSON with room for the longest float offset.

    Args:
        shape: the weight's shape.
        dtype: the dtype it is quantized from.
        settings: the 4-bit settings.

    Returns:
        The length in bytes.

    Raises:
        Nothing.

    Example:
        >>> quant_state_length((4, 64), torch.bfloat16, Nf4Settings(double_quant=False))
        77
    """
    import json

    text = json.dumps(quant_state_fields(shape, dtype, settings))
    return len(text) - len("0.0") + _FLOAT_CHARS if settings.double_quant else len(text)


def pad_quant_state(packed: torch.Tensor, length: int) -> torch.Tensor:
    """bitsandbytes' packed quant-state JSON (``QuantState.as_dict(packed=True)``) padded with spaces to exactly
    ``length`` bytes (``json.loads``, which ``QuantState.from_dict`` reads it with, ignores trailing whitespace).

    Args:
        packed: the 1-D ``torch.uint8`` tensor bitsandbytes packed.
        length: from :func:`quant_state_length`.

    Returns:
        A 1-D ``torch.uint8`` tensor of ``length`` bytes.

    Raises:
        ValueError: the JSON is longer than ``length``.

    Example:
        >>> bytes(pad_quant_state(torch.tensor(list(b'{"a": 1}'), dtype=torch.uint8), 10).tolist())
        b'{"a": 1}  '
    """
    data = bytes(packed.cpu().tolist())
    if len(data) > length:
        raise ValueError(f"quant state of {len(data)} bytes does not fit the {length} reserved")
    return torch.frombuffer(bytearray(data.ljust(length, b" ")), dtype=torch.uint8)
