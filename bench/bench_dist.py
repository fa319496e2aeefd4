"""Benchmark: the disk merge in one process against the same merge spread over 2 ranks with torchrun.

Builds (or reuses) a random bf16 Llama-like base of about 0.8 GB (200 MB input shards) and a rank-8 LoRA on
all seven projections under bench/_work, then times, alternating, side by side:

    python -m peft_shardmerge merge BASE ADAPTER OUT1 --max-shard-size 100MB -q
    torchrun --nproc_per_node 2 -m peft_shardmerge merge BASE ADAPTER OUT2 --max-shard-size 100MB -q

(``torchrun`` as ``sys.executable -m torch.distributed.run``), both with ``--model-checks first`` (what the ranks of a
job do: the model-class checks before the merge) and OMP_NUM_THREADS=1, reports the
median wall time of each and the 1 -> 2 speed-up, and checks that OUT1 and OUT2 are byte-identical.

    python bench/bench_dist.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import filecmp
import os
import platform
import shutil
import socket
import subprocess
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_merge import write_section  # noqa: E402

WORK = os.path.join(HERE, "_work")
SECTION = "## Many processes (1 -> 2 ranks)"

#: a Llama-like base of ~0.38B parameters (~0.76 GB in bf16)
SIZE = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=2048,
)


def build() -> tuple[str, str]:
    """Write the bf16 base and a LoRA adapter under bench/_work, unless they are already there."""
    import torch

    from peft_shardmerge.testing import build_adapter, build_base

    torch.set_num_threads(1)
    base = os.path.join(WORK, "dist-base")
    adapter = os.path.join(WORK, "dist-adapter")
    if not os.path.exists(os.path.join(base, "model.safetensors.index.json")):
        shutil.rmtree(base, ignore_errors=True)
        build_base(base, "llama", dtype=torch.bfloat16, max_shard_size="200MB", **SIZE)
    if not os.path.exists(os.path.join(adapter, "adapter_model.safetensors")):
        shutil.rmtree(adapter, ignore_errors=True)
        build_adapter(base, adapter, r=8, lora_alpha=16)
    return base, adapter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(ranks: int, base: str, adapter: str, out: str, dry: bool = False) -> list[str]:
    tail = ["-m", "peft_shardmerge", "merge", base, adapter, out, "--max-shard-size", "100MB", "-q"]
    tail += ["--model-checks", "first"]  # as every rank of a job does: the comparison is of the merge, not of start-up
    tail += ["--dry-run"] if dry else []
    if ranks == 1:
        return [sys.executable, *tail]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--master_port",
        str(free_port()),
        *tail,
    ]


def run(ranks: int, base: str, adapter: str, out: str, dry: bool = False) -> float:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    os.sync()  # no dirty pages of the previous run being written back during this one
    t0 = time.perf_counter()
    p = subprocess.run(
        command(ranks, base, adapter, out, dry), capture_output=True, text=True, env=env, timeout=1200, check=False
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RunFailed(f"{ranks} rank(s) failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return wall


class RunFailed(RuntimeError):
    """A timed command exited non-zero."""


FAILURES: list[str] = []


def run_counted(ranks: int, base: str, adapter: str, out: str, dry: bool = False) -> float:
    """:func:`run`, once more after a failure (which is counted and shown, never timed); a second failure stops."""
    try:
        return run(ranks, base, adapter, out, dry)
    except RunFailed as e:
        first = next((ln for ln in str(e).splitlines()[1:] if ln.strip()), "")
        FAILURES.append(f"{str(e).splitlines()[0].rstrip(':')}{' with --dry-run' if dry else ''}: `{first.strip()}`")
        print(f"FAILED, run again:\n{e}", flush=True)
        return run(ranks, base, adapter, out, dry)


def identical(a: str, b: str) -> tuple[bool, int, list[str]]:
    """Whether folders a and b hold the same files with the same bytes; the file count; the files that differ."""
    files_a = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, fs in os.walk(a) for f in fs)
    files_b = sorted(os.path.relpath(os.path.join(d, f), b) for d, _, fs in os.walk(b) for f in fs)
    differ = sorted(set(files_a) ^ set(files_b))
    differ += [
        f
        for f in files_a
        if f in set(files_b) and not filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False)
    ]
    return not differ, len(files_a), differ


def machine() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM"


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def section(
    base: str,
    walls: dict[int, list[float]],
    dry: dict[int, list[float]],
    same: tuple[bool, int, list[str]],
    repeats: int,
    load: float,
) -> str:
    import torch

    total = sum(os.path.getsize(os.path.join(base, f)) for f in os.listdir(base) if f.endswith(".safetensors"))
    n_in = sum(f.endswith(".safetensors") for f in os.listdir(base))
    one, two = median(walls[1]), median(walls[2])
    ok, files, differ = same
    lines = [
        SECTION,
        "",
        "Produced by `bench/bench_dist.py`:",
        "",
        "    python bench/bench_dist.py"
        + (f" --repeats {repeats}" if repeats != 3 else "")
        + " --write docs/benchmarks.md",
        "",
        "which times, alternating, these two commands on the same inputs (`torchrun` run as",
        "`python -m torch.distributed.run`, with a free `--master_port`), both with `OMP_NUM_THREADS=1` and",
        "`--model-checks first` (the ranks of a job make the model-class checks before the merge; one process alone",
        "would run them beside it by default):",
        "",
        "    python -m peft_shardmerge merge BASE ADAPTER OUT1 --max-shard-size 100MB -q",
        "    torchrun --nproc_per_node 2 -m peft_shardmerge merge BASE ADAPTER OUT2 --max-shard-size 100MB -q",
        "",
        f"Machine: {machine()}, no GPU; Python {platform.python_version()}, torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        textwrap.fill(
            f"The base is a random bf16 Llama (hidden {SIZE['hidden_size']}, "
            f"intermediate {SIZE['intermediate_size']}, "
            f"{SIZE['num_hidden_layers']} layers, vocabulary {SIZE['vocab_size']}, untied; {total / 1e9:.2f} GB in "
            f"{n_in} input shards of at most 200 MB), the adapter a rank-8 LoRA on all seven projections. "
            "Wall time is "
            "the whole command's, from start to exit: starting Python (every rank), importing torch and transformers, "
            f"joining the process group, the merge and the fsyncs; median of {repeats} alternating runs (range in "
            "brackets), each started after `sync` with the inputs in the page cache. "
            f"Load average (1 min) when the timing began: {load:.2f}.",
            width=115,
        ),
    ]
    if dry[1]:
        d1, d2 = median(dry[1]), median(dry[2])
        lines += [
            "",
            "The same commands with `--dry-run` (start-up, imports, joining the process group, planning; no tensor",
            'is read or written) are timed too, alternating with the merges; "merge alone" is the difference of',
            "the medians, and its speed-up the ratio of those differences.",
            "",
            "| processes | wall time (s) | speed-up over 1 | `--dry-run` wall (s) | merge alone (s) | "
            "merge alone: speed-up |",
            "|---|---:|---:|---:|---:|---:|",
            f"| 1 (`python -m peft_shardmerge merge`) | {one:.2f} [{min(walls[1]):.2f}–{max(walls[1]):.2f}] | 1.00 | "
            f"{d1:.2f} [{min(dry[1]):.2f}–{max(dry[1]):.2f}] | {one - d1:.2f} | 1.00 |",
            f"| 2 (`torchrun --nproc_per_node 2`) | {two:.2f} [{min(walls[2]):.2f}–{max(walls[2]):.2f}] | "
            f"{one / two:.2f} | {d2:.2f} [{min(dry[2]):.2f}–{max(dry[2]):.2f}] | {two - d2:.2f} | "
            f"{(one - d1) / (two - d2):.2f} |",
        ]
    else:
        lines += [
            "",
            "| processes | wall time (s) | speed-up over 1 |",
            "|---|---:|---:|",
            f"| 1 (`python -m peft_shardmerge merge`) | {one:.2f} [{min(walls[1]):.2f}–{max(walls[1]):.2f}] | 1.00 |",
            f"| 2 (`torchrun --nproc_per_node 2`) | {two:.2f} [{min(walls[2]):.2f}–{max(walls[2]):.2f}] | "
            f"{one / two:.2f} |",
        ]
    lines += [
        "",
        textwrap.fill(
            f"The two outputs are byte-identical: all {files} files (shards, index, config, side files, "
            "`merge_manifest.json`) compared with `filecmp.cmp(shallow=False)`."
            if ok
            else f"The two outputs DIFFER in: {', '.join(differ)}.",
            width=115,
        ),
    ]
    if FAILURES:
        lines += ["", f"{len(FAILURES)} command(s) exited non-zero and were run again (not timed):", ""]
        lines += [f"- {f}" for f in FAILURES]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each; the median is reported")
    ap.add_argument("--write", help="replace or append the section in this Markdown file")
    ap.add_argument("--no-dry-run", action="store_true", help="skip timing the --dry-run commands")
    ap.add_argument("--keep", action="store_true", help="keep the generated models under bench/_work")
    args = ap.parse_args()
    t0 = time.perf_counter()
    base, adapter = build()
    print(f"inputs ready in {time.perf_counter() - t0:.1f} s", flush=True)
    out = {1: os.path.join(WORK, "dist-out-1"), 2: os.path.join(WORK, "dist-out-2")}
    load = os.getloadavg()[0]
    walls: dict[int, list[float]] = {1: [], 2: []}
    dry: dict[int, list[float]] = {1: [], 2: []}
    for i in range(args.repeats):
        for ranks in (1, 2) if i % 2 == 0 else (2, 1):  # alternating, so load on the machine hits both alike
            w = run_counted(ranks, base, adapter, out[ranks])
            walls[ranks].append(w)
            print(f"{ranks} rank(s): {w:.2f} s", flush=True)
        if not args.no_dry_run:  # the same commands with --dry-run: start-up, imports, joining, planning
            for ranks in (1, 2) if i % 2 == 0 else (2, 1):
                w = run_counted(ranks, base, adapter, out[ranks] + "-dry", dry=True)
                dry[ranks].append(w)
                print(f"{ranks} rank(s), --dry-run: {w:.2f} s", flush=True)
    same = identical(out[1], out[2])
    text = section(base, walls, dry, same, args.repeats, load)
    print(text)
    if args.write:
        write_section(args.write, SECTION, text)
    for o in out.values():
        shutil.rmtree(o, ignore_errors=True)
    if not args.keep:
        for name in ("dist-base", "dist-adapter"):
            shutil.rmtree(os.path.join(WORK, name), ignore_errors=True)
    return 0 if same[0] else 1


if __name__ == "__main__":
    sys.exit(main())
