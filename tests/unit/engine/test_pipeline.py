"""Several tensors in flight: the bytes, the record and the failures do not depend on the number of workers."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from peft_shardmerge import merge_checkpoint
from peft_shardmerge.checkpoint.reader import CheckpointReader
from peft_shardmerge.errors import InputError, MergeCheckError
from peft_shardmerge.io.safetensors_io import RowReader, read_header
from peft_shardmerge.output.staging import file_digest
from peft_shardmerge.output.writer import ShardWriter, shard_digest


def _files(folder) -> dict[str, bytes]:
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder)) if f != "README.md"}


def _assert_same_output(a, b) -> None:
    """Two outputs of the same merge: every file byte for byte, and the record's per-tensor SHA-256 (computed by the
    threads that wrote them); the record's other fields (times, peak memory) may differ."""
    one, other = _files(a), _files(b)
    assert one.keys() == other.keys() and sum(f.endswith(".safetensors") for f in one) > 1
    for name in one:
        if name != "merge_manifest.json":
            assert one[name] == other[name], name
    records = [json.loads(o["merge_manifest.json"]) for o in (one, other)]
    assert records[0]["shards"] == records[1]["shards"]


@pytest.mark.parametrize("arch", ["llama_sharded", "gpt2"])
def test_the_same_bytes_and_record_whatever_the_workers(arch, make_base, make_adapter, tmp_path):
    base, adapter = make_base(arch), make_adapter(arch, "default")
    for workers in (1, 4):
        out = str(tmp_path / f"w{workers}")
        merge_checkpoint(base, adapter, out, max_shard_size="200KB", workers=workers, progress=False)
    _assert_same_output(tmp_path / "w1", tmp_path / "w4")


def test_each_recorded_sha256_is_the_written_bytes(make_base, make_adapter, tmp_path):
    """The digests the worker threads computed equal SHA-256 of the file's bytes, read back by hand."""
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    out = tmp_path / "out"
    merge_checkpoint(base, adapter, str(out), max_shard_size="200KB", workers=3, progress=False)
    shards = json.loads((out / "merge_manifest.json").read_text())["shards"]
    for name, rec in shards.items():
        data = (out / name).read_bytes()
        header = rec["header"]["size"]
        assert hashlib.sha256(data[:header]).hexdigest() == rec["header"]["sha256"]
        for t, entry in rec["tensors"].items():
            begin, end = entry["offsets"]
            assert hashlib.sha256(data[header + begin : header + end]).hexdigest() == entry["sha256"], t


def test_the_first_failure_in_plan_order_stops_the_merge(make_base, make_adapter, tmp_path, monkeypatch):
    """Two tensors fail, the later one first in time: the earlier one's error is raised, and nothing is left."""
    base, adapter = make_base("llama_sharded"), make_adapter("llama_sharded", "default")
    real = CheckpointReader.write_tensor

    def failing(self, t, w):
        if threading.current_thread() is threading.main_thread():
            raise AssertionError("a merge with workers produces tensors on its worker threads")
        if t.name == "model.layers.0.self_attn.k_proj.weight":  # written before q_proj (the base's order)
            time.sleep(0.5)
            raise OSError(28, "No space left on device")
        if t.name == "model.layers.0.self_attn.q_proj.weight":
            raise OSError(5, "Input/output error")
        return real(self, t, w)

    monkeypatch.setattr(CheckpointReader, "write_tensor", failing)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left on device"):
        merge_checkpoint(base, adapter, str(out), workers=4, progress=False)
    assert not out.exists() and [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


@pytest.mark.parametrize("workers", [0, -1, 1.5, True])
def test_workers_must_be_a_positive_int(workers, make_base, make_adapter, tmp_path):
    base, adapter = make_base("llama"), make_adapter("llama", "default")
    with pytest.raises(InputError, match="workers must be a positive int"):
        merge_checkpoint(base, adapter, str(tmp_path / "out"), workers=workers, progress=False)
    assert not (tmp_path / "out").exists()


def test_in_order_and_in_place_give_the_digest_read_back_from_the_file(tmp_path):
    a, b = torch.arange(6.0), torch.ones(3, dtype=torch.bfloat16)
    entries = [("a", "F32", (6,), 24), ("b", "BF16", (3,), 6)]
    digests = []
    for how in ("in order", "in place"):
        path = str(tmp_path / f"{how}.safetensors")
        with ShardWriter(path, entries) as w:
            for i, t in reversed(list(enumerate((a, b)))) if how == "in place" else enumerate((a, b)):
                if how == "in order":
                    w.write(t)
                else:
                    sink = w.at(i)
                    sink.write(t[:1])
                    sink.write(t[1:])
                    sink.finish()
        assert shard_digest(w.record()) == file_digest(path)
        assert w.record()["tensors"]["a"]["sha256"] == hashlib.sha256(a.numpy().tobytes()).hexdigest()
        digests.append(shard_digest(w.record()))
    assert digests[0] == digests[1]
    w = ShardWriter(str(tmp_path / "bad.safetensors"), entries)
    sink = w.at(1)
    sink.write(a)  # 24 bytes where b has 6
    with pytest.raises(MergeCheckError, match="written twice or with the wrong size"):
        sink.finish()
    w.abort()


def test_a_row_reader_serves_several_threads_at_once(tmp_path):
    path = str(tmp_path / "m.safetensors")
    weights = {f"w{i}": torch.randn(64, 32) for i in range(8)}
    save_file(weights, path)
    infos = {i.name: i for i in read_header(path)[0]}
    errors = []

    def read(name):
        for start in range(0, 64, 8):
            rows = reader.read_rows(infos[name], start, start + 8).clone()
            if not torch.equal(rows, weights[name][start : start + 8]):
                errors.append((name, start))

    with RowReader() as reader:
        threads = [threading.Thread(target=read, args=(n,)) for n in weights for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def test_a_4bit_base_gives_the_same_bytes_whatever_the_workers(tmp_path):
    """base_precision nf4: bitsandbytes' quantization reduces the block scales of a weight (their mean, for double
    quantization); over 32768 of them torch splits that sum over its threads, so it runs on one thread in every
    mode."""
    from peft_shardmerge.testing import build_adapter, build_base

    base = build_base(str(tmp_path / "base"), hidden_size=256, intermediate_size=8704, num_hidden_layers=1)
    adapter = build_adapter(base, str(tmp_path / "adapter"), target_modules=["down_proj", "up_proj"])
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        merge_checkpoint(base, adapter, str(out), base_precision="nf4", workers=workers, progress=False)
        outs.append((out / "model.safetensors").read_bytes())
    assert outs[0] == outs[1]


def _loaded(base: str, adapter: str, quant: str = "none"):
    from peft import PeftModel

    from tests.helpers import load_quantized, no_cpu_repack

    model = load_quantized(base, quant)
    if quant != "none":
        no_cpu_repack(model)
    return PeftModel.from_pretrained(model, adapter)


@pytest.mark.parametrize(
    ("arch", "quant", "dtype"),
    [
        ("llama_sharded", "nf4", "bfloat16"),
        ("gpt2", "none", "bfloat16"),
        ("gpt2", "none", "float16"),
        ("gpt2", "none", "float32"),
        ("qwen2", "8bit", "bfloat16"),
    ],
)
def test_a_loaded_model_gives_the_same_bytes_and_record_whatever_the_workers(
    arch, quant, dtype, make_base, make_adapter, tmp_path
):
    """merge_and_save merges each module on the calling thread and, with several workers, has it written by a worker
    while the next is merged: the same files and the same per-tensor SHA-256 as one thread doing both."""
    if quant != "none":
        pytest.importorskip("bitsandbytes")
    from peft_shardmerge import merge_and_save

    model = _loaded(make_base(arch), make_adapter(arch, "default"), quant)
    for workers in (1, 3):
        out = str(tmp_path / f"w{workers}")
        merge_and_save(
            model,
            out,
            dtype=dtype,
            max_shard_size="200KB",
            workers=workers,
            base_precision="dequantized",
            progress=False,
        )
    _assert_same_output(tmp_path / "w1", tmp_path / "w3")


def test_a_loaded_model_is_merged_in_order_on_the_calling_thread_and_written_by_the_workers(
    make_base, make_adapter, tmp_path, monkeypatch
):
    """The walk, the budget and a job's gathers follow the plan on the calling thread; the hashing and writing of
    every tensor happens on the worker threads."""
    from peft_shardmerge import merge_and_save
    from peft_shardmerge.model.reader import LiveMerger, ModelReader

    model = _loaded(make_base("llama"), make_adapter("llama", "default"))
    merged, written = [], []
    real_produce, real_write = LiveMerger.produce, ModelReader._write_parts

    def produce(self, entry):
        merged.append((entry.name, threading.current_thread().name))
        return real_produce(self, entry)

    def write_parts(*args):
        written.append(threading.current_thread().name)
        return real_write(*args)

    monkeypatch.setattr(LiveMerger, "produce", produce)
    monkeypatch.setattr(ModelReader, "_write_parts", write_parts)
    report = merge_and_save(model, str(tmp_path / "out"), workers=2, base_precision="dequantized", progress=False)
    assert {thread for _, thread in merged} == {threading.main_thread().name}
    record = json.loads((tmp_path / "out" / "merge_manifest.json").read_text())["shards"]["model.safetensors"]
    in_file = sorted(record["tensors"], key=lambda name: record["tensors"][name]["offsets"][0])
    assert [name for name, _ in merged] == in_file  # the plan's order, which is the file's
    assert len(written) == report.tensors_written and all(t.startswith("merge") for t in written)


@pytest.mark.parametrize("where", ["merge", "write"])
def test_a_loaded_models_merge_that_fails_with_workers_leaves_nothing(
    where, make_base, make_adapter, tmp_path, monkeypatch
):
    """A failure while merging a module (on the calling thread) or while writing one (on a worker): raised, and
    neither the output nor a staging folder is left."""
    from peft_shardmerge import merge_and_save
    from peft_shardmerge.model.reader import LiveMerger, ModelReader

    model = _loaded(make_base("llama_sharded"), make_adapter("llama_sharded", "default"))
    victim = "model.layers.1.self_attn.q_proj.weight"
    real_produce, real_write = LiveMerger.produce, ModelReader._write_parts
    error = MergeCheckError(f"tensor {victim!r} has NaN or Inf") if where == "merge" else OSError(28, "No space")

    def produce(self, entry):
        if where == "merge" and entry.name == victim:
            raise error
        return real_produce(self, entry)

    def write_parts(*args):
        written.append(threading.current_thread().name)
        if where == "write" and len(written) == 5:
            raise error
        return real_write(*args)

    written: list[str] = []
    monkeypatch.setattr(LiveMerger, "produce", produce)
    monkeypatch.setattr(ModelReader, "_write_parts", write_parts)
    out = tmp_path / "out"
    with pytest.raises(type(error), match="NaN or Inf" if where == "merge" else "No space"):
        merge_and_save(
            model, str(out), workers=3, max_shard_size="200KB", base_precision="dequantized", progress=False
        )
    assert where == "merge" or written[4].startswith("merge")  # the failing write was a worker's
    assert not out.exists() and [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


@pytest.mark.parametrize("workers", [0, 2.5])
def test_merge_and_save_workers_must_be_a_positive_int(workers, make_base, make_adapter, tmp_path):
    from peft_shardmerge import merge_and_save

    model = _loaded(make_base("llama"), make_adapter("llama", "default"))
    with pytest.raises(InputError, match="workers must be a positive int"):
        merge_and_save(model, str(tmp_path / "out"), workers=workers, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_failed_write_comes_before_a_later_failure_to_merge(make_base, make_adapter, tmp_path, monkeypatch):
    """A worker's write fails, then the calling thread fails to merge a later module: the write's error is raised
    (the first failure in plan order), and nothing is left."""
    from peft_shardmerge import merge_and_save
    from peft_shardmerge.model.reader import LiveMerger, ModelReader

    model = _loaded(make_base("llama_sharded"), make_adapter("llama_sharded", "default"))
    real_produce, real_write = LiveMerger.produce, ModelReader._write_parts
    calls = {"writes": 0, "merges": 0}
    failed = threading.Event()

    def write_parts(*args):
        calls["writes"] += 1
        if calls["writes"] == 2:
            failed.set()
            raise OSError(28, "No space left on device")
        return real_write(*args)

    def produce(self, entry):
        calls["merges"] += 1
        if calls["merges"] == 4:
            failed.wait(5)  # the write has failed, and has not been seen yet
            raise MergeCheckError(f"tensor {entry.name!r} has NaN or Inf")
        return real_produce(self, entry)

    monkeypatch.setattr(LiveMerger, "produce", produce)
    monkeypatch.setattr(ModelReader, "_write_parts", write_parts)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left on device"):
        merge_and_save(model, str(out), workers=2, base_precision="dequantized", progress=False)
    assert not out.exists() and [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_what_is_prepared_and_not_yet_written_stays_under_the_byte_limit(tmp_path):
    """write_placed with a byte limit: the planned bytes prepared and not yet written never go over it (a tensor
    alone may), several small tensors are in flight at once, and the file is the same as without a limit."""
    from types import SimpleNamespace

    from peft_shardmerge.engine.pipeline import worker_pool, write_placed

    sizes = [4, 4, 4, 40, 4, 4, 4, 4, 12, 4]  # float32 elements; 40 alone is over the limit of 12 elements
    ts = [SimpleNamespace(name=f"t{i}", shape=(n,), nbytes=4 * n) for i, n in enumerate(sizes)]
    entries = [(t.name, "F32", t.shape, t.nbytes) for t in ts]
    lock, held, seen = threading.Lock(), [0], []

    def prepare(t):
        with lock:
            held[0] += t.nbytes
            seen.append((held[0], t.nbytes))

        def write(sink):
            time.sleep(0.01)
            sink.write(torch.full(t.shape, float(t.shape[0])))
            with lock:
                held[0] -= t.nbytes

        return write

    for limit in (48, None):
        with ShardWriter(str(tmp_path / f"{limit}.safetensors"), entries) as w, worker_pool(4) as pool:
            write_placed(ts, prepare, w, pool, ahead=8, held_limit=limit)
        if limit is not None:
            assert all(total <= limit or total == own for total, own in seen), seen
            assert any(own < total for total, own in seen)  # several at once
            seen.clear()
    assert (tmp_path / "48.safetensors").read_bytes() == (tmp_path / "None.safetensors").read_bytes()


def test_a_long_write_does_not_hold_back_the_tensors_after_it(tmp_path):
    """write_placed with two workers and two tensors in flight at most: the first write ends only once the last tensor
    is written, so the others must go through the second worker meanwhile (waiting for the writes in their order would
    hold the third tensor back until the first write ended, which never comes: its wait times out and fails it), and
    never more than two are prepared and not yet written."""
    from types import SimpleNamespace

    from peft_shardmerge.engine.pipeline import worker_pool, write_placed

    ts = [SimpleNamespace(name=f"t{i}", shape=(i + 1,), nbytes=4 * (i + 1)) for i in range(6)]
    entries = [(t.name, "F32", t.shape, t.nbytes) for t in ts]
    last_written, counted, lock, in_flight = threading.Event(), [], threading.Lock(), [0, 0]  # now, most

    def prepare(t):
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight)

        def write(sink):
            if t is ts[0] and not last_written.wait(60):
                raise TimeoutError("the last tensor was not written while the first one's write ran")
            sink.write(torch.full(t.shape, float(t.shape[0])))
            with lock:
                in_flight[0] -= 1
            if t is ts[-1]:
                last_written.set()

        return write

    path = tmp_path / "model.safetensors"
    with ShardWriter(str(path), entries) as w, worker_pool(2) as pool:
        write_placed(ts, prepare, w, pool, ahead=2, done=counted.append)
    assert in_flight == [0, 2]
    assert sorted(counted) == sorted(t.nbytes for t in ts)
    assert {k: v.tolist() for k, v in load_file(str(path)).items()} == {t.name: [t.shape[0]] * t.shape[0] for t in ts}


@pytest.mark.parametrize("model_checks", ["first", "beside"])
def test_a_merge_leaves_no_cyclic_garbage_per_tensor_or_shard(model_checks, tmp_path):
    """The command line merges with the cyclic garbage collector off (``api/cli.py``), which is safe only while what a
    merge leaves unreachable does not grow with what it writes: 2 layers and 16 (14 and 112 merged weights), in shards
    of 200 kB (10 and 66 shards), after a first merge that makes the one-time imports."""
    import gc

    from peft_shardmerge.testing import build_adapter, build_base

    models = {}
    for layers in (2, 16):
        base = build_base(str(tmp_path / f"b{layers}"), "llama", num_hidden_layers=layers)
        models[layers] = base, build_adapter(base, str(tmp_path / f"a{layers}"))
    left, shards = {}, {}
    for i, layers in enumerate((2, 2, 16)):
        out = tmp_path / f"o{i}"
        gc.collect()
        gc.disable()
        try:
            merge_checkpoint(
                *models[layers], str(out), model_checks=model_checks, max_shard_size="200KB", progress=False
            )
            left[layers] = gc.collect()
        finally:
            gc.enable()
        shards[layers] = len(list(out.glob("*.safetensors")))
    assert shards[16] > 5 * shards[2] > 0, shards
    assert left[16] - left[2] < 20, left  # one cyclic object per merged weight would be 98 more, per shard 56
