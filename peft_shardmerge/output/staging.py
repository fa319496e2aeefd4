"""The output folder's life: the lock, the staging folder with its resume manifest, the commit, and what became
of OUT when a merge stops."""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import stat
from contextlib import contextmanager
from typing import Callable, Iterator

from ..errors import CorruptFileError, FileSystemError, InputError, OutputChangedError, ShardMergeError
from .files import (
    MADE_BY,
    MANIFEST,
    describe_change,
    held_signals,
    kill_point,
    kill_point_reset,
    read_manifest,
    remove_checked,
    rename_noreplace,
    sidecar,
    sidecar_problems,
    snapshot,
)
from .lock import OutputLock, output_lock  # noqa: F401 - output_lock: public here too
from .record import shard_record
from .recovery import drop_manifest, fsync_dir, lstat_or_none, recover_commit, write_manifest
from .replace import replace_problems
from .writer import shard_digest

log = logging.getLogger(__name__)

NOTHING_WRITTEN = "nothing was written and OUT is unchanged"
REMOVED = "the partial output was removed and OUT is unchanged"
#: the manifest in which rank N of a distributed merge records the shards it finished
RANK_MANIFEST = re.compile(r"manifest\.rank-\d+\.json")
#: what became of each output folder (by absolute path) in the last merge into it from this process
_OUTCOME: dict[str, str] = {}


def outcome(out_dir: str) -> str:
    """What became of ``out_dir`` in the last merge into it from this process: one true sentence for a message
    after an error or an interrupt.

    Args:
        out_dir: the output folder as given.

    Returns:
        E.g. ``"the partial output was removed and OUT is unchanged"``.

    Example:
        >>> outcome("/nowhere/merged")
        'nothing was written and OUT is unchanged'
    """
    try:
        return _OUTCOME.get(os.path.abspath(os.fspath(out_dir)), NOTHING_WRITTEN)
    except TypeError:
        return NOTHING_WRITTEN


def partial_dir(out_dir: str) -> str:
    """The staging folder of ``out_dir``: ``.<name>.partial`` beside it (same filesystem, so the commit is a
    rename).

    Args:
        out_dir: the output folder.

    Returns:
        The staging folder's path.

    Example:
        >>> partial_dir("/data/merged/")
        '/data/.merged.partial'
    """
    return sidecar(out_dir, "partial")


def file_digest(path: str) -> str:
    """The digest of a finished shard read back from the file: :func:`~peft_shardmerge.output.writer.shard_digest` of
    its record, as the writer's record gave it while writing.

    Args:
        path: a finished shard.

    Returns:
        64 hex characters, or ``""`` when the file is not valid safetensors (no shard of ours matches it).

    Raises:
        OSError: the file cannot be read (missing, a folder, no permission).

    Example:
        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> import torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> save_file({"w": torch.ones(2)}, path)
        >>> len(file_digest(path)), file_digest(__file__)
        (64, '')
    """
    try:
        return shard_digest(shard_record(path))
    except CorruptFileError:
        return ""


class Staging:
    """A staging folder for ``out_dir`` that remembers finished shards across a crash.

    The folder is created with ``mkdir`` and marked at once by ``manifest.json``; an existing one is reused only
    when that manifest proves it ours (else the merge is refused). With a ``fingerprint`` and ``inputs`` (digests
    of the input bytes each shard is computed from, :class:`~peft_shardmerge.output.resume.InputDigests`), shards
    recorded by an earlier run that died are kept when their size, their digest and the digest of their inputs
    still match; the rest is redone.

    Args:
        out_dir: the final folder.
        fingerprint: identity of the merge; None disables resuming.
        inputs: digests of the inputs (``common()`` and ``shard(name)``); None disables resuming.
    """

    def __init__(self, out_dir: str, fingerprint: str | None, inputs=None):
        self.out_dir = os.path.abspath(os.fspath(out_dir))
        self.path = partial_dir(self.out_dir)
        self.fingerprint = fingerprint if inputs is not None else None
        self.inputs = inputs if fingerprint is not None else None
        self.common = None
        self.done: dict[str, dict] = {}
        self.resumed: list[str] = []
        self.created = self.committed = self.keep = self.rerun = False
        self.checked: dict | None = None  # OUT's snapshot when checked (None: it did not exist)
        self.leftover: str | None = None
        self.manifest = MANIFEST

    @classmethod
    def joined(cls, out_dir: str, rank: int, common: str | None, fingerprint: str | None, inputs=None) -> "Staging":
        """The staging folder rank 0 of a distributed merge opened, as another rank writes into it: the shards it
        finishes are recorded in its own ``manifest.rank-N.json`` (the same records rank 0 keeps), and it never
        creates, removes or commits the folder.

        Args:
            out_dir: the final folder (the same path on every rank).
            rank: this rank.
            common: the digest of the common inputs rank 0 computed when it opened the folder.
            fingerprint: identity of the merge; None disables resuming.
            inputs: digests of the inputs per shard.

        Returns:
            The :class:`Staging`.

        Example:
            >>> Staging.joined("/data/merged", 1, None, None).manifest
            'manifest.rank-1.json'
        """
        staging = cls(out_dir, fingerprint, inputs)
        staging.manifest, staging.common = f"manifest.rank-{rank}.json", common
        return staging

    def open(self) -> None:
        """Create the staging folder, or reuse the verified finished shards of a matching earlier run."""
        kept: dict[str, dict] = {}
        st = lstat_or_none(self.path)
        if st is None:
            os.mkdir(self.path, 0o755)
        else:
            manifest = read_manifest(self.path) if stat.S_ISDIR(st.st_mode) else None
            if manifest is None and (not stat.S_ISDIR(st.st_mode) or os.listdir(self.path)):
                raise InputError(sidecar_problems(self.out_dir) or [f"{self.path} is not a staging folder of ours"])
            if self.inputs is not None:
                self.common = self.inputs.common()
            if (
                manifest
                and self.fingerprint
                and manifest.get("fingerprint") == self.fingerprint
                and manifest.get("inputs") == self.common
            ):
                for fname, meta in self._recorded(manifest).items():
                    p = os.path.join(self.path, os.path.basename(fname))
                    s = lstat_or_none(p)
                    if (
                        s is not None
                        and stat.S_ISREG(s.st_mode)
                        and s.st_size == meta.get("size")
                        and file_digest(p) == meta.get("digest")
                        and meta.get("inputs") == self.inputs.shard(fname)
                    ):
                        kept[fname] = meta
            for entry in os.listdir(self.path):  # the folder is ours (manifest checked): clear what is not kept
                if entry not in kept and entry != MANIFEST:
                    p = os.path.join(self.path, entry)
                    s = os.lstat(p)
                    shutil.rmtree(p) if stat.S_ISDIR(s.st_mode) else os.unlink(p)
        self.created = True
        if self.inputs is not None and self.common is None:
            self.common = self.inputs.common()
        self.done = kept
        self.resumed = sorted(kept)
        if kept:
            log.info("resuming: %d finished shard(s) kept from an interrupted run", len(kept))
        self._write_manifest()

    def _recorded(self, manifest: dict) -> dict[str, dict]:
        """The shards a matching earlier run recorded: in the manifest, and each rank of a distributed run in its
        own."""
        shards = dict(manifest.get("shards") or {})
        for entry in sorted(os.listdir(self.path)):
            part = read_manifest(self.path, entry) if RANK_MANIFEST.fullmatch(entry) else None
            if part and part.get("fingerprint") == self.fingerprint and part.get("inputs") == self.common:
                shards.update(part.get("shards") or {})
        return shards

    def adopt(self, shards: dict[str, dict]) -> None:
        """Take over the shards the other ranks of a distributed merge finished, and drop their own manifests.

        Args:
            shards: file name -> ``{"size", "digest", "inputs"}`` as each rank recorded it.
        """
        if self.fingerprint:
            self.done.update(shards)
            self._write_manifest()
        for entry in os.listdir(self.path):
            if RANK_MANIFEST.fullmatch(entry.removesuffix(".tmp")):
                os.unlink(os.path.join(self.path, entry))

    def is_done(self, fname: str) -> bool:
        """Whether shard ``fname`` was finished and verified by an earlier run, from the same input bytes."""
        return fname in self.done

    def record(self, fname: str, digest: str, inputs: str | None = None) -> None:
        """Record a finished, fsynced shard in the manifest (written atomically), with the digest of its inputs
        (``inputs``, when the caller computed it already)."""
        size = os.path.getsize(os.path.join(self.path, fname))
        meta = {"size": size, "digest": digest}
        if self.inputs is not None:
            meta["inputs"] = inputs if inputs is not None else self.inputs.shard(fname)
        self.done[fname] = meta
        self._write_manifest()

    def _manifest(self) -> dict:
        return {
            "made_by": MADE_BY,
            "fingerprint": self.fingerprint,
            "inputs": self.common,
            "shards": self.done if self.fingerprint else {},
        }

    def _write_manifest(self) -> None:
        write_manifest(os.path.join(self.path, self.manifest), self._manifest())

    def commit(self, lock: OutputLock | None = None) -> None:
        """Move the staging folder into place, replacing OUT only if it still holds exactly what was checked.

        The previous OUT is renamed aside and then only the entries recorded when it was checked are deleted;
        anything added meanwhile stays there and is named in a warning. With ``lock``, a journal of the commit in
        the lock's record lets the next merge finish or undo a commit cut short by SIGKILL.

        Raises:
            OutputChangedError: OUT changed since it was checked; OUT is left as it is and the new output kept.
        """
        parent = os.path.dirname(self.out_dir)
        st = lstat_or_none(self.out_dir)
        now = None
        if st is not None and self.checked is not None and stat.S_ISDIR(st.st_mode):
            now = snapshot(self.out_dir)
        if (st is None) != (self.checked is None) or (self.checked is not None and now != self.checked):
            self.keep = True
            what = (
                "it was removed"
                if st is None
                else "it appeared"
                if self.checked is None
                else "it is no longer a folder"
                if now is None
                else describe_change(self.checked, now)
            )
            raise OutputChangedError(
                f"{self.out_dir} changed while the merge ran ({what}); it was left exactly as it is and the new "
                f"output is kept in {self.path}: move your files out of the way and run the same command again"
                + (" (the finished shards are reused)" if self.fingerprint else "")
                + ", or choose another output folder"
            )
        old = sidecar(self.out_dir, f"old-{secrets.token_hex(4)}") if st is not None else None
        kill_point_reset()
        if lock is not None:  # the journal keeps the manifest, which leaves the folder before it becomes OUT
            journal = {"staging_ino": os.lstat(self.path).st_ino, "manifest": self._manifest()}
            if old:
                journal.update(old=os.path.basename(old), old_ino=st.st_ino, old_dev=st.st_dev, snapshot=self.checked)
            lock.note(commit=journal)
            kill_point("commit: journal written")
        drop_manifest(self.path)  # the staging folder is now, file for file, the new output
        if old:
            rename_noreplace(self.out_dir, old)
            kill_point("commit: rename previous output aside")
        try:
            rename_noreplace(self.path, self.out_dir)
        except BaseException:
            if old:
                rename_noreplace(old, self.out_dir)
            self._write_manifest()
            raise
        kill_point("commit: rename new output into place")
        self.committed = True
        fsync_dir(parent)
        kill_point("commit: fsync parent")
        if old:
            left = remove_checked(old, self.checked)
            if left:
                self.leftover = old
                log.warning(
                    "the previous output was replaced; what was added to it during the merge (%s) is kept in %s",
                    ", ".join(left[:5]),
                    old,
                )
        if lock is not None:
            lock.note(commit=None)
            kill_point("commit: journal cleared")

    def discard(self) -> None:
        """Remove the staging folder (ours: created by this run, or proven ours by its manifest)."""
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)

    def state(self) -> str:
        """One true sentence on what became of OUT."""
        if self.committed:
            return "the merge had finished: OUT holds the new, complete output" + (
                f" (what was added to the previous output during the merge is kept in {self.leftover})"
                if self.leftover
                else ""
            )
        if self.keep:
            return f"OUT was left as it is and the new output is kept in {self.path}"
        if self.rerun:
            return (
                f"OUT is unchanged and the finished shards are kept in {self.path}: run the same command again "
                "(with any number of ranks) to finish the merge"
            )
        if not self.created:
            return NOTHING_WRITTEN
        if os.path.lexists(self.path):
            return f"the partial output could not all be removed ({self.path} is left) and OUT is unchanged"
        return REMOVED


@contextmanager
def staged_output(
    out_dir: str,
    *,
    overwrite: bool,
    fingerprint: str | None = None,
    inputs=None,
    replace_check: Callable[[str], list[str]] | None = None,
) -> Iterator[Staging]:
    """Lock ``out_dir``, yield its :class:`Staging`, and move it into place when the block succeeds.

    On any exception (KeyboardInterrupt and SIGTERM included) the staging folder is removed and ``out_dir`` is
    left as it was; SIGINT and SIGTERM are held back while the staging folder is made, removed or committed, so
    that a second Ctrl-C cannot cut those steps in half. Only a process killed outright leaves the staging
    folder, for the next run to resume (and a journal in the lock, for the next run to finish a cut commit).
    :func:`outcome` then says what became of ``out_dir``.

    Args:
        out_dir: the final folder.
        fingerprint: identity of the merge, for resuming; None starts fresh every time.
        overwrite: whether a non-empty ``out_dir`` may be replaced (checked again under the lock, in case another
            merge finished in between); required, so that no caller forgets to pass its own.
        inputs: digests of the inputs each shard is computed from
            (:class:`~peft_shardmerge.output.resume.InputDigests`); resuming needs them.
        replace_check: with ``overwrite``, what may replace a non-empty ``out_dir``: called with it under the lock,
            it returns the problems that forbid replacing it (the Unsloth-style saves replace only their own earlier
            save, so a file that appeared since it was checked is never deleted); None: an earlier output of ours
            may be replaced, nothing else.

    Returns:
        A context manager yielding the :class:`Staging` (its ``path`` is where to write).

    Raises:
        OutputLockedError: another merge is writing ``out_dir``.
        OutputChangedError: ``out_dir`` changed while the merge ran; it was left as it is.
        InputError: ``out_dir`` became non-empty and ``overwrite`` is False, ``replace_check`` refuses it, or a
            name beside it is taken by something we did not make.
        FileSystemError: the filesystem failed (its message says what became of ``out_dir``).
    """
    out = os.path.abspath(os.fspath(out_dir))
    _OUTCOME[out] = NOTHING_WRITTEN
    lock = OutputLock(out)
    staging = Staging(out, fingerprint, inputs)
    try:
        with held_signals():
            lock.acquire()
            recover_commit(out, lock)
            problems = sidecar_problems(out)
            st = lstat_or_none(out)
            if st is not None:
                if not stat.S_ISDIR(st.st_mode):
                    problems.append(
                        f"output {out} appeared meanwhile and is not a folder; remove it or choose "
                        "another output folder"
                    )
                elif not overwrite and os.listdir(out):
                    problems.append(
                        f"output folder {out} is not empty (it changed since it was checked); pass "
                        "overwrite=True to replace it"
                    )
                elif replace_check is not None and os.listdir(out):
                    problems += replace_check(out)
                else:  # overwrite replaces an empty folder or an earlier output of ours, nothing else
                    problems += replace_problems(out)
            if problems:
                raise InputError(problems)
            staging.checked = snapshot(out) if st is not None else None
            staging.open()
        yield staging
        with held_signals():
            staging.commit(lock)
            _OUTCOME[out] = staging.state()
    except BaseException as e:
        with held_signals():
            if getattr(e, "keep_partial", False) and staging.created and staging.fingerprint:
                staging.rerun = True  # a distributed job lost a rank or was stopped: its finished shards stay
            elif not staging.committed and not staging.keep:
                staging.discard()
            _OUTCOME[out] = staging.state()
            if isinstance(e, OSError) and not isinstance(e, ShardMergeError):
                raise FileSystemError(e, _OUTCOME[out]) from e
        raise
    finally:
        with held_signals():
            lock.release()


def note_outcome(out_dir: str, state: str) -> None:
    """Record what became of ``out_dir`` when another process (rank 0 of a distributed merge) decided it.

    Args:
        out_dir: the output folder.
        state: one true sentence (what :func:`outcome` returns afterwards).

    Returns:
        None.

    Example:
        >>> note_outcome("/nowhere/noted", "OUT is unchanged"); outcome("/nowhere/noted")
        'OUT is unchanged'
    """
    _OUTCOME[os.path.abspath(os.fspath(out_dir))] = state
