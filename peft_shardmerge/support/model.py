"""The allowlist applied to a model carrying PEFT layers (a loaded PeftModel, or one rebuilt on the meta device):
its adapters' configs, every adapted layer, the adapters' values and the model class."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from .claims import DISK, IN_PROCESS, check_supported, config_variants, layer_kind, peft_type_of, raise_if_any

#: the attribute a merge_and_unload that failed part-way leaves on the model, holding the refusal of later merges
HALF_MERGED = "peft_shardmerge_half_merged"


def selected_adapters(model: nn.Module, adapter_names: list[str] | None = None) -> list[str]:
    """The adapters a merge takes: ``adapter_names`` when given, else the active one(s).

    Args:
        model: a ``PeftModel`` (or a transformers model after ``add_adapter``).
        adapter_names: the names asked for, or None.

    Returns:
        The names.

    Example:
        >>> selected_adapters(torch.nn.Linear(1, 1), ["a"])
        ['a']
    """
    if adapter_names is not None:
        return [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
    names = getattr(model, "active_adapters", None)
    try:
        names = names() if callable(names) else names
    except Exception:  # no PEFT layers, or transformers refusing the installed PEFT (5.24 with 0.21)
        names = _layer_adapters(model)
    if not names:
        names = getattr(model, "active_adapter", None)
        names = names() if callable(names) else names
    if isinstance(names, str):
        names = [names]
    return list(names or ["default"])


def _layer_adapters(model: nn.Module) -> list[str] | None:
    """The active adapters of the model's first PEFT layer (what transformers' ``active_adapters`` reads), or None."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layer = next((m for m in model.modules() if isinstance(m, BaseTunerLayer)), None)
    return None if layer is None else list(layer.active_adapters)


def transformers_model(model: nn.Module) -> nn.Module:
    """The model a ``PeftModel`` wraps: ``base_model.model`` for adapters injected into layers (LoRA, ...),
    ``base_model`` itself for prompt learning (where there is no tuner in between); any other model as it is.

    Args:
        model: a ``PeftModel`` or any module.

    Returns:
        The wrapped model.

    Example:
        >>> transformers_model(torch.nn.Linear(1, 1))
        Linear(in_features=1, out_features=1, bias=True)
    """
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    if not isinstance(model, PeftModel):
        return model
    return model.base_model.model if isinstance(model.base_model, BaseTuner) else model.base_model


_inner = transformers_model


def layer_uses(model: nn.Module, names: list[str]) -> Iterator[tuple[str, str, str, list[str], nn.Module]]:
    """Each adapted layer of the selected adapters: ``(name, PEFT type, layer kind, variants, layer)``.

    Args:
        model: the PeftModel (or transformers model with PEFT layers).
        names: the adapters merged.

    Returns:
        An iterator, one item per adapted layer and adapter type.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    configs = getattr(model, "peft_config", None) or {}
    for name, module in _inner(model).named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        held = [a for a in names if a in adapter_keys(module)]
        if not held:
            continue
        cls = type(module).__name__
        if cls == "TrainableTokensLayer":
            yield name, "TRAINABLE_TOKENS", layer_kind(_real_base(module)), [], module
            continue
        kind = layer_kind(module) if cls == "ParamWrapper" else layer_kind(_real_base(module))
        by_type: dict[str, set[str]] = {}
        for a in held:
            config = configs.get(a)
            variants = set(config_variants(config)[0]) if config is not None else set()
            if getattr(module, "use_dora", {}).get(a):
                variants.add("DoRA")
            if getattr(module, "lora_bias", {}).get(a):
                variants.add("lora_bias")
            variant = getattr(module, "lora_variant", {}).get(a)
            if variant is not None and not type(variant).__name__.startswith("Dora"):
                variants.add(type(variant).__name__.removesuffix("LinearVariant").removesuffix("Variant"))
            if getattr(module, "is_feedforward", False):
                variants.add("feedforward")
            if len(held) > 1:
                variants.add("several adapters")
            by_type.setdefault(peft_type_of(config) if config is not None else "", set()).update(variants)
        for peft_type, variants in by_type.items():
            yield name, peft_type, kind, sorted(variants), module


def adapter_keys(layer: nn.Module) -> set[str]:
    """The adapter names a PEFT layer holds weights for.

    Args:
        layer: a PEFT tuner layer.

    Returns:
        The names (e.g. ``{"default"}``).

    Example:
        >>> adapter_keys(torch.nn.Linear(1, 1))
        set()
    """
    names: set[str] = set()
    for attr in getattr(layer, "adapter_layer_names", ()):
        store = getattr(layer, attr, None)
        if hasattr(store, "keys"):
            names |= set(store.keys())
    return names


def _real_base(layer: nn.Module) -> nn.Module:
    """The torch layer under a PEFT layer, through a trainable-tokens wrapper it may wrap (LoRA on a tied head)."""
    base = layer.get_base_layer()
    while getattr(base, "token_adapter", None) is not None:
        base = base.token_adapter.get_base_layer()
    return base


def check_model(
    model: nn.Module, adapter_names: list[str] | None = None, *, path: str = IN_PROCESS, values: bool = True
) -> tuple[list[str], list[str]]:
    """Everything the allowlist refuses in a model's selected adapters, and bad adapter values.

    Args:
        model: a ``PeftModel``, a transformers model after ``add_adapter``, or a meta-device model PEFT rebuilt.
        adapter_names: the adapters merged; None: the active one(s).
        path: ``"in_process"`` or ``"disk"``.
        values: also look for NaN/Inf in the adapters' tensors.

    Returns:
        ``(unsupported, bad)``: refusals by the allowlist, and other problems of the inputs.
    """
    configs = getattr(model, "peft_config", None) or {}
    names = selected_adapters(model, adapter_names)
    unsupported = check_supported({a: configs[a] for a in names if a in configs}, path=path)
    if unsupported:  # a type or option outside the allowlist: its layers are not looked at
        return unsupported, []
    inner = _inner(model)
    if path == IN_PROCESS:
        from transformers import PreTrainedModel

        if not isinstance(inner, PreTrainedModel):
            return [
                f"the PeftModel wraps a plain torch module ({type(inner).__name__}), not a transformers model; "
                "peft-shardmerge writes and returns transformers checkpoints. Use PEFT's own merge_and_unload() "
                "for it"
            ], []
    uses = list(layer_uses(model, names))
    unsupported += check_supported({}, [u[:4] for u in uses], path=path)
    no_bias = [
        n
        for n, t, _, v, m in uses
        if t == "LORA" and "lora_bias" in v and getattr(_real_base(m), "bias", None) is None
    ]
    if no_bias:
        unsupported.append(no_bias_problem(no_bias))
    bad: list[str] = []
    if values and path == IN_PROCESS:
        bad_names = nonfinite(_adapter_tensors(model, names))
        if bad_names:
            bad.append(
                f"adapter weights contain NaN or Inf: {', '.join(bad_names[:5])}"
                f"{' and more' if len(bad_names) > 5 else ''}; the training diverged. Nothing was changed"
            )
    return unsupported, bad


def no_bias_problem(layers: list[str]) -> str:
    """The refusal of ``lora_bias`` on layers whose base has no bias (the same words on every path).

    Args:
        layers: the layer names.

    Returns:
        The message.

    Example:
        >>> no_bias_problem(["q_proj"])[:40]
        'q_proj: lora_bias=True on a layer whose '
    """
    return (
        f"{', '.join(layers[:3])}{f' and {len(layers) - 3} more' if len(layers) > 3 else ''}: lora_bias=True on "
        "a layer whose base has no bias; the merged model would need a bias the base does not have (PEFT "
        "refuses to merge it too). Train with lora_bias=False, or on a base with biases"
    )


def nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of floating-point tensors holding NaN or Inf (meta tensors skipped).

    Args:
        tensors: ``(name, tensor)`` pairs.

    Returns:
        The names.

    Example:
        >>> nonfinite([("a", torch.tensor([1.0, float("nan")])), ("b", torch.ones(2))])
        ['a']
    """
    return [n for n, t in tensors if t.is_floating_point() and not t.is_meta and not bool(torch.isfinite(t).all())]


def _adapter_tensors(model: nn.Module, names: list[str]):
    """The trained tensors of the selected adapters (LoRA factors, copies, token rows, shared projections)."""
    wanted = set(names)
    for source in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        for key, t in source:
            parts = key.split(".")
            if wanted & set(parts) and "base_layer" not in parts and "original_module" not in parts:
                yield key, t.detach()


def require_supported(
    model: nn.Module, adapter_names: list[str] | None = None, problems: list[str] | None = None
) -> list[str]:
    """Refuse, before anything is written or replaced, a loaded model whose selected adapters the allowlist does not
    claim for the in-process path; every API of the in-process path calls this first.

    Args:
        model: the PeftModel.
        adapter_names: the adapters merged; None: the active one(s).
        problems: problems the caller found already, reported together with the refusals.

    Returns:
        ``problems`` plus bad adapter values (NaN or Inf), for the caller to raise with its own.

    Raises:
        UnsupportedError: a PEFT type, layer, variant or option outside the allowlist (all named, with the fix, and
            ``problems`` with them).
    """
    half = [
        m
        for m in (model, getattr(getattr(model, "base_model", None), "model", None))
        if m is not None and getattr(m, HALF_MERGED, None)
    ]
    if half:  # a merge_and_unload that failed part-way: the model holds merged and unmerged layers
        return list(problems or []) + [getattr(half[0], HALF_MERGED)]
    unsupported, bad = check_model(model, selected_adapters(model, adapter_names))
    if unsupported:
        raise_if_any(unsupported, list(problems or []) + bad)
    return list(problems or []) + bad


__all__ = [
    "transformers_model",
    "selected_adapters",
    "layer_uses",
    "check_model",
    "require_supported",
    "adapter_keys",
    "no_bias_problem",
    "nonfinite",
    "DISK",
    "IN_PROCESS",
]
