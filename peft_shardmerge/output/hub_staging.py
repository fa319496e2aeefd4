"""A push's local state: its staging folder (made as this user's, emptied, removed) and the journal of the shards the
Hub confirmed, which a rerun keeps."""

from __future__ import annotations

import json
import os
import shutil
import threading
from contextlib import contextmanager
from typing import Iterator

from ..errors import InputError
from .files import PUSH_MARK, held_signals
from .lock import output_lock

JOURNAL_FORMAT = "peft-shardmerge-push-journal"


def staging_folder(staging: str, repo_id: str) -> str:
    """Where a push to ``repo_id`` keeps its shards until they are uploaded: a folder of its own in ``staging``.

    Example:
        >>> staging_folder("/tmp", "me/tiny")
        '/tmp/peft-shardmerge-push-me--tiny'
    """
    return os.path.join(os.path.abspath(staging), "peft-shardmerge-push-" + repo_id.replace("/", "--"))


def journal_path(folder: str) -> str:
    """The journal of the push staged in ``folder``, beside it (``<folder>.journal.json``)."""
    return folder + ".journal.json"


class PushJournal:
    """What a push has uploaded so far: the merge's fingerprint and inputs' digest, and for each shard the server
    confirmed, its size, SHA-256, record and the digest of the inputs it was computed from. A rerun of the same merge
    to the same place keeps the shards whose inputs are unchanged and which the server still holds.

    Args:
        path: the journal file.
        key: what must match for an earlier journal to be kept (repository, revision, fingerprint, inputs' digest).
    """

    def __init__(self, path: str, key: dict):
        self.path, self.key = path, key
        self.shards: dict[str, dict] = {}
        self._lock = threading.Lock()

    def load(self) -> dict[str, dict]:
        """The shards an earlier run of this push uploaded (none where the journal is missing, unreadable, not this
        user's own file, or for another merge or place)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, encoding="utf-8") as f:
                if os.fstat(f.fileno()).st_uid != os.geteuid():
                    return {}
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != JOURNAL_FORMAT or data.get("key") != self.key:
            return {}
        shards = data.get("shards")
        return shards if isinstance(shards, dict) else {}

    def add(self, name: str, entry: dict) -> None:
        """Record a shard the server confirmed (the journal rewritten, then renamed over the old one)."""
        with self._lock:
            self.shards[name] = entry
        self.rewrite()

    def rewrite(self) -> None:
        """Write the journal as it stands (a new file renamed over the old one)."""
        with self._lock:
            tmp = self.path + ".tmp"
            if os.path.lexists(tmp):
                os.remove(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)  # never through a link
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": JOURNAL_FORMAT, "key": self.key, "shards": self.shards}, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    def remove(self) -> None:
        """Delete the journal (the push is committed)."""
        for path in (self.path, self.path + ".tmp"):
            if os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)


def bytes_under(folder: str) -> int:
    """The bytes the files under ``folder`` take (0 where it cannot be read)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


@contextmanager
def staged_push(folder: str) -> Iterator[str]:
    """A push's staging folder (:func:`staging_folder`): locked, made as this user's and marked as ours (emptied of
    what an earlier run of ours left there), and removed when the block ends, whatever happens. Anything else at that
    name is refused.

    Args:
        folder: its path.

    Returns:
        A context manager yielding ``folder``.

    Raises:
        InputError: something a push of this user's did not make is at that name (:func:`folder_problems`).

    Example:
        >>> import tempfile
        >>> staging = tempfile.mkdtemp()
        >>> with staged_push(staging_folder(staging, "me/tiny")) as folder:
        ...     os.listdir(folder)
        ['.peft-shardmerge-push']
        >>> os.listdir(staging)
        []
    """
    with output_lock(folder):
        problems = folder_problems(folder)
        if problems:
            raise InputError(problems)
        if os.path.lexists(folder):
            shutil.rmtree(folder)
        os.mkdir(folder, 0o700)  # the shards wait here, hashed, for their upload: nobody else writes in it
        with open(os.path.join(folder, PUSH_MARK), "w", encoding="utf-8") as f:
            f.write("a staging folder of peft-shardmerge's push; removed when the push ends\n")
        try:
            yield folder
        finally:
            with held_signals():
                shutil.rmtree(folder, ignore_errors=True)


def folder_problems(folder: str) -> list[str]:
    """What stands in the way of a push's staging folder at ``folder``, without touching anything: its parent missing,
    or something there that a push of this user's did not make.

    Example:
        >>> folder_problems("/no/such/place/peft-shardmerge-push-me--tiny")[0][:32]
        'the staging folder /no/such/plac'
    """
    parent = os.path.dirname(folder)
    if not os.path.isdir(parent):
        return [f"the staging folder {parent} does not exist; create it or pass another (--staging DIR)"]
    if not os.path.lexists(folder):
        return []
    st = os.lstat(folder)
    mine = not os.path.islink(folder) and st.st_uid == os.geteuid() and not st.st_mode & 0o022
    if mine and os.path.isfile(os.path.join(folder, PUSH_MARK)):
        return []
    return [
        f"{folder} exists and is not a staging folder of peft-shardmerge's made by this user; the push never writes "
        "into what it did not make: remove it or pass another staging folder (--staging DIR)"
    ]
