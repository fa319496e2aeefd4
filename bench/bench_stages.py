"""Benchmark: where the time of a merge from disk goes, stage by stage, for this tree and another one side by side.

Each tree's ``peft-shardmerge merge BASE ADAPTER OUT`` runs under ``py-spy record`` (100 samples a second, every
thread); each sample is put in the stage of the innermost frame of its stack that names one
(the rules below, by function name), so a stage's seconds are the thread-seconds spent there, summed over threads.
Wall time is measured around the command, without py-spy, in separate interleaved runs.

    python bench/bench_stages.py --before /path/to/old/checkout --size 0.5B

``--raw`` instead puts the samples of py-spy raw files made elsewhere (``bench_gpu.py``'s ``spy-...`` rows) in the
same stages, all threads and the main thread apart (the thread that merges a loaded model's modules):

    python bench/bench_stages.py --raw 8B-inprocess.txt --rate 50
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_checks  # noqa: E402 - the cost of the checks
import bench_merge  # noqa: E402 - the benchmark models

RATE = 100
#: (stage, function names): the innermost frame naming one of these decides a sample's stage
RULES = [
    ("input digests for resuming (CRC-32)", {"range_digest", "InputDigests.shard", "InputDigests.common"}),
    ("output CRC-32 (before: a second hash of every byte)", {"Crc32.update"}),
    ("fsync", {"fsync", "ShardWriter.close"}),
    ("SHA-256 of the output", {"TensorDigests.update", "TensorAt.write", "TensorAt.copy_from"}),
    ("write (os.write, pwrite, copy)", {"_write_all", "_pwrite", "_copy", "ShardWriter._copy", "TensorAt._pwrite"}),
    ("read base rows", {"read_rows", "RowReader.read_rows", "RowReader.read", "_buffer"}),
    ("LoRA products", {"_add_tiles_", "add_lora_", "lora_probe", "add_lora_checked_"}),
    ("widen, checks, narrow (per block)", {"merge_block", "merge_rows", "RowMerger.merge_rows", "update_counts"}),
    ("copy off the device (a loaded model's modules)", {"ModelReader._copied_out"}),
    ("dequantize 4-bit (a loaded model's modules)", {"dequantize_4bit_exact", "dequantize_blockwise_exact"}),
    ("adapter weights finite (planning)", {"_check_finite_files"}),
    ("planning (headers, configs, checks)", {"plan_from_folders", "plan_with_options"}),
    ("imports", {"_find_and_load", "_call_with_frames_removed", "import_module", "_compile_bytecode"}),
    ("waiting (queues, locks, idle workers)", {"wait", "Condition.wait", "_worker", "get", "Queue.get", "result"}),
]
STAGES = [name for name, _ in RULES] + ["other"]
WAITING = RULES[-1][0]


def stage_of(frames: list[str]) -> str:
    """The stage of one sampled stack (outermost frame first)."""
    names = [f.split(" (")[0] for f in frames]
    for name in reversed(names):
        for stage, funcs in RULES:
            if name in funcs or name.split(".")[-1] in funcs:
                if funcs is RULES[1][1] and any("range_digest" in n for n in names):
                    return RULES[0][0]  # the CRC-32 of the inputs, not of the output
                return stage
    return "other"


def spy_record(raw: str, rate: int) -> list[str]:
    """``py-spy record`` of every thread into the raw file ``raw`` at ``rate`` samples a second, to be followed by
    ``-- COMMAND`` or ``--pid PID``; py-spy as installed beside this interpreter, on the PATH, or by a wheel into a
    folder of ``sys.path`` (``pip install --target``)."""
    folders = [os.path.dirname(sys.executable)] + [os.path.join(p, "bin") for p in sys.path if p]
    spy = next((os.path.join(f, "py-spy") for f in folders if os.path.exists(os.path.join(f, "py-spy"))), None)
    return [spy or shutil.which("py-spy") or "py-spy", "record", "-r", str(rate), "-f", "raw", "--threads", "-o", raw]


def profile(tree: str, base: str, adapter: str, out: str, extra: list[str]) -> Counter:
    """Thread-seconds per stage of one merge run from ``tree`` under py-spy."""
    raw = os.path.join(tempfile.mkdtemp(), "spy.txt")
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    cmd = [sys.executable, "-m", "peft_shardmerge", "merge", base, adapter, out, "-q", *extra]
    subprocess.run(
        [*spy_record(raw, RATE), "--", *cmd],
        cwd=tree,
        check=True,
        capture_output=True,
    )
    shutil.rmtree(out, ignore_errors=True)
    return read_raw(raw, RATE)[0]


def read_raw(raw: str, rate: int) -> tuple[Counter, Counter]:
    """Seconds per stage of a py-spy raw file sampled at ``rate`` (``--threads``): all threads, and the main thread."""
    seconds: Counter = Counter()
    main: Counter = Counter()
    for line in open(raw):
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        stage = stage_of(frames[1:])
        seconds[stage] += int(n) / rate
        if "MainThread" in frames[0]:
            main[stage] += int(n) / rate
    return seconds, main


def summarize(files: list[str], rate: int) -> None:
    """Print the stage table of py-spy raw files: thread-seconds of all threads and of the main thread, per file."""
    read = {f: read_raw(f, rate) for f in files}
    names = [os.path.basename(f) for f in files]
    print("| stage (thread-seconds) | " + " | ".join(f"{n}: all threads | {n}: main thread" for n in names) + " |")
    print("|---|" + "---:|---:|" * len(files))
    for s in STAGES:
        print(f"| {s} | " + " | ".join(f"{read[f][0][s]:.2f} | {read[f][1][s]:.2f}" for f in files) + " |")
    total = [(sum(v for k, v in c.items() if k != WAITING) for c in read[f]) for f in files]
    print("| **waiting left out** | " + " | ".join(f"{a:.2f} | {m:.2f}" for a, m in total) + " |")


def wall(tree: str, base: str, adapter: str, out: str, extra: list[str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "peft_shardmerge", "merge", base, adapter, out, "-q", *extra],
        cwd=tree,
        check=True,
        capture_output=True,
    )
    t = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another checkout (a folder holding peft_shardmerge/)")
    ap.add_argument("--after", default=os.path.dirname(HERE), help="this checkout (default)")
    ap.add_argument("--size", default="0.5B", choices=list(bench_merge.SIZES))
    ap.add_argument("--repeats", type=int, default=3, help="interleaved wall-time runs per tree (median)")
    ap.add_argument("--after-args", default="", help="more arguments for this tree's command (e.g. '--workers 1')")
    ap.add_argument("--raw", nargs="+", help="instead: py-spy raw files to put in stages (made with --threads)")
    ap.add_argument("--rate", type=int, default=RATE, help="the samples a second of the --raw files")
    args = ap.parse_args()
    if args.raw:
        summarize(args.raw, args.rate)
        return 0
    if not args.before:
        ap.error("--before is needed (or --raw)")
    base, adapter = bench_merge.build(args.size)
    out = os.path.join(bench_merge.WORK, "out-stages")
    subprocess.run(["cat", *[os.path.join(base, f) for f in os.listdir(base)]], stdout=subprocess.DEVNULL)
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    walls = {k: [] for k in trees}
    extra = {"before": [], "after": args.after_args.split()}
    for _ in range(args.repeats):
        for k, tree in trees.items():
            walls[k].append(wall(tree, base, adapter, out, extra[k]))
    stages = {k: profile(tree, base, adapter, out, extra[k]) for k, tree in trees.items()}
    copy = os.path.join(bench_merge.WORK, "copy")
    shutil.rmtree(copy, ignore_errors=True)
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(["sh", "-c", f"cp -r {base} {copy} && sync"], check=True)
    copy_wall = time.perf_counter() - t0
    shutil.rmtree(copy)
    med = {k: sorted(v)[len(v) // 2] for k, v in walls.items()}
    print(f"{args.size}: {os.cpu_count()} CPUs; `cp -r BASE COPY && sync` {copy_wall:.2f} s; {args.after_args}\n")
    print("| stage (thread-seconds, summed over threads) | before | after |")
    print("|---|---:|---:|")
    for s in STAGES:
        print(f"| {s} | {stages['before'][s]:.2f} | {stages['after'][s]:.2f} |")
    work = {k: sum(v for s, v in c.items() if s != WAITING) for k, c in stages.items()}
    print(f"| **all threads, waiting left out** | {work['before']:.2f} | {work['after']:.2f} |")
    print(
        f"| **wall time of the command** (median of {args.repeats}, no profiler) | {med['before']:.2f} | "
        f"{med['after']:.2f} |"
    )
    from peft_shardmerge.engine.pipeline import default_workers

    after = args.after_args.split()
    workers = int(after[after.index("--workers") + 1]) if "--workers" in after else default_workers()
    share = bench_checks.measure(base, adapter, out, 2 * args.repeats, workers, trees["after"])
    print(
        f"\nafter: the merge's own wall time {share['on_median']:.2f} s with the self-check and the precision report, "
        f"{share['off_median']:.2f} s without them (median pairwise ratio {share['ratio']:.3f}, "
        f"{2 * args.repeats} pairs, {workers} workers; bench_checks.py)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
