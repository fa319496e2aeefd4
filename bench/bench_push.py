"""Benchmark: a merge pushed to the Hub as it is made (``peft-shardmerge push``) against what users run today: the
merge to a folder, then huggingface_hub's ``upload_folder``; both against the tests' local Hub (tests/hub_server.py,
the LFS path: preupload, batch, PUT, verify, commit), a fresh one for each run.

Each run is timed end to end (wall seconds: every process started, the commit made) and the bytes the run holds on
the local disk are sampled every 20 ms (the staging folder for the push, the merged folder for the other; the
server's own storage is not counted). The methods run in turn, ``--repeats`` times each; the table gives medians and
the ratios. The bases are bench_merge.py's random bf16 models.

    python bench/bench_push.py --sizes 1B --max-shard-size 500MB --write docs/benchmarks.md

The two side by side, paired, as whole processes: ``farm-bench --vs 'python bench/bench_push.py --one upload' --
python bench/bench_push.py --one push``.
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
sys.path.insert(0, os.path.join(ROOT, "tests"))

from bench_merge import WORK, build, write_section  # noqa: E402
from disk_use import DiskSampler  # noqa: E402
from hub_server import FakeHub  # noqa: E402

SECTION = "## Push to the Hub: while merging against merge then upload"
UPLOAD = (
    "import sys; from huggingface_hub import HfApi; api = HfApi(); "
    "api.create_repo(sys.argv[2], exist_ok=True); "
    "api.upload_folder(repo_id=sys.argv[2], folder_path=sys.argv[1], commit_message='Upload merged model')"
)


def run(method: str, base: str, adapter: str, shard: str) -> tuple[float, int, int]:
    """One run against a fresh local Hub: wall seconds, peak local bytes, files committed."""
    local = os.path.join(WORK, "push-local")
    shutil.rmtree(local, ignore_errors=True)
    os.makedirs(local)
    storage = os.path.join(WORK, "push-hub")
    shutil.rmtree(storage, ignore_errors=True)
    cli = os.path.join(os.path.dirname(sys.executable), "peft-shardmerge")
    with FakeHub(storage) as hub:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": "hf_bench",
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
        if method == "push while merging":
            steps = [[cli, "push", base, adapter, "me/bench", "--staging", local, "--max-shard-size", shard, "-q"]]
        else:
            out = os.path.join(local, "merged")
            steps = [
                [cli, "merge", base, adapter, out, "--max-shard-size", shard, "-q"],
                [sys.executable, "-c", UPLOAD, out, "me/bench"],
            ]
        os.sync()
        t0 = time.perf_counter()
        with DiskSampler(local, interval=0.02) as disk:
            for cmd in steps:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{' '.join(cmd[:3])} failed:\n{done.stderr[-2000:]}")
        wall = time.perf_counter() - t0
        commits = len(hub.commits)
        files = len(hub.files["me/bench"])
    shutil.rmtree(storage, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    if commits != 1:
        raise RuntimeError(f"{method}: {commits} commits")
    return wall, disk.peak, files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1B")
    ap.add_argument("--max-shard-size", default="500MB")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--write", help="put the section into this Markdown file (replacing an earlier one)")
    ap.add_argument("--one", choices=["push", "upload"], help="one run of one method (for farm-bench), then exit")
    args = ap.parse_args()
    if args.one:
        method = "push while merging" if args.one == "push" else "merge, then upload_folder"
        wall, peak, files = run(method, *build(args.sizes.split(",")[0]), args.max_shard_size)
        print(f"{method}: {wall:.1f} s, peak local disk {peak / 1e9:.2f} GB, {files} files")
        return 0
    rows = []
    for size in args.sizes.split(","):
        base, adapter = build(size)
        runs: dict[str, list] = {"push while merging": [], "merge, then upload_folder": []}
        for _ in range(args.repeats):
            for method in runs:
                runs[method].append(run(method, base, adapter, args.max_shard_size))
                wall, peak, files = runs[method][-1]
                print(f"{size} {method}: {wall:.1f} s, peak local disk {peak / 1e9:.2f} GB, {files} files", flush=True)
        rows.append((size, runs))
    table = format_table(rows, args)
    print(table)
    if args.write:
        write_section(args.write, SECTION, table)
    return 0


def format_table(rows, args) -> str:
    lines = [
        SECTION,
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; the Hub is "
        "tests/hub_server.py on 127.0.0.1 (LFS path, objects on the same disk). Command:",
        "",
        f"    python bench/bench_push.py --sizes {args.sizes} --max-shard-size {args.max_shard_size} "
        f"--repeats {args.repeats} --write docs/benchmarks.md",
        "",
        "| model | push while merging (s) | merge, then upload_folder (s) | time ratio (push / other) "
        "| peak local disk, push | peak local disk, other | disk ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, runs in rows:
        ours, other = runs["push while merging"], runs["merge, then upload_folder"]
        wall, owall = statistics.median(r[0] for r in ours), statistics.median(r[0] for r in other)
        disk, odisk = statistics.median(r[1] for r in ours), statistics.median(r[1] for r in other)
        lines.append(
            f"| {size} | {wall:.1f} | {owall:.1f} | {wall / owall:.2f} | {disk / 1e9:.2f} GB | {odisk / 1e9:.2f} GB "
            f"| {disk / odisk:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
