"""Benchmark two source trees of peft-shardmerge side by side: the disk merge and the in-process 4-bit merge.

Uses bench_merge.py's models and its measuring subprocess; each run imports the package from the tree named
on the command line (PYTHONPATH), and the runs of the two trees are interleaved so that load on the machine
hits both alike. Prints a Markdown table of medians and the ratio new / old.

    git worktree add /tmp/old <revision>
    python bench/bench_compare.py --old /tmp/old --new . --sizes 0.5B,1B --repeats 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_merge  # the models and the measuring subprocess


def imported_from(tree: str) -> str:
    """The folder ``import peft_shardmerge`` resolves to with ``tree`` first on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [sys.executable, "-c", "import peft_shardmerge, os; print(os.path.dirname(peft_shardmerge.__file__))"],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        check=True,
    )
    return out.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the source tree to compare against (a git worktree)")
    ap.add_argument("--new", default=".", help="the source tree measured (default: this one)")
    ap.add_argument("--sizes", default="0.5B,1B")
    ap.add_argument("--inprocess-sizes", default="0.5B")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    for tag, tree in trees.items():
        got = imported_from(tree)
        if not got.startswith(tree):
            raise SystemExit(f"{tag}: peft_shardmerge is imported from {got}, not from {tree}")
    jobs = [(s, "peft_shardmerge") for s in args.sizes.split(",") if s] + [
        (s, "merge_and_save_4bit") for s in args.inprocess_sizes.split(",") if s
    ]
    lines = [
        "| base | method | old: wall (s) | new: wall (s) | new / old | old: peak RSS (MiB) | new: peak RSS (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for size, method in jobs:
        base, adapter = bench_merge.build(size)
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(args.repeats):
            for tag, tree in trees.items():
                os.environ["PYTHONPATH"] = tree
                r = bench_merge.run(method, base, adapter)
                runs[tag].append(r)
                print(
                    f"{size} {method} {tag}: {r['wall_s']:.2f} s, +{(r['peak_rss'] - r['baseline_rss']) / 2**20:.0f}"
                    " MiB",
                    flush=True,
                )
        old, new = bench_merge.summarize(runs["old"]), bench_merge.summarize(runs["new"])
        lines.append(
            f"| {size} | {method} | {old['wall_s']:.2f} [{old['wall_min']:.2f}–{old['wall_max']:.2f}] | "
            f"{new['wall_s']:.2f} [{new['wall_min']:.2f}–{new['wall_max']:.2f}] | "
            f"{new['wall_s'] / old['wall_s']:.2f} | {old['rss_over'] / 2**20:.0f} | "
            f"{new['rss_over'] / 2**20:.0f} |"
        )
    os.environ.pop("PYTHONPATH", None)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
