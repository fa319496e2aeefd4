"""Benchmark: a merge written quantized (``quantize=``) against a 16-bit merge, then the format's own tool."""

# At 1B (bench_merge.py's random bf16 base and rank-16 adapter) each job runs in a fresh process: the 16-bit merge, the
# quantized merges, and each format's tool over the 16-bit merge's output (bitsandbytes through from_pretrained on the
# CPU for nf4 and int8; transformers' Fp8Quantize over the whole state dict for fp8-block, whose from_pretrained needs
# a GPU). Wall time and peak RSS are the job's, after its imports (bench_merge.py's measure), and for a merge its
# report's own peak; the jobs run interleaved, --repeats times, medians reported. Once more each, the 16-bit and the
# first format's merge with MALLOC_MMAP_THRESHOLD_=65536 (what is live, not what the allocator keeps). --pairs N times
# the whole processes of --one nf4 and --one nf4-reference in turn. make bench runs:
#
#     python bench/bench_quantize.py --repeats 3 --pairs 3 --write docs/benchmarks.md

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_merge import START_SAMPLING, WORK, build, write_section  # noqa: E402

SECTION = "## Quantized output: one pass against a 16-bit merge, then the format's tool"
FORMATS = ("nf4", "fp8-block", "int8")
SIZE = "1B"

CHILD = (
    r"""
import json, os, resource, shutil, sys, threading, time
job, base, adapter, merged, out = sys.argv[1:6]
import torch, transformers, peft_shardmerge
from peft_shardmerge.engine.rss import current_rss_bytes
if job in ("tool-nf4", "tool-int8"):
    import bitsandbytes
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    if job == "tool-nf4":
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    else:
        qc = BitsAndBytesConfig(load_in_8bit=True)
if job == "tool-fp8-block":
    import glob
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
shutil.rmtree(out, ignore_errors=True)
"""
    + START_SAMPLING
    + r"""extra = {}
if job.startswith("merge-"):
    fmt = job.removeprefix("merge-")
    report = peft_shardmerge.merge_checkpoint(base, adapter, out, quantize=None if fmt == "16bit" else fmt,
                                              progress=False)
    extra["merge_own"] = report.peak_rss_bytes - report.baseline_rss_bytes  # from its start: the plan made
elif job in ("tool-nf4", "tool-int8"):
    model = AutoModelForCausalLM.from_pretrained(merged, quantization_config=qc, device_map="cpu")
    model.save_pretrained(out)
elif job == "tool-fp8-block":
    qc = FineGrainedFP8Config()
    state = {}
    for f in sorted(glob.glob(os.path.join(merged, "*.safetensors"))):
        state.update(load_file(f))
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(qc))
    for name in list(state):
        if name.endswith("_proj.weight"):
            state.update(quantize._quantize_one(name, state.pop(name)))
    os.makedirs(out)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(merged)
    config.quantization_config = qc.to_dict()
    config.save_pretrained(out)
else:
    raise SystemExit(f"unknown job {job}")
wall = time.perf_counter() - t0
done.set()
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
peak = maxrss if maxrss > maxrss_before else max(sampled[0], current_rss_bytes())
size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
print(json.dumps({"wall_s": wall, "peak_rss": peak, "baseline_rss": baseline, "maxrss": maxrss, "bytes": size,
                  **extra}))
"""
)


def job(name: str, base: str, adapter: str, keep: bool = False) -> dict:
    """One job in a fresh process: its wall seconds, peak RSS (and over the post-import baseline), bytes written, and
    for a merge its own peak (its report's). ``NAME+mmap``: the C allocator returns every block over 64 KiB at once
    (``MALLOC_MMAP_THRESHOLD_``), so that the peak counts what is live, not what its free lists keep."""
    name, _, variant = name.partition("+")
    merged = os.path.join(WORK, "quant-merged16")
    out = merged if name == "merge-16bit" and not variant else os.path.join(WORK, f"quant-{name}")
    env = {
        **os.environ,
        **({"MALLOC_MMAP_THRESHOLD_": "65536"} if variant == "mmap" else {}),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    os.sync()  # no dirty pages of the previous job being written back during this one
    p = subprocess.run(
        [sys.executable, "-c", CHILD, name, base, adapter, merged, out],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    if p.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def model() -> tuple[str, str]:
    """bench_merge.py's base and adapter, built first where missing (without importing torch where they exist: a
    ``--one`` process starts as light as the commands it stands for)."""
    base, adapter = os.path.join(WORK, f"base-{SIZE}"), os.path.join(WORK, f"adapter-{SIZE}")
    if os.path.exists(os.path.join(adapter + "-b", "adapter_model.safetensors")):
        return base, adapter
    return build(SIZE)


def one(mode: str, base: str, adapter: str) -> str:
    """``--one``: a quantized merge (``nf4``), a 16-bit merge (``16bit``), or a 16-bit merge then the format's tool
    (``nf4-reference``); a line saying what it took."""
    if mode.endswith("-reference"):
        fmt = mode.removesuffix("-reference")
        merge = job("merge-16bit", base, adapter, keep=True)
        try:
            tool = job(f"tool-{fmt}", base, adapter)
        finally:
            shutil.rmtree(os.path.join(WORK, "quant-merged16"), ignore_errors=True)
        return (
            f"16-bit merge then the {fmt} tool: {merge['wall_s']:.1f} + {tool['wall_s']:.1f} s, peak RSS "
            f"{merge['maxrss'] / 2**20:.0f} / {tool['maxrss'] / 2**20:.0f} MiB"
        )
    r = job(f"merge-{mode}", base, adapter)
    return f"merge, {mode}: {r['wall_s']:.1f} s, peak RSS {r['maxrss'] / 2**20:.0f} MiB"


def largest(base: str) -> tuple[tuple[str, int], tuple[str, int]]:
    """The largest ``*_proj.weight`` (the weights the formats quantize) and the largest tensor of ``base``, each with
    its bytes in float32."""
    from safetensors import safe_open

    sizes = {}
    for f in sorted(os.listdir(base)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(base, f), framework="pt") as st:
                for k in st.keys():
                    n = 1
                    for d in st.get_slice(k).get_shape():
                        n *= d
                    sizes[k] = 4 * n
    proj = max((kv for kv in sizes.items() if kv[0].endswith("_proj.weight")), key=lambda kv: kv[1])
    return proj, max(sizes.items(), key=lambda kv: kv[1])


def pairs(n: int, fmt: str) -> list[tuple[dict, dict]]:
    """``n`` pairs of whole processes run in turn: ``--one FMT`` (A) then ``--one FMT-reference`` (B); each one's wall
    seconds, CPU seconds and peak RSS (the largest of the processes it waited for)."""
    runs = []
    for _ in range(n):
        pair = []
        for mode in (fmt, f"{fmt}-reference"):
            os.sync()
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--one", mode],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)
            out, err = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"--one {mode} failed:\n{err[-3000:]}")
            pair.append({"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "maxrss": usage.ru_maxrss * 1024})
            print(f"pair, --one {mode}: {wall:.1f} s ({out.strip()})", flush=True)
        runs.append(tuple(pair))
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of every job; the median is reported")
    ap.add_argument("--pairs", type=int, default=0, help="whole-process pairs of --one nf4 and --one nf4-reference")
    ap.add_argument(
        "--no-allocator-check",
        dest="allocator_check",
        action="store_false",
        help="skip the 16-bit merge and the first format's merge run once more with MALLOC_MMAP_THRESHOLD_=65536",
    )
    ap.add_argument("--write", help="put the section into this Markdown file (replacing an earlier one)")
    ap.add_argument(
        "--one",
        metavar="MODE",
        help="one run, then exit: a format (a quantized merge), 16bit, or FORMAT-reference (a 16-bit merge, then "
        "the format's tool)",
    )
    args = ap.parse_args()
    base, adapter = model()
    if args.one:
        print(one(args.one, base, adapter))
        return 0
    formats = args.formats.split(",")
    t_start = time.perf_counter()
    runs: dict[str, list[dict]] = {}
    for i in range(args.repeats):  # interleaved, so that load on the machine hits every job alike
        jobs = ["merge-16bit", *(f"merge-{f}" for f in formats), *(f"tool-{f}" for f in formats)]
        if i == 0 and args.allocator_check:
            jobs += ["merge-16bit+mmap", f"merge-{formats[0]}+mmap"]
        try:
            for name in jobs:
                r = job(name, base, adapter, keep=name == "merge-16bit")
                runs.setdefault(name, []).append(r)
                print(
                    f"{name}: {r['wall_s']:.1f} s, peak RSS {r['maxrss'] / 2**20:.0f} MiB "
                    f"(+{(r['peak_rss'] - r['baseline_rss']) / 2**20:.0f} MiB over its imports"
                    + (f", the merge's own +{r['merge_own'] / 2**20:.0f} MiB" if "merge_own" in r else "")
                    + f"), {r['bytes'] / 1e9:.2f} GB written",
                    flush=True,
                )
        finally:
            shutil.rmtree(os.path.join(WORK, "quant-merged16"), ignore_errors=True)
    for i in range(args.repeats):  # merge + tool, each repeat's 16-bit merge with the tool run over its output
        for f in formats:
            runs.setdefault(f"chain-{f}", []).append(
                {"wall_s": runs["merge-16bit"][i]["wall_s"] + runs[f"tool-{f}"][i]["wall_s"]}
            )
    paired = pairs(args.pairs, "nf4") if args.pairs else []
    measured = time.perf_counter() - t_start
    table = format_section(runs, formats, largest(base), paired, measured, args)
    print(table)
    if args.write:
        write_section(args.write, SECTION, table)
    return 0


def med(rs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def over(rs: list[dict]) -> float:
    """The highest peak RSS over the post-import baseline of the runs, in MiB."""
    return max(r["peak_rss"] - r["baseline_rss"] for r in rs) / 2**20


def para(text: str) -> str:
    """A paragraph of the section, wrapped as the rest of docs/benchmarks.md is."""
    parts = text.split("`")
    parts[1::2] = [p.replace(" ", "\0") for p in parts[1::2]]  # a code span is never broken
    wrapped = textwrap.fill("`".join(parts), width=119, break_long_words=False, break_on_hyphens=False)
    return wrapped.replace("\0", " ")


def format_section(runs, formats, sizes, paired, measured, args) -> str:
    from importlib.metadata import version

    (proj, proj_bytes), (big, big_bytes) = sizes
    one_tensor = proj_bytes / 2**20
    merge16 = runs["merge-16bit"]
    base_over = over(merge16)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [
        SECTION,
        "",
        para(
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, no GPU; Python "
            f"{platform.python_version()}, torch {version('torch')}, transformers {version('transformers')}, "
            f"bitsandbytes {version('bitsandbytes')}; {time.strftime('%Y-%m-%d')}. Command:"
        ),
        "",
        f"    python bench/bench_quantize.py --formats {','.join(formats)} --repeats {args.repeats} "
        f"--pairs {args.pairs} --write docs/benchmarks.md",
        "",
        para(
            f"The {SIZE} base of bench_merge.py (random bf16, Llama-3.2-1B's shapes with untied embeddings, 1.5B "
            "parameters, 1 GB shards) and its rank-16 LoRA on all seven projections. Each job runs in a fresh "
            "process: the 16-bit merge (`merge_checkpoint(..., quantize=None)`), the quantized merges "
            "(`quantize=NAME`), and each format's own tool over the 16-bit merge's output: for nf4 and int8 "
            "`AutoModelForCausalLM.from_pretrained(merged, quantization_config=BitsAndBytesConfig(...), "
            'device_map="cpu")` then `save_pretrained` (nf4: double quant, bf16 compute dtype; bitsandbytes '
            "quantizes on the CPU); for fp8-block the whole state dict loaded (`load_file`), transformers' "
            "`Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config()))._quantize_one` applied to every "
            "`*_proj.weight`, then `save_file` (`from_pretrained` with `FineGrainedFP8Config` needs a GPU). Wall "
            f"time is the job's, after its imports: the median of {args.repeats} interleaved runs (range in "
            "brackets); the chain is each run's 16-bit merge plus the tool over its output. Peak RSS is the "
            "process's lifetime peak (`ru_maxrss`, mapped file pages included), and the job's own peak over the "
            "process's resident memory after its imports (bench_merge.py's measure); the highest of the runs."
        ),
        "",
        "| job | wall (s) | peak RSS of the process (MiB) | over its imports (MiB) | the merge's own (MiB) "
        "| written (GB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {"merge-16bit": "16-bit merge (`quantize=None`)"}
    for f in formats:
        names[f"merge-{f}"] = f'quantized merge, `quantize="{f}"`'
    for f in formats:
        names[f"tool-{f}"] = f"{f}: the tool over the 16-bit merge"
    for key, label in names.items():
        rs = runs[key]
        walls = sorted(r["wall_s"] for r in rs)
        lines.append(
            f"| {label} | {med(rs, 'wall_s'):.1f} [{walls[0]:.1f}–{walls[-1]:.1f}] | "
            f"{max(r['maxrss'] for r in rs) / 2**20:.0f} | {over(rs):.0f} | {own(rs)} | "
            f"{med(rs, 'bytes') / 1e9:.2f} |"
        )
    lines += [
        "",
        para(
            "The merge's own peak is its report's (`MergeReport.peak_rss_bytes` less `baseline_rss_bytes`: sampled "
            "every 50 ms from the merge's start, the plan made). In time, against the chain users run today (the "
            "16-bit merge, then the tool over the whole model):"
        ),
        "",
        "| format | quantized merge (s) | 16-bit merge + tool (s) | quantized / chain |",
        "|---|---:|---:|---:|",
    ]
    for f in formats:
        q, chain, tool = runs[f"merge-{f}"], runs[f"chain-{f}"], runs[f"tool-{f}"]
        lines.append(
            f"| {f} | {med(q, 'wall_s'):.1f} | {med(chain, 'wall_s'):.1f} "
            f"({med(merge16, 'wall_s'):.1f} + {med(tool, 'wall_s'):.1f}) | "
            f"{med(q, 'wall_s') / med(chain, 'wall_s'):.2f} |"
        )
    own16 = max(r["merge_own"] for r in merge16) / 2**20
    lines += [
        "",
        para(
            "In memory, against the target (a quantized merge's peak within the 16-bit merge's plus one tensor: the "
            f"largest weight the formats quantize, `{proj}`, {one_tensor:.0f} MiB in float32; the largest tensor of "
            f"all, `{big}`, is {big_bytes / 2**20:.0f} MiB in float32 and is not quantized), in MiB, the highest of "
            "the runs:"
        ),
        "",
        "| format | over the imports: quantized merge | 16-bit merge + one tensor | over the target "
        "| the merge's own: quantized merge | 16-bit merge + one tensor | over the target | the tool step, over its "
        "imports |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    verdicts = []
    for f in formats:
        q = runs[f"merge-{f}"]
        qown = max(r["merge_own"] for r in q) / 2**20
        verdicts.append((f, over(q) - base_over, over(q) - base_over - one_tensor, qown - own16 - one_tensor))
        lines.append(
            f"| {f} | {over(q):.0f} | {base_over + one_tensor:.0f} | {max(0.0, verdicts[-1][2]):.0f} | {qown:.0f} | "
            f"{own16 + one_tensor:.0f} | {max(0.0, verdicts[-1][3]):.0f} | {over(runs[f'tool-{f}']):.0f} |"
        )
    if paired:
        a, b = [p[0] for p in paired], [p[1] for p in paired]
        ratio = statistics.median(x["wall_s"] / y["wall_s"] for x, y in paired)
        cpu = statistics.median(x["cpu_s"] / y["cpu_s"] for x, y in paired)
        lines += [
            "",
            para(
                "Paired, as whole processes (start-up included): A `python bench/bench_quantize.py --one nf4`, B "
                "`python bench/bench_quantize.py --one nf4-reference` (the 16-bit merge, then the bnb tool, two "
                f"processes), run in turn, {len(paired)} pairs, the ratios taken pair by pair; peak RSS is the "
                "largest process's:"
            ),
            "",
            "| | quantized merge, nf4 (A) | 16-bit merge, then the bnb tool (B) | A/B |",
            "|---|---:|---:|---:|",
            f"| wall, median of {len(paired)} | {med(a, 'wall_s'):.1f} s | {med(b, 'wall_s'):.1f} s | {ratio:.3f} "
            f"({1 / ratio:.2f}x faster) |",
            f"| cpu | {med(a, 'cpu_s'):.1f} s | {med(b, 'cpu_s'):.1f} s | {cpu:.3f} |",
            f"| peak RSS | {max(x['maxrss'] for x in a) / 2**20:.0f} MiB | {max(x['maxrss'] for x in b) / 2**20:.0f} "
            "MiB | |",
        ]
    lines += ["", para("What the figures say. " + memory_text(runs, formats, verdicts, sizes, base_over, own16))]
    ratios = ", ".join(
        f"{f} {med(runs[f'merge-{f}'], 'wall_s') / med(runs[f'chain-{f}'], 'wall_s'):.2f}" for f in formats
    )
    lines += [
        "",
        para(
            f"In time, quantized merge / (16-bit merge + tool): {ratios}; the quantized merge writes fewer bytes "
            "than the 16-bit merge and never writes or reads a 16-bit copy. Times vary from run to run on 2 cores "
            "(the ranges above); the paired whole-process runs give the ratio with start-up included. The whole "
            f"benchmark took {measured / 60:.0f} min ({args.repeats} repeats of {2 * len(formats) + 1} jobs"
            + (", 2 allocator runs" if "merge-16bit+mmap" in runs else "")
            + (f", then {len(paired)} pairs)." if paired else ").")
        ),
    ]
    return "\n".join(lines) + "\n"


def own(rs: list[dict]) -> str:
    """The highest of the merge's own peaks (its report's) of the runs, in MiB; a dash for a tool."""
    return f"{max(r['merge_own'] for r in rs) / 2**20:.0f}" if "merge_own" in rs[0] else "–"


def memory_text(runs, formats, verdicts, sizes, base_over, own16) -> str:
    """The paragraph on the memory target: whether it holds, by how much it does not, and what holds the rest."""
    (_, proj_bytes), (big, big_bytes) = sizes
    one_tensor = proj_bytes / 2**20
    worst = max(verdicts, key=lambda v: v[2])
    if worst[2] <= 0:
        return (
            f"The memory target holds: every quantized merge peaks within the 16-bit merge's {base_over:.0f} MiB "
            f"over its imports plus one {one_tensor:.0f} MiB tensor."
        )
    most = max(v[1] for v in verdicts)
    text = (
        f"The memory target does not hold. Over its imports the 16-bit merge peaks at {base_over:.0f} MiB, the "
        "quantized merges "
        + ", ".join(f"{add:.0f} MiB higher ({f})" for f, add, _, _ in verdicts)
        + f": up to {worst[2]:.0f} MiB over the 16-bit merge plus the largest weight they quantize "
        f"({one_tensor:.0f} MiB in float32, {worst[0]}). Taken as the largest tensor of the model, `{big}` in float32 "
        f"({big_bytes / 2**20:.0f} MiB), the target would hold"
        + (f" with {big_bytes / 2**20 - most:.0f} MiB to spare." if most <= big_bytes / 2**20 else " for none.")
    )
    pre16 = base_over - own16
    f, add, _, own_excess = worst
    pre = over(runs[f"merge-{f}"]) - max(r["merge_own"] for r in runs[f"merge-{f}"]) / 2**20
    text += (
        f" Of the {add:.0f} MiB ({f}), {pre - pre16:.0f} are taken before the merge starts (the job's peak over its "
        f"imports less the merge's own: {pre:.0f} MiB against the 16-bit merge's {pre16:.0f}): the quantized merge "
        "runs the model class's checks in its own process first, which loads transformers' modeling code and "
        "bitsandbytes. The merge's own peak is "
        + (
            f"{own_excess:.0f} MiB over the 16-bit merge's plus one tensor"
            if own_excess > 0
            else f"within the 16-bit merge's plus one tensor ({-own_excess:.0f} MiB below)"
        )
        + ": each worker (one per core here) merges its weight's rows in float32, twice the bytes of a 16-bit row "
        "block, and the format's quantizer makes its temporaries from them."
    )
    mm16, mmq = runs.get("merge-16bit+mmap"), runs.get(f"merge-{formats[0]}+mmap")
    if mm16 and mmq:
        diff = (mmq[0]["merge_own"] - mm16[0]["merge_own"]) / 2**20
        text += (
            " With the C allocator returning every block over 64 KiB at once (`MALLOC_MMAP_THRESHOLD_=65536`, one "
            f"run each), the merge's own peak is {mm16[0]['merge_own'] / 2**20:.0f} MiB for the 16-bit "
            f"merge and {mmq[0]['merge_own'] / 2**20:.0f} MiB for {formats[0]}: {diff:.0f} MiB apart, "
            + ("within one tensor" if diff <= one_tensor else f"{diff - one_tensor:.0f} MiB over one tensor")
            + "."
        )
        default = (max(r["merge_own"] for r in runs[f"merge-{formats[0]}"]) / 2**20) - own16
        if default > diff:
            text += (
                f" The other {default - diff:.0f} MiB of the {default:.0f} MiB between the two by default is memory "
                "freed and kept by the allocator for reuse, not held."
            )
    return text + (
        " Every quantized merge stays far below the tool step, which holds the whole model "
        f"({min(over(runs[f'tool-{f}']) for f in formats) / 2**10:.1f} GiB and more over its imports)."
    )


if __name__ == "__main__":
    sys.exit(main())
