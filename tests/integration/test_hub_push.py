"""A merge pushed to the Hub as it is made (the push command, merge_checkpoint(push_to_hub=), the drop-ins), against
a local server that speaks the Hub's LFS path and checks what the Hub checks: bytes equal a local merge's, one
commit, a bounded staging folder, a rerun after a kill that sends nothing twice, nothing committed on a failure."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
from disk_use import DiskSampler

from peft_shardmerge import HubUploadError, InputError, merge_checkpoint
from peft_shardmerge.testing import build_adapter, build_base

SHARD = "300KB"
REPO = "me/tiny-push"


@pytest.fixture()
def hub(monkeypatch):
    import huggingface_hub.constants as hc
    from hub_server import FakeHub

    with FakeHub() as server:
        monkeypatch.setattr(hc, "ENDPOINT", server.url)
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)  # the LFS path, which this server speaks
        yield server


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A base of eight layers (5.3 MB in float32, about 20 shards of 300 KB), an adapter, and their local merge."""
    tmp = tmp_path_factory.mktemp("push")
    base = build_base(str(tmp / "base"), num_hidden_layers=8)
    adapter = build_adapter(base, str(tmp / "adapter"))
    local = str(tmp / "local")
    merge_checkpoint(base, adapter, local, max_shard_size=SHARD, progress=False)
    return base, adapter, local


def _sha256(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _shards(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def _bound(local: str) -> int:
    """What the push may hold in its staging folder, from the local merge's files: two of its largest shards, the
    files beside them, and the room kept for the files the push makes (model card, record, journal)."""
    shards = _shards(local)
    largest = max(os.path.getsize(os.path.join(local, f)) for f in shards)
    beside = sum(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local) if f not in shards)
    return 2 * largest + beside + 10**6


def _same_as_local(files, local: str) -> None:
    """The pushed files equal the local merge's, byte for byte (the model card is the push's own; the record lists
    it too and is otherwise the same)."""
    shards = _shards(local)
    assert set(files) == set(os.listdir(local)) | {"README.md"}
    for name in os.listdir(local):
        if name != "merge_manifest.json":
            assert files[name] == open(os.path.join(local, name), "rb").read(), name
    pushed, here = (
        json.loads(files["merge_manifest.json"]),
        json.load(open(os.path.join(local, "merge_manifest.json"))),
    )
    assert pushed["shards"] == here["shards"] and set(pushed["shards"]) == set(shards)
    assert pushed["merge"] == here["merge"]
    assert {k: v for k, v in pushed["files"].items() if k != "README.md"} == here["files"]


@pytest.mark.parametrize("workers", [1, 3])  # tensors written in order, and at their places from three threads
def test_a_push_equals_a_local_merge_in_one_commit_within_its_staging_bound(case, hub, tmp_path, workers):
    base, adapter, local = case
    staging = tmp_path / "staging"
    staging.mkdir()
    with DiskSampler(str(staging)) as sampler:
        report = merge_checkpoint(
            base, adapter, push_to_hub=REPO, token="hf_x", staging=str(staging), max_shard_size=SHARD, progress=False,
            workers=workers,
        )  # fmt: skip
    files = hub.files[REPO]
    _same_as_local(files, local)
    assert len(hub.commits) == 1 and sorted(hub.commits[0]["lfs"]) == _shards(local)
    assert sorted(hub.puts) == sorted(_sha256(os.path.join(local, f)) for f in _shards(local))  # each sent once
    total = sum(os.path.getsize(os.path.join(local, f)) for f in _shards(local))
    assert sampler.samples > 10 and 0 < sampler.peak <= _bound(local) and total >= 3 * _bound(local)
    assert os.listdir(staging) == []  # the staging folder, its lock and its journal are gone
    assert report.out_dir == f"hf://{REPO}" and any(n.startswith("pushed: ") for n in report.notes)
    # what was pushed is a checkpoint whose record checks every byte
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    for name in files:
        (pulled / name).write_bytes(files[name])
    from peft_shardmerge.verify.report import verify_checkpoint

    assert verify_checkpoint(str(pulled)).exit_code == 0


def _cli_env(hub, **more) -> dict:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_TOKEN", None)
    return {**env, **more}


def _push_command(base, adapter, repo, staging, *more) -> list[str]:
    return [
        sys.executable, "-m", "peft_shardmerge", "push", base, adapter, repo, "--staging", staging,
        "--max-shard-size", SHARD, "--model-checks", "first", *more,
    ]  # fmt: skip


def _unshare_works() -> bool:
    try:
        done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.skipif(sys.platform != "linux" or not shutil.which("unshare"), reason="a tmpfs needs Linux's unshare")
def test_the_push_command_into_a_tmpfs_a_third_of_the_output(case, hub, tmp_path):
    """The staging folder is a tmpfs (in a mount namespace of the command's own) of the bound's size, a third of the
    output or less: the push completes, one commit; below the bound it is refused before anything is merged."""
    if not _unshare_works():
        pytest.skip("unshare -rm (a user and mount namespace) is not allowed on this machine")
    base, adapter, local = case
    total = sum(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local))
    bound = _bound(local)
    assert 3 * bound <= total  # the tmpfs is a third of the output or less
    mount = tmp_path / "mnt"
    mount.mkdir()

    def run(size: int, repo: str):
        script = f'mount -t tmpfs -o size={size} tmpfs "$1" && shift && exec "$@"'
        command = ["unshare", "-rm", "sh", "-c", script, "sh", str(mount)]
        command += _push_command(base, adapter, repo, str(mount), "-q")
        return subprocess.run(command, env=_cli_env(hub, HF_TOKEN="hf_x"), capture_output=True, text=True, timeout=300)

    small = run(bound // 2, "me/too-small")
    assert small.returncode == 2 and "pushing this merge holds at most" in small.stderr, small.stderr
    assert hub.puts == [] and hub.commits == [] and "me/too-small" not in hub.repos  # no repository made either
    done = run(bound, "me/tmpfs")
    assert done.returncode == 0, done.stderr
    assert len(hub.commits) == 1
    _same_as_local(hub.files["me/tmpfs"], local)


def test_killed_after_some_uploads_a_rerun_sends_nothing_twice(case, hub, tmp_path):
    base, adapter, local = case
    staging = tmp_path / "staging"
    staging.mkdir()
    hub.stall("PUT", r"/lfs-upload/", 0.3, times=None)  # uploads slower than the merge: the kill lands midway
    journal = staging / "peft-shardmerge-push-me--killed.journal.json"
    command = _push_command(base, adapter, "me/killed", str(staging), "-q")
    first = subprocess.Popen(command, env=_cli_env(hub, HF_TOKEN="hf_x"), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if len(json.loads(journal.read_text())["shards"]) >= 3:
                break
        except (OSError, ValueError, KeyError):
            pass
        assert first.poll() is None, first.stderr.read()
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    sent = list(hub.puts)
    assert len(sent) >= 3 and hub.commits == []  # nothing is visible in the repository
    journaled = json.loads(journal.read_text())["shards"]
    dropped = sorted(journaled)[0]  # the Hub forgot one upload meanwhile: that shard is merged and sent again
    hub.drop_object(journaled[dropped]["sha256"])
    kept = {name: entry for name, entry in journaled.items() if name != dropped}

    hub.stall("PUT", r"/lfs-upload/", 0.0, times=None)
    hub._stalls.clear()
    command.remove("-q")  # the summary says what was resumed
    rerun = subprocess.run(command, env=_cli_env(hub, HF_TOKEN="hf_x"), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert len(hub.commits) == 1
    _same_as_local(hub.files["me/killed"], local)
    again = hub.puts[len(sent) :]
    assert not set(again) & {e["sha256"] for e in kept.values()}  # the journal's shards were not sent again...
    assert journaled[dropped]["sha256"] in again  # ...but the one the Hub dropped was
    assert len(again) == len(set(again)) and len(set(hub.puts)) == len(_shards(local))
    assert f"resumed: {len(kept)} shard(s) kept from an interrupted run" in rerun.stdout  # neither merged again
    assert len(again) == len(_shards(local)) - len(kept)
    assert os.listdir(staging) == []


def test_a_refused_upload_commits_nothing_and_a_rerun_completes(case, hub, tmp_path, monkeypatch):
    base, adapter, local = case
    files = hub.add_repo("me/kept")
    files["notes.txt"] = b"the owner's file"
    hub.fail("POST", r"/objects/batch$", [400])  # not retried
    hub.echo_auth = True  # the server's message carries the token: ours must not
    monkeypatch.setenv("HF_TOKEN", "hf_secret_0")  # the token as huggingface_hub finds it
    with pytest.raises(HubUploadError, match=r"(?s)me/kept.*Nothing was committed") as e:
        merge_checkpoint(
            base, adapter, push_to_hub="me/kept", staging=str(tmp_path), max_shard_size=SHARD, progress=False
        )
    assert "hf_secret_0" not in str(e.value) and "Bearer ***" in str(e.value)
    assert hub.commits == [] and dict(files.items()) == {"notes.txt": b"the owner's file"}
    hub.echo_auth = False
    hub.fail("PUT", r"/lfs-upload/", [500])  # retried by huggingface_hub
    merge_checkpoint(
        base, adapter, push_to_hub="me/kept", token="hf_secret_0", staging=str(tmp_path), max_shard_size=SHARD,
        progress=False,
    )  # fmt: skip
    assert len(hub.commits) == 1 and files["notes.txt"] == b"the owner's file"  # what was there is left alone
    _same_as_local({k: files[k] for k in files if k != "notes.txt"}, local)


@pytest.mark.parametrize(
    ("token", "said"),
    [("hf_read", "refuses to take files into me/ro with this token"), (None, "no valid token")],
)
def test_a_token_without_write_access_is_refused_before_merging(case, hub, tmp_path, token, said, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    base, adapter, _ = case
    hub.add_repo("me/ro")
    with pytest.raises(HubUploadError, match=said) as e:
        merge_checkpoint(base, adapter, push_to_hub="me/ro", token=token, staging=str(tmp_path), progress=False)
    assert "nothing was merged" in str(e.value)
    assert hub.puts == [] and hub.commits == []
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("peft-shardmerge-push", ".peft-shardmerge-push"))]


def test_a_push_to_a_new_branch_makes_it_at_the_commit(case, hub, tmp_path):
    base, adapter, local = case
    merge_checkpoint(
        base, adapter, push_to_hub="me/branched", token="hf_x", revision="dev", commit_message="merged at last",
        staging=str(tmp_path), max_shard_size=SHARD, progress=False,
    )  # fmt: skip
    (commit,) = hub.commits
    assert commit["revision"] == "dev" and commit["header"]["summary"] == "merged at last"
    assert "dev" in hub.branches["me/branched"]
    hub.fail("POST", r"/commit/", [422])  # a refused commit: the branch the push made goes with it
    with pytest.raises(HubUploadError, match="the commit for me/branched failed"):
        merge_checkpoint(
            base, adapter, push_to_hub="me/branched", token="hf_x", revision="next", staging=str(tmp_path),
            max_shard_size="500KB", overwrite=True, progress=False,  # other shards (main's deleted): a commit to make
        )  # fmt: skip
    assert set(hub.branches["me/branched"]) == {"main", "dev"} and len(hub.commits) == 1


def test_a_gguf_is_pushed_with_its_record_and_card(gguf_case, hub, tmp_path):
    base, adapter, _ = gguf_case("llama")
    (tmp_path / "s").mkdir()
    local = tmp_path / "local.gguf"
    merge_checkpoint(base, adapter, str(local), outtype="q8_0", progress=False)
    report = merge_checkpoint(
        base, adapter, push_to_hub="me/tiny-gguf", token="hf_x", outtype="q8_0", staging=str(tmp_path / "s"),
        progress=False,
    )  # fmt: skip
    files = hub.files["me/tiny-gguf"]
    assert set(files) == {"tiny-gguf.Q8_0.gguf", "tiny-gguf.Q8_0.merge_manifest.json", "README.md", "Modelfile"}
    assert len(hub.commits) == 1 and hub.commits[0]["lfs"] == ["tiny-gguf.Q8_0.gguf"]
    import gguf

    pushed = tmp_path / "pushed.gguf"
    pushed.write_bytes(files["tiny-gguf.Q8_0.gguf"])
    a, b = gguf.GGUFReader(str(pushed)), gguf.GGUFReader(str(local))
    assert [(t.name, bytes(t.data)) for t in a.tensors] == [(t.name, bytes(t.data)) for t in b.tensors]
    assert str(bytes(a.fields["general.name"].parts[-1]), "utf-8") == "Tiny Gguf"  # the converter's, from the repo
    assert "gguf" in files["README.md"].decode() and report.out_dir == "hf://me/tiny-gguf"
    assert os.listdir(tmp_path / "s") == []


def test_push_to_hub_merged_streams_a_loaded_4bit_model(hub, tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft_shardmerge import merge_and_save, push_to_hub_merged
    from tests.integration.test_inprocess import qlora

    base = build_base(str(tmp_path / "base"), num_hidden_layers=8)
    model = qlora(base, "llama", "nf4")
    local = str(tmp_path / "local")
    merge_and_save(model, local, dtype="bfloat16", max_shard_size="150KB", progress=False)
    staging = tmp_path / "staging"
    staging.mkdir()
    with DiskSampler(str(staging)) as sampler:
        url = push_to_hub_merged(
            model, "me/qlora", dtype="bfloat16", max_shard_size="150KB", temporary_location=str(staging),
            token="hf_x", progress=False,
        )  # fmt: skip
    assert len(hub.commits) == 1 and "/me/qlora/commit/" in url
    _same_as_local(hub.files["me/qlora"], local)
    assert len(hub.puts) == len(set(hub.puts)) == len(_shards(local))
    assert sampler.samples > 10 and 0 < sampler.peak <= _bound(local)
    assert os.listdir(staging) == []


def test_a_push_of_other_shards_refuses_or_deletes_the_repository_s_old_ones(case, hub, tmp_path):
    """The weight files an earlier push left that this one does not write would be loaded instead of the new ones
    (one model.safetensors wins over an index): refused before merging, or deleted in the same commit."""
    base, adapter, local = case
    merge_checkpoint(base, adapter, push_to_hub="me/again", token="hf_x", staging=str(tmp_path), progress=False)
    assert set(hub.files["me/again"]) >= {"model.safetensors"}
    other = build_adapter(base, str(tmp_path / "other"), seed=7)
    with pytest.raises(InputError, match=r"me/again holds model\.safetensors, which this push does not write"):
        merge_checkpoint(
            base, other, push_to_hub="me/again", token="hf_x", staging=str(tmp_path), max_shard_size=SHARD,
            progress=False,
        )  # fmt: skip
    assert len(hub.commits) == 1 and len(hub.puts) == 1  # refused before anything was merged or sent
    merge_checkpoint(
        base, other, push_to_hub="me/again", token="hf_x", staging=str(tmp_path), max_shard_size=SHARD,
        overwrite=True, progress=False,
    )  # fmt: skip
    assert hub.commits[-1]["deleted"] == ["model.safetensors"]
    mine = tmp_path / "mine"
    merge_checkpoint(base, other, str(mine), max_shard_size=SHARD, progress=False)
    _same_as_local(hub.files["me/again"], str(mine))


def test_ctrl_c_while_the_commit_is_made_ends_the_push_complete(case, hub, tmp_path):
    """Once the commit's one request is sent the push ends with it: an interrupt then is said, not obeyed half-way."""
    base, adapter, local = case
    staging = tmp_path / "staging"
    staging.mkdir()
    hub.stall("POST", r"/commit/", 3.0)
    command = _push_command(base, adapter, "me/late", str(staging), "-q")
    push = subprocess.Popen(command, env=_cli_env(hub, HF_TOKEN="hf_x"), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(hub.puts) < len(_shards(local)) and time.monotonic() < deadline:  # every shard up: the commit is next
        time.sleep(0.02)
    time.sleep(1.0)
    push.send_signal(signal.SIGINT)
    _, err = push.communicate(timeout=120)
    assert push.returncode == 0, err
    assert "interrupted while the commit was made: the push is complete" in err
    assert len(hub.commits) == 1 and os.listdir(staging) == []  # committed, and the journal gone with the folder
    _same_as_local(hub.files["me/late"], local)


def test_refusals_before_merging_say_what_is_wrong(case, hub, tmp_path, monkeypatch):
    """Each refused before any repository is made or any byte merged, with the cause named and the token masked."""
    from peft_shardmerge.api.hub import prepare_repo

    base, adapter, _ = case
    monkeypatch.setenv("HF_TOKEN", "hf_from_env_0")
    hub.echo_auth = True

    def push(repo, **kw):
        return merge_checkpoint(base, adapter, push_to_hub=repo, staging=str(tmp_path), progress=False, **kw)

    hub.fail("POST", r"/api/repos/create", [403])  # the server's answer carries the token it was sent
    with pytest.raises(HubUploadError, match="cannot create or write") as e:
        push("me/r1")
    assert "hf_from_env_0" not in str(e.value) and "Bearer ***" in str(e.value)
    hub.fail("POST", r"/preupload/", [503] * 6)  # retried by huggingface_hub, then said as the server's
    monkeypatch.setattr("huggingface_hub.utils._http.time", types.SimpleNamespace(sleep=lambda s: None))
    with pytest.raises(HubUploadError, match=r"server error \(503\), not about the token"):
        push("me/r2")
    with pytest.raises(InputError, match="a pull request is opened against a branch that exists"):
        prepare_repo("me/r3", create_pr=True, revision="nobranch")  # what push_to_hub_merged(create_pr=True) asks
    os.symlink(str(tmp_path / "elsewhere"), str(tmp_path / "peft-shardmerge-push-me--r4"))
    with pytest.raises(InputError, match="is not a staging folder of peft-shardmerge's made by this user"):
        push("me/r4")
    assert "me/r4" not in hub.repos and hub.puts == [] and hub.commits == []


def test_ctrl_c_while_a_shard_uploads_stops_at_once_with_nothing_committed(case, hub, tmp_path):
    """The merge does not wait for the upload under way (its thread is not joined): Ctrl-C ends the command within
    seconds though the upload would take a minute, the repository as it was, the staging folder emptied."""
    base, adapter, _ = case
    staging = tmp_path / "staging"
    staging.mkdir()
    hub.stall("PUT", r"/lfs-upload/", 60.0, times=None)
    command = _push_command(base, adapter, "me/stopped", str(staging), "-q")
    push = subprocess.Popen(command, env=_cli_env(hub, HF_TOKEN="hf_x"), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(m == "POST" and p.endswith("/objects/batch") for m, p, _ in hub.log) and time.monotonic() < deadline:
        time.sleep(0.02)  # the first shard's upload is asked for: its PUT stalls
    time.sleep(0.5)
    push.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = push.communicate(timeout=60)
    assert push.returncode == 130 and time.monotonic() - t0 < 10, err
    assert "interrupted; nothing was committed to me/stopped" in err
    assert hub.commits == [] and os.listdir(staging) == []
