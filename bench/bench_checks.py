"""Benchmark: what the self-check (probe vectors) and the precision report (sampled rounding counts) cost a merge
from disk, measured with them switched off.

One process merges the same base and adapter again and again, with the two on and off in turn (the finite check
stays); each run's time is the merge's own (its report's wall time: streaming, checks, fsyncs; the plan is made before
it, with the model-class checks first). Pairing each run with the next one keeps the ratio meaningful when the
machine's speed drifts; the median of the pairwise ratios is the cost quoted.

    python bench/bench_checks.py --size 0.5B --repeats 20 --workers 2,1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_merge  # noqa: E402 - the benchmark models

CHILD = r"""
import json, os, shutil, sys, torch
import peft_shardmerge
from peft_shardmerge.engine import row_merge
base, adapter, out, repeats, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
on = (row_merge.probe_vectors, row_merge.probe_rows, row_merge.update_counts)
off = (lambda name, columns: None, lambda n, device=None, width=1: torch.empty(0, dtype=torch.long, device=device),
       lambda before, merged, cast: (0, 0))
times = {"on": [], "off": []}
for i in range(repeats + 1):  # the first pair warms up and is not counted
    for mode in ("on", "off"):
        row_merge.probe_vectors, row_merge.probe_rows, row_merge.update_counts = on if mode == "on" else off
        shutil.rmtree(out, ignore_errors=True)
        os.sync()
        report = peft_shardmerge.merge_checkpoint(base, adapter, out, workers=workers, model_checks="first",
                                                  progress=False)
        if i:
            times[mode].append(report.wall_time_s)
shutil.rmtree(out, ignore_errors=True)
print(json.dumps(times))
"""


def measure(base: str, adapter: str, out: str, repeats: int, workers: int, tree: str | None = None) -> dict:
    """The merge's own times with the checks on and off, and the median pairwise ratio (on / off).

    Args:
        base, adapter, out: the models and a scratch output folder.
        repeats: pairs of runs counted.
        workers: ``workers=`` of each merge.
        tree: a source tree to import peft_shardmerge from (default: this one).

    Returns:
        ``{"on": [...], "off": [...], "ratio": median of on_i / off_i, "on_median": ..., "off_median": ...}``.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, base, adapter, out, str(repeats), str(workers)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    times = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        **times,
        "ratio": statistics.median(a / b for a, b in zip(times["on"], times["off"])),
        "on_median": statistics.median(times["on"]),
        "off_median": statistics.median(times["off"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.5B", choices=list(bench_merge.SIZES))
    ap.add_argument("--repeats", type=int, default=20, help="pairs of runs (on, off) counted")
    ap.add_argument("--workers", default="2,1", help="comma-separated workers= values to measure")
    ap.add_argument("--tree", help="import peft_shardmerge from this source tree instead")
    args = ap.parse_args()
    base, adapter = bench_merge.build(args.size)
    out = os.path.join(bench_merge.WORK, "out-checks")
    print(f"{args.size}: {os.cpu_count()} CPUs; {args.repeats} pairs of runs, checks on then off")
    print("| workers | merge itself, checks on (s) | off (s) | on / off, median of the pairwise ratios |")
    print("|---:|---:|---:|---:|")
    for workers in (int(w) for w in args.workers.split(",")):
        r = measure(base, adapter, out, args.repeats, workers, args.tree)
        print(f"| {workers} | {r['on_median']:.2f} | {r['off_median']:.2f} | {r['ratio']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
