"""Writes past the page cache (output/direct.py): whatever the order, the threads and the cuts of the writes, the file
holds exactly the bytes written; a refused or failed direct write is handled; the merge's output is the same bytes
with and without them."""

from __future__ import annotations

import errno
import fcntl
import filecmp
import json
import mmap
import os
import random
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.output import direct
from peft_shardmerge.output import writer as writer_module
from peft_shardmerge.output.direct import ALIGN, DirectWrites
from peft_shardmerge.output.writer import ShardWriter
from peft_shardmerge.testing import build_adapter, build_base
from tests.helpers import KILL_AFTER_SHARDS, seven_shard_merge, shard_keys, tensor_bytes

PIECE = 4 * ALIGN  # small pieces: many direct writes per tensor


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _layout(seed: int):
    """A header and tensor sizes around the block size: empty, tiny (several in one block), one byte short of and
    past a block, many blocks; and the bytes the file must hold."""
    rng = random.Random(seed)
    head = os.urandom(rng.choice([8, 37, ALIGN - 3, ALIGN, 2 * ALIGN + 100]))
    sizes = [0, 1, 3, 8, ALIGN - 1, ALIGN, ALIGN + 1, 3 * PIECE + 5, 5, 2 * PIECE, 17, PIECE - 8]
    rng.shuffle(sizes)
    tensors = [os.urandom(n) for n in sizes]
    return head, tensors, head + b"".join(tensors)


def _write(path, head, tensors, seed: int, threads: int = 3) -> DirectWrites:
    """Write the tensors from several threads, each tensor cut at random places and handed in in order."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, head)
        size = len(head) + sum(map(len, tensors))
        d = DirectWrites(str(path), fd, size, head, PIECE, threads=2, buffers=3)
        begins = [len(head) + sum(map(len, tensors[:i])) for i in range(len(tensors))]
        order = list(range(len(tensors)))
        random.Random(seed).shuffle(order)

        def worker(k: int) -> None:
            rng = random.Random(seed * 100 + k)
            for i in order[k::threads]:
                data, pos = memoryview(tensors[i]), begins[i]
                while data:
                    n = rng.randint(1, max(1, len(data)))
                    d.pwrite(data[:n], pos)
                    data, pos = data[n:], pos + n

        workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        d.close()
        os.fsync(fd)
    finally:
        os.close(fd)
    return d


def _needs_direct(tmp_path) -> None:
    try:
        fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        pytest.skip(f"this filesystem takes no O_DIRECT: {e}")
    try:
        os.pwrite(fd, memoryview(mmap.mmap(-1, ALIGN)), 0)
    except OSError as e:
        pytest.skip(f"this filesystem refuses direct writes: {e}")
    finally:
        os.close(fd)
        os.unlink(tmp_path / "probe")


@pytest.mark.parametrize("seed", range(6))
def test_writes_from_several_threads_in_any_order_and_cut_give_the_bytes_written(seed, tmp_path, monkeypatch):
    _needs_direct(tmp_path)
    head, tensors, want = _layout(seed)
    sizes = {"direct": [], "cached": []}
    real = os.pwrite

    def pwrite(fd, data, offset):
        sizes["direct" if _is_direct(fd) else "cached"].append((offset, len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    d = _write(tmp_path / "f", head, tensors, seed)
    assert (tmp_path / "f").read_bytes() == want
    assert d.direct and d.error is None
    # every direct write is aligned and at most a piece; together with the blocks written through the cache, every
    # byte after the header's whole blocks is written exactly once
    align = d.align
    assert sizes["direct"] and all(o % align == 0 and 0 < n <= PIECE and n % align == 0 for o, n in sizes["direct"])
    covered = sorted(sizes["direct"] + sizes["cached"])
    start = len(head) - len(head) % align
    assert covered[0][0] == start and all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))
    assert covered[-1][0] + covered[-1][1] == len(want)


def test_the_shared_blocks_held_are_bounded(tmp_path, monkeypatch):
    _needs_direct(tmp_path)
    monkeypatch.setattr(direct, "HELD_BLOCKS", 2)
    head, tensors, want = _layout(3)
    held = []
    real = DirectWrites._fragment

    def fragment(self, view, pos):
        real(self, view, pos)
        held.append(len(self._complete))

    monkeypatch.setattr(DirectWrites, "_fragment", fragment)
    _write(tmp_path / "f", head, tensors, 3)
    assert (tmp_path / "f").read_bytes() == want
    assert held and max(held) < 2


def test_a_copy_at_an_unaligned_place_shares_only_its_end_blocks(tmp_path, monkeypatch):
    _needs_direct(tmp_path)
    monkeypatch.setenv(direct.ENVIRONMENT, "1")
    n = 5 * writer_module.WRITE_PIECE + 7
    data = os.urandom(n)
    (tmp_path / "src").write_bytes(data)
    cached = []
    real = os.pwrite

    def pwrite(fd, view, offset):
        if not _is_direct(fd):
            cached.append(len(view))
        return real(fd, view, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    path = str(tmp_path / "out.safetensors")
    src = os.open(tmp_path / "src", os.O_RDONLY)
    try:
        with ShardWriter(path, [("a", "U8", (3,), 3), ("b", "U8", (n,), n)]) as w:
            for index, (offset, nbytes) in enumerate([(0, 3), (0, n)]):
                sink = w.at(index)
                sink.copy_from(src, offset, nbytes)
                sink.finish()
            assert w._direct
    finally:
        os.close(src)
    loaded = load_file(path)
    assert loaded["a"].numpy().tobytes() == data[:3] and loaded["b"].numpy().tobytes() == data
    assert len(cached) <= 3  # the header (written first), and the two blocks the tensors share with their ends


def test_a_refused_direct_write_sends_the_rest_through_the_page_cache(tmp_path, monkeypatch):
    _needs_direct(tmp_path)
    head, tensors, want = _layout(1)
    real = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if _is_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    d = _write(tmp_path / "f", head, tensors, 1)
    assert (tmp_path / "f").read_bytes() == want
    assert not d.direct and refused


def test_a_failed_direct_write_is_raised(tmp_path, monkeypatch):
    _needs_direct(tmp_path)
    head, tensors, _ = _layout(2)
    real = os.pwrite

    def pwrite(fd, data, offset):
        if _is_direct(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError) as e:
        _write(tmp_path / "f", head, tensors, 2)
    assert e.value.errno == errno.ENOSPC


def test_abort_while_threads_write_stops_them_without_a_hang(tmp_path, monkeypatch):
    _needs_direct(tmp_path)
    real = os.pwrite

    def slow(fd, data, offset):
        if _is_direct(fd):
            time.sleep(0.05)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    ends: list[BaseException | None] = []
    try:
        d = DirectWrites(str(tmp_path / "f"), fd, 8 * 16 * PIECE, b"", PIECE, threads=2, buffers=3)

        def writer(k: int) -> None:
            try:
                d.pwrite(memoryview(bytes(16 * PIECE)), k * 16 * PIECE)
                ends.append(None)
            except OSError as e:
                ends.append(e)

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.2)
        d.abort()
        for t in threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in threads)
        assert len(ends) == 8 and any(isinstance(e, OSError) and e.errno == errno.EBADF for e in ends)
        with pytest.raises(OSError):  # nothing is written once closed
            d.pwrite(memoryview(bytes(PIECE)), 0)
        d.abort()  # again: nothing left to do
    finally:
        os.close(fd)


def test_a_block_never_completed_is_named_at_close(tmp_path):
    from peft_shardmerge.errors import MergeCheckError

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        d = DirectWrites(str(tmp_path / "f"), fd, 3 * ALIGN, b"", PIECE)
        d.pwrite(memoryview(b"x" * (d.align + 10)), 0)
        with pytest.raises(MergeCheckError, match=f"1 block.*offset {d.align}"):
            d.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "setting, free, merge, want",
    [
        ("1", 1 << 50, 0, True),
        ("0", 0, 1 << 62, False),
        ("auto", 0, 0, True),
        ("auto", 1 << 50, 0, False),
        ("auto", 1 << 50, 1 << 62, True),
        ("auto", 1 << 50, 1 << 20, False),
        (None, 0, 0, True),
    ],
    ids=[
        "always",
        "never",
        "auto, no free memory",
        "auto, memory free",
        "auto, the merge larger than memory",
        "auto, the merge smaller than memory",
        "unset",
    ],
)
def test_a_shard_in_place_goes_past_the_page_cache_where_wanted(setting, free, merge, want, tmp_path, monkeypatch):
    if setting is None:
        monkeypatch.delenv(direct.ENVIRONMENT, raising=False)
    else:
        monkeypatch.setenv(direct.ENVIRONMENT, setting)
    monkeypatch.setattr(direct, "free_memory", lambda: free)
    allowed = direct.filesystem_type(str(tmp_path)) in direct.DIRECT_FILESYSTEMS
    path = str(tmp_path / "a.safetensors")
    with ShardWriter(path, [("w", "F32", (4,), 16)], working_set=merge) as w:
        sink = w.at(0)
        sink.write(torch.arange(4.0))
        sink.finish()
        used = bool(w._direct)
    assert used == (want and allowed)
    assert torch.equal(load_file(path)["w"], torch.arange(4.0))


def test_free_memory_is_the_kernels_memfree(monkeypatch):
    monkeypatch.setattr(direct, "_PROC_CGROUP", "/nonexistent")  # the machine's, whatever container runs the tests
    with open("/proc/meminfo") as f:  # the kernel's own count, read a moment apart
        want = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemFree:"))
    assert abs(direct.free_memory() - want) < 256 << 20


def test_physical_memory_is_the_kernels_memtotal(monkeypatch):
    monkeypatch.setattr(direct, "_PROC_CGROUP", "/nonexistent")
    with open("/proc/meminfo") as f:
        want = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemTotal:"))
    assert abs(direct.physical_memory() - want) < 1 << 30  # the kernel reserves a little at boot, counted or not


def test_a_merge_weighs_what_it_reads_and_writes_against_the_machines_memory(tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_shardmerge import merge_and_save

    base = build_base(str(tmp_path / "base"))
    adapter = build_adapter(base, str(tmp_path / "adapter"))
    seen: list[int] = []
    wanted = direct.wanted
    monkeypatch.setattr(direct, "wanted", lambda path, nbytes, working_set=0: seen.append(working_set) or False)
    merge_checkpoint(base, adapter, str(tmp_path / "disk"), progress=False, model_checks="first")
    out = tensor_bytes(tmp_path / "disk")
    assert seen and set(seen) == {tensor_bytes(base) + out}  # every base tensor read once, every output written
    seen.clear()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    merge_and_save(model, str(tmp_path / "original"), progress=False)  # merged from the base's folder it came from
    assert set(seen) == {tensor_bytes(base) + out}
    seen.clear()
    merge_and_save(model, str(tmp_path / "loaded"), base_precision="dequantized", progress=False)
    assert seen and set(seen) == {tensor_bytes(tmp_path / "loaded")}  # from the weights in memory: nothing read
    monkeypatch.setenv(direct.ENVIRONMENT, "auto")
    monkeypatch.setattr(direct, "physical_memory", lambda: out + 1)  # holds the output, not the base beside it
    if direct.filesystem_type(str(tmp_path)) not in direct.DIRECT_FILESYSTEMS:
        pytest.skip("this filesystem is not one direct writes are used on")
    chosen: list[bool] = []
    monkeypatch.setattr(direct, "wanted", lambda *a: chosen.append(wanted(*a)) or chosen[-1])
    merge_checkpoint(base, adapter, str(tmp_path / "direct"), progress=False, workers=2, model_checks="first")
    assert chosen and all(chosen)  # with free memory to spare: the base would not stay in the page cache beside it
    names = [n for n in os.listdir(tmp_path / "disk") if n.endswith(".safetensors")]
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "disk", tmp_path / "direct", names, shallow=False)
    assert match == names


def test_a_resumed_merge_weighs_only_the_shards_it_has_left(tmp_path, monkeypatch):
    base, adapter = seven_shard_merge(tmp_path)
    out = str(tmp_path / "out")
    r = subprocess.run([sys.executable, "-c", KILL_AFTER_SHARDS, base, adapter, out], capture_output=True, timeout=300)
    assert r.returncode == 9, r.stderr
    with open(tmp_path / ".out.partial" / "manifest.json") as f:
        kept = set(json.load(f)["shards"])  # finished and recorded; the next one was being written
    assert len(kept) == 3
    seen: list[int] = []
    monkeypatch.setattr(direct, "wanted", lambda path, nbytes, working_set=0: seen.append(working_set) or False)
    merge_checkpoint(base, adapter, out, dtype="bfloat16", max_shard_size="1MB", model_checks="first", progress=False)
    left = [n for f, keys in shard_keys(out).items() if f not in kept for n in keys]
    whole = tensor_bytes(base) + tensor_bytes(out)
    assert set(seen) == {tensor_bytes(base, left) + tensor_bytes(out, left)} and seen[0] < whole


def test_the_alignment_is_the_filesystems_block_where_larger(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        block = int(subprocess.run(["stat", "-f", "-c", "%S", str(tmp_path)], capture_output=True, text=True).stdout)
        assert direct.alignment(fd) == max(ALIGN, mmap.PAGESIZE, block)
    finally:
        os.close(fd)


@pytest.mark.skipif(shutil.which("findmnt") is None, reason="findmnt (util-linux) is the reference")
@pytest.mark.parametrize("where", ["tmp", "/proc", "/dev/shm", "/"])
def test_the_filesystem_type_is_the_one_findmnt_names(where, tmp_path):
    path = str(tmp_path) if where == "tmp" else where
    if not os.path.exists(path):
        pytest.skip(f"{path} is not on this machine")
    want = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", path], capture_output=True, text=True, check=True)
    assert direct.filesystem_type(path) == want.stdout.split()[-1]  # over-mounts: the last one is seen


def test_a_merge_writes_the_same_bytes_past_the_page_cache_and_through_it(tmp_path, monkeypatch):
    base = build_base(str(tmp_path / "base"))
    adapter = build_adapter(base, str(tmp_path / "adapter"))
    monkeypatch.setenv(direct.ENVIRONMENT, "1")
    if not direct.wanted(str(tmp_path / "x"), 1):
        pytest.skip("this filesystem is not one direct writes are used on")
    merge_checkpoint(base, adapter, str(tmp_path / "direct"), workers=2, progress=False, model_checks="first")
    monkeypatch.setenv(direct.ENVIRONMENT, "0")
    merge_checkpoint(base, adapter, str(tmp_path / "cached"), workers=2, progress=False, model_checks="first")
    names = sorted(n for n in os.listdir(tmp_path / "direct") if n.endswith((".safetensors", ".json")))
    names.remove("merge_manifest.json")  # names the output folder
    assert any(n.endswith(".safetensors") for n in names)
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "direct", tmp_path / "cached", names, shallow=False)
    assert not mismatch and not errors


def _fake_cgroups(root, monkeypatch, line: str, groups: dict[str, tuple[str, str]], v1: bool):
    """``/proc/self/cgroup`` and a memory controller's folders under ``root``, each group's limit and usage files."""
    (root / "self").write_text(line + "\n")
    mount = root / ("memory" if v1 else "unified")
    files = ("memory.limit_in_bytes", "memory.usage_in_bytes") if v1 else ("memory.max", "memory.current")
    for group, (limit, held) in groups.items():
        folder = mount / group.lstrip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / files[0]).write_text(limit + "\n")
        (folder / files[1]).write_text(held + "\n")
    monkeypatch.setattr(direct, "_PROC_CGROUP", str(root / "self"))
    monkeypatch.setattr(direct, "_CGROUP_MOUNTS", ((str(mount), "memory" if v1 else "", files),))


@pytest.mark.parametrize(
    "v1, line, groups, want",
    [
        (False, "0::/pod/ctr", {"/": ("max", "9"), "/pod": ("max", "5"), "/pod/ctr": ("1000", "300")}, (1000, 300)),
        (False, "0::/pod/ctr", {"/pod": ("800", "500"), "/pod/ctr": ("max", "300")}, (800, 500)),
        (False, "0::/", {"/": ("max", "7")}, None),
        (True, "4:cpu,memory:/docker/abc", {"/docker/abc": ("2000", "10")}, (2000, 10)),
        (True, "4:memory:/docker/abc", {"/": ("3000", "20")}, (3000, 20)),  # mounted at the container's own group
        (True, "4:memory:/", {"/": ("9223372036854771712", "20")}, None),
        (True, "3:cpu:/x", {"/x": ("1000", "1")}, None),
    ],
    ids=[
        "v2 own limit",
        "v2 a parent's",
        "v2 none",
        "v1",
        "v1 mounted at the group",
        "v1 unlimited",
        "no memory line",
    ],
)
def test_the_tightest_control_group_limit_is_the_processs(v1, line, groups, want, tmp_path, monkeypatch):
    _fake_cgroups(tmp_path, monkeypatch, line, groups, v1)
    assert direct.cgroup_memory() == want
    if want is not None:
        assert direct.physical_memory() == want[0] and direct.free_memory() == want[0] - want[1]


def test_a_real_control_group_limit_is_seen_and_chosen_by(tmp_path):
    """Where this process may create a memory control group (root on a cgroup v1 or v2 host), a child process put in
    one limited to 512 MiB sees that limit, and a merge of 600 MiB goes past the page cache."""
    with open("/proc/self/cgroup") as f:
        lines = [line.split(":", 2) for line in f.read().splitlines()]
    candidates = [f"/sys/fs/cgroup/memory{p}" for _, c, p in lines if "memory" in c.split(",")]
    candidates += [f"/sys/fs/cgroup{p}" for _, c, p in lines if c == ""]
    group = None
    for parent in candidates:
        try:
            os.mkdir(os.path.join(parent, "peft-shardmerge-test"))
        except OSError:
            continue
        group = os.path.join(parent, "peft-shardmerge-test")
        break
    if group is None:
        pytest.skip("no memory control group can be created here")
    try:
        limit_file = "memory.limit_in_bytes" if "/memory" in group else "memory.max"
        try:
            with open(os.path.join(group, limit_file), "w") as f:
                f.write(str(512 << 20))
        except OSError:
            pytest.skip("the memory controller is not enabled for a new control group here")
        code = (
            "from peft_shardmerge.output import direct; import sys; "
            "print(direct.physical_memory(), direct.free_memory(), direct.wanted(sys.argv[1], 1, 600 << 20))"
        )
        script = f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1" "$2"'
        r = subprocess.run(
            ["sh", "-c", script, sys.executable, code, str(tmp_path / "x")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        memory, free, chosen = r.stdout.split()
        assert int(memory) == 512 << 20 and 0 <= int(free) <= 512 << 20
        assert chosen == str(direct.filesystem_type(str(tmp_path)) in direct.DIRECT_FILESYSTEMS)
    finally:
        os.rmdir(group)


def _entries(sizes):
    return [(f"t{i}", "U8", (n,), n) for i, n in enumerate(sizes)]


def test_a_shards_blocks_are_allocated_when_it_is_created_on_the_listed_filesystems(tmp_path):
    """On ext4 and XFS the whole file is allocated before its first tensor (the size the header announces, its
    blocks on the disk); on a filesystem off the list (tmpfs) nothing is: the file grows as it is written."""
    if direct.filesystem_type(str(tmp_path)) not in direct.DIRECT_FILESYSTEMS:
        pytest.skip("the test folder is on no filesystem of the list")
    sizes = [3 << 20, 5, 1 << 20]
    path = tmp_path / "model.safetensors"
    w = ShardWriter(str(path), _entries(sizes))
    try:
        st = os.stat(path)
        assert st.st_size == w._header[0] + sum(sizes)
        assert st.st_blocks * 512 >= st.st_size
        for i, n in enumerate(sizes):
            sink = w.at(i)
            sink.write(torch.full((n,), i + 1, dtype=torch.uint8))
            sink.finish()
        w.close()
    finally:
        w.abort()
    loaded = load_file(str(path))
    assert [int(loaded[f"t{i}"].sum()) for i in range(3)] == [(i + 1) * n for i, n in enumerate(sizes)]


def test_a_shard_on_a_filesystem_off_the_list_is_not_allocated_ahead(tmp_path):
    if not os.path.isdir("/dev/shm") or direct.filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    other = ShardWriter(f"/dev/shm/{os.getpid()}-{tmp_path.name}.safetensors", _entries([3 << 20, 5]))
    try:
        assert os.path.getsize(other.path) == other._header[0]  # the header alone: not allocated ahead
    finally:
        other.abort()
        os.unlink(other.path)


@pytest.mark.parametrize("setting", ["0", "1"])
def test_what_another_rank_wrote_is_read_as_data_not_as_the_allocated_size(setting, tmp_path, monkeypatch):
    """Rank 0's progress bar counts the data of the other ranks' shards: a shard allocated whole shows only the
    header and the tensors written so far (through the page cache or past it), the whole file once it is closed."""
    from peft_shardmerge.output.shard_sink import written_bytes

    if direct.filesystem_type(str(tmp_path)) not in direct.DIRECT_FILESYSTEMS:
        pytest.skip("the test folder is on no filesystem of the list")
    monkeypatch.setenv(direct.ENVIRONMENT, setting)
    mib = 1 << 20
    path = str(tmp_path / "model.safetensors")
    assert written_bytes(path) == 0  # not created yet
    w = ShardWriter(path, _entries([mib, mib, mib]))
    try:
        head = w._header[0]
        assert os.path.getsize(path) == head + 3 * mib
        assert written_bytes(path) < mib  # the header's block
        for i in (0, 2):
            sink = w.at(i)
            sink.write(torch.full((mib,), i + 1, dtype=torch.uint8))
            sink.finish()
        block = max(ALIGN, mmap.PAGESIZE, os.statvfs(tmp_path).f_frsize)  # direct.alignment's
        deadline = time.monotonic() + 10  # past the page cache, the shard's threads write the pieces meanwhile,
        while written_bytes(path) < 2 * mib - 8 * block and time.monotonic() < deadline:  # the ends at close
            time.sleep(0.01)
        assert 2 * mib - 8 * block <= written_bytes(path) <= head + 2 * mib + 2 * block  # to the file's blocks
        sink = w.at(1)
        sink.write(torch.full((mib,), 2, dtype=torch.uint8))
        sink.finish()
        w.close()
    finally:
        w.abort()
    assert written_bytes(path) == head + 3 * mib


@pytest.mark.parametrize("answer", ["no progress", "EIO", "ENXIO"])
def test_a_filesystem_that_cannot_tell_data_from_holes_gives_the_size(answer, tmp_path, monkeypatch):
    """Rank 0's count of another rank's bytes never hangs nor fails the merge: a SEEK_HOLE that does not move on, or an
    lseek failing, gives the file's size; ENXIO (no data from there on) what was counted before it."""
    from peft_shardmerge.output.shard_sink import written_bytes

    path = tmp_path / "shard"
    path.write_bytes(b"x" * 10000)
    real = os.lseek

    def lseek(fd, pos, how):
        if how == os.SEEK_HOLE and answer == "no progress":
            return pos
        if how == os.SEEK_DATA and answer != "no progress":
            raise OSError(errno.EIO if answer == "EIO" else errno.ENXIO, answer)
        return real(fd, pos, how)

    monkeypatch.setattr(os, "lseek", lseek)
    assert written_bytes(str(path)) == (0 if answer == "ENXIO" else 10000)


@pytest.mark.parametrize("failure", [errno.ENOSPC, errno.EOPNOTSUPP])
def test_a_disk_without_room_for_a_shard_is_said_before_a_byte_is_written(failure, tmp_path, monkeypatch):
    """The allocation failing for want of room (the kernel's ENOSPC, injected: the disk filled since the merge checked
    its free space) stops the merge before it writes a byte of the shard, header included, named as the filesystem's
    error; the staging folder goes and the earlier output in OUT is untouched. Where the filesystem does not allocate
    so (EOPNOTSUPP), the merge writes the same bytes all the same."""
    from peft_shardmerge.errors import FileSystemError

    kind = direct.filesystem_type(str(tmp_path))
    monkeypatch.setattr(direct, "DIRECT_FILESYSTEMS", direct.DIRECT_FILESYSTEMS | {kind})  # wherever the test runs
    monkeypatch.setenv(direct.ENVIRONMENT, "0")
    base = build_base(str(tmp_path / "base"))
    adapter = build_adapter(base, str(tmp_path / "adapter"))
    out = tmp_path / "out"
    options = dict(progress=False, model_checks="first", overwrite=True)
    merge_checkpoint(base, adapter, str(out), **options)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    written, asked = [], []
    real_write, real_pwrite = os.write, os.pwrite

    def refused(fd, size):
        asked.append(os.fstat(fd).st_size)
        raise OSError(failure, os.strerror(failure))

    def write(fd, data):
        written.append(os.readlink(f"/proc/self/fd/{fd}"))  # the shards' writes, and others (the output lock)
        return real_write(fd, data)

    def pwrite(fd, data, offset):
        written.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct, "_fallocate", refused)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "pwrite", pwrite)
    if failure == errno.EOPNOTSUPP:
        merge_checkpoint(base, adapter, str(out), **options)
        assert asked and any(p.endswith(".safetensors") for p in written)
        after = {n: (out / n).read_bytes() for n in os.listdir(out) if n != "merge_manifest.json"}
        assert after == {n: b for n, b in before.items() if n != "merge_manifest.json"}
        return
    with pytest.raises(FileSystemError, match="No space left on device"):
        merge_checkpoint(base, adapter, str(out), **options)
    assert asked == [0] and not any(p.endswith(".safetensors") for p in written)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["adapter", "base", "out"]  # no staging folder, no lock left


def test_the_choice_of_writes_past_the_page_cache_is_logged_with_its_figures(tmp_path, monkeypatch, caplog):
    import logging

    if direct.filesystem_type(str(tmp_path)) not in direct.DIRECT_FILESYSTEMS:
        pytest.skip("this filesystem is not one direct writes are used on")
    monkeypatch.setenv(direct.ENVIRONMENT, "auto")
    monkeypatch.setattr(direct, "free_memory", lambda: 0)
    with caplog.at_level(logging.DEBUG, logger="peft_shardmerge.output.direct"):
        assert direct.wanted(str(tmp_path / "model.safetensors"), 2 << 30, 5 << 30)
    assert "model.safetensors written past the page cache: 0.00 GB free for 2.15 GB" in caplog.text
    assert "writing 5.37 GB (PEFT_SHARDMERGE_DIRECT_IO=0 to write through it)" in caplog.text
