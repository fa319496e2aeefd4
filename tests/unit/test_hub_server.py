"""The test Hub (tests/hub_server.py) driven by the real huggingface_hub client over its LFS path: what it stores,
what it refuses, and that a refused commit changes nothing."""

from __future__ import annotations

import base64
import hashlib
import os
import types

import httpx2
import pytest
from hub_server import FakeHub, git_blob_oid
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

TOKEN = "hf_write_token"
REPO = "me/tiny"
WEIGHTS = bytes(range(256)) * 40  # binary, 10240 bytes
CONFIG = b'{"model_type": "llama"}\n'


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def hub(monkeypatch):
    import huggingface_hub.constants as hc
    from huggingface_hub.utils import _http

    sleeps: list[float] = []
    with FakeHub() as h:
        monkeypatch.setattr(hc, "ENDPOINT", h.url)
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
        # the client's retry waits (1 s and up) are recorded, not slept
        monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=sleeps.append))
        h.sleeps = sleeps
        yield h


@pytest.fixture()
def api(hub):
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(REPO)
    return api


def calls(hub, *, status: bool = False) -> list:
    """The requests answered, as "METHOD kind" (kind: the last meaningful part of the path)."""
    out = []
    for method, path, code in hub.log:
        kind = next((k for k in ("preupload", "batch", "lfs-upload", "verify", "commit", "create") if k in path), path)
        out.append((f"{method} {kind}", code) if status else f"{method} {kind}")
    return out


def test_an_lfs_file_goes_preupload_batch_put_verify_commit_and_lands_on_disk(hub, api, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(WEIGHTS)
    hub.log.clear()
    info = api.create_commit(
        REPO,
        [
            CommitOperationAdd("model.safetensors", str(weights)),  # a path: sent with a Content-Length
            CommitOperationAdd("config.json", CONFIG),
        ],
        commit_message="add",
    )
    oid = sha256(WEIGHTS)
    assert calls(hub) == ["POST preupload", "POST batch", "PUT lfs-upload", "POST verify", "POST commit"]
    assert hub.puts == [oid]
    with open(hub.object_path(oid), "rb") as f:
        assert f.read() == WEIGHTS
    files = hub.files[REPO]
    assert sorted(files) == ["config.json", "model.safetensors"] and "model.safetensors" in files
    assert files["model.safetensors"] == WEIGHTS and files.is_lfs("model.safetensors")
    assert files["config.json"] == CONFIG and not files.is_lfs("config.json")  # inline in the commit
    (commit,) = hub.commits
    assert commit["files"] == ["model.safetensors", "config.json"] and commit["lfs"] == ["model.safetensors"]
    assert commit["repo"] == REPO and commit["revision"] == "main" and commit["create_pr"] is False
    assert commit["header"]["summary"] == "add"
    assert info.oid == commit["oid"] and info.commit_url == f"{hub.url}/{REPO}/commit/{commit['oid']}"
    assert api.repo_info(REPO).sha == commit["oid"]
    assert {s.rfilename for s in api.repo_info(REPO).siblings} == {"config.json", "model.safetensors"}
    assert os.listdir(os.path.join(hub.storage, "incoming")) == []
    assert hub.auth and all(a == f"Bearer {TOKEN}" for a in hub.auth)
    assert hub.unknown == []


def test_preupload_then_commit_in_a_second_call_puts_once(hub, api):
    op = CommitOperationAdd("model.safetensors", WEIGHTS)
    api.preupload_lfs_files(REPO, additions=[op])
    assert hub.puts == [sha256(WEIGHTS)] and hub.commits == [] and "model.safetensors" not in hub.files[REPO]
    api.create_commit(REPO, [op], commit_message="commit the preuploaded file")
    assert hub.puts == [sha256(WEIGHTS)] and len(hub.commits) == 1 and hub.commits[0]["lfs"] == ["model.safetensors"]
    assert calls(hub).count("PUT lfs-upload") == 1 and calls(hub).count("POST batch") == 1
    assert hub.files[REPO]["model.safetensors"] == WEIGHTS


def test_content_already_stored_is_not_sent_again(hub, api):
    api.create_commit(REPO, [CommitOperationAdd("a.safetensors", WEIGHTS)], commit_message="one")
    first = hub.commits[-1]["oid"]
    api.create_commit(REPO, [CommitOperationAdd("b.safetensors", WEIGHTS)], commit_message="two")
    assert hub.puts == [sha256(WEIGHTS)]  # the batch said the object is there: no second PUT
    assert hub.commits[-1]["lfs"] == ["b.safetensors"] and hub.files[REPO]["b.safetensors"] == WEIGHTS
    # the same bytes at the same path: preupload names the oid there, the client sends nothing and commits nothing
    info = api.create_commit(REPO, [CommitOperationAdd("a.safetensors", WEIGHTS)], commit_message="three")
    assert len(hub.commits) == 2 and info.oid == hub.commits[-1]["oid"] != first
    assert hub.files[REPO].oid("a.safetensors") == sha256(WEIGHTS)
    assert hub.files[REPO].oid("b.safetensors") == sha256(WEIGHTS)


def test_a_commit_naming_an_object_never_uploaded_is_refused_whole(hub, api):
    api.create_commit(REPO, [CommitOperationAdd("config.json", CONFIG)], commit_message="first")
    ghost = CommitOperationAdd("ghost.safetensors", b"never uploaded")
    ghost._upload_mode, ghost._is_uploaded = "lfs", True  # the client believes it was uploaded
    with pytest.raises(HfHubHTTPError) as e:
        api.create_commit(
            REPO, [CommitOperationAdd("config.json", b"{}"), ghost], commit_message="second", token=TOKEN
        )
    assert e.value.response.status_code == 400
    assert "ghost.safetensors" in str(e.value) and sha256(b"never uploaded") in str(e.value)
    assert hub.files[REPO]["config.json"] == CONFIG and "ghost.safetensors" not in hub.files[REPO]
    assert len(hub.commits) == 1 and hub.puts == []
    # an object stored with another size is refused the same way; once right, the whole commit applies
    body = b"\n".join(
        [
            b'{"key": "header", "value": {"summary": "s", "description": ""}}',
            b'{"key": "deletedFile", "value": {"path": "config.json"}}',
            b'{"key": "lfsFile", "value": {"path": "w.bin", "algo": "sha256", "oid": "%s", "size": 3}}'
            % sha256(b"abc").encode(),
        ]
    )
    r = httpx2.put(f"{hub.url}/lfs-upload/{sha256(b'abc')}?size=3", content=b"abc")
    assert r.status_code == 200 and hub.puts == [sha256(b"abc")]
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-ndjson"}
    bad = body.replace(b'"size": 3', b'"size": 4')
    r = httpx2.post(f"{hub.url}/api/models/{REPO}/commit/main", content=bad, headers=headers)
    assert r.status_code == 400 and "w.bin" in r.json()["error"] and "config.json" in hub.files[REPO]
    r = httpx2.post(f"{hub.url}/api/models/{REPO}/commit/main", content=body, headers=headers)
    assert r.status_code == 200 and sorted(hub.files[REPO]) == ["w.bin"] and hub.commits[-1]["lfs"] == ["w.bin"]


def test_an_upload_whose_bytes_are_not_its_oid_is_refused(hub):
    oid = sha256(b"abc")
    r = httpx2.put(f"{hub.url}/lfs-upload/{oid}?size=3", content=b"abd")
    assert r.status_code == 400 and "abc" not in r.text
    r = httpx2.put(f"{hub.url}/lfs-upload/{oid}?size=4", content=b"abc")  # right bytes, wrong size
    assert r.status_code == 400
    assert hub.puts == [] and not os.path.exists(hub.object_path(oid))
    assert os.listdir(os.path.join(hub.storage, "incoming")) == []
    # a chunked body is read as well
    r = httpx2.put(f"{hub.url}/lfs-upload/{oid}?size=3", content=iter([b"a", b"bc"]))
    assert r.status_code == 200 and hub.puts == [oid] and open(hub.object_path(oid), "rb").read() == b"abc"
    hub.add_repo(REPO)
    verify = f"{hub.url}/{REPO}.git/info/lfs/objects/verify"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx2.post(verify, json={"oid": oid, "size": 3}, headers=auth).status_code == 200
    assert httpx2.post(verify, json={"oid": oid, "size": 4}, headers=auth).status_code == 404
    assert httpx2.post(verify, json={"oid": sha256(b"x"), "size": 1}, headers=auth).status_code == 404


def test_writes_need_a_write_token(hub):
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub.url, token=False).create_repo(REPO)
    assert e.value.response.status_code == 401 and hub.repos == {} and hub.auth == [""]
    assert e.value.response.headers["X-Error-Message"]
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub.url, token="hf_read").create_repo(REPO)
    assert e.value.response.status_code == 403 and hub.repos == {}
    writer = HfApi(endpoint=hub.url, token=TOKEN)
    writer.create_repo(REPO)
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub.url, token="hf_read").create_commit(
            REPO, [CommitOperationAdd("model.safetensors", WEIGHTS)], commit_message="no"
        )
    assert e.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub.url, token=False).create_commit(
            REPO, [CommitOperationAdd("model.safetensors", WEIGHTS)], commit_message="no"
        )
    assert e.value.response.status_code == 401
    batch = f"{hub.url}/{REPO}.git/info/lfs/objects/batch"
    payload = {"operation": "upload", "objects": [{"oid": sha256(WEIGHTS), "size": len(WEIGHTS)}]}
    assert httpx2.post(batch, json=payload).status_code == 401
    assert httpx2.post(batch, json=payload, headers={"Authorization": "Bearer hf_read"}).status_code == 403
    commit = f"{hub.url}/api/models/{REPO}/commit/main"
    line = b'{"key": "header", "value": {"summary": "s"}}\n'
    assert httpx2.post(commit, content=line, headers={"Authorization": "Bearer hf_read"}).status_code == 403
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub.url, token="hf_read").create_branch(REPO, branch="dev")
    assert e.value.response.status_code == 403
    assert hub.puts == [] and hub.commits == [] and list(hub.files[REPO]) == []
    # exist_ok: a read token on an existing repository is not an error (the client asks for the repository)
    HfApi(endpoint=hub.url, token="hf_read").create_repo(REPO, exist_ok=True)


def test_a_failed_upload_is_retried(hub, api):
    hub.fail("PUT", r"^/lfs-upload/", [500])
    api.create_commit(REPO, [CommitOperationAdd("model.safetensors", WEIGHTS)], commit_message="retried")
    assert [c for c in calls(hub, status=True) if c[0] == "PUT lfs-upload"] == [
        ("PUT lfs-upload", 500),
        ("PUT lfs-upload", 200),
    ]
    assert hub.puts == [sha256(WEIGHTS)] and hub.sleeps == [1] and len(hub.commits) == 1
    assert hub.files[REPO]["model.safetensors"] == WEIGHTS


def test_preupload_modes_and_oids(hub, api):
    api.create_commit(REPO, [CommitOperationAdd("config.json", CONFIG)], commit_message="c")
    api.create_commit(REPO, [CommitOperationAdd("model.safetensors", WEIGHTS)], commit_message="w")
    files = [
        ("config.json", 10, b"{}"),
        ("model.safetensors", 10, b"text"),
        ("x.gguf", 1, b"x"),
        ("big.txt", 10_000_001, b"text"),
        ("data.dat", 4, b"a\0bc"),
        ("notes.md", 4, b"text"),
    ]
    payload = {"files": [{"path": p, "size": n, "sample": base64.b64encode(s).decode()} for p, n, s in files]}
    r = httpx2.post(
        f"{hub.url}/api/models/{REPO}/preupload/main", json=payload, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    answer = {f["path"]: (f["uploadMode"], f["oid"], f["shouldIgnore"]) for f in r.json()["files"]}
    assert answer == {
        "config.json": ("regular", git_blob_oid(CONFIG), False),
        "model.safetensors": ("lfs", sha256(WEIGHTS), False),
        "x.gguf": ("lfs", None, False),
        "big.txt": ("lfs", None, False),
        "data.dat": ("lfs", None, False),
        "notes.md": ("regular", None, False),
    }
    op = CommitOperationAdd("config.json", CONFIG)
    op._upload_mode = "regular"
    assert op._local_oid == git_blob_oid(CONFIG)  # the oid the client compares with
    with pytest.raises(RepositoryNotFoundError):
        api.create_commit("me/nothing", [CommitOperationAdd("a.txt", b"a")], commit_message="x")
    with pytest.raises(RevisionNotFoundError):
        api.create_commit(REPO, [CommitOperationAdd("a.txt", b"a")], commit_message="x", revision="nope")
    assert len(hub.commits) == 2


def test_branches_pull_requests_and_deletes(hub, api):
    api.create_commit(REPO, [CommitOperationAdd("config.json", CONFIG)], commit_message="c")
    with pytest.raises(RevisionNotFoundError):
        api.repo_info(REPO, revision="dev")
    api.create_branch(REPO, branch="dev")
    api.create_branch(REPO, branch="dev", exist_ok=True)
    with pytest.raises(HfHubHTTPError) as e:
        api.create_branch(REPO, branch="dev")
    assert e.value.response.status_code == 409
    assert api.repo_info(REPO, revision="dev").sha == hub.commits[-1]["oid"]
    api.create_commit(REPO, [CommitOperationAdd("model.safetensors", WEIGHTS)], commit_message="w", revision="dev")
    assert hub.commits[-1]["revision"] == "dev" and hub.branches[REPO]["dev"] == hub.commits[-1]["oid"]
    assert hub.branches[REPO]["main"] == hub.commits[0]["oid"]
    info = api.create_commit(REPO, [CommitOperationAdd("readme.txt", b"hi")], commit_message="pr", create_pr=True)
    assert hub.commits[-1]["create_pr"] is True and info.pr_url == f"{hub.url}/{REPO}/discussions/1"
    api.create_commit(REPO, [CommitOperationDelete("config.json")], commit_message="rm")
    assert hub.commits[-1]["deleted"] == ["config.json"] and "config.json" not in hub.files[REPO]
    with pytest.raises(HfHubHTTPError) as e:
        api.create_commit(REPO, [CommitOperationDelete("config.json")], commit_message="rm again")
    assert e.value.response.status_code == 404


def test_objects_over_the_limit_are_refused_by_the_batch(hub, api):
    hub.max_object_bytes = 1000
    with pytest.raises(ValueError, match="LFS batch API returned errors"):
        api.create_commit(REPO, [CommitOperationAdd("model.safetensors", WEIGHTS)], commit_message="big")
    assert hub.puts == [] and hub.commits == [] and not os.path.exists(hub.object_path(sha256(WEIGHTS)))


def test_storage_stall_and_unknown_requests(tmp_path):
    with FakeHub(storage=tmp_path / "store") as hub:
        r = httpx2.put(f"{hub.url}/lfs-upload/{sha256(b'abc')}?size=3", content=b"abc")
        assert r.status_code == 200 and hub.object_path(sha256(b"abc")).startswith(str(tmp_path / "store"))
        hub.stall("GET", r"^/api/models/", 5)
        with pytest.raises(httpx2.TimeoutException):
            httpx2.get(f"{hub.url}/api/models/{REPO}", timeout=0.3)
        assert httpx2.get(f"{hub.url}/api/whatever").status_code == 404 and hub.unknown == ["GET /api/whatever"]
    assert (tmp_path / "store" / "objects" / sha256(b"abc")).read_bytes() == b"abc"  # a given folder is kept
    with FakeHub(storage=tmp_path / "store") as hub:
        assert hub.has_object(sha256(b"abc"), 3)  # and what it holds counts as uploaded
    with FakeHub() as hub:
        storage = hub.storage
    assert not os.path.exists(storage)  # a temporary one is removed
