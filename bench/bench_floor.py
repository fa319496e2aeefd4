"""Benchmark: the least time a merge from disk can take on this machine, from the cost of each step it cannot skip,
beside a durable copy of the same bytes and the merge itself.

Every step a merge must take is timed alone on one thread over the whole base:

- reading the bytes (``pread`` into one buffer);
- the CRC-32 of the input, which a resumed merge compares;
- the arithmetic on the weights the adapter changes: the engine's own per-tensor step (``RowMerger.merge_rows``, with
  the changes the plan gives each weight): the rows widened to fp32, the LoRA products added, the self-check, the
  finite check and the precision report's counts, the cast back to bf16;
- the SHA-256 of the output, for the merge record;
- writing the output (``pwrite`` into the page cache, in the shard writer's pieces; the ``fsync`` after it, the
  disk's time, apart).

The sum is the CPU time a merge needs; divided by the cores, it is the wall time of a merge whose steps overlap
perfectly and cost nothing more. Where a durable copy takes longer, the copy is the bound instead. Either is a lower
bound: what is left out (the plan, copying the tensors the adapter does not change, the threads' hand-offs) only adds
to it. Each figure is the median of ``--repeats`` runs.

    python bench/bench_floor.py --size 0.5B,1B,8B-2L --repeats 3

It also times the whole command in a fresh process (start-up, the model-class checks beside the merge), and, given
several sizes, how each cost grows with the model (``--size 0.5B,1B,8B``: the whole Llama-8B shape, 16 GB).

With ``--before TREE`` (another checkout of the package, e.g. ``git archive COMMIT | tar -x -C TREE``), the merge
itself is also timed side by side: this checkout and TREE in turn, each merge in a fresh process, and the median of
the pairwise ratios reported, of the wall time and of the CPU seconds (the merge's process, and the whole machine's,
which counts the kernel's writeback threads too); ``--pairs-only`` times only that:

    python bench/bench_floor.py --size 0.5B,1B --repeats 8 --before TREE --pairs-only
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's package
sys.path.insert(0, HERE)

import bench_merge  # noqa: E402 - the benchmark models

PIECE = 8 << 20


def _shards(base: str) -> list[str]:
    """The base's safetensors files."""
    return sorted(os.path.join(base, f) for f in os.listdir(base) if f.endswith(".safetensors"))


def _median(step, repeats: int) -> float:
    """Median of the seconds ``step()`` returns, after ``os.sync()`` before each run."""
    times = []
    for _ in range(repeats):
        os.sync()
        times.append(step())
    return statistics.median(times)


def _pieces(paths: list[str]):
    """Every byte of ``paths``, read with ``pread`` into one buffer, as memoryviews of it."""
    buf = bytearray(PIECE)
    view = memoryview(buf)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size, pos = os.fstat(fd).st_size, 0
            while pos < size:
                n = os.preadv(fd, [view[: min(PIECE, size - pos)]], pos)
                yield view[:n]
                pos += n
        finally:
            os.close(fd)


#: one merge in a fresh process, from the package of the checkout given first (``model_checks="first"``: only the
#: merge is timed); prints the report's wall time, the process's CPU seconds (user + system) and the machine's busy CPU
#: seconds (every core, the kernel's writeback threads included, from /proc/stat) over the executor's run
_MERGE_IN = """
import os, resource, shutil, sys
tree, base, adapter, out = sys.argv[1:]
sys.path.insert(0, tree)
import peft_shardmerge
from peft_shardmerge.api import disk
assert os.path.realpath(peft_shardmerge.__file__).startswith(os.path.realpath(tree)), peft_shardmerge.__file__

def busy():
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks[0:3]) + sum(ticks[5:7])) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq

run, cpu = getattr(disk, "run", None), {"process": float("nan"), "machine": float("nan")}

def timed(*args, **kwargs):
    r0, m0 = resource.getrusage(resource.RUSAGE_SELF), busy()
    try:
        return run(*args, **kwargs)
    finally:
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu["process"] = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        cpu["machine"] = busy() - m0

if run is not None:  # a tree before the one executor: its wall time alone
    disk.run = timed
report = peft_shardmerge.merge_checkpoint(base, adapter, out, model_checks="first", progress=False)
shutil.rmtree(out)
print(report.wall_time_s, cpu["process"], cpu["machine"])
"""


def side_by_side(base: str, adapter: str, scratch: str, before: str, repeats: int) -> dict:
    """The merge itself, this checkout against ``before``, each in a fresh process, in turn (the order swapped every
    pair).

    Args:
        base: the base folder.
        adapter: the adapter folder.
        scratch: where the outputs go (removed after each run).
        before: the other checkout's root.
        repeats: pairs.

    Returns:
        ``{"now": median s, "before": median s, "ratio": median of now / before over the pairs}``, and the same of
        the process's CPU seconds (``"cpu"``) and of the machine's (``"machine"``), each ``{"now", "before",
        "ratio"}``.
    """
    trees = {"now": os.path.dirname(HERE), "before": before}
    runs: dict[str, list[tuple[float, ...]]] = {k: [] for k in trees}
    for i in range(repeats):
        for key in ("now", "before") if i % 2 == 0 else ("before", "now"):
            os.sync()
            out = os.path.join(scratch, f"merged-{key}")
            done = subprocess.run(
                [sys.executable, "-c", _MERGE_IN, trees[key], base, adapter, out],
                capture_output=True,
                text=True,
                check=True,
                cwd=scratch,
            )
            runs[key].append(tuple(float(v) for v in done.stdout.split()[-3:]))

    def compared(k: int) -> dict:
        now, old = [r[k] for r in runs["now"]], [r[k] for r in runs["before"]]
        ratios = [a / b for a, b in zip(now, old)]
        return {"now": statistics.median(now), "before": statistics.median(old), "ratio": statistics.median(ratios)}

    return {**compared(0), "cpu": compared(1), "machine": compared(2)}


def measure(size: str, repeats: int, before: str | None = None) -> dict:
    """Seconds of each step on one thread (its own calls timed, not the reads that feed it), the durable copy and
    the merge itself.

    Args:
        size: a size of ``bench_merge.SIZES``.
        repeats: runs of each step (the median is kept).

    Returns:
        ``{"gb": ..., "steps": {name: seconds}, "fsync": s, "copy": s, "merge": s, "cores": n}``.
    """
    import torch

    from peft_shardmerge import merge_checkpoint, plan_checkpoint_merge
    from peft_shardmerge.checkpoint.reader import CheckpointReader
    from peft_shardmerge.engine.plan import DTYPES, Op
    from peft_shardmerge.output.resume import Crc32
    from peft_shardmerge.output.writer import WRITE_PIECE

    base, adapter = bench_merge.build(size)
    paths = _shards(base)
    nbytes = sum(os.path.getsize(p) for p in paths)
    scratch = os.path.join(bench_merge.WORK, "floor")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    clock = time.perf_counter

    def read():
        t = clock()
        for _ in _pieces(paths):
            pass
        return clock() - t

    def crc():
        spent, h = 0.0, Crc32()
        for piece in _pieces(paths):
            t = clock()
            h.update(piece)
            spent += clock() - t
        return spent

    plan = plan_checkpoint_merge(base, adapter, os.path.join(scratch, "plan"))
    reader = CheckpointReader(plan)  # the merge's own per-tensor step, with the plan's changes of each weight
    merged = [t for t in plan.tensors if t.op is Op.MERGE]

    def maths():
        spent = 0.0
        for t in merged:
            whole = reader.reader.read(t.source)  # read first: the step's time is the merge's alone
            changes = reader.changes(t)
            start = clock()
            for _ in reader.merger.merge_rows(
                t.name, lambda a, b: whole[a:b], changes, t.shape, DTYPES[t.out_dtype][0], torch.device("cpu")
            ):
                pass
            spent += clock() - start
        return spent

    def sha():
        spent, h = 0.0, hashlib.sha256()
        for piece in _pieces(paths):  # as many bytes as the output has
            t = clock()
            h.update(piece)
            spent += clock() - t
        return spent

    def write(sync: bool):
        path = os.path.join(scratch, "out")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        spent, pos = 0.0, 0
        try:
            for piece in _pieces(paths):
                t = clock()
                for at in range(0, len(piece), WRITE_PIECE):  # as the shard writer hands them to the kernel
                    os.pwrite(fd, piece[at : at + WRITE_PIECE], pos + at)
                spent += clock() - t
                pos += len(piece)
            t = clock()
            os.fsync(fd)
            synced = clock() - t
        finally:
            os.close(fd)
            os.remove(path)
        return synced if sync else spent

    def copy():
        t = clock()
        for p in paths:
            dst = os.path.join(scratch, os.path.basename(p))
            shutil.copyfile(p, dst)
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        spent = clock() - t
        for p in paths:
            os.remove(os.path.join(scratch, os.path.basename(p)))
        return spent

    def merge():
        out = os.path.join(scratch, "merged")
        report = merge_checkpoint(base, adapter, out, model_checks="first", progress=False)
        shutil.rmtree(out)
        return report.wall_time_s

    steps = {
        "read (`pread`)": read,
        "input CRC-32 (what a resumed merge compares)": crc,
        "merge arithmetic: widen, LoRA, the checks, cast (the engine's `merge_rows`)": maths,
        "output SHA-256 (the merge record)": sha,
        "write (`pwrite`, into the page cache)": lambda: write(False),
    }
    result = {name: _median(step, repeats) for name, step in steps.items()}
    fsync_s = _median(lambda: write(True), repeats)
    copy_s = _median(copy, repeats)
    torch.set_num_threads(threads)  # the merge as a user runs it
    merge()  # the first call's costs (imports, caches) out of the timing
    merge_s = _median(merge, repeats)
    command_s = _median(lambda: bench_merge.run("cli", base, adapter)["wall_s"], repeats)  # `make bench`'s row
    reader.close()
    pair = side_by_side(base, adapter, scratch, before, repeats) if before else None
    shutil.rmtree(scratch, ignore_errors=True)
    return {
        "gb": nbytes / 1e9,
        "steps": result,
        "fsync": fsync_s,
        "copy": copy_s,
        "merge": merge_s,
        "command": command_s,
        "cores": len(os.sched_getaffinity(0)),
        "before": pair,
        "before_tree": before,
    }


def table(size: str, r: dict) -> str:
    """The result as a markdown table."""
    lines = [
        f"{size} ({r['gb']:.2f} GB, {r['cores']} cores):",
        "",
        "| step (one thread; the arithmetic on the adapter's weights, the rest on every byte) | s | GB/s of base |",
        "|---|---:|---:|",
    ]
    lines += [f"| {k} | {v:.2f} | {r['gb'] / v:.2f} |" for k, v in r["steps"].items()]
    total = sum(r["steps"].values())
    floor = max(total / r["cores"], r["copy"])
    lines += [
        f"| **CPU time a merge needs (the sum)** | {total:.2f} | |",
        f"| fsync of the written file (the disk's time, not the CPU's) | {r['fsync']:.2f} | |",
        f"| durable copy (`shutil.copyfile`, then fsync each) | {r['copy']:.2f} | {r['gb'] / r['copy']:.2f} |",
        f"| **least wall time on {r['cores']} cores**: the sum over the cores (every step overlapped), or the "
        f"durable copy where that is longer | {floor:.2f} | |",
        f"| the merge itself (`merge_checkpoint`, its report's wall time) | {r['merge']:.2f} | "
        f"{r['gb'] / r['merge']:.2f} |",
        f"| the whole command (`python -m peft_shardmerge merge BASE ADAPTER OUT --model-checks auto`, a fresh "
        f"process, start-up and the checks beside included) | {r['command']:.2f} | {r['gb'] / r['command']:.2f} |",
        "",
        f"Least wall time / durable copy: {floor / r['copy']:.2f}; the merge itself / durable copy: "
        f"{r['merge'] / r['copy']:.2f}; the merge itself / least wall time: {r['merge'] / floor:.2f}.",
    ]
    if r.get("before"):
        lines += ["", pairs_line(r["before"], r["before_tree"])]
    return "\n".join(lines)


def pairs_line(b: dict, tree: str) -> str:
    """What :func:`side_by_side` found, as a sentence."""
    return (
        f"The merge itself in a fresh process, side by side with {tree}: {b['now']:.2f} s against "
        f"{b['before']:.2f} s (medians); this checkout / the other: {b['ratio']:.3f} (median of the pairs). "
        f"CPU seconds of its process: {b['cpu']['now']:.2f} against {b['cpu']['before']:.2f} "
        f"({b['cpu']['ratio']:.3f}); of the whole machine: {b['machine']['now']:.2f} against "
        f"{b['machine']['before']:.2f} ({b['machine']['ratio']:.3f})."
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.5B", help="comma-separated sizes of bench_merge.py")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", help="another checkout's root: its merge timed side by side with this one's")
    ap.add_argument("--pairs-only", action="store_true", help="with --before: only the side-by-side merges")
    args = ap.parse_args()
    if args.pairs_only:
        if not args.before:
            ap.error("--pairs-only needs --before TREE")
        for size in args.size.split(","):
            base, adapter = bench_merge.build(size)
            scratch = os.path.join(bench_merge.WORK, "floor")
            shutil.rmtree(scratch, ignore_errors=True)
            os.makedirs(scratch)
            pair = side_by_side(base, adapter, scratch, args.before, args.repeats)
            print(f"{size}: {pairs_line(pair, args.before)}", flush=True)
        return 0
    results = {}
    for size in args.size.split(","):
        results[size] = measure(size, args.repeats, args.before)
        print(table(size, results[size]), flush=True)
        print()
    if len(results) > 1:
        print(growth(results))
    return 0


def growth(results: dict) -> str:
    """How the cost grows with the model: GB/s of the copy, the merge itself and the whole command at each size."""
    lines = [
        "| base | GB | durable copy (s) | GB/s | the merge itself (s) | GB/s | × copy | whole command (s) | GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, r in results.items():
        gb = r["gb"]
        lines.append(
            f"| {size} | {gb:.2f} | {r['copy']:.2f} | {gb / r['copy']:.2f} | {r['merge']:.2f} | {gb / r['merge']:.2f} "
            f"| {r['merge'] / r['copy']:.2f} | {r['command']:.2f} | {gb / r['command']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
