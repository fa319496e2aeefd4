"""The Hub as a destination: each file uploaded by its content (its SHA-256) first, then one commit that names them
all; the errors of the Hub said without the token."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import HubUploadError, InputError, MissingDependencyError
from .files import held_signals
from .record import RECORD_FILE, output_files

log = logging.getLogger(__name__)

#: the weight files transformers reads from a model repository's top level (an index first, else the weights)
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def weight_file(name: str) -> bool:
    """Whether a file of a repository is one transformers may load the model's weights from (top level).

    Example:
        >>> [weight_file(n) for n in ("model.safetensors", "pytorch_model-00001-of-00002.bin", "1_Pooling/w.bin")]
        [True, True, False]
    """
    if "/" in name:
        return False
    return (
        name.endswith(".safetensors")
        or name in WEIGHT_INDEXES
        or (name.startswith("pytorch_model") and name.endswith(".bin"))
    )


def resolved_token(token: str | None) -> str | None:
    """The token the Hub's calls send: ``token``, else the one huggingface_hub finds (``HF_TOKEN``, the login cache).

    Example:
        >>> resolved_token("hf_given")
        'hf_given'
    """
    if token:
        return token
    from huggingface_hub import get_token

    return get_token()


#: exception class names of the HTTP libraries huggingface_hub uses (httpx, requests, urllib3) that mean the server
#: was not reached at all
_NETWORK_ERRORS = {
    "ConnectError",
    "ConnectTimeout",
    "ConnectionError",
    "NewConnectionError",
    "MaxRetryError",
    "NameResolutionError",
    "ProxyError",
    "ReadTimeout",
    "Timeout",
    "TimeoutException",
    "WriteTimeout",
}


def unreachable(error: BaseException) -> bool:
    """Whether an error of a Hub call means the server could not be reached (refused, unresolved, timed out).

    Args:
        error: the exception a ``huggingface_hub`` call raised; its causes are searched too.

    Returns:
        True for a network failure, False for an answer of the server (a refused token, a bad name).

    Example:
        >>> unreachable(ConnectionRefusedError(111, "Connection refused")), unreachable(ValueError("401"))
        (True, False)
    """
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (ConnectionError, TimeoutError)) or any(
            c.__name__ in _NETWORK_ERRORS for c in type(e).__mro__
        ):
            return True
        todo += [e.__cause__, e.__context__]
    return False


def masked(error: BaseException, token: str | None) -> str:
    """An error's text with the token replaced by ``***`` (and the causes huggingface_hub chains, once each).

    Args:
        error: the exception.
        token: the token that must not appear.

    Returns:
        ``"Type: message"``.

    Example:
        >>> masked(ValueError("bad token hf_abc"), "hf_abc")
        'ValueError: bad token ***'
    """
    text = f"{type(error).__name__}: {error}"
    cause = error.__cause__ or error.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({type(cause).__name__}: {cause})"
    return text.replace(token, "***") if token else text


def hf_api(token: str | None):
    """huggingface_hub's ``HfApi`` for ``token`` (None: ``HF_TOKEN`` or the login cache, as huggingface_hub finds it).

    Raises:
        MissingDependencyError: huggingface_hub is not installed.
    """
    try:
        from huggingface_hub import HfApi
    except ImportError as e:  # pragma: no cover - a dependency of transformers
        raise MissingDependencyError("pushing needs huggingface_hub: pip install huggingface_hub") from e
    return HfApi(token=token)


def xet_uploads() -> bool:
    """Whether huggingface_hub sends the large files through Xet storage (``hf_xet`` installed and
    ``HF_HUB_DISABLE_XET`` not set) rather than the LFS batch API.

    Example:
        >>> isinstance(xet_uploads(), bool)
        True
    """
    from huggingface_hub.utils._runtime import is_xet_available

    return bool(is_xet_available())


@contextmanager
def hub_bars(show: bool) -> Iterator[None]:
    """huggingface_hub's progress bars held back for the block unless ``show`` (put back after it)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if show or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


@dataclass
class HubTarget:
    """Where a push goes and how it is committed.

    Attributes:
        repo_id: ``"user/name"`` (resolved: :func:`~peft_shardmerge.api.hub.prepare_repo`).
        token: the token (None: ``HF_TOKEN`` or the login cache); never logged.
        revision: the branch (None: ``main``); created at the commit where it does not exist yet.
        private: create the repository private.
        commit_message: the commit's title.
        commit_description: the commit's description.
        create_pr: open a pull request with the commit instead of pushing to the branch.
        progress: show huggingface_hub's upload progress bars.
    """

    repo_id: str
    token: str | None = field(default=None, repr=False)
    revision: str | None = None
    private: bool | None = None
    commit_message: str = "Upload merged model"
    commit_description: str | None = None
    create_pr: bool = False
    progress: bool = True

    @property
    def url(self) -> str:
        """``hf://user/name`` (with ``@revision``)."""
        return f"hf://{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


class HubSession:
    """The calls of one push: files uploaded by content as they are ready (:meth:`upload`), objects an earlier run
    uploaded named again (:meth:`uploaded`, :meth:`stored`), one commit at the end (:meth:`commit`). Every failure
    becomes a :class:`~peft_shardmerge.errors.HubUploadError` that names the repository and never the token; nothing
    is committed before :meth:`commit`, so a failure leaves the repository as it was.

    Args:
        target: the :class:`HubTarget`.
    """

    def __init__(self, target: HubTarget):
        self.target = target
        self.api = hf_api(target.token)
        self._branch_exists: bool | None = None
        self._made_branch = False

    def _token(self) -> str | None:
        """The token the calls send (given, or found by huggingface_hub), for masking."""
        return resolved_token(self.target.token)

    def stale_weights(self, written: set[str], replace: bool) -> list[str]:
        """The weight files of the repository (at the branch, or ``main`` for a branch to be made) a push that writes
        weights does not write: left there, transformers could load them instead of the pushed ones (a single
        ``model.safetensors`` wins over an index). A GGUF beside them is no such push.

        Args:
            written: the files the push writes.
            replace: they are to be deleted in the push's commit; else a repository holding any is refused.

        Returns:
            Their names, for the commit to delete.

        Raises:
            InputError: there are some and ``replace`` is False.
        """
        if not any(weight_file(n) for n in written):
            return []
        with self.said("listing the repository's files"):
            info = self.api.repo_info(self.target.repo_id, revision=self._upload_revision(), files_metadata=False)
        stale = sorted(
            s.rfilename for s in info.siblings or [] if weight_file(s.rfilename) and s.rfilename not in written
        )
        if stale and not replace:
            raise InputError(
                [
                    f"{self.target.repo_id} holds {', '.join(stale)}, which this push does not write: transformers "
                    "could load them instead of the pushed weights. Pass overwrite=True to delete them in the same "
                    "commit, or push to another repository or branch (revision)"
                ]
            )
        return stale

    @contextmanager
    def said(self, what: str, outcome: str = "Nothing was committed: the repository is as it was") -> Iterator[None]:
        """Turn a failure of the calls in the block into a HubUploadError saying ``what`` failed, and ``outcome``."""
        try:
            yield
        except HubUploadError:
            raise
        except Exception as e:  # any failure of the Hub's client, said without the token
            where = f"the Hub at {self.api.endpoint} could not be reached (network)" if unreachable(e) else "refused"
            error = HubUploadError(
                f"{what} for {self.target.repo_id} failed: {where}: {masked(e, self._token())}. {outcome}"
            )
            error.refused = not unreachable(e)
            raise error from None

    def branch_exists(self) -> bool:
        """Whether the target's branch exists (``main``, or no branch named: True)."""
        if self._branch_exists is None:
            if not self.target.revision or self.target.revision == "main":
                self._branch_exists = True
            else:
                from huggingface_hub.errors import RevisionNotFoundError

                with self.said("reading the branch"):
                    try:
                        self.api.repo_info(self.target.repo_id, revision=self.target.revision)
                        self._branch_exists = True
                    except RevisionNotFoundError:
                        self._branch_exists = False
        return self._branch_exists

    def _upload_revision(self) -> str | None:
        """The revision files are uploaded against: the branch, or ``main`` while the branch is to be made."""
        return self.target.revision if self.branch_exists() else None

    def upload(self, path: str, path_in_repo: str, sha256: str | None = None):
        """Upload one file's content by its SHA-256 (``preupload_lfs_files``): after it, the Hub holds the bytes and
        only a commit naming them makes them appear. A small text file the Hub keeps in git is sent with the commit.

        Args:
            path: the local file.
            path_in_repo: its name in the repository.
            sha256: its SHA-256 where already known (taken while it was written): the file is not read to hash it.

        Returns:
            The ``CommitOperationAdd`` for :meth:`commit`.

        Raises:
            HubUploadError: the upload failed (after huggingface_hub's retries).
        """
        from huggingface_hub import CommitOperationAdd

        op = CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=path)  # reads 512 bytes
        if sha256:
            op.upload_info.sha256 = bytes.fromhex(sha256)
        self.upload_all([op])
        return op

    def upload_all(self, operations: list) -> None:
        """Upload the content of the ``CommitOperationAdd`` s (see :meth:`upload`), several at once.

        Raises:
            HubUploadError: an upload failed (after huggingface_hub's retries).
        """
        what = f"uploading {operations[0].path_in_repo}" if len(operations) == 1 else "uploading the files"
        with self.said(what):
            self.api.preupload_lfs_files(
                self.target.repo_id,
                additions=operations,
                revision=self._upload_revision(),
                create_pr=self.target.create_pr,
                free_memory=False,
            )

    @staticmethod
    def uploaded(path_in_repo: str, size: int, sha256: str):
        """The commit entry of a file an earlier run uploaded (the bytes are on the Hub, not here).

        Args:
            path_in_repo: its name in the repository.
            size: its size.
            sha256: its SHA-256.

        Returns:
            A ``CommitOperationAdd`` naming the uploaded object.
        """
        from huggingface_hub import CommitOperationAdd
        from huggingface_hub.lfs import UploadInfo

        op = CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=b"")
        op.upload_info = UploadInfo(size=size, sample=b"", sha256=bytes.fromhex(sha256))
        # huggingface_hub has no public way to name an object another process uploaded: these two fields are what its
        # own preupload_lfs_files sets once an upload is done, and create_commit then names the object by its SHA-256
        op._upload_mode, op._is_uploaded = "lfs", True
        return op

    def stored(self, objects: dict[str, int]) -> set[str]:
        """Which of the objects ``{sha256: size}`` the Hub holds, from the LFS batch API (those it asks no upload
        of). Under Xet storage the batch API is not what uploads went through: every object is taken as held, and a
        commit naming a missing one is refused by the Hub (nothing committed).

        Returns:
            The SHA-256s held.
        """
        if not objects or xet_uploads():
            return set(objects)
        from huggingface_hub.lfs import UploadInfo, post_lfs_batch_info

        infos = [UploadInfo(size=size, sample=b"", sha256=bytes.fromhex(sha)) for sha, size in objects.items()]
        with self.said("asking which files the Hub holds"):
            actions, _, _ = post_lfs_batch_info(
                upload_infos=infos,
                token=self.target.token,
                repo_type="model",
                repo_id=self.target.repo_id,
                revision=self._upload_revision(),
                endpoint=self.api.endpoint,
            )
        return {a["oid"] for a in actions if a.get("actions") is None and objects.get(a["oid"]) == a.get("size")}

    def commit(self, operations: list, deleted: list[str] = ()) -> str:
        """One commit naming every file (creating the branch first where it does not exist yet): the files not
        uploaded yet are uploaded first, and a push some of whose files the repository's ``.gitignore`` would leave
        out is refused. The commit's request is sent under held signals: once sent, the push ends with it (an
        interrupt meanwhile is said, not obeyed).

        Args:
            operations: the ``CommitOperationAdd`` of each file, uploaded or to be sent with the commit.
            deleted: the repository's files the commit deletes.

        Returns:
            The URL of the commit (of the pull request with ``create_pr``).
        """
        from huggingface_hub import CommitOperationDelete

        if any(not op._is_uploaded for op in operations):
            self.upload_all([op for op in operations if not op._is_uploaded])
        ignored = [op.path_in_repo for op in operations if getattr(op, "_should_ignore", False)]
        if ignored:
            raise HubUploadError(
                f"the .gitignore of {self.target.repo_id} leaves out {', '.join(ignored)}: the commit would miss "
                "them. Nothing was committed; remove those patterns from the repository's .gitignore, then push again"
            )
        operations = [*operations, *(CommitOperationDelete(path_in_repo=name) for name in deleted)]
        t = self.target
        if not self.branch_exists() and not t.create_pr:
            with self.said(f"making the branch {t.revision}"):
                self.api.create_branch(t.repo_id, branch=t.revision, exist_ok=True)
            self._branch_exists = self._made_branch = True
        unknown = (
            "If it was the network, the commit may have been made or not: look at the repository's history before "
            "pushing again"
        )
        try:
            with self.said("the commit", f"Nothing was committed, unless: {unknown}"), held_signals(False) as stopped:
                info = self.api.create_commit(
                    t.repo_id,
                    operations=operations,
                    commit_message=t.commit_message,
                    commit_description=t.commit_description,
                    revision=t.revision if self.branch_exists() else None,
                    create_pr=t.create_pr,
                    repo_type="model",
                )
        except HubUploadError:
            if self._made_branch:  # the branch this push made goes with its commit
                try:
                    self.api.delete_branch(t.repo_id, branch=t.revision)
                    self._branch_exists = self._made_branch = False
                except Exception:  # the commit's error is the one to say
                    log.debug("the branch %s could not be removed again", t.revision)
            raise
        url = str(info.pr_url or info.commit_url)
        if stopped:
            log.warning("interrupted while the commit was made: the push is complete (%s)", url)
        return url


def folder_operations(folder: str, known: dict[str, str] | None = None, skip=()) -> list:
    """A ``CommitOperationAdd`` for every file of a folder a push commits (its merge record included), each reading
    512 bytes of its file; a SHA-256 already known is set, not computed again.

    Args:
        folder: the folder.
        known: SHA-256 of files already hashed, by relative path.
        skip: relative paths left out (files already in the commit).

    Returns:
        The operations, in :func:`~peft_shardmerge.output.record.output_files`'s order, the record last.
    """
    from huggingface_hub import CommitOperationAdd

    names = output_files(folder) + ([RECORD_FILE] if os.path.isfile(os.path.join(folder, RECORD_FILE)) else [])
    ops = []
    for rel in names:
        if rel in skip:
            continue
        op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=os.path.join(folder, rel))
        if (known or {}).get(rel):
            op.upload_info.sha256 = bytes.fromhex(known[rel])
        ops.append(op)
    return ops


def push_folder(folder: str, target: HubTarget, known: dict[str, str] | None = None, replace: bool = False) -> str:
    """Upload every file of a finished folder by content, then commit them all at once: the repository shows them
    together or not at all (whatever their number and size, on the LFS path and on Xet storage alike).

    Args:
        folder: the folder (its sub-folders' files go under the same relative paths).
        target: where to.
        known: the SHA-256 of files already hashed, by relative path (a GGUF's, from its merge record): not read
            again to hash them.
        replace: delete, in the same commit, the repository's weight files the folder does not hold (else such
            files are refused: :meth:`HubSession.stale_weights`).

    Returns:
        The URL of the commit.

    Raises:
        InputError: the repository holds weight files the folder does not replace, and ``replace`` is False.
        HubUploadError: an upload or the commit failed; nothing was committed.
    """
    session, ops = HubSession(target), folder_operations(folder, known)
    stale = session.stale_weights({op.path_in_repo for op in ops}, replace)
    log.info("pushing %d files to %s", len(ops), target.url)
    with hub_bars(target.progress):
        return session.commit(ops, stale)
