#!/usr/bin/env bash
# GPU machine wrapper for bench/gpu_suite.py, run from the repository root:
#   bash bench/gpu_suite.sh [gpu_suite.py options]
# The wheels the image lacks are installed first (bench/gpu_env.sh says which and how to carry them).
# Then the kernel tests run on the GPU (their cuda parameters; --confcutdir keeps out the root
# conftest, whose broker fixtures need packages that image lacks), then the suite.
set -u
source bench/gpu_env.sh
out_dir=${OUT:-out}
mkdir -p "$out_dir"
timeout 180 python3 -m pytest tests/kernels --confcutdir=tests/kernels -q -p no:cacheprovider -k "cuda" \
    >"$out_dir/pytest_kernels_cuda.log" 2>&1
echo "pytest tests/kernels (cuda params): rc=$? (log: $out_dir/pytest_kernels_cuda.log)"
tail -n 3 "$out_dir/pytest_kernels_cuda.log"
exec python3 bench/gpu_suite.py "$@"
