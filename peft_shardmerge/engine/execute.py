"""Carrying out a plan: read each tensor in row blocks, merge in fp32, stream into shards, check, commit."""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Callable

import torch

from ..checkpoint.reader import PlanMerger, check_counts
from ..distributed.ranks import OtherRanks, check_stop, write_share
from ..distributed.world import JobSteps, World
from ..errors import InputError
from ..options import DEVICES
from ..output.record import disk_merge_info
from ..output.resume import InputDigests
from ..output.shard_sink import FolderFiles, ShardSink
from ..output.side_files import copy_side_files
from .plan import Plan, PlannedTensor
from .report import MergeReport
from .row_merge import precision_notes
from .rss import PeakRss, current_rss_bytes  # noqa: F401 - bench/ reads current_rss_bytes from here

log = logging.getLogger(__name__)



def resolve_device(device: str | torch.device) -> torch.device:
    """Turn ``"auto"``, ``"cpu"`` or ``"cuda"`` (``"cuda:N"``) into the device the merge maths runs on.

    Args:
        device: the requested device; a ``torch.device`` is returned as is.

    Returns:
        ``cuda`` when asked for (or ``auto`` and available), else ``cpu``.

    Raises:
        InputError: unknown device, or CUDA asked for but not available.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" or str(device).startswith("cuda:"):
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r} was asked for but CUDA is not available; use device='cpu' or 'auto'")
        return torch.device(device)
    raise InputError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")


def execute_plan(plan: Plan, out_dir: str, *, device: str | torch.device = "auto",
                 progress: bool = True, before_commit: Callable[[str], None] | None = None,
                 resume: bool = True, overwrite: bool, steps: JobSteps | None = None) -> MergeReport:
    """Write the planned checkpoint into a temporary folder beside ``out_dir``, check it, then move it into place.

    ``out_dir`` is replaced only after every file is complete and checked; on any failure the temporary
    folder is removed and ``out_dir`` is left as it was.

    Args:
        plan: the plan from :func:`~peft_shardmerge.checkpoint.planner.build_plan`.
        out_dir: the output folder (validated by the caller).
        device: where the merge maths runs: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        progress: show a progress bar over bytes written.
        before_commit: called with the temporary folder once the weights are written, before the checks and
            the move into place (e.g. to save a tokenizer there).
        resume: keep the verified finished shards of an earlier run of the same merge that was killed.
        overwrite: whether a non-empty ``out_dir`` may be replaced (checked again under the output lock).
        steps: in a distributed job (:mod:`peft_shardmerge.distributed.world`), the steps left after ``plan``: the
            shards are split over the ranks, rank 0 commits, and every rank returns rank 0's report.

    Returns:
        The :class:`MergeReport`.

    Raises:
        MergeCheckError: a LoRA module was not applied exactly once, a merged value is not finite, or a
            written file does not match the plan.
        InputError: the device is not available.
        OSError: the filesystem failed (disk full, permissions); nothing is left behind.

    Example:
        >>> report = execute_plan(plan, "merged", overwrite=False)   # doctest: +SKIP
    """
    t0 = time.perf_counter()
    meter = PeakRss().start()
    world = steps.world if steps is not None else World()
    dev = world.device(resolve_device(device))
    merger = PlanMerger(plan, dev, progress and world.rank == 0)
    ranks = OtherRanks(plan, merger, steps) if world.distributed and world.rank == 0 else None
    sink = ShardSink(out_dir, plan.shard_entries(), overwrite=overwrite,
                     fingerprint=plan.fingerprint() if resume else None,
                     inputs=InputDigests(plan) if resume else None)

    def produce(i: int, w) -> None:
        for t in plan.shard_tensors(i):
            if steps is not None:
                check_stop(steps)
            if ranks is not None:
                ranks.poll()
            merger.write_tensor(t, w)

    if world.rank != 0:
        try:
            return write_share(plan, out_dir, steps, sink, produce, merger)
        finally:
            merger.close()

    files = FolderFiles(config=plan.config, index=plan.index(), side_files=lambda tmp: _copy_side_files(plan, tmp),
                        before_commit=before_commit, merge_info=lambda: disk_merge_info(plan),
                        checks=[lambda: check_counts(plan, merger)])
    try:
        sink.write(produce, files, skip=lambda i: merger.skip(plan.shard_tensors(i)), ranks=ranks)
    finally:
        merger.close()
    resumed = sink.resumed
    out_dir = os.path.abspath(out_dir)
    report = merge_report(
        plan, merger, out_dir, t0, meter,
        base=plan.base.folder,
        adapter=(plan.adapter_text or ", ".join(plan.adapter.folders))
        + (f" ({plan.adapter.combination})" if plan.adapter.combination else ""),
        base_precision=plan.base_precision,
        lora_modules_merged=len({k.split("@")[0] for k in merger.applied
                                 if not k.endswith((".bias", "::bias")) and not k.startswith("tokens:")}),
        replacements_applied=merger.replacements,
        device=str(dev),
        untied=list(plan.untied),
        notes=list(plan.notes) + ([f"resumed: {len(resumed)} shard(s) kept from an interrupted run"]
                                  if resumed else [])
        + ([f"spread over {world.size} ranks; the peak memory above is rank 0's"] if world.distributed else []),
        reproduces=plan.reproduces,
    )
    log.debug("%s", report.summary())  # the caller prints it (the CLI on stdout, once)
    if steps is not None:
        steps.step("committed", report)
    return report


def stream_tensors(plan: Plan, sink, tensors: list[PlannedTensor] | None = None, *,
                   device: str | torch.device = "cpu") -> None:
    """Produce planned tensors with the very code :func:`execute_plan` writes them with, into ``sink`` instead of a
    shard (``peft-shardmerge verify`` compares them with a merged checkpoint this way).

    Args:
        plan: the plan.
        sink: an object with ``begin(t)`` (called before each tensor's bytes), ``write(tensor)`` and
            ``copy_from(fd, offset, nbytes)`` (the calls a :class:`~peft_shardmerge.output.writer.ShardWriter`
            receives).
        tensors: the planned tensors to produce (default: all, in write order).
        device: where the maths runs.

    Returns:
        None.

    Raises:
        MergeCheckError: a merged value is not finite or the self-check fails.

    Example:
        >>> stream_tensors(plan, sink)   # doctest: +SKIP
    """
    merger = PlanMerger(plan, resolve_device(device), False)
    try:
        with torch.no_grad():
            for t in plan.tensors if tensors is None else tensors:
                sink.begin(t)
                merger.write_tensor(t, sink)
    finally:
        merger.close()


def _copy_side_files(plan: Plan, tmp: str) -> None:
    """Carry every non-weight file of the base into the output (tokenizer, sentence-transformers pipeline, README,
    ...), then the adapter's tokenizer files, which replace the base's tokenizer as a whole."""
    from ..checkpoint.source import TOKENIZER_FILES

    skip = TOKENIZER_FILES if plan.adapter.tokenizer_files else ()
    written = set(plan.shard_names) | {"model.safetensors.index.json"}
    copy_side_files(plan.base.folder, tmp, [n for n in plan.base.extra_files if n not in written], skip=skip)
    for fname in plan.adapter.tokenizer_files:
        shutil.copyfile(os.path.join(plan.adapter.folder, fname), os.path.join(tmp, fname))





def merge_report(plan: Plan, merger, out_dir: str, started: float, meter: PeakRss, **fields) -> MergeReport:
    """The report of a finished merge on either path: what the plan wrote and what the merger counted.

    Args:
        plan: the plan that was carried out.
        merger: its per-tensor merger (``fallbacks``, ``probe_err``, ``swallowed``).
        out_dir: the output folder.
        started: ``time.perf_counter()`` when the merge started.
        meter: the measure of the merge's peak resident memory, started when the merge started (stopped here).
        **fields: the path's own :class:`MergeReport` fields (base, adapter, counts, device, notes, ...).

    Returns:
        The :class:`MergeReport`; the note on the update lost to rounding follows the path's notes.

    Example:
        >>> report = merge_report(plan, merger, "merged", t0, meter, base="b", adapter="a")   # doctest: +SKIP
    """
    meter.stop()
    report = MergeReport(
        out_dir=os.path.abspath(out_dir), dtype=str(plan.dtype).removeprefix("torch."),
        tensors_written=len(plan.tensors), lora_modules_total=plan.layer_count, shards=list(plan.shard_names),
        bytes_written=plan.total_size, wall_time_s=time.perf_counter() - started, peak_rss_bytes=meter.peak,
        baseline_rss_bytes=meter.baseline, peak_rss_method=meter.method, cpu_fallbacks=merger.fallbacks,
        self_check_max_rel_err=merger.probe_err,
        swallowed={k: v[1] / v[0] for k, v in merger.swallowed.items()}, **fields)
    report.notes = list(report.notes) + precision_notes(merger.swallowed, plan.dtype)
    return report

