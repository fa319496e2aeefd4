"""Benchmark: the least time a merge from disk can take on this machine, from the cost of each step it cannot skip,
beside a durable copy of the same bytes and the merge itself.

Every step a merge must take is timed alone on one thread over the whole base:

- reading the bytes (``pread`` into one buffer);
- the CRC-32 of the input, which a resumed merge compares;
- the arithmetic on the weights the adapter changes: the engine's own per-tensor step (``RowMerger.merge_rows``, with
  the changes the plan gives each weight): the rows widened to fp32, the LoRA products added, the self-check, the
  finite check and the precision report's counts, the cast back to bf16;
- the SHA-256 of the output, for the merge record;
- writing the output (``pwrite`` into the page cache; the ``fsync`` after it, the disk's time, apart).

The sum is the CPU time a merge needs; divided by the cores, it is the wall time of a merge whose steps overlap
perfectly and cost nothing more. Where a durable copy takes longer, the copy is the bound instead. Either is a lower
bound: what is left out (the plan, copying the tensors the adapter does not change, the threads' hand-offs) only adds
to it. Each figure is the median of ``--repeats`` runs.

    python bench/bench_floor.py --size 0.5B,1B,8B-2L --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
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


def measure(size: str, repeats: int) -> dict:
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
    merger = CheckpointReader(plan)  # the merge's own per-tensor step, with the plan's changes of each weight
    merged = [t for t in plan.tensors if t.op is Op.MERGE]

    def maths():
        spent = 0.0
        for t in merged:
            whole = merger.reader.read(t.source)  # read first: the step's time is the merge's alone
            changes = merger.changes(t)
            start = clock()
            for _ in merger.merge_rows(
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
                os.pwrite(fd, piece, pos)
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
    merger.close()
    shutil.rmtree(scratch, ignore_errors=True)
    return {
        "gb": nbytes / 1e9,
        "steps": result,
        "fsync": fsync_s,
        "copy": copy_s,
        "merge": merge_s,
        "cores": len(os.sched_getaffinity(0)),
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
        "",
        f"Least wall time / durable copy: {floor / r['copy']:.2f}; the merge itself / durable copy: "
        f"{r['merge'] / r['copy']:.2f}; the merge itself / least wall time: {r['merge'] / floor:.2f}.",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.5B", help="comma-separated sizes of bench_merge.py")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for size in args.size.split(","):
        print(table(size, measure(size, args.repeats)), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
