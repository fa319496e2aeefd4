"""The ranks of a torch.distributed merge: from disk, every rank writes its share of the output's parts into the output
rank 0 opened, which writes the rest and commits; a sharded model is gathered by all and written by rank 0."""

from __future__ import annotations

import logging
import os
import time

from ..engine.plan import Plan
from ..errors import FileSystemError, InputError, PeerFailedError, PeerLostError, ShardMergeError, Stopped
from ..output.staging import note_outcome, outcome
from .world import JobSteps, World, assign_shards  # noqa: F401 - World: doctest

log = logging.getLogger(__name__)

#: the steps of a merge from disk, taken by every rank together
STEPS = ("plan", "open", "written", "committed")
#: what a rank other than 0 can say of OUT before rank 0 tells it
UNKNOWN = "rank 0 decides what becomes of OUT and did not say (see its message)"


def agree_on_plan(steps: JobSteps, plan: Plan, out_dir: str) -> None:
    """Take the ``plan`` step: every rank must have planned the very same merge into the same folder.

    Args:
        steps: the job's steps.
        plan: this rank's plan.
        out_dir: the output folder this rank was given.

    Returns:
        None.

    Raises:
        InputError: the ranks planned different merges (they see different files or were given different options).
        PeerFailedError: another rank could not plan.
    """
    if not steps.world.distributed:
        return
    prints = steps.step("plan", (plan.fingerprint(), os.path.abspath(os.fspath(out_dir))))
    if len(set(prints)) > 1:
        odd = [r for r, p in enumerate(prints) if p != prints[0]]
        raise InputError(
            f"rank(s) {odd} planned a different merge than rank 0: every rank must be given the same "
            "BASE, ADAPTER, OUT and options and see the same files (a filesystem shared by every node)"
        )


#: the file a failing rank leaves in the staging folder, so that the others stop at their next tensor
STOP_FILE = "stop"


def check_stop(steps: JobSteps) -> None:
    """Between two tensors: stop when another rank has failed (it left :data:`STOP_FILE` in the staging folder).

    Args:
        steps: the job's steps (``staging`` is set once the staging folder is known).

    Returns:
        None, when no rank has failed.

    Raises:
        Stopped: another rank failed; its message comes with the next step.

    Example:
        >>> check_stop(JobSteps(World(), STEPS))
    """
    if steps.staging is not None and os.path.exists(os.path.join(steps.staging, STOP_FILE)):
        raise Stopped()


def _leave_stop(steps: JobSteps) -> None:
    if steps.staging is not None:
        try:
            with open(os.path.join(steps.staging, STOP_FILE), "x"):
                pass
        except OSError:  # already there, or the folder is gone: nobody is writing into it
            pass


class OtherRanks:
    """Rank 0's side of a distributed merge from disk, for the executor's hooks: it says which parts the other ranks
    write, then takes over what they wrote.

    Args:
        plan: the plan every rank agreed on.
        source: rank 0's source (the other ranks' counts are added to its own, for the count check and the report).
        steps: the job's steps.
        bar: rank 0's progress bar (it shows the other ranks' bytes too).
    """

    def __init__(self, plan: Plan, source, steps: JobSteps, bar):
        self.plan, self.source, self.steps, self.bar = plan, source, steps, bar
        self.out = None
        self.theirs: list[tuple[int, int]] = []  # (part, planned bytes) of the parts the other ranks write
        self.seen, self.polled = 0, 0.0

    def opened(self, out) -> set[int]:
        """Tell every rank where the output is and which parts an earlier run finished.

        Args:
            out: the opened output (:class:`~peft_shardmerge.engine.sink.Opened`).

        Returns:
            The parts the other ranks write.
        """
        handle = out.handle()
        self.steps.step("open", handle)
        self.steps.staging = handle["path"]
        self.out = out
        share = _share(self.plan, handle["done"], self.steps)
        sizes = self.plan.shard_sizes()
        self.theirs = [(i, sizes[i]) for other in share[1:] for i in other]
        return {i for i, _ in self.theirs}

    def poll(self) -> None:
        """Between two of rank 0's tensors, at most once a second: add the bytes the other ranks have written so far
        to rank 0's progress bar, so that it covers every rank's work."""
        now = time.monotonic()
        if now - self.polled < 1.0 or not self.theirs:
            return
        self.polled = now
        written = 0
        for i, planned in self.theirs:
            written += min(planned, self.out.progress(i))
        if written > self.seen:
            self.bar.update(written - self.seen)
            self.seen = written

    def stopped(self, error: BaseException) -> None:
        """Rank 0 failed while writing: make the other ranks stop and wait until they have, before the staging
        folder is removed (nobody writes into it while it goes).

        Args:
            error: why rank 0 stopped.
        """
        _leave_stop(self.steps)
        self.steps.fail(error, until="committed")

    def gathered(self, out) -> None:
        """Wait for every rank's parts; hand them to ``out`` and take over their counts.

        Args:
            out: the opened output.

        Raises:
            PeerFailedError: a rank failed.
        """
        for got in self.steps.step("written", None)[1:]:
            out.adopt(got["written"])
            self.source.counts.add(got["counts"])
        self.bar.update(sum(planned for _, planned in self.theirs) - self.seen)  # their last bytes


def _share(plan: Plan, done: list[int], steps: JobSteps) -> list[list[int]]:
    return assign_shards(plan.shard_sizes(), steps.world.size, skip=done)


def write_share(plan: Plan, steps: JobSteps, sink, layout, produce, source):
    """A rank other than 0: write this rank's parts into the output rank 0 opened
    (:meth:`~peft_shardmerge.engine.sink.Sink.join`); return rank 0's report.

    Args:
        plan: the plan every rank agreed on.
        steps: the job's steps (``open``, ``written`` and ``committed`` are left).
        sink: the sink rank 0 writes with too.
        layout: the plan's layout.
        produce: ``produce(i, writer)`` writes part ``i``'s tensors.
        source: the source ``produce`` writes from (its counts go to rank 0).

    Returns:
        The :class:`~peft_shardmerge.engine.report.MergeReport` rank 0 made.

    Raises:
        PeerFailedError: another rank failed.
        MergeCheckError: a merged value is not finite, or the self-check failed.
        OSError: the filesystem failed.
    """
    note_outcome(sink.location, UNKNOWN)
    opened = steps.step("open", None)[0]
    steps.staging = opened["path"]
    with sink.join(layout, opened, steps.world.rank) as out:
        out.write(_share(plan, opened["done"], steps)[steps.world.rank], produce)
        steps.step("written", {"written": out.written(), "counts": source.counts})
    return steps.step("committed", None)[0]


class LiveRanks:
    """Rank 0's side of a merge of a sharded model in process: rank 0 writes every part (onto its own disk: no
    shared filesystem needed) while every rank takes the same gathers.

    Args:
        steps: the job's steps.
        gatherer: the :class:`~peft_shardmerge.distributed.sharding.UnitGatherer` every rank drives in plan order.
    """

    def __init__(self, steps: JobSteps, gatherer):
        self.steps, self.gatherer = steps, gatherer

    def opened(self, out) -> set[int]:
        """Tell the other ranks the output is open (they start gathering with rank 0); rank 0 writes every part."""
        self.steps.step("open", None)
        return set()

    def gathered(self, out) -> None:
        """Release the last units and wait for the other ranks (raises PeerFailedError when one failed)."""
        self.gatherer.close()
        self.steps.step("written", None)

    def stopped(self, error: BaseException) -> None:
        """Rank 0 failed while writing: take the gathers left, so that no rank waits in one, then tell the others.

        Args:
            error: why rank 0 stopped.
        """
        self.steps.broken = self.steps.broken or not self.gatherer.abandon()
        self.steps.fail(error, until="committed")


def follow_plan(out_dir: str, steps: JobSteps, gatherer):
    """A rank other than 0 of a merge of a sharded model in process: take every gather rank 0 takes, in the same
    order, keeping nothing; return rank 0's report.

    Args:
        out_dir: the output (written by rank 0).
        steps: the job's steps after ``plan``.
        gatherer: the :class:`~peft_shardmerge.distributed.sharding.UnitGatherer`.

    Returns:
        The :class:`~peft_shardmerge.engine.report.MergeReport` rank 0 made.

    Raises:
        PeerFailedError: rank 0 or another rank failed.
    """
    note_outcome(out_dir, UNKNOWN)
    steps.step("open", None)
    try:
        gatherer.drain()  # every gather rank 0 takes, in its order
    except Exception:
        steps.broken = steps.broken or not gatherer.abandon()
        raise
    steps.step("written", None)
    return steps.step("committed", None)[0]


def failed(steps: JobSteps, error: BaseException, out_dir: str) -> BaseException:
    """After a failure on this rank: tell the others, learn from rank 0 what became of OUT, and return the exception
    to raise (the same one, or one whose message says what became of OUT).

    Args:
        steps: the job's steps.
        error: what stopped this rank.
        out_dir: the output folder.

    Returns:
        The exception to raise; on a rank other than 0 whose failure reached rank 0, marked ``said_by_rank_0`` (the
        command line leaves the message to rank 0, which says it once for the job).
    """
    error = _failed(steps, error, out_dir)
    error.said_by_rank_0 = steps.world.rank != 0 and (steps.told or isinstance(steps.failure, PeerFailedError))
    return error


def _failed(steps: JobSteps, error: BaseException, out_dir: str) -> BaseException:
    """:func:`failed` without the mark."""
    rank = steps.world.rank
    if rank != 0:
        _leave_stop(steps)  # rank 0 removes the staging folder only after every rank took the next step
    state = steps.fail(error, outcome(out_dir) if rank == 0 else None)
    if rank != 0 and state:
        note_outcome(out_dir, state)
    if isinstance(error, Stopped):  # the failure that started it, or a rank lost while stopping
        error = steps.failure or PeerLostError("a rank was lost while the ranks stopped")
    elif steps.broken and isinstance(error, RuntimeError) and not isinstance(error, ShardMergeError):
        error = PeerLostError(str(error))  # a gather failed: torch.distributed lost a rank
    if isinstance(error, PeerFailedError) and error.state is None and state:
        return PeerFailedError(error.rank, error.message, state)
    if isinstance(error, PeerLostError):
        return PeerLostError(error.detail, state or UNKNOWN)
    if rank != 0 and isinstance(error, OSError) and not isinstance(error, ShardMergeError):
        return FileSystemError(error, state or UNKNOWN)
    return error
