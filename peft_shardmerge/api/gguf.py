"""Unsloth's GGUF drop-ins, refused before anything runs with the commands that make a GGUF today."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedError
from ..output.gguf import gguf_hint, gguf_types


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
    name = gguf_types(quantization_method)[0]
    raise UnsupportedError(f"{gguf_hint(quantization_method)}; then upload it: hf upload {repo_id} merged-{name}.gguf")
