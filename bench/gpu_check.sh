#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md in one call on a machine with a CUDA GPU: the CUDA tests, then the side-by-side
# rows of "8B on a 16-core GPU machine" (bench/bench_gpu.py --scenarios speed).
#
# Such a machine has its own torch and may lack the tested set's transformers, PEFT and bitsandbytes: fetch their
# wheels first, where pip can reach PyPI (into .whl/, which git ignores here):
#
#     bash bench/gpu_check.sh --fetch
#
# then, on the GPU machine, in the repository's root, with .whl/ beside it:
#
#     bash bench/gpu_check.sh [tests|bench|all] [SIZES] [MORE...]   # default: all 8B
#
# MORE goes to bench_gpu.py (e.g. --rows cpu,inprocess,spy-inprocess; --before .before, a tree unpacked there with
# `git archive REV peft_shardmerge bench | tar -x -C .before` and carried beside .whl). What it prints is also written
# under $OUT (default /tmp/gpu-check): machine.txt, cuda-tests.txt, bench.txt, gpu.jsonl (bench_gpu.py's raw lines)
# and, where a spy-... row ran, profiles.tar.gz (py-spy's raw stacks).
set -euo pipefail

# the tested set's packages (requirements/constraints.txt) that the GPU machines' image lacks or holds in another
# version, and py-spy for the profiles; its huggingface_hub, tokenizers, safetensors and accelerate satisfy these
# (and the wheels, 58 MB, fit the 64 MiB a call may carry beside the repository)
PINNED="transformers peft bitsandbytes zlib-ng py-spy"

if [ "${1:-}" = "--fetch" ]; then
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >>"$exclude"
    specs=""
    for p in $PINNED; do
        if ! spec=$(grep -i "^$p==" requirements/constraints.txt); then
            echo "$p is not pinned in requirements/constraints.txt" >&2
            exit 2
        fi
        specs="$specs $spec"
    done
    # shellcheck disable=SC2086 # one argument per requirement
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl $specs
    ls .whl
    exit 0
fi

what=${1:-all}
sizes=${2:-8B}
shift $(($# < 2 ? $# : 2))
case "$what" in
    tests | bench | all) ;;
    *) echo "usage: bash bench/gpu_check.sh [--fetch | tests | bench | all] [SIZES] [MORE...]" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
    export PYTHONPATH=$PWD
fi
# bytecode compiled ahead, as a normal install does (else the first import compiles it: seconds on the clock)
python3 -m compileall -q -j 0 /tmp/site peft_shardmerge bench tests >/dev/null 2>&1 || true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
    echo "$(nproc) CPUs, $(free -g | awk '/Mem:/ {print $2}') GiB RAM; /tmp: $(df -h /tmp | awk 'NR == 2 {print $4}') free"
    python3 -c "import sys, torch, transformers, peft, bitsandbytes; print(sys.version.split()[0], torch.__version__,
'transformers', transformers.__version__, 'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__,
'cuda', torch.cuda.is_available())" || echo "the tested set does not import: fetch its wheels (--fetch) and carry .whl"
    git log -1 --format="commit %h %s" 2>/dev/null || true
} 2>&1 | tee "$OUT/machine.txt"

tests=0
if [ "$what" = "tests" ] || [ "$what" = "all" ]; then
    set +e # a failed test is reported, and the benchmark still runs
    python3 -m pytest -q -p no:cacheprovider -m cuda -rs \
        tests/integration/test_cuda.py tests/unit/engine/test_execute.py tests/integration/test_inprocess.py \
        tests/unit/engine/test_host_slabs.py \
        2>&1 | tee "$OUT/cuda-tests.txt"
    tests=${PIPESTATUS[0]}
    set -e
    echo "pytest exit status: $tests" | tee -a "$OUT/cuda-tests.txt"
fi
if [ "$what" = "bench" ] || [ "$what" = "all" ]; then
    rm -rf /tmp/gpu-profiles # the spy rows' raw stacks of this run only
    python3 bench/bench_gpu.py --sizes "$sizes" --scenarios speed --work /tmp/gpu-bench --json "$OUT/gpu.jsonl" \
        "$@" 2>&1 | tee "$OUT/bench.txt"
    if [ -n "$(ls -A /tmp/gpu-profiles 2>/dev/null)" ]; then
        tar -czf "$OUT/profiles.tar.gz" -C /tmp gpu-profiles
    fi
fi
exit "$tests"
