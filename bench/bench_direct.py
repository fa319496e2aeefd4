"""Benchmark: a shard's tensors written past the page cache (``O_DIRECT``, the default on ext4 and XFS) against
through it (``PEFT_SHARDMERGE_DIRECT_IO=0``), side by side, in the two states a machine's memory can be in when a
merge writes:

- **memory full**: no free memory (it is held by this process, as by a training run's host memory); every new page
  of the page cache is taken from the clean cache, as on a busy machine;
- **memory free**: gigabytes free for a few seconds (as after a large process exits); on a virtual machine whose
  balloon reports free memory to its host (``virtio_balloon`` free page reporting), each such page costs a trip to
  the host when first written again.

For each state and size, pairs of runs, each in a fresh process, the order swapped every pair:

- the merge itself (``merge_checkpoint``, model-class checks first, its report's wall time), past the page cache
  (``PEFT_SHARDMERGE_DIRECT_IO=1``), through it (``0``) and as by default (``auto``);
- a durable write of as many bytes (one 1 MiB buffer written again and again, then ``fsync``): ``O_DIRECT`` and
  through the page cache: the disk's own pace, and what filling the page cache costs.

    python bench/bench_direct.py --size 0.5B,1B --repeats 4
    python bench/bench_direct.py --size 8B --states free --repeats 3   # the base and the output larger than memory

The table is printed (Markdown); the state is set before every run.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_floor  # noqa: E402 - the merge run in a fresh process
import bench_merge  # noqa: E402 - the benchmark models

from peft_shardmerge.output.direct import free_memory  # noqa: E402 - this checkout's

CHUNK = 256 << 20
RESERVE = 768 << 20  # left free in the "memory full" state: the merge's own working set
SETTLE_S = 5.0  # the wait in the "memory free" state (Linux reports free pages to the host after 2 s)

_WRITE = """
import mmap, os, sys, time
path, nbytes, direct = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
buf = mmap.mmap(-1, 1 << 20); buf.write(os.urandom(1 << 20)); view = memoryview(buf)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o644)
t = time.perf_counter()
for pos in range(0, nbytes, 1 << 20):
    os.pwrite(fd, view, pos)
os.fsync(fd)
print(time.perf_counter() - t)
os.close(fd); os.unlink(path)
"""


class Memory:
    """The state of the machine's memory before each run: held (``full``) or given back and left to settle."""

    def __init__(self) -> None:
        self.held: list[mmap.mmap] = []

    def full(self) -> None:
        """Hold free memory until only :data:`RESERVE` is left (touched, so it is really taken)."""
        while free_memory() > RESERVE + CHUNK:
            m = mmap.mmap(-1, CHUNK)
            m.write(b"\1" * CHUNK)
            self.held.append(m)

    def free(self) -> None:
        """Give back what is held (if any), and wait :data:`SETTLE_S`."""
        for m in self.held:
            m.close()
        self.held.clear()
        time.sleep(SETTLE_S)


def _merge(base: str, adapter: str, out: str, setting: str) -> float:
    env = dict(os.environ, PEFT_SHARDMERGE_DIRECT_IO=setting)
    tree = os.path.dirname(HERE)
    done = subprocess.run(
        [sys.executable, "-c", bench_floor._MERGE_IN, tree, base, adapter, out],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return float(done.stdout.split()[-1])


def _write(path: str, nbytes: int, setting: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _WRITE, path, str(nbytes), setting],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout.split()[-1])


#: each pair's runs: (kind, PEFT_SHARDMERGE_DIRECT_IO): past the page cache, through it, and (the merge) the default
RUNS = (("merge", "1"), ("merge", "0"), ("merge", "auto"), ("write", "1"), ("write", "0"))


def measure(size: str, state: str, repeats: int, scratch: str, memory: Memory) -> dict:
    """Median seconds of each run, and the median ratio of each to the run through the page cache over the pairs."""
    base, adapter = bench_merge.build(size)
    nbytes = sum(os.path.getsize(p) for p in bench_floor._shards(base))
    nbytes -= nbytes % (1 << 20)
    times: dict[tuple[str, str], list[float]] = {run: [] for run in RUNS}
    for i in range(repeats):
        for kind, setting in RUNS if i % 2 == 0 else RUNS[::-1]:
            os.sync()
            memory.full() if state == "full" else memory.free()
            if kind == "merge":
                seconds = _merge(base, adapter, os.path.join(scratch, "merged"), setting)
            else:
                seconds = _write(os.path.join(scratch, "written"), nbytes, setting)
            times[(kind, setting)].append(seconds)
    out = {"GB": nbytes / 1e9}
    for kind, setting in RUNS:
        mine, through = times[(kind, setting)], times[(kind, "0")]
        out[(kind, setting)] = (statistics.median(mine), statistics.median(a / b for a, b in zip(mine, through)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.5B,1B", help="comma-separated sizes of bench_merge.py")
    ap.add_argument("--repeats", type=int, default=4, help="pairs per size, state and run kind")
    ap.add_argument("--states", default="full,free", help="the memory states measured (full, free)")
    ap.add_argument("--scratch", default=os.path.join(HERE, "_work", "direct"), help="where outputs go (removed)")
    args = ap.parse_args()
    os.makedirs(args.scratch, exist_ok=True)
    memory = Memory()
    rows = []
    labels = {
        ("merge", "1"): "the merge itself, past the page cache",
        ("merge", "0"): "the merge itself, through it",
        ("merge", "auto"): "the merge itself, the default (`auto`)",
        ("write", "1"): "durable write, one buffer, past the page cache (`O_DIRECT`)",
        ("write", "0"): "durable write, one buffer, through it",
    }
    try:
        for size in args.size.split(","):
            for state in args.states.split(","):
                r = measure(size, state, args.repeats, args.scratch, memory)
                for run in RUNS:
                    seconds, ratio = r[run]
                    where = f"{size} ({r['GB']:.2f} GB) | memory {state}"
                    rows.append(f"| {where} | {labels[run]} | {seconds:.2f} | {ratio:.3f} |")
                    print(rows[-1], flush=True)
    finally:
        memory.free()
        shutil.rmtree(args.scratch, ignore_errors=True)
    print(f"\n{os.cpu_count()} cores, {args.repeats} pairs each:\n")
    print("| base | state | run | s (median) | / through the page cache (median of pairs) |")
    print("|---|---|---|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
