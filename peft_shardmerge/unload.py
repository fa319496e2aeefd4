"""What merge_and_unload leaves of a model once the merged modules are in place: no PEFT module, the ties transformers
makes, and no trace of quantization."""

from __future__ import annotations

import torch
from torch import nn


def finish_unload(inner: nn.Module, *, untied: list[str] | tuple[str, ...] = ()) -> None:
    """Make a model whose PEFT and bitsandbytes layers were replaced by merged ones a plain transformers model.

    Any PEFT module still in the model (a trainable-tokens wrapper of a tied head, whose rows are the embedding's, or
    a layer of an adapter that was not merged) is replaced by the layer it wraps, as PEFT's ``unload`` does; tied
    weights are tied again when the adapter left the tie intact (the merged embedding then serves the head too);
    quantization flags, quantizer and ``quantization_config`` are cleared so that ``.to(dtype)``, ``.half()``,
    ``.float()`` and ``save_pretrained`` treat it as the plain model it now is.

    Args:
        inner: the transformers model.
        untied: the tied weights the adapter made different (one side changed): each gets a parameter of its own,
            so that ``save_pretrained`` writes every one of them, and ``tie_word_embeddings`` is turned off.

    Returns:
        None.

    Raises:
        Nothing.

    Example:
        >>> finish_unload(model, untie=False)   # doctest: +SKIP
    """
    remove_peft_modules(inner)
    drop_quantization(inner, untie=bool(untied))
    if untied:
        separate(inner, untied)
    elif callable(getattr(inner, "tie_weights", None)):
        inner.tie_weights()


def separate(inner: nn.Module, names: list[str] | tuple[str, ...]) -> None:
    """Give each of the named parameters a tensor of its own where several still share one, so that
    ``save_pretrained`` writes each (it keeps one of several names of one tensor; reloading then ties the others to
    another partner, e.g. T5's ``decoder.embed_tokens`` to the merged ``shared``).

    Args:
        inner: the model.
        names: parameter names.

    Returns:
        None.

    Raises:
        Nothing.

    Example:
        >>> separate(model, ["lm_head.weight", "model.embed_tokens.weight"])   # doctest: +SKIP
    """
    seen: set[int] = set()
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        try:
            owner = inner.get_submodule(owner_name)
        except AttributeError:
            continue
        param = getattr(owner, attr, None)
        if not isinstance(param, nn.Parameter):
            continue
        if id(param) in seen:
            setattr(owner, attr, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
        else:
            seen.add(id(param))


def remove_peft_modules(root: nn.Module) -> list[str]:
    """Replace every PEFT module left in ``root`` by the layer it wraps (outermost first).

    Args:
        root: a model.

    Returns:
        The names of the modules replaced.

    Raises:
        Nothing.

    Example:
        >>> remove_peft_modules(torch.nn.Linear(2, 2))
        []
    """
    done: list[str] = []
    for name, module in list(root.named_modules()):
        if not name or any(name.startswith(d + ".") for d in done):
            continue
        if not type(module).__module__.startswith("peft."):
            continue
        inner = _wrapped(module)
        if inner is None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, child, inner)
        done.append(name)
    return done


def _wrapped(module: nn.Module) -> nn.Module | None:
    token_adapter = getattr(module, "token_adapter", None)
    if token_adapter is not None:
        return token_adapter.get_base_layer()
    if callable(getattr(module, "get_base_layer", None)):
        return module.get_base_layer()
    return getattr(module, "original_module", None)


def drop_quantization(inner: nn.Module, *, untie: bool) -> None:
    """Make a formerly quantized transformers model a plain one: flags and quantizer on every submodel, and
    ``quantization_config`` in every (sub-)config.

    Args:
        inner: the transformers model.
        untie: also set ``tie_word_embeddings`` to False.

    Returns:
        None.

    Raises:
        Nothing.

    Example:
        >>> drop_quantization(model, untie=False)   # doctest: +SKIP
    """
    for module in inner.modules():
        for attr in ("is_loaded_in_4bit", "is_loaded_in_8bit", "is_quantized"):
            if attr in vars(module):
                setattr(module, attr, False)
        for attr in ("hf_quantizer", "quantization_method"):
            if attr in vars(module):
                setattr(module, attr, None)
        config = getattr(module, "config", None)
        for cfg in _configs(config):
            for attr in ("quantization_config", "_pre_quantization_dtype"):
                if attr in vars(cfg):
                    delattr(cfg, attr)
            if getattr(cfg, "_is_quantized", False):  # set by transformers' quantizer on every submodel's config
                cfg._is_quantized = False
            if untie and cfg is config and hasattr(cfg, "tie_word_embeddings"):
                cfg.tie_word_embeddings = False
    for cfg in _configs(getattr(inner, "config", None)):
        if untie and hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False
    if hasattr(inner, "_hf_peft_config_loaded"):
        inner._hf_peft_config_loaded = False


def _configs(config) -> list:
    """A config and its sub-configs (text, vision, ...)."""
    if config is None:
        return []
    out = [config]
    for value in list(vars(config).values()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type") and value is not config:
            out.append(value)
    return out
