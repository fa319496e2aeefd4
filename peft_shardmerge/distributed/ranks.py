"""A merge from disk spread over the ranks of a torch.distributed job: every rank writes its share of the output
shards into the one staging folder; rank 0 holds the lock, writes the index, config and side files, and commits."""

from __future__ import annotations

import errno
import logging
import os
import time

import torch

from ..engine.plan import Plan
from ..errors import FileSystemError, InputError, PeerFailedError, PeerLostError, ShardMergeError, Stopped
from ..output.staging import Staging, note_outcome, outcome
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


def _counts(merger) -> dict:
    return {
        "applied": merger.applied,
        "replacements": merger.replacements,
        "fallbacks": merger.fallbacks,
        "probe_err": merger.probe_err,
        "swallowed": merger.swallowed,
    }


class OtherRanks:
    """Rank 0's side of a distributed merge from disk, for :meth:`~peft_shardmerge.output.shard_sink.ShardSink.write`:
    it says
    which shards rank 0 writes, then takes over what the other ranks wrote.

    Args:
        plan: the plan every rank agreed on.
        merger: rank 0's source (the other ranks' counts are added to it, for the count check and the report).
        steps: the job's steps.
        bar: rank 0's progress bar (it shows the other ranks' bytes too).
    """

    def __init__(self, plan: Plan, merger, steps: JobSteps, bar):
        self.plan, self.merger, self.steps, self.bar = plan, merger, steps, bar
        self.theirs: list[tuple[str, int]] = []  # (path, planned bytes) of the shards the other ranks write
        self.seen, self.polled = 0, 0.0

    def opened(self, staging) -> set[int]:
        """Tell every rank where the staging folder is and which shards an earlier run finished.

        Args:
            staging: the opened :class:`~peft_shardmerge.output.staging.Staging`.

        Returns:
            The shards rank 0 writes.
        """
        self.steps.step("open", {"done": sorted(staging.done), "common": staging.common})
        self.steps.staging = staging.path
        share = _share(self.plan, sorted(staging.done), self.steps)
        sizes = _sizes(self.plan)
        self.theirs = [
            (os.path.join(staging.path, self.plan.shard_names[i]), sizes[i]) for other in share[1:] for i in other
        ]
        return set(share[0])

    def poll(self) -> None:
        """Between two of rank 0's tensors, at most once a second: add the bytes the other ranks have written so far
        to rank 0's progress bar (:func:`written_bytes` of their shards), so that it covers every rank's work."""
        now = time.monotonic()
        if now - self.polled < 1.0 or not self.theirs:
            return
        self.polled = now
        written = 0
        for path, planned in self.theirs:
            written += min(planned, written_bytes(path))
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

    def gathered(self, staging, records: dict) -> None:
        """Wait for every rank's shards; take over their records, manifests and counts.

        Args:
            staging: the staging folder.
            records: rank 0's shard records, to which the others' are added.

        Raises:
            PeerFailedError: a rank failed.
        """
        for got in self.steps.step("written", None)[1:]:
            records.update(got["records"])
            staging.adopt(got["done"])
            m, c = self.merger, got["counts"]
            m.applied.update(c["applied"])
            m.replacements += c["replacements"]
            m.fallbacks += c["fallbacks"]
            m.probe_err = max(m.probe_err, c["probe_err"])
            m.swallowed.update(c["swallowed"])
        self.bar.update(sum(planned for _, planned in self.theirs) - self.seen)  # their last bytes


def written_bytes(path: str) -> int:
    """The bytes written so far into a shard another process writes: the file's data, not its size (a shard's blocks
    are allocated when it is created, :func:`~peft_shardmerge.output.direct.preallocate`, and read as holes until
    written); where the filesystem cannot tell data from holes, its size. 0 where there is no such file yet.

    Args:
        path: the shard.

    Returns:
        The bytes.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     _ = f.write(b"abc"); f.flush(); written_bytes(f.name)
        3
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    total = pos = size = 0
    try:
        size = os.fstat(fd).st_size
        while pos < size:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            if start >= size:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            if end <= start:  # a filesystem that answers so cannot tell: its size
                return size
            total, pos = total + min(end, size) - start, end
    except OSError as e:  # ENXIO: no data from pos on; anything else: SEEK_DATA not taken here, or the file changed
        return total if e.errno == errno.ENXIO else size
    finally:
        os.close(fd)
    return total


def _sizes(plan: Plan) -> list[int]:
    return [sum(e[3] for e in entries) for _, entries in plan.shard_entries()]


def _share(plan: Plan, done: list[str], steps: JobSteps) -> list[list[int]]:
    return assign_shards(_sizes(plan), steps.world.size, skip=[plan.shard_names.index(n) for n in done])


def write_share(plan: Plan, out_dir: str, steps: JobSteps, sink, produce, merger):
    """A rank other than 0: write this rank's shards into rank 0's staging folder with ``sink``, recording each one
    finished in ``manifest.rank-N.json`` there (so a rerun keeps it, whatever its rank count); return rank 0's report.

    Args:
        plan: the plan every rank agreed on.
        out_dir: the output folder (the same path on every rank: the plans agreed on it).
        steps: the job's steps (``open``, ``written`` and ``committed`` are left).
        sink: the :class:`~peft_shardmerge.output.shard_sink.ShardSink` rank 0 writes with too (its ``fingerprint`` and
            ``inputs`` say whether finished shards are recorded for a rerun).
        produce: ``produce(i, writer)`` writes shard ``i``'s tensors.
        merger: the merger ``produce`` writes with (its counts go to rank 0).

    Returns:
        The :class:`~peft_shardmerge.engine.report.MergeReport` rank 0 made.

    Raises:
        PeerFailedError: another rank failed.
        MergeCheckError: a merged value is not finite, or the self-check failed.
        OSError: the filesystem failed.
    """
    note_outcome(out_dir, UNKNOWN)
    opened = steps.step("open", None)[0]
    staging = Staging.joined(out_dir, steps.world.rank, opened["common"], sink.fingerprint, sink.inputs)
    steps.staging = staging.path
    with torch.no_grad():
        sink.write_shards(staging, produce, mine=set(_share(plan, opened["done"], steps)[steps.world.rank]))
    steps.step("written", {"records": sink.records, "done": staging.done, "counts": _counts(merger)})
    return steps.step("committed", None)[0]


class LiveRanks:
    """Rank 0's side of a merge of a sharded model in process: rank 0 writes every shard (onto its own disk: no
    shared filesystem needed) while every rank takes the same gathers.

    Args:
        steps: the job's steps.
        gatherer: the :class:`~peft_shardmerge.distributed.sharding.UnitGatherer` every rank drives in plan order.
    """

    def __init__(self, steps: JobSteps, gatherer):
        self.steps, self.gatherer = steps, gatherer

    def opened(self, staging) -> None:
        """Tell the other ranks the output is open (they start gathering with rank 0); rank 0 writes every shard."""
        self.steps.step("open", None)

    def gathered(self, staging, records: dict) -> None:
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


def follow_plan(plan: Plan, out_dir: str, steps: JobSteps, gatherer):
    """A rank other than 0 of a merge of a sharded model in process: take every gather rank 0 takes, in the same
    order, keeping nothing; return rank 0's report.

    Args:
        plan: the plan every rank agreed on.
        out_dir: the output folder (written by rank 0).
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
