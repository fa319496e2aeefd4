"""The GGUF types a merge can be written in (``outtype``), by name: which there are, and Unsloth's names for them."""

from __future__ import annotations

from typing import Any

#: the types llama.cpp's converter writes itself (``--outtype``), and ``auto``: the base's 16-bit type
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
#: the types llama.cpp's ``llama-quantize`` makes from the converter's file, written here in the same pass
QUANTIZER_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
OUTTYPES = ("auto",) + CONVERTER_TYPES + QUANTIZER_TYPES
#: Unsloth's names for its usual choices, and the GGUF type each stands for
UNSLOTH_NAMES = {"not_quantized": "f16", "fast_quantized": "q8_0", "quantized": "q4_k_m"}


def gguf_types(quantization_method: Any) -> list[str]:
    """The GGUF types asked for, Unsloth's names turned into theirs (``"quantized"`` is ``q4_k_m``).

    Args:
        quantization_method: a type or a list of them.

    Returns:
        The types, lower case; ``["q8_0"]`` for an empty list.

    Example:
        >>> gguf_types(["quantized", "Q8_0"])
        ['q4_k_m', 'q8_0']
    """
    asked = quantization_method if isinstance(quantization_method, (list, tuple)) else [quantization_method]
    return [UNSLOTH_NAMES.get(str(t).lower(), str(t).lower()) for t in asked] or ["q8_0"]


def outtype_problems(outtype: Any, what: str = "outtype") -> list[str]:
    """What is wrong with a GGUF type asked for.

    Args:
        outtype: the type (Unsloth's names too).
        what: the option's name, for the message.

    Returns:
        The problem, naming the types written; empty when it is one.

    Example:
        >>> outtype_problems("Q4_K_M"), outtype_problems("q3_k")[0][:44]
        ([], "outtype 'q3_k' is not a GGUF type written he")
    """
    name = UNSLOTH_NAMES.get(str(outtype).lower(), str(outtype).lower())
    if isinstance(outtype, str) and name in OUTTYPES:
        return []
    return [f"{what} {outtype!r} is not a GGUF type written here; choose one of {', '.join(OUTTYPES)}"]


def split_bytes(value: Any) -> int:
    """A GGUF split size as llama.cpp's converter reads ``--split-max-size``: bytes, or a number with ``K``, ``M``
    or ``G`` (powers of 1000); 0 does not split.

    Args:
        value: an int or a string such as ``"2G"``.

    Returns:
        The bytes.

    Raises:
        ValueError: a value that is not one.

    Example:
        >>> split_bytes("500M"), split_bytes(0)
        (500000000, 0)
    """
    if isinstance(value, bool):
        raise ValueError(f"split_max_size must be bytes or a size such as '2G', got {value!r}")
    if isinstance(value, int) and value >= 0:
        return value
    text = str(value).strip()
    scale = {"K": 1000, "M": 1000**2, "G": 1000**3}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    if not number.isdecimal():
        raise ValueError(
            f"split_max_size must be bytes or a size such as '2G' (K, M, G: powers of 1000), got {value!r}"
        )
    return int(number) * scale
