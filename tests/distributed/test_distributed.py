"""One merge over several processes (torchrun, gloo on the CPU): from disk, byte-identical to one process whatever
the rank count and shard size, with failures, kills and resumes; in process, FSDP2-sharded models gathered one unit
at a time, and the shardings that are refused."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from peft_shardmerge import merge_and_save, merge_checkpoint
from peft_shardmerge.distributed.world import assign_shards
from peft_shardmerge.testing import build_adapter, build_base

#: subprocesses, signals and kills: make test-all runs them
pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


def torchrun(ranks: int, *args: str, timeout: int = 240, **env_vars: str) -> subprocess.CompletedProcess:
    """Run ``dist_worker.py ARGS`` on ``ranks`` local processes, in a session of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env_vars}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), WORKER, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def same_folder(a: str, b: str) -> list[str]:
    """The files that differ between two folders (missing on one side included)."""
    names_a = sorted(os.listdir(a))
    names_b = sorted(os.listdir(b))
    if names_a != names_b:
        return sorted(set(names_a) ^ set(names_b))
    _, mismatch, errors = filecmp.cmpfiles(a, b, names_a, shallow=False)
    return mismatch + errors


def needs_deepspeed() -> None:
    """Skip, saying why, where DeepSpeed cannot run here: not installed, or no C++ compiler for the communication op
    it builds on its first use on the CPU. Found without importing it (its import sets up an accelerator)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install deepspeed to run this test)")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("deepspeed builds a C++ op on its first use on the CPU, and no C++ compiler is installed")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    sharded = build_base(str(root / "sharded"), max_shard_size="100KB")
    single = build_base(str(root / "single"), seed=3)
    return {
        "sharded": sharded,
        "single": single,
        "sharded_ad": build_adapter(sharded, str(root / "sharded_ad")),
        "single_ad": build_adapter(single, str(root / "single_ad"), seed=4),
    }


def test_assign_shards_balances_bytes_and_skips_finished():
    assert assign_shards([5, 5, 5, 5, 1], 2) == [[0, 2, 4], [1, 3]]
    assert assign_shards([9, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4]]
    assert assign_shards([3, 3], 3) == [[0], [1], []]
    split = assign_shards([4, 4, 4, 4], 3, skip=[1])
    assert sorted(i for share in split for i in share) == [0, 2, 3]


@pytest.mark.parametrize(
    "ranks,base,shard", [(2, "sharded", "60KB"), (3, "sharded", "150KB"), (3, "single", "90KB"), (2, "single", "5GB")]
)
def test_ranks_write_the_same_bytes_as_one_process(inputs, tmp_path, ranks, base, shard):
    ref = str(tmp_path / "ref")
    merge_checkpoint(inputs[base], inputs[base + "_ad"], ref, max_shard_size=shard, progress=False)
    out = str(tmp_path / "out")
    run = torchrun(ranks, "cli", "merge", inputs[base], inputs[base + "_ad"], out, "--max-shard-size", shard)
    assert run.returncode == 0, run.stderr[-3000:]
    assert same_folder(ref, out) == []
    summaries = [line for line in run.stdout.splitlines() if line.startswith("merged ")]
    assert len(summaries) == 1 and f"spread over {ranks} ranks" in run.stdout  # one summary, rank 0's
    assert not os.path.exists(str(tmp_path / ".out.partial"))


def test_a_dare_ties_combination_on_two_ranks_is_the_bytes_of_one_process(inputs, tmp_path):
    base, first = inputs["sharded"], inputs["sharded_ad"]
    second = build_adapter(base, str(tmp_path / "second"), r=2, seed=9, target_modules=["q_proj", "up_proj"])
    ref = str(tmp_path / "ref")
    kw = dict(weights=[0.6, 0.4], combination="dare_ties", density=0.3, seed=7, max_shard_size="60KB")
    merge_checkpoint(base, [first, second], ref, progress=False, **kw)
    out = str(tmp_path / "out")
    options = ["--weights", "0.6", "0.4", "--combination", "dare_ties", "--density", "0.3", "--seed", "7"]
    run = torchrun(2, "cli", "merge", base, first, out, "--add-adapter", second, *options, "--max-shard-size", "60KB")
    assert run.returncode == 0, run.stderr[-3000:]
    assert same_folder(ref, out) == []
    assert "dare_ties (weights 0.6, 0.4; density 0.3; majority sign total; seed 7; not normalized)" in run.stdout


@pytest.mark.parametrize("fmt", ["nf4", "fp8-block"])
def test_a_quantized_merge_on_two_ranks_is_the_bytes_of_one_process(inputs, tmp_path, fmt):
    ref = str(tmp_path / "ref")
    merge_checkpoint(inputs["sharded"], inputs["sharded_ad"], ref, max_shard_size="60KB", quantize=fmt, progress=False)
    out = str(tmp_path / "out")
    run = torchrun(
        2, "cli", "merge", inputs["sharded"], inputs["sharded_ad"], out, "--max-shard-size", "60KB", "--quantize", fmt
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert same_folder(ref, out) == []
    assert f"weights as {fmt}" in run.stdout  # the summary of rank 0 names the format


def _our_lines(stderr: str) -> list[str]:
    """What the ranks of peft-shardmerge printed (not torchrun), and any trace of a Python exception."""
    ours = ("peft-shardmerge", "peft_shardmerge", "Exception ignored", "Traceback (most recent call last)")
    lines = [ln for ln in stderr.splitlines() if ln.startswith(ours[:3])]
    return lines + [ln for ln in stderr.splitlines() if "peft_shardmerge" in ln and ln not in lines]


@pytest.mark.parametrize("failing", [1, 0])
def test_a_failure_on_one_rank_stops_every_rank_with_one_message_from_rank_0(inputs, tmp_path, failing):
    out = str(tmp_path / "out")
    run = torchrun(
        2, "fail", str(failing), "merge", inputs["sharded"], inputs["sharded_ad"], out, "--max-shard-size", "20KB"
    )
    assert run.returncode != 0
    said = "" if failing == 0 else f"rank {failing}: "
    assert _our_lines(run.stderr) == [
        f"peft-shardmerge[rank 0]: error: {said}No space left on device (shard); the partial output was removed and "
        "OUT is unchanged"
    ], run.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == []  # no OUT, no staging folder, no lock


@pytest.mark.parametrize("ranks", [4, 8])
def test_bad_input_on_every_rank_is_said_once_by_rank_0(inputs, tmp_path, ranks):
    """Every rank finds the same problem; the launcher then stops the others (SIGTERM): one line, no traceback."""
    run = torchrun(ranks, "command", "merge", inputs["single"], str(tmp_path / "missing"), str(tmp_path / "out"))
    assert run.returncode != 0
    lines = _our_lines(run.stderr)
    assert len(lines) == 1 and lines[0].startswith("peft-shardmerge[rank 0]: error: adapter "), run.stderr[-3000:]


def test_a_failure_of_rank_0_after_the_shards_is_said_once(inputs, tmp_path):
    out = str(tmp_path / "out")
    run = torchrun(
        2, "fail-finish", "0", "merge", inputs["sharded"], inputs["sharded_ad"], out, "--max-shard-size", "60KB"
    )
    assert run.returncode != 0
    state = "the partial output was removed and OUT is unchanged"
    assert _our_lines(run.stderr) == [
        f"peft-shardmerge[rank 0]: error: No space left on device (config.json); {state}"
    ], run.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("what", ["dtype", "out"])
def test_ranks_that_planned_differently_are_refused_before_writing(inputs, tmp_path, what):
    out = str(tmp_path / "out")
    run = torchrun(2, "api-differ", what, out, inputs["single"], inputs["single_ad"])
    assert run.returncode != 0
    assert "rank 0 refused" in run.stderr and "rank 1 refused" in run.stderr
    assert "rank(s) [1] planned a different merge than rank 0" in run.stderr
    assert os.listdir(tmp_path) == []


def test_merge_checkpoint_called_by_rank_0_alone_merges_in_that_process(inputs, tmp_path):
    ref = str(tmp_path / "ref")
    merge_checkpoint(inputs["single"], inputs["single_ad"], ref, progress=False)
    out = str(tmp_path / "out")
    run = torchrun(2, "rank0-only-disk", out, inputs["single"], inputs["single_ad"], timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert same_folder(ref, out) == []


def test_one_rank_killed_leaves_no_finished_output_and_a_rerun_with_three_ranks_completes(inputs, tmp_path):
    ref = str(tmp_path / "ref")
    merge_checkpoint(inputs["sharded"], inputs["sharded_ad"], ref, max_shard_size="40KB", progress=False)
    out = str(tmp_path / "out")
    args = ("merge", inputs["sharded"], inputs["sharded_ad"], out, "--max-shard-size", "40KB")
    run = torchrun(2, "kill-after-shard", "1", *args)
    assert run.returncode != 0
    assert not os.path.exists(out)
    # torchrun stops rank 0 (SIGTERM, or its peer's connection is gone): the finished shards stay, and it says so
    assert "OUT is unchanged and the finished shards are kept in" in run.stderr, run.stderr[-3000:]
    again = torchrun(3, "cli", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed: " in again.stdout
    assert same_folder(ref, out) == []
    assert not os.path.exists(str(tmp_path / ".out.partial"))


def test_a_job_killed_whole_resumes_its_finished_shards_with_another_rank_count(inputs, tmp_path):
    ref = str(tmp_path / "ref")
    merge_checkpoint(inputs["sharded"], inputs["sharded_ad"], ref, max_shard_size="40KB", progress=False)
    out = str(tmp_path / "out")
    args = ("merge", inputs["sharded"], inputs["sharded_ad"], out, "--max-shard-size", "40KB")
    os.mkdir(tmp_path / "pids")
    run = torchrun(2, "killall-after-record", "1", *args, DIST_TEST_PIDS=str(tmp_path / "pids"))
    assert run.returncode != 0
    assert not os.path.exists(out)
    partial = str(tmp_path / ".out.partial")
    assert "manifest.rank-1.json" in os.listdir(partial)
    recorded = json.load(open(os.path.join(partial, "manifest.rank-1.json")))["shards"]
    assert len(recorded) == 1
    name = next(iter(recorded))
    inode = os.stat(os.path.join(partial, name)).st_ino
    report = merge_checkpoint(inputs["sharded"], inputs["sharded_ad"], out, max_shard_size="40KB", progress=False)
    assert any(n.startswith("resumed: ") for n in report.notes), report.notes
    assert os.stat(os.path.join(out, name)).st_ino == inode  # rank 1's recorded shard was kept, not rewritten
    assert same_folder(ref, out) == []
    assert not os.path.exists(partial)


@pytest.mark.parametrize(
    "scenario,ranks,options",
    [
        ("fsdp2", 2, ()),
        ("fsdp2", 3, ("dora",)),
        ("fsdp2", 2, ("bf16",)),
        ("fsdp2", 2, ("mp", "twice")),
        ("fsdp1", 2, ("twice",)),
        ("fsdp1", 2, ("dora", "flat")),
        ("fsdp1", 2, ("rootonly", "flat")),
    ],
)
def test_sharded_merge_and_save_equals_the_unsharded_merge(tmp_path, scenario, ranks, options):
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_worker import tiny_peft

    dora, dtype = "dora" in options, torch.bfloat16 if "bf16" in options else torch.float32
    ref = str(tmp_path / "ref")
    merge_and_save(tiny_peft(dora, dtype), ref, progress=False)
    out, result = str(tmp_path / "out"), str(tmp_path / "result.json")
    run = torchrun(ranks, scenario, out, result, *options)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.load(open(result))
    assert outcome["ok"], outcome
    assert outcome["forward_unchanged"] and outcome["parameters_unchanged"]
    assert same_folder(ref, out) == []
    note = next(n for n in outcome["notes"] if n.startswith(f"gathered from {ranks} ranks"))
    held = int(note.split("at most ")[1].split(" elements")[0].replace(",", ""))
    model = tiny_peft(dora)
    total = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.base_model.model.model.layers[0].parameters())
    one_unit = total if "rootonly" in options else max(layer, total - 2 * layer)
    assert 0 < held <= one_unit and ("rootonly" in options or one_unit < total)  # one unit at a time, not the model


@pytest.fixture(scope="module")
def qlora_base(tmp_path_factory):
    """A tiny bf16 Llama on disk, loaded in 4-bit by each QLoRA scenario."""
    from transformers import AutoModelForCausalLM

    from peft_shardmerge.testing import tiny_config

    path = str(tmp_path_factory.mktemp("qlora") / "base")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "scenario,options",
    [("fsdp2", ()), ("fsdp2", ("dora",)), ("fsdp2", ("mp",)), ("fsdp1", ()), ("fsdp1", ("flat",)), ("zero3", ())],
)
def test_a_sharded_qlora_model_merges_as_the_unsharded_one(tmp_path, qlora_base, scenario, options):
    pytest.importorskip("bitsandbytes")
    if scenario == "zero3":
        needs_deepspeed()
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_worker import tiny_qlora

    ref = str(tmp_path / "ref")
    report = merge_and_save(tiny_qlora(qlora_base, "dora" in options), ref, progress=False)
    assert report.lora_modules_merged == 6
    assert json.load(open(f"{ref}/merge_manifest.json"))["merge"]["quantization"]["quant_type"] == "nf4"
    out, result = str(tmp_path / "out"), str(tmp_path / "result.json")
    run = torchrun(2, scenario, out, result, f"qlora={qlora_base}", *options)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.load(open(result))
    assert outcome["ok"], outcome
    assert outcome["forward_unchanged"] and outcome["parameters_unchanged"] and outcome["merged"] == 6
    assert same_folder(ref, out) == []  # the 4-bit bytes gathered and dequantized with the quant state on the module
    note = next(n for n in outcome["notes"] if n.startswith("gathered from 2 ranks"))
    held = int(note.split("at most ")[1].split(" elements")[0].replace(",", ""))
    assert 0 < held < sum(p.numel() for p in tiny_qlora(qlora_base).parameters())  # never the whole model


def test_a_sharded_qlora_model_repacked_by_an_eval_forward_merges_right(tmp_path, qlora_base):
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight at an eval forward: under FSDP the repacked
    bytes are dropped with the unsharded parameter while the module's quant state says "repacked"; the merge reads
    the bytes as they are with the state undone (to the bf16 block scales the repacking kept), not garbage."""
    pytest.importorskip("bitsandbytes")
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_worker import tiny_qlora
    from safetensors.torch import load_file

    ref = str(tmp_path / "ref")
    merge_and_save(tiny_qlora(qlora_base), ref, progress=False)
    out, result = str(tmp_path / "out"), str(tmp_path / "result.json")
    run = torchrun(2, "fsdp2", out, result, f"qlora={qlora_base}", "eval")
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.load(open(result))
    assert outcome["ok"], outcome
    if not any("repacked by bitsandbytes" in n for n in outcome["notes"]):
        pytest.skip("bitsandbytes did not repack on this CPU")
    want, got = load_file(f"{ref}/model.safetensors"), load_file(f"{out}/model.safetensors")
    assert sorted(want) == sorted(got)
    for name, w in want.items():
        rel = float((got[name].float() - w.float()).abs().max() / w.float().abs().max())
        assert rel < 2**-7, (name, rel)  # a bf16 block scale and one bf16 rounding; garbage would be O(1)


def test_a_ddp_wrapper_is_refused_with_the_way_to_merge_it(tmp_path):
    result = str(tmp_path / "result.json")
    run = torchrun(2, "ddp", result)
    assert run.returncode == 0, run.stderr[-3000:]
    for outcome in (json.load(open(result)), json.load(open(result + ".1"))):
        assert outcome["error"] == "InputError", outcome
        assert "if rank == 0: merge_and_save(model.module, OUT)" in outcome["message"]
    assert sorted(os.listdir(tmp_path)) == ["result.json", "result.json.1"]


@pytest.mark.parametrize(
    "fsdp,said",
    [
        ((), "DTensor parameters outside FSDP (tensor parallelism)"),
        (("fsdp",), "also splits weights by tensor parallelism"),
    ],
)
def test_a_tensor_parallel_model_is_refused_by_name_on_every_rank(tmp_path, fsdp, said):
    result = str(tmp_path / "result.json")
    run = torchrun(2, "tp", result, *fsdp)
    assert run.returncode == 0, run.stderr[-3000:]
    for outcome in (json.load(open(result)), json.load(open(result + ".1"))):
        assert outcome["error"] == "InputError", outcome
        assert said in outcome["message"]
    assert sorted(os.listdir(tmp_path)) == ["result.json", "result.json.1"]


def test_an_8bit_base_sharded_by_fsdp_is_refused_by_name_on_every_rank(tmp_path, qlora_base):
    pytest.importorskip("bitsandbytes")
    out, result = str(tmp_path / "out"), str(tmp_path / "result.json")
    run = torchrun(2, "refused-8bit", qlora_base, out, result)
    assert run.returncode == 0, run.stderr[-3000:]
    for outcome in (json.load(open(result)), json.load(open(result + ".1"))):
        assert outcome["error"] == "InputError", outcome
        assert (
            "of which merge_and_save gathers only 4-bit Linear4bit ones with their quant state" in outcome["message"]
        )
        assert "self_attn.q_proj.base_layer (Linear8bitLt)" in outcome["message"]  # int8 bytes are never written
    assert sorted(os.listdir(tmp_path)) == ["result.json", "result.json.1"]


def test_a_zero3_model_trained_in_bf16_merges_its_fp32_master_weights(tmp_path):
    """DeepSpeed's bf16 mode trains fp32 masters and keeps bf16 copies in the module: the merge reads the masters,
    as an unsharded copy loaded with what DeepSpeed gives (safe_get_full_fp32_param) merges them."""
    needs_deepspeed()
    out, result = str(tmp_path / "out"), str(tmp_path / "result.json")
    run = torchrun(2, "zero3", out, result, "train", "engine", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.load(open(result))
    assert outcome["ok"], outcome
    assert outcome["forward_unchanged"] and outcome["parameters_unchanged"]
    assert "12 trainable tensor(s) read from DeepSpeed's fp32 master weights" in " ".join(outcome["notes"])
    assert filecmp.cmp(f"{out}/model.safetensors", f"{out}.ref/model.safetensors", shallow=False)


@pytest.mark.parametrize("scenario", ["fsdp2", "fsdp1", "zero3"])
def test_peak_memory_of_a_sharded_merge_does_not_grow_with_the_model(tmp_path, scenario):
    """Each rank's peak resident memory during merge_and_save (the kernel's own count, restarted just before; glibc
    told to give large freed blocks back at once, so that the peak is what is live) is the same for a model of 8 and
    of 16 decoder layers (220 MB and 430 MB in fp32): a unit at a time, never the model or the output."""
    if scenario == "zero3":
        needs_deepspeed()
    growth = {}
    for layers in (8, 16):
        out, result = str(tmp_path / f"out{layers}"), str(tmp_path / f"result{layers}.json")
        run = torchrun(2, scenario, out, result, f"big={layers}", "rss", timeout=300, MALLOC_MMAP_THRESHOLD_="65536")
        assert run.returncode == 0, run.stderr[-3000:]
        outcomes = [json.load(open(result)), json.load(open(result + ".1"))]
        assert all(o["ok"] for o in outcomes), outcomes
        growth[layers] = [o["rss_growth"] for o in outcomes]
    added = 8 * 26 * 2**20  # the 8 more layers, in fp32
    for rank in (0, 1):
        assert abs(growth[16][rank] - growth[8][rank]) < added / 10, growth
        assert growth[16][rank] < 2 * added / 4, growth  # a quarter of the 16-layer model at most


@pytest.mark.parametrize(
    "scenario,fault,said",
    [
        ("fsdp2", "fail", "No space left on device (shard)"),
        ("fsdp1", "fail", "No space left on device (shard)"),
        ("fsdp2", "gatherfail", "Input/output error (unit)"),
        ("fsdp1", "gatherfail", "Input/output error (unit)"),
        ("zero3", "fail", "No space left on device (shard)"),
        ("zero3", "gatherfail", "Input/output error (unit)"),
    ],
)
def test_a_failure_on_rank_0_mid_gather_stops_every_rank_with_its_message(tmp_path, scenario, fault, said):
    if scenario == "zero3":
        needs_deepspeed()
    out, result = str(tmp_path / "out"), str(tmp_path / "result.json")
    run = torchrun(2, scenario, out, result, fault, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    mine, theirs = json.load(open(result)), json.load(open(result + ".1"))
    assert mine["error"] == "FileSystemError" and theirs["error"] == "PeerFailedError", (mine, theirs)
    assert theirs["message"] == f"rank 0: {said}; the partial output was removed and OUT is unchanged"
    assert mine["forward_unchanged"] and theirs["forward_unchanged"]  # every unit released, the model as it was
    assert sorted(os.listdir(tmp_path)) == ["result.json", "result.json.1"]


@pytest.mark.parametrize("options", [(), ("dora", "engine"), ("bert", "twice")])
def test_a_zero3_model_merges_as_the_unsharded_one(tmp_path, options):
    """bert: the head's decoder is tied to two modules before it (its weight to the word embeddings, its bias to the
    head's own), so both are gathered with it; twice: a second merge of the same model writes the same bytes."""
    needs_deepspeed()
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_worker import tiny_peft

    ref = str(tmp_path / "ref")
    model = tiny_peft("dora" in options, bert="bert" in options)
    merged = merge_and_save(model, ref, progress=False).lora_modules_merged
    out, result = str(tmp_path / "out"), str(tmp_path / "result.json")
    run = torchrun(2, "zero3", out, result, *options, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.load(open(result))
    assert outcome["ok"], outcome
    assert outcome["forward_unchanged"] and outcome["parameters_unchanged"]
    assert outcome["merged"] == merged == (5 if "bert" in options else 6)
    assert same_folder(ref, out) == []
    note = next(n for n in outcome["notes"] if n.startswith("gathered from 2 ranks"))
    held = int(note.split("at most ")[1].split(" elements")[0].replace(",", ""))
    unit = max(
        [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
        + [sum(p.numel() for p in m.parameters()) for m in model.modules() if hasattr(m, "lora_A")]
    )
    total = sum(p.numel() for p in model.parameters())
    assert 0 < held <= unit < total / 3  # a module (or a LoRA layer: base and factors) at a time, not the model


def test_merge_and_unload_of_an_fsdp2_model_is_refused_and_leaves_it_untouched(tmp_path):
    result = str(tmp_path / "result.json")
    run = torchrun(2, "unload-fsdp2", result)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.load(open(result))
    assert outcome["refused"] and outcome["untouched"], outcome
    assert "call merge_and_save(model, out_dir) on every rank" in outcome["message"]


def test_an_unsharded_model_is_merged_by_rank_0_alone_as_before(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_worker import tiny_peft

    ref = str(tmp_path / "ref")
    merge_and_save(tiny_peft(), ref, progress=False)
    out = str(tmp_path / "out")
    run = torchrun(2, "rank0-only", out, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert same_folder(ref, out) == []


def test_ctrl_c_stops_every_rank_and_removes_the_partial_output(inputs, tmp_path):
    out = str(tmp_path / "out")
    run = torchrun(
        2,
        "interrupt-after-shard",
        "1",
        "merge",
        inputs["sharded"],
        inputs["sharded_ad"],
        out,
        "--max-shard-size",
        "40KB",
    )
    assert run.returncode != 0
    assert _our_lines(run.stderr) == [
        "peft-shardmerge[rank 0]: interrupted; the partial output was removed and OUT is unchanged"
    ], run.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == []


def test_an_output_locked_by_another_merge_is_refused_once_for_every_rank(inputs, tmp_path):
    from peft_shardmerge.output.staging import output_lock

    out = str(tmp_path / "out")
    with output_lock(out):
        run = torchrun(2, "cli", "merge", inputs["single"], inputs["single_ad"], out)
    assert run.returncode != 0
    (line,) = _our_lines(run.stderr)
    assert line.startswith("peft-shardmerge[rank 0]: error: another merge is writing"), run.stderr[-3000:]
    assert line.endswith("wait for it to finish or choose another output folder")
    assert not os.path.exists(out)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL puts one rank on each GPU)")
def test_ranks_on_gpus_write_the_same_bytes_as_one_gpu_process(inputs, tmp_path):
    ref = str(tmp_path / "ref")
    merge_checkpoint(
        inputs["sharded"], inputs["sharded_ad"], ref, max_shard_size="60KB", device="cuda", progress=False
    )
    out = str(tmp_path / "out")
    run = torchrun(
        2, "cli", "merge", inputs["sharded"], inputs["sharded_ad"], out, "--max-shard-size", "60KB", "--device", "cuda"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "device cuda:0" in run.stdout
    assert same_folder(ref, out) == []
