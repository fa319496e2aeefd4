"""merge_and_unload's module replacement: the live model's PEFT and bitsandbytes modules replaced by merged plain ones.

Not a Sink of the one executor, which hands a destination bytes on the host, part by part: each merged weight here
stays on its module's device and replaces the module with the others of its group (fused or tied weights) at once,
and an offloaded layer's weights go back where accelerate keeps them; a round trip through host bytes would copy
every weight off the device and back."""

from __future__ import annotations

import tempfile

import torch
from torch import nn

from ..engine.budget import free_accelerator_cache
from ..engine.plan import Plan
from ..engine.report import bar_disabled
from ..engine.row_merge import check_applied
from ..errors import InputError, MergeCheckError, ShardMergeError
from ..support.model import HALF_MERGED
from .entries import LiveEntry, LiveModel
from .reader import LiveMerger
from .weights import (
    cast_offloaded,
    disk_folder,
    free_bytes,
    offloaded_modules,
    offloads,
    store_offloaded,
)


class ModuleReplacer:
    """``merge_and_unload``'s writer: each module of a loaded model's plan replaced in place, one at a time.

    Built from the plan of a walked model (:func:`~peft_shardmerge.model.planner.plan_live`): the planned tensors of
    one PEFT or bitsandbytes module are produced by the per-tensor merger and put into a plain ``nn.Linear``,
    ``Conv1D`` or ``nn.Embedding`` (or written back where accelerate keeps an offloaded layer). Every check that
    can refuse runs when the replacer is made, before anything changes.

    Args:
        plan: the plan of the loaded model (from :func:`~peft_shardmerge.model.planner.plan_live`).
        dtype: the dtype of the returned model.

    Raises:
        InputError: an offloaded module whose merged weights cannot be written back (nothing is changed).
    """

    def __init__(self, plan: Plan, dtype: torch.dtype):
        self.live: LiveModel = plan.inputs.live
        self.dtype = dtype
        self.groups: dict[str, list[LiveEntry]] = {}  # the tensors of each PEFT or bitsandbytes module, by its path
        for t in plan.tensors:
            if t.recipe.entry.owner:
                self.groups.setdefault(t.recipe.entry.owner, []).append(t.recipe.entry)
        self.offloaded = bool(offloaded_modules(self.live.model))
        self.folders = _offload_folders(self.live.model, self.groups, dtype) if self.offloaded else {}

    def write(self, merger: LiveMerger, progress: bool = False) -> None:
        """Replace every planned module by its merged plain module (offloaded layers: their hooks serve the merged
        weights).

        Args:
            merger: the per-tensor merger of the walked model.
            progress: show a progress bar over the modules (PEFT's ``progressbar``).

        Raises:
            MergeCheckError: a layer was not applied exactly once, or a merged value is not finite.
        """
        from tqdm.auto import tqdm
        from transformers.pytorch_utils import Conv1D

        inner = self.live.model
        done = 0
        try:
            with torch.no_grad():
                for path, group in tqdm(
                    self.groups.items(),
                    total=len(self.groups),
                    desc="Unloading and merging model",
                    disable=bar_disabled(progress),
                ):
                    _set_submodule(
                        inner, path, _replacement(group, merger, self.dtype, Conv1D, self.live, self.folders.get(path))
                    )
                    done += _changes(group)
                check_applied(self.live.lora_layers, merger.counts.applied)
        except ShardMergeError as e:
            if done:  # the model now mixes merged and unmerged layers: say so, and refuse it from now on
                message = (
                    f"merge_and_unload stopped after replacing {done} of "
                    f"{sum(map(_changes, self.groups.values()))} merged modules, so this model now mixes "
                    "merged and unmerged layers and must not be used or merged again: load it again"
                    + (
                        f" (merged offloaded weights were written under {sorted(set(self.folders.values()))})"
                        if any(self.folders.values())
                        else ""
                    )
                )
                setattr(inner, HALF_MERGED, message)
                raise MergeCheckError(f"{e}; {message}") from e
            raise
        free_accelerator_cache()

    def cast(self, model: nn.Module) -> None:
        """Cast the merged model to the replacer's dtype (an offloaded one module by module, its hooks serving that
        dtype, with the device map kept for ``save_pretrained``).

        Args:
            model: the model given by the caller (a PeftModel, or the transformers model itself).
        """
        inner = self.live.model
        if self.offloaded:  # accelerate's model.to refuses offloaded models: each module is cast, each hook too
            cast_offloaded(inner, self.dtype)
            _keep_device_map(model, inner)
        else:
            inner.to(self.dtype)


def _changes(group: list[LiveEntry]) -> bool:
    return any(e.kind not in ("plain", "saved") for e in group)


def _offload_folders(
    inner: nn.Module, groups: dict[str, list[LiveEntry]], dtype: torch.dtype
) -> dict[str, str | None]:
    """Where the merged weights of each offloaded module go (a new folder inside accelerate's offload folder, or
    None for CPU memory), after checking that every one can be written back there; nothing is changed on a
    problem."""
    problems: list[str] = []
    disk: dict[str, list[str]] = {}
    need: dict[str, int] = {}
    for path, group in groups.items():
        holder = group[0].holder
        if not _changes(group):
            continue
        hooked = [n for n, m in inner.get_submodule(path).named_modules() if offloads(m) and m is not holder]
        above = [n for n in _ancestors(path) if offloads(inner.get_submodule(n))]
        if above or (offloads(holder) and type(holder).__module__.startswith(("peft.", "bitsandbytes."))):
            problems.append(
                f"{path} is offloaded by accelerate as part of {above[0] if above else path}, which "
                "merge_and_unload cannot write back; use merge_and_save(model, out_dir)"
            )
        elif hooked and not all(_is_factor(n) for n in hooked):
            problems.append(f"{path}: offloaded modules {hooked} inside it cannot be written back")
        elif offloads(holder) and disk_folder(holder) is not None:
            folder = disk_folder(holder)
            disk.setdefault(folder, []).append(path)
            need[folder] = need.get(folder, 0) + sum(e.numel for e in group) * dtype.itemsize
    for folder, n in need.items():
        free = free_bytes(folder)
        if free < n + (64 << 20):
            problems.append(
                f"the offload folder {folder} has {free >> 20} MiB free; the merged "
                f"offloaded weights need {n >> 20} MiB"
            )
    if problems:
        raise InputError(
            ["merge_and_unload cannot keep this accelerate-offloaded model offloaded; nothing was changed:"] + problems
        )
    made = {folder: tempfile.mkdtemp(prefix="merged-", dir=folder) for folder in disk}
    return {path: made[folder] for folder, paths in disk.items() for path in paths}


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_factor(name: str) -> bool:
    """Whether a module inside a PEFT layer holds adapter weights (dropped by the merge), not base weights."""
    return name.split(".", 1)[0] != "base_layer" and name != ""


def _keep_device_map(model: nn.Module, inner: nn.Module) -> None:
    """Record the device map on the transformers model when accelerate dispatched the PeftModel around it, so
    that ``save_pretrained`` fetches the offloaded weights."""
    outer = getattr(model, "hf_device_map", None)
    if outer and model is not inner and not getattr(inner, "hf_device_map", None):
        inner.hf_device_map = {k.removeprefix("base_model.model."): v for k, v in outer.items()}


def _replacement(
    group: list[LiveEntry],
    merger: "LiveMerger",
    dtype: torch.dtype,
    conv1d_cls,
    live: LiveModel,
    folder: str | None = None,
) -> nn.Module:
    """The plain module that takes the place of a PEFT or bitsandbytes module, holding its merged tensors (an
    offloaded base layer stays, its merged weights served by its accelerate hook from ``folder`` or memory)."""
    holder = group[0].holder
    changed = {e.attr: merger.produce(e) for e in group if e.kind not in ("plain", "saved")}
    if not changed:  # a modules_to_save copy, an original module, a layer without an active adapter
        return holder
    if offloads(holder):
        store_offloaded(holder, group[0].owner, {a: v.detach().to(dtype) for a, v in changed.items()}, folder)
        return holder
    params = list(holder.parameters())
    device = next((p.device for p in params if p.device.type != "meta"), torch.device("cpu"))
    reusable = (
        not type(holder).__module__.startswith(("peft.", "bitsandbytes."))
        and getattr(holder, "_hf_hook", None) is None
        and not any(p.is_meta for p in params)
    )
    if reusable:  # a plain torch layer (Linear, Conv1D, Embedding, Conv2d/3d, fused experts): keep it
        for attr, value in changed.items():
            setattr(holder, attr, nn.Parameter(value.detach().to(device=device, dtype=dtype), requires_grad=False))
        return holder
    # bitsandbytes, accelerate-offloaded or PEFT-wrapped: a new Linear / Conv1D / Embedding
    entry = next(e for e in group if e.attr == "weight")
    w = changed["weight"].to(device=device, dtype=dtype)
    bias = next((e for e in group if e.attr == "bias"), None)
    b = (changed.get("bias") if "bias" in changed else merger.produce(bias)) if bias is not None else None
    if isinstance(holder, nn.Embedding):
        new = nn.Embedding(
            w.shape[0],
            w.shape[1],
            padding_idx=holder.padding_idx,
            max_norm=holder.max_norm,
            norm_type=holder.norm_type,
            scale_grad_by_freq=holder.scale_grad_by_freq,
            sparse=holder.sparse,
            device="meta",
        )
    elif entry.name in live.info.transposed:
        new = conv1d_cls(w.shape[1], w.shape[0])
        new.to("meta")
    else:
        new = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    new.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        new.bias = nn.Parameter(b.detach().to(device=device, dtype=dtype), requires_grad=False)
    elif getattr(new, "bias", None) is not None:
        new.bias = None
    return new


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
