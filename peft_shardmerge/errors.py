"""The exception family of peft-shardmerge: every error a user can cause, with the fix in its message."""

from __future__ import annotations

from typing import Iterable


class ShardMergeError(Exception):
    """Base class of every error raised on purpose by peft-shardmerge.

    The command line prints these without a traceback and exits with status 2.
    """


class InputError(ShardMergeError, ValueError):
    """One or more problems with the inputs, found before anything was written (or, by the model-class checks run
    beside a merge from disk, before anything was committed: its staging folder is then removed).

    Args:
        problems: every problem found, each a sentence naming what is wrong, where, and the fix.
        when: when they were found, as the message's first line says it.

    Example:
        >>> raise InputError(["OUT is not empty: pass --overwrite"])
        Traceback (most recent call last):
        peft_shardmerge.errors.InputError: 1 problem found before writing anything:
          - OUT is not empty: pass --overwrite
    """

    def __init__(self, problems: Iterable[str] | str, when: str = "before writing anything"):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} found {when}:"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


class NotFoundError(ShardMergeError, FileNotFoundError):
    """A file, folder or cached Hub snapshot that the merge needs does not exist."""


class UnsupportedError(ShardMergeError, ValueError):
    """The adapter or checkpoint uses a feature this version cannot merge (named in the message)."""


class CorruptFileError(ShardMergeError, ValueError):
    """A safetensors file or index is malformed (header, offsets, names)."""


class MissingDependencyError(ShardMergeError, ImportError):
    """An optional dependency is needed for the requested option; the message gives the install line."""


class MergeCheckError(ShardMergeError, RuntimeError):
    """A consistency check after the merge failed (e.g. a LoRA module was not applied exactly once)."""


class OutputLockedError(ShardMergeError, RuntimeError):
    """Another merge is writing the same output folder right now."""


class OutputChangedError(ShardMergeError, RuntimeError):
    """OUT changed while the merge ran: it was left as it is, and the new output kept in the staging folder."""


class FileSystemError(ShardMergeError, OSError):
    """The filesystem failed during the merge (disk full, permissions, I/O error); the message says what became of
    OUT. ``errno`` and ``filename`` are the original error's.

    Args:
        error: the ``OSError`` the filesystem raised.
        state: one sentence on what became of OUT.

    Example:
        >>> str(FileSystemError(OSError(28, "No space left on device", "out/model.safetensors"), "OUT is unchanged"))
        'No space left on device (out/model.safetensors); OUT is unchanged'
    """

    def __init__(self, error: OSError, state: str):
        where = error.filename or "the output"
        super().__init__(error.errno, f"{error.strerror or error} ({where}); {state}")
        self.filename = error.filename

    def __str__(self) -> str:
        return self.strerror


class HubUploadError(ShardMergeError, RuntimeError):
    """The Hub could not be reached, refused the repository, or the upload failed; never contains the token."""


class PeerFailedError(ShardMergeError, RuntimeError):
    """Another rank of a distributed merge failed, so this one stopped too; the message is the failing rank's.

    Args:
        rank: the rank that reported the failure (the lowest one, when several did).
        message: its message, starting with the rank that failed first (``"rank 1: ..."``).
        state: what became of OUT, when rank 0 said it.

    Example:
        >>> str(PeerFailedError(1, "rank 1: No space left on device"))
        'rank 1: No space left on device'
    """

    def __init__(self, rank: int, message: str, state: str | None = None):
        self.rank, self.message, self.state = rank, message, state
        self.stopped = False  # True when that rank only stopped because yet another one failed
        said = state and message.endswith(state)  # the message already says it (an OSError's state, from rank 0)
        super().__init__(message + (f"; {state}" if state and not said else ""))


class PeerLostError(ShardMergeError, RuntimeError):
    """A rank of a distributed merge stopped answering (killed, or its node lost); the finished shards are kept in
    the staging folder for a rerun, with any number of ranks.

    Args:
        detail: what torch.distributed said.
        state: what became of OUT, once known.

    Example:
        >>> PeerLostError("Connection reset by peer").keep_partial
        True
    """

    keep_partial = True

    def __init__(self, detail: str, state: str | None = None):
        self.detail = detail
        said = (detail.splitlines() or ["no detail"])[0]
        said = said.split("] ", 1)[-1] if said.startswith("[") else said  # gloo starts with its source file
        super().__init__(
            f"another rank stopped answering (torch.distributed: {said.split('. ')[0][:160]})"
            + (f"; {state}" if state else "")
        )


class Stopped(Exception):
    """Internal: this rank of a distributed merge stopped writing because another rank failed (that rank's message
    comes with the next step, and is what the user sees)."""


class PlanChanged(Exception):
    """Internal: the plan made with the model class differs from the one a merge from disk started from (made from
    the files alone, its model-class checks running beside it); the merge is made again with the whole plan."""
