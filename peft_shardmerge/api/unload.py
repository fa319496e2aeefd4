"""merge_and_unload: a loaded model merged in place (its plan carried out by a ModuleReplacer), and what that leaves:
no PEFT module, the ties transformers makes, and no trace of quantization."""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.combine import task_vector_method
from ..distributed.sharding import SHARDINGS, sharding_of
from ..engine.budget import MemoryBudget
from ..errors import InputError
from ..model.reader import LiveMerger
from ..model.walk import unwrap, walk
from ..options import parse_dtype
from ..support.combinations import task_vector_problems
from ..support.model import require_supported
from .model_plan import adapter_selection, model_dtype


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


def merge_and_unload(
    model: nn.Module,
    *,
    maximum_memory_usage: float = 0.9,
    dtype: str | torch.dtype | None = None,
    adapter_names: list[str] | None = None,
    weights: list[float] | None = None,
    combination_type: str = "cat",
    density: float | None = None,
    majority_sign_method: str = "total",
    normalize: bool | None = None,
    seed: int = 0,
    progress: bool = False,
) -> nn.Module:
    """Replace PEFT's ``merge_and_unload`` without re-quantizing: return a plain 16-bit transformers model.

    Every LoRA layer and every bitsandbytes ``Linear4bit``/``Linear8bitLt`` is replaced, one module at a time,
    by an ``nn.Linear`` (``Conv1D`` for GPT-2 style layers, ``nn.Embedding`` for embeddings) holding the
    dequantized weight plus the LoRA delta (added in fp32, cast once); ``modules_to_save`` wrappers are
    replaced by their trained copies. Each old module is released as soon as its replacement exists, so the
    freed 4-bit storage is reused. The weights equal PEFT's merge on an fp32-dequantized base. Like PEFT's,
    this consumes ``model``: use :func:`merge_and_save` to keep it. On a model offloaded by accelerate
    (``device_map`` with ``"disk"``/``"cpu"`` parts) each offloaded layer is brought in for its turn and stays
    offloaded: its merged weights are written where accelerate keeps them (a new folder inside the offload
    folder, or CPU memory), and the model runs and saves with the same device map.

    Args:
        model: a ``PeftModel`` (or transformers model with LoRA layers), base 4-bit, 8-bit or unquantized.
        maximum_memory_usage: fraction (0, 0.95] of accelerator memory the merge may occupy; a module over it is
            merged on the CPU, and one that runs out of memory is retried there.
        dtype: dtype of the returned model; None keeps the model's 16-bit dtype.
        adapter_names: adapters to merge together; None merges the active adapter(s).
        weights: one weight per adapter of ``adapter_names`` (default 1.0 each).
        combination_type: ``"cat"``, ``"linear"``, ``"ties"``, ``"dare_ties"``, ``"dare_linear"`` or
            ``"magnitude_prune"``, as in :func:`merge_and_save`.
        density: the fraction of each delta a task-vector method keeps, as in :func:`merge_and_save`.
        majority_sign_method: ``"total"`` or ``"frequency"`` (``ties``, ``dare_ties``).
        normalize: None for the method's default.
        seed: DARE's seed.
        progress: show a progress bar over the modules replaced.

    Returns:
        The transformers model, with no PEFT or bitsandbytes layers and no ``quantization_config``.

    Raises:
        InputError: bad options, no adapter, an adapter already merged, or accelerate-offloaded modules whose merged
            weights cannot be written back where accelerate keeps them (the model is then unchanged).
        UnsupportedError: an adapter feature that cannot be merged (named).
    """
    from ..model.in_place import ModuleReplacer
    from ..model.planner import LiveInputs, plan_live

    budget = MemoryBudget(maximum_memory_usage)
    out_dtype = parse_dtype(dtype)
    if sharding_of(model) is not None:  # first: the other checks do not know its wrappers
        raise InputError(
            f"the model is sharded by {SHARDINGS[sharding_of(model)]}: each rank holds only a slice of "
            "every weight, so merge_and_unload cannot give back a whole merged model; call "
            "merge_and_save(model, out_dir) on every rank to write the merged checkpoint instead"
        )
    inner = unwrap(model)
    names, weight_map, problems = adapter_selection(model, adapter_names, weights, combination_type)
    problems += task_vector_problems(
        combination_type,
        density,
        majority_sign_method,
        normalize,
        seed,
        option="combination_type",
        sign_option="majority_sign_method",
    )
    problems = require_supported(model, names, problems)
    out_dtype = out_dtype or model_dtype(inner)
    if problems:
        raise InputError(problems)
    vectors = task_vector_method(
        combination_type, list(weight_map.values()), density, majority_sign_method, normalize, seed
    )
    live = walk(model, names)
    plan = plan_live(LiveInputs(live, names, weight_map, combination_type, vectors), out_dtype, limit=1 << 62)
    replacer = ModuleReplacer(plan, out_dtype)  # checks, before changing anything
    merger = LiveMerger(live, budget, out_dtype, weight_map, combination_type, plan.chunk_elems, vectors)
    replacer.write(merger, progress=progress)
    finish_unload(inner, untied=live.untied)
    replacer.cast(model)
    return inner
