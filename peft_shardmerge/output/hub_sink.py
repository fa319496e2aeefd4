"""A merge pushed to the Hub as it is made: each shard uploaded by content once written and deleted here, a journal
of the uploaded ones for a rerun, then one commit of every file."""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator

from ..engine.sink import Finish, Layout
from ..errors import HubUploadError, InputError
from ..io.safetensors_io import build_header
from .files import PUSH_MARK
from .hub_push import HubSession, HubTarget, folder_operations, hub_bars
from .hub_staging import PushJournal, bytes_under, folder_problems, journal_path, staged_push, staging_folder
from .shard_sink import check_written, write_beside
from .writer import ShardWriter

log = logging.getLogger(__name__)


class HubSink:
    """A merge pushed to a Hub repository (:class:`~peft_shardmerge.engine.sink.Sink`) with a bounded local disk.

    Each shard is written into a staging folder, its SHA-256 taken as it is written; once complete and its header
    checked, it is uploaded by content (huggingface_hub's ``preupload_lfs_files``) while the next one is merged, and
    deleted here when the server has it. At most ``in_flight`` shards are on disk at once: the next one waits for
    room. When every shard is up, the index, config, tokenizer and other files, the model card and the merge record
    are written beside them and one commit names every file. Until that commit the repository shows nothing new; a
    failure leaves it as it was (the uploaded objects are invisible). A journal beside the staging folder lists the
    shards the server confirmed: a rerun of the same merge neither merges nor uploads them again.

    Args:
        target: the repository and how to commit (:class:`~peft_shardmerge.output.hub_push.HubTarget`).
        staging: the folder shards wait in for their upload (a folder of the push's own is made in it).
        in_flight: the most shards on disk at once (one being merged, the others being uploaded).
        side_bytes: the most the files besides the shards may take (the bound's second term).
        prepare: called once the staging folder is found big enough, before anything is merged: the repository
            made and its access checked (it returns the full repository id); None: done already.
        replace: delete, in the same commit, the repository's weight files this push does not write (an earlier
            push's other shards); else a repository holding such files is refused before anything is merged.
    """

    label = "merging and pushing"

    def __init__(
        self,
        target: HubTarget,
        staging: str,
        *,
        in_flight: int = 2,
        side_bytes: int = 0,
        prepare: Callable[[], str] | None = None,
        replace: bool = False,
    ):
        if in_flight < 1:
            raise InputError(f"in_flight must be 1 or more, got {in_flight}")
        self.target, self.staging, self.in_flight, self.side_bytes = target, staging, in_flight, side_bytes
        self.prepare, self.replace = prepare, replace
        self.location = target.url
        self.folder = staging_folder(staging, target.repo_id)
        self.commit_url: str | None = None

    def bound(self, layout: Layout) -> int:
        """The most bytes the push holds in the staging folder: ``in_flight`` of its largest shards (header
        included) and the files besides them."""
        largest = max(
            len(build_header(entries, {"format": "pt"})) + sum(e[3] for e in entries) for _, entries in layout.parts
        )
        return min(self.in_flight, len(layout.parts)) * largest + self.side_bytes

    def problems(self, layout: Layout) -> list[str]:
        """What stands in the way before anything is merged: a staging folder that cannot hold the bound, or a thing
        at the push's folder name that a push of ours did not make."""
        where = self.staging
        problems = folder_problems(self.folder)
        if problems:
            return problems
        if not os.access(where, os.W_OK):
            return [f"cannot write in the staging folder {where}; pass another (--staging DIR)"]
        held = bytes_under(self.folder) if os.path.isfile(os.path.join(self.folder, PUSH_MARK)) else 0
        free = shutil.disk_usage(where).free + held
        need = self.bound(layout)
        if free < need:
            shards = min(self.in_flight, len(layout.parts))
            return [
                f"the staging folder {where} has {_size(free)} free; pushing this merge holds at most {_size(need)} "
                f"there ({shards} shard(s) of at most {_size((need - self.side_bytes) // shards)} and "
                f"{_size(self.side_bytes)} for the files beside them): free some space, pass a smaller max_shard_size "
                "(--max-shard-size), or another staging folder (--staging DIR)"
            ]
        return []

    @contextmanager
    def open(self, layout: Layout) -> Iterator["HubOutput"]:
        """The staging folder, locked and emptied of what an earlier run of ours left; the commit when the block
        ends; on a failure, no commit, the staging folder emptied and the journal kept for a rerun.

        Args:
            layout: the shards.

        Returns:
            A context manager yielding the :class:`HubOutput`.

        Raises:
            InputError: the staging folder cannot hold the bound, or its name is taken by something not ours.
            HubUploadError: an upload or the commit failed (nothing committed).
        """
        problems = self.problems(layout)
        if problems:
            raise InputError(problems)
        if self.prepare is not None:
            self.target.repo_id = self.prepare()
            self.location = self.target.url
        with staged_push(self.folder), hub_bars(self.target.progress):
            session = HubSession(self.target)
            written = {name for name, _ in layout.parts} | ({INDEX} if len(layout.parts) > 1 else set())
            deleted = session.stale_weights(written, self.replace)
            key = {"repo": self.target.repo_id, "revision": self.target.revision, "fingerprint": layout.fingerprint}
            if layout.inputs is not None:
                key["inputs"] = layout.inputs.common()
            journal = PushJournal(journal_path(self.folder), key)
            out = HubOutput(self, layout, session, journal)
            yield out
            self.commit_url = out.commit(deleted)
        journal.remove()


class HubOutput:
    """An opened :class:`HubSink` (:class:`~peft_shardmerge.engine.sink.Opened`): shards written, uploaded and
    deleted, at most ``in_flight`` on disk; then the other files and the commit.

    Args:
        sink: the sink.
        layout: the shards.
        session: the Hub calls.
        journal: the uploaded shards, kept for a rerun.
    """

    def __init__(self, sink: HubSink, layout: Layout, session: HubSession, journal: PushJournal):
        self.sink, self.layout, self.session, self.journal = sink, layout, session, journal
        self.folder = sink.folder
        self.names = [name for name, _ in layout.parts]
        self.ops: dict[str, object] = {}
        self.records: dict[str, dict] = {}
        self.sha: dict[str, str] = {}
        self.failure: BaseException | None = None  # an upload's, seen by the merging thread before its future
        self.kept: set[str] = set()
        self.done = self._kept() if layout.fingerprint is not None else set()

    def _kept(self) -> set[int]:
        """The shards an earlier run uploaded that this one keeps: computed from the same input bytes, and held by
        the server."""
        earlier = self.journal.load()
        same = {}
        for name, entry in earlier.items():
            if name not in self.names:
                continue
            if self.layout.inputs is not None and entry.get("inputs") != self.layout.inputs.shard(name):
                continue
            same[name] = entry
        held = self.session.stored({e["sha256"]: e["size"] for e in same.values()})
        kept = set()
        for name, entry in same.items():
            if entry["sha256"] in held:
                self.ops[name] = self.session.uploaded(name, entry["size"], entry["sha256"])
                self.records[name] = entry["record"]
                self.journal.shards[name] = entry
                self.kept.add(name)
                kept.add(self.names.index(name))
        if kept:
            log.info("%d shard(s) already uploaded by an earlier run: neither merged nor sent again", len(kept))
        return kept

    def write(self, parts: list[int], produce: Callable[[int, ShardWriter], None]) -> None:
        """Write the shards ``parts`` in order, each uploaded (on one thread) while the next is merged, and deleted
        once the server has it; a shard waits for room while ``in_flight`` are on disk.

        Args:
            parts: the shard indexes, in order.
            produce: ``produce(i, writer)`` writes shard ``i``'s tensors.

        Raises:
            HubUploadError: an upload failed.
        """
        room = threading.Semaphore(self.sink.in_flight)
        stopping = threading.Event()
        uploads = Uploader(self._upload)
        pending: list[Future] = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="input-digest") as digests:
            try:
                for i in parts:
                    while not room.acquire(timeout=0.2):  # an upload that failed meanwhile stops the merge here
                        self._raise_failed(pending)
                    try:
                        self._raise_failed(pending)
                    except BaseException:
                        room.release()
                        raise
                    inputs = None
                    if self.layout.inputs is not None and self.layout.fingerprint is not None:
                        inputs = digests.submit(self.layout.inputs.shard, self.names[i], stop=stopping)
                    path = self._written(i, produce, room)
                    pending.append(uploads.submit(i, path, room, inputs))
                    log.debug("%s written; uploading", self.names[i])
                for future in pending:
                    future.result()
            except HubUploadError as e:
                stopping.set()  # the digests stop at their next read, before the pool is left
                raise self._resumable(e) from None
            except BaseException:
                stopping.set()
                raise
            finally:
                for future in pending:
                    future.cancel()
                uploads.close()

    def _raise_failed(self, pending: list[Future]) -> None:
        """Raise the failure of an upload, if one failed."""
        if self.failure is not None:
            raise self.failure
        for future in pending:
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise future.exception()

    def _resumable(self, error: HubUploadError) -> HubUploadError:
        """An upload's error, with what a rerun keeps."""
        kept = len(self.journal.shards)
        if self.layout.fingerprint is None or not kept:
            return error
        return HubUploadError(
            f"{error}. The {kept} shard(s) uploaded so far are kept: the same call run again neither merges nor sends "
            f"them (the journal {self.journal.path})"
        )

    def _written(self, i: int, produce: Callable[[int, ShardWriter], None], room: threading.Semaphore) -> str:
        """Shard ``i`` written into the staging folder, closed and its header checked; its record kept."""
        name, entries = self.layout.parts[i]
        path = os.path.join(self.folder, name)
        try:
            w = ShardWriter(path, entries, file_digest=True)
        except BaseException:
            room.release()
            raise
        try:
            produce(i, w)
            w.close()
            check_written(self.folder, [(name, [(n, d, s) for n, d, s, _ in entries])])
        except BaseException:
            w.abort()
            _remove(path)
            room.release()
            raise
        self.records[name] = w.record()
        self.sha[name] = w.sha256()
        return path

    def _upload(self, i: int, path: str, room: threading.Semaphore, inputs: Future | None) -> None:
        """Upload shard ``i`` by content and delete it here (its room freed at once); then journal it."""
        name = self.names[i]
        try:
            op = self.session.upload(path, name, self.sha[name])
            if op._should_ignore:
                raise HubUploadError(
                    f"the .gitignore of {self.sink.target.repo_id} leaves out {name}: the commit would miss it. "
                    "Nothing was committed; remove that pattern from the repository's .gitignore, then push again"
                )
            if op._upload_mode != "lfs":  # a small shard the repository keeps in git: it goes with the commit
                with open(path, "rb") as f:
                    op.path_or_fileobj = f.read()
        except BaseException as e:
            self.failure = e
            raise
        finally:
            _remove(path)
            room.release()
        self.ops[name] = op
        if op._upload_mode == "lfs" and self.layout.fingerprint is not None:
            entry = {"sha256": op.upload_info.sha256.hex(), "size": op.upload_info.size, "record": self.records[name]}
            if inputs is not None:
                entry["inputs"] = inputs.result()
            if entry.get("inputs") != "stopped":
                self.journal.add(name, entry)

    def finish(self, finish: Finish) -> None:
        """The index, config, side files, the caller's hook (the model card) and the merge record, written into the
        staging folder once every shard is up; then the checks.

        Args:
            finish: what the output holds besides its shards.
        """
        write_beside(self.folder, finish, len(self.layout.parts), {name: self.records[name] for name in self.names})

    def commit(self, deleted: list[str]) -> str:
        """One commit: every shard (uploaded) and every other file of the staging folder, and the repository's
        weight files this push replaces deleted.

        Args:
            deleted: those files.

        Returns:
            The commit's URL.
        """
        ops = [self.ops[name] for name in self.names]
        ops += folder_operations(self.folder, skip=set(self.ops))
        try:
            url = self.session.commit(ops, deleted)
        except HubUploadError as e:
            if not getattr(e, "refused", False) or not self.kept:
                raise
            for name in self.kept:  # an earlier run's upload the Hub no longer holds: merged and sent again next time
                self.journal.shards.pop(name, None)
            self.journal.rewrite()
            raise HubUploadError(
                f"{e} The commit named {len(self.kept)} shard(s) an earlier run uploaded; they are dropped from the "
                f"journal ({self.journal.path}): the same call run again merges and sends them"
            ) from None
        log.info("pushed %d files to %s in one commit", len(ops), self.sink.target.url)
        return url


class Uploader:
    """One thread that runs the uploads in turn, each a ``Future``. It is a daemon thread, not joined: a merge
    stopped by an error or Ctrl-C does not wait for the upload under way (it ends with the process; nothing is
    committed without the commit).

    Args:
        upload: called with each :meth:`submit`'s arguments.
    """

    def __init__(self, upload: Callable[..., None]):
        self.upload = upload
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hub-upload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.upload(*args))
            except BaseException as e:  # handed to the merging thread through the future
                future.set_exception(e)

    def submit(self, *args) -> Future:
        """Queue an upload."""
        future: Future = Future()
        self._queue.put((future, args))
        return future

    def close(self) -> None:
        """No more uploads: the thread ends once the queued ones are done or cancelled."""
        self._queue.put(None)


#: the index a sharded output writes
INDEX = "model.safetensors.index.json"


def _size(nbytes: int) -> str:
    """Bytes as a person reads them (MB below a GB).

    Example:
        >>> _size(1_500_000), _size(2_500_000_000)
        ('1.5 MB', '2.50 GB')
    """
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**9 else f"{nbytes / 1e6:.1f} MB"


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
