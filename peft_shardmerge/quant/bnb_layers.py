"""bitsandbytes weights of a loaded model read back as float: which layers hold them (FSDP-sharded ones included),
their unquantized shapes, and the float32 weight dequantized by bitsandbytes."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..errors import MergeCheckError

#: the relative error of a bf16 block scale, what bitsandbytes' CPU repacking keeps of each absmax
REPACK_ABSMAX_REL_ERROR = 2.0**-9


def bnb_kind(param: torch.Tensor | None) -> str | None:
    """Whether a parameter is a bitsandbytes quantized one.

    Args:
        param: a parameter, or None.

    Returns:
        ``"4bit"`` (``Params4bit``), ``"8bit"`` (``Int8Params``) or None.

    Example:
        >>> bnb_kind(torch.nn.Linear(1, 1).weight) is None
        True
    """
    name = type(param).__name__ if param is not None else ""
    return {"Params4bit": "4bit", "Int8Params": "8bit"}.get(name)


def is_bnb_layer(module: nn.Module, name: str = "") -> bool:
    """Whether a module is one of bitsandbytes' own layers (``name``: only that class and its subclasses).

    Args:
        module: any module.
        name: a bitsandbytes class name such as ``"Linear4bit"``, or empty for any bitsandbytes module.

    Returns:
        True for a bitsandbytes layer (of that class).

    Example:
        >>> is_bnb_layer(torch.nn.Linear(1, 1))
        False
    """
    return any(
        c.__module__.startswith("bitsandbytes") and (not name or c.__name__ == name) for c in type(module).__mro__
    )


def bnb_layer_kind(module: nn.Module | None) -> str | None:
    """Whether a layer holds a bitsandbytes-quantized weight.

    A ``Linear4bit`` sharded by FSDP holds its packed bytes in a plain (or DTensor) parameter: the parameter lost its
    quant state, which bitsandbytes keeps on the module as ``module.quant_state`` (its own forward reads it back
    there), so the layer is recognized by that (or by a ``quant_state`` the planning stand-in of its weight
    carries).

    Args:
        module: a layer, or None.

    Returns:
        ``"4bit"``, ``"8bit"`` or None (:func:`bnb_kind` of its weight, else ``"4bit"`` for such a sharded layer).

    Example:
        >>> bnb_layer_kind(torch.nn.Linear(1, 1)) is None
        True
    """
    weight = getattr(module, "weight", None)
    kind = bnb_kind(weight)
    if (
        kind is None
        and weight is not None
        and is_bnb_layer(module, "Linear4bit")
        and (getattr(module, "quant_state", None) is not None or getattr(weight, "quant_state", None) is not None)
    ):
        return "4bit"
    return kind


def quant_state_of(module: nn.Module):
    """The quant state of a 4-bit layer: its weight's, else the one bitsandbytes keeps on the module (FSDP).

    Args:
        module: a layer :func:`bnb_layer_kind` calls ``"4bit"``.

    Returns:
        A bitsandbytes ``QuantState``, or None where the layer has none.
    """
    state = getattr(module.weight, "quant_state", None)
    return state if state is not None else getattr(module, "quant_state", None)


def logical_shape(module: nn.Module) -> tuple[int, ...]:
    """The unquantized shape of a layer's (possibly bitsandbytes-packed) weight, in the layer's layout.

    Args:
        module: the layer (its weight may be a full-shape planning stand-in).

    Returns:
        The shape of the float weight.

    Example:
        >>> logical_shape(torch.nn.Linear(3, 2))
        (2, 3)
    """
    if bnb_layer_kind(module) == "4bit":
        return tuple(quant_state_of(module).shape)
    return tuple(module.weight.shape)


def dequantize(holder: nn.Module, device: torch.device, notes: list[str] | None = None) -> torch.Tensor:
    """The float32 weight of a module, dequantized on ``device`` when it is a bitsandbytes weight (4-bit: by the
    format's definition, :func:`~peft_shardmerge.quant.nf4.dequantize_state`, the function the disk path applies to the
    stored bytes; never bitsandbytes' CPU ``dequantize_4bit``, wrong on rows that are not whole 64-value blocks).

    A 4-bit weight that bitsandbytes repacked for its CPU kernel (``quant_state.packing_format_for_cpu``,
    after an eval-mode forward on a CPU with AVX512-BF16) is unpacked on a copy: the 4-bit codes are
    recovered exactly; the block scales were stored in bf16 by the repacking, so each block's scale is
    off by at most 2^-9 relative (noted in ``notes``). A weight whose repacking bitsandbytes already undid in place
    (a ``state_dict()``, e.g. PEFT's ``save_pretrained``, re-quantizes those bf16 scales) is noted too: it is not the
    base the model was trained on either. The module itself is never changed. A 4-bit layer
    sharded by FSDP is read from its gathered bytes with the quant state kept on the module.

    Args:
        holder: an ``nn.Linear``/``Conv1D``/``nn.Embedding`` or a bitsandbytes ``Linear4bit``/``Linear8bitLt``.
        device: where to compute.
        notes: receives a note when a repacked weight was unpacked.

    Returns:
        A new float32 tensor in the holder's layout (``[out, in]`` for bitsandbytes layers).

    Raises:
        MissingDependencyError: a bitsandbytes weight without bitsandbytes installed.
        MergeCheckError: a 4-bit weight whose bytes are not all there (an FSDP shard not gathered), or were cast.
    """
    weight = holder.weight
    kind = bnb_layer_kind(holder)
    if kind is None:
        return weight.detach().to(device=device, dtype=torch.float32, copy=True)
    from .nf4 import dequantize_state, require_bitsandbytes

    require_bitsandbytes()
    if kind == "8bit":
        from .nf4 import dequantize_int8_exact

        cb = weight.data.to(device)
        scb = weight.SCB if getattr(weight, "SCB", None) is not None else holder.state.SCB
        return dequantize_int8_exact(cb, scb)  # the format's definition in float32, as from disk
    qs = quant_state_of(holder)
    data = weight.data
    storage = getattr(weight, "quant_storage", None) or getattr(holder, "quant_storage", None)
    if isinstance(storage, torch.dtype) and data.dtype != storage and not getattr(qs, "packing_format_for_cpu", False):
        raise MergeCheckError(
            f"the 4-bit weight of {type(holder).__name__}{tuple(qs.shape)} is stored as {storage} "
            f"but was read as {data.dtype}: a cast changed its packed bytes"
        )
    if getattr(qs, "packing_format_for_cpu", False):
        data, qs = _unpack_cpu_format(data, qs)
        if notes is not None:
            notes.append("repacked")
    elif getattr(qs, "original_qshape", None) is not None:
        qs = _undone_in_place(qs)
        if notes is not None:
            notes.append("repacked")  # repacked, then undone in place by a state_dict() (PEFT save_pretrained)
    expected = (qs.shape.numel() + 1) // 2
    if hasattr(data, "placements") or data.numel() * data.element_size() != expected:
        raise MergeCheckError(
            f"the 4-bit weight of {type(holder).__name__}{tuple(qs.shape)} holds "
            f"{data.numel() * data.element_size()} bytes, not the {expected} of the whole weight "
            "(a sharded weight that was not gathered)"
        )
    qs = _quant_state_on(qs, device) if qs.absmax.device != device else qs
    return dequantize_state(data.to(device), qs, torch.float32)  # the definition, as from disk


def _quant_state_on(qs, device: torch.device):
    """A copy of a QuantState on another device (QuantState.to works in place, on the caller's state)."""
    from bitsandbytes.functional import QuantState

    packed = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in qs.as_dict(packed=True).items()}
    return QuantState.from_dict(packed, device=device)


def _undone_in_place(qs):
    """The quant state of a repacking bitsandbytes undid in place (a ``state_dict()``): without double quant it
    leaves the block scales in the repacked layout (bf16, ``[blocks per row, rows]``), read here as a flat copy."""
    if qs.nested or qs.absmax.dim() != 2:
        return qs
    state = copy.copy(qs)
    state.absmax = qs.absmax.T.reshape(-1).to(torch.float32)
    return state


def _unpack_cpu_format(packed: torch.Tensor, qs):
    """Undo bitsandbytes' CPU repacking on copies: exact 4-bit codes, un-nested bf16 block scales.

    Under FSDP the repacking reaches only the module's quant state (the packed bytes went to a parameter FSDP then
    dropped): bytes still in bitsandbytes' usual layout are kept as they are, only the state is undone."""
    import bitsandbytes.functional as F

    rows, cols = qs.shape
    state = copy.copy(qs)
    if packed.dtype == torch.uint8 and tuple(packed.shape) == (rows, cols // 2):
        state.original_nested = False  # keep the bf16 scales as they are rather than re-quantizing them
        packed, state = F._convert_weight_packed_for_cpu_inverse(packed.detach().clone(), state)
        state = copy.copy(state)
    state.absmax = qs.absmax.T.reshape(-1).to(torch.float32)
    state.nested = False
    state.dtype = qs.original_dtype
    state.packing_format_for_cpu = False
    return packed, state


__all__ = [
    "REPACK_ABSMAX_REL_ERROR",
    "bnb_kind",
    "bnb_layer_kind",
    "is_bnb_layer",
    "quant_state_of",
    "logical_shape",
    "dequantize",
]
