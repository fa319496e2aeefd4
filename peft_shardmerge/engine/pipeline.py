"""Several planned tensors produced at once on worker threads, each hashed where it was made, and handed to the
shard writer in plan order."""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ..options import IN_FLIGHT_BYTES
from .plan import Op, PlannedTensor

_READ_PIECE = 8 << 20


def default_workers() -> int:
    """The worker threads a merge from disk uses when not told: one per CPU this process may run on, at most 8.

    Returns:
        At least 1.

    Example:
        >>> 1 <= default_workers() <= 8
        True
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


class Produced:
    """One tensor's output as a worker made it: its bytes (CPU tensors, and ranges of other files to copy), their
    count and their SHA-256; a sink with the calls a :class:`~peft_shardmerge.output.writer.ShardWriter` receives.

    Example:
        >>> p = Produced(); p.write(torch.zeros(2, dtype=torch.uint8)); p.nbytes, p.sha256()[:8]
        (2, '96a296d2')
    """

    def __init__(self) -> None:
        self.pieces: list = []
        self.nbytes = 0
        self._sha = hashlib.sha256()

    def write(self, tensor: torch.Tensor) -> None:
        """Keep a block of the tensor (moved to the CPU, made contiguous) and hash it."""
        t = tensor.detach().to("cpu").contiguous()
        if t.numel() == 0:
            return
        self.pieces.append(t)
        self.nbytes += t.numel() * t.element_size()
        self._sha.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))

    def copy_from(self, fd: int, offset: int, nbytes: int) -> None:
        """Keep a range of another file to copy, and hash its bytes (read here, from the page cache)."""
        self.pieces.append((fd, offset, nbytes))
        self.nbytes += nbytes
        for pos in range(0, nbytes, _READ_PIECE):
            self._sha.update(os.pread(fd, min(_READ_PIECE, nbytes - pos), offset + pos))

    def sha256(self) -> str:
        """Hex SHA-256 of every byte kept, in order."""
        return self._sha.hexdigest()


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


def write_in_order(
    tensors: list[PlannedTensor],
    produce: Callable[[PlannedTensor, Produced], None],
    writer,
    *,
    workers: int,
    before: Callable[[PlannedTensor], None] = lambda t: None,
    done: Callable[[int], None] = lambda n: None,
    in_flight_bytes: int = IN_FLIGHT_BYTES,
) -> None:
    """Produce ``tensors`` on ``workers`` threads, a few ahead of the writer, and hand each to ``writer.put`` in
    their order; the first failure in that order is raised once the threads have stopped.

    Args:
        tensors: the planned tensors of one shard, in write order.
        produce: ``produce(t, sink)`` writes ``t``'s bytes into ``sink`` (called on a worker thread).
        writer: a :class:`~peft_shardmerge.output.writer.ShardWriter`.
        workers: worker threads (at least 1).
        before: called on this thread before ``t`` is handed to a worker.
        done: called with the byte count of each tensor written.
        in_flight_bytes: produced bytes held at once (copied tensors hold none).

    Returns:
        None.

    Example:
        >>> sizes = []
        >>> class Writer:
        ...     def put(self, pieces, nbytes, sha256): sizes.append(nbytes)
        >>> from types import SimpleNamespace
        >>> ts = [SimpleNamespace(op=Op.CAST, shape=(k,), nbytes=4 * k) for k in (1, 2)]
        >>> write_in_order(ts, lambda t, sink: sink.write(torch.zeros(t.shape)), Writer(), workers=2)
        >>> sizes
        [4, 8]
    """
    pending: deque[tuple[Future, int]] = deque()
    held = 0
    todo = iter(tensors)

    def task(t: PlannedTensor) -> Produced:
        sink = Produced()
        with torch.no_grad():
            produce(t, sink)
        return sink

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="merge") as pool:
        try:
            nxt = next(todo, None)
            while nxt is not None or pending:
                while nxt is not None and len(pending) <= workers:
                    cost = 0 if nxt.op is Op.COPY else nxt.nbytes
                    if pending and held + cost > in_flight_bytes:
                        break
                    before(nxt)
                    pending.append((pool.submit(task, nxt), cost))
                    held += cost
                    nxt = next(todo, None)
                future, cost = pending.popleft()
                made = future.result()
                writer.put(made.pieces, made.nbytes, made.sha256())
                held -= cost
                done(made.nbytes)
        finally:
            for future, _ in pending:
                future.cancel()
