"""Benchmark: peak RSS and wall time of peft-shardmerge vs plain file copying vs PEFT's reload + merge + save.

Builds random bf16 bases (~0.5B Qwen2-like, ~1.2B Llama-3.2-1B-like; ``8B-2L``, two layers of Llama-8B's shapes, and
``8B``, the whole of them, for the other benchmarks) and rank-16 adapters on every projection under bench/_work, then
runs each method in a fresh subprocess, side by side, and writes a Markdown table. Peak RSS is the subprocess's peak
resident memory during the job (``ru_maxrss`` when the job sets a new peak, else the highest of 5 ms samples of
``/proc/self/statm``) minus its RSS after importing torch, transformers, peft and peft_shardmerge (the post-import
baseline).

    python bench/bench_merge.py --sizes 0.5B,1B --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.path.join(HERE, "_work")

SIZES = {
    "0.5B": dict(
        arch="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1B": dict(
        arch="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
# two layers of Llama-8B's shapes (hidden 4096, MLP 14336) and a small vocabulary: the widest rows of an 8B merge
# (bench_checks.py, bench_floor.py), on a machine without room or time for the whole model
SIZES["8B-2L"] = dict(SIZES["1B"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, vocab_size=32000)
# Llama-3-8B's shapes, whole (16.06 GB): how the cost grows with the model (bench_floor.py --size 0.5B,1B,8B)
SIZES["8B"] = dict(SIZES["1B"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_section(path: str, heading: str, text: str) -> None:
    """Put ``text`` in ``path`` in place of the section that starts with ``heading`` (up to the next ``## ``
    heading: the sections around it, hand-written ones included, are kept where they are), or append it.

    Args:
        path: the Markdown file.
        heading: the section's first line.
        text: the new section, its heading first.
    """
    old = open(path).read() if os.path.exists(path) else ""
    if heading in old:
        start = old.index(heading)
        end = old.find("\n## ", start + len(heading))
        new = old[:start] + text.rstrip("\n") + "\n" + (old[end:] if end >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(new)


def build(size: str) -> tuple[str, str]:
    """Write a random bf16 base, a rank-16 adapter and a second, rank-8 one (for the combinations) for ``size``,
    streaming one tensor at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    from peft_shardmerge.output.writer import ShardWriter, write_json
    from peft_shardmerge.testing import tiny_config

    base = os.path.join(WORK, f"base-{size}")
    adapter = os.path.join(WORK, f"adapter-{size}")
    if os.path.exists(os.path.join(second_adapter(adapter), "adapter_model.safetensors")):
        return base, adapter
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    spec = dict(SIZES[size])
    config = tiny_config(spec.pop("arch"), **spec)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]  # as a real checkpoint's config names it (MergeKit needs it)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    # shards of at most 1 GB, as a consecutive split
    shards, cur, size_b = [], [], 0
    for name, shape in shapes.items():
        n = 2 * int(torch.Size(shape).numel())
        if cur and size_b + n > 10**9:
            shards.append(cur)
            cur, size_b = [], 0
        cur.append(name)
        size_b += n
    shards.append(cur)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for fname, names in zip(files, shards):
        entries = [(n, "BF16", shapes[n], 2 * int(torch.Size(shapes[n]).numel())) for n in names]
        with ShardWriter(os.path.join(base, fname), entries) as w:
            for n in names:
                shape = shapes[n]
                rows = shape[0]
                step = max(1, (1 << 22) // max(1, int(torch.Size(shape[1:]).numel())))
                for r in range(0, rows, step):
                    block = torch.randn((min(step, rows - r), *shape[1:]), generator=g) * 0.02
                    w.write(block.to(torch.bfloat16))
                weight_map[n] = fname
    total = sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    write_json(
        os.path.join(base, "model.safetensors.index.json"),
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    config.save_pretrained(base)

    write_adapter(shapes, adapter, g)
    write_adapter(shapes, second_adapter(adapter), torch.Generator().manual_seed(1), rank=8)
    return base, adapter


def second_adapter(adapter: str) -> str:
    """The folder of the second adapter built beside ``adapter``."""
    return adapter + "-b"


def write_adapter(shapes: dict, folder: str, g, rank: int = 16) -> str:
    """A rank-``rank`` LoRA with non-zero B on the seven projections of every layer of a base with weights of
    ``shapes``, drawn from generator ``g`` and written to ``folder``."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    lora = {}
    for name, shape in shapes.items():
        mod = name.removesuffix(".weight")
        if name.endswith(".weight") and mod.rsplit(".", 1)[-1] in TARGETS:
            lora[f"base_model.model.{mod}.lora_A.weight"] = torch.randn(rank, shape[1], generator=g) * 0.01
            lora[f"base_model.model.{mod}.lora_B.weight"] = torch.randn(shape[0], rank, generator=g) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(lora, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=rank, lora_alpha=32, target_modules=TARGETS, task_type="CAUSAL_LM").save_pretrained(folder)
    return folder


#: a child's start of measurement, after its imports and set-up: its RSS then (``baseline``), its lifetime peak then
#: (``maxrss_before``), the highest RSS sampled every 5 ms from then on (``sampled[0]``, until ``done`` is set) and
#: the time (``t0``); bench_quantize.py's children start so too
START_SAMPLING = r"""
baseline = current_rss_bytes()
maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
sampled = [baseline]
done = threading.Event()
def sample():
    while not done.wait(0.005):
        sampled[0] = max(sampled[0], current_rss_bytes())
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
"""

CHILD = (
    r"""
import json, os, resource, shutil, sys, threading, time
import torch, transformers, peft, peft_shardmerge
from peft_shardmerge.engine.rss import current_rss_bytes
method, base, adapter, out = sys.argv[1:5]
adapters = [adapter, adapter + "-b"]  # the two adapters of the combinations (bench_merge.second_adapter)
shutil.rmtree(out, ignore_errors=True)
extra = {}
if method in ("mergekit", "mergekit_ties"):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions
if method == "merge_and_save_4bit":
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=qc, device_map="cpu", dtype=torch.bfloat16)
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    with torch.no_grad():  # fault in every weight page (transformers maps checkpoints), as training would
        for t in list(model.parameters()) + list(model.buffers()):
            t.detach().sum()
    extra["largest_module_fp32"] = max(m.weight.quant_state.shape.numel() * 4 for m in model.modules()
                                       if isinstance(m, bnb.nn.Linear4bit))
"""
    + START_SAMPLING
    + r"""ru0 = resource.getrusage(resource.RUSAGE_SELF)
if method in ("copy", "copy_fsync"):
    os.makedirs(out)
    for f in sorted(os.listdir(base)):
        shutil.copyfile(os.path.join(base, f), os.path.join(out, f))
        if method == "copy_fsync":
            fd = os.open(os.path.join(out, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
elif method == "peft_shardmerge":
    peft_shardmerge.merge_checkpoint(base, adapter, out, progress=False)
elif method == "peft_shardmerge_500MB":
    peft_shardmerge.merge_checkpoint(base, adapter, out, progress=False, max_shard_size="500MB")
elif method == "merge_and_save_4bit":
    peft_shardmerge.merge_and_save(model, out, base_precision="dequantized", progress=False)
elif method == "peft_shardmerge_ties":
    peft_shardmerge.merge_checkpoint(base, adapters, out, weights=[0.7, 0.3], combination="ties", density=0.5,
                                     progress=False)
elif method == "mergekit_ties":  # each BASE+ADAPTER merged into a full copy in its cache first
    cache = out + "-lora-cache"
    config = {"merge_method": "ties", "base_model": base, "dtype": "bfloat16",
              "models": [{"model": f"{base}+{a}", "parameters": {"weight": w, "density": 0.5}}
                         for a, w in zip(adapters, (0.7, 0.3))]}
    run_merge(MergeConfiguration.model_validate(config), out, MergeOptions(
        lora_merge_cache=cache, lazy_unpickle=True, copy_tokenizer=False, write_model_card=False, quiet=True))
    shutil.rmtree(cache)
elif method == "mergekit":  # BASE+ADAPTER passthrough: the adapter merged into a full copy in its cache first
    cache = out + "-lora-cache"
    config = {"merge_method": "passthrough", "dtype": "bfloat16", "models": [{"model": f"{base}+{adapter}"}]}
    run_merge(MergeConfiguration.model_validate(config), out, MergeOptions(
        lora_merge_cache=cache, lazy_unpickle=True, copy_tokenizer=False, write_model_card=False, quiet=True))
    shutil.rmtree(cache)
elif method == "peft":
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    m = PeftModel.from_pretrained(m, adapter).merge_and_unload()
    m.save_pretrained(out)
wall = time.perf_counter() - t0
ru1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
done.set()
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
# a new lifetime peak during the job is exact; otherwise the job stayed below the import-time peak and
# the 5 ms samples of /proc/self/statm tell how high it went
peak = maxrss if maxrss > maxrss_before else max(sampled[0], current_rss_bytes())
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_rss": peak, "baseline_rss": baseline, **extra}))
"""
)


#: the command line, timed from outside: its start-up (interpreter, imports, checks, plan) included
COMMANDS = {
    "cli": ["merge", "--model-checks", "auto"],
    "cli_first": ["merge", "--model-checks", "first"],
    "cli_dry_run": ["merge", "--dry-run"],
}


def run(method: str, base: str, adapter: str) -> dict:
    out = os.path.join(WORK, f"out-{method}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    os.sync()  # start every run with no dirty pages from the previous one being written back
    if method in COMMANDS:
        return run_command(method, base, adapter, out, env)
    p = subprocess.run(
        [sys.executable, "-c", CHILD, method, base, adapter, out],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    if p.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_command(method: str, base: str, adapter: str, out: str, env: dict) -> dict:
    """One run of ``peft-shardmerge merge`` in a fresh process: its wall and CPU time (every process it started), and
    the merge's own wall time from its summary (``wall time ... s``; none for a dry run)."""
    cmd = [sys.executable, "-m", "peft_shardmerge", *COMMANDS[method][:1], base, adapter, out, *COMMANDS[method][1:]]
    t0 = time.perf_counter()
    with open(out + ".stdout", "w+") as stdout, open(out + ".stderr", "w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this command's own resources, the processes it waited for included
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        stdout.seek(0)
        stderr.seek(0)
        text, errors = stdout.read(), stderr.read()
    shutil.rmtree(out, ignore_errors=True)
    os.remove(out + ".stdout")
    os.remove(out + ".stderr")
    os.sync()
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{errors[-3000:]}")
    merge = re.search(r"wall time ([0-9.]+) s", text)
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "merge_s": float(merge.group(1)) if merge else None,
        "peak_rss": usage.ru_maxrss * 1024,
        "baseline_rss": 0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5B,1B")
    ap.add_argument(
        "--methods",
        default="copy,copy_fsync,peft_shardmerge,peft_shardmerge_500MB,peft,mergekit,peft_shardmerge_ties,mergekit_ties,"
        "cli,cli_first,cli_dry_run",
    )
    ap.add_argument(
        "--inprocess-sizes",
        default="0.5B",
        help="sizes for the in-process merge_and_save benchmark on a 4-bit model ('' to skip)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per method; the median is reported")
    ap.add_argument("--write", help="write the Markdown table to this file")
    ap.add_argument("--keep", action="store_true", help="keep the generated models under bench/_work")
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        base, adapter = build(size)
        params = json.load(open(os.path.join(base, "model.safetensors.index.json")))["metadata"]["total_size"] // 2
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # interleaved, so that load on the machine hits every method alike
            for method in args.methods.split(","):
                r = run(method, base, adapter)
                runs.setdefault(method, []).append(r)
                print(
                    f"{size} {method}: {r['wall_s']:.2f} s, "
                    f"peak RSS +{(r['peak_rss'] - r['baseline_rss']) / 2**20:.0f} MiB"
                    + (f", the merge itself {r['merge_s']:.2f} s" if r.get("merge_s") else ""),
                    flush=True,
                )
        summary = {m: summarize(rs) for m, rs in runs.items()}
        copy_wall = summary.get("copy", {}).get("wall_s")
        for method, r in summary.items():
            rows.append((size, params, method, r, copy_wall))
    inproc = []
    for size in filter(None, args.inprocess_sizes.split(",")):
        base, adapter = build(size)
        rs = [run("merge_and_save_4bit", base, adapter) for _ in range(args.repeats)]
        for r in rs:
            print(
                f"{size} merge_and_save (4-bit): {r['wall_s']:.2f} s, peak RSS over the loaded model "
                f"+{(r['peak_rss'] - r['baseline_rss']) / 2**20:.0f} MiB",
                flush=True,
            )
        inproc.append((size, summarize(rs)))
    table = format_table(rows, args, inproc)
    print(table)
    if args.write:
        kept = ""  # the GPU section (bench/bench_gpu.py, measured on another machine) is kept as it is
        if os.path.exists(args.write):
            old = open(args.write).read()
            if "\n## On a CUDA GPU" in old:
                kept = old[old.index("\n## On a CUDA GPU") :]
        with open(args.write, "w") as f:
            f.write(table.rstrip("\n") + "\n" + kept)
    if not args.keep:
        shutil.rmtree(WORK, ignore_errors=True)
    return 0


def summarize(runs: list[dict]) -> dict:
    """Median wall time with its range, and the highest peak RSS over baseline, of repeated runs."""
    walls = sorted(r["wall_s"] for r in runs)
    merges = sorted(r["merge_s"] for r in runs if r.get("merge_s") is not None)
    return {
        "merge_s": merges[len(merges) // 2] if merges else None,
        "wall_s": walls[len(walls) // 2],
        "cpu_s": sorted(r["cpu_s"] for r in runs)[len(runs) // 2],
        "wall_min": walls[0],
        "wall_max": walls[-1],
        "rss_over": max(r["peak_rss"] - r["baseline_rss"] for r in runs),
        "largest_module_fp32": runs[0].get("largest_module_fp32"),
    }


def format_table(rows, args, inproc=()) -> str:
    import torch

    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    )
    lines = [
        "# Benchmarks",
        "",
        "Produced by `make bench`, i.e.",
        "",
        f"    python bench/bench_merge.py --sizes {args.sizes} --write docs/benchmarks.md",
        "",
        f"Machine: {machine}, no GPU; Python {platform.python_version()}, torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        "Each method runs in a fresh subprocess on the same random bf16 base (1 GB shards) and a rank-16 LoRA on",
        "all seven projections, output bf16 with 5 GB shards. Peak RSS is the subprocess's peak resident memory",
        "during the job (`ru_maxrss`, mapped file pages included, or 5 ms samples of `/proc/self/statm` when the",
        "job stays below the import-time peak) minus its resident memory right after importing torch,",
        "transformers, peft and peft_shardmerge. Wall time is the",
        f"median of {args.repeats} interleaved runs (range in brackets), each started after `sync` with the",
        "inputs in the page cache; × copy is the ratio of medians. CPU time is the job's user + system time (all its",
        "threads; median). Peak RSS is the highest of the runs.",
        "",
        "| base | params | method | wall time (s) | × copy | CPU time (s) | peak RSS over baseline (MiB) |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    names = {
        "copy": "copy the files (`shutil.copyfile`)",
        "copy_fsync": "copy the files, then fsync each",
        "peft_shardmerge": "peft-shardmerge merge (fsyncs its output)",
        "peft_shardmerge_500MB": 'peft-shardmerge merge, `max_shard_size="500MB"`',
        "peft": "PEFT reload + merge_and_unload + save_pretrained",
        "mergekit": "MergeKit `BASE+ADAPTER` passthrough (`run_merge`, lazy unpickle)",
        "peft_shardmerge_ties": 'peft-shardmerge, two adapters, `combination="ties"`, density 0.5',
        "mergekit_ties": "MergeKit `ties` of two `BASE+ADAPTER` references, density 0.5",
    }
    commands = [row for row in rows if row[2] in COMMANDS]
    rows = [row for row in rows if row[2] not in COMMANDS]
    for size, params, method, r, copy_wall in rows:
        ratio = f"{r['wall_s'] / copy_wall:.2f}" if copy_wall else "-"
        lines.append(
            f"| {size} | {params / 1e9:.2f}B | {names.get(method, method)} | {r['wall_s']:.2f} "
            f"[{r['wall_min']:.2f}–{r['wall_max']:.2f}] | {ratio} | {r['cpu_s']:.2f} | {r['rss_over'] / 2**20:.0f} |"
        )
    lines += [
        "",
        "Reading the table: the peak RSS of a peft-shardmerge merge is a row block per worker thread and does not",
        "grow with the model or the shard size (compare the two sizes and the two shard settings). Its time is",
        "bounded by the work a copy does not do: every merged weight is read, widened to fp32, given its LoRA",
        "delta, narrowed, hashed (SHA-256, for the merge record) and written back through user space, on two",
        "cores. The merges run in process here (`merge_checkpoint`), after the imports: the command line adds its",
        'start-up (see "Speed" below). PEFT\'s path holds the whole model in memory. MergeKit first merges the',
        "adapter into a whole model in memory and writes it to its LoRA cache (a second full copy on disk, deleted",
        "after the run), then copies that into the output; it does not fsync. All three outputs are the same bytes",
        "(`tests/integration/test_mergekit.py` checks ours against MergeKit's).",
        "",
        "The two `ties` rows combine the rank-16 adapter with a second, rank-8 one (weights 0.7 and 0.3, density",
        "0.5): ours computes each adapter's delta of one tensor at a time, twice for the exact top-k threshold and",
        "once for the merge; MergeKit first writes each adapter merged into a full model to its cache (two full",
        "copies on disk, deleted after the run). On float32 bases the two outputs agree to float32 rounding but for",
        "elements at the top-k threshold (tests/integration/test_mergekit.py); on this bf16 base MergeKit's deltas",
        "come from bf16 merged copies (docs/variants-several-adapters.md says how the two differ).",
    ]
    if commands:
        lines += command_table(commands, rows, args)
    if inproc:
        lines += [
            "",
            "## In-process: `merge_and_save` on a loaded 4-bit model",
            "",
            "The base is loaded with `BitsAndBytesConfig(load_in_4bit=True, nf4, double quant)` on the CPU, a",
            "rank-16 LoRA (non-zero B) is attached to all seven projections, and `merge_and_save(model, out,",
            'base_precision="dequantized")` writes bf16 (default `workers`: one per CPU, at most 8, here '
            f"{min(8, len(os.sched_getaffinity(0)))}; each module",
            "merged on the calling thread, then hashed and written by a worker while the next is merged). Peak RSS",
            "is measured over the RSS of the process with the model loaded and every weight page touched once (as",
            "after training; transformers memory-maps checkpoints, so untouched weights are not yet resident),",
            "against the largest quantized module's weight in fp32 (the working set of one module; up to `workers",
            "+ 1` merged modules in bf16, half that size each, wait for their write besides).",
            "",
            "| base | wall time (s) | peak RSS over the loaded model (MiB) | largest module in fp32 (MiB) |",
            "|---|---:|---:|---:|",
        ]
        for size, r in inproc:
            lines.append(
                f"| {size} | {r['wall_s']:.2f} [{r['wall_min']:.2f}–{r['wall_max']:.2f}] | "
                f"{r['rss_over'] / 2**20:.0f} | {r['largest_module_fp32'] / 2**20:.0f} |"
            )
    return "\n".join(lines) + "\n"


def command_table(commands, rows, args) -> list[str]:
    """The command line's section: whole commands against the durable copy of the same base."""
    durable = {size: r["wall_s"] for size, _, method, r, _ in rows if method == "copy_fsync"}
    names = {
        "cli": "`peft-shardmerge merge BASE ADAPTER OUT` (model-class checks beside the merge: the default here)",
        "cli_first": "`... --model-checks first` (the checks, then the merge)",
        "cli_dry_run": "`... --dry-run` (start-up and the whole plan; nothing read or written)",
    }
    lines = [
        "",
        "## The command line, start-up included",
        "",
        "The same bases and adapters, merged by the command in a fresh process, timed from outside (median of "
        f"{args.repeats}",
        'interleaved runs, range in brackets); × durable copy is against the row "copy the files, then fsync each" '
        "above.",
        '"The merge itself" is the summary\'s wall time (streaming, fsyncs and, beside, the wait for the checks);',
        "start-up is the command's wall time less that (the interpreter, imports, configs, the plan). CPU time adds",
        "every process the command started (the second process of the checks included).",
        "",
        "| base | command | wall (s) | × durable copy | the merge itself (s) | start-up (s) | CPU time (s) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for size, _, method, r, _ in commands:
        copy, merge = durable.get(size), r.get("merge_s")
        ratio = f"{r['wall_s'] / copy:.2f}" if copy else "–"
        split = f"{merge:.2f} | {r['wall_s'] - merge:.2f}" if merge is not None else "– | –"
        lines.append(
            f"| {size} | {names[method]} | {r['wall_s']:.2f} [{r['wall_min']:.2f}–{r['wall_max']:.2f}] | {ratio} | "
            f"{split} | {r['cpu_s']:.2f} |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
