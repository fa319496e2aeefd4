"""verify without inputs: the merge record (merge_manifest.json) catches every change of a finished output, from a
single flipped bit to a missing shard; a folder without a record is UNCHECKED, never OK."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.output.record import RECORD_FILE, shard_record
from peft_shardmerge.output.writer import ShardWriter, TensorDigests
from peft_shardmerge.verify.report import verify_checkpoint


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, make_base, make_adapter):
    """Untampered outputs: fp32 in 7 shards, bf16 in one file."""
    root = tmp_path_factory.mktemp("integrity")
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    fp32, bf16 = str(root / "fp32"), str(root / "bf16")
    merge_checkpoint(base, adapter, fp32, dtype="float32", max_shard_size="300KB", progress=False)
    merge_checkpoint(base, adapter, bf16, dtype="bfloat16", progress=False)
    return {"fp32": fp32, "bf16": bf16}


def _copy(src: str, tmp_path, name: str = "copy") -> str:
    return str(shutil.copytree(src, tmp_path / name))


def _shards(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def _header_size(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _flip(path: str, pos: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))


def _failed(folder: str, *needles: str):
    report = verify_checkpoint(folder)
    assert report.status == "FAILED" and not report.ok and report.exit_code == 1, report.summary()
    text = "\n".join(report.problems)
    for needle in needles:
        assert needle in text, report.summary()
    return report


def test_record_is_written_and_loaders_ignore_it(outputs):
    for folder in outputs.values():
        record = json.load(open(os.path.join(folder, RECORD_FILE)))
        assert record["tool"]["name"] == "peft-shardmerge" and record["algorithm"] == "sha256"
        assert record["merge"]["path"] == "disk" and record["merge"]["base_precision"] == "original"
        assert set(record["shards"]) == {os.path.basename(p) for p in _shards(folder)}
        assert "config.json" in record["files"] and "/" not in json.dumps(record["merge"]["base"]["name"])
        for path in _shards(folder):  # every tensor's digest is the SHA-256 of the bytes safetensors reads
            entry = record["shards"][os.path.basename(path)]
            with safe_open(path, framework="pt") as h:
                for name in h.keys():
                    t = h.get_tensor(name)
                    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
                    assert hashlib.sha256(raw).hexdigest() == entry["tensors"][name]["sha256"]
        report = verify_checkpoint(folder)
        assert report.status == "OK" and report.integrity is True, report.summary()
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(outputs["fp32"], output_loading_info=True)
    assert not any(info.values())
    # llama.cpp's converter and sentence-transformers take weights from *.safetensors only
    assert not RECORD_FILE.endswith(".safetensors")


def test_one_bit_flips_in_tensor_data(outputs, tmp_path):
    """60 seeded random bit flips in tensor data, across every shard, fp32 and bf16."""
    rng = random.Random(1234)
    detected = 0
    for case in range(60):
        folder = _copy(outputs["fp32" if case % 2 else "bf16"], tmp_path, f"c{case}")
        path = rng.choice(_shards(folder))
        start = _header_size(path)
        pos = rng.randrange(start, os.path.getsize(path))
        _flip(path, pos, rng.randrange(8))
        report = _failed(folder, os.path.basename(path), "tensor(s) differ from what the merge wrote")
        detected += report.status == "FAILED"
        shutil.rmtree(folder)
    assert detected == 60


def test_one_bit_flips_in_headers(outputs, tmp_path):
    """30 seeded random bit flips in shard headers (length prefix, JSON, padding): named, never a traceback."""
    rng = random.Random(99)
    for case in range(30):
        folder = _copy(outputs["fp32" if case % 2 else "bf16"], tmp_path, f"h{case}")
        path = rng.choice(_shards(folder))
        _flip(path, rng.randrange(0, _header_size(path)), rng.randrange(8))
        _failed(folder, os.path.basename(path))
        shutil.rmtree(folder)


def _tensors(folder: str) -> dict:
    out = {}
    for path in _shards(folder):
        size = _header_size(path)
        header = json.loads(open(path, "rb").read(size)[8:])
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (path, size + meta["data_offsets"][0], size + meta["data_offsets"][1], meta)
    return out


def test_huge_value_written_into_a_weight(outputs, tmp_path):
    """A weight set to 3e38 (bit pattern of the stored dtype), at 10 seeded places."""
    rng = random.Random(7)
    for case in range(10):
        kind = "fp32" if case % 2 else "bf16"
        folder = _copy(outputs[kind], tmp_path, f"v{case}")
        name, (path, begin, end, meta) = rng.choice(sorted(_tensors(folder).items()))
        value = torch.tensor([3e38], dtype=torch.float32 if kind == "fp32" else torch.bfloat16)
        raw = value.view(torch.uint8).numpy().tobytes()
        pos = begin + rng.randrange((end - begin) // len(raw)) * len(raw)
        with open(path, "r+b") as f:
            f.seek(pos)
            f.write(raw)
        _failed(folder, name)
        shutil.rmtree(folder)


def test_two_same_shape_tensors_swapped(outputs, tmp_path):
    """Same-shape tensors swapped, by their bytes (header untouched) and by their header offsets."""
    rng = random.Random(5)
    cases = 0
    for kind in ("fp32", "bf16"):
        by_shape: dict = {}
        for name, info in _tensors(outputs[kind]).items():
            by_shape.setdefault((tuple(info[3]["shape"]), info[3]["dtype"]), []).append(name)
        pairs = [(a, b) for names in by_shape.values() for a in names for b in names if a < b]
        for i, (a, b) in enumerate(rng.sample(pairs, 6)):
            folder = _copy(outputs[kind], tmp_path, f"s{kind}{i}")
            tensors = _tensors(folder)
            (pa, ba, ea, _), (pb, bb, eb, _) = tensors[a], tensors[b]
            da, db = open(pa, "rb").read()[ba:ea], open(pb, "rb").read()[bb:eb]
            if da == db:  # e.g. two untouched norms of ones
                shutil.rmtree(folder)
                continue
            for path, pos, data in ((pa, ba, db), (pb, bb, da)):
                with open(path, "r+b") as f:
                    f.seek(pos)
                    f.write(data)
            _failed(folder, a, b)
            shutil.rmtree(folder)
            cases += 1
        # the header variant: one file, the two tensors' offsets exchanged (same header length)
        folder = _copy(outputs[kind], tmp_path, f"sh{kind}")
        tensors = _tensors(folder)
        a, b = next((x, y) for x, y in pairs if tensors[x][0] == tensors[y][0])
        path = tensors[a][0]
        size = _header_size(path)
        data = open(path, "rb").read()
        header = json.loads(data[8:size])
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (size - 8 - len(raw))
        open(path, "wb").write(data[:8] + raw + data[size:])
        _failed(folder, os.path.basename(path), "header differs")
        cases += 1
    assert cases >= 12


def test_truncated_and_extended_files(outputs, tmp_path):
    rng = random.Random(11)
    for case in range(16):
        folder = _copy(outputs["fp32" if case % 2 else "bf16"], tmp_path, f"t{case}")
        path = rng.choice(_shards(folder))
        size = os.path.getsize(path)
        if case < 8:
            cut = rng.choice([1, 2, 7, rng.randrange(1, size)])
            os.truncate(path, size - cut)
            _failed(folder, "truncated")
        else:
            with open(path, "ab") as f:
                f.write(os.urandom(rng.choice([1, 8, 4096])))
            _failed(folder, "extended")
        shutil.rmtree(folder)


def test_missing_and_extra_shards(outputs, tmp_path):
    for i, path in enumerate(_shards(outputs["fp32"])):  # every shard removed in turn
        folder = _copy(outputs["fp32"], tmp_path, f"m{i}")
        os.remove(os.path.join(folder, os.path.basename(path)))
        _failed(folder, f"shard {os.path.basename(path)} is missing")
        shutil.rmtree(folder)
    for i, extra in enumerate(["model-00008-of-00007.safetensors", "pytorch_model.bin", "model.safetensors"]):
        folder = _copy(outputs["fp32"], tmp_path, f"x{i}")
        shutil.copyfile(_shards(folder)[0], os.path.join(folder, extra))
        _failed(folder, f"{extra} was not written by the merge")
        shutil.rmtree(folder)
    folder = _copy(outputs["fp32"], tmp_path, "readme")  # a file added by hand is named, not a failure
    open(os.path.join(folder, "README.md"), "w").write("# my model\n")
    report = verify_checkpoint(folder)
    assert report.status == "OK" and any("README.md was added after the merge" in n for n in report.notes)


def _edit_json(path: str, change) -> None:
    data = json.load(open(path))
    change(data)
    json.dump(data, open(path, "w"), indent=2)


def test_edited_index_config_and_record(outputs, tmp_path):
    edits = [
        ("model.safetensors.index.json", lambda d: d["metadata"].update(total_size=d["metadata"]["total_size"] + 1)),
        (
            "model.safetensors.index.json",
            lambda d: d["weight_map"].update({"lm_head.weight": sorted(set(d["weight_map"].values()))[0]}),
        ),
        ("model.safetensors.index.json", lambda d: None),  # same content, other bytes
        ("config.json", lambda d: d.update(rms_norm_eps=1e-5)),
        ("config.json", lambda d: d.update(rope_theta=d.get("rope_theta", 10000.0) * 2)),
        ("generation_config.json", lambda d: d.update(temperature=0.1)),
    ]
    for i, (name, change) in enumerate(edits):
        folder = _copy(outputs["fp32"], tmp_path, f"e{i}")
        _edit_json(os.path.join(folder, name), change)
        _failed(folder, f"{name} differs from what the merge wrote")
        shutil.rmtree(folder)
    folder = _copy(outputs["fp32"], tmp_path, "rec")  # the record itself edited: refused as a whole
    _edit_json(os.path.join(folder, RECORD_FILE), lambda d: d["merge"].update(dtype="bfloat16"))
    _failed(folder, f"{RECORD_FILE} does not match its own digest")


@pytest.mark.slow
def test_corrupted_json_files_give_problems_not_tracebacks(outputs, tmp_path):
    for name in ("config.json", "model.safetensors.index.json", RECORD_FILE):
        folder = _copy(outputs["fp32"], tmp_path, name)
        path = os.path.join(folder, name)
        open(path, "w").write(open(path).read()[:40])
        r = subprocess.run(
            [sys.executable, "-m", "peft_shardmerge", "verify", folder], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 1 and r.stdout.startswith("FAILED: "), (r.stdout, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr, r.stderr
        assert "not valid JSON" in r.stdout or f"{RECORD_FILE} cannot be read" in r.stdout, r.stdout


def test_folder_without_record_is_unchecked(outputs, tmp_path, make_base):
    folder = _copy(outputs["fp32"], tmp_path)
    os.remove(os.path.join(folder, RECORD_FILE))
    report = verify_checkpoint(folder)
    assert report.status == "UNCHECKED" and not report.ok and report.exit_code == 3 and not report.problems
    assert any("the bytes were not checked" in n for n in report.notes)
    r = subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "verify", make_base("llama")],
        capture_output=True,
        text=True,
        timeout=300,
    )  # saved by transformers, not by us
    assert r.returncode == 3 and r.stdout.startswith("UNCHECKED: ") and "Traceback" not in r.stderr, r.stdout
    assert "Loading weights" not in r.stderr and "Warning" not in r.stderr, r.stderr


def test_shard_record_from_file_equals_the_record_written(tmp_path):
    """A shard kept from an interrupted run gets the same record from its file as the writer computed."""
    rng = random.Random(3)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(5000))
    fd = os.open(src, os.O_RDONLY)
    entries = [
        ("a", "F32", (3, 5), 60),
        ("empty", "F32", (0,), 0),
        ("b", "BF16", (100,), 200),
        ("copied", "U8", (1000,), 1000),
        ("c", "F16", (7,), 14),
    ]
    path = str(tmp_path / "x.safetensors")
    with ShardWriter(path, entries) as w:
        w.write(torch.randn(3, 5))
        w.write(torch.randn(100).bfloat16()[:40])
        w.write(torch.randn(100).bfloat16()[40:])
        w.copy_from(fd, rng.randrange(4000), 1000)
        w.write(torch.randn(7).half())
    os.close(fd)
    assert w.record() == shard_record(path)
    with safe_open(path, framework="pt") as h:
        assert h.get_tensor("copied").numel() == 1000


def test_tensor_digests_split_any_chunking():
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.choice([0, 1, 3, 64, 1000]) for _ in range(rng.randrange(1, 8))]
        data = os.urandom(sum(sizes))
        d = TensorDigests([(f"t{i}", n) for i, n in enumerate(sizes)])
        pos = 0
        while pos < len(data):
            step = rng.randrange(1, 300)
            d.update(data[pos : pos + step])
            pos += step
        want, begin = {}, 0
        for i, n in enumerate(sizes):
            want[f"t{i}"] = hashlib.sha256(data[begin : begin + n]).hexdigest()
            begin += n
        assert d.digests() == want
    with pytest.raises(ValueError):
        TensorDigests([("a", 1)]).update(b"xy")


def test_crafted_record_with_a_valid_digest_is_handled(outputs, tmp_path):
    """A record rewritten with a matching digest but hostile entries: problems, never a read outside OUT."""
    from peft_shardmerge.output.record import record_digest

    folder = _copy(outputs["fp32"], tmp_path)
    path = os.path.join(folder, RECORD_FILE)
    record = json.load(open(path))
    record["files"]["../../etc/hostname"] = {"size": 1, "sha256": "0" * 64}
    record["files"]["config.json"] = "not an object"
    first = sorted(record["shards"])[0]
    del record["shards"][first]["header"]
    record["record_sha256"] = record_digest(record)
    json.dump(record, open(path, "w"))
    report = _failed(
        folder,
        "'../../etc/hostname' in a malformed entry",
        "'config.json' in a malformed entry",
        f"the entry of {first} is malformed",
    )
    assert not any("could not be checked" in p for p in report.problems)
