"""The output folder of a merge: shards streamed from a producer, index, config, side files, record, checks, commit."""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import MergeCheckError
from ..io.safetensors_io import read_header
from .record import write_merge_record
from .staging import staged_output
from .writer import ShardWriter, shard_digest, write_json

#: ``(name, safetensors dtype, shape, nbytes)`` of one output tensor
Entry = tuple[str, str, tuple[int, ...], int]

log = logging.getLogger(__name__)


@dataclass
class FolderFiles:
    """What a merged folder holds besides its shards, written after them and before the record.

    Attributes:
        config: the ``config.json`` content.
        index: the ``model.safetensors.index.json`` content (written when there is more than one shard).
        side_files: called with the staging folder to copy the base's other files (tokenizer, generation config).
        before_commit: the caller's hook, called with the staging folder after the side files.
        merge_info: returns the ``merge`` part of ``merge_manifest.json``.
        checks: called before the headers are read back (e.g. each LoRA layer applied exactly once).
    """

    config: dict
    index: dict | None = None
    side_files: Callable[[str], None] | None = None
    before_commit: Callable[[str], None] | None = None
    merge_info: Callable[[], dict] = dict
    checks: list[Callable[[], None]] = field(default_factory=list)


class ShardSink:
    """Writes a merged checkpoint folder through :func:`~peft_shardmerge.output.staging.staged_output`.

    Each shard's header is built from the planned entries before any data; a producer streams the data into a
    :class:`~peft_shardmerge.output.writer.ShardWriter`. The folder appears at ``out_dir`` only once complete and
    checked; on any failure ``out_dir`` is left as it was.

    Args:
        out_dir: the output folder.
        shards: ``(file name, [entry, ...])`` per shard, in write order.
        overwrite: whether a non-empty ``out_dir`` may be replaced (checked again under the output lock).
        fingerprint: identity of the merge for resuming (None: never resume).
        inputs: digests of the inputs per shard (:class:`~peft_shardmerge.output.resume.InputDigests`), for resuming.
        depth: blocks queued to the writer thread.
        io_bytes: per shard, the bytes the merge reads from disk and writes for it; those of the shards not done yet
            are the working set the writes past the page cache are chosen by
            (:func:`~peft_shardmerge.output.direct.wanted`; None: not known).
        replace_check: with ``overwrite``, the problems that forbid replacing a non-empty ``out_dir``, checked again
            under the output lock (see :func:`~peft_shardmerge.output.staging.staged_output`); None: an earlier
            output of ours may be replaced.

    Example:
        >>> import os, tempfile
        >>> from safetensors.torch import load_file
        >>> out = os.path.join(tempfile.mkdtemp(), "merged")
        >>> sink = ShardSink(out, [("model.safetensors", [("w", "F32", (2,), 8)])], overwrite=False)
        >>> sink.write(lambda i, w: w.write(torch.ones(2)), FolderFiles(config={}))
        >>> sorted(os.listdir(out)), load_file(os.path.join(out, "model.safetensors"))["w"]
        (['config.json', 'merge_manifest.json', 'model.safetensors'], tensor([1., 1.]))
    """

    def __init__(
        self,
        out_dir: str,
        shards: list[tuple[str, list[Entry]]],
        *,
        overwrite: bool,
        fingerprint: str | None = None,
        inputs=None,
        depth: int = 2,
        io_bytes: list[int] | None = None,
        replace_check: Callable[[str], list[str]] | None = None,
    ):
        self.out_dir = out_dir
        self.shards = shards
        self.overwrite = overwrite
        self.replace_check = replace_check
        self.fingerprint = fingerprint
        self.inputs = inputs
        self.depth = depth
        self.io_bytes = io_bytes
        self.resumed: list[str] = []
        self.records: dict[str, dict] = {}

    def write(
        self,
        produce: Callable[[int, ShardWriter], None],
        files: FolderFiles,
        skip: Callable[[int], None] | None = None,
        ranks=None,
    ) -> None:
        """Write every shard, then the folder's other files; check it and move it into place.

        Args:
            produce: ``produce(i, writer)`` writes the data of shard ``i``'s tensors, in header order.
            files: what else the folder holds.
            skip: ``skip(i)`` is called instead of ``produce`` for a shard kept from an interrupted run.
            ranks: on rank 0 of a distributed merge, the other ranks' side
                (:class:`~peft_shardmerge.distributed.ranks.OtherRanks`): ``opened(staging)`` returns the shards this
                rank writes (None: all), ``gathered(staging, records)`` waits for the rest, ``stopped(error)``
                makes the others stop and waits for them when this rank fails while writing.

        Returns:
            None; ``resumed`` lists the kept shards and ``records`` the record of each shard written.

        Raises:
            MergeCheckError: a written header differs from the plan, or a check failed.
            InputError: ``out_dir`` became non-empty and ``overwrite`` is False.
            OSError: the filesystem failed; nothing is left behind.
        """
        with (
            staged_output(
                self.out_dir,
                fingerprint=self.fingerprint,
                overwrite=self.overwrite,
                inputs=self.inputs,
                replace_check=self.replace_check,
            ) as staging,
            torch.no_grad(),
        ):
            tmp = staging.path
            mine = None if ranks is None else ranks.opened(staging)
            try:
                self.write_shards(staging, produce, skip, mine)
            except BaseException as e:
                if ranks is not None:  # the other ranks stop first: nobody writes into the folder as it goes
                    ranks.stopped(e)
                raise
            if ranks is not None:
                ranks.gathered(staging, self.records)
            self.resumed = list(staging.resumed)
            self._finish(tmp, files)

    def write_shards(
        self,
        staging,
        produce: Callable[[int, ShardWriter], None],
        skip: Callable[[int], None] | None = None,
        mine=None,
    ) -> None:
        """Write the shards that are not done yet into ``staging`` (all, or those in ``mine``), each recorded in the
        staging manifest once fsynced; ``records`` gets each one's record.

        Args:
            staging: the :class:`~peft_shardmerge.output.staging.Staging` (rank 0's, or another rank's
                :meth:`~peft_shardmerge.output.staging.Staging.joined`).
            produce: ``produce(i, writer)`` writes shard ``i``'s tensors.
            skip: called for a shard kept from an interrupted run.
            mine: the shard indexes this process writes (None: every one).

        Returns:
            None.
        """
        # one thread reads the inputs' digests beside each shard; another closes a finished shard (its writes drained
        # and fsynced, then recorded in the manifest) while the next one is produced. When the merge stops, both
        # stop at their next step: the error (a Ctrl-C, say) is raised at once, not after an fsync or a long read.
        stopping = threading.Event()
        working_set = sum(
            n for (name, _), n in zip(self.shards, self.io_bytes or []) if not staging.is_done(name)
        )  # every rank's, on one machine: the filesystems written past the page cache are local ones
        with (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="input-digest") as digests,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-close") as closer,
        ):
            closing: list[tuple[Future, ShardWriter]] = []
            try:
                for i, (name, entries) in enumerate(self.shards):
                    if staging.is_done(name):
                        if skip is not None:
                            skip(i)
                        continue
                    if mine is not None and i not in mine:
                        continue
                    inputs = None
                    if staging.inputs is not None:
                        inputs = digests.submit(staging.inputs.shard, name, stop=stopping)
                    w = ShardWriter(
                        os.path.join(staging.path, name), entries, depth=self.depth, working_set=working_set
                    )
                    try:
                        produce(i, w)
                    except BaseException:
                        w.abort()
                        raise
                    closing.append((closer.submit(self._close, staging, name, w, inputs, stopping), w))
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

    def _close(self, staging, name: str, w: ShardWriter, inputs: Future | None, stopping: threading.Event) -> None:
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
        staging.record(name, shard_digest(record), inputs=digest)
        self.records[name] = record
        log.debug("%s written", name)

    def _finish(self, tmp: str, files: FolderFiles) -> None:
        if len(self.shards) > 1 and files.index is not None:
            write_json(os.path.join(tmp, "model.safetensors.index.json"), files.index)
        write_json(os.path.join(tmp, "config.json"), files.config)
        if files.side_files is not None:
            files.side_files(tmp)
        if files.before_commit is not None:
            files.before_commit(tmp)
        write_merge_record(tmp, self.records, files.merge_info())
        for check in files.checks:
            check()
        check_written(tmp, [(name, [(n, d, s) for n, d, s, _ in entries]) for name, entries in self.shards])


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
