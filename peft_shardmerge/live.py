"""A loaded model as a merge source: walk a PeftModel module by module and produce each merged tensor on demand."""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from .errors import InputError, UnsupportedError
from .model_check import adapter_keys, transformers_model
from .model_info import ModelInfo, inspect_model
from .plan import _tie_enabled

log = logging.getLogger(__name__)

#: the relative error of a bf16 block scale, what bitsandbytes' CPU repacking keeps of each absmax
REPACK_ABSMAX_REL_ERROR = 2.0**-9


@dataclass
class LiveEntry:
    """One output tensor of a loaded model and how to produce it.

    Attributes:
        name: its name in the output checkpoint (plain transformers names).
        shape: its shape in the output layout.
        floating: whether it is cast to the output dtype.
        kind: ``"lora"`` (base + LoRA deltas), ``"quantized"`` (a bitsandbytes weight, dequantized),
            ``"saved"`` (a ``modules_to_save`` copy), ``"lora_bias"`` (a bias with ``lora_B.bias``), ``"tokens"``
            (trainable-token rows), ``"delta"`` (base + PEFT's ``get_delta_weight``: LoHa, LoKr, VeRA, LoRA on
            parameters), ``"ia3"`` (base scaled by IA3's vector) or ``"plain"``.
        module: the module holding the tensor (the LoRA layer for ``"lora"``/``"lora_bias"``).
        attr: the tensor's attribute name on the module it lives on.
        holder: the module the attribute belongs to (base layer, ModulesToSaveWrapper copy, ...).
        adapters: active adapter names whose deltas are added.
        transpose_out: the output layout is the transpose of the holder's (Conv1D replaced by bnb Linear).
        numel: elements.
        owner: the path of the PEFT (or bitsandbytes) module this tensor belongs to, the module
            ``merge_and_unload`` replaces; "" for tensors of plain modules.
    """

    name: str
    shape: tuple[int, ...]
    floating: bool
    kind: str
    module: nn.Module
    attr: str
    holder: nn.Module
    adapters: list[str] = field(default_factory=list)
    transpose_out: bool = False
    numel: int = 0
    owner: str = ""


@dataclass
class LiveModel:
    """A walked model: its transformers model, structure facts, and every output tensor in order.

    Attributes:
        model: the transformers model under the PEFT wrapper.
        info: structure of the plain model class (layouts, ties).
        entries: output tensors, in ``state_dict`` order.
        untied: tied weights written separately because the adapter changed one side.
        lora_layers: names of LoRA layers with an active adapter (each must be applied once).
        notes: things to tell the user.
    """

    model: nn.Module
    info: ModelInfo
    entries: list[LiveEntry]
    untied: list[str]
    lora_layers: list[str]
    notes: list[str] = field(default_factory=list)


def unwrap(model: nn.Module) -> nn.Module:
    """Return the transformers model inside a ``PeftModel`` (or the model itself when PEFT layers were
    injected into a transformers model with ``add_adapter``).

    Args:
        model: a ``PeftModel`` or a transformers model carrying LoRA layers.

    Returns:
        The transformers model.

    Raises:
        InputError: the model carries no PEFT adapter.

    Example:
        >>> unwrap(peft_model).__class__.__name__   # doctest: +SKIP
        'LlamaForCausalLM'
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


def bnb_kind(param: torch.Tensor | None) -> str | None:
    """Whether a parameter is a bitsandbytes quantized one.

    Args:
        param: a parameter, or None.

    Returns:
        ``"4bit"`` (``Params4bit``), ``"8bit"`` (``Int8Params``) or None.

    Raises:
        Nothing.

    Example:
        >>> bnb_kind(torch.nn.Linear(1, 1).weight) is None
        True
    """
    name = type(param).__name__ if param is not None else ""
    return {"Params4bit": "4bit", "Int8Params": "8bit"}.get(name)


def walk(model: nn.Module, adapter_names: list[str] | None = None) -> LiveModel:
    """List every tensor the merged checkpoint will hold, without computing any of them.

    Args:
        model: a ``PeftModel`` with a LoRA adapter (base unquantized, bitsandbytes 4-bit or 8-bit).
        adapter_names: the adapters to merge; None means the active one(s).

    Returns:
        The :class:`LiveModel`.

    Raises:
        InputError: no adapter, or adapters already merged into the base.
        UnsupportedError: DoRA or other LoRA variants, trainable tokens (all named).

    Example:
        >>> live = walk(peft_model)              # doctest: +SKIP
        >>> [e.name for e in live.entries][:2]   # doctest: +SKIP
        ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight']
    """
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    inner = unwrap(model)
    info = inspect_model(inner.config, type(inner))
    entries: list[LiveEntry] = []
    problems: list[str] = []
    unsupported: list[str] = []
    lora_layers: list[str] = []
    skip: list[str] = []
    if adapter_names is not None:
        name_problems = check_adapter_names(model, adapter_names)
        if name_problems:
            raise InputError(name_problems)
    for name, module in inner.named_modules():
        if any(name.startswith(p + ".") for p in skip):
            continue
        prefix = f"{name}." if name else ""
        if _delta_layer(module):  # LoHa, LoKr, VeRA, IA3, LoRA on parameters: PEFT computes each delta
            skip.append(name)
            chain = [module]
            while _delta_layer(getattr(chain[-1], "base_layer", None)):
                chain.append(chain[-1].base_layer)
            real = chain[-1].get_base_layer()
            wanted = adapter_names if adapter_names is not None else module.active_adapters
            if any(getattr(m, "merged", False) for m in chain):
                problems.append(f"{name} has its adapter merged into the base already; call model.unmerge_adapter() "
                                "first")
                continue
            by_param = {getattr(m, "parameter_name", None) or "weight": m for m in chain}
            for pname, t in list(real.named_parameters(recurse=False)) + [
                    (b, t) for b, t in real.named_buffers(recurse=False) if b not in real._non_persistent_buffers_set]:
                layer = by_param.get(pname)
                if layer is None and pname == "bias" and _is_ia3(module) and not module.is_feedforward:
                    layer = module  # IA3 scales a non-feedforward layer's bias with its outputs
                adapters = [a for a in wanted if layer is not None and a in adapter_keys(layer)]
                kind = ("ia3" if _is_ia3(layer) else "delta") if adapters else \
                    "quantized" if bnb_kind(t) is not None else "plain"  # an inactive layer over a 4-bit base
                shape = _logical_shape(real, t) if pname == "weight" else tuple(t.shape)
                entries.append(LiveEntry(prefix + pname, shape, t.is_floating_point(), kind, layer or real, pname,
                                         real, adapters, numel=_numel(shape), owner=name))
                if adapters and kind == "delta" or kind == "ia3" and pname != "bias":
                    lora_layers.append(change_key(entries[-1]))
            continue
        if _is_lora(module):
            skip.append(name)
            wanted = adapter_names if adapter_names is not None else module.active_adapters
            adapters = [a for a in wanted if a in module.lora_A or a in module.lora_embedding_A]
            if getattr(module, "merged", False):
                problems.append(f"{name} has its adapter merged into the base already; call model.unmerge_adapter() "
                                "first (merging into a 4-bit base re-quantizes it)")
                continue
            dora = [a for a in adapters if getattr(module, "use_dora", {}).get(a)]
            if dora and len(adapters) > 1:
                unsupported.append(f"{name}: DoRA adapters cannot be combined with others (their magnitudes do "
                                   "not add)")
            for a in set(adapters) - set(dora):
                if getattr(module, "lora_variant", {}).get(a) is not None:
                    unsupported.append(f"{name}: LoRA variant {type(module.lora_variant[a]).__name__} is not supported")
            base = module.get_base_layer()
            weight = base.weight
            wname = f"{prefix}weight"
            transpose_out = bnb_kind(weight) is not None and wname in info.transposed
            shape = _logical_shape(base, weight)
            if transpose_out:
                shape = shape[::-1]
            entries.append(LiveEntry(wname, shape, True, "lora", module, "weight", base, adapters, transpose_out,
                                     _numel(shape), owner=name))
            if adapters:
                lora_layers.append(change_key(entries[-1]))
            if getattr(base, "bias", None) is not None:
                with_bias = [a for a in adapters if getattr(module, "lora_bias", {}).get(a)]
                entries.append(LiveEntry(f"{prefix}bias", tuple(base.bias.shape), True,
                                         "lora_bias" if with_bias else "plain", module, "bias", base, with_bias,
                                         numel=base.bias.numel(), owner=name))
            continue
        if isinstance(module, ModulesToSaveWrapper):
            skip.append(name)
            if adapter_names is None:
                active = module.active_adapters
                saved = [active[0]] if active and active[0] in module.modules_to_save else []
            else:
                saved = [a for a in adapter_names if a in module.modules_to_save]
            if len(saved) > 1:
                problems.append(f"{name} is a modules_to_save copy in several of the adapters merged "
                                f"({', '.join(saved)}); these copies cannot be combined")
                continue
            holder = module.modules_to_save[saved[0]] if saved else module.original_module
            for pname, t in holder.state_dict(keep_vars=True).items():
                entries.append(LiveEntry(prefix + pname, tuple(t.shape), t.is_floating_point(),
                                         "saved" if holder is not module.original_module else "plain",
                                         module, pname, holder, numel=t.numel(), owner=name))
            continue
        tokens = _token_layer(module)
        if tokens is not None:  # trainable tokens: trained rows replace the embedding's (or tied head's)
            skip.append(name)
            wanted = adapter_names if adapter_names is not None else (
                module.active_adapters if isinstance(module, AuxiliaryTrainingWrapper) else tokens.active_adapters)
            adapters = [a for a in wanted if a in tokens.token_indices]
            if len(adapters) > 1:
                problems.append(f"{name}: several adapters train tokens here ({', '.join(adapters)}); their rows "
                                "cannot be combined")
            base = tokens.get_base_layer()
            entries.append(LiveEntry(f"{prefix}weight", tuple(base.weight.shape), True, "tokens" if adapters else
                                     "plain", tokens, "weight", base, adapters, numel=base.weight.numel(), owner=name))
            if adapters and tokens.tied_adapter is None:  # a tied head shares the embedding's rows
                lora_layers.append(change_key(entries[-1]))
            if getattr(base, "bias", None) is not None:
                entries.append(LiveEntry(f"{prefix}bias", tuple(base.bias.shape), True, "plain", base, "bias", base,
                                         numel=base.bias.numel(), owner=name))
            continue
        if isinstance(module, AuxiliaryTrainingWrapper):
            unsupported.append(f"{name}: {type(module).__name__} is not supported")
            skip.append(name)
            continue
        weight = getattr(module, "weight", None)
        if bnb_kind(weight) is not None:
            skip.append(name)
            shape = _logical_shape(module, weight)
            transpose_out = f"{prefix}weight" in info.transposed
            if transpose_out:
                shape = shape[::-1]
            entries.append(LiveEntry(f"{prefix}weight", shape, True, "quantized", module, "weight", module,
                                     transpose_out=transpose_out, numel=_numel(shape), owner=name))
            if getattr(module, "bias", None) is not None:
                entries.append(LiveEntry(f"{prefix}bias", tuple(module.bias.shape), True, "plain", module, "bias",
                                         module, numel=module.bias.numel(), owner=name))
            continue
        for pname, t in list(module.named_parameters(recurse=False)) + [
            (b, t) for b, t in module.named_buffers(recurse=False) if b not in module._non_persistent_buffers_set
        ]:
            entries.append(LiveEntry(prefix + pname, tuple(t.shape), t.is_floating_point(), "plain", module, pname,
                                     module, numel=t.numel()))
    if unsupported:
        raise UnsupportedError("the model uses adapter features that cannot be merged: " + "; ".join(unsupported))
    if problems:
        raise InputError(problems)
    entries, untied = _resolve_ties(inner, info, entries)
    notes = []
    if untied:
        notes.append(f"the adapter changes tied weights ({', '.join(untied)}); both are written and "
                     "tie_word_embeddings is set to false")
    return LiveModel(inner, info, entries, untied, lora_layers, notes)


def check_adapter_names(model: nn.Module, adapter_names: list[str]) -> list[str]:
    """What is wrong with a selection of adapters by name: empty, unknown names, a name twice.

    Args:
        model: the PeftModel.
        adapter_names: the names.

    Returns:
        The problems (none when the selection is good).

    Raises:
        Nothing.

    Example:
        >>> check_adapter_names(torch.nn.Linear(1, 1), ["a"])
        ["adapter_names ['a'] must name loaded adapters; the model has none"]
    """
    known = set((getattr(model, "peft_config", None) or {}).keys())
    if not adapter_names or any(a not in known for a in adapter_names):
        return [f"adapter_names {list(adapter_names)!r} must name loaded adapters; the model has "
                f"{sorted(known) or 'none'}"]
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

    Raises:
        Nothing.

    Example:
        >>> change_key(LiveEntry("m.weight", (1,), True, "lora", None, "weight", None, owner="m"))
        'm'
    """
    if entry.kind == "tokens":
        return f"tokens:{entry.owner}"  # token rows are counted, not reported as LoRA modules (as on disk)
    return f"{entry.owner}::{entry.attr}" if entry.kind in ("delta", "ia3") else entry.owner


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


def _logical_shape(module: nn.Module, weight: torch.Tensor) -> tuple[int, ...]:
    """The unquantized shape of a (possibly bitsandbytes-packed) weight, in the holder's layout."""
    qs = getattr(weight, "quant_state", None)
    if qs is not None:
        return tuple(qs.shape)
    return tuple(weight.shape)


def _resolve_ties(inner: nn.Module, info: ModelInfo, entries: list[LiveEntry]) -> tuple[list[LiveEntry], list[str]]:
    """Drop tied duplicates as transformers' save_pretrained does, unless the adapter changed one side."""
    if not _tie_enabled(inner.config.to_dict()) or not info.tied:
        return entries, []
    by_name = {e.name: e for e in entries}
    drop, untied = set(), []
    for target, source in info.tied.items():
        if target not in by_name or source not in by_name:
            continue
        touched = {by_name[n].kind for n in (target, source)} & {"lora", "saved"}
        if by_name[target].kind == "tokens" and by_name[source].kind == "tokens" and \
                by_name[target].module.tied_adapter is None:
            raise UnsupportedError(f"trainable tokens are given for both tied weights {source} and {target}; tied "
                                   "weights share one matrix, so train tokens on the input embedding only")
        if touched:
            untied += [target, source]
        else:
            drop.add(target)
    return [e for e in entries if e.name not in drop], sorted(set(untied))


@contextmanager
def materialized(module: nn.Module) -> Iterator[None]:
    """Bring an accelerate-offloaded module's weights onto its execution device for the duration.

    Args:
        module: a module whose parameters may be on the meta device behind an accelerate hook, or None (then
            nothing happens).

    Returns:
        A context manager.

    Raises:
        Nothing of its own.

    Example:
        >>> with materialized(layer):   # doctest: +SKIP
        ...     w = layer.weight.detach().clone()
    """
    if _offloads(module):
        from accelerate.utils import align_module_device

        with align_module_device(module, getattr(module._hf_hook, "execution_device", None)):
            yield
    else:
        yield


def _offloads(module: nn.Module | None) -> bool:
    hook = getattr(module, "_hf_hook", None)
    return hook is not None and bool(getattr(hook, "offload", False))


def offloaded_modules(model: nn.Module) -> list[str]:
    """The outermost modules whose weights accelerate keeps off their execution device (disk or CPU offload).

    Args:
        model: a model, possibly dispatched by accelerate with a ``device_map``.

    Returns:
        Module names, outermost first; empty when nothing is offloaded.

    Raises:
        Nothing.

    Example:
        >>> offloaded_modules(torch.nn.Linear(2, 2))
        []
    """
    found: list[str] = []
    for name, module in model.named_modules():
        if _offloads(module) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def offload_owner(model: nn.Module, name: str, holder: nn.Module | None = None) -> nn.Module | None:
    """The module whose accelerate hook holds tensor ``name``'s offloaded weights, if any: the tensor's own
    module first (accelerate hooks leaf modules, which PEFT keeps as ``base_layer``), else the outermost
    offloading module on the path to it.

    Args:
        model: the transformers model.
        name: the tensor's name in it.
        holder: the module that owns the tensor, when it is not on the path (a LoRA layer's base layer).

    Returns:
        The module to materialize, or None.

    Raises:
        Nothing.

    Example:
        >>> offload_owner(torch.nn.Linear(2, 2), "weight") is None
        True
    """
    if _offloads(holder):
        return holder
    mod: nn.Module | None = model
    for part in name.split(".")[:-1] + [None]:
        if _offloads(mod):
            return mod
        mod = getattr(mod, part, None) if part is not None else None
        if mod is None:
            return None
    return None


def dequantize(holder: nn.Module, device: torch.device, notes: list[str] | None = None) -> torch.Tensor:
    """The float32 weight of a module, dequantized on ``device`` when it is a bitsandbytes weight.

    A 4-bit weight that bitsandbytes repacked for its CPU kernel (``quant_state.packing_format_for_cpu``,
    after an eval-mode forward on a CPU with AVX512-BF16) is unpacked on a copy: the 4-bit codes are
    recovered exactly; the block scales were stored in bf16 by the repacking, so each block's scale is
    off by at most 2^-9 relative (noted in ``notes``). The module itself is never changed.

    Args:
        holder: an ``nn.Linear``/``Conv1D``/``nn.Embedding`` or a bitsandbytes ``Linear4bit``/``Linear8bitLt``.
        device: where to compute.
        notes: receives a note when a repacked weight was unpacked.

    Returns:
        A new float32 tensor in the holder's layout (``[out, in]`` for bitsandbytes layers).

    Raises:
        MissingDependencyError: a bitsandbytes weight without bitsandbytes installed.

    Example:
        >>> dequantize(model.model.layers[0].mlp.up_proj, torch.device("cpu")).dtype   # doctest: +SKIP
        torch.float32
    """
    weight = holder.weight
    kind = bnb_kind(weight)
    if kind is None:
        return weight.detach().to(device=device, dtype=torch.float32, copy=True)
    from .quant import require_bitsandbytes

    F = require_bitsandbytes()
    if kind == "8bit":
        cb = weight.data.to(device)
        scb = weight.SCB if getattr(weight, "SCB", None) is not None else holder.state.SCB
        return F.int8_vectorwise_dequant(cb, scb.to(device)).to(torch.float32)
    qs = weight.quant_state
    data = weight.data
    if getattr(qs, "packing_format_for_cpu", False):
        data, qs = _unpack_cpu_format(data, qs)
        if notes is not None:
            notes.append("repacked")
    qs = _quant_state_on(qs, device) if qs.absmax.device != device else qs
    return F.dequantize_4bit(data.to(device), qs).to(torch.float32)


def _quant_state_on(qs, device: torch.device):
    """A copy of a QuantState on another device (QuantState.to works in place, on the caller's state)."""
    from bitsandbytes.functional import QuantState

    packed = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in qs.as_dict(packed=True).items()}
    return QuantState.from_dict(packed, device=device)


def _unpack_cpu_format(packed: torch.Tensor, qs):
    """Undo bitsandbytes' CPU repacking on copies: exact 4-bit codes, un-nested bf16 block scales."""
    import bitsandbytes.functional as F

    state = copy.copy(qs)
    state.original_nested = False  # keep the bf16 scales as they are rather than re-quantizing them
    qweight, state = F._convert_weight_packed_for_cpu_inverse(packed.detach().clone(), state)
    state = copy.copy(state)
    state.absmax = qs.absmax.T.reshape(-1).to(torch.float32)
    state.nested = False
    state.dtype = qs.original_dtype
    state.packing_format_for_cpu = False
    return qweight, state


__all__ = ["LiveEntry", "LiveModel", "unwrap", "walk", "materialized", "offload_owner", "dequantize",
           "adapter_keys", "bnb_kind", "change_key", "check_adapter_names", "REPACK_ABSMAX_REL_ERROR"]
