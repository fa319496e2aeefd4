"""Several planned tensors produced at once on worker threads, each written at its place in the shard and hashed by
the thread that made it."""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

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
def intra_op_threads(workers: int) -> Iterator[None]:
    """With several workers on the CPU, each torch op runs in its worker's thread (torch's intra-op pool held to
    one), then the caller's setting is put back.

    Args:
        workers: the worker threads about to run.

    Example:
        >>> with intra_op_threads(2):
        ...     torch.get_num_threads()
        1
    """
    threads = torch.get_num_threads()
    if workers > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def write_placed(
    tensors: list[PlannedTensor],
    produce: Callable[[PlannedTensor, object], None],
    writer,
    *,
    workers: int,
    before: Callable[[PlannedTensor], None] = lambda t: None,
    done: Callable[[int], None] = lambda n: None,
) -> None:
    """Produce the tensors of one shard on ``workers`` threads, each written at its place in the file as it is made
    (:meth:`~peft_shardmerge.output.writer.ShardWriter.at`); the first failure in their order is raised once the
    threads have stopped.

    Args:
        tensors: the planned tensors of the shard, in the order of its entries.
        produce: ``produce(t, sink)`` writes ``t``'s bytes into ``sink`` (called on a worker thread).
        writer: the :class:`~peft_shardmerge.output.writer.ShardWriter`.
        workers: worker threads (at least 1).
        before: called on this thread before ``t`` is handed to a worker.
        done: called on this thread with the byte count of each tensor written, in order.

    Returns:
        None.

    Example:
        >>> import os, tempfile
        >>> from types import SimpleNamespace
        >>> from safetensors.torch import load_file
        >>> from peft_shardmerge.output.writer import ShardWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> ts = [SimpleNamespace(name=n, shape=(k,)) for n, k in (("a", 1), ("b", 2))]
        >>> with ShardWriter(path, [(t.name, "F32", t.shape, 4 * t.shape[0]) for t in ts]) as w:
        ...     write_placed(ts, lambda t, sink: sink.write(torch.ones(t.shape)), w, workers=2)
        >>> load_file(path)
        {'a': tensor([1.]), 'b': tensor([1., 1.])}
    """
    pending: deque[Future] = deque()

    def task(index: int, t: PlannedTensor) -> int:
        sink = writer.at(index)
        with torch.no_grad():
            produce(t, sink)
        sink.finish()
        return sink.nbytes

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="merge") as pool:
        try:
            for index, t in enumerate(tensors):
                if len(pending) >= 2 * workers:  # a few queued behind the running ones; failures seen early
                    done(pending.popleft().result())
                before(t)
                pending.append(pool.submit(task, index, t))
            while pending:
                done(pending.popleft().result())
        finally:
            for future in pending:
                future.cancel()
