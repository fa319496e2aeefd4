"""What the one executor runs a plan with: the Source of the planned tensors, and the Coordinator of a job's ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: the executor never imports an implementation
    from .plan import PlannedTensor
    from .report import MergeReport
    from .row_merge import MergeCounts
    from .sink import Layout, Opened, Sink

__all__ = ["Alone", "Coordinator", "Source"]


@runtime_checkable
class Source(Protocol):
    """Where the planned tensors' bytes come from. Two implementations: a checkpoint on disk read in row blocks
    (:class:`~peft_shardmerge.checkpoint.reader.CheckpointReader`) and a loaded model read module by module
    (:class:`~peft_shardmerge.model.reader.ModelReader`). Both hold a
    :class:`~peft_shardmerge.engine.row_merge.RowMerger` every merged tensor goes through, and say what it counted
    (:class:`~peft_shardmerge.engine.row_merge.MergeCounts`); everything else a merge does (parts, progress, the
    sink, checks, commit, the report, the ranks) is the executor's, the same for both.

    Attributes:
        counts: what its merger counted (changes applied, CPU fallbacks, the self-check's largest error, the updates
            the output dtype rounded away), for the count check and the report.
        workers: tensors it may have in flight at once, each written (and, from disk, produced) on its own thread
            (1: one after the other, on the executor's thread).
        ahead: tensors prepared and not yet written, at most (what the memory held in flight is counted in).
        held_limit: where a prepared tensor holds its whole bytes until written, their planned bytes at most (None:
            a tensor in flight holds a row block).
        one_torch_thread: whether torch is held to one intra-op thread while the workers run (they run torch ops
            each: a merge from disk); False where they only copy out, hash and write what was prepared.
    """

    counts: MergeCounts
    workers: int
    ahead: int
    held_limit: int | None
    one_torch_thread: bool

    def prepare(self, t: PlannedTensor) -> Callable[[object], None]:
        """Called on the executor's thread, in plan order: the part of ``t``'s work that must follow the plan (a loaded
        model's module read and merged within the memory budget, a job's gathers), and returns what writes the rest
        of ``t``'s bytes into a sink (``write(tensor)``, ``copy_from(fd, offset, nbytes)``), called on a worker."""
        ...  # pragma: no cover - a protocol

    def skip(self, tensors: list[PlannedTensor]) -> None:
        """Count the changes of tensors kept from an interrupted run, as if written."""
        ...  # pragma: no cover - a protocol

    def resume_keys(self) -> tuple[str, object] | None:
        """``(fingerprint, input digests)`` when finished shards of a killed run may be kept, else None."""
        ...  # pragma: no cover - a protocol

    def side_files(self, folder: str) -> None:
        """Write the files the output holds besides weights, config and index (tokenizer, generation config...)."""
        ...  # pragma: no cover - a protocol

    def merge_info(self) -> dict:
        """The ``merge`` part of the output's ``merge_manifest.json``."""
        ...  # pragma: no cover - a protocol

    def check(self) -> None:
        """Raise :class:`~peft_shardmerge.errors.MergeCheckError` unless every change was applied exactly once."""
        ...  # pragma: no cover - a protocol

    def report_fields(self) -> dict:
        """The source's own :class:`~peft_shardmerge.engine.report.MergeReport` fields (base, adapter, counts,
        device, notes...)."""
        ...  # pragma: no cover - a protocol

    def close(self) -> None:
        """Release the files and bars the source holds."""
        ...  # pragma: no cover - a protocol


class Coordinator(Protocol):
    """The ranks of a job the executor runs in: hooks it calls, never branches of its own. One process is
    :class:`Alone`; a merge from disk spread over ranks and a sharded model gathered unit by unit are in
    :mod:`peft_shardmerge.distributed.coordinators`.

    Attributes:
        leads: this process opens the sink, writes what the output holds besides the tensors, and commits (rank 0).
    """

    leads: bool

    def start(self, source: Source, progress) -> None:
        """Called once before the first tensor, with the source and the progress bar."""
        ...  # pragma: no cover - a protocol

    def before(self, t: PlannedTensor) -> None:
        """Called before each tensor this process writes."""
        ...  # pragma: no cover - a protocol

    def opened(self, out: Opened) -> set[int]:
        """On the leader, once the sink is open: the parts the other ranks write (this process writes the rest of
        those not :attr:`~peft_shardmerge.engine.sink.Opened.done`)."""
        ...  # pragma: no cover - a protocol

    def stopped(self, error: BaseException) -> None:
        """On the leader, when writing its parts failed: make the other ranks stop, before the output goes."""
        ...  # pragma: no cover - a protocol

    def gathered(self, out: Opened) -> None:
        """On the leader, after its parts: wait for the other ranks' and hand them to ``out``
        (:meth:`~peft_shardmerge.engine.sink.Opened.adopt`)."""
        ...  # pragma: no cover - a protocol

    def follow(self, sink: Sink, layout: Layout, produce: Callable) -> MergeReport:
        """On a rank that does not lead: take this rank's part, then return the leader's report."""
        ...  # pragma: no cover - a protocol

    def notes(self) -> list[str]:
        """What the report says of the ranks."""
        ...  # pragma: no cover - a protocol

    def committed(self, report: MergeReport) -> None:
        """Called on the leader once the output is in place (hands the report to the others)."""
        ...  # pragma: no cover - a protocol


class Alone:
    """The coordinator of a merge run by one process: every hook does nothing.

    Example:
        >>> Alone().leads, Alone().notes()
        (True, [])
    """

    leads = True

    def start(self, source: Source, progress) -> None:
        pass

    def before(self, t: PlannedTensor) -> None:
        pass

    def opened(self, out: Opened) -> set[int]:
        return set()

    def stopped(self, error: BaseException) -> None:
        pass

    def gathered(self, out: Opened) -> None:
        pass

    def follow(self, sink: Sink, layout: Layout, produce: Callable) -> MergeReport:
        raise AssertionError("a single process leads")  # pragma: no cover - never called: leads is True

    def notes(self) -> list[str]:
        return []

    def committed(self, report: MergeReport) -> None:
        pass
