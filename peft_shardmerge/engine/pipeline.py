"""Several planned tensors produced at once on worker threads, each written at its place in the shard and hashed by
the thread that made it."""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch

from .maths import one_cpu_thread
from .plan import PlannedTensor


def default_workers(share: int = 1) -> int:
    """The worker threads a merge from disk uses when not told: its share of the CPUs this process may run on (one
    per CPU for a process alone; ``share`` processes of one job on this node split them), at most 8.

    Args:
        share: processes of the job on this node (torchrun's ``LOCAL_WORLD_SIZE``).

    Returns:
        At least 1.

    Example:
        >>> 1 <= default_workers() <= 8, default_workers(share=10**6)
        (True, 1)
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // max(1, share)))


@contextmanager
def worker_pool(workers: int, one_torch_thread: bool = True) -> Iterator[ThreadPoolExecutor | None]:
    """The worker threads of one merge (None for one worker: the caller's thread does the work), kept for all its
    shards, so that what a thread keeps (its read buffer, its CUDA stream) serves every shard.

    Args:
        workers: how many.
        one_torch_thread: hold torch to one intra-op thread meanwhile (workers that run torch ops each); False leaves
            torch's threads to the caller's thread (workers that only hash and write).

    Example:
        >>> with worker_pool(1) as pool:
        ...     pool is None
        True
    """
    if workers <= 1:
        yield None
        return
    # each torch op runs in its worker's thread: torch's pool (a setting of the whole process) held to one meanwhile
    held = one_cpu_thread(torch.device("cpu")) if one_torch_thread else nullcontext()
    with held, ThreadPoolExecutor(workers, thread_name_prefix="merge") as pool:
        yield pool


def produce_shard(
    tensors: list[PlannedTensor],
    prepare: Callable[[PlannedTensor], Callable[[object], None]],
    writer,
    pool: ThreadPoolExecutor | None,
    *,
    ahead: int = 16,
    held_limit: int | None = None,
    before: Callable[[PlannedTensor], None] = lambda t: None,
    done: Callable[[int], None] = lambda n: None,
) -> None:
    """The tensors of one shard into ``writer``: each prepared on this thread in order, then written on the threads
    of ``pool`` at its place in the file (:func:`write_placed`), or without a pool one after the other on this
    thread.

    Args:
        tensors: the planned tensors of the shard, in the order of its entries.
        prepare: ``prepare(t)`` does what must happen on this thread, in order, and returns ``write(sink)``, which
            writes ``t``'s bytes into ``sink``.
        writer: the :class:`~peft_shardmerge.output.writer.ShardWriter`.
        pool: the worker threads (:func:`worker_pool`), or None.
        ahead, held_limit: see :func:`write_placed`.
        before: called on this thread before each tensor is prepared.
        done: called on this thread with the bytes written (per tensor with a pool, per block without).

    Returns:
        None.
    """
    if pool is not None:
        write_placed(tensors, prepare, writer, pool, ahead=ahead, held_limit=held_limit, before=before, done=done)
        return
    counted = _Counted(writer, done)
    for t in tensors:
        before(t)
        prepare(t)(counted)


class _Counted:
    """A shard writer that reports the bytes written through it."""

    def __init__(self, w, done: Callable[[int], None]):
        self.w, self.done = w, done

    def write(self, tensor) -> None:
        self.w.write(tensor)
        self.done(tensor.numel() * tensor.element_size())

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        self.w.copy_from(fd, offset, nbytes)
        self.done(nbytes)


def write_placed(
    tensors: list[PlannedTensor],
    prepare: Callable[[PlannedTensor], Callable[[object], None]],
    writer,
    pool: ThreadPoolExecutor,
    *,
    ahead: int = 16,
    held_limit: int | None = None,
    before: Callable[[PlannedTensor], None] = lambda t: None,
    done: Callable[[int], None] = lambda n: None,
) -> None:
    """Prepare the tensors of one shard on this thread, in order, and write each on the threads of ``pool`` at its
    place in the file (:meth:`~peft_shardmerge.output.writer.ShardWriter.at`). The next tensor is prepared as soon as
    there is room for it under ``ahead`` and ``held_limit``, made by whichever writes in flight end first (not only
    the oldest): a long write does not hold back the tensors after it while there is room beside it (under
    ``held_limit``, a long write that holds most of the limit still holds them back).
    The first failure among the writes, in their order, is raised once no thread works on the shard any more (also
    when this thread is interrupted meanwhile), and nothing more is prepared once a write has failed; a failure of
    ``before`` or ``prepare`` (another rank stopped, a merged value not finite) is raised as soon as the threads have
    stopped, unless a write handed out before it failed (that one is raised, from it).

    Args:
        tensors: the planned tensors of the shard, in the order of its entries.
        prepare: ``prepare(t)`` (on this thread) returns ``write(sink)``, which writes ``t``'s bytes into ``sink``
            (called on a worker thread).
        writer: the :class:`~peft_shardmerge.output.writer.ShardWriter`.
        pool: the worker threads (:func:`worker_pool`).
        ahead: tensors prepared and not yet seen written, at most (a few beyond the running ones, so that a failure
            is seen early; what is prepared is held until written).
        held_limit: their planned bytes, at most, where each holds its whole tensor until written (None: not
            counted); a tensor that would go over waits until enough of the writes in flight have ended (one alone
            always goes).
        before: called on this thread before ``t`` is prepared.
        done: called on this thread with the byte count of each tensor written, as each is seen finished.

    Returns:
        None.

    Example:
        >>> import os, tempfile
        >>> from types import SimpleNamespace
        >>> from safetensors.torch import load_file
        >>> from peft_shardmerge.output.writer import ShardWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> ts = [SimpleNamespace(name=n, shape=(k,)) for n, k in (("a", 1), ("b", 2))]
        >>> entries = [(t.name, "F32", t.shape, 4 * t.shape[0]) for t in ts]
        >>> with ShardWriter(path, entries) as w, worker_pool(2) as pool:
        ...     write_placed(ts, lambda t: lambda sink: sink.write(torch.ones(t.shape)), w, pool)
        >>> load_file(path)
        {'a': tensor([1.]), 'b': tensor([1., 1.])}
    """
    pending: dict[Future, tuple[int, int]] = {}  # each write not yet seen finished: (its place, planned bytes held)
    failures: list[tuple[int, BaseException]] = []

    def task(index: int, write: Callable[[object], None]) -> int:
        sink = writer.at(index)
        with torch.no_grad():
            write(sink)
        sink.finish()
        return sink.nbytes

    def settle(finished) -> None:
        """Count the finished writes and let go of what they held; keep their failures."""
        for future in finished:
            index, _ = pending.pop(future)
            if future.cancelled():
                continue
            if future.exception() is None:
                done(future.result())
            else:
                failures.append((index, future.exception()))

    def first_failure() -> BaseException | None:
        """Once no thread works on the shard: the failure of the earliest write in plan order, if any (an interrupt
        while waiting goes up; the ``finally`` below waits for the threads through any further one)."""
        for future in pending:
            future.cancel()
        wait(pending)
        settle(list(pending))
        return min(failures, key=lambda f: f[0])[1] if failures else None

    def full(t) -> bool:
        return len(pending) >= ahead or (
            held_limit is not None and sum(h for _, h in pending.values()) + t.nbytes > held_limit
        )

    try:
        for index, t in enumerate(tensors):
            settle([f for f in pending if f.done()])
            # room is made by whichever writes end first, not only the oldest
            while pending and not failures and full(t):
                settle(wait(pending, return_when=FIRST_COMPLETED).done)
            if failures:
                break  # a write failed: nothing more is prepared, the first failure is raised below
            try:
                before(t)
                with torch.no_grad():
                    write = prepare(t)
            except Exception as err:  # an earlier tensor's failed write comes first
                earlier = first_failure()
                if earlier is not None:
                    raise earlier from err
                raise
            pending[pool.submit(task, index, write)] = (index, t.nbytes if held_limit is not None else 0)
        while pending and not failures:
            settle(wait(pending, return_when=FIRST_COMPLETED).done)
        earlier = first_failure()
        if earlier is not None:
            raise earlier
    finally:
        _stop(pending)


def _stop(futures) -> None:
    """Cancel the futures not started and wait until none runs."""
    for future in futures:
        future.cancel()
    _wait_for(futures)


def _wait_for(futures) -> None:
    """Wait until none of ``futures`` runs, through further interrupts (Ctrl-C, or the command's SIGTERM): the shard's
    file and the inputs are closed after this, and a thread still writing would write through a closed (or reused)
    descriptor."""
    while True:
        try:
            wait(futures)
            return
        except BaseException:  # the first interrupt is on its way up already
            continue
