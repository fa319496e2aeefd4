"""The ranks of a merge spread over torch.distributed: who this process is, the steps every rank takes together, and
which output shards each rank writes."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from ..errors import InputError, PeerFailedError, PeerLostError, ShardMergeError, Stopped

log = logging.getLogger(__name__)

_GLOO_GROUPS: dict[int, Any] = {}


@dataclass(frozen=True)
class World:
    """This process's place in the job.

    Attributes:
        rank: this process's global rank (0 writes the index, config and side files and commits).
        size: the number of processes; 1 outside a distributed job.
        local_rank: the rank on this node (``LOCAL_RANK``): which GPU ``cuda`` means for this process.
        local_size: the processes of the job on this node (``LOCAL_WORLD_SIZE``), which share its CPUs.
        group: the process group the job's small messages travel on (a gloo group beside an NCCL one).

    Example:
        >>> World().distributed
        False
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    group: Any = None

    @property
    def distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.size > 1

    def device(self, device: torch.device) -> torch.device:
        """``cuda`` without an index means this rank's own GPU (``cuda:LOCAL_RANK``).

        Args:
            device: the resolved device.

        Returns:
            The device this rank computes on.

        Example:
            >>> World(rank=1, size=2, local_rank=1).device(torch.device("cpu"))
            device(type='cpu')
        """
        if device.type == "cuda" and device.index is None and self.distributed:
            return torch.device("cuda", self.local_rank)
        return device


def current_world() -> World:
    """The job this process is part of: the initialized default process group, else a world of one.

    Returns:
        The :class:`World`.

    Example:
        >>> current_world().size
        1
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return World()
    rank, size = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    group = None
    if dist.get_backend() != "gloo":  # the job's messages are Python objects on the CPU: a gloo group beside NCCL
        key = id(dist.distributed_c10d._get_default_group())
        if key not in _GLOO_GROUPS:
            _GLOO_GROUPS[key] = dist.new_group(backend="gloo")
        group = _GLOO_GROUPS[key]
    local_size = max(1, _env_int("LOCAL_WORLD_SIZE", 1))
    return World(rank=rank, size=size, local_rank=local, local_size=local_size, group=group)


@contextmanager
def joined_world(device: str = "auto") -> Iterator[World]:
    """Join the job a launcher started (``torchrun``, ``accelerate launch``, ``srun torchrun``: ``WORLD_SIZE`` above 1
    in the environment), or use the process group the caller initialized; leave it again on exit if it was joined
    here.

    Args:
        device: the merge's device: ``cuda`` (or ``auto`` with CUDA available) joins with NCCL, else gloo.

    Returns:
        A context manager yielding the :class:`World` (a world of one outside a distributed job).

    Raises:
        InputError: the environment names a job but torch.distributed cannot join it.

    Example:
        >>> with joined_world("cpu") as world:
        ...     world.size
        1
    """
    import torch.distributed as dist

    size = _env_int("WORLD_SIZE", 1)
    joined = False
    if size > 1 and not (dist.is_available() and dist.is_initialized()):
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing or not dist.is_available():
            raise InputError(
                f"WORLD_SIZE={size} says this is a distributed job, but "
                + (f"{', '.join(missing)} is not set" if missing else "torch.distributed is not available")
                + ": start it with torchrun (or accelerate launch), or unset WORLD_SIZE"
            )
        cuda = torch.cuda.is_available() and (device == "auto" or str(device).startswith("cuda"))
        if cuda:
            torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        dist.init_process_group("nccl" if cuda else "gloo")
        joined = True
    try:
        yield current_world()
    except BaseException:
        if joined and dist.is_initialized():
            dist.destroy_process_group()
        raise
    if joined and dist.is_initialized():
        dist.barrier()  # no rank tears its connections down while another still reads the last step's messages
        dist.destroy_process_group()


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise InputError(f"{name}={os.environ[name]!r} is not a number") from None


class JobSteps:
    """The steps every rank takes together, in a fixed order; each exchanges one small object per rank.

    A rank that fails takes the steps left carrying its error (:meth:`fail`), so that no rank waits for it and
    every rank stops with the failing rank's message (:class:`~peft_shardmerge.errors.PeerFailedError`).

    Args:
        world: the job.
        names: the steps, in order.

    Example:
        >>> steps = JobSteps(World(), ["plan"])
        >>> steps.step("plan", "abc")
        ['abc']
    """

    def __init__(self, world: World, names: Sequence[str]):
        self.world = world
        self.names = list(names)
        self.taken = 0
        self.broken = False  # the group is out of step (a gather failed half-way): no more messages on it
        self.failure: PeerFailedError | None = None  # the first failure another rank reported
        self.staging: str | None = None  # the staging folder, once rank 0 opened it (where a stop file goes)
        self.told = False  # this rank's failure reached every rank (rank 0 says it)

    def _exchange(self, name: str, item: tuple) -> list[tuple]:
        if self.taken >= len(self.names) or self.names[self.taken] != name:
            raise RuntimeError(f"step {name!r} taken out of order (steps: {self.names}, taken: {self.taken})")
        self.taken += 1
        if not self.world.distributed:
            return [item]
        import torch.distributed as dist

        got: list = [None] * self.world.size
        try:
            dist.all_gather_object(got, item, group=self.world.group)
        except RuntimeError as e:  # a rank died or its node was lost: the group is gone
            self.broken = True
            raise PeerLostError(str(e)) from e
        failures = [
            (v.get("stopped", False), r)
            for r, (status, v) in enumerate(got)
            if status == "failed" and r != self.world.rank
        ]
        if failures and (self.failure is None or self.failure.stopped):  # a rank's own failure before a stop
            stopped, rank = min(failures)
            v = got[rank][1]
            self.failure = PeerFailedError(rank, v["message"], v.get("state"))
            self.failure.stopped = stopped
        return got

    def step(self, name: str, payload: Any = None) -> list:
        """Take step ``name`` with this rank's ``payload``.

        Args:
            name: the next step's name.
            payload: any picklable object.

        Returns:
            Every rank's payload, by rank.

        Raises:
            PeerFailedError: a rank failed before or at this step (one that failed of its own first, then the
                lowest rank).

        Example:
            >>> JobSteps(World(), ["open"]).step("open", {"done": []})
            [{'done': []}]
        """
        got = self._exchange(name, ("ok", payload))
        if any(status == "failed" for status, _ in got):
            raise self.failure
        return [value for _, value in got]

    def fail(self, error: BaseException, state: str | None = None, until: str | None = None) -> str | None:
        """Take the steps left carrying ``error`` (up to ``until``, not included), so the other ranks stop too.

        Args:
            error: why this rank stops; a :class:`PeerFailedError` passes on the first failure's message, and
                :class:`Stopped` says this rank only stopped because another failed.
            state: on rank 0, what became of OUT.
            until: the step to stop before (None: every step left).

        Returns:
            What rank 0 said became of OUT (None when it said nothing in the steps taken).

        Example:
            >>> JobSteps(World(), ["plan"]).fail(ValueError("bad"), "OUT is unchanged")
            'OUT is unchanged'
        """
        rank = self.world.rank
        if isinstance(error, PeerFailedError):
            message = error.message
        elif isinstance(error, OSError) and error.strerror and not isinstance(error, ShardMergeError):
            # as the command line says it: "No space left on device (path)"
            message = f"rank {rank}: {error.strerror} ({error.filename or 'output'})"
        else:
            message = f"rank {rank}: {error}" if str(error) else f"rank {rank}: {type(error).__name__}"
        item = (
            "failed",
            {"message": message, "state": state, "stopped": isinstance(error, (Stopped, PeerFailedError))},
        )
        said = state if rank == 0 else None
        while self.taken < len(self.names) and self.names[self.taken] != until and not self.broken:
            try:
                got = self._exchange(self.names[self.taken], item)
            except PeerLostError as e:  # the group itself broke (a rank died): nobody is left to tell
                log.debug("could not tell the other ranks: %s", e)
                break
            self.told = True
            said = got[0][1].get("state") if got[0][0] == "failed" and got[0][1].get("state") else said
        return said


def assign_shards(sizes: Sequence[int], ranks: int, skip: Sequence[int] = ()) -> list[list[int]]:
    """Split output shards over ranks, balanced by bytes: the largest shard goes to the least loaded rank (lowest
    rank on a tie). Deterministic, so every rank computes the same split.

    Args:
        sizes: bytes of each shard, by index.
        ranks: the number of ranks.
        skip: shards already finished (kept from an interrupted run): given to nobody.

    Returns:
        Per rank, its shard indexes in file order.

    Example:
        >>> assign_shards([10, 10, 10, 5], 2)
        [[0, 2], [1, 3]]
        >>> assign_shards([10, 10, 10], 2, skip=[0])
        [[1], [2]]
    """
    load = [0] * ranks
    mine: list[list[int]] = [[] for _ in range(ranks)]
    skipped = set(skip)
    for i in sorted((i for i in range(len(sizes)) if i not in skipped), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        load[r] += sizes[i]
        mine[r].append(i)
    return [sorted(m) for m in mine]
