"""The hooks of a job's ranks for the executor: a merge from disk spread over them; a sharded model in units."""

from __future__ import annotations

from ..engine.plan import Plan, PlannedTensor
from ..engine.report import MergeReport
from .ranks import LiveRanks, OtherRanks, check_stop, follow_plan, write_share
from .sharding import UnitGatherer
from .world import JobSteps


class _Leading:
    """The leader's hooks, handed to its side of the other ranks (``ranks``):
    :class:`~peft_shardmerge.distributed.ranks.OtherRanks` or :class:`~peft_shardmerge.distributed.ranks.LiveRanks`."""

    ranks: OtherRanks | LiveRanks | None

    def opened(self, out) -> set[int]:
        """Tell the other ranks the output is open; the parts they write."""
        return self.ranks.opened(out)

    def stopped(self, error: BaseException) -> None:
        self.ranks.stopped(error)

    def gathered(self, out) -> None:
        """Wait for the other ranks; take over what they wrote."""
        self.ranks.gathered(out)


class SpreadShards(_Leading):
    """A merge from disk spread over the ranks (:class:`~peft_shardmerge.engine.source.Coordinator`): each rank
    writes its share of the parts into the output rank 0 opened; rank 0 writes the rest of the output and commits.

    Args:
        plan: the plan every rank agreed on.
        steps: the job's steps after ``plan``.
    """

    def __init__(self, plan: Plan, steps: JobSteps):
        self.plan, self.steps = plan, steps
        self.leads = steps.world.rank == 0
        self.ranks: OtherRanks | None = None
        self.source = None

    def start(self, source, progress) -> None:
        """Keep the source (its counts travel to rank 0); on rank 0, watch the other ranks' parts."""
        self.source = source
        if self.leads:
            self.ranks = OtherRanks(self.plan, source, self.steps, progress)

    def before(self, t: PlannedTensor) -> None:
        """Stop when another rank failed; on rank 0, show the other ranks' progress."""
        check_stop(self.steps)
        if self.ranks is not None:
            self.ranks.poll()

    def follow(self, sink, layout, produce) -> MergeReport:
        """Write this rank's parts into the output rank 0 opened; return rank 0's report."""
        return write_share(self.plan, self.steps, sink, layout, produce, self.source)

    def notes(self) -> list[str]:
        return [f"spread over {self.steps.world.size} ranks; the peak memory above is rank 0's"]

    def committed(self, report: MergeReport) -> None:
        self.steps.step("committed", report)


class GatherUnits(_Leading):
    """A sharded model merged collectively (:class:`~peft_shardmerge.engine.source.Coordinator`): every rank gathers
    each unit in plan order, rank 0 merges and writes every shard.

    Args:
        plan: the plan every rank agreed on.
        steps: the job's steps after ``plan``.
        root: the model as sharded (the outermost FSDP unit, the ZeRO-3 module).
    """

    def __init__(self, plan: Plan, steps: JobSteps, root):
        self.plan, self.steps = plan, steps
        order = [t for i in range(len(plan.shard_names)) for t in plan.shard_tensors(i)]  # the write order
        self.gatherer = UnitGatherer(root, order)
        self.leads = steps.world.rank == 0
        self.ranks = LiveRanks(steps, self.gatherer)

    def start(self, source, progress) -> None:
        pass

    def before(self, t: PlannedTensor) -> None:
        """Gather the unit ``t`` lives in (releasing the one before)."""
        self.gatherer.before(t)

    def follow(self, sink, layout, produce) -> MergeReport:
        """Take every gather rank 0 takes, in its order; return rank 0's report."""
        return follow_plan(sink.location, self.steps, self.gatherer)

    def notes(self) -> list[str]:
        units, notes = self.gatherer.units, []
        if getattr(units, "masters", None):
            notes.append(
                f"{len(units.masters)} trainable tensor(s) read from DeepSpeed's fp32 master weights (the "
                "model holds 16-bit copies of them)"
            )
        notes.append(
            f"gathered from {self.steps.world.size} ranks one {units.label} at a time (at most "
            f"{self.gatherer.peak_numel:,} elements at once); the peak memory above is rank 0's"
        )
        return notes

    def committed(self, report: MergeReport) -> None:
        self.steps.step("committed", report)
