"""Carrying out a loaded model's plan: each tensor produced by the in-process merger and streamed into shards."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ..checkpoint.source import copy_base_side_files
from ..distributed.ranks import LiveRanks, follow_plan
from ..distributed.sharding import UnitGatherer
from ..errors import MergeCheckError
from ..io.safetensors_io import DTYPES, row_blocks
from ..model.reader import LiveMerger
from ..output.record import live_merge_info
from ..output.shard_sink import FolderFiles, ShardSink
from ..output.writer import ShardWriter
from ..quant.nf4 import pad_quant_state, quant_state_length, require_bitsandbytes
from .budget import MemoryBudget
from .execute import merge_report
from .plan import Plan, PlannedTensor
from .report import MergeReport
from .row_merge import check_applied
from .rss import PeakRss

log = logging.getLogger(__name__)

REPACKED_NOTE = (
    "{} 4-bit weight(s) had been repacked by bitsandbytes for its CPU kernel (an eval forward on a CPU with "
    "AVX512-BF16): 4-bit codes exact, block scales rounded to bf16 by the repacking (and re-quantized where "
    "bitsandbytes undid it in place, e.g. at a save_pretrained), so the trained model's exact 4-bit base could not be "
    "read back bit for bit; those tensors are merged within that loss, and `verify` reports them UNCHECKED, not "
    "equal. Re-quantizing the original 16-bit weights gives the very 4-bit bytes the model was loaded with: load "
    "it again with module.support_avx512bf16_for_cpu = False set on every Linear4bit after loading, load the "
    "adapter, and merge"
)


def execute_live_plan(plan: Plan, out_dir: str, *, budget: MemoryBudget, overwrite: bool, progress: bool = True,
                      before_commit: Callable[[str], None] | None = None, steps=None, root=None,
                      merge_info: dict | None = None) -> MergeReport:
    """Write a loaded model's planned checkpoint (from :func:`~peft_shardmerge.model.planner.plan_live`) into
    ``out_dir``.

    Args:
        plan: the plan, with ``live`` set.
        out_dir: the output folder (validated by the caller).
        budget: the memory budget of the merge.
        overwrite: whether a non-empty ``out_dir`` may be replaced (checked again under the output lock).
        progress: show a progress bar over bytes written.
        before_commit: called with the staging folder after the side files (e.g. to save a tokenizer there).
        steps: for a model sharded by FSDP in a distributed job, the job's steps after ``plan``
            (:class:`~peft_shardmerge.distributed.world.JobSteps`): every rank gathers each unit in plan order, rank 0
            writes, and every rank returns rank 0's report.
        root: with ``steps``, the model as sharded (the outermost FSDP unit; default: the walked model).
        merge_info: the record's ``merge`` part when the caller took it already (an FSDP1 model holds no whole
            parameter outside its planning view); default: taken from the model when the output is complete.

    Returns:
        The :class:`~peft_shardmerge.engine.report.MergeReport`.

    Raises:
        MergeCheckError: a LoRA layer was not applied exactly once, a merged value is not finite, or a written
            tensor differs from the plan.
        InputError: ``out_dir`` became non-empty meanwhile and ``overwrite`` is False.

    Example:
        >>> report = execute_live_plan(plan, "merged", budget=MemoryBudget(0.9), overwrite=False)   # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    meter = PeakRss().start()
    src = plan.live
    live = src.live
    gatherer = ranks = None
    if steps is not None:
        order = [t for i in range(len(plan.shard_names)) for t in plan.shard_tensors(i)]  # the write order
        gatherer = UnitGatherer(root if root is not None else live.model, order)
        if steps.world.rank != 0:
            return follow_plan(plan, out_dir, steps, gatherer)
        ranks = LiveRanks(steps, gatherer)
    merger = LiveMerger(live, budget, plan.dtype, src.weights, src.combination, plan.chunk_elems)
    sink = ShardSink(out_dir, plan.shard_entries(), overwrite=overwrite, depth=1)
    bar = tqdm(total=plan.total_size, unit="B", unit_scale=True, desc="merging", disable=not progress)

    def produce(i: int, w: ShardWriter) -> None:
        parts: dict[str, torch.Tensor] = {}
        for t in plan.shard_tensors(i):
            if gatherer is not None:
                gatherer.before(t)
            if t.kind == "quantize4" and not t.part:
                parts = _quantize(merger, t, plan)
            _write(merger, t, w, parts, plan.chunk_elems, copy=gatherer is not None)
            bar.update(t.nbytes)

    def side_files(tmp: str) -> None:
        copy_base_side_files(getattr(live.model.config, "_name_or_path", "") or "", tmp)  # tokenizer, pipeline, ...
        if src.generation_config is not None:
            src.generation_config.save_pretrained(tmp)

    files = FolderFiles(config=plan.config, index=plan.index(), side_files=side_files, before_commit=before_commit,
                        merge_info=lambda: _with_repacked(merge_info or live_merge_info(
                            live.model, plan.dtype, src.adapter_names, src.quant4, src.weights, src.combination),
                            merger.repacked),
                        checks=[lambda: check_applied(live.lora_layers, merger.applied)])
    try:
        sink.write(produce, files, ranks=ranks)
    finally:
        bar.close()
    report = _report(plan, merger, out_dir, t0, meter)
    if steps is not None:
        if getattr(gatherer.units, "masters", None):
            report.notes.append(f"{len(gatherer.units.masters)} trainable tensor(s) read from DeepSpeed's fp32 master "
                                "weights (the model holds 16-bit copies of them)")
        report.notes.append(f"gathered from {steps.world.size} ranks one {gatherer.units.label} at a time (at most "
                            f"{gatherer.peak_numel:,} elements at once); the peak memory above is rank 0's")
        steps.step("committed", report)
    return report


def _with_repacked(info: dict, repacked: list[str]) -> dict:
    """The record's ``merge`` part naming the weights read from bitsandbytes' lossy CPU repacking (``verify`` then
    knows which tensors cannot equal a recomputation from the original base byte for byte)."""
    return {**info, "cpu_repacked": sorted(repacked)} if repacked else info


def _write(merger: LiveMerger, t: PlannedTensor, w: ShardWriter, parts: dict[str, torch.Tensor],
           plan_chunk: int, copy: bool = False) -> None:
    """Write one planned tensor: a part of a re-quantized weight, or an entry produced and cast in row blocks (with
    ``copy``, always copies: a gathered FSDP unit's storage must be free of the writer's views when it is
    released)."""
    e = t.entry
    if t.kind == "quantize4":
        data = parts[t.part]
        if tuple(data.shape) != tuple(t.shape) or DTYPES[t.out_dtype][0] != data.dtype:
            raise MergeCheckError(f"{t.name}: quantized to {list(data.shape)} {data.dtype}, planned "
                                  f"{list(t.shape)} {t.out_dtype}")
        w.write(data)
        return
    data = merger.produce(e)
    if tuple(data.shape) != e.shape:
        raise MergeCheckError(f"{e.name}: produced shape {list(data.shape)}, expected {list(e.shape)}")
    if e.kind != "plain" and not e.adapters and data.is_floating_point() and not torch.isfinite(data.sum()):
        raise MergeCheckError(f"tensor {e.name!r} has NaN or Inf")  # the row merge checked every changed one
    target = DTYPES[t.out_dtype][0]
    for start, stop in row_blocks(e.shape, plan_chunk):
        w.write(data[start:stop].detach().to(device="cpu", dtype=target, copy=copy))


def _quantize(merger: LiveMerger, t: PlannedTensor, plan: Plan) -> dict[str, torch.Tensor]:
    """The merged weight quantized with bitsandbytes as transformers stores it, by key suffix (``""``: the codes),
    on the CPU; the quant-state JSON padded to its planned length."""
    F = require_bitsandbytes()
    e, settings = t.entry, plan.live.settings
    w = merger.produce(e)
    if e.transpose_out or e.name in merger.live.info.transposed:  # bitsandbytes holds Conv1D as [out, in]
        w = w.T
    q, state = F.quantize_4bit(w.to(device="cpu", dtype=plan.dtype).contiguous(), blocksize=settings.blocksize,
                               compress_statistics=settings.double_quant, quant_type=settings.quant_type,
                               quant_storage=torch.uint8)
    parts = {"": q.cpu()}
    for key, value in state.as_dict(packed=True).items():
        parts[key] = value.cpu()
    key = f"quant_state.bitsandbytes__{settings.quant_type}"
    parts[key] = pad_quant_state(parts[key], quant_state_length(tuple(w.shape), plan.dtype, settings))
    return parts


def _report(plan: Plan, merger: LiveMerger, out_dir: str, t0: float, meter: PeakRss) -> MergeReport:
    live = plan.live.live
    notes = list(plan.notes) + ([REPACKED_NOTE.format(len(merger.repacked))] if merger.repacked else [])
    report = merge_report(
        plan, merger, out_dir, t0, meter,
        base=plan.origin,
        adapter="(in memory)",
        base_precision="dequantized",
        lora_modules_merged=sum(not k.startswith("tokens:") for k in merger.applied),
        replacements_applied=sum(1 for e in live.entries if e.kind == "saved"),
        device=str(next((p.device for p in live.model.parameters()), "cpu")),
        untied=list(live.untied),
        notes=notes,
    )
    log.info("%s", report.summary())
    return report
