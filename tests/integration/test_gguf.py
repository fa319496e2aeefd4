"""GGUF output (OUT ending in .gguf) against llama.cpp's own tools: the whole file equals what its converter writes
from PEFT's fp32 merge of the same base and adapter; K-quant tensors equal its quantizer applied to the converter's
f32 file; values read back with gguf-py equal PEFT's merge; bad input refused before anything is written."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")

from peft_shardmerge import InputError, UnsupportedError, merge_checkpoint
from tests.gguf_tokenizers import TOKENIZERS, write_tokenizer


def peft_merge(base: str, adapter: str, kind: str, out: str) -> str:
    """PEFT's fp32 merge of ``adapter`` into ``base``, saved with its tokenizer: the converter's input."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(out):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
        write_tokenizer(out, kind)
    return out


def read(path: str) -> dict[str, tuple[str, np.ndarray, tuple[int, ...]]]:
    """name -> (type, raw bytes, GGUF shape) of every tensor of a GGUF file."""
    return {
        t.name: (t.tensor_type.name, np.asarray(t.data).view(np.uint8).copy(), tuple(int(n) for n in t.shape))
        for t in gguf.GGUFReader(path).tensors
    }


def test_values_read_back_are_pefts_merge(gguf_case, tmp_path):
    """Without the converter: an f32 GGUF holds PEFT's fp32 merge, each tensor under the converter's name (q/k
    rows permuted back), read with gguf-py."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter, _ = gguf_case("llama")
    out = str(tmp_path / "m.gguf")
    report = merge_checkpoint(base, adapter, out, outtype="f32", progress=False)
    assert report.shards == ["m.gguf"] and report.bytes_written == os.path.getsize(out)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()
    got = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(out).tensors}
    cfg = model.config
    q = got["blk.1.attn_q.weight"].reshape(cfg.num_attention_heads, -1, 2, cfg.hidden_size)
    unpermuted = q.swapaxes(1, 2).reshape(-1, cfg.hidden_size)  # the converter's permutation undone
    np.testing.assert_array_equal(unpermuted, merged["model.layers.1.self_attn.q_proj.weight"].numpy())
    np.testing.assert_array_equal(got["blk.0.ffn_down.weight"], merged["model.layers.0.mlp.down_proj.weight"].numpy())
    np.testing.assert_array_equal(got["token_embd.weight"], merged["model.embed_tokens.weight"].numpy())
    assert len(got) == len(merged) - 0  # every tensor, none twice


def test_q8_0_read_back_is_within_its_step(gguf_case, tmp_path):
    base, adapter, _ = gguf_case("llama")
    f32, q8 = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    merge_checkpoint(base, adapter, f32, outtype="f32", progress=False)
    merge_checkpoint(base, adapter, q8, outtype="q8_0", progress=False)
    exact, quantized = read(f32), read(q8)
    for name, (kind, raw, shape) in quantized.items():
        want = exact[name][1].view(np.float32)
        if kind == "F32":
            np.testing.assert_array_equal(raw.view(np.float32), want)
            continue
        assert kind == "Q8_0"
        back = gguf.quants.dequantize(raw.reshape(-1, shape[0] // 32 * 34), gguf.GGMLQuantizationType.Q8_0)
        step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
        # half a step, and the scale's own rounding to f16 (a 2**-11 relative error over up to 127 steps)
        assert (np.abs(back.reshape(-1, 32) - want.reshape(-1, 32)) <= step * 0.57).all(), name


def test_bad_input_is_refused_before_anything_is_written(gguf_case, make_base, make_adapter, tmp_path):
    base, adapter, _ = gguf_case("llama")
    out = tmp_path / "x.gguf"
    cases = [
        (dict(outtype="q3_k"), "outtype 'q3_k' is not a GGUF type written here"),
        (dict(max_shard_size="1GB"), "applies to a folder's shards; a GGUF output is one file"),
        (dict(dtype="float16"), "pass outtype instead"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InputError, match=message):
            merge_checkpoint(base, adapter, str(out), progress=False, **kwargs)
    with pytest.raises(InputError, match="applies to a GGUF output"):
        merge_checkpoint(base, adapter, str(tmp_path / "folder"), outtype="q8_0", progress=False)
    # gpt2 has no rules here; a base without tokenizer cannot be written either
    with pytest.raises(UnsupportedError, match="GPT2LMHeadModel is not written by peft-shardmerge"):
        merge_checkpoint(make_base("gpt2"), make_adapter("gpt2", "default"), str(out), progress=False)
    with pytest.raises(InputError, match="tokenizer"):
        merge_checkpoint(make_base("llama"), make_adapter("llama", "default"), str(out), progress=False)
    out.write_bytes(b"mine")
    with pytest.raises(InputError, match="exists; pass overwrite=True"):
        merge_checkpoint(base, adapter, str(out), progress=False)
    with pytest.raises(InputError, match="was not written by peft-shardmerge"):  # never a file we did not write
        merge_checkpoint(base, adapter, str(out), progress=False, overwrite=True)
    assert out.read_bytes() == b"mine" and sorted(os.listdir(tmp_path)) == ["x.gguf"]
    out.unlink()
    merge_checkpoint(base, adapter, str(out), progress=False)
    first = out.read_bytes()
    report = merge_checkpoint(base, adapter, str(out), progress=False, overwrite=True, outtype="q8_0")
    assert out.read_bytes() != first and report.dtype == "q8_0"  # an earlier output of ours is replaced
    assert sorted(os.listdir(tmp_path)) == ["x.gguf", "x.merge_manifest.json"]
    nested = tmp_path / "new" / "sub" / "m.gguf"  # folders made as for a folder output
    merge_checkpoint(base, adapter, str(nested), progress=False)
    assert nested.read_bytes()[:4] == b"GGUF"


def test_a_failed_write_leaves_nothing(gguf_case, tmp_path, monkeypatch):
    from peft_shardmerge.output import gguf_sink

    base, adapter, _ = gguf_case("llama")

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_sink, "_encode", fail)
    with pytest.raises(OSError):
        merge_checkpoint(base, adapter, str(tmp_path / "x.gguf"), progress=False)
    assert os.listdir(tmp_path) == []


def test_dry_run_lists_the_gguf_tensors(gguf_case, tmp_path):
    base, adapter, _ = gguf_case("llama")
    report = merge_checkpoint(base, adapter, str(tmp_path / "x.gguf"), outtype="q8_0", dry_run=True)
    assert "GGUF" in report.plan_text and "blk.0.attn_q.weight" in report.plan_text and "Q8_0" in report.plan_text
    assert os.listdir(tmp_path) == []


# llama.cpp's converter: a subprocess in a virtual environment of its own
CONVERTER_CASES = (
    [(a, "q8_0") for a in TOKENIZERS]
    + [(a, t) for a in ("llama", "mistral", "qwen2", "gemma2", "phi3") for t in ("f16", "bf16")]
    + [("llama", "f32")]
)


@pytest.mark.slow
@pytest.mark.parametrize("arch,outtype", CONVERTER_CASES, ids=[f"{a}-{t}" for a, t in CONVERTER_CASES])
def test_the_file_is_the_converters(arch, outtype, gguf_case, tmp_path):
    """The whole file, byte for byte: what llama.cpp's converter writes from PEFT's fp32 merge (saved in a folder
    named as our output, which the converter names the model after)."""
    from tests.gguf_refs import run_converter

    base, adapter, kind = gguf_case(arch)
    reference = peft_merge(base, adapter, kind, str(tmp_path / "merged"))
    want = run_converter(reference, str(tmp_path / "converter.gguf"), outtype)
    got = str(tmp_path / "ours" / "merged.gguf")
    os.makedirs(os.path.dirname(got))
    merge_checkpoint(base, adapter, got, outtype=outtype, progress=False)
    a, b = read(want), read(got)
    assert list(a) == list(b)
    assert [n for n in a if a[n][0] != b[n][0] or not np.array_equal(a[n][1], b[n][1])] == []
    with open(want, "rb") as f, open(got, "rb") as g:
        assert f.read() == g.read()  # the metadata and tokenizer too


KQUANT_CASES = [
    ("llama", "q4_k_m"),
    ("llama", "q5_k_m"),
    ("llama", "q6_k"),
    ("qwen2", "q4_k_m"),
    ("mixtral", "q4_k_m"),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,outtype", KQUANT_CASES, ids=[f"{a}-{t}" for a, t in KQUANT_CASES])
def test_kquant_tensors_are_llama_cpps_quantizer_on_the_converters_f32(arch, outtype, gguf_case, tmp_path):
    """Each tensor's type and bytes: llama.cpp's quantizer (its C reference quantizers, compiled here) applied to
    the converter's f32 file, in the type our port of its choice gives (rows of 256 and more: the K-quants run)."""
    from tests import gguf_cquants
    from tests.gguf_refs import run_converter

    base, adapter, kind = gguf_case(arch, hidden_size=256, intermediate_size=512)
    reference = peft_merge(base, adapter, kind, str(tmp_path / "merged"))
    f32 = read(run_converter(reference, str(tmp_path / "converter-f32.gguf"), "f32"))
    got = str(tmp_path / "merged.gguf")
    merge_checkpoint(base, adapter, got, outtype=outtype, progress=False)
    ours = read(got)
    assert sorted(ours) == sorted(f32)  # in llama-quantize's order (test_gguf_llama_cpp.py checks it)
    kinds = set()
    for name, (qtype, raw, shape) in ours.items():
        rows = f32[name][1].view(np.float32).reshape(-1, shape[0])
        kinds.add(qtype)
        if qtype in ("Q4_K", "Q5_K", "Q6_K"):
            want = gguf_cquants.quantize(qtype[:-1].lower() + "K", rows)
        else:
            want = gguf.quants.quantize(rows if len(shape) > 1 else rows.reshape(-1), gguf.GGMLQuantizationType[qtype])
        assert np.array_equal(raw.reshape(-1), np.ascontiguousarray(want).view(np.uint8).reshape(-1)), name
    assert {"Q4_K", "Q6_K"} <= kinds if outtype == "q4_k_m" else True


def test_a_split_output_is_llama_cpps_split_files(gguf_case, tmp_path):
    import json

    from peft_shardmerge.output.gguf_sink import record_path

    base, adapter, _ = gguf_case("llama")
    out = str(tmp_path / "m.gguf")
    report = merge_checkpoint(base, adapter, out, outtype="f16", split_max_size="200K", progress=False)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".gguf"))
    assert len(names) > 1 and names[0] == f"m-00001-of-{len(names):05d}.gguf" and report.shards == names
    with open(record_path(out)) as f:
        assert sorted(json.load(f)["files"]) == names
    tensors, first = {}, None
    for i, name in enumerate(names):
        reader = gguf.GGUFReader(str(tmp_path / name))
        assert reader.fields["split.no"].contents() == i and reader.fields["split.count"].contents() == len(names)
        first = first or reader
        tensors.update({t.name: np.asarray(t.data).copy() for t in reader.tensors})
    whole = str(tmp_path / "whole" / "m.gguf")
    os.makedirs(os.path.dirname(whole))
    merge_checkpoint(base, adapter, whole, outtype="f16", progress=False)
    alone = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(whole).tensors}
    assert list(tensors) == list(alone) and all(np.array_equal(tensors[n], alone[n]) for n in alone)
    assert "tokenizer.ggml.tokens" in first.fields
    from peft_shardmerge.verify.gguf_check import verify_gguf

    assert verify_gguf(out).status == "OK"  # the name given: every file the record lists
    report = verify_gguf(str(tmp_path / names[1]), base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed, report.summary()
    with pytest.raises(InputError, match="split_max_size='2G' applies to a GGUF output"):
        merge_checkpoint(base, adapter, str(tmp_path / "folder"), split_max_size="2G", progress=False)


@pytest.mark.slow
def test_a_split_output_is_the_converters(gguf_case, tmp_path):
    from tests.gguf_refs import run_converter

    base, adapter, kind = gguf_case("qwen2")
    reference = peft_merge(base, adapter, kind, str(tmp_path / "merged"))
    os.makedirs(tmp_path / "converter")
    os.makedirs(tmp_path / "ours")
    run_converter(reference, str(tmp_path / "converter" / "merged.gguf"), "q8_0", "--split-max-size", "5M")
    merge_checkpoint(base, adapter, str(tmp_path / "ours" / "merged.gguf"), outtype="q8_0", split_max_size="5M")
    names = sorted(os.listdir(tmp_path / "converter"))
    assert len(names) > 1 and sorted(n for n in os.listdir(tmp_path / "ours") if n.endswith(".gguf")) == names
    for name in names:
        assert (tmp_path / "converter" / name).read_bytes() == (tmp_path / "ours" / name).read_bytes(), name


@pytest.mark.slow
def test_the_command_line_writes_and_lists_a_gguf(gguf_case, tmp_path):
    import subprocess
    import sys

    base, adapter, _ = gguf_case("qwen2")
    out = str(tmp_path / "m.gguf")
    cmd = [sys.executable, "-m", "peft_shardmerge", "merge", base, adapter, out, "--outtype", "q8_0"]
    listed = subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True, timeout=600)
    assert listed.returncode == 0, listed.stderr
    assert "blk.0.attn_q.weight" in listed.stdout and not os.path.exists(out)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "m.gguf" in done.stdout and read(out)["blk.0.attn_q.weight"][0] == "Q8_0"
    shutil.rmtree(tmp_path)


@pytest.mark.slow  # a merge killed outright in a subprocess
@pytest.mark.parametrize("inputs_changed", [False, True], ids=["same-inputs", "base-rewritten"])
def test_a_killed_merge_resumes_from_its_finished_parts(inputs_changed, gguf_case, tmp_path):
    import shutil
    import subprocess
    import sys

    from peft_shardmerge.output import gguf_sink

    base, adapter, _ = gguf_case("llama")
    base = shutil.copytree(base, str(tmp_path / "base"))
    clean = str(tmp_path / "clean" / "m.gguf")
    merge_checkpoint(base, adapter, clean, outtype="q8_0", progress=False)
    out = str(tmp_path / "m.gguf")
    child = f"""
import os, signal
from peft_shardmerge import merge_checkpoint
from peft_shardmerge.output import gguf_sink
gguf_sink.PART_BYTES = 300_000  # several parts
real = gguf_sink.GGUFOutput.part_done
def part_done(self, i, digest):
    real(self, i, digest)
    if len(self.done) == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # killed outright: nothing runs after
gguf_sink.GGUFOutput.part_done = part_done
merge_checkpoint({base!r}, {adapter!r}, {out!r}, outtype="q8_0", progress=False)
"""
    killed = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr
    staging = gguf_sink.staging_path(out)
    assert not os.path.exists(out) and os.path.exists(staging) and os.path.exists(staging + ".json")
    if inputs_changed:  # other weights, same size and modification time: content decides
        weights = os.path.join(base, "model.safetensors")
        stat, data = os.stat(weights), bytearray(open(weights, "rb").read())
        start = 8 + int.from_bytes(data[:8], "little")  # every tensor's data: one value in 64 set to 0
        data[start::256] = bytes(len(data[start::256]))
        open(weights, "wb").write(data)
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        os.unlink(clean)
        os.unlink(gguf_sink.record_path(clean))
        merge_checkpoint(base, adapter, clean, outtype="q8_0", progress=False)
    old, gguf_sink.PART_BYTES = gguf_sink.PART_BYTES, 300_000
    try:
        report = merge_checkpoint(base, adapter, out, outtype="q8_0", progress=False)
    finally:
        gguf_sink.PART_BYTES = old
    resumed = [n for n in report.notes if n.startswith("resumed:")]
    assert resumed == ([] if inputs_changed else ["resumed: 2 shard(s) kept from an interrupted run"]), resumed
    assert open(out, "rb").read() == open(clean, "rb").read()
    assert sorted(os.listdir(tmp_path)) == ["base", "clean", "m.gguf", "m.merge_manifest.json"]


def test_a_failed_merge_leaves_nothing_to_resume(gguf_case, tmp_path, monkeypatch):
    """Any error (a full disk, a failed check, Ctrl-C) removes the staging file: only a kill leaves one."""
    from peft_shardmerge.output import gguf_sink

    base, adapter, _ = gguf_case("llama")
    monkeypatch.setattr(gguf_sink, "PART_BYTES", 300_000)
    real = gguf_sink.GGUFOutput.part_done

    def stop_after_the_second(self, i, digest):
        real(self, i, digest)
        if len(self.done) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(gguf_sink.GGUFOutput, "part_done", stop_after_the_second)
    with pytest.raises(KeyboardInterrupt):
        merge_checkpoint(base, adapter, str(tmp_path / "m.gguf"), outtype="q8_0", progress=False)
    assert os.listdir(tmp_path) == []


def test_verify_checks_the_record_and_recomputes_in_the_files_type(gguf_case, tmp_path):
    from peft_shardmerge.api.cli import main
    from peft_shardmerge.output.gguf_sink import record_path
    from peft_shardmerge.verify.gguf_check import verify_gguf

    base, adapter, _ = gguf_case("llama")
    out = str(tmp_path / "m.gguf")
    merge_checkpoint(base, adapter, out, outtype="q4_k_m", progress=False)
    report = verify_gguf(out)
    assert report.status == "OK" and report.integrity, report.summary()
    report = verify_gguf(out, base=base, adapter=adapter)
    assert report.status == "OK" and report.recomputed, report.summary()
    assert main(["verify", out, "--base", base, "--adapter", adapter]) == 0
    # one byte changed in a tensor: the record and the recomputation both find it
    reader = gguf.GGUFReader(out)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    with open(out, "r+b") as f:
        f.seek(int(tensor.data_offset) + 7)
        byte = f.read(1)
        f.seek(int(tensor.data_offset) + 7)
        f.write(bytes([byte[0] ^ 1]))
    assert verify_gguf(out).status == "FAILED"
    os.unlink(record_path(out))
    assert verify_gguf(out).status == "UNCHECKED"
    report = verify_gguf(out, base=base, adapter=adapter)
    assert report.status == "FAILED" and "blk.1.ffn_down.weight (1 bytes)" in report.summary(), report.summary()


def test_a_gguf_is_not_spread_over_ranks(gguf_case, tmp_path):
    from peft_shardmerge.api.disk import CheckpointJob
    from peft_shardmerge.distributed.ranks import STEPS
    from peft_shardmerge.distributed.world import JobSteps, World
    from peft_shardmerge.options import MergeOptions

    base, adapter, _ = gguf_case("llama")
    steps = JobSteps(World(rank=0, size=2), STEPS)  # what merge_checkpoint(distributed=True) has under torchrun
    job = CheckpointJob(base, adapter, str(tmp_path / "m.gguf"), MergeOptions(progress=False), [], steps)
    assert any("one file that one process writes" in p for p in job.problems)


def test_a_qwen3_reranker_is_found_by_its_card_not_by_the_output_name(tmp_path):
    from peft_shardmerge.testing import build_adapter, build_base, build_tokenizer

    base = build_tokenizer(build_base(str(tmp_path / "base"), "qwen3"))
    adapter = build_adapter(base, str(tmp_path / "adapter"), arch="qwen3")
    merge_checkpoint(base, adapter, str(tmp_path / "reranker-ablation.gguf"), outtype="q8_0", progress=False)
    with open(os.path.join(base, "README.md"), "w") as f:
        f.write("# Qwen3-Reranker-0.6B\n")
    with pytest.raises(UnsupportedError, match="Qwen3 reranker is not written"):
        merge_checkpoint(base, adapter, str(tmp_path / "m.gguf"), outtype="q8_0", progress=False)
    assert not os.path.exists(tmp_path / "m.gguf")
