"""The one executor: a plan's tensors from a Source streamed into a Sink, checked, committed, reported."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from ..errors import InputError
from ..options import DEVICES
from .pipeline import produce_shard, worker_pool
from .plan import Plan
from .report import MergeReport, bar_disabled
from .row_merge import precision_notes
from .rss import PeakRss
from .sink import Finish, Layout, Sink
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
    sink: Sink,
    *,
    progress: bool = True,
    before_commit: Callable[[str], None] | None = None,
    coordinator: Coordinator | None = None,
) -> MergeReport:
    """Carry out a plan: every planned tensor from ``source`` streamed into ``sink``, part by part, then what the
    output holds besides; checked, then committed.

    The one executor of every merge: a checkpoint on disk and a loaded model differ only in their ``source``, a
    folder on disk and verify's comparison only in their ``sink``, a job's ranks only in the ``coordinator``'s hooks.
    The sink commits only once every part is written and checked; on any failure it is left as it was.

    Args:
        plan: the plan (from :func:`~peft_shardmerge.api.disk.plan_checkpoint_merge` or
            :func:`~peft_shardmerge.api.model_plan.plan_model_merge`).
        source: what produces each planned tensor (:class:`~peft_shardmerge.engine.source.Source`).
        sink: where the tensors go (:class:`~peft_shardmerge.engine.sink.Sink`).
        progress: show a progress bar over the bytes written.
        before_commit: called with the folder being written after the side files (e.g. to save a tokenizer there).
        coordinator: the job's ranks (default: this process alone).

    Returns:
        The :class:`~peft_shardmerge.engine.report.MergeReport` (on every rank of a job: the leader's).

    Raises:
        MergeCheckError: a change was not applied exactly once, a merged value is not finite, or a written file
            does not match the plan.
        InputError: the sink's destination became non-empty meanwhile and may not be replaced.
        OSError: the filesystem failed (disk full, permissions); nothing is left behind.

    Example:
        >>> import os, tempfile
        >>> from peft_shardmerge import plan_checkpoint_merge
        >>> from peft_shardmerge.checkpoint.reader import CheckpointReader
        >>> from peft_shardmerge.output.shard_sink import FolderSink
        >>> from peft_shardmerge.testing import build_adapter, build_base
        >>> tmp = tempfile.mkdtemp()
        >>> base = build_base(os.path.join(tmp, "base"))
        >>> adapter = build_adapter(base, os.path.join(tmp, "adapter"))
        >>> out = os.path.join(tmp, "merged")
        >>> plan = plan_checkpoint_merge(base, adapter, out)
        >>> report = run(plan, CheckpointReader(plan), FolderSink(out, overwrite=False), progress=False)
        >>> report.lora_modules_merged == report.lora_modules_total == 14, sorted(os.listdir(out))[:2]
        (True, ['config.json', 'generation_config.json'])
    """
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    meter = PeakRss().start()
    coordinator = coordinator if coordinator is not None else Alone()
    fingerprint, inputs = source.resume_keys() or (None, None)
    layout = Layout(plan.shard_entries(), plan.shard_io_bytes(), fingerprint, inputs)
    bar = tqdm(
        total=plan.total_size,
        unit="B",
        unit_scale=True,
        desc=sink.label,
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

    try:
        with worker_pool(source.workers, source.one_torch_thread) as pool, torch.no_grad():
            if not coordinator.leads:
                return coordinator.follow(sink, layout, produce)
            with sink.open(layout) as out:
                kept, sizes = sorted(out.done), plan.shard_sizes()
                for i in kept:  # parts an interrupted run finished: their changes count as applied
                    source.skip(plan.shard_tensors(i))
                    bar.update(sizes[i])
                skipped = set(kept) | coordinator.opened(out)  # kept, or written by the other ranks
                try:
                    out.write([i for i in range(len(layout.parts)) if i not in skipped], produce)
                except BaseException as e:
                    coordinator.stopped(e)  # the other ranks stop first: nobody writes into the output as it goes
                    raise
                coordinator.gathered(out)
                out.finish(
                    Finish(
                        config=plan.config,
                        index=plan.index(),
                        side_files=source.side_files,
                        before_commit=before_commit,
                        merge_info=source.merge_info,
                        checks=[source.check],
                    )
                )
    finally:
        bar.close()
        source.close()
    meter.stop()
    report = _report(plan, source, sink.location, time.perf_counter() - t0, meter, coordinator.notes(), len(kept))
    log.debug("%s", report.summary())  # the caller prints it (the CLI on stdout, once)
    coordinator.committed(report)
    return report


def _report(
    plan: Plan, source: Source, out_dir: str, wall: float, meter: PeakRss, ranks_notes: list[str], resumed: int
) -> MergeReport:
    """The report of a finished run: the plan's totals, the source's counts and notes, the peak RSS."""
    fields, counts = source.report_fields(), source.counts
    fields["notes"] = (
        list(fields.get("notes", ()))
        + ([f"resumed: {resumed} shard(s) kept from an interrupted run"] if resumed else [])
        + ranks_notes
    )
    report = MergeReport(
        out_dir=out_dir if "://" in out_dir else os.path.abspath(out_dir),  # hf://user/name: a repository
        dtype=str(plan.dtype).removeprefix("torch."),
        tensors_written=len(plan.tensors),
        lora_modules_total=plan.layer_count,
        shards=list(plan.shard_names),
        bytes_written=plan.total_size,
        wall_time_s=wall,
        peak_rss_bytes=meter.peak,
        baseline_rss_bytes=meter.baseline,
        peak_rss_method=meter.method,
        cpu_fallbacks=counts.fallbacks,
        self_check_max_rel_err=counts.probe_err,
        reproduces=plan.reproduces,
        swallowed={k: v[1] / v[0] for k, v in counts.swallowed.items()},
        **fields,
    )
    report.notes = list(report.notes) + precision_notes(counts.swallowed, plan.dtype)
    return report
