"""What the one executor hands a merge's destination: the Sink protocol, the layout it opens, what it finishes with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ContextManager, Protocol, runtime_checkable

__all__ = ["Entry", "Finish", "Layout", "Opened", "SharedOutput", "SharedSink", "Sink"]

#: ``(name, safetensors dtype, shape, nbytes)`` of one output tensor
Entry = tuple[str, str, tuple[int, ...], int]


@dataclass
class Layout:
    """The plan as a destination sees it before any bytes: its parts (a folder's shard files), each with its tensors
    in write order.

    Attributes:
        parts: ``(part name, [entry, ...])`` per part, in write order.
        io_bytes: per part, the bytes the merge reads from disk and writes for it (None: not known); a destination
            on disk chooses by them which writes bypass the page cache.
        fingerprint: the identity of the merge, for keeping the parts of an interrupted run (None: never kept).
        inputs: digests of the inputs per part (:class:`~peft_shardmerge.output.resume.InputDigests`), for keeping
            them.
    """

    parts: list[tuple[str, list[Entry]]]
    io_bytes: list[int] | None = None
    fingerprint: str | None = None
    inputs: object = None


@dataclass
class Finish:
    """What the output holds besides the tensors, handed to :meth:`Opened.finish` once every part is written.

    Attributes:
        config: the ``config.json`` content.
        index: the ``model.safetensors.index.json`` content (where the output has more than one part).
        side_files: called with the folder being written to copy the base's other files (tokenizer, generation
            config).
        before_commit: the caller's hook, called with that folder after the side files.
        merge_info: returns the ``merge`` part of ``merge_manifest.json``.
        checks: called before the output is committed (each change applied exactly once).
    """

    config: dict
    index: dict | None = None
    side_files: Callable[[str], None] | None = None
    before_commit: Callable[[str], None] | None = None
    merge_info: Callable[[], dict] = dict
    checks: list[Callable[[], None]] = field(default_factory=list)


@runtime_checkable
class Opened(Protocol):
    """A destination opened for a :class:`Layout`: the executor writes parts into it, then finishes it. It is
    committed when the :meth:`Sink.open` block ends and left as it was when the block raises.

    Attributes:
        done: when opened, the parts an interrupted run finished and this one keeps (the executor counts them as
            written and reads this once, before writing).
    """

    done: set[int]

    def write(self, parts: list[int], produce: Callable[[int, object], None]) -> None:
        """Write ``parts``, in order: ``produce(i, writer)`` writes part ``i``'s tensors into ``writer``. The writer
        takes both ways the executor writes (which one depends on the source's workers, not on the sink): in order,
        ``write(tensor)`` in row blocks and ``copy_from(fd, offset, nbytes)`` for stored bytes (a tensor's bytes
        follow the one before it; a zero-size tensor's block is empty), and at their place, ``at(index)`` giving
        tensor ``index``'s own writer (``write``, ``copy_from``, then ``finish``; its ``nbytes``, the bytes written
        through it, feed the progress bar), called from worker threads."""
        ...  # pragma: no cover - a protocol

    def finish(self, finish: Finish) -> None:
        """Everything but the tensors, then the checks; raises when the output must not be committed."""
        ...  # pragma: no cover - a protocol


@runtime_checkable
class SharedOutput(Opened, Protocol):
    """An opened destination the processes of a job write parts of (:class:`SharedSink`); only the coordinator of
    such a job calls what it adds."""

    def handle(self) -> dict:
        """What another process of the job joins this output with (:meth:`Sink.join`)."""
        ...  # pragma: no cover - a protocol

    def written(self) -> dict:
        """What this process wrote, for the leader's :meth:`adopt`."""
        ...  # pragma: no cover - a protocol

    def adopt(self, written: dict) -> None:
        """Take over the parts another process wrote (its :meth:`written`)."""
        ...  # pragma: no cover - a protocol

    def progress(self, i: int) -> int:
        """The bytes of part ``i`` written so far, by whichever process writes it."""
        ...  # pragma: no cover - a protocol


@runtime_checkable
class Sink(Protocol):
    """Where a merge goes. The executor (:func:`~peft_shardmerge.engine.execute.run`) hands it the layout first, then
    each part's tensor bytes, then what it holds besides them; it never knows what the destination is. Two
    implementations: a safetensors folder staged beside ``out_dir`` and moved into place
    (:class:`~peft_shardmerge.output.shard_sink.FolderSink`), and verify's comparison of the recomputed bytes with a
    merged checkpoint (:class:`~peft_shardmerge.verify.compare.CompareSink`).

    Attributes:
        location: where the output is (the report's ``out_dir``).
        label: what the progress bar says.
    """

    location: str
    label: str

    def open(self, layout: Layout) -> ContextManager[Opened]:
        """Open the destination for ``layout``: the block writes into it; it is committed when the block ends."""
        ...  # pragma: no cover - a protocol


@runtime_checkable
class SharedSink(Sink, Protocol):
    """A destination the ranks of a job spread over write parts of: rank 0 opens it, the others join it (a folder
    on a filesystem every rank sees)."""

    def join(self, layout: Layout, handle: dict, rank: int) -> ContextManager[SharedOutput]:
        """Another process's view of the output the leader opened (``handle`` is its :meth:`SharedOutput.handle`): it
        writes parts into it and never commits nor removes it."""
        ...  # pragma: no cover - a protocol
