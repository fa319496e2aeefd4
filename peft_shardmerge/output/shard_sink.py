"""The safetensors folder as a Sink: shards streamed by the executor, then index, config, side files, record."""

from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

from ..engine.sink import Finish, Layout
from ..errors import MergeCheckError
from ..io.safetensors_io import read_header
from .record import write_merge_record
from .staging import Staging, staged_output
from .writer import ShardWriter, shard_digest, write_json

log = logging.getLogger(__name__)


class FolderSink:
    """A merged checkpoint folder (:class:`~peft_shardmerge.engine.sink.Sink`), written through
    :func:`~peft_shardmerge.output.staging.staged_output`.

    Each shard's header is built from the layout's entries before any data; the executor streams the data into a
    :class:`~peft_shardmerge.output.writer.ShardWriter`. The folder appears at ``out_dir`` only once complete and
    checked; on any failure ``out_dir`` is left as it was.

    Args:
        out_dir: the output folder.
        overwrite: whether a non-empty ``out_dir`` may be replaced (checked again under the output lock).
        depth: blocks queued to the writer thread.
        replace_check: with ``overwrite``, the problems that forbid replacing a non-empty ``out_dir``, checked again
            under the output lock (see :func:`~peft_shardmerge.output.staging.staged_output`); None: an earlier
            output of ours may be replaced.

    Example:
        >>> import os, tempfile, torch
        >>> from safetensors.torch import load_file
        >>> from peft_shardmerge.engine.sink import Finish, Layout
        >>> out = os.path.join(tempfile.mkdtemp(), "merged")
        >>> with FolderSink(out, overwrite=False).open(Layout([("model.safetensors", [("w", "F32", (2,), 8)])])) as o:
        ...     o.write([0], lambda i, w: w.write(torch.ones(2)))
        ...     o.finish(Finish(config={}))
        >>> sorted(os.listdir(out)), load_file(os.path.join(out, "model.safetensors"))["w"]
        (['config.json', 'merge_manifest.json', 'model.safetensors'], tensor([1., 1.]))
    """

    label = "merging"

    def __init__(
        self,
        out_dir: str,
        *,
        overwrite: bool,
        depth: int = 2,
        replace_check: Callable[[str], list[str]] | None = None,
    ):
        self.location = out_dir
        self.overwrite = overwrite
        self.replace_check = replace_check
        self.depth = depth

    @contextmanager
    def open(self, layout: Layout) -> Iterator["FolderOutput"]:
        """The staging folder beside ``out_dir``, locked; moved into place when the block ends, removed when it
        raises (see :func:`~peft_shardmerge.output.staging.staged_output`).

        Args:
            layout: the shards.

        Returns:
            A context manager yielding the :class:`FolderOutput`.

        Raises:
            InputError: ``out_dir`` became non-empty and ``overwrite`` is False.
            OSError: the filesystem failed; nothing is left behind.
        """
        with staged_output(
            self.location,
            fingerprint=layout.fingerprint,
            overwrite=self.overwrite,
            inputs=layout.inputs,
            replace_check=self.replace_check,
        ) as staging:
            yield FolderOutput(staging, layout, self.depth)

    @contextmanager
    def join(self, layout: Layout, handle: dict, rank: int) -> Iterator["FolderOutput"]:
        """The staging folder another process opened, as rank ``rank`` writes shards into it: each one it finishes
        is recorded in its own manifest there, and it never creates, removes or commits the folder.

        Args:
            layout: the shards (the same on every rank).
            handle: the leader's :meth:`FolderOutput.handle`.
            rank: this process's rank.

        Returns:
            A context manager yielding the :class:`FolderOutput`.
        """
        staging = Staging.joined(self.location, rank, handle["common"], layout.fingerprint, layout.inputs)
        yield FolderOutput(staging, layout, self.depth)


class FolderOutput:
    """An opened :class:`FolderSink` (:class:`~peft_shardmerge.engine.sink.Opened`): its staging folder, the shards
    written into it and their records.

    Args:
        staging: the :class:`~peft_shardmerge.output.staging.Staging`.
        layout: the shards.
        depth: blocks queued to each shard's writer thread.
    """

    def __init__(self, staging: Staging, layout: Layout, depth: int = 2):
        self.staging, self.layout, self.depth = staging, layout, depth
        self.names = [name for name, _ in layout.parts]
        self.records: dict[str, dict] = {}

    @property
    def done(self) -> set[int]:
        """The shards finished in the staging folder: when opened, those an earlier run finished and this one keeps;
        later, those written and adopted too."""
        return {i for i, name in enumerate(self.names) if self.staging.is_done(name)}

    def handle(self) -> dict:
        """The staging folder, its kept shards and the digest of the common inputs, for the other ranks."""
        return {"path": self.staging.path, "done": sorted(self.done), "common": self.staging.common}

    def written(self) -> dict:
        """This process's shard records and the staging records of the shards it finished."""
        return {"records": self.records, "done": self.staging.done}

    def adopt(self, written: dict) -> None:
        """Take over another process's shards: their records, and their entries in the staging manifest."""
        self.records.update(written["records"])
        self.staging.adopt(written["done"])

    def progress(self, i: int) -> int:
        """The bytes of shard ``i`` on disk so far (:func:`written_bytes`)."""
        return written_bytes(os.path.join(self.staging.path, self.names[i]))

    def write(self, parts: list[int], produce: Callable[[int, ShardWriter], None]) -> None:
        """Write the shards ``parts`` into the staging folder, each recorded in the staging manifest once fsynced;
        ``records`` gets each one's record.

        Args:
            parts: the shard indexes, in order.
            produce: ``produce(i, writer)`` writes shard ``i``'s tensors.

        Returns:
            None.
        """
        # one thread reads the inputs' digests beside each shard; another closes a finished shard (its writes drained
        # and fsynced, then recorded in the manifest) while the next one is produced. When the merge stops, both
        # stop at their next step: the error (a Ctrl-C, say) is raised at once, not after an fsync or a long read.
        stopping = threading.Event()
        working_set = sum(
            n for (name, _), n in zip(self.layout.parts, self.layout.io_bytes or []) if not self.staging.is_done(name)
        )  # every rank's, on one machine: the filesystems written past the page cache are local ones
        with (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="input-digest") as digests,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-close") as closer,
        ):
            closing: list[tuple[Future, ShardWriter]] = []
            try:
                for i in parts:
                    name, entries = self.layout.parts[i]
                    inputs = None
                    if self.staging.inputs is not None:
                        inputs = digests.submit(self.staging.inputs.shard, name, stop=stopping)
                    w = ShardWriter(
                        os.path.join(self.staging.path, name), entries, depth=self.depth, working_set=working_set
                    )
                    try:
                        produce(i, w)
                    except BaseException:
                        w.abort()
                        raise
                    closing.append((closer.submit(self._close, name, w, inputs, stopping), w))
                    if len(closing) > 1:
                        closing.pop(0)[0].result()  # the shard before: a failure to close it stops the merge here
                while closing:
                    closing.pop(0)[0].result()
            except BaseException:
                stopping.set()
                raise
            finally:
                for future, w in closing:
                    if future.cancel():
                        w.abort()

    def finish(self, finish: Finish) -> None:
        """The index, config, side files, the caller's hook and the record; then the checks, and every shard's
        header read back against the layout.

        Args:
            finish: what the folder holds besides its shards.

        Raises:
            MergeCheckError: a written header differs from the layout, or a check failed.
        """
        tmp = self.staging.path
        write_beside(tmp, finish, len(self.layout.parts), self.records)
        check_written(tmp, [(name, [(n, d, s) for n, d, s, _ in entries]) for name, entries in self.layout.parts])

    def _close(self, name: str, w: ShardWriter, inputs: Future | None, stopping: threading.Event) -> None:
        """Drain and fsync a produced shard, then record it (in order: the one closing thread does it); a merge that
        is stopping leaves it unrecorded."""
        if stopping.is_set():
            w.abort()
            return
        try:
            w.close()
        except BaseException:
            w.abort()
            raise
        digest = inputs.result() if inputs is not None else None
        if stopping.is_set():
            return
        record = w.record()
        self.staging.record(name, shard_digest(record), inputs=digest)
        self.records[name] = record
        log.debug("%s written", name)


def write_beside(folder: str, finish: Finish, parts: int, records: dict[str, dict]) -> None:
    """What an output holds besides its shards, written into ``folder``: the index (of several shards), the config,
    the side files and the caller's hook, then the merge record (last: it lists them); then the checks.

    Args:
        folder: the folder being written.
        finish: what to write and check.
        parts: how many shards the output has.
        records: the shards' records by name (:func:`~peft_shardmerge.output.record.write_merge_record`).

    Raises:
        MergeCheckError: a check failed.
    """
    if parts > 1 and finish.index is not None:
        write_json(os.path.join(folder, "model.safetensors.index.json"), finish.index)
    write_json(os.path.join(folder, "config.json"), finish.config)
    if finish.side_files is not None:
        finish.side_files(folder)
    if finish.before_commit is not None:
        finish.before_commit(folder)
    write_merge_record(folder, records, finish.merge_info())
    for check in finish.checks:
        check()


def check_written(folder: str, shards: list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]) -> None:
    """Read back every written shard's header and compare it with what was planned.

    Args:
        folder: where the shards are.
        shards: ``(file name, [(tensor name, dtype, shape), ...])`` per shard, in write order.

    Returns:
        None.

    Raises:
        MergeCheckError: a header differs from the plan or lacks ``{"format": "pt"}``.
        CorruptFileError: a written file is not valid safetensors.
    """
    for shard_name, want in shards:
        infos, meta = read_header(os.path.join(folder, shard_name))
        got = [(t.name, t.dtype, t.shape) for t in infos]
        if got != [(n, d, tuple(s)) for n, d, s in want] or meta.get("format") != "pt":
            raise MergeCheckError(f"{shard_name}: written header does not match the plan")


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
