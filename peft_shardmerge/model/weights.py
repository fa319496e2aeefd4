"""The weights of a loaded model where they really are: bitsandbytes weights dequantized, accelerate-offloaded
modules brought in for a turn, and merged weights written back where accelerate keeps them."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch
from torch import nn

from ..quant.bnb_layers import dequantize


def entry_base(entry, device: torch.device, notes: list[str] | None = None) -> torch.Tensor:
    """A float32 copy, on ``device``, of the base tensor a walked entry
    (:class:`~peft_shardmerge.model.entries.LiveEntry`) is merged into: a weight dequantized (:func:`dequantize`), a
    bias,
    trainable tokens' base rows or a parameter such as fused experts' ``gate_up_proj`` as stored.

    Args:
        entry: the entry (its ``holder`` must be materialized when it is offloaded).
        device: where the copy goes.
        notes: receives a note when a repacked 4-bit weight was unpacked.

    Returns:
        A new float32 tensor in the holder's layout.

    Raises:
        MissingDependencyError: a bitsandbytes weight without bitsandbytes installed.
    """
    if entry.attr == "weight" and entry.kind != "tokens":
        return dequantize(entry.holder, device, notes)
    return getattr(entry.holder, entry.attr).detach().to(device=device, dtype=torch.float32, copy=True)


@contextmanager
def materialized(module: nn.Module | None) -> Iterator[None]:
    """Bring an accelerate-offloaded module's weights onto its execution device for the duration; for a PEFT
    module, every offloaded module inside it (base layer and adapter factors), as PEFT's ``onload_layer`` does.

    Args:
        module: a module whose parameters may be on the meta device behind an accelerate hook, or None (then
            nothing happens).

    Returns:
        A context manager.
    """
    if module is None:
        yield
        return
    inside = list(module.modules()) if _is_peft(module) else [module]
    with ExitStack() as stack:
        from accelerate.utils import align_module_device

        for m in inside:
            if offloads(m):
                stack.enter_context(align_module_device(m, getattr(m._hf_hook, "execution_device", None)))
        yield


def _is_peft(module: nn.Module) -> bool:
    return type(module).__module__.startswith("peft.")


def offloads(module: nn.Module | None) -> bool:
    """Whether accelerate keeps this module's own weights off its execution device (a hook with ``offload``).

    Args:
        module: a module, or None.

    Returns:
        True when a hook serves its weights from the disk or CPU offload map (no hook, or one that only moves
        inputs: False).

    Example:
        >>> offloads(None), offloads(torch.nn.Linear(1, 1))
        (False, False)
    """
    hook = getattr(module, "_hf_hook", None)
    return hook is not None and bool(getattr(hook, "offload", False))


def offloaded_modules(model: nn.Module) -> list[str]:
    """The outermost modules whose weights accelerate keeps off their execution device (disk or CPU offload).

    Args:
        model: a model, possibly dispatched by accelerate with a ``device_map``.

    Returns:
        Module names, outermost first; empty when nothing is offloaded.

    Example:
        >>> offloaded_modules(torch.nn.Linear(2, 2))
        []
    """
    found: list[str] = []
    for name, module in model.named_modules():
        if offloads(module) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def offload_owner(model: nn.Module, name: str, holder: nn.Module | None = None) -> nn.Module | None:
    """The module to materialize to read tensor ``name``: the PEFT module it belongs to when its adapter factors
    are offloaded (a PeftModel dispatched by accelerate), else the tensor's own module when accelerate hooked it
    (accelerate hooks leaf modules, which PEFT keeps as ``base_layer``), else the outermost offloading module on
    the path to it.

    Args:
        model: the transformers model.
        name: the tensor's name in it.
        holder: the module that owns the tensor, when it is not on the path (a LoRA layer's base layer).

    Returns:
        The module to materialize, or None.

    Example:
        >>> offload_owner(torch.nn.Linear(2, 2), "weight") is None
        True
    """
    path = [model]
    for part in name.split(".")[:-1]:
        child = getattr(path[-1], part, None)
        if not isinstance(child, nn.Module):
            break
        path.append(child)
    if _is_peft(path[-1]) and any(offloads(m) for m in path[-1].modules() if m is not holder):
        return path[-1]  # adapter factors offloaded too (a PeftModel dispatched by accelerate)
    if offloads(holder):
        return holder
    return next((m for m in path if offloads(m)), None)


class CastWeights(Mapping):
    """An accelerate ``weights_map`` whose floating tensors come out in another dtype (read lazily)."""

    def __init__(self, weights_map: Mapping, dtype: torch.dtype):
        self.weights_map = weights_map
        self.dtype = dtype

    def __getitem__(self, key: str) -> torch.Tensor:
        value = self.weights_map[key]
        return value.to(self.dtype) if value.is_floating_point() and value.dtype != self.dtype else value

    def __iter__(self):
        return iter(self.weights_map)

    def __len__(self) -> int:
        return len(self.weights_map)


def disk_folder(module: nn.Module) -> str | None:
    """The folder accelerate reads an offloaded module's weights from, when they are on disk (None when they are
    kept in CPU memory or the module is not offloaded).

    Args:
        module: a module, possibly with an offloading accelerate hook.

    Returns:
        The offload folder, or None.

    Example:
        >>> disk_folder(torch.nn.Linear(1, 1)) is None
        True
    """
    if not offloads(module):
        return None
    weights_map = module._hf_hook.weights_map
    if isinstance(weights_map, CastWeights):
        weights_map = weights_map.weights_map
    prefix = getattr(weights_map, "prefix", "")
    loader = getattr(weights_map, "dataset", None)
    index, in_memory = getattr(loader, "index", None) or {}, getattr(loader, "state_dict", None) or {}
    names = [prefix + n for n, _ in _offloaded_tensors(module)]
    on_disk = any(n in index and n not in in_memory for n in names)
    return getattr(loader, "save_folder", None) if on_disk else None


def _offloaded_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    from accelerate.utils import named_module_tensors

    hook = module._hf_hook
    return list(named_module_tensors(module, include_buffers=hook.offload_buffers, recurse=hook.place_submodules))


def store_offloaded(holder: nn.Module, path: str, changed: dict[str, torch.Tensor], folder: str | None) -> None:
    """Give an offloaded module new weights where accelerate keeps them: its hook serves ``changed`` (and its
    other tensors, as they were) from then on, from files in ``folder`` (disk offload) or from CPU memory.

    Args:
        holder: a module whose own accelerate hook offloads its tensors.
        path: the module's name in the model (names its files).
        changed: new tensors by attribute name.
        folder: a folder of our own for the files, or None to keep the tensors in CPU memory.

    Raises:
        OSError: the files cannot be written (the module is then unchanged).
    """
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset
    from accelerate.utils.offload import offload_weight

    hook = holder._hf_hook
    tensors = {n: changed[n] if n in changed else hook.weights_map[n] for n, _ in _offloaded_tensors(holder)}
    if folder is None:
        hook.weights_map = {n: t.detach().to("cpu") for n, t in tensors.items()}
        return
    index: dict = {}
    for n, t in tensors.items():
        offload_weight(t.detach().contiguous(), f"{path}.{n}", folder, index)
    hook.weights_map = PrefixedDataset(OffloadedWeightsLoader(save_folder=folder, index=index), f"{path}.")


def free_bytes(folder: str) -> int:
    """Free space on the disk holding ``folder``.

    Args:
        folder: an existing folder.

    Returns:
        Bytes.

    Raises:
        OSError: the folder cannot be examined.

    Example:
        >>> free_bytes(".") > 0
        True
    """
    return shutil.disk_usage(folder).free


def cast_offloaded(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast a model some of whose modules accelerate offloads, one module at a time: resident floating tensors
    are cast, and offloaded ones are served in ``dtype`` by their hooks (``model.to`` refuses offloaded models).

    Args:
        model: the model.
        dtype: the floating dtype.

    Returns:
        None.

    Example:
        >>> cast_offloaded(torch.nn.Linear(2, 2), torch.bfloat16)
    """
    for module in model.modules():
        if offloads(module) and not isinstance(module._hf_hook.weights_map, CastWeights):
            module._hf_hook.weights_map = CastWeights(module._hf_hook.weights_map, dtype)
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[name] = buf.to(dtype)
