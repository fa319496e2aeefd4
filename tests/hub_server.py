"""FakeHub: a local Hub speaking the repo, branch, preupload, LFS (batch, upload, verify) and commit API, for tests."""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import json
import os
import re
import shutil
import tempfile
import threading
import traceback
from collections.abc import Iterator, MutableMapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

#: paths the preupload endpoint sends through LFS whatever their size or content
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".model", ".ckpt")
#: files larger than this go through LFS
LFS_MIN_BYTES = 10_000_000

_REPO = r"(?P<repo>[^/]+/[^/]+?)"
_OID = re.compile(r"^[0-9a-f]{64}$")


def git_blob_oid(data: bytes) -> str:
    """The git blob sha1 of ``data`` (the oid the Hub names a regular file by)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def wants_lfs(path: str, size: int, sample: bytes) -> bool:
    """Whether the Hub takes this file through LFS: a weights suffix, over 10 MB, or binary (a NUL in the sample)."""
    return path.endswith(LFS_SUFFIXES) or size > LFS_MIN_BYTES or b"\0" in sample


class RepoFiles(MutableMapping):
    """The files of one repository, path -> bytes; LFS files live on disk and are read on access."""

    def __init__(self, hub: FakeHub) -> None:
        self._hub = hub
        self._entries: dict[
            str, tuple[str, bytes | str, int]
        ] = {}  # path -> ("regular", bytes, size) | ("lfs", oid, size)

    def __getitem__(self, path: str) -> bytes:
        kind, value, _ = self._entries[path]
        if kind == "lfs":
            with open(self._hub.object_path(value), "rb") as f:
                return f.read()
        return value

    def __setitem__(self, path: str, data: bytes) -> None:  # seeds a regular file (tests)
        self._entries[path] = ("regular", bytes(data), len(data))

    def __delitem__(self, path: str) -> None:
        del self._entries[path]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, path) -> bool:
        return path in self._entries

    def is_lfs(self, path: str) -> bool:
        return self._entries[path][0] == "lfs"

    def size(self, path: str) -> int:
        return self._entries[path][2]

    def oid(self, path: str) -> str:
        """The oid the preupload endpoint gives: sha256 hex for an LFS file, the git blob sha1 for a regular one."""
        kind, value, _ = self._entries[path]
        return value if kind == "lfs" else git_blob_oid(value)

    def _set_lfs(self, path: str, oid: str, size: int) -> None:
        self._entries[path] = ("lfs", oid, size)

    def __repr__(self) -> str:
        return f"RepoFiles({sorted(self._entries)})"


class _Refusal(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class FakeHub:
    """A Hub on 127.0.0.1 for tests: use as a context manager and point ``huggingface_hub.constants.ENDPOINT`` at
    ``hub.url``.

    It checks what the Hub checks: a bearer token on every write (401 without, 403 for a token in
    ``read_only_tokens``), that the repository and revision exist (404 ``RepoNotFound`` / ``RevisionNotFound``),
    that an uploaded LFS object has the sha256 and size it was announced with, and that a commit names only LFS
    objects that were uploaded. LFS objects are kept on disk under ``storage``, never all in memory.

    Attributes:
        url: the server's address.
        storage: the folder holding ``objects/{oid}`` (a temporary one, removed on exit, when none is given; the
            objects a given folder already holds count as uploaded).
        repos: repository id -> the JSON its creation request sent.
        files: repository id -> :class:`RepoFiles` (path -> bytes), one table per repository whatever the branch.
        branches: repository id -> {branch name: head commit oid}.
        commits: one dict per applied commit: repo, revision, header, files, lfs, create_pr, oid.
        puts: the oid of each accepted LFS upload, in order.
        auth: the Authorization header of every POST received ("" when absent).
        log: ``(method, path without query, status)`` for every request (status 0: the client went away).
        unknown: ``"METHOD path"`` of requests the server does not serve.
        errors: tracebacks of requests the server failed on itself (answered 500).
        read_only_tokens: bearer tokens that may read but not write.
        max_object_bytes: LFS objects above this size are refused by the batch endpoint (None: no limit).
        echo_auth: injected failures (:meth:`fail`) say the Authorization header in their message.
    """

    def __init__(self, storage: str | os.PathLike | None = None) -> None:
        self._own_storage = storage is None
        self.storage = tempfile.mkdtemp(prefix="fakehub-") if storage is None else os.fspath(storage)
        os.makedirs(os.path.join(self.storage, "objects"), exist_ok=True)
        os.makedirs(os.path.join(self.storage, "incoming"), exist_ok=True)
        self.repos: dict[str, dict] = {}
        self.files: dict[str, RepoFiles] = {}
        self.branches: dict[str, dict[str, str]] = {}
        self.commits: list[dict] = []
        self.puts: list[str] = []
        self.auth: list[str] = []
        self.log: list[tuple[str, str, int]] = []
        self.unknown: list[str] = []
        self.errors: list[str] = []
        self.read_only_tokens: set[str] = {"hf_read"}
        self.max_object_bytes: int | None = None
        self.echo_auth = False  # injected failures say the Authorization header they were sent
        objects = os.path.join(self.storage, "objects")
        self._objects: dict[str, int] = {  # oid -> size of the objects kept (a given storage keeps its own)
            oid: os.path.getsize(os.path.join(objects, oid)) for oid in os.listdir(objects) if _OID.match(oid)
        }
        self._failures: list[list] = []  # [method, regex, [statuses]]
        self._stalls: list[list] = []  # [method, regex, seconds, times left or None]
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._counter = itertools.count(1)
        self._pulls: dict[str, int] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    # -- for tests -------------------------------------------------------------------------------------------------

    def object_path(self, oid: str) -> str:
        """Where the LFS object ``oid`` is (or would be) kept."""
        return os.path.join(self.storage, "objects", oid)

    def fail(self, method: str, path_regex: str, statuses: list[int]) -> None:
        """Answer the next requests of ``method`` whose path matches ``path_regex`` with ``statuses``, in turn."""
        with self._lock:
            self._failures.append([method.upper(), re.compile(path_regex), list(statuses)])

    def stall(self, method: str, path_regex: str, seconds: float, times: int | None = 1) -> None:
        """Wait ``seconds`` before handling the next ``times`` matching requests (None: every one)."""
        with self._lock:
            self._stalls.append([method.upper(), re.compile(path_regex), seconds, times])

    def add_repo(self, repo: str) -> RepoFiles:
        """Create ``repo`` (with a ``main`` branch) without a request; returns its files."""
        with self._lock:
            if repo not in self.repos:
                self.repos[repo] = {}
                self.files[repo] = RepoFiles(self)
                self.branches[repo] = {"main": self._new_commit_oid()}
            return self.files[repo]

    def drop_object(self, oid: str) -> None:
        """Forget an uploaded object (as the Hub drops uploads no commit named, after a while)."""
        with self._lock:
            self._objects.pop(oid, None)
            if os.path.exists(self.object_path(oid)):
                os.remove(self.object_path(oid))

    def has_object(self, oid: str, size: int | None = None) -> bool:
        with self._lock:
            return oid in self._objects and (size is None or self._objects[oid] == size)

    def _new_commit_oid(self) -> str:
        return hashlib.sha1(b"fakehub commit %d" % next(self._counter)).hexdigest()

    def _take_failure(self, method: str, path: str) -> int | None:
        with self._lock:
            for rule in self._failures:
                if rule[0] == method and rule[2] and rule[1].search(path):
                    return rule[2].pop(0)
        return None

    def _take_stall(self, method: str, path: str) -> float:
        with self._lock:
            for rule in self._stalls:
                if rule[0] == method and rule[1].search(path) and (rule[3] is None or rule[3] > 0):
                    if rule[3] is not None:
                        rule[3] -= 1
                    return rule[2]
        return 0.0

    # -- lifetime --------------------------------------------------------------------------------------------------

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
        if self._own_storage:
            shutil.rmtree(self.storage, ignore_errors=True)


def _make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        # -- reading ---------------------------------------------------------------------------------------------

        def _chunks(self, bufsize: int = 1 << 20) -> Iterator[bytes]:
            """The request body, piece by piece (Content-Length or chunked transfer encoding); read once."""
            if self._consumed:
                return
            self._consumed = True
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                while True:
                    line = self.rfile.readline(65537)
                    if not line:
                        raise ConnectionError("body ended inside a chunk header")
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return
                    yield from self._exactly(size, bufsize)
                    self.rfile.readline()  # CRLF after the chunk
            else:
                yield from self._exactly(int(self.headers.get("Content-Length") or 0), bufsize)

        def _exactly(self, n: int, bufsize: int) -> Iterator[bytes]:
            while n > 0:
                piece = self.rfile.read(min(n, bufsize))
                if not piece:
                    raise ConnectionError("body shorter than announced")
                n -= len(piece)
                yield piece

        def _body(self) -> bytes:
            return b"".join(self._chunks())

        def _drain(self) -> None:
            for _ in self._chunks():
                pass

        def _json_body(self):
            try:
                return json.loads(self._body() or b"{}")
            except ValueError:
                raise _Refusal(400, "the request body is not JSON") from None

        # -- answering -------------------------------------------------------------------------------------------

        def _send(self, status: int, raw: bytes, content_type: str, headers: dict | None = None) -> None:
            hub.log.append((self.command, self._path, status))  # before the answer: a client that got it sees it
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(raw)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

        def _json(self, status: int, data, content_type: str = "application/json") -> None:
            self._send(status, json.dumps(data).encode(), content_type)

        def _error(self, status: int, message: str, code: str | None = None, **extra) -> None:
            headers = {"X-Error-Message": " ".join(message.split()).encode("ascii", "replace").decode()}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message, **extra}).encode(), "application/json", headers)

        # -- checks ----------------------------------------------------------------------------------------------

        def _token(self, write: bool) -> None:
            value = self.headers.get("Authorization", "")
            if not value.startswith("Bearer ") or not value[len("Bearer ") :].strip():
                raise _Refusal(401, "Invalid credentials in Authorization header")
            if write and value[len("Bearer ") :].strip() in hub.read_only_tokens:
                raise _Refusal(403, "You don't have the rights to write to this repository (read-only token)")

        def _repo(self, repo: str) -> RepoFiles:
            if repo not in hub.repos:
                raise _Refusal(404, f"Repository not found: {repo}", "RepoNotFound")
            return hub.files[repo]

        def _branch(self, repo: str, revision: str) -> str:
            self._repo(repo)
            if revision not in hub.branches[repo]:
                raise _Refusal(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return hub.branches[repo][revision]

        # -- dispatch --------------------------------------------------------------------------------------------

        def _handle(self) -> None:
            self._consumed = False
            split = urlsplit(self.path)
            self._path, self._query = split.path, parse_qs(split.query)
            if self.command == "POST":
                hub.auth.append(self.headers.get("Authorization", ""))
            seconds = hub._take_stall(self.command, self._path)
            if seconds:
                hub._closing.wait(seconds)
            status = hub._take_failure(self.command, self._path)
            try:
                self._route(status)
            except ConnectionError:  # the client went away mid-request: nothing to answer
                self.close_connection = True
                hub.log.append((self.command, self._path, 0))

        def _route(self, status: int | None) -> None:
            try:
                if status is not None:
                    self._drain()
                    said = self.headers.get("Authorization", "") if hub.echo_auth else ""  # as a careless proxy would
                    return self._error(status, f"failure injected by the test hub ({status}) {said}".strip())
                routes = _ROUTES.get(self.command, ())
                for pattern, name in routes:
                    m = pattern.match(self._path)
                    if m:
                        return getattr(self, name)(
                            **{k: unquote(v) for k, v in m.groupdict().items() if v is not None}
                        )
                self._drain()
                if self._path not in _NOT_SERVED_QUIETLY:
                    hub.unknown.append(f"{self.command} {self.path}")
                return self._error(404, f"not served by the test hub: {self.command} {self.path}")
            except _Refusal as r:
                self._drain()
                return self._error(r.status, r.message, r.code, **r.extra)
            except ConnectionError:
                raise
            except Exception:  # a bug of the test hub: said, and kept for the test to see
                hub.errors.append(traceback.format_exc())
                return self._error(500, f"the test hub failed: {traceback.format_exc(limit=1)}")

        do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _handle

        # -- repositories and branches ---------------------------------------------------------------------------

        def create_repo(self) -> None:
            req = self._json_body()
            self._token(write=True)
            if not isinstance(req, dict) or not req.get("name"):
                raise _Refusal(400, "a repository needs a name")
            repo = f"{req.get('organization') or 'user'}/{req['name']}"
            with hub._lock:
                if repo in hub.repos:
                    raise _Refusal(409, "You already created this model repo", url=f"{hub.url}/{repo}")
                hub.add_repo(repo)
                hub.repos[repo] = req
            return self._json(200, {"url": f"{hub.url}/{repo}", "name": repo, "id": repo})

        def validate_yaml(self) -> None:
            self._drain()
            return self._json(200, {"errors": [], "warnings": []})

        def repo_info(self, repo: str, revision: str | None = None) -> None:
            files = self._repo(repo)
            revision = revision or "main"
            with hub._lock:
                sha = hub.branches[repo].get(revision)
                if sha is None and any(c["oid"] == revision and c["repo"] == repo for c in hub.commits):
                    sha = revision
                if sha is None:
                    raise _Refusal(404, f"Invalid rev id: {revision}", "RevisionNotFound")
                siblings = [{"rfilename": p} for p in files]
            private = hub.repos[repo].get("visibility") == "private" or bool(hub.repos[repo].get("private"))
            return self._json(200, {"id": repo, "modelId": repo, "sha": sha, "siblings": siblings, "private": private})

        def list_refs(self, repo: str) -> None:
            self._repo(repo)
            with hub._lock:
                branches = [
                    {"name": b, "ref": f"refs/heads/{b}", "targetCommit": sha} for b, sha in hub.branches[repo].items()
                ]
            return self._json(200, {"branches": branches, "converts": [], "tags": [], "pullRequests": []})

        def create_branch(self, repo: str, branch: str) -> None:
            req = self._json_body()
            self._token(write=True)
            self._repo(repo)
            with hub._lock:
                start = self._branch(repo, (req or {}).get("startingPoint") or "main")
                if branch in hub.branches[repo]:
                    raise _Refusal(409, f"Reference already exists: refs/heads/{branch}")
                hub.branches[repo][branch] = start
            return self._json(200, {})

        def delete_branch(self, repo: str, branch: str) -> None:
            self._drain()
            self._token(write=True)
            self._branch(repo, branch)
            if branch == "main":
                raise _Refusal(403, "the default branch cannot be deleted")
            with hub._lock:
                del hub.branches[repo][branch]
            return self._json(200, {})

        # -- uploads ---------------------------------------------------------------------------------------------

        def preupload(self, repo: str, revision: str) -> None:
            req = self._json_body()
            self._token(write=True)
            files = self._repo(repo)
            self._branch(repo, revision)
            answer = []
            for f in req.get("files") or []:
                try:
                    path, size, sample = f["path"], int(f["size"]), base64.b64decode(f.get("sample") or "")
                except (KeyError, TypeError, ValueError, binascii.Error):
                    raise _Refusal(400, f"malformed preupload entry: {f!r}") from None
                mode = "lfs" if wants_lfs(path, size, sample) else "regular"
                oid = files.oid(path) if path in files else None
                answer.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
            return self._json(200, {"files": answer})

        def lfs_batch(self, repo: str) -> None:
            req = self._json_body()
            self._token(write=True)
            self._repo(repo)
            ref = (req.get("ref") or {}).get("name")
            if ref is not None:
                self._branch(repo, ref)
            if req.get("operation") != "upload":
                raise _Refusal(400, f"only the upload operation is served, not {req.get('operation')!r}")
            out = []
            for obj in req.get("objects") or []:
                oid, size = obj.get("oid"), obj.get("size")
                if not isinstance(oid, str) or not _OID.match(oid) or not isinstance(size, int) or size < 0:
                    out.append({"oid": str(oid), "size": -1, "error": {"code": 422, "message": "invalid oid or size"}})
                elif hub.max_object_bytes is not None and size > hub.max_object_bytes:
                    message = f"object {oid} is {size} bytes, over the limit of {hub.max_object_bytes}"
                    out.append({"oid": oid, "size": size, "error": {"code": 413, "message": message}})
                elif hub.has_object(oid, size):
                    out.append({"oid": oid, "size": size})
                else:
                    actions = {
                        "upload": {"href": f"{hub.url}/lfs-upload/{oid}?size={size}"},
                        "verify": {"href": f"{hub.url}/{repo}.git/info/lfs/objects/verify"},
                    }
                    out.append({"oid": oid, "size": size, "authenticated": True, "actions": actions})
            return self._json(200, {"transfer": "basic", "objects": out}, "application/vnd.git-lfs+json")

        def lfs_put(self, oid: str) -> None:
            if not _OID.match(oid):
                raise _Refusal(400, f"not a sha256 oid: {oid}")
            try:
                size = int(self._query["size"][0])
            except (KeyError, ValueError):
                raise _Refusal(400, "the upload address names no size") from None
            if hub.max_object_bytes is not None and size > hub.max_object_bytes:
                raise _Refusal(413, f"object {oid} is over the limit of {hub.max_object_bytes} bytes")
            fd, tmp = tempfile.mkstemp(dir=os.path.join(hub.storage, "incoming"))
            try:
                digest, got = hashlib.sha256(), 0
                with os.fdopen(fd, "wb") as out:
                    for piece in self._chunks():
                        digest.update(piece)
                        got += len(piece)
                        out.write(piece)
                if got != size or digest.hexdigest() != oid:
                    raise _Refusal(
                        400, f"the uploaded bytes ({got} bytes, sha256 {digest.hexdigest()}) are not {oid} ({size})"
                    )
                with hub._lock:
                    os.replace(tmp, hub.object_path(oid))
                    hub._objects[oid] = size
                    hub.puts.append(oid)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return self._send(200, b"", "text/plain", {"ETag": f'"{oid[:32]}"'})

        def lfs_verify(self, repo: str) -> None:
            req = self._json_body()
            self._token(write=False)
            self._repo(repo)
            if not hub.has_object(req.get("oid"), req.get("size")):
                raise _Refusal(404, f"object {req.get('oid')} of {req.get('size')} bytes was not uploaded")
            return self._json(200, {"oid": req["oid"], "size": req["size"]})

        # -- commits ---------------------------------------------------------------------------------------------

        def commit(self, repo: str, revision: str) -> None:
            body = self._body()
            self._token(write=True)
            files = self._repo(repo)
            try:
                lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
            except ValueError:
                raise _Refusal(400, "the commit payload is not NDJSON") from None
            if not lines or lines[0].get("key") != "header" or not isinstance(lines[0].get("value"), dict):
                raise _Refusal(400, "the commit payload starts with no header line")
            header = lines[0]["value"]
            if not header.get("summary"):
                raise _Refusal(400, "the commit has no summary")
            create_pr = self._query.get("create_pr", ["0"])[0] in ("1", "true", "True")
            with hub._lock:
                head = self._branch(repo, revision)
                if header.get("parentCommit") not in (None, head):
                    raise _Refusal(412, "A commit has happened since. Please refresh and try again.")
                changes, deleted, missing = self._plan(files, lines[1:])
                if missing:
                    raise _Refusal(
                        400,
                        "Your push was rejected because an LFS pointer pointed to a file that does not exist. "
                        "Offending files: " + ", ".join(missing),
                    )
                for p in deleted:
                    del files[p]
                for path, kind, value in changes:
                    if kind == "lfs":
                        files._set_lfs(path, value, hub._objects[value])
                    else:
                        files[path] = value
                oid = hub._new_commit_oid()
                if not create_pr:
                    hub.branches[repo][revision] = oid
                pr_url = None
                if create_pr:
                    hub._pulls[repo] = hub._pulls.get(repo, 0) + 1
                    pr_url = f"{hub.url}/{repo}/discussions/{hub._pulls[repo]}"
                hub.commits.append(
                    {
                        "repo": repo,
                        "revision": revision,
                        "header": header,
                        "files": [p for p, _, _ in changes],
                        "lfs": [p for p, kind, _ in changes if kind == "lfs"],
                        "deleted": deleted,
                        "create_pr": create_pr,
                        "oid": oid,
                    }
                )
            return self._json(
                200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": pr_url}
            )

        def _plan(self, files: RepoFiles, lines: list) -> tuple[list, list, list]:
            """Check every operation of a commit before any is applied: (changes, deleted paths, missing objects)."""
            changes, deleted, missing = [], [], []
            present = set(files)
            for line in lines:
                key, value = line.get("key"), line.get("value") or {}
                path = value.get("path")
                if not isinstance(path, str) or not path or path.startswith("/"):
                    raise _Refusal(400, f"a commit operation names no valid path: {line!r}")
                if key == "file":
                    try:
                        data = base64.b64decode(value.get("content") or "", validate=True)
                    except (binascii.Error, ValueError):
                        raise _Refusal(400, f"{path}: the content is not base64") from None
                    if data and wants_lfs(path, len(data), data[:512]):
                        raise _Refusal(
                            400, f"Your push was rejected because {path} must be stored with LFS (binary or large)"
                        )
                    changes.append((path, "regular", data))
                    present.add(path)
                elif key == "lfsFile":
                    oid, size = value.get("oid"), value.get("size")
                    if value.get("algo", "sha256") != "sha256" or not isinstance(oid, str):
                        raise _Refusal(400, f"{path}: an LFS file needs a sha256 oid")
                    if not hub.has_object(oid, size):
                        missing.append(f"{path} ({oid})")
                    changes.append((path, "lfs", oid))
                    present.add(path)
                elif key == "deletedFile":
                    if path not in present:
                        raise _Refusal(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    deleted.append(path)
                    present.discard(path)
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    gone = [p for p in present if p.startswith(prefix)]
                    if not gone:
                        raise _Refusal(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    deleted.extend(sorted(gone))
                    present.difference_update(gone)
                else:
                    raise _Refusal(400, f"unknown commit operation {key!r}")
            # a path deleted then added again in the same commit stays
            deleted = [p for p in deleted if p in files and p not in {c[0] for c in changes}]
            return changes, deleted, missing

    return Handler


#: asked by huggingface_hub on its own (the agent registry behind its user agent); a 404 leaves it uncached
_NOT_SERVED_QUIETLY = {"/api/agent-harnesses"}

_ROUTES = {
    "POST": [
        (re.compile(r"^/api/repos/create$"), "create_repo"),
        (re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
        (re.compile(rf"^/api/models/{_REPO}/preupload/(?P<revision>[^/]+)$"), "preupload"),
        (re.compile(rf"^/api/models/{_REPO}/commit/(?P<revision>[^/]+)$"), "commit"),
        (re.compile(rf"^/api/models/{_REPO}/branch/(?P<branch>[^/]+)$"), "create_branch"),
        (re.compile(rf"^/{_REPO}\.git/info/lfs/objects/batch$"), "lfs_batch"),
        (re.compile(rf"^/{_REPO}\.git/info/lfs/objects/verify$"), "lfs_verify"),
    ],
    "PUT": [(re.compile(r"^/lfs-upload/(?P<oid>[^/]+)$"), "lfs_put")],
    "DELETE": [(re.compile(rf"^/api/models/{_REPO}/branch/(?P<branch>[^/]+)$"), "delete_branch")],
    "GET": [
        (re.compile(rf"^/api/models/{_REPO}/refs$"), "list_refs"),
        (re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<revision>[^/]+))?$"), "repo_info"),
    ],
}
