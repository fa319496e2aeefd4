"""Benchmark on a CUDA GPU: merge_and_save of a 4-bit QLoRA model under the memory budget and real out-of-memory.

For each size, a random bf16 Llama-shaped base is written to ``--work`` (weights drawn on the GPU, one tensor
at a time), loaded in 4-bit NF4 (double quant, bf16 compute) on the GPU, given a rank-16 LoRA on every linear
layer with non-zero B, and merged into bf16 with ``merge_and_save(base_precision="dequantized")`` in
these scenarios:

- ``gpu``: ``maximum_memory_usage=0.9``;
- ``cpu``: ``maximum_memory_usage=0.01``, below what the loaded model already occupies: every module over
  the budget, merged on the CPU (the reference the others are compared with, tensor for tensor);
- ``tight``: a budget of the GPU memory in use plus 1.5x the largest attention projection's working set,
  so that attention projections fit and MLP projections do not;
- ``cap``: budget 0.95, and ``torch.cuda.set_per_process_memory_fraction`` capping this process at what it
  holds plus about half an MLP projection's working set; ``mem_get_info`` does not see the cap, so the budget
  lets MLP projections onto the GPU, and torch raises real ``torch.OutOfMemoryError`` there;
- ``other``: budget 0.95 while another process fills all but a sliver of the free GPU memory for 20 ms,
  releases it for 10 ms, and so on: the budget sees it or not depending on the moment, and allocations that
  meet it raise real out-of-memory errors.

Then the disk engine (``peft-shardmerge merge``, the adapter saved from the same model) with
``--device cuda`` and ``--device cpu``, and ``merge_and_unload`` on the GPU (generation, VRAM).

Peak VRAM is ``torch.cuda.max_memory_allocated`` over the merge (this process's tensors) and the highest
``total - free`` of ``torch.cuda.mem_get_info`` sampled every 2 ms (the whole device, as the budget reads
it). Modules on the CPU are counted from the merge's log: "over the memory budget" (the budget's choice)
and "out of memory merging" (retried after a real out-of-memory; also ``report.cpu_fallbacks``).

    python bench/bench_gpu.py --sizes 1B,8B --work /tmp/gpubench --json gpu.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_merge.py's models

SIZES = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    "1B": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "3B": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "8B": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda:0" if CUDA else "cpu")


def emit(record: dict, path: str | None) -> None:
    """Print one result and append it as a JSON line."""
    print(json.dumps(record), flush=True)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def build_base(size: str, folder: str) -> tuple[str, float]:
    """A random bf16 Llama of ``size`` in ``folder`` (2 GB shards); returns (folder, parameters in billions)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        **SIZES[size],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    params = sum(torch.Size(s).numel() for s in shapes.values())
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder, params / 1e9
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    g = torch.Generator(device=DEV).manual_seed(0)
    shards, cur, nbytes = [], {}, 0
    weight_map = {}

    def flush() -> None:
        name = f"part-{len(shards)}.safetensors"
        save_file(cur, os.path.join(folder, name), metadata={"format": "pt"})
        shards.append((name, list(cur)))
        cur.clear()

    for k, shape in shapes.items():
        n = 2 * torch.Size(shape).numel()
        if cur and nbytes + n > 2 * 10**9:
            flush()
            nbytes = 0
        if k.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device=DEV, dtype=torch.bfloat16) * 0.02).cpu()
        cur[k] = t
        nbytes += n
    flush()
    total = len(shards)
    for i, (name, keys) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        os.rename(os.path.join(folder, name), os.path.join(folder, final))
        weight_map.update({k: final for k in keys})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 2 * params}, "weight_map": weight_map}, f)
    config.save_pretrained(folder)
    return folder, params / 1e9


def load_qlora(base: str):
    """The base in 4-bit NF4 on the GPU with a rank-16 LoRA (random, non-zero B) on every linear layer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=qc, device_map=str(DEV), dtype=torch.bfloat16
    )
    if not CUDA:
        import bitsandbytes as bnb

        for m in model.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                m.support_avx512bf16_for_cpu = False
    torch.manual_seed(0)
    return get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    ).eval()


class Counter(logging.Handler):
    """Counts the merge's per-module device decisions from its log."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.budget_cpu = 0
        self.oom_cpu = 0
        self.oom_blocks = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.budget_cpu += "over the memory budget" in msg
        self.oom_cpu += "out of memory merging" in msg
        self.oom_blocks += "redoing them on the CPU" in msg


class Sampler:
    """The highest device-wide use (total - free) seen every 2 ms while active."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if CUDA:
            free, total = torch.cuda.mem_get_info(DEV)
            self.peak = total - free
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            free, total = torch.cuda.mem_get_info(DEV)
            self.peak = max(self.peak, total - free)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            free, total = torch.cuda.mem_get_info(DEV)
            self.peak = max(self.peak, total - free)


def device_used() -> tuple[int, int]:
    if not CUDA:
        return 0, 1
    free, total = torch.cuda.mem_get_info(DEV)
    return total - free, total


OTHER = r"""
import os, sys, time, torch
leave, stop = int(sys.argv[1]), sys.argv[2]
torch.empty(1, device="cuda")
open(stop + ".ready", "w").close()
held = []
while not os.path.exists(stop):
    free, total = torch.cuda.mem_get_info()
    try:
        held.append(torch.empty(max(0, free - leave), dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        pass
    time.sleep(0.02)
    held.clear()
    torch.cuda.empty_cache()
    time.sleep(0.01)
"""


def start_other(leave: int, work: str):
    """Another process that holds all but ``leave`` bytes of the free GPU memory, 20 ms on, 10 ms off."""
    stop = os.path.join(work, "other.stop")
    for p in (stop, stop + ".ready"):
        if os.path.exists(p):
            os.remove(p)
    proc = subprocess.Popen([sys.executable, "-c", OTHER, str(leave), stop])
    while not os.path.exists(stop + ".ready"):
        if proc.poll() is not None:
            raise RuntimeError("the memory-holding process ended")
        time.sleep(0.05)
    time.sleep(0.2)
    return proc, stop


def compare(a: str, b: str) -> dict:
    """Tensor for tensor: tensors compared, tensors equal, elements different, largest difference in bf16 ulps
    (the merged weights' output dtype) and largest relative difference."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(b) if f.endswith(".safetensors"))
    assert files == sorted(f for f in os.listdir(a) if f.endswith(".safetensors")), (a, b)
    out = dict(tensors=0, equal=0, elements=0, differing=0, max_ulps=0, max_rel=0.0)
    for f in files:
        with (
            safe_open(os.path.join(a, f), "pt", device=str(DEV)) as ha,
            safe_open(os.path.join(b, f), "pt", device=str(DEV)) as hb,
        ):
            assert set(ha.keys()) == set(hb.keys()), f
            for k in hb.keys():
                x, y = ha.get_tensor(k), hb.get_tensor(k)
                assert x.dtype == y.dtype and x.shape == y.shape, k
                out["tensors"] += 1
                out["elements"] += y.numel()
                if torch.equal(x, y):
                    out["equal"] += 1
                    continue
                ne = x != y
                out["differing"] += int(ne.sum())
                if y.dtype == torch.bfloat16:
                    ulps = (x.view(torch.int16).int() - y.view(torch.int16).int()).abs().max()
                    out["max_ulps"] = max(out["max_ulps"], int(ulps))
                rel = float(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)))
                out["max_rel"] = max(out["max_rel"], rel)
    return out


def run_merge(
    model, out: str, fraction: float, ref: str | None, rec: dict, around=contextlib.nullcontext, workers=None
) -> dict:
    """merge_and_save into ``out`` (inside the context ``around()``, with ``workers=``), measured; compared with
    ``ref`` after."""
    from peft_shardmerge import merge_and_save

    shutil.rmtree(out, ignore_errors=True)
    counter = Counter()
    lg = logging.getLogger("peft_shardmerge")
    lg.addHandler(counter)
    lg.setLevel(logging.INFO)
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(DEV)
    alloc0 = torch.cuda.memory_allocated(DEV) if CUDA else 0
    used0, total = device_used()
    sync()
    try:
        with around(), Sampler() as s:
            t0 = time.perf_counter()
            report = merge_and_save(
                model,
                out,
                dtype="bfloat16",
                base_precision="dequantized",
                maximum_memory_usage=fraction,
                workers=workers,
                progress=False,
            )
            sync()
            wall = time.perf_counter() - t0
    finally:
        lg.removeHandler(counter)
    peak_alloc = torch.cuda.max_memory_allocated(DEV) if CUDA else 0
    peak_reserved = torch.cuda.max_memory_reserved(DEV) if CUDA else 0
    modules = report.lora_modules_total
    rec.update(
        maximum_memory_usage=round(fraction, 5),
        budget_gib=fraction * total / 2**30,
        device_total_gib=total / 2**30,
        used_before_gib=used0 / 2**30,
        peak_used_gib=s.peak / 2**30,
        exceeded_budget=bool(s.peak > max(fraction * total, used0)),
        max_allocated_gib=peak_alloc / 2**30,
        max_reserved_gib=peak_reserved / 2**30,
        merge_allocated_mib=(peak_alloc - alloc0) / 2**20,
        modules=modules,
        modules_cpu_budget=counter.budget_cpu,
        modules_cpu_oom=counter.oom_cpu,
        cpu_fallbacks=report.cpu_fallbacks,
        modules_gpu=modules - counter.budget_cpu - counter.oom_cpu,
        merged=f"{report.lora_modules_merged}/{report.lora_modules_total}",
        wall_s=wall,
        report_wall_s=report.wall_time_s,
        gb=report.bytes_written / 1e9,
        gb_per_s=report.bytes_written / 1e9 / wall,
        self_check=report.self_check_max_rel_err,
    )
    if ref is not None:
        t0 = time.perf_counter()
        rec["vs_cpu"] = compare(out, ref)
        rec["compare_s"] = time.perf_counter() - t0
    return rec


def disk_engine(base: str, adapter: str, out: str, device: str, ref: str | None, rec: dict) -> dict:
    """``peft-shardmerge merge`` in a subprocess; wall time of the command and the report's."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "peft_shardmerge",
        "merge",
        base,
        adapter,
        out,
        "--dtype",
        "bfloat16",
        "--device",
        device,
        "-q",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run(["sync"])
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    rec.update(
        command="peft-shardmerge merge BASE ADAPTER OUT --dtype bfloat16 --device " + device,
        command_wall_s=wall,
        gb=size / 1e9,
        gb_per_s=size / 1e9 / wall,
    )
    m = re.search(r"wall time ([0-9.]+) s", done.stdout + done.stderr)
    if m:
        rec["report_wall_s"] = float(m.group(1))
    if ref is not None:
        rec["vs_cpu"] = compare(out, ref)
    return rec


def unload(model, rec: dict) -> dict:
    """merge_and_unload on the model's device: VRAM before and after, logits against the 4-bit model, generate."""
    from peft_shardmerge import merge_and_unload

    ids = torch.randint(3, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1)).to(DEV)
    with torch.no_grad():
        before_logits = model(input_ids=ids).logits.float()
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(DEV)
    alloc0 = torch.cuda.memory_allocated(DEV) if CUDA else 0
    sync()
    t0 = time.perf_counter()
    plain = merge_and_unload(model, maximum_memory_usage=0.9)
    sync()
    wall = time.perf_counter() - t0
    del model
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    alloc1 = torch.cuda.memory_allocated(DEV) if CUDA else 0
    peak = torch.cuda.max_memory_allocated(DEV) if CUDA else 0
    with torch.no_grad():
        after_logits = plain(input_ids=ids).logits.float()
        gen = plain.generate(input_ids=ids[:, :8], max_new_tokens=16, do_sample=False, pad_token_id=0)
    rel = float((after_logits - before_logits).abs().max() / before_logits.abs().max())
    kinds = sorted({type(m).__name__ for m in plain.modules() if "Linear" in type(m).__name__})
    rec.update(
        wall_s=wall,
        allocated_4bit_lora_gib=alloc0 / 2**30,
        allocated_after_gib=alloc1 / 2**30,
        peak_allocated_gib=peak / 2**30,
        generated_tokens=int(gen.shape[1] - 8),
        logits_rel_diff_vs_4bit=rel,
        linear_types=kinds,
        weight_device=str(plain.model.layers[0].mlp.up_proj.weight.device),
        weight_dtype=str(plain.model.layers[0].mlp.up_proj.weight.dtype),
    )
    return rec


PEFT_RECIPE = r"""
import os, sys, time, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base, adapter, out = sys.argv[1:4]
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, device_map="cuda")
model = PeftModel.from_pretrained(model, adapter)
t1 = time.perf_counter()
model = model.merge_and_unload()
torch.cuda.synchronize()
t2 = time.perf_counter()
model.save_pretrained(out, max_shard_size="5GB")
t3 = time.perf_counter()
os.sync()
t4 = time.perf_counter()
peak = torch.cuda.max_memory_allocated() / 2**30
print(f"phases {t1 - t0:.2f} {t2 - t1:.2f} {t3 - t2:.2f} {t4 - t3:.2f} {peak:.2f}")
"""


def random_adapter(base: str, folder: str) -> str:
    """bench_merge.py's rank-16 LoRA (non-zero B on the seven projections) for the base in ``base``."""
    from bench_merge import write_adapter

    from peft_shardmerge.io.safetensors_io import read_header

    index = json.load(open(os.path.join(base, "model.safetensors.index.json")))["weight_map"]
    shapes = {}
    for f in sorted(set(index.values())):
        shapes.update({t.name: t.shape for t in read_header(os.path.join(base, f))[0]})
    return write_adapter(shapes, folder, torch.Generator().manual_seed(1))


def durable_copy(src: str, copy: str) -> float:
    """Seconds ``cp -r SRC COPY && sync`` takes (the floor for reading and durably writing every byte); the copy
    removed after."""
    shutil.rmtree(copy, ignore_errors=True)
    wall, _ = timed(["sh", "-c", f"cp -r {src} {copy} && sync"])
    shutil.rmtree(copy, ignore_errors=True)
    return wall


def timed(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> tuple[float, str]:
    """Run a command after ``sync`` (no dirty pages left from the step before); its wall time and output."""
    os.sync()
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    assert done.returncode == 0, (cmd, done.stderr[-3000:])
    return wall, done.stdout + done.stderr


def same_tensors(a: str, b: str) -> str:
    """How many tensors of folder ``a`` are byte-identical to those of the same name in ``b``."""
    from safetensors import safe_open

    def tensors(folder):
        out = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(folder, f), "pt") as h:
                    out.update({k: (os.path.join(folder, f), k) for k in h.keys()})
        return out

    ta, tb = tensors(a), tensors(b)
    same = 0
    for k, (fa, _) in ta.items():
        if k in tb:
            with safe_open(fa, "pt") as ha, safe_open(tb[k][0], "pt") as hb:
                x, y = ha.get_tensor(k), hb.get_tensor(k)
                bytes_x, bytes_y = x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
                same += x.dtype == y.dtype and x.shape == y.shape and torch.equal(bytes_x, bytes_y)
    return f"{same} of {len(ta)}"


DEFAULT_ROWS = ("peft", "cuda", "cpu", "checks-first", "dry", "inprocess", "inprocess-1")
ROWS = DEFAULT_ROWS + ("spy-cuda", "spy-cpu", "spy-inprocess")  # once more under py-spy


def speed(size: str, work: str, args) -> None:
    """Side by side on one base: a durable copy, PEFT's load-everything recipe on the GPU, ours from disk with
    ``--device cuda`` and ``--device cpu`` (and, with ``--before``, another tree of this package), in process from
    4-bit, and a durable copy of that output (the durable copy always, the other rows named by ``--rows``; the rows
    ``spy-...`` run ours from disk or in process once more under ``py-spy record``, their raw stacks written into
    ``--profile``)."""
    from bench_stages import spy_record

    rows = set(args.rows.split(","))
    base = os.path.join(work, "base")
    adapter = random_adapter(base, os.path.join(work, "speed-adapter"))
    nbytes = sum(os.path.getsize(os.path.join(base, f)) for f in os.listdir(base) if f.endswith(".safetensors"))
    subprocess.run(["cat"] + [os.path.join(base, f) for f in os.listdir(base)], stdout=subprocess.DEVNULL)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    rec = dict(size=size, step="speed", gb=nbytes / 1e9)
    copy = os.path.join(work, "copy")
    copy_wall = durable_copy(base, copy)
    emit(dict(rec, method="cp -r BASE COPY && sync", wall_s=copy_wall), args.json)
    ref = os.path.join(work, "peft-out")
    if CUDA and "peft" in rows:
        wall, text = timed([sys.executable, "-c", PEFT_RECIPE, base, adapter, ref], env)
        phases = re.search(r"phases (.*)", text).group(1).split()
        emit(
            dict(
                rec,
                method="PEFT: from_pretrained(cuda) + PeftModel + merge_and_unload + save_pretrained(5GB) + sync",
                wall_s=wall,
                x_copy=wall / copy_wall,
                load_s=float(phases[0]),
                merge_s=float(phases[1]),
                save_s=float(phases[2]),
                sync_s=float(phases[3]),
                peak_vram_gib=float(phases[4]),
            ),
            args.json,
        )
    for n in range(1, args.repeat + 1):  # the disk rows, in turn, each round after a durable copy of its own
        r = rec if args.repeat == 1 else dict(rec, round=n)
        if n > 1:
            copy_wall = durable_copy(base, copy)
            emit(dict(r, method="cp -r BASE COPY && sync", wall_s=copy_wall), args.json)
        # the bytes are compared with PEFT's in the first round only
        disk_rows(base, adapter, work, ref if n == 1 else os.path.join(work, "no-check"), r, copy_wall, rows, args)
    shutil.rmtree(ref, ignore_errors=True)  # the disk holds the base, one output and its copy at once from here
    if "dry" in rows:
        emit(startup(base, adapter, work, rec), args.json)
    for device in ("cuda", "cpu") if CUDA else ("cpu",):
        if f"spy-{device}" in rows:
            out = os.path.join(work, f"ours-{device}")
            raw = os.path.join(args.profile, f"{size}-disk-{device}.txt")
            cmd = [sys.executable, "-m", "peft_shardmerge", "merge", base, adapter, out, "--device", device, "-q"]
            wall, _ = timed([*spy_record(raw, 50), "--", *cmd], env)
            emit(dict(rec, method=f"profile: merge --device {device} under py-spy", wall_s=wall, raw=raw), args.json)
            shutil.rmtree(out, ignore_errors=True)
    if CUDA and {"inprocess", "inprocess-1", "spy-inprocess"} & rows:
        t0 = time.perf_counter()
        model = load_qlora(base)
        loaded = time.perf_counter() - t0
        emit(dict(rec, method="load the base in 4-bit NF4 on the GPU + LoRA", wall_s=loaded), args.json)
        out = os.path.join(work, "inproc")
        # the default (a writer thread per CPU, at most 8) and one thread
        for workers, row in ((None, "inprocess"), (1, "inprocess-1")):
            if row not in rows:
                continue
            how = "" if workers is None else f", workers={workers}"
            method = f"in process: merge_and_save(4-bit NF4 on the GPU{how})"
            r = run_merge(model, out, 0.9, None, dict(rec, method=method), workers=workers)
            r["durable_copy_of_output_s"] = durable_copy(out, copy)
            emit(r, args.json)
        if "spy-inprocess" in rows:
            raw = os.path.join(args.profile, f"{size}-inprocess.txt")
            spy = subprocess.Popen(
                [*spy_record(raw, 50), "--pid", str(os.getpid())],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(2)  # py-spy attached
            if spy.poll() is not None:
                raise RuntimeError(f"py-spy could not attach to this process (exit {spy.returncode}): ptrace refused?")
            r = run_merge(model, out, 0.9, None, dict(rec, method="profile: in process under py-spy", raw=raw))
            spy.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
            spy.wait()
            emit(r, args.json)
        shutil.rmtree(out, ignore_errors=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if args.before and CUDA and "inprocess" in rows:
        emit_before_inprocess(size, work, args)


def disk_rows(base: str, adapter: str, work: str, ref: str, rec: dict, copy_wall: float, rows: set, args) -> None:
    """Ours from disk with ``--device cuda`` and ``cpu``, with the checks first, and the tree ``--before``."""
    for device in ("cuda", "cpu") if CUDA else ("cpu",):
        if device in rows:
            r = dict(rec, method=f"ours: merge --device {device}")
            emit(ours(base, adapter, work, device, None, ref, r, copy_wall), args.json)
    if "checks-first" in rows:
        how = "--model-checks first (the checks before the merge, not beside it)"
        r = dict(rec, method=f"ours: merge --device cpu {how}")
        emit(ours(base, adapter, work, "cpu", None, ref, r, copy_wall, ("--model-checks", "first")), args.json)
    if args.before:
        device = "cuda" if CUDA else "cpu"
        r = dict(rec, method=f"before: merge --device {device}")
        emit(ours(base, adapter, work, device, args.before, ref, r, copy_wall), args.json)


def emit_before_inprocess(size: str, work: str, args) -> None:
    """The in-process row of the tree ``--before`` (its own bench_gpu.py, which must know ``--rows``: dd66410 or
    later), run in a process of its own on the same base after this tree's rows; its lines re-emitted marked
    ``tree: before``."""
    lines = os.path.join(work, "before.jsonl")
    script = os.path.join(os.path.abspath(args.before), "bench", "bench_gpu.py")
    cmd = [sys.executable, script, "--sizes", size, "--scenarios", "speed", "--rows", "inprocess"]
    timed([*cmd, "--work", args.work, "--keep", "--json", lines], cwd=args.before)
    for line in open(lines):
        record = json.loads(line)
        if record.get("step") == "speed":
            emit(dict(record, tree="before"), args.json)
    os.remove(lines)


def startup(base: str, adapter: str, work: str, rec: dict) -> dict:
    """The dry run (imports, configs, the checks, the plan): its wall time under ``python -X importtime``, and the
    imports that took longest (cumulative, top-level packages)."""
    dry = os.path.join(work, "dry")
    cmd = [sys.executable, "-X", "importtime", "-m", "peft_shardmerge", "merge", base, adapter, dry, "--dry-run"]
    wall, text = timed(cmd, dict(os.environ, HF_HUB_OFFLINE="1"))  # importtime adds a little to the wall time
    top = []
    for line in text.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            name = parts[2].rstrip()
            depth = (len(name) - len(name.lstrip())) // 2
            if depth <= 1:
                top.append((int(parts[1]) / 1e6, name.strip()))
    return dict(rec, method="dry run (start-up)", wall_s=wall, slowest_imports=sorted(top, reverse=True)[:10])


def ours(
    base: str,
    adapter: str,
    work: str,
    device: str,
    tree: str | None,
    ref: str,
    rec: dict,
    copy_wall: float,
    extra: tuple[str, ...] = (),
):
    """``peft-shardmerge merge`` from this checkout (or ``tree``), with ``extra`` arguments: wall, CPU and peak RSS of
    the command, the merge's own wall time from its report, and how many tensors equal PEFT's output (``ref``) byte
    for byte."""
    out = os.path.join(work, f"ours-{device}")
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "peft_shardmerge", "merge", base, adapter, out, "--device", device, *extra]
    wall, text = timed(["/usr/bin/time", "-f", "TIME %e %U %S %M"] + cmd, env, cwd=tree)
    m = re.search(r"wall time ([0-9.]+) s", text)
    t = re.search(r"TIME ([0-9.]+) ([0-9.]+) ([0-9.]+) ([0-9]+)", text)
    rec.update(
        wall_s=wall,
        x_copy=wall / copy_wall,
        merge_report_wall_s=float(m.group(1)) if m else None,
        user_s=float(t.group(2)) if t else None,
        sys_s=float(t.group(3)) if t else None,
        max_rss_gib=int(t.group(4)) / 2**20 if t else None,
    )
    if os.path.exists(ref):
        rec["same_as_peft"] = same_tensors(out, ref)
    shutil.rmtree(out, ignore_errors=True)
    return rec


def bench_size(size: str, args) -> None:
    work = os.path.join(args.work, size)
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    base, params = build_base(size, os.path.join(work, "base"))
    emit(dict(size=size, step="build", params_b=params, wall_s=time.perf_counter() - t0), args.json)
    scenarios = args.scenarios.split(",")
    if "speed" in scenarios:
        speed(size, work, args)
    if not set(scenarios) - {"speed"}:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        return
    sync()
    t0 = time.perf_counter()
    model = load_qlora(base)
    sync()
    gc.collect()
    alloc = torch.cuda.memory_allocated(DEV) if CUDA else 0
    used, total = device_used()
    emit(
        dict(
            size=size,
            step="load_4bit",
            wall_s=time.perf_counter() - t0,
            allocated_gib=alloc / 2**30,
            device_used_gib=used / 2**30,
        ),
        args.json,
    )

    cfg = model.config
    attn_need = cfg.hidden_size * cfg.hidden_size * 8  # the budget's working set: fp32 weight + one copy
    mlp_numel = cfg.hidden_size * cfg.intermediate_size
    ref = os.path.join(work, "out-cpu")
    if "cpu" in scenarios:
        emit(run_merge(model, ref, 0.01, None, dict(size=size, step="merge_and_save", scenario="cpu")), args.json)
    refarg = ref if os.path.exists(ref) else None
    if "gpu" in scenarios:
        emit(
            run_merge(
                model, os.path.join(work, "out"), 0.9, refarg, dict(size=size, step="merge_and_save", scenario="gpu")
            ),
            args.json,
        )
    if "tight" in scenarios and CUDA:
        gc.collect()
        torch.cuda.empty_cache()
        used, total = device_used()
        emit(
            run_merge(
                model,
                os.path.join(work, "out"),
                (used + 1.5 * attn_need) / total,
                refarg,
                dict(size=size, step="merge_and_save", scenario="tight"),
            ),
            args.json,
        )
    if "cap" in scenarios and CUDA:
        gc.collect()
        torch.cuda.empty_cache()
        cap_bytes = torch.cuda.memory_reserved(DEV) + 3 * mlp_numel  # dequantizing an MLP weight takes 6 bytes/element

        @contextlib.contextmanager
        def capped():
            torch.cuda.set_per_process_memory_fraction(cap_bytes / total, DEV)
            try:
                yield
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, DEV)

        rec = dict(size=size, step="merge_and_save", scenario="cap", cap_gib=cap_bytes / 2**30)
        emit(run_merge(model, os.path.join(work, "out"), 0.95, refarg, rec, capped), args.json)
    if "other" in scenarios and CUDA:

        @contextlib.contextmanager
        def other():
            proc, stop = start_other(2 * mlp_numel, work)
            try:
                yield
            finally:
                open(stop, "w").close()
                proc.wait()

        rec = dict(size=size, step="merge_and_save", scenario="other", other_leaves_mib=2 * mlp_numel / 2**20)
        emit(run_merge(model, os.path.join(work, "out"), 0.95, refarg, rec, other), args.json)
    shutil.rmtree(os.path.join(work, "out"), ignore_errors=True)
    shutil.rmtree(ref, ignore_errors=True)

    if "disk" in scenarios:
        adapter = os.path.join(work, "adapter")
        shutil.rmtree(adapter, ignore_errors=True)
        model.save_pretrained(adapter)
        dref = os.path.join(work, "disk-cpu")
        emit(disk_engine(base, adapter, dref, "cpu", None, dict(size=size, step="disk", device="cpu")), args.json)
        if CUDA:
            emit(
                disk_engine(
                    base,
                    adapter,
                    os.path.join(work, "disk-cuda"),
                    "cuda",
                    dref,
                    dict(size=size, step="disk", device="cuda"),
                ),
                args.json,
            )
        shutil.rmtree(dref, ignore_errors=True)
        shutil.rmtree(os.path.join(work, "disk-cuda"), ignore_errors=True)
    if "unload" in scenarios:
        emit(unload(model, dict(size=size, step="merge_and_unload")), args.json)
    del model
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1B,8B", help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--work", default="/tmp/gpubench", help="folder for bases and outputs (tens of GB for 8B)")
    p.add_argument("--json", help="append one JSON line per result to this file")
    p.add_argument("--scenarios", default="cpu,gpu,tight,cap,other,disk,unload")
    p.add_argument("--keep", action="store_true", help="keep the bases")
    p.add_argument(
        "--before",
        help="speed: also time this tree of the package (a folder holding peft_shardmerge/, and bench/ for its "
        "in-process row)",
    )
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="speed: which rows, of " + ", ".join(ROWS))
    p.add_argument(
        "--repeat", type=int, default=1, help="speed: rounds of the disk rows, each after a durable copy of its own"
    )
    p.add_argument("--profile", default="/tmp/gpu-profiles", help="speed: the folder for the spy rows' raw stacks")
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        p.error(f"unknown --rows {sorted(unknown)}; choose from {', '.join(ROWS)}")
    os.makedirs(args.profile, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import bitsandbytes
    import peft
    import transformers

    machine = dict(
        step="machine",
        torch=torch.__version__,
        transformers=transformers.__version__,
        peft=peft.__version__,
        bitsandbytes=bitsandbytes.__version__,
        python=sys.version.split()[0],
        cpus=os.cpu_count(),
    )
    if CUDA:
        props = torch.cuda.get_device_properties(DEV)
        machine.update(gpu=props.name, gpu_total_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
        try:
            machine["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            ).stdout.strip()
        except OSError:
            pass
    emit(machine, args.json)
    for size in args.sizes.split(","):
        bench_size(size, args)


if __name__ == "__main__":
    main()
