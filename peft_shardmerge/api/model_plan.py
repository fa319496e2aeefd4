"""Planning a loaded model's merge: option checks, the base merged into, and the plan of every output tensor."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..checkpoint.adapter import check_weights, modifies_base
from ..checkpoint.combine import task_vector_method
from ..checkpoint.peft_deltas import DELTA_TYPES
from ..checkpoint.planner import plan_from_folders
from ..distributed.sharding import SHARDINGS, sharding_of, sharding_problems
from ..engine.plan import Plan
from ..errors import FileSystemError, InputError, ShardMergeError
from ..model.planner import LiveInputs, in_memory_text, plan_live, valid_generation_config
from ..model.walk import check_adapter_names, unwrap, walk
from ..options import MODEL, MODEL_BASE_PRECISIONS, MergeOptions
from ..output.out_dir import check_out_dir, foreign_model_problems, source_folders
from ..output.side_files import candidate_folders
from ..output.staging import NOTHING_WRITTEN
from ..support.combinations import TASK_VECTOR_METHODS, combination_problems
from ..support.model import require_supported, selected_adapters
from .original import (
    OriginalCheck,
    default_dtype,
    describe_base,
    find_original,
    inner_problems,
    is_quantized,
)

log = logging.getLogger(__name__)

BASE_PRECISIONS = MODEL_BASE_PRECISIONS


def model_dtype(inner: nn.Module) -> torch.dtype:
    """The 16-bit dtype a loaded (possibly 4-bit) model computes in: its config's dtype, else that of its first
    floating-point parameter that bitsandbytes did not quantize.

    Args:
        inner: the transformers model.

    Returns:
        ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
    """
    cfg = getattr(getattr(inner, "config", None), "dtype", None) or getattr(inner.config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = getattr(torch, cfg, None)
    if cfg in (torch.bfloat16, torch.float16, torch.float32):
        return cfg
    for p in inner.parameters():
        if p.is_floating_point() and type(p).__name__ not in ("Params4bit", "Int8Params"):
            return p.dtype
    return torch.float32


def _original_checkpoint(
    model: nn.Module,
    inner: nn.Module,
    names: list[str],
    weight_map: dict[str, float],
    base_precision: str = "original",
) -> tuple[str | None, str, OriginalCheck]:
    """The 16-bit checkpoint to merge into from disk, ``(folder, "", check)``, or ``(None, why not, check)``.

    The checkpoint is used only when a sample of its tensors equals the model in memory (any cached revision,
    :func:`~peft_shardmerge.api.original.find_original`). ``"auto"`` reproduces the trained model: it takes the
    checkpoint only for an unquantized model (the same numbers as in memory), never for a quantized one.
    """
    from peft import PeftModel

    try:
        check = find_original(walk(model, names))
    except ShardMergeError as e:
        check = OriginalCheck(None, inner_problems(e))
    if not isinstance(model, PeftModel):
        return None, "the model is not a PeftModel (the adapter cannot be saved on its own)", check
    inits = [getattr(c, "init_lora_weights", True) for c in (getattr(model, "peft_config", None) or {}).values()]
    rewritten = next((i for i in inits if modifies_base(i)), None)
    if rewritten is not None:
        return None, f"the adapter was initialised with {rewritten!r}, which rewrote the base in memory", check
    memory_only = _memory_only(model, names, weight_map)
    if memory_only:
        return None, f"the model has a {memory_only}, which is merged in memory only", check
    if any(p.is_meta for n, p in model.named_parameters() if any(f".{a}." in n for a in names)):
        return (
            None,
            "the adapter's weights are offloaded by accelerate (they are read in memory, layer by layer)",
            check,
        )
    if check.folder is None:
        return None, check.reason, check
    if base_precision == "auto" and is_quantized(inner):
        return (
            None,
            (
                "'auto' reproduces the trained model, whose base is the quantized one; pass "
                "base_precision='original' to merge into the 16-bit checkpoint"
            ),
            check,
        )
    return check.folder, "", check


def _peft_type(config) -> str:
    return str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "")))


def _memory_only(model: nn.Module, names: list[str], weight_map: dict[str, float]) -> str:
    """What, among the adapters to merge, the disk engine cannot merge (named), or "" when there is none."""
    configs = getattr(model, "peft_config", None) or {}
    combined = len(names) > 1 or any(w != 1 for w in weight_map.values())
    for name in names:
        config = configs.get(name)
        peft_type = _peft_type(config)
        if peft_type not in ("LORA", "TRAINABLE_TOKENS", *DELTA_TYPES):
            return f"{peft_type} adapter"
        if peft_type == "VERA" and not getattr(config, "save_projection", True):
            return "VeRA adapter without saved projections"
        if combined and (peft_type != "LORA" or getattr(config, "target_parameters", None)):
            return f"weighted combination with the {peft_type} adapter {name!r}"
    return ""


def adapter_selection(model: nn.Module, adapter_names, weights, combination_type):
    """Check ``adapter_names``/``weights``/``combination_type``: ``(names or None, weight per name, problems)`` (a
    task-vector method always names its adapters and their weights)."""
    if adapter_names is None and weights is None and combination_type not in TASK_VECTOR_METHODS:
        return None, {}, check_weights(0, None, combination_type, option="combination_type")[1]
    configs = getattr(model, "peft_config", None) or {}
    if adapter_names is None:
        adapter_names = selected_adapters(model, None)
    names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
    problems = check_adapter_names(model, names)
    if problems:
        return names, {}, problems
    weights, problems = combination_problems(
        [configs[a] for a in names], names, weights, combination_type, option="combination_type", in_process=True
    )
    if len(weights) != len(names):
        return names, {}, problems
    return names, dict(zip(names, weights)), problems


def _vocab_size(config) -> int | None:
    """The text vocabulary of a transformers config (a multimodal config's text part), None when it has none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)


def _folder_config(folder: str):
    """The transformers config of a checkpoint folder, None when transformers cannot read it."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except Exception:  # an unknown architecture: the vocabularies are then not compared
        return None


def save_adapter_untouched(
    model: nn.Module, adapter: str, folder: str, *, save_embedding_layers: bool | str = "auto"
) -> None:
    """Save one adapter of a PeftModel like ``save_pretrained`` does, without calling ``state_dict()``.

    ``state_dict()`` on a bitsandbytes ``Linear4bit`` that was repacked for the CPU kernel undoes the
    repacking in place (lossily); reading ``named_parameters()`` leaves the model as it is.

    Args:
        model: the ``PeftModel``.
        adapter: the adapter name.
        folder: where ``adapter_config.json`` and ``adapter_model.safetensors`` go.
        save_embedding_layers: PEFT's option of the same name (``"auto"``: PEFT's rule, which saves the whole
            embedding layers beside a LoRA on them).

    Returns:
        None.

    Raises:
        OSError: the folder cannot be written.
    """
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = dict(model.named_parameters(remove_duplicate=False))  # shared tensors (VeRA) under every name
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    adapter_state = get_peft_model_state_dict(
        model, state_dict=state, adapter_name=adapter, save_embedding_layers=save_embedding_layers
    )
    os.makedirs(folder, exist_ok=True)
    # a copy each (tied aliases apart), contiguous (add_weighted_adapter's "svd" factors are transposed views)
    save_file(
        {k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format) for k, v in adapter_state.items()},
        os.path.join(folder, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    model.peft_config[adapter].save_pretrained(folder)


@dataclass
class ModelPlan:
    """A loaded model's checked merge: its plan and what the report says about the base.

    Attributes:
        plan: the :class:`~peft_shardmerge.engine.plan.Plan` (``live`` set when merged from memory, else a plan
            over the original checkpoint and the adapters saved in a temporary folder kept with it).
        reproduces: what the merge reproduces (the report's ``reproduces``).
        device: where the maths of a merge from the original checkpoint runs.
    """

    plan: Plan
    reproduces: str
    device: str = "cpu"


def plan_model_merge(
    model: nn.Module,
    out_dir: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    base_precision: str = "auto",
    adapter_names: list[str] | None = None,
    weights: list[float] | None = None,
    combination_type: str = "cat",
    density: float | None = None,
    majority_sign_method: str = "total",
    normalize: bool | None = None,
    seed: int = 0,
    overwrite: bool = False,
    options: MergeOptions | None = None,
) -> Plan:
    """Check a loaded model's merge and return what :func:`~peft_shardmerge.api.inprocess.merge_and_save` would write,
    without writing anything or changing the model (the in-process dry run).

    Args:
        model: a ``PeftModel`` (or a transformers model with a LoRA attached by ``add_adapter``).
        out_dir: the output folder to check as ``merge_and_save`` would (None: no folder is checked).
        dtype: output dtype, as for ``merge_and_save``.
        max_shard_size: largest shard (``"5GB"``, ``"500MB"`` or bytes).
        base_precision: ``"auto"``, ``"original"`` or ``"dequantized"`` (see ``merge_and_save``).
        adapter_names: adapters of the model to merge together; None merges the active adapter(s).
        weights: one weight per adapter of ``adapter_names``.
        combination_type: ``"cat"``, ``"linear"``, or a task-vector method (``"ties"``, ``"dare_ties"``,
            ``"dare_linear"``, ``"magnitude_prune"``), as for ``merge_and_save``.
        density: the fraction of each delta a task-vector method keeps.
        majority_sign_method: ``"total"`` or ``"frequency"`` (``ties``, ``dare_ties``).
        normalize: None for the method's default.
        seed: DARE's seed.
        overwrite: whether the merge would replace a non-empty ``out_dir``, as for ``merge_and_save``.
        options: the same knobs (and ``chunk_elems``) as one :class:`~peft_shardmerge.options.MergeOptions`, with
            the precedence rules of :meth:`~peft_shardmerge.options.MergeOptions.merged`.

    Returns:
        A :class:`~peft_shardmerge.engine.plan.Plan`, the type :func:`~peft_shardmerge.api.disk.plan_checkpoint_merge`
        returns: ``describe()`` lists every tensor with its shard, dtype, shape, bytes and operation;
        ``peak_bytes()`` estimates the working memory. Its first notes say which base is merged into.

    Raises:
        InputError: bad options or output folder, all named.
        UnsupportedError: the adapter uses a feature that cannot be merged.

    Example:
        >>> from peft import LoraConfig, get_peft_model
        >>> from transformers import LlamaForCausalLM
        >>> from peft_shardmerge import plan_model_merge
        >>> from peft_shardmerge.testing import tiny_config
        >>> model = get_peft_model(LlamaForCausalLM(tiny_config()), LoraConfig(target_modules=["q_proj", "v_proj"]))
        >>> plan = plan_model_merge(model, dtype="bfloat16", max_shard_size="200KB")
        >>> plan.dtype, len(plan.shard_names), plan.layer_count
        (torch.bfloat16, 5, 4)
        >>> print(plan.describe().splitlines()[5])
        changed layers:  4
    """
    opts, problems = MergeOptions.from_call(locals(), path=MODEL)
    if out_dir is None:
        opts = replace(opts, overwrite=True)
    return build_model_plan(model, out_dir, opts, adapter_names, problems).plan


def build_model_plan(
    model: nn.Module,
    out_dir,
    opts: MergeOptions,
    adapter_names: list[str] | None,
    problems: list[str] | None = None,
    sharded: str | None = None,
) -> ModelPlan:
    """Check every option of a loaded model's merge (all problems named at once) and plan it.

    Args:
        model: the model.
        out_dir: the output folder, or None to check none.
        opts: the options (:meth:`~peft_shardmerge.options.MergeOptions.merged` with path ``"model"``; their
            problems are passed in ``problems``).
        adapter_names: adapters to merge (None: the active ones).
        problems: problems the caller found already (reported with these).
        sharded: the sharding of the model this one was unwrapped from (``"fsdp1"``), when it is not its own.

    Returns:
        The :class:`ModelPlan`.

    Raises:
        InputError: any problem.
    """
    problems = list(problems or [])
    base_precision, weights, combination_type = opts.base_precision, opts.weights, opts.combination
    inner = unwrap(model)
    names, weight_map, selection_problems = adapter_selection(
        model, adapter_names, list(weights) if weights is not None else None, combination_type
    )
    problems = require_supported(model, names, problems + selection_problems)
    adapters = names or selected_adapters(model, None)
    vectors = None
    if not problems and opts.combination in TASK_VECTOR_METHODS:
        vectors = task_vector_method(
            opts.combination, list(weight_map.values()), opts.density, opts.majority_sign, opts.normalize, opts.seed
        )
    original, reason, check = None, "base_precision='dequantized'", OriginalCheck(None)
    if sharded is None and sharding_of(model) is not None:
        sharded = sharding_of(model)
        problems += sharding_problems(model, base_precision)
    if sharded is not None:
        reason = f"the model is sharded by {SHARDINGS[sharded]}: its weights in memory are gathered one unit at a time"
    elif base_precision in ("auto", "original"):
        original, reason, check = _original_checkpoint(model, inner, adapters, weight_map, base_precision)
        if original is None and base_precision == "original":
            problems.append(f"base_precision='original' cannot be used: {reason}; use 'dequantized'")
    if out_dir is not None:
        inputs = {**source_folders(model), **({"base": original} if original else {})}
        problems += check_out_dir(out_dir, inputs=inputs, overwrite=opts.overwrite) + foreign_model_problems(out_dir)
    if problems:  # among them any option value that does not parse: the parsed values are read only past here
        raise InputError(problems)
    out_dtype, dtype_note = opts.out_dtype, ""
    if out_dtype is None:
        out_dtype, dtype_note = default_dtype(inner, model_dtype(inner))
    reproduces, note = describe_base(original, check, is_quantized(inner), reason)
    if original is not None:
        result = _plan_from_original(
            model, inner, original, out_dir, replace(opts, dtype=out_dtype), adapters, weight_map
        )
    else:
        source = LiveInputs(
            walk(model, names),
            names,
            weight_map,
            combination_type,
            vectors,
            generation_config=valid_generation_config(inner),
        )
        order = checkpoint_order(inner)  # a sharded model too: its units are gathered in that order
        result = ModelPlan(plan_live(source, out_dtype, opts.shard_bytes, opts.chunk_elems, order), "")
    result.plan.adapter_text = in_memory_text(adapters, weight_map) + (f" ({vectors.describe()})" if vectors else "")
    result.reproduces = result.plan.reproduces = reproduces
    result.plan.notes[:0] = [f"base precision {base_precision!r}: {note}"] + ([dtype_note] if dtype_note else [])
    return result


def checkpoint_order(inner: nn.Module) -> list[str]:
    """The tensor names of the checkpoint a model was loaded from (``config._name_or_path``: a folder, or the Hub
    cache's snapshot ``refs/main`` points at), in its order (a quantized one's dequantized names), from its headers
    alone; empty when there is none to read.

    Args:
        inner: the transformers model.

    Returns:
        The names, in checkpoint order.

    Example:
        >>> checkpoint_order(nn.Linear(2, 2))
        []
    """
    from ..checkpoint.base_folder import open_checkpoint

    name = str(getattr(getattr(inner, "config", None), "_name_or_path", "") or "")
    for folder in candidate_folders(name)[:1]:
        try:
            return [t.name for t in open_checkpoint(folder, check_files=False).tensors]
        except (ShardMergeError, OSError):  # unreadable or not a checkpoint: the module order stands
            return []
    return []


def _plan_from_original(
    model, inner, original: str, out_dir, opts: MergeOptions, adapters: list[str], weight_map: dict[str, float]
) -> ModelPlan:
    """Plan the merge into the original checkpoint of the adapters saved in a temporary folder kept by the plan.

    The output folder was checked by the caller; only its free space is checked here, once the plan's size is known
    (None: no folder is checked). ``opts.dtype`` is the dtype written, resolved."""
    folder = tempfile.TemporaryDirectory(prefix="peft-shardmerge-live-adapter-")
    folders = []
    # the original holds the very embeddings in memory unless the vocabulary was resized: then PEFT's copies of the
    # embedding layers are only the same weights again (which the disk planner would take as replacements)
    vocab = _vocab_size(getattr(inner, "config", None))
    same_vocab = vocab is not None and vocab == _vocab_size(_folder_config(original))
    for i, adapter in enumerate(adapters):
        folders.append(os.path.join(folder.name, str(i)))
        save_adapter_untouched(model, adapter, folders[-1], save_embedding_layers=False if same_vocab else "auto")
    device = "cuda" if any(p.is_cuda for p in inner.parameters()) else "cpu"
    opts = replace(opts, base_precision="original", weights=[weight_map[a] for a in adapters] if weight_map else None)
    try:
        plan = plan_from_folders(original, folders, opts, out_dir=None if out_dir is None else os.fspath(out_dir))
    except BaseException as e:
        folder.cleanup()
        if isinstance(e, OSError) and not isinstance(e, ShardMergeError):  # reading the inputs failed
            raise FileSystemError(e, NOTHING_WRITTEN) from e
        raise
    for note in plan.notes:
        log.info("%s", note)
    plan.resources.append(folder)  # the adapter files live as long as the plan
    plan.in_memory_adapters = list(adapters)
    return ModelPlan(plan, "", device)
