"""The one executor: a plan's tensors from a Source streamed into shards, checked, committed, reported."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from ..errors import InputError
from ..options import DEVICES
from ..output.shard_sink import FolderFiles, ShardSink
from .pipeline import produce_shard, worker_pool
from .plan import Plan
from .report import MergeReport, bar_disabled
from .row_merge import precision_notes
from .rss import PeakRss
from .source import Alone, Coordinator, Source

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


def run(
    plan: Plan,
    source: Source,
    out_dir: str,
    *,
    overwrite: bool,
    progress: bool = True,
    before_commit: Callable[[str], None] | None = None,
    coordinator: Coordinator | None = None,
    replace_check: Callable[[str], list[str]] | None = None,
) -> MergeReport:
    """Carry out a plan: every planned tensor from ``source`` streamed into shards in a staging folder beside
    ``out_dir``, then the index, config, side files and record; checked, then moved into place.

    The one executor of both paths: a checkpoint on disk and a loaded model differ only in their ``source``; a job's
    ranks only in the ``coordinator``'s hooks. ``out_dir`` is replaced only after every file is complete and checked;
    on any failure the staging folder goes and ``out_dir`` is left as it was.

    Args:
        plan: the plan (from :func:`~peft_shardmerge.api.disk.plan_checkpoint_merge` or
            :func:`~peft_shardmerge.api.model_plan.plan_model_merge`).
        source: what produces each planned tensor (:class:`~peft_shardmerge.engine.source.Source`).
        out_dir: the output folder (validated by the caller).
        overwrite: whether a non-empty ``out_dir`` may be replaced (checked again under the output lock).
        progress: show a progress bar over the bytes written.
        before_commit: called with the staging folder after the side files (e.g. to save a tokenizer there).
        coordinator: the job's ranks (default: this process alone).

    Returns:
        The :class:`~peft_shardmerge.engine.report.MergeReport` (on every rank of a job: the leader's).

    Raises:
        MergeCheckError: a change was not applied exactly once, a merged value is not finite, or a written file
            does not match the plan.
        InputError: ``out_dir`` became non-empty meanwhile and ``overwrite`` is False.
        OSError: the filesystem failed (disk full, permissions); nothing is left behind.

    Example:
        >>> import os, tempfile
        >>> from peft_shardmerge import plan_checkpoint_merge
        >>> from peft_shardmerge.checkpoint.reader import CheckpointReader
        >>> from peft_shardmerge.testing import build_adapter, build_base
        >>> tmp = tempfile.mkdtemp()
        >>> base = build_base(os.path.join(tmp, "base"))
        >>> adapter = build_adapter(base, os.path.join(tmp, "adapter"))
        >>> out = os.path.join(tmp, "merged")
        >>> plan = plan_checkpoint_merge(base, adapter, out)
        >>> report = run(plan, CheckpointReader(plan), out, overwrite=False, progress=False)
        >>> report.lora_modules_merged == report.lora_modules_total == 14, sorted(os.listdir(out))[:2]
        (True, ['config.json', 'generation_config.json'])
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    meter = PeakRss().start()
    coordinator = coordinator if coordinator is not None else Alone()
    keys = source.resume_keys()
    sink = ShardSink(
        out_dir,
        plan.shard_entries(),
        overwrite=overwrite,
        fingerprint=keys[0] if keys else None,
        inputs=keys[1] if keys else None,
        io_bytes=plan.shard_io_bytes(),
        replace_check=replace_check,
    )
    bar = tqdm(
        total=plan.total_size,
        unit="B",
        unit_scale=True,
        desc="merging",
        disable=bar_disabled(progress and coordinator.leads),
    )
    coordinator.start(source, bar)

    def produce(i: int, w) -> None:
        produce_shard(
            plan.shard_tensors(i),
            source.prepare,
            w,
            pool,
            ahead=source.ahead,
            held_limit=source.held_limit,
            before=coordinator.before,
            done=bar.update,
        )

    def skip(i: int) -> None:
        kept = plan.shard_tensors(i)
        source.skip(kept)
        bar.update(sum(t.nbytes for t in kept))

    try:
        with worker_pool(source.workers, source.one_torch_thread) as pool:
            if not coordinator.leads:
                return coordinator.follow(out_dir, sink, produce)
            files = FolderFiles(
                config=plan.config,
                index=plan.index(),
                side_files=source.side_files,
                before_commit=before_commit,
                merge_info=source.merge_info,
                checks=[source.check],
            )
            sink.write(produce, files, skip=skip, ranks=coordinator.ranks)
    finally:
        bar.close()
        source.close()
    meter.stop()
    report = _report(plan, source, out_dir, time.perf_counter() - t0, meter, coordinator.notes(), len(sink.resumed))
    log.debug("%s", report.summary())  # the caller prints it (the CLI on stdout, once)
    coordinator.committed(report)
    return report


def _report(
    plan: Plan, source: Source, out_dir: str, wall: float, meter: PeakRss, ranks_notes: list[str], resumed: int
) -> MergeReport:
    """The report of a finished run: the plan's totals, the source's counts and notes, the peak RSS."""
    fields = source.report_fields()
    fields["notes"] = (
        list(fields.get("notes", ()))
        + ([f"resumed: {resumed} shard(s) kept from an interrupted run"] if resumed else [])
        + ranks_notes
    )
    report = MergeReport(
        out_dir=os.path.abspath(out_dir),
        dtype=str(plan.dtype).removeprefix("torch."),
        tensors_written=len(plan.tensors),
        lora_modules_total=plan.layer_count,
        shards=list(plan.shard_names),
        bytes_written=plan.total_size,
        wall_time_s=wall,
        peak_rss_bytes=meter.peak,
        baseline_rss_bytes=meter.baseline,
        peak_rss_method=meter.method,
        cpu_fallbacks=source.fallbacks,
        self_check_max_rel_err=source.probe_err,
        reproduces=plan.reproduces,
        swallowed={k: v[1] / v[0] for k, v in source.swallowed.items()},
        **fields,
    )
    report.notes = list(report.notes) + precision_notes(source.swallowed, plan.dtype)
    return report
