"""The tie policy of both paths: whether a config ties its embeddings, which tied weights get untied, and the notes."""

from __future__ import annotations

from typing import Iterable, Mapping


def _as_dict(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return {k: v for k, v in vars(config).items()} if hasattr(config, "__dict__") else {}


def tie_enabled(config) -> bool:
    """Whether a model config ties the output embedding to the input embedding.

    The top-level ``tie_word_embeddings`` decides, else the one of ``text_config``; a config that says nothing
    ties (the ``PretrainedConfig`` default; a model class that ties nothing lists no tied weights anyway).

    Args:
        config: ``config.json`` as a dict, or a transformers config object.

    Returns:
        True when tied weights share one matrix.

    Example:
        >>> tie_enabled({"tie_word_embeddings": False}), tie_enabled({"text_config": {"tie_word_embeddings": False}})
        (False, False)
        >>> tie_enabled({})
        True
    """
    config = _as_dict(config)
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config")
    if isinstance(text, Mapping) and "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return True


def untied_names(tied: Mapping[str, str], changed: Iterable[str], present: Iterable[str]) -> list[str]:
    """The tied weights written separately: both sides of every tie where the adapter changes a side.

    Args:
        tied: ``{target: source}`` tied pairs (e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``).
        changed: the names the adapter changes (LoRA deltas and biases, replacements, PEFT layers); trainable-token
            rows alone untie nothing, as in PEFT, which trains the same rows on both sides.
        present: the names the output can hold (a target the checkpoint leaves out counts when it can be written).

    Returns:
        The untied names, sorted, each once.

    Example:
        >>> untied_names({"lm_head.weight": "emb.weight"}, ["emb.weight"], ["emb.weight", "lm_head.weight"])
        ['emb.weight', 'lm_head.weight']
    """
    changed, present = set(changed), set(present)
    out: set[str] = set()
    for target, source in tied.items():
        if (target in changed or source in changed) and target in present and source in present:
            out |= {target, source}
    return sorted(out)


def untie_note(names: Iterable[str]) -> str:
    """The note saying that tied weights were written separately.

    Args:
        names: the untied names.

    Returns:
        The note.

    Example:
        >>> untie_note(["lm_head.weight", "emb.weight"])[:55]
        'the adapter changes tied weights (emb.weight, lm_head.w'
    """
    return (
        f"the adapter changes tied weights ({', '.join(sorted(set(names)))}); both are written and "
        "tie_word_embeddings is set to false"
    )


def tokens_on_both_sides(source: str, target: str) -> str:
    """The refusal when trainable tokens are given, with different rows, for both sides of a tie.

    Args:
        source: the input embedding's weight name.
        target: the tied output embedding's weight name.

    Returns:
        The message.

    Example:
        >>> tokens_on_both_sides("emb.weight", "lm_head.weight")[:60]
        "trainable tokens are given for both tied weights 'emb.weight"
    """
    return (
        f"trainable tokens are given for both tied weights {source!r} and {target!r}; tied weights share one "
        "matrix, so train tokens on the input embedding only"
    )
