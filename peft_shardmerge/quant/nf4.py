"""The 4-bit base a QLoRA adapter was trained against: dequant(quantize_4bit(W)) with bitsandbytes on CPU."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from ..errors import InputError, MissingDependencyError


@dataclass(frozen=True)
class Nf4Settings:
    """How bitsandbytes quantized the base during QLoRA training.

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"`` (``bnb_4bit_quant_type``).
        blocksize: quantization block size (64 in transformers' bitsandbytes integration).
        double_quant: ``bnb_4bit_use_double_quant``.
        skip_modules: modules training kept unquantized (``llm_int8_skip_modules``), matched as transformers
            matches them (:func:`transformers.quantizers.quantizers_utils.should_convert_module`).

    Example:
        >>> Nf4Settings(quant_type="nf4", blocksize=64, double_quant=True).describe()
        'nf4, blocksize 64, double quant'
    """

    quant_type: str = "nf4"
    blocksize: int = 64
    double_quant: bool = True
    skip_modules: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether training quantized ``module`` (a module name: a weight's name without ``.weight``)."""
        if not self.skip_modules:
            return True
        from transformers.quantizers.quantizers_utils import should_convert_module

        return should_convert_module(module, list(self.skip_modules))

    def validate(self) -> list[str]:
        """Return the problems with these settings (empty when valid)."""
        problems = []
        if self.quant_type not in ("nf4", "fp4"):
            problems.append(f"4-bit quant type must be 'nf4' or 'fp4', got {self.quant_type!r}")
        if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            problems.append(f"4-bit blocksize must be a power of two from 32 to 4096, got {self.blocksize}")
        return problems

    def describe(self) -> str:
        kept = f", kept in 16-bit: {', '.join(self.skip_modules)}" if self.skip_modules else ""
        return (
            f"{self.quant_type}, blocksize {self.blocksize}, "
            f"{'double quant' if self.double_quant else 'no double quant'}{kept}"
        )


def require_bitsandbytes():
    """Import bitsandbytes.functional, or explain how to install it.

    Returns:
        The ``bitsandbytes.functional`` module.

    Raises:
        MissingDependencyError: bitsandbytes is not installed.
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
    return dequantize_state(q, state, torch.float32).reshape(weight.shape)


#: values dequantized at a time (a few MiB of scratch, whatever the weight's size)
PIECE_VALUES = 1 << 20


def dequantize_4bit_exact(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    blocksize: int,
    numel: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The 4-bit format's definition applied to packed bytes: value ``i`` is ``code[q_i] * absmax[i // blocksize]``
    in float32, rounded once to ``dtype``; ``q_{2j}`` is the high nibble of byte ``j``, ``q_{2j+1}`` the low one.

    The weight is quantized flat, whatever its shape, so this works on the flat elements; bitsandbytes' CPU
    ``dequantize_4bit`` instead takes blocks per row and is wrong where a row is not whole blocks (hidden size 96).

    Args:
        packed: the packed bytes (uint8, any shape) of elements ``[0, numel)`` of a run starting on a block boundary.
        absmax: the float32 scale of each block of that run (double quant already undone).
        code: the 16-entry code book (``bitsandbytes.functional.get_4bit_type``).
        blocksize: values per absmax.
        numel: how many values to return.
        dtype: the dtype the values are rounded to (the quant state's ``dtype``).
        out_dtype: the dtype they are returned in, once rounded (default ``dtype``); float32 for a merge saves a pass
            over the whole weight.

    Returns:
        A flat tensor of ``numel`` values in ``out_dtype``.

    Example:
        >>> nf4 = torch.linspace(-1, 1, 16)
        >>> dequantize_4bit_exact(torch.tensor([0x0F], dtype=torch.uint8), torch.tensor([2.0]), nf4, 64, 2,
        ...                       torch.float32).tolist()
        [-2.0, 2.0]
    """
    flat = packed.reshape(-1).view(torch.uint8)
    quads = _quad_table(tuple(code.to(torch.float32).view(torch.int32).tolist()), flat.device)  # by its exact bits
    out = torch.empty(numel, dtype=out_dtype or dtype, device=flat.device)
    step = max(1, PIECE_VALUES // blocksize) * blocksize  # whole blocks (an even count of values) at a time
    for v0 in range(0, numel, step):
        v1 = min(numel, v0 + step)
        part = flat[v0 // 2 : (v1 + 1) // 2]
        if part.storage_offset() % 2:  # read as 16-bit pairs of bytes: aligned...
            part = part.clone()
        if part.numel() % 2:  # ...and whole
            part = torch.nn.functional.pad(part, (0, 1))
        blocks = -(-(v1 - v0) // blocksize)
        values = quads.index_select(0, part.view(torch.int16).to(torch.int32).bitwise_and_(0xFFFF)).reshape(-1)
        if values.numel() != blocks * blocksize:  # an odd count, or the last, partial block
            values = torch.nn.functional.pad(values[: v1 - v0], (0, blocks * blocksize - (v1 - v0)))
        scale = absmax[v0 // blocksize : v0 // blocksize + blocks].to(device=flat.device, dtype=torch.float32)
        values = values.view(blocks, blocksize).mul_(scale.unsqueeze(1))
        values = values.reshape(-1)[: v1 - v0]
        out[v0:v1].copy_(values if out.dtype == dtype else values.to(dtype))  # rounded once to dtype
    return out


@functools.lru_cache(maxsize=8)
def _quad_table(bits: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The four values of each pair of packed bytes, indexed by the pair read as one native-order 16-bit integer: one
    gather per two bytes instead of a shift, a mask and a gather per value (1 MiB of float32, made once per code
    book, given by its float32 bit patterns, and device; complete before any stream of any thread reads it)."""
    code = torch.tensor(bits, dtype=torch.int32).view(torch.float32).to(device)
    pair = torch.arange(1 << 16, device=device)
    first, second = (pair & 0xFF, pair >> 8) if sys.byteorder == "little" else (pair >> 8, pair & 0xFF)
    table = torch.stack([code[first >> 4], code[first & 0xF], code[second >> 4], code[second & 0xF]], dim=1)
    if table.device.type == "cuda":  # made on this thread's stream, read on others'
        torch.cuda.current_stream(table.device).synchronize()
    return table


def dequantize_blockwise_exact(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int
) -> torch.Tensor:
    """The 8-bit blockwise format's definition (double quant's absmax): ``code[c_i] * absmax[i // blocksize]`` in
    float32.

    Args:
        codes: uint8 codes of a run starting on a block boundary.
        absmax: the float32 scale of each block of that run.
        code: the 256-entry code book.
        blocksize: codes per scale.

    Returns:
        A flat float32 tensor, one value per code.

    Example:
        >>> dequantize_blockwise_exact(torch.tensor([0, 255], dtype=torch.uint8), torch.tensor([3.0]),
        ...                            torch.linspace(-1, 1, 256), 256).tolist()
        [-3.0, 3.0]
    """
    n = codes.numel()
    blocks = -(-n // blocksize)
    values = code.to(device=codes.device, dtype=torch.float32).index_select(0, codes.reshape(-1).int())
    if n != blocks * blocksize:  # the last, partial block
        values = torch.nn.functional.pad(values, (0, blocks * blocksize - n))
    scale = absmax[:blocks].to(device=codes.device, dtype=torch.float32)
    return values.view(blocks, blocksize).mul_(scale.unsqueeze(1)).reshape(-1)[:n]


def dequantize_state(packed: torch.Tensor, state, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A whole 4-bit weight dequantized by :func:`dequantize_4bit_exact` from its packed bytes and bitsandbytes
    ``QuantState`` (double quant undone by :func:`dequantize_blockwise_exact`, plus the state's offset).

    Args:
        packed: the packed bytes in bitsandbytes' usual layout (not repacked for the CPU kernel).
        state: its ``QuantState``.
        out_dtype: the dtype of the result, once rounded to the state's dtype (default: the state's dtype).

    Returns:
        The weight, of the state's shape, in ``out_dtype``, on ``packed``'s device.

    Raises:
        MissingDependencyError: bitsandbytes is not installed.

    Example:
        >>> F = require_bitsandbytes()
        >>> w = torch.linspace(-1, 1, 288).reshape(3, 96)  # rows of 1.5 blocks
        >>> q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        >>> back = dequantize_state(q, state)
        >>> back.shape, float((back - w).abs().max()) < 0.16  # within half the widest NF4 step
        (torch.Size([3, 96]), True)
    """
    F = require_bitsandbytes()
    absmax = state.absmax
    if getattr(state, "nested", False):
        s2 = state.state2
        absmax = dequantize_blockwise_exact(absmax, s2.absmax, s2.code, s2.blocksize) + state.offset.to(torch.float32)
    code = F.get_4bit_type(state.quant_type, device=packed.device)
    numel = state.shape.numel()
    return dequantize_4bit_exact(packed, absmax, code, state.blocksize, numel, state.dtype, out_dtype).reshape(
        state.shape
    )


#: characters reserved for the ``nested_offset`` float in a packed quant state (the longest ``repr`` of a float)
_FLOAT_CHARS = 24


def quant_state_fields(
    shape: tuple[int, ...], dtype: torch.dtype, settings: Nf4Settings, nested_offset: float = 0.0
) -> dict:
    """The non-tensor part of a bitsandbytes 4-bit quant state, as ``QuantState.as_dict(packed=True)`` packs it.

    Args:
        shape: the weight's shape.
        dtype: the dtype the weight had when quantized (its compute dtype after loading).
        settings: the 4-bit settings.
        nested_offset: the double-quantization offset (the mean block scale).

    Returns:
        The dict whose JSON is stored as the ``quant_state.bitsandbytes__<type>`` tensor.

    Example:
        >>> quant_state_fields((4, 64), torch.bfloat16, Nf4Settings(double_quant=False))
        {'quant_type': 'nf4', 'blocksize': 64, 'dtype': 'bfloat16', 'shape': [4, 64]}
    """
    fields = {
        "quant_type": settings.quant_type,
        "blocksize": settings.blocksize,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": list(shape),
    }
    if settings.double_quant:
        fields.update({"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": float(nested_offset)})
    return fields


def packed_4bit_layout(
    shape: tuple[int, ...], dtype: torch.dtype, settings: Nf4Settings
) -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensors transformers stores for one 4-bit weight, computed from its shape alone (nothing is quantized).

    Packed codes hold two 4-bit values a byte; ``absmax`` holds one scale per block (one byte each with double
    quantization, which adds one float32 scale per 256 blocks and the 256-entry map); the quant-state JSON is
    given a fixed length, room for any ``nested_offset``, and :func:`pad_quant_state` pads bitsandbytes' own JSON with
    spaces.

    Args:
        shape: the weight's shape.
        dtype: the dtype it is quantized from.
        settings: the 4-bit settings.

    Returns:
        ``(key suffix, safetensors dtype, shape)`` in the order bitsandbytes writes them; the suffix is ``""`` for
        the packed codes, else the part after ``<weight name>.``.

    Example:
        >>> [(k, d, s) for k, d, s in packed_4bit_layout((7, 5), torch.bfloat16, Nf4Settings())][:3]
        [('', 'U8', (18, 1)), ('absmax', 'U8', (1,)), ('quant_map', 'F32', (16,))]
    """
    numel = 1
    for s in shape:
        numel *= s
    blocks = -(-numel // settings.blocksize)
    out = [
        ("", "U8", ((numel + 1) // 2, 1)),
        ("absmax", "U8" if settings.double_quant else "F32", (blocks,)),
        ("quant_map", "F32", (16,)),
    ]
    if settings.double_quant:
        out += [("nested_absmax", "F32", (-(-blocks // 256),)), ("nested_quant_map", "F32", (256,))]
    out.append(
        (f"quant_state.bitsandbytes__{settings.quant_type}", "U8", (quant_state_length(shape, dtype, settings),))
    )
    return out


def quant_state_length(shape: tuple[int, ...], dtype: torch.dtype, settings: Nf4Settings) -> int:
    """Bytes reserved for the quant-state JSON of a weight: its JSON with room for the longest float offset.

    Args:
        shape: the weight's shape.
        dtype: the dtype it is quantized from.
        settings: the 4-bit settings.

    Returns:
        The length in bytes.

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


#: rows of an LLM.int8 weight dequantized in float64 at a time (keeps the float64 temporaries to a few MiB)
_INT8_STEP_ELEMS = 1 << 18


def dequantize_int8_exact(codes: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """The LLM.int8 format's definition applied to stored rows: ``codes * SCB[row] / 127`` in float64 (the product
    exact), rounded to float32; the one int8 dequantization of every path. bitsandbytes'
    ``int8_vectorwise_dequant`` multiplies by a float32 reciprocal of 127 instead, one float32 step off in some
    elements.

    Args:
        codes: int8 codes ``[rows, columns]``.
        scb: the float row scales (``SCB``), one per row.

    Returns:
        The float32 rows, on ``codes``' device.

    Example:
        >>> dequantize_int8_exact(torch.tensor([[127, -64]], dtype=torch.int8), torch.tensor([0.5])).tolist()
        [[0.5, -0.25196850299835205]]
    """
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    scale = scb.to(device=codes.device, dtype=torch.float64).reshape(-1, 1)
    step = max(1, _INT8_STEP_ELEMS // max(1, codes.shape[-1]))
    for r in range(0, codes.shape[0], step):
        out[r : r + step] = codes[r : r + step].to(torch.float64).mul_(scale[r : r + step]).div_(127)
    return out
