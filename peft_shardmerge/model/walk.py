"""A loaded model as a merge source: walk a PeftModel module by module and produce each merged tensor on demand."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..engine.changes import ChangeKey
from ..errors import InputError, UnsupportedError
from ..quant.bnb_layers import REPACK_ABSMAX_REL_ERROR, bnb_kind, bnb_layer_kind, dequantize, logical_shape
from ..support.model import adapter_keys, transformers_model
from ..support.model_info import ModelInfo, inspect_model
from ..support.ties import tie_enabled, tokens_on_both_sides, untie_note, untied_names
from .entries import LiveEntry, LiveModel
from .weights import materialized, offload_owner, offloaded_modules

log = logging.getLogger(__name__)


def unwrap(model: nn.Module) -> nn.Module:
    """Return the transformers model inside a ``PeftModel`` (or the model itself when PEFT layers were
    injected into a transformers model with ``add_adapter``).

    Args:
        model: a ``PeftModel`` or a transformers model carrying LoRA layers.

    Returns:
        The transformers model.

    Raises:
        InputError: the model carries no PEFT adapter.
    """
    try:
        from peft import PeftModel
    except ImportError as e:  # pragma: no cover - peft is a dependency
        raise InputError("peft is not installed: pip install peft") from e
    if isinstance(model, PeftModel):
        return transformers_model(model)
    if getattr(model, "peft_config", None) or any(_is_lora(m) for m in model.modules()):
        return model
    raise InputError(
        f"{type(model).__name__} has no LoRA adapter; pass the PeftModel returned by get_peft_model / "
        "PeftModel.from_pretrained (or a transformers model after add_adapter)"
    )


def _is_lora(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def walk(model: nn.Module, adapter_names: list[str] | None = None) -> LiveModel:
    """List every tensor the merged checkpoint will hold, without computing any of them.

    Args:
        model: a ``PeftModel`` with a LoRA adapter (base unquantized, bitsandbytes 4-bit or 8-bit).
        adapter_names: the adapters to merge; None means the active one(s).

    Returns:
        The :class:`LiveModel`.

    Raises:
        InputError: no adapter, adapters already merged into the base, or LoRA factors with no weights (on the
            meta device, where PEFT leaves them on a layer accelerate had offloaded).
        UnsupportedError: DoRA or other LoRA variants, trainable tokens (all named).
    """
    inner = unwrap(model)
    if adapter_names is not None:
        name_problems = check_adapter_names(model, adapter_names)
        if name_problems:
            raise InputError(name_problems)
    w = _Walk(inspect_model(inner.config, type(inner)), adapter_names)
    skip: list[str] = []
    for name, module in inner.named_modules():
        if any(name.startswith(p + ".") for p in skip):
            continue
        kind = _walker(module)
        if kind is not None:
            skip.append(name)
            kind(w, name, module)
        else:
            _walk_plain(w, name, module)
    if w.unsupported:
        raise UnsupportedError("the model uses adapter features that cannot be merged: " + "; ".join(w.unsupported))
    if w.problems:
        raise InputError(w.problems)
    entries, untied = _resolve_ties(inner, w.info, w.entries)
    notes = []
    if untied:
        notes.append(untie_note(untied))
    return LiveModel(inner, w.info, entries, untied, w.lora_layers, notes)


@dataclass
class _Walk:
    """What the walk has found so far."""

    info: ModelInfo
    adapter_names: list[str] | None
    entries: list[LiveEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    lora_layers: list[str] = field(default_factory=list)

    def wanted(self, active: list[str]) -> list[str]:
        return self.adapter_names if self.adapter_names is not None else active


def _walker(module: nn.Module):
    """The function that lists a module's tensors when the module is a PEFT or bitsandbytes one (its children are
    then skipped), else None."""
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    if _delta_layer(module):  # LoHa, LoKr, VeRA, IA3, LoRA on parameters: PEFT computes each delta
        return _walk_delta
    if _is_lora(module):
        return _walk_lora
    if isinstance(module, ModulesToSaveWrapper):
        return _walk_saved
    if _token_layer(module) is not None:  # trainable tokens: trained rows replace the embedding's (or tied head's)
        return _walk_tokens
    if isinstance(module, AuxiliaryTrainingWrapper):
        return _walk_unsupported
    if bnb_layer_kind(module) is not None:
        return _walk_bnb
    return None


def _walk_delta(w: _Walk, name: str, module: nn.Module) -> None:
    chain = [module]
    while _delta_layer(getattr(chain[-1], "base_layer", None)):
        chain.append(chain[-1].base_layer)
    real = chain[-1].get_base_layer()
    wanted = w.wanted(module.active_adapters)
    if any(getattr(m, "merged", False) for m in chain):
        w.problems.append(f"{name} has its adapter merged into the base already; call model.unmerge_adapter() first")
        return
    prefix = f"{name}." if name else ""
    by_param = {getattr(m, "parameter_name", None) or "weight": m for m in chain}
    for pname, t in _own_tensors(real):
        layer = by_param.get(pname)
        if layer is None and pname == "bias" and _is_ia3(module) and not module.is_feedforward:
            layer = module  # IA3 scales a non-feedforward layer's bias with its outputs
        adapters = [a for a in wanted if layer is not None and a in adapter_keys(layer)]
        quantized = pname == "weight" and bnb_layer_kind(real) is not None  # an inactive layer over a 4-bit base
        kind = ("ia3" if _is_ia3(layer) else "delta") if adapters else "quantized" if quantized else "plain"
        shape = logical_shape(real) if pname == "weight" else tuple(t.shape)
        w.entries.append(
            LiveEntry(
                prefix + pname,
                shape,
                t.is_floating_point(),
                kind,
                layer or real,
                pname,
                real,
                adapters,
                numel=_numel(shape),
                owner=name,
            )
        )
        if adapters and kind == "delta" or kind == "ia3" and pname != "bias":
            w.lora_layers.append(change_key(w.entries[-1]))


def _walk_lora(w: _Walk, name: str, module: nn.Module) -> None:
    adapters = [a for a in w.wanted(module.active_adapters) if a in module.lora_A or a in module.lora_embedding_A]
    if getattr(module, "merged", False):
        w.problems.append(
            f"{name} has its adapter merged into the base already; call model.unmerge_adapter() first "
            "(merging into a 4-bit base re-quantizes it)"
        )
        return
    dora = [a for a in adapters if getattr(module, "use_dora", {}).get(a)]
    if dora and len(adapters) > 1:
        w.unsupported.append(f"{name}: DoRA adapters cannot be combined with others (their magnitudes do not add)")
    for a in set(adapters) - set(dora):
        if getattr(module, "lora_variant", {}).get(a) is not None:
            w.unsupported.append(f"{name}: LoRA variant {type(module.lora_variant[a]).__name__} is not supported")
    empty = [a for a in adapters if _without_weights(module, a)]
    if empty:
        w.problems.append(
            f"{name}: the LoRA factors of {', '.join(empty)} are on the meta device with no weights "
            "behind them (PEFT leaves them so when it attaches an adapter to a layer accelerate had "
            "offloaded); attach the adapter before dispatching the model"
        )
    base = module.get_base_layer()
    prefix = f"{name}." if name else ""
    wname = f"{prefix}weight"
    transpose_out = bnb_layer_kind(base) is not None and wname in w.info.transposed
    shape = logical_shape(base)
    if transpose_out:
        shape = shape[::-1]
    w.entries.append(
        LiveEntry(
            wname, shape, True, "lora", module, "weight", base, adapters, transpose_out, _numel(shape), owner=name
        )
    )
    if adapters:
        w.lora_layers.append(change_key(w.entries[-1]))
    with_bias = [a for a in adapters if getattr(module, "lora_bias", {}).get(a)]
    _bias_entry(w, name, module, base, "lora_bias" if with_bias else "plain", with_bias)


def _without_weights(module: nn.Module, adapter: str) -> bool:
    """Whether an adapter's LoRA factors in a layer are meta tensors that no accelerate hook serves."""
    parts = [d[adapter] for d in (module.lora_A, module.lora_B) if adapter in d]
    return any(p.is_meta and not offloaded_modules(part) for part in parts for p in part.parameters())


def _walk_saved(w: _Walk, name: str, module: nn.Module) -> None:
    if w.adapter_names is None:
        active = module.active_adapters
        saved = [active[0]] if active and active[0] in module.modules_to_save else []
    else:
        saved = [a for a in w.adapter_names if a in module.modules_to_save]
    if len(saved) > 1:
        w.problems.append(
            f"{name} is a modules_to_save copy in several of the adapters merged ({', '.join(saved)}); "
            "these copies cannot be combined"
        )
        return
    holder = module.modules_to_save[saved[0]] if saved else module.original_module
    prefix = f"{name}." if name else ""
    for pname, t in holder.state_dict(keep_vars=True).items():
        w.entries.append(
            LiveEntry(
                prefix + pname,
                tuple(t.shape),
                t.is_floating_point(),
                "saved" if holder is not module.original_module else "plain",
                module,
                pname,
                holder,
                numel=t.numel(),
                owner=name,
            )
        )


def _walk_tokens(w: _Walk, name: str, module: nn.Module) -> None:
    from peft.utils.other import AuxiliaryTrainingWrapper

    tokens = _token_layer(module)
    wanted = w.wanted(
        module.active_adapters if isinstance(module, AuxiliaryTrainingWrapper) else tokens.active_adapters
    )
    adapters = [a for a in wanted if a in tokens.token_indices]
    if len(adapters) > 1:
        w.problems.append(
            f"{name}: several adapters train tokens here ({', '.join(adapters)}); their rows cannot be combined"
        )
    base = tokens.get_base_layer()
    prefix = f"{name}." if name else ""
    w.entries.append(
        LiveEntry(
            f"{prefix}weight",
            tuple(base.weight.shape),
            True,
            "tokens" if adapters else "plain",
            tokens,
            "weight",
            base,
            adapters,
            numel=base.weight.numel(),
            owner=name,
        )
    )
    if adapters and tokens.tied_adapter is None:  # a tied head shares the embedding's rows
        w.lora_layers.append(change_key(w.entries[-1]))
    _bias_entry(w, name, base, base)


def _walk_unsupported(w: _Walk, name: str, module: nn.Module) -> None:
    w.unsupported.append(f"{name}: {type(module).__name__} is not supported")


def _walk_bnb(w: _Walk, name: str, module: nn.Module) -> None:
    prefix = f"{name}." if name else ""
    shape = logical_shape(module)
    transpose_out = f"{prefix}weight" in w.info.transposed
    if transpose_out:
        shape = shape[::-1]
    w.entries.append(
        LiveEntry(
            f"{prefix}weight",
            shape,
            True,
            "quantized",
            module,
            "weight",
            module,
            transpose_out=transpose_out,
            numel=_numel(shape),
            owner=name,
        )
    )
    _bias_entry(w, name, module, module)


def _bias_entry(
    w: _Walk, name: str, module: nn.Module, holder: nn.Module, kind: str = "plain", adapters: list[str] = ()
) -> None:
    """The entry of ``holder``'s bias, where it has one, in the module ``name`` (``module`` produces it)."""
    bias = getattr(holder, "bias", None)
    if bias is not None:
        prefix = f"{name}." if name else ""
        shape, numel = tuple(bias.shape), bias.numel()
        w.entries.append(
            LiveEntry(
                f"{prefix}bias", shape, True, kind, module, "bias", holder, list(adapters), numel=numel, owner=name
            )
        )


def _walk_plain(w: _Walk, name: str, module: nn.Module) -> None:
    prefix = f"{name}." if name else ""
    for pname, t in _own_tensors(module):
        w.entries.append(
            LiveEntry(
                prefix + pname, tuple(t.shape), t.is_floating_point(), "plain", module, pname, module, numel=t.numel()
            )
        )


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own parameters and persistent buffers (not its children's)."""
    return list(module.named_parameters(recurse=False)) + [
        (b, t) for b, t in module.named_buffers(recurse=False) if b not in module._non_persistent_buffers_set
    ]


def check_adapter_names(model: nn.Module, adapter_names: list[str]) -> list[str]:
    """What is wrong with a selection of adapters by name: empty, unknown names, a name twice.

    Args:
        model: the PeftModel.
        adapter_names: the names.

    Returns:
        The problems (none when the selection is good).

    Example:
        >>> check_adapter_names(torch.nn.Linear(1, 1), ["a"])
        ["adapter_names ['a'] must name loaded adapters; the model has none"]
    """
    known = set((getattr(model, "peft_config", None) or {}).keys())
    if not adapter_names or any(a not in known for a in adapter_names):
        return [
            f"adapter_names {list(adapter_names)!r} must name loaded adapters; the model has {sorted(known) or 'none'}"
        ]
    if len(set(adapter_names)) != len(adapter_names):
        return [f"adapter_names {list(adapter_names)!r} names an adapter twice"]
    return []


def change_key(entry: LiveEntry) -> str:
    """The count-check key of the adapter change an entry receives: its module's path, with the parameter for
    PEFT layers merged through their own deltas (``"<module>::<parameter>"``), ``"tokens:<module>"`` for
    trainable-token rows.

    Args:
        entry: a ``"lora"``, ``"tokens"``, ``"delta"`` or ``"ia3"`` entry.

    Returns:
        The key.

    Example:
        >>> change_key(LiveEntry("m.weight", (1,), True, "lora", None, "weight", None, owner="m"))
        'm'
    """
    kind = {"tokens": "tokens", "delta": "peft", "ia3": "peft"}.get(entry.kind, "lora")
    name = {"tokens": f"tokens:{entry.owner}", "peft": f"{entry.owner}::{entry.attr}"}.get(kind, entry.owner)
    return str(ChangeKey(kind, name))  # token rows are counted, not reported as LoRA modules (as on disk)


def _delta_layer(module: nn.Module | None) -> bool:
    """Whether a module is a PEFT layer merged through PEFT's own delta (or scaling): LoHa, LoKr, VeRA, IA3, and
    LoRA on parameters (``target_parameters``)."""
    if module is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not isinstance(module, BaseTunerLayer) or _token_layer(module) is not None:
        return False
    if _is_lora(module):
        return type(module).__name__ == "ParamWrapper"
    return hasattr(module, "get_delta_weight") or _is_ia3(module)


def _is_ia3(module: nn.Module | None) -> bool:
    return module is not None and hasattr(module, "ia3_l")


def _token_layer(module: nn.Module):
    """The ``TrainableTokensLayer`` of a trainable-tokens module (wrapped by LoRA's ``trainable_token_indices``
    or injected by a trainable-tokens adapter), else None."""
    try:
        from peft.tuners.trainable_tokens import TrainableTokensLayer
    except ImportError:  # pragma: no cover - older peft
        return None
    layer = getattr(module, "token_adapter", module)
    return layer if isinstance(layer, TrainableTokensLayer) else None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _resolve_ties(inner: nn.Module, info: ModelInfo, entries: list[LiveEntry]) -> tuple[list[LiveEntry], list[str]]:
    """Drop tied duplicates as transformers' save_pretrained does, unless the adapter changed one side."""
    if not tie_enabled(inner.config) or not info.tied:
        return entries, []
    by_name = {e.name: e for e in entries}
    for target, source in info.tied.items():
        if (
            target in by_name
            and source in by_name
            and by_name[target].kind == by_name[source].kind == "tokens"
            and by_name[target].module.tied_adapter is None
        ):
            raise UnsupportedError(tokens_on_both_sides(source, target))
    untied = untied_names(info.tied, [n for n, e in by_name.items() if e.kind in ("lora", "saved")], by_name)
    drop = {t for t, s in info.tied.items() if t in by_name and s in by_name and t not in untied}
    return [e for e in entries if e.name not in drop], untied


__all__ = [
    "LiveEntry",
    "LiveModel",
    "unwrap",
    "walk",
    "materialized",
    "offload_owner",
    "offloaded_modules",
    "dequantize",
    "adapter_keys",
    "bnb_kind",
    "change_key",
    "check_adapter_names",
    "REPACK_ABSMAX_REL_ERROR",
]
