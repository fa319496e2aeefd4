"""After training, in the same process: merge_and_save and the 4-bit re-quantized save, planned then written."""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn

from ..checkpoint.reader import CheckpointReader
from ..distributed import fsdp1 as fsdp1_view
from ..distributed import zero3 as zero3_view
from ..distributed.coordinators import GatherUnits
from ..distributed.ranks import STEPS
from ..distributed.sharding import SHARDINGS, sharding_of, sharding_problems
from ..distributed.world import JobSteps, current_world
from ..engine.budget import MemoryBudget
from ..engine.pipeline import default_workers
from ..engine.plan import Plan
from ..engine.report import MergeReport
from ..engine.source import Coordinator, Source
from ..errors import InputError
from ..model.planner import LiveInputs
from ..model.reader import ModelReader
from ..model.walk import unwrap
from ..options import MODEL, MergeOptions, parse_dtype
from ..output.out_dir import path_argument, source_folders
from ..output.quant_sink import Encoding, encode_plan
from ..output.record import live_merge_info
from ..quant.encode import Bnb4bit
from ..support.model import require_supported
from .hub import Push, model_names
from .job import MergeJob
from .model_plan import (  # noqa: F401 - public
    BASE_PRECISIONS,
    ModelPlan,
    adapter_selection,
    build_model_plan,
    model_dtype,
    plan_model_merge,
    save_adapter_untouched,
)
from .quiet import quiet_libraries

#: the shardings planned from a view of the model unsharded (FSDP2 shows full shapes as it is)
VIEWS = {"fsdp1": fsdp1_view.planning_view, "zero3": zero3_view.planning_view}


def merge_and_save(
    model: nn.Module,
    out_dir: str,
    *,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    maximum_memory_usage: float = 0.9,
    base_precision: str = "auto",
    adapter_names: list[str] | None = None,
    weights: list[float] | None = None,
    combination_type: str = "cat",
    density: float | None = None,
    majority_sign_method: str = "total",
    normalize: bool | None = None,
    seed: int = 0,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    options: MergeOptions | None = None,
    outtype: str | None = None,
    split_max_size: int | str = 0,
    quantize: str | None = None,
) -> MergeReport:
    """Write base + LoRA of a loaded model (bitsandbytes 4-bit, 8-bit or unquantized base) as a 16-bit checkpoint
    (or, with ``quantize``, in a served quantized format).

    Walks the model one module at a time: each bitsandbytes weight is dequantized, the active adapter's
    delta is added in fp32, the result is cast once and streamed into sharded safetensors. The full 16-bit
    model is never built, and the caller's model is left exactly as it was.

    A model sharded by FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``) or DeepSpeed ZeRO-3 (the engine
    or the PeftModel inside it) is merged collectively: call this on every rank. Each unit (FSDP unit, ZeRO-3
    module) is gathered in turn on every rank and released before the next; rank 0 merges and writes (onto its own
    disk) and every rank returns its report. A model that is not sharded is merged by the process that calls this,
    inside a distributed job too (see ``docs/distributed.md``).

    Args:
        model: a ``PeftModel`` (or a transformers model with a LoRA attached by ``add_adapter``).
        out_dir: the output folder; it appears only when complete.
        tokenizer: saved into ``out_dir`` when given: a tokenizer (or processor) object, or what
            ``AutoTokenizer.from_pretrained`` accepts (a local folder, a Hub id), loaded before anything is written.
        dtype: output dtype (``torch.bfloat16`` or ``"bfloat16"``, ``"float16"``, ``"float32"``); None or ``"auto"``
            writes the base checkpoint's own dtype (its config.json), as a merge from disk does, else the dtype of
            the model's weights (a note says which).
        max_shard_size: largest shard (``"5GB"``, ``"500MB"`` or bytes).
        maximum_memory_usage: fraction (0, 0.95] of the accelerator's memory the process may occupy while
            merging. A module whose working set would go over it is merged on the CPU; on out-of-memory it is
            retried on the CPU and counted in the report. On the CPU, which is the last resort, a module over
            the same fraction of host RAM is merged anyway, with a warning.
        base_precision: ``"auto"`` reproduces the trained model: the weights in memory (dequantized) for a
            quantized model; for an unquantized one the original checkpoint when it holds the same weights, else
            the weights in memory. ``"original"`` merges into the 16-bit checkpoint the model was loaded from
            (``config._name_or_path``: a folder, or any revision of that Hub id in the offline cache), used only
            when a sample of its tensors matches the model in memory; ``"dequantized"`` merges into the weights in
            memory. The report's ``reproduces`` and first note say which, why, and how far the original merge of a
            quantized model is from the trained one.
        adapter_names: adapters of the model to merge together; None merges the active adapter(s).
        weights: one weight per adapter of ``adapter_names`` (default 1.0 each).
        combination_type: ``"cat"`` adds ``sum_i w_i * dW_i`` exactly (any ranks); ``"linear"`` merges the factors
            PEFT's ``add_weighted_adapter(combination_type="linear")`` builds (equal ranks, cross terms included);
            ``"ties"``, ``"dare_ties"``, ``"dare_linear"`` and ``"magnitude_prune"`` combine each tensor's full
            deltas as MergeKit defines these methods (DARE's kept elements divided by ``density``;
            ``docs/variants-several-adapters.md``), the same bytes as
            :func:`~peft_shardmerge.api.disk.merge_checkpoint` with the same parameters.
        density: the fraction of each adapter's delta a task-vector method keeps, in (0, 1] (required by them).
        majority_sign_method: how ``ties``/``dare_ties`` elect each element's sign: ``"total"`` (the sign of the
            weighted sum) or ``"frequency"`` (the sign most adapters have); PEFT's name.
        normalize: divide by the weights of the deltas kept at each element; None: the method's default (on for
            ``ties`` only).
        seed: the seed of DARE's random draw.
        workers: threads that write while the next module is merged (each merged module is copied out block by
            block in the output dtype into reused host buffers, page-locked for a model on a GPU and released when
            the merge ends, then hashed and written there; up to ``workers + 1`` modules, and at most the largest
            tensor's bytes of them, held meanwhile); None: one per CPU, at most 8;
            1: each module merged and written in row blocks by the calling thread, the least memory. The bytes do
            not depend on it.
        overwrite: replace a non-empty ``out_dir`` (after the new output is complete).
        progress: show progress bars.
        options: the same knobs (and ``chunk_elems``) as one :class:`~peft_shardmerge.options.MergeOptions`, the
            object :func:`~peft_shardmerge.api.disk.merge_checkpoint` takes; a keyword left at its default defers to
            it, and a keyword and a field set to different values are refused.
        outtype: the GGUF type where ``out_dir`` ends in ``.gguf`` (one GGUF file for llama.cpp, as its converter
            and quantizer write it; the tokenizer is then required): ``"auto"`` (None; the base's 16-bit type),
            ``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q4_k_m"``, ... (see ``docs/gguf.md``).
        split_max_size: a GGUF output split into files of at most this many bytes of tensors, as llama.cpp's
            converter splits them (``"2G"``); 0 writes one file.
        quantize: write the merged weights in a served format, each quantized once from its float32 merge as the
            format's own tool does (``"fp8-block"``, ``"ct-fp8-block"``, ``"ct-w4a16"``, ``"nf4"``, ``"fp4"``,
            ``"int8"``; ``"base"``: the loaded model's bitsandbytes format; see ``docs/quantized.md``); None writes
            ``dtype``.

    Returns:
        A :class:`~peft_shardmerge.engine.report.MergeReport`; ``base_precision`` says which base was used and
        ``reproduces`` what the result reproduces.

    Raises:
        InputError: bad options, output folder problems, or ``base_precision="original"`` without a local
            original checkpoint (the reason is given).
        UnsupportedError: the adapter uses a feature that cannot be merged (named).
        MergeCheckError: a LoRA layer was not applied exactly once.
        PeerFailedError: (FSDP) another rank failed; its message, and what became of ``out_dir``.

    Example:
        >>> import os, tempfile
        >>> from peft import LoraConfig, get_peft_model
        >>> from transformers import LlamaForCausalLM
        >>> from peft_shardmerge import merge_and_save
        >>> from peft_shardmerge.testing import tiny_config
        >>> model = get_peft_model(LlamaForCausalLM(tiny_config()), LoraConfig(target_modules=["q_proj", "v_proj"]))
        >>> report = merge_and_save(model, os.path.join(tempfile.mkdtemp(), "merged"), progress=False)
        >>> report.lora_modules_merged, report.base_precision, report.dtype
        (4, 'dequantized', 'float32')
    """
    opts, problems = MergeOptions.from_call(locals(), path=MODEL)
    return save_model(model, out_dir, opts, problems, adapter_names=adapter_names, tokenizer=tokenizer)


def save_model(
    model: nn.Module,
    out_dir: str,
    opts: MergeOptions,
    problems: list[str],
    *,
    adapter_names: list[str] | None = None,
    tokenizer: Any = None,
    replace_check: Callable[[str], list[str]] | None = None,
) -> MergeReport:
    """:func:`merge_and_save` with its options parsed (``problems``: theirs, reported with the rest); with
    ``overwrite``, ``replace_check(out_dir)`` names what forbids replacing a non-empty ``out_dir`` (checked again
    under the output lock, as the drop-ins' re-save needs)."""
    with quiet_libraries():
        return ModelJob(model, out_dir, opts, problems, adapter_names, tokenizer, replace_check).run()


class ModelJob(MergeJob):
    """A loaded model's merge (:func:`merge_and_save`, the drop-ins' 16-bit saves) as one
    :class:`~peft_shardmerge.api.job.MergeJob`: planned from the model (a sharded one from a view of it unsharded),
    read from the weights in memory or the original checkpoint, gathered unit by unit on every rank of a sharded
    model.

    Args:
        model: the PeftModel (or the engine or wrapper sharding it).
        out_dir: the output folder.
        opts: the options.
        problems: the options' problems.
        adapter_names: the adapters merged (None: the active ones).
        tokenizer: saved with the model (an object, a folder or a Hub id).
        replace_check: with ``overwrite``, what forbids replacing a non-empty ``out_dir``.
        push: where the merge is pushed on the Hub instead (``out_dir`` None).

    Raises:
        InputError: a wrapper that does not shard the model, or a sharding that cannot be gathered (before anything
            is written).
    """

    def __init__(
        self,
        model: nn.Module,
        out_dir,
        opts: MergeOptions,
        problems: list[str],
        adapter_names: list[str] | None = None,
        tokenizer: Any = None,
        replace_check: Callable[[str], list[str]] | None = None,
        push: Push | None = None,
    ):
        self.budget = None
        try:
            self.budget = MemoryBudget(opts.maximum_memory_usage)
        except InputError as e:  # reported with every other problem
            problems += e.problems
        wrapper, sharding = type(model).__name__, sharding_of(model)
        if wrapper in ("DeepSpeedEngine", "DistributedDataParallel") and sharding is None:
            raise InputError(
                [
                    f"the model is a {wrapper} around the PeftModel, whose weights every rank holds "
                    "whole (it is not sharded): merge its .module from one rank, `if rank == 0: "
                    "merge_and_save(model.module, OUT)`"
                ]
                + problems
            )
        if sharding == "dtensor":  # refused by each rank alone: nothing of it is ever gathered
            raise InputError(sharding_problems(model, opts.base_precision) + problems)
        steps = JobSteps(current_world(), STEPS) if sharding is not None else None
        if out_dir is None and push is None:  # the plan checks an output path; None is none
            problems += path_argument(None, "output folder")[1]
        super().__init__(out_dir, opts, problems, steps, push)
        self.model, self.sharding, self.adapter_names, self.tokenizer = model, sharding, adapter_names, tokenizer
        self.replace_check = replace_check
        self.planned: ModelPlan | None = None
        self.info: dict | None = None

    def inputs(self) -> dict:
        return source_folders(self.model)

    def plan(self) -> Plan:
        """The plan; a model sharded by FSDP1 or ZeRO-3 is planned from a view of it unsharded (FSDP2 shows full
        shapes as it is)."""
        model, view = self.model, VIEWS.get(self.sharding)
        if view is not None:
            self.problems += sharding_problems(model, self.opts.base_precision)
            if self.problems:
                raise InputError(self.problems)
        with view(model) if view is not None else nullcontext(model) as planned_model:
            sharded = self.sharding if view is not None else None
            self.planned = build_model_plan(
                planned_model, self.out_dir, self.opts, self.adapter_names, self.problems, sharded=sharded
            )
            self.info = _record_info(self.planned.plan) if view is not None else None
        return self.planned.plan

    def source(self, plan: Plan) -> Source:
        """The weights in memory (every rank gathering each unit, for a sharded model), or the original checkpoint."""
        steps = self.steps
        workers = self.opts.workers or default_workers(steps.world.local_size if steps is not None else 1)
        if steps is not None:
            return ModelReader(plan, self.budget, self.info, copy=True, workers=workers)
        if isinstance(plan.inputs, LiveInputs):
            return ModelReader(plan, self.budget, workers=workers)
        return CheckpointReader(plan, torch.device(self.planned.device), workers=workers)

    def coordinator(self, plan: Plan) -> Coordinator | None:
        """A sharded model: every rank gathers each unit in plan order; rank 0 writes."""
        return GatherUnits(plan, self.steps, self.model) if self.steps is not None else None

    def before_commit(self) -> Callable[[str], None] | None:
        return _side_saver(self.tokenizer)

    def base_dtype(self, plan: Plan) -> str:
        return str(model_dtype(unwrap(self.model)))

    def saves_beside(self) -> bool:
        return self.tokenizer is not None

    def card_base(self, plan: Plan | None) -> tuple[str | None, object]:
        """The base the model was loaded from (``_name_or_path``) and its first adapter's config."""
        return model_names(self.model)


def _record_info(plan: Plan) -> dict:
    """The record's ``merge`` part, taken while the model is seen unsharded (an FSDP1 model holds no whole parameter
    outside its planning view)."""
    src = plan.inputs
    return live_merge_info(src.live.model, plan.dtype, src.adapter_names, src.weights, src.combination, src.vectors)


def _side_saver(tokenizer: Any) -> Callable[[str], None] | None:
    """What saves ``tokenizer`` into the staging folder: a tokenizer object, or a name or local folder loaded with
    ``AutoTokenizer.from_pretrained`` now, before anything is written."""
    if tokenizer is None:
        return None
    tokenizer = load_tokenizer(tokenizer)

    def save(folder: str) -> None:
        from ..checkpoint.base_folder import TOKENIZER_FILES

        for name in TOKENIZER_FILES:  # no file of the base's tokenizer may outlive the one given
            path = os.path.join(folder, name)
            if os.path.exists(path):
                os.remove(path)
        tokenizer.save_pretrained(folder)

    return save


def load_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer to save beside a merged model: an object with ``save_pretrained`` as is, a name or a folder
    loaded with ``AutoTokenizer.from_pretrained``.

    Args:
        tokenizer: a tokenizer or processor object, a local folder, or a Hub id (offline settings apply).

    Returns:
        An object with ``save_pretrained``.

    Raises:
        InputError: the name cannot be loaded, or the object cannot be saved (named, with what to pass instead).

    Example:
        >>> load_tokenizer(42)
        Traceback (most recent call last):
        ...
        peft_shardmerge.errors.InputError: 1 problem found before writing anything:
          - tokenizer must be a tokenizer object (with save_pretrained), a local folder or a Hub id, got int 42
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(os.fspath(tokenizer))
        except Exception as e:  # any failure to load is the user's to fix, said by name
            why = (str(e).strip().splitlines() or [""])[0]
            raise InputError(
                f"tokenizer {os.fspath(tokenizer)!r} could not be loaded with AutoTokenizer."
                f"from_pretrained ({type(e).__name__}: {why}); pass a tokenizer object, a local folder "
                "holding one, or a Hub id reachable from here"
            ) from e
    if not callable(getattr(tokenizer, "save_pretrained", None)):
        raise InputError(
            f"tokenizer must be a tokenizer object (with save_pretrained), a local folder or a Hub id, "
            f"got {type(tokenizer).__name__} {tokenizer!r}"
        )
    return tokenizer


def save_merged_4bit(
    model: nn.Module,
    out_dir: str,
    *,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    maximum_memory_usage: float = 0.9,
    overwrite: bool = False,
    progress: bool = True,
    replace_check: Callable[[str], list[str]] | None = None,
) -> MergeReport:
    """Merge in fp32 as :func:`merge_and_save` does, and store every weight bitsandbytes quantizes in 4-bit again:
    ``quantize="nf4"`` with the 4-bit settings the model was loaded with (nf4 with double quantization for a model
    loaded unquantized), each weight quantized once from its float32 merge.

    Warns once (``UserWarning``): the result is not the trained model, each weight moves by its 4-bit error.

    Args:
        model: the trained ``PeftModel``.
        out_dir: the output folder.
        tokenizer: saved with the model when given.
        dtype: the compute dtype recorded for the 4-bit layers and the dtype of the other tensors (a 16-bit dtype;
            fp32 becomes bf16).
        max_shard_size: largest shard.
        maximum_memory_usage: fraction (0, 0.95] of accelerator memory the merge may occupy.
        overwrite: replace a non-empty ``out_dir``.
        progress: show progress bars.
        replace_check: as for :func:`save_model`.

    Returns:
        The :class:`MergeReport`; its first note names the 4-bit settings.

    Raises:
        InputError: bad options or output folder, or a sharded model.

    Example:
        >>> import os, tempfile, warnings
        >>> from peft import LoraConfig, get_peft_model
        >>> from transformers import LlamaForCausalLM
        >>> from peft_shardmerge.testing import tiny_config
        >>> model = get_peft_model(LlamaForCausalLM(tiny_config()), LoraConfig(target_modules=["q_proj"]))
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     report = save_merged_4bit(model, os.path.join(tempfile.mkdtemp(), "m4"), progress=False)
        >>> report.notes[0]
        'weights re-quantized to 4-bit (nf4, double quant)'
    """
    import warnings

    inner = unwrap(model)
    problems = require_supported(model)  # every in-process API's first step: a model it cannot take is refused
    if sharding_of(model) is not None:
        problems.append(
            f"the model is sharded by {SHARDINGS[sharding_of(model)]}: save_method='merged_4bit' does not "
            "gather it; merge_and_save (called on every rank) writes the 16-bit merge"
        )
    out_dtype = parse_dtype(dtype) or model_dtype(inner)
    if out_dtype == torch.float32:
        out_dtype = torch.bfloat16
    qc = getattr(inner.config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc or {})
    loaded4 = bool(qc.get("load_in_4bit"))
    encoder = Bnb4bit(
        qc.get("bnb_4bit_quant_type", "nf4") if loaded4 else "nf4",
        bool(qc.get("bnb_4bit_use_double_quant", True)) if loaded4 else True,
    )
    opts = MergeOptions(
        overwrite=overwrite,
        progress=progress,
        dtype=str(out_dtype).removeprefix("torch."),
        max_shard_size=max_shard_size,
        maximum_memory_usage=maximum_memory_usage,
        quantize=encoder.name,
    )
    problems += opts.problems(MODEL)
    if problems:
        raise InputError(problems)
    message = (
        "save_method='merged_4bit' re-quantizes the merged weights to 4-bit: the result is not the model "
        "you trained (each weight moves by its 4-bit quantization error); keep a 'merged_16bit' copy"
    )
    warnings.warn(message, UserWarning, stacklevel=3)
    with quiet_libraries():
        report = Requantized4bitJob(model, out_dir, opts, encoder, tokenizer, replace_check).run()
    kind = "double quant" if encoder.double_quant else "no double quant"
    report.notes.insert(0, f"weights re-quantized to 4-bit ({encoder.quant_type}, {kind})")
    return report


class Requantized4bitJob(ModelJob):
    """``save_method="merged_4bit"``: a loaded model's merge (:class:`ModelJob`) whose weights bitsandbytes
    quantizes are written in its 4-bit format with the settings given.

    Args:
        model: the trained ``PeftModel``.
        out_dir: the output folder.
        opts: the options (``quantize`` names the 4-bit type).
        encoder: the 4-bit settings (:class:`~peft_shardmerge.quant.encode.Bnb4bit`).
        tokenizer: saved with the model when given.
        replace_check: with ``overwrite``, what forbids replacing a non-empty ``out_dir``.
    """

    def __init__(self, model, out_dir, opts: MergeOptions, encoder: Bnb4bit, tokenizer: Any, replace_check):
        super().__init__(model, out_dir, opts, [], tokenizer=tokenizer, replace_check=replace_check)
        self.encoder = encoder

    def encode(self, plan: Plan) -> Encoding:
        """The model's own 4-bit settings, not the named type's defaults."""
        return encode_plan(plan, self.encoder)
